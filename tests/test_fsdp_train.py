"""The product's training (`causal_adapter.training.loop.train`) under FSDP1 and FSDP2: 2 gloo processes on
CPU through `accelerate launch` of examples/accelerate_configs/fsdp.yaml / fsdp2.yaml (their CPU copies), the
accelerate state set as an FSDP launch on GPUs sets it (tests/fsdp_train_worker.py). Checked per version:
no refusal and finite losses; a run SIGKILLed after its step-2 checkpoint and resumed ends bit-identical to
the uninterrupted run; the final directory is adapter-only (a single process's files) and reloads onto a
fresh base; 2 processes with per-device batch 2 match 1 process with batch 4 (the loss curve and the
adapter); LoRA in fp32 on a bf16 base saves and reloads bit for bit; `CausalTrainer` saves the adapter only
and resumes from its own checkpoint bit for bit. One launch + one resume launch per version for all of it
(~40 s each here)."""
from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "fsdp_train_worker.py"
sys.path.insert(0, str(REPO / "tests"))
import fsdp_train_worker as worker  # noqa: E402  (the runs' model, data and settings)

# 2 processes x batch 2 against 1 x batch 4: the same rows in every micro-batch, the sums taken in another
# order (per-process means, then the mean of them), fp32. Measured: the adapters differ by <= 1e-6
# relative; a head gradient summed instead of averaged over the processes moves them by ~1e-2.
RTOL, ATOL = 1e-4, 1e-6
# adapters after the runs: 2 ranks vs 1 sum in another order, and 8 SGD-like steps at lr 0.5 carry that
# float32 noise to up to 1.3e-4 of a tensor's largest entry (measured: lora_B, w_reg, abduction.loc.bias);
# a doubled head gradient moves them by the order of the tensor itself
ADAPTER_SCALE_RTOL = 1e-3


CONFIGS = {1: "fsdp.yaml", 2: "fsdp2.yaml"}  # fsdp_version -> the shipped accelerate config


def cpu_config(out: Path, version: int) -> Path:
    """The shipped config of `version` with what needs a GPU off and fp32 (mixed_precision: no)."""
    text = (REPO / "examples/accelerate_configs" / CONFIGS[version]).read_text()
    assert f"fsdp_version: {version}" in text
    for key in ("fsdp_cpu_ram_efficient_loading", "fsdp_sync_module_states"):
        text = text.replace(f"{key}: true", f"{key}: false")
    text = text.replace("mixed_precision: bf16", 'mixed_precision: "no"')
    path = out / f"cpu_{CONFIGS[version]}"
    path.write_text(text)
    return path


def launch(config: Path, out: Path, job: str, timeout: float = 240, worker: Path = WORKER,
           env: dict | None = None) -> subprocess.CompletedProcess:
    """`accelerate launch` of `worker` (its own session, killed whole on a timeout); `env`: the launch's
    environment variables (default: CPU mode)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # PYTHONFAULTHANDLER: a worker that dies of a signal prints every thread's Python stack (in the failure's stderr)
    env = {**os.environ, "PYTHONFAULTHANDLER": "1", **(env if env is not None else {"ACCELERATE_USE_CPU": "1"}),
           "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), "--main_process_port",
           str(port), str(worker), "--out", str(out), "--job", job]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)  # the launcher and both workers (their own session), then fail
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


@pytest.fixture(scope="module", params=[1, 2], ids=["fsdp1", "fsdp2"])
def runs(request, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp(f"fsdp{request.param}_train")
    config = cpu_config(out, request.param)
    first = launch(config, out, "first")
    # the killed run's processes died by SIGKILL after checkpoint-2: the launcher reports the signal
    assert first.returncode != 0 and "SIGKILL" in first.stderr, first.stderr[-3000:]
    assert (out / "full" / "adapter").is_dir() and (out / "bf16" / "trained.safetensors").is_file(), first.stderr[-3000:]
    resumed = launch(config, out, "resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    # FSDP2 hooks the backward of the root's outputs; an output that is a view would lose that hook to an
    # in-place op, and FSDP2 warns of it (loc_U was one: nn.Linear's 3-D path)
    assert "returned a view tensor" not in first.stderr + resumed.stderr
    return out


def records(run_dir: Path, split: str = "train") -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["split"] == split]


def adapter_files(adapter_dir: Path) -> dict[str, torch.Tensor]:
    return {**load_file(str(adapter_dir / "causal_adapter_model.safetensors")),
            **{f"peft.{k}": v for k, v in load_file(str(adapter_dir / "adapter_model.safetensors")).items()}}


def test_fsdp_train_runs_sharded_with_finite_losses_and_sharded_checkpoints(runs):
    final = json.loads((runs / "full" / "final_metrics.json").read_text())
    assert final["num_processes"] == 2 and final["global_step"] == worker.RUN_STEPS
    losses = [r["loss"] for r in records(runs / "full")]
    assert len(losses) == worker.RUN_STEPS and all(math.isfinite(v) for v in losses)
    # accelerate's save_state with SHARDED_STATE_DICT: one shard file per process, model and optimizer
    state = runs / "full" / "checkpoint-2" / "accelerate_state"
    for part in ("pytorch_model_fsdp_0", "optimizer_0"):
        assert sorted(p.name for p in (state / part).glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]


def test_fsdp_resume_after_sigkill_ends_equal_to_the_uninterrupted_run(runs):
    assert sorted(p.name for p in (runs / "killed").glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    a, b = adapter_files(runs / "full" / "adapter"), adapter_files(runs / "killed" / "adapter")
    assert set(a) == set(b)
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    drop = ("label_tokens_per_s",)  # wall-clock
    for split in ("train", "eval", "eval_calibrated"):
        full, resumed = records(runs / "full", split), records(runs / "killed", split)
        assert [{k: v for k, v in r.items() if k not in drop} for r in full] == \
               [{k: v for k, v in r.items() if k not in drop} for r in resumed]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The same run in this process: 1 process, per-device batch 4 = 2 x 2 (the same rows each micro-batch)."""
    from causal_adapter.training.loop import train

    train_ds, eval_ds = worker.datasets_()
    out = tmp_path_factory.mktemp("one_process")
    train(worker.model(), worker.config(out, batch=4, save_steps=0), train_dataset=train_ds, eval_dataset=eval_ds)
    return out


