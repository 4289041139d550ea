"""FSDP through accelerate (2 gloo processes on CPU) for your own loop, the launchers causal_adapter.training.loop refuses,
1-element scalars (and adapters saved with 0-d ones), placement on several devices."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from causal_adapter import CausalAdapterConfig, CausalModel, get_causal_model
from causal_adapter.saving.artifacts import WEIGHTS_NAME, write_adapter_files
from conftest import adapter_tensors, assert_same_tensors, small_vocab_qwen

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "examples" / "accelerate_configs"


def run_fsdp_wrap(config: Path, dtype: str, out: Path) -> dict:
    """tests/fsdp_wrap_worker.py's check: `accelerate launch --config_file <config>` (its CPU copy) of 2 workers
    that prepare, train 4 steps and save the adapter, then its verdict on their files; the rank-0 result."""
    ok, why = _fsdp_wrap().check(config, dtype, out)
    assert ok, why
    return json.loads((out / "result.json").read_text())


def check_replicas_and_reload(out: Path, dtype: torch.dtype) -> None:
    a, b = (load_file(str(out / f"full_rank{r}.safetensors")) for r in (0, 1))
    assert_same_tensors(a, b)  # the replicas agree
    fresh = get_causal_model(_fsdp_base(dtype), CausalAdapterConfig(num_token_id=300))
    moved = [k for k, v in adapter_tensors(fresh).items() if not torch.equal(v, a[k])]
    assert {"abduction.loc.weight", "action.b_cls", "action.b_reg"} <= set(moved), moved  # trained
    loaded = CausalModel.from_pretrained(_fsdp_base(dtype), out / "adapter")
    assert_same_tensors(adapter_tensors(loaded), a)
    assert sorted(p.name for p in (out / "adapter").iterdir()) == ["causal_adapter_config.json", WEIGHTS_NAME]


def _fsdp_wrap():
    import fsdp_wrap_worker

    return fsdp_wrap_worker


def _fsdp_base(dtype):
    return _fsdp_wrap().tiny_base(dtype)


@pytest.mark.slow  # ~25-50 s: two interpreters importing transformers
def test_fsdp1_accelerate_wrap_of_fsdp_yaml_bf16_base_fp32_heads(tmp_path):
    """accelerate's own FullyShardedDataParallel(model, use_orig_params=True, auto_wrap_policy=...,
    ignored_modules=...) for fsdp.yaml, a bf16 base (one FSDP1 unit could not hold it with fp32 heads)."""
    res = run_fsdp_wrap(CONFIGS / "fsdp.yaml", "bfloat16", tmp_path)
    assert res["wrapper"] == "FullyShardedDataParallel" and res["fsdp_version"] == 1
    assert res["base_dtype"] == "torch.bfloat16" and res["head_dtype"] == "torch.float32"
    assert res["values_dtype"] == [res["batch_values_dtype"]]  # not cast to bf16 by FSDP's mixed precision
    check_replicas_and_reload(tmp_path, torch.bfloat16)


@pytest.mark.slow
def test_fsdp2_accelerate_wrap_of_fsdp2_yaml(tmp_path):
    res = run_fsdp_wrap(CONFIGS / "fsdp2.yaml", "bfloat16", tmp_path)
    assert res["wrapper"].startswith("FSDP") and res["fsdp_version"] == 2
    assert res["values_dtype"] == [res["batch_values_dtype"]] and res["head_dtype"] == "torch.float32"
    check_replicas_and_reload(tmp_path, torch.bfloat16)


def test_finish_fsdp_wrap_refuses_heads_managed_by_fsdp():
    """Without fsdp_ignored_modules the heads are flattened into FSDP's root unit: refused, naming the setting."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from causal_adapter.saving.fsdp import FSDP_IGNORED_MODULES, finish_fsdp_wrap

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    try:
        model = FSDP(get_causal_model(small_vocab_qwen(), CausalAdapterConfig(num_token_id=300)), use_orig_params=True,
                     device_id=torch.device("cpu"))
        with pytest.raises(ValueError, match="fsdp_ignored_modules.*" + FSDP_IGNORED_MODULES.replace("|", r"\|")):
            finish_fsdp_wrap(model)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("kind", ["DEEPSPEED", "FSDP1"])
