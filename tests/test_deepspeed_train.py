"""The product's training (`causal_adapter.training.loop.train`) under DeepSpeed ZeRO-2 and ZeRO-3: 2 gloo
processes on CPU through `accelerate launch` of examples/accelerate_configs/deepspeed_zero{2,3}.yaml (their CPU
copies: mixed_precision "no"; DS_ACCELERATOR=cpu), as launched, nothing in accelerate's state set by hand
(tests/deepspeed_train_worker.py). Per stage: no refusal, 2 processes, finite losses, DeepSpeed's own sharded
checkpoint without the frozen base; a run SIGKILLed after its step-2 checkpoint and resumed ends bit-identical
to the uninterrupted run; the final directory is adapter-only and reloads onto a fresh base; 2 processes with
per-device batch 2 match 1 process (plain train()) with batch 4: loss curve and adapter (tolerances below). Two launches per stage. Skipped without deepspeed (the `deepspeed` extra)."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("deepspeed", reason="the deepspeed extra: DS_BUILD_OPS=0 pip install 'causal_adapter[deepspeed]'")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
import fsdp_train_worker as worker  # noqa: E402  (the runs' model, data and settings)
from test_fsdp_train import adapter_files, assert_adapters_close, launch, records  # noqa: E402

# 2 processes x batch 2 (DeepSpeed) against 1 x batch 4 (plain train()), fp32: DeepSpeed reduces flattened
# gradient buffers and computes the clipping norm over partitions, so the sums run in another order than
# FSDP's. Measured (ZeRO-2 / ZeRO-3): losses within 1.0e-7 relative; every adapter tensor within 6.8e-5 / 2.7e-4
# of its largest |entry|. Planted (ZeRO-2): the loss divided by the accumulation twice (DeepSpeed's
# gradient_accumulation_steps left at the run's 2) -> losses 4.2e-3, tensors 0.17; clipping lost -> 3.0e-2, 18.
LOSS_RTOL, ADAPTER_SCALE_RTOL = 1e-5, 1e-3

WORKER = REPO / "tests" / "deepspeed_train_worker.py"
pytestmark = pytest.mark.slow


def cpu_config(stage: int, out: Path) -> Path:
    """examples/accelerate_configs/deepspeed_zeroN.yaml with fp32 compute (mixed_precision: no). ZeRO-3: its
    settings through a DeepSpeed config file that adds ``stage3_param_persistence_threshold: 0``: DeepSpeed
    keeps every parameter under 1e5 elements whole by default, which at this test's size is all of them
    (W_cls is 320 x 32), so without it nothing would be partitioned."""
    import yaml

    config = yaml.safe_load((REPO / f"examples/accelerate_configs/deepspeed_zero{stage}.yaml").read_text())
    config["mixed_precision"] = "no"
    if stage == 3:
        ds = config.pop("deepspeed_config")
        del config["mixed_precision"]  # the file's (no bf16 / fp16 section: fp32); accelerate refuses both
        ds_file = out / "zero3.json"
        ds_file.write_text(json.dumps({
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
            "gradient_accumulation_steps": ds["gradient_accumulation_steps"], "gradient_clipping": ds["gradient_clipping"],
            "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto"}))
        config["deepspeed_config"] = {"deepspeed_config_file": str(ds_file), "zero3_init_flag": ds["zero3_init_flag"]}
    path = out / f"cpu_deepspeed_zero{stage}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="module", params=[2, 3], ids=["zero2", "zero3"])
def runs(request, tmp_path_factory) -> tuple[int, Path]:
    stage = request.param
    out = tmp_path_factory.mktemp(f"zero{stage}_train")
    config, env = cpu_config(stage, out), {"DS_ACCELERATOR": "cpu"}
    first = launch(config, out, "first", timeout=400, worker=WORKER, env=env)
    # the killed run's processes died by SIGKILL after checkpoint-2: the launcher reports the signal
    assert first.returncode != 0 and "SIGKILL" in first.stderr, first.stderr[-3000:]
    assert (out / "full" / "adapter").is_dir(), first.stderr[-3000:]
    resumed = launch(config, out, "resume", timeout=400, worker=WORKER, env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return stage, out


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> Path:
    """The same run in this process without DeepSpeed: per-device batch 4 = 2 x 2 (the same rows each micro-batch)."""
    from causal_adapter.training.loop import train

    train_ds, eval_ds = worker.datasets_()
    out = tmp_path_factory.mktemp("one_process")
    train(worker.model(), worker.config(out, batch=4, save_steps=0), train_dataset=train_ds, eval_dataset=eval_ds)
    return out


def test_deepspeed_train_runs_two_processes_with_deepspeed_checkpoints(runs):
    stage, out = runs
    final = json.loads((out / "full" / "final_metrics.json").read_text())
    assert final["num_processes"] == 2 and final["global_step"] == worker.RUN_STEPS
    losses = [r["loss"] for r in records(out / "full")]
    assert len(losses) == worker.RUN_STEPS and all(math.isfinite(v) for v in losses)
    state = out / "full" / "checkpoint-2" / "accelerate_state" / "pytorch_model"
    optim = sorted(p.name for p in state.glob("*optim_states.pt"))
    assert len(optim) == 2 and all(f"zero_pp_rank_{r}_" in optim[r] for r in range(2)), optim
    models = sorted(state.glob("*model_states.pt"))  # ZeRO-2: one (process 0's); ZeRO-3: one per process
    assert len(models) == (1 if stage == 2 else 2), models
    for path in models:  # the frozen base is not checkpointed: LoRA and the heads only, and the tiny base's
        # lm_head.weight, tied to the embedding (DeepSpeed's frozen filter walks named_parameters, which lists a
        # shared tensor once, under the embedding's name)
        module = torch.load(path, map_location="cpu", weights_only=False)["module"]
        base = [k for k in module if k.startswith("backbone.") and "lora_" not in k]
        assert any("lora_" in k for k in module) and base in ([], ["backbone.lm_head.weight"]), base


def test_deepspeed_resume_after_sigkill_ends_equal_to_the_uninterrupted_run(runs):
    _, out = runs
    assert sorted(p.name for p in (out / "killed").glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    a, b = adapter_files(out / "full" / "adapter"), adapter_files(out / "killed" / "adapter")
    assert set(a) == set(b)
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    drop = ("label_tokens_per_s",)  # wall-clock
    for split in ("train", "eval", "eval_calibrated"):
        full, resumed = records(out / "full", split), records(out / "killed", split)
        assert [{k: v for k, v in r.items() if k not in drop} for r in full] == \
               [{k: v for k, v in r.items() if k not in drop} for r in resumed]


def test_deepspeed_final_directory_is_adapter_only_and_reloads_onto_a_fresh_base(runs, one_process):
    from safetensors.torch import load_file

    from causal_adapter import CausalModel

    adapter = runs[1] / "full" / "adapter"
    assert sorted(p.name for p in adapter.iterdir()) == sorted(p.name for p in (one_process / "adapter").iterdir())
    loaded = CausalModel.from_pretrained(worker.base(), adapter)
    saved = load_file(str(adapter / "causal_adapter_model.safetensors"))
    state = loaded.adapter_state_dict()
    assert all(torch.equal(state[k], v) for k, v in saved.items())
    assert any(k.startswith("lora.") for k in state)  # LoRA reloaded through peft's file
    assert loaded.causal_config.value_calibration is not None  # the calibration fitted at the end travels


def test_deepspeed_two_processes_match_one_process_with_twice_the_batch(runs, one_process):
    """SGD-like AdamW with clipping at work: a gradient summed over the processes, clipping lost or the
    accumulation scaled twice shows (the loss curve and the adapter)."""
    _, out = runs
    two, one = records(out / "full"), records(one_process)
    torch.testing.assert_close(torch.tensor([r["loss"] for r in two]), torch.tensor([r["loss"] for r in one]),
                               rtol=LOSS_RTOL, atol=0)
    assert_adapters_close(adapter_files(out / "full" / "adapter"), adapter_files(one_process / "adapter"),
                          scale_rtol=ADAPTER_SCALE_RTOL)
    ev2, ev1 = records(out / "full", "eval_calibrated")[-1], records(one_process, "eval_calibrated")[-1]
    assert ev2["num_targets"] == ev1["num_targets"] == 5  # every validation row once, gathered from both ranks
    assert ev2["loss"] == pytest.approx(ev1["loss"], rel=LOSS_RTOL)


def _forget_deepspeed_state() -> None:
    from accelerate.state import AcceleratorState
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    AcceleratorState._reset_state(reset_partial_state=True)


def test_causal_trainer_refuses_deepspeed_naming_what_runs(monkeypatch, request):
    """CausalTrainer under DeepSpeed is not supported (train() is): it stops at construction, not mid-run."""
    import datasets
    from transformers import TrainingArguments

    from causal_adapter import CausalAdapterConfig, get_causal_model
    from causal_adapter.saving.assets import build_tiny_qwen, load_qwen_tokenizer
    from causal_adapter.saving.hf_trainer import CausalTrainer

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    # TrainingArguments(deepspeed=...) sets ACCELERATE_USE_DEEPSPEED and transformers' global ZeRO config in this
    # process: both are undone afterwards, or every later train() in the session would start as a DeepSpeed run
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "false")
    request.addfinalizer(_forget_deepspeed_state)
    args = TrainingArguments(output_dir="unused", max_steps=1, report_to=[], use_cpu=False,
                             deepspeed={"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto",
                                        "train_batch_size": "auto", "gradient_accumulation_steps": "auto"})
    model = get_causal_model(build_tiny_qwen("qwen2"), CausalAdapterConfig(), tokenizer=load_qwen_tokenizer())
    with pytest.raises(ValueError, match="does not run under DeepSpeed yet: train with causal_adapter.training.loop"):
        CausalTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_dict({"input_ids": [[1, 2]]}))