def assert_adapters_close(a: dict, b: dict, scale_rtol: float | None = None) -> None:
    """Every adapter tensor within RTOL / ATOL (with `scale_rtol`: within scale_rtol x the tensor's largest
    |entry|); the depth form's eigenbasis is not unique (16 rows in 32 dimensions: a degenerate null space),
    so it is compared as the quadratic form basis^T diag(weight) basis."""
    assert set(a) == set(b)
    for k in set(a) - {"action.depth_basis", "action.depth_weight"}:
        if scale_rtol is None:
            torch.testing.assert_close(a[k], b[k], rtol=RTOL, atol=ATOL, msg=k)
        else:
            torch.testing.assert_close(a[k], b[k], rtol=0, atol=scale_rtol * float(b[k].abs().max()) + 1e-12, msg=k)
    qa, qb = (t["action.depth_basis"].double().T @ torch.diag(t["action.depth_weight"].double())
              @ t["action.depth_basis"].double() for t in (a, b))
    torch.testing.assert_close(qa, qb, rtol=0, atol=(scale_rtol or RTOL) * float(qb.abs().max()))


def test_fsdp_final_directory_is_adapter_only_and_reloads_onto_a_fresh_base(runs, one_process):
    from causal_adapter import CausalModel

    adapter = runs / "full" / "adapter"
    assert sorted(p.name for p in adapter.iterdir()) == sorted(p.name for p in (one_process / "adapter").iterdir())
    loaded = CausalModel.from_pretrained(worker.base(), adapter)
    saved = load_file(str(adapter / "causal_adapter_model.safetensors"))
    state = loaded.adapter_state_dict()
    assert all(torch.equal(state[k], v) for k, v in saved.items())
    assert any(k.startswith("lora.") for k in state)  # LoRA reloaded through peft's file
    assert loaded.causal_config.value_calibration is not None  # the calibration fitted at the end travels


def test_fsdp_two_processes_match_one_process_with_twice_the_batch(runs, one_process):
    """Catches a head gradient summed over the processes instead of averaged (SGD-like AdamW, clipping on)."""
    two, one = records(runs / "full"), records(one_process)
    torch.testing.assert_close(torch.tensor([r["loss"] for r in two]), torch.tensor([r["loss"] for r in one]),
                               rtol=RTOL, atol=ATOL)
    assert_adapters_close(adapter_files(runs / "full" / "adapter"), adapter_files(one_process / "adapter"),
                          scale_rtol=ADAPTER_SCALE_RTOL)
    ev2, ev1 = records(runs / "full", "eval_calibrated")[-1], records(one_process, "eval_calibrated")[-1]
    assert ev2["num_targets"] == ev1["num_targets"] == 5  # every validation row once, gathered from both ranks
    assert ev2["loss"] == pytest.approx(ev1["loss"], rel=RTOL)