def test_train_refuses_deepspeed_zero1_and_fsdp1_without_orig_params_at_start_naming_the_launchers(tmp_path, kind):
    """A real Accelerator whose state says what a DeepSpeed ZeRO-1 / FSDP1 (use_orig_params off) launch sets
    (accelerate selects FSDP on an accelerator only; the plugin needs no deepspeed). FSDP1 with use_orig_params,
    FSDP2 and ZeRO-2/3 run (tests/test_fsdp_train.py, tests/test_deepspeed_train.py)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DeepSpeedPlugin, DistributedType, FullyShardedDataParallelPlugin

    from causal_adapter.training.engines import check_engine

    AcceleratorState._reset_state(True)
    try:
        accelerator = Accelerator(cpu=True)
        if kind == "FSDP1":
            accelerator.state.distributed_type = DistributedType.FSDP
            accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin(fsdp_version=1)
            assert not accelerator.state.fsdp_plugin.use_orig_params
            check_engine_error = r"FSDP1 with fsdp_use_orig_params: true only.*fsdp_version: 2"
        else:
            accelerator.state.distributed_type = DistributedType.DEEPSPEED
            accelerator.state.deepspeed_plugins = DeepSpeedPlugin(zero_stage=1)
            check_engine_error = r"runs DeepSpeed ZeRO-2 and ZeRO-3 only.*got 1"
        with pytest.raises(ValueError, match=check_engine_error + r".*multi_gpu_ddp.yaml.*cpu_ddp.yaml.*fsdp2.yaml"
                                             r".*fsdp.yaml.*deepspeed_zero2.yaml, deepspeed_zero3.yaml"):
            check_engine(accelerator)
    finally:
        AcceleratorState._reset_state(True)


def test_process_group_backend_is_a_launcher_setting_gloo_for_deepspeed_without_a_gpu(monkeypatch):
    """Without a backend accelerate records ONE process for a DeepSpeed launch on CPUs (docs/distributed.md):
    train() asks for gloo there, takes --ddp-backend when given, and leaves every other launch to accelerate."""
    from causal_adapter.training.config import TrainConfig
    from causal_adapter.training.engines import process_group_backend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    assert process_group_backend(TrainConfig(), world=2) == "gloo"
    assert process_group_backend(TrainConfig(ddp_backend="mpi"), world=2) == "mpi"
    assert process_group_backend(TrainConfig(), world=1) is None
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "false")
    assert process_group_backend(TrainConfig(), world=2) is None  # DDP / FSDP: accelerate's choice


# ============================================================================ 1-element scalars
def test_scalar_parameters_are_one_element_and_broadcast_as_scalars():
    model = get_causal_model(small_vocab_qwen(), CausalAdapterConfig(num_token_id=300, learnable_threshold=True))
    zero_d = [n for n, t in {**dict(model.named_parameters()), **dict(model.named_buffers())}.items() if t.dim() == 0]
    assert zero_d == []  # FSDP refuses 0-d parameters
    act = model.action
    assert act.b_reg.shape == act.b_noise_Y.shape == act.thresholds.shape == (1,)
    C = act.w_reg.shape[0]
    u = torch.randn(C)
    loc_Y, scale_Y = act.regression(u, torch.rand(C))
    assert loc_Y.shape == scale_Y.shape == ()  # a single individual: scalars, as with 0-d b_reg / b_noise_Y
    s = act.decision_scores(torch.randn(3, C), model.W_cls)
    assert s.shape == (3, model.vocab_size) and act.num_threshold().shape == ()


def test_adapter_saved_with_0d_scalars_still_loads(tmp_path):
    """A real safetensors file in the old layout (b_reg, b_noise_Y, a scalar threshold 0-d) loads, same outputs."""
    cfg = CausalAdapterConfig(num_token_id=300, learnable_threshold=True)
    model = get_causal_model(small_vocab_qwen(), cfg)
    with torch.no_grad():
        model.action.b_reg.fill_(0.75)
        model.action.b_noise_Y.fill_(2.5)
        model.action.thresholds.fill_(-0.5)
    model.save_pretrained(tmp_path)
    tensors = load_file(str(tmp_path / WEIGHTS_NAME))
    old = {k: v.reshape(()) if k in ("action.b_reg", "action.b_noise_Y", "action.thresholds") else v
           for k, v in tensors.items()}
    assert all(old[k].dim() == 0 for k in ("action.b_reg", "action.b_noise_Y", "action.thresholds"))
    write_adapter_files(tmp_path, model.adapter_metadata(), old)  # the writer of the old versions (sha256 too)
    assert load_file(str(tmp_path / WEIGHTS_NAME))["action.b_reg"].dim() == 0
    loaded = CausalModel.from_pretrained(small_vocab_qwen(), tmp_path)
    assert_same_tensors(adapter_tensors(loaded), adapter_tensors(model))
    ids = torch.tensor([[1, 2, 300, 4]])
    vals = torch.tensor([[0.0, 0.0, 3.5, 0.0]])
    a, b = (m(ids, vals, return_scores=True) for m in (model.eval(), loaded))
    for k in ("loc_Y", "scale_Y", "loc_S", "scale_S"):
        assert torch.equal(a[k], b[k]), k


# ============================================================================ several devices
def split_model(head_device: str):
    """Embedding and body on the CPU, an untied lm_head (hence the heads, which sit with W_cls) on
    `head_device`: the placement of `from_pretrained(..., device_map=...)` across two devices."""
    base = small_vocab_qwen(tie_word_embeddings=False)
    base.lm_head.to(head_device)
    return get_causal_model(base, CausalAdapterConfig(num_token_id=300, fused_loss=False))


def test_split_placement_inputs_go_to_the_embedding_not_to_lm_head():
    """Shapes only (lm_head on the meta device): what can be checked without a second device. Before,
    generate put prompts on model.device (lm_head's) and check_inputs refused them."""
    from causal_adapter.modeling.generation.prepare import resolve_inputs

    model = split_model("meta")
    assert model.input_device == torch.device("cpu") and model.device.type == "meta"
    assert model.action.b_cls.device.type == model.abduction.loc.weight.device.type == "meta"
    ids, vals, mask = resolve_inputs(model, None, [[1, 2, 300, 4]], [[0.0, 0.0, 3.5, 0.0]], None, None)
    assert ids.device == vals.device == mask.device == torch.device("cpu")
    model.check_inputs(ids, vals, ids, vals, mask)  # raised before: the prompts were on lm_head's device
    with pytest.raises(ValueError, match="input_ids is on device meta but the model's embedding is on cpu"):
        model.check_inputs(ids.to("meta"), None, None, None)


def _two_gpus():
    return torch.cuda.is_available() and torch.cuda.device_count() >= 2


@pytest.mark.skipif(not _two_gpus(), reason="needs two accelerators (unverified here: docs/distributed.md)")
def test_split_over_two_gpus_forward_loss_generate_save_load(tmp_path):
    """Body on cuda:0, lm_head + heads on cuda:1: the same loss, gradients and generation as on one device."""
    torch.manual_seed(0)
    one = get_causal_model(small_vocab_qwen(tie_word_embeddings=False).to("cuda:0"),
                           CausalAdapterConfig(num_token_id=300))
    base = small_vocab_qwen(tie_word_embeddings=False)
    base.model.to("cuda:0")
    base.lm_head.to("cuda:1")
    two = get_causal_model(base, CausalAdapterConfig(num_token_id=300))  # the heads join lm_head
    assert two.input_device == torch.device("cuda:0") and two.device == torch.device("cuda:1")
    ids = torch.tensor([[1, 2, 300, 4, 5, 300, 7]], device="cuda:0")
    vals = torch.tensor([[0.0, 0.0, 3.5, 0.0, 0.0, -2.0, 0.0]], device="cuda:0")
    a, b = one(ids, vals, labels=ids), two(ids, vals, labels=ids)
    torch.testing.assert_close(a.loss, b.loss.to("cuda:0"))
    a.loss.backward()
    b.loss.backward()
    torch.testing.assert_close(one.abduction.loc.weight.grad, two.abduction.loc.weight.grad.to("cuda:0"))
    ga = one.generate(input_ids=ids, numeric_values=vals, max_new_tokens=4, mode="causal", seed=0)
    gb = two.generate(input_ids=ids, numeric_values=vals, max_new_tokens=4, mode="causal", seed=0)
    assert torch.equal(ga.sequences.cpu(), gb.sequences.cpu())
    two.save_pretrained(tmp_path)
    base = small_vocab_qwen(tie_word_embeddings=False)
    base.model.to("cuda:0")
    base.lm_head.to("cuda:1")
    loaded = CausalModel.from_pretrained(base, tmp_path)
    assert loaded.device == torch.device("cuda:1")
    assert_same_tensors(adapter_tensors(loaded), adapter_tensors(two))


GLOO_EXIT_SCRIPT = r'''
import atexit, os, sys, torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from causal_adapter.saving.process_groups import keep_gloo_groups_to_process_end
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
group = dist.group.WORLD
atexit.register(lambda: print("references at exit:", sys.getrefcount(group), flush=True))
if sys.argv[1] == "keep":
    keep_gloo_groups_to_process_end()  # its own atexit hook runs before the one above (last in, first out)
model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
fully_shard(model[0]); fully_shard(model)
model(torch.randn(3, 4)).sum().backward()
del model
dist.destroy_process_group()
threads = sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))
print("gloo threads after destroy_process_group:", [t for t in threads if "gloo" in t], flush=True)
'''


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads thread names from /proc")
def test_gloo_groups_torch_still_holds_are_never_destroyed_during_interpreter_exit(tmp_path):
    """docs/distributed.md, "Exit": under FSDP2 torch keeps the gloo group referenced after destroy_process_group (its threads run
    on), so its C++ destructor ran during interpreter exit, where a worker now and then aborted ("terminate
    called without an active exception"). `keep_gloo_groups_to_process_end` (train() and CausalTrainer call it)
    takes, at exit, a reference that is never given back: no destructor, no teardown to race."""
    script = tmp_path / "gloo_exit.py"
    script.write_text(GLOO_EXIT_SCRIPT)
    outs = {}
    for mode in ("keep", "plain"):
        proc = subprocess.run([sys.executable, str(script), mode], capture_output=True, text=True, timeout=240,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert proc.returncode == 0, proc.stderr[-3000:]
        outs[mode] = proc.stdout
    # what makes the fix necessary: destroy_process_group leaves the group's threads running under FSDP2
    assert "pt_gloo_runloop" in outs["plain"] and "gloo_tcp_loop" in outs["plain"], outs["plain"]
    refs = {mode: int(re.search(r"references at exit: (\d+)", out).group(1)) for mode, out in outs.items()}
    # two references more: the run's record (dropped when the interpreter clears its modules) and the one taken
    # at exit and never given back
    assert refs["keep"] == refs["plain"] + 2, outs


def test_exit_without_teardown_flushes_and_ends_with_the_code_skipping_atexit(tmp_path):
    """The end of a multi-process script whose exit status matters (docs/distributed.md, "Exit"): what was printed
    reaches the pipe (unterminated lines too), the code is the process's status, and nothing of the teardown runs
    (an atexit handler is the Python-visible part of it)."""
    script = tmp_path / "exit_now.py"
    script.write_text("import atexit, sys\n"
                      "from causal_adapter.saving.process_groups import exit_without_teardown\n"
                      "atexit.register(lambda: print('TEARDOWN RAN', flush=True))\n"
                      "print('out, no newline', end='')\nsys.stderr.write('err, no newline')\n"
                      "exit_without_teardown(3)\nprint('after')\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # pipes block-buffered
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60,
                          env={**env, "PYTHONPATH": str(REPO)})
    assert (proc.returncode, proc.stdout, proc.stderr) == (3, "out, no newline", "err, no newline")


CLI_EXIT_SCRIPT = r'''
import atexit, sys, torch.distributed as dist
if sys.argv[1] == "gloo":  # the group `accelerate launch` would have made (1 process here)
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
atexit.register(lambda: print("TEARDOWN RAN", flush=True))
sys.argv = ["causal-adapter", *sys.argv[2:]]
from causal_adapter.commands.main import run_and_exit
run_and_exit()
'''


def test_cli_ends_without_teardown_only_after_a_run_that_kept_a_gloo_group(tmp_path):
    """The `causal-adapter` command (console script, python -m) after `train` under a gloo group: its status, its
    printed summary and its files, and no interpreter teardown (whose static destructors now and then raced the
    kept group's threads: SIGABRT after the work, CI's 2-process launches). Any other run exits as usual."""
    script = tmp_path / "cli_exit.py"
    script.write_text(CLI_EXIT_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, str(script), "gloo", "train", "--output-dir", str(out),
                           "--tiny-hidden-size", "32", "--tiny-layers", "1", "--max-steps", "1",
                           "--per-device-train-batch-size", "2", "--max-eval-samples", "2", "--no-plot",
                           "--no-progress"], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "steps: 1" in proc.stdout and "TEARDOWN RAN" not in proc.stdout, proc.stdout
    assert (out / "adapter" / WEIGHTS_NAME).is_file()
    # no gloo group: an ordinary exit, with the command's own status (a user error here)
    proc = subprocess.run([sys.executable, str(script), "plain", "eval", "--adapter", str(tmp_path / "missing")],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 1 and "TEARDOWN RAN" in proc.stdout, (proc.stdout, proc.stderr)
