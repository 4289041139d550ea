"""The product's training (`causal_adapter.training.loop.train`) under DeepSpeed ZeRO-2 and ZeRO-3: 2 gloo
processes on CPU through `accelerate launch` of examples/accelerate_configs/deepspeed_zero{2,3}.yaml (their CPU
copies: mixed_precision "no"; DS_ACCELERATOR=cpu), as launched, nothing in accelerate's state set by hand
(tests/deepspeed_train_worker.py). Per stage: no refusal, 2 processes, finite losses, DeepSpeed's own sharded
checkpoint without the frozen base; a run SIGKILLed after its step-2 checkpoint and resumed ends bit-identical
to the uninterrupted run; the final directory is adapter-only and reloads onto a fresh base; 2 processes with
per-device batch 2 match 1 process (plain train()) with batch 4: loss curve and adapter (tolerance: tests/
test_fsdp_train.py's RTOL / ATOL). Two launches per stage. Skipped without deepspeed (the `deepspeed` extra)."""
from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("deepspeed", reason="the deepspeed extra: DS_BUILD_OPS=0 pip install 'causal_adapter[deepspeed]'")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
import fsdp_train_worker as worker  # noqa: E402  (the runs' model, data and settings)
from test_fsdp_train import RTOL, adapter_files, assert_adapters_close, launch, records  # noqa: E402

WORKER = REPO / "tests" / "deepspeed_train_worker.py"
pytestmark = pytest.mark.slow


def cpu_config(stage: int, out: Path) -> Path:
    """examples/accelerate_configs/deepspeed_zeroN.yaml with fp32 compute (mixed_precision: no)."""
    text = (REPO / f"examples/accelerate_configs/deepspeed_zero{stage}.yaml").read_text()
    path = out / f"cpu_deepspeed_zero{stage}.yaml"
    path.write_text(text.replace("mixed_precision: bf16", 'mixed_precision: "no"'))
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
    module = torch.load(state / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)["module"]
    assert not any(k.endswith("mlp.up_proj.weight") for k in module)  # the frozen base is not checkpointed


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
                               rtol=RTOL, atol=1e-6)
    assert_adapters_close(adapter_files(out / "full" / "adapter"), adapter_files(one_process / "adapter"))
    ev2, ev1 = records(out / "full", "eval_calibrated")[-1], records(one_process, "eval_calibrated")[-1]
    assert ev2["num_targets"] == ev1["num_targets"] == 5  # every validation row once, gathered from both ranks
    assert ev2["loss"] == pytest.approx(ev1["loss"], rel=RTOL)