def test_fsdp_lora_fp32_on_a_bf16_base_saves_and_reloads_bit_for_bit(runs):
    from causal_adapter import CausalModel

    trained = load_file(str(runs / "bf16" / "trained.safetensors"))
    lora = {k: v for k, v in trained.items() if k.startswith("lora.")}
    assert lora and all(v.dtype == torch.float32 for v in lora.values())
    loaded = CausalModel.from_pretrained(worker.base(torch.bfloat16), runs / "bf16" / "adapter").adapter_state_dict()
    assert set(loaded) == set(trained)
    assert [k for k in trained if not torch.equal(loaded[k], trained[k])] == []


def test_causal_trainer_under_fsdp_saves_the_adapter_only_and_resumes_exactly(runs):
    """`CausalTrainer` in the same launches: 4 steps (2 micro-batches, clipping) with Trainer's sharded checkpoints
    beside the adapter files; the replicated heads equal on both processes; `save_model` writes the adapter
    only, which reloads onto a fresh base; a trainer resumed from checkpoint-2 ends bit-identical to the
    uninterrupted one (losses logged equal)."""
    from causal_adapter import CausalModel

    checkpoint = runs / "trainer" / "checkpoint-2"
    for part in ("pytorch_model_fsdp_0", "optimizer_0"):  # FSDP's own sharded state: the engine did run
        assert sorted(p.name for p in (checkpoint / part).glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    adapter = runs / "trainer" / "adapter"
    assert sorted(p.name for p in adapter.iterdir()) == sorted(
        [p.name for p in (runs / "full" / "adapter").iterdir()] + ["training_args.bin"])
    heads = [load_file(str(runs / "trainer" / f"heads_rank{r}.safetensors")) for r in (0, 1)]
    assert [k for k in heads[0] if not torch.equal(heads[0][k], heads[1][k])] == []  # replicas kept equal
    saved = adapter_files(adapter)
    assert all(t.numel() < 320 * 32 for t in saved.values())  # no vocabulary-sized matrix of the base
    loaded = CausalModel.from_pretrained(worker.base(), adapter).adapter_state_dict()
    ours = load_file(str(adapter / "causal_adapter_model.safetensors"))
    assert all(torch.equal(loaded[k], v) for k, v in ours.items()) and any(k.startswith("lora.") for k in loaded)
    resumed = adapter_files(runs / "trainer_resumed" / "adapter")
    assert set(saved) == set(resumed) and [k for k in saved if not torch.equal(saved[k], resumed[k])] == []
    logs = [[(r["step"], r["loss"]) for r in json.loads((d / "checkpoint-4" / "trainer_state.json").read_text())
             ["log_history"] if "loss" in r] for d in (runs / "trainer", runs / "trainer_resumed")]
    assert logs[0] == logs[1] and len(logs[0]) == worker.RUN_STEPS


def test_frozen_backbone_under_fsdp_own_loop_and_causal_trainer(runs):
    """No LoRA (a frozen backbone, the heads trained), in the same launches: `train()` and `CausalTrainer` each
    leave an adapter-only directory (no LoRA, no base matrix) that reloads onto a fresh base; the trainer's
    replicated heads are equal on both processes and moved from their start."""
    from causal_adapter import CausalModel

    for run in ("frozen", "trainer_frozen"):
        adapter = runs / run / "adapter"
        assert not (adapter / "adapter_model.safetensors").exists(), run  # no LoRA: no peft file
        saved = load_file(str(adapter / "causal_adapter_model.safetensors"))
        assert saved and not any(k.startswith("lora.") for k in saved), run
        assert all(t.numel() < 320 * 32 for t in saved.values())
        loaded = CausalModel.from_pretrained(worker.base(), adapter).adapter_state_dict()
        assert all(torch.equal(loaded[k], v) for k, v in saved.items())
    heads = [load_file(str(runs / "trainer_frozen" / f"heads_rank{r}.safetensors")) for r in (0, 1)]
    assert [k for k in heads[0] if not torch.equal(heads[0][k], heads[1][k])] == []
    start = worker.model(lora=False).adapter_state_dict(lora=False)
    assert any(not torch.equal(heads[0][k], start[k]) for k in heads[0] if k in start)
    records = [json.loads(line) for line in (runs / "frozen" / "metrics.jsonl").read_text().splitlines()]
    assert all(math.isfinite(r["loss"]) for r in records if "loss" in r)
