"""The launchers (engines) `training.loop.train` runs under, what each needs at setup, and where each
keeps its checkpointed weights (docs/distributed.md).

* one process / DDP: `accelerator.prepare(model, optimizer)`; the checkpoint holds the adapter files and
  ``optimizer.pt`` written by the main process (every process holds the same state).
* FSDP2 (``fsdp_version: 2``, decoder layers sharded, the heads replicated through
  ``fsdp_ignored_modules`` = `saving.integrations.FSDP_IGNORED_MODULES`): after `prepare`,
  `finish_fsdp_wrap` (head gradients averaged over the processes, the values kept in their dtype).
  Every forward is a collective (FSDP all-gathers the layers), so every process runs the same number of
  forwards: the value-head fits already use the same rows on every process, the evaluation pads the
  shorter shards (`pad_forwards`). The weights and the optimizer state are checkpointed through
  accelerate's ``save_state`` / ``load_state`` (torch.distributed.checkpoint, sharded with
  ``fsdp_state_dict_type: SHARDED_STATE_DICT``) in ``ENGINE_SUBDIR``; the adapter files beside them are
  gathered whole (`whole_adapter_tensors`), so a checkpoint still loads with
  `CausalModel.from_pretrained`.
* refused at start, naming what runs: DeepSpeed and FSDP1.
"""
from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

import torch

from ..modeling.heads import full_precision
from ..saving.integrations import finish_fsdp_wrap, full_adapter_state_dict

ENGINE_SUBDIR = "accelerate_state"  # inside checkpoint-STEP: accelerate's save_state (FSDP only)

SUPPORTED_LAUNCHERS = ("one process (python -m causal_adapter train / causal-adapter train), DDP (accelerate launch "
                       "with examples/accelerate_configs/multi_gpu_ddp.yaml or cpu_ddp.yaml) or FSDP2 "
                       "(examples/accelerate_configs/fsdp2.yaml)")


def is_fsdp(accelerator) -> bool:
    from accelerate.utils import DistributedType

    return accelerator.distributed_type == DistributedType.FSDP


def check_engine(accelerator) -> None:
    """Refuse the launchers this loop does not run, at start, naming the supported ones."""
    from accelerate.utils import DistributedType

    kind = accelerator.distributed_type
    if kind == DistributedType.DEEPSPEED:
        raise ValueError(f"causal_adapter.training.loop does not support DeepSpeed yet (issue 26); supported "
                         f"launchers: {SUPPORTED_LAUNCHERS}")
    if kind == DistributedType.FSDP and accelerator.state.fsdp_plugin.fsdp_version != 2:
        raise ValueError("causal_adapter.training.loop does not support FSDP1 (fsdp_version: 1): set fsdp_version: 2 "
                         f"in the accelerate config; supported launchers: {SUPPORTED_LAUNCHERS}")


def prepare(accelerator, model, optimizer):
    """(prepared model, prepared optimizer). Under FSDP2 the model is sharded in place and the optimizer's
    parameters become its DTensors (accelerate); the heads must stay replicated (`finish_fsdp_wrap`
    refuses a config without ``fsdp_ignored_modules``)."""
    model, optimizer = accelerator.prepare(model, optimizer)
    if is_fsdp(accelerator):
        finish_fsdp_wrap(model)
    return model, optimizer


@contextlib.contextmanager
def inference_precision(model):
    """Run `model` (the unwrapped CausalModel) as the saved adapter runs at inference (`eval`, `predict`,
    `generate`): the base in its own dtype, with no autocast, also when accelerate's mixed precision
    wrapped its forward in one (`prepare` keeps the plain forward as ``_original_forward``, the one
    ``unwrap_model(keep_fp32_wrapper=False)`` restores; here only for the duration of the context).

    Why: the value head reads differences between loc_U rows far smaller than bf16's resolution of
    the backbone's activations (sunspots, random tiny base: across-row sd of the last attention
    output 8e-4, bf16 rounding error 4e-5; docs/mixed_precision.md). A head fitted and calibrated on
    bf16-autocast features is scored by `eval` on float32 features and loses 2.2x; fitted on the
    features inference computes, a bf16-autocast run matches fp32. On a 16-bit base the features are
    16-bit at inference too, and this changes nothing."""
    original = model.__dict__.get("_original_forward")
    patched = model.__dict__.get("forward")
    if original is not None:
        model.forward = original
    try:
        with full_precision(model.device):
            yield model
    finally:
        if original is not None:
            model.forward = patched


def whole_adapter_tensors(accelerator, model) -> dict[str, torch.Tensor] | None:
    """Under FSDP: the adapter's tensors gathered whole (a collective: call on every process); else None
    (the module's own tensors are whole)."""
    return full_adapter_state_dict(model) if is_fsdp(accelerator) else None


def pad_forwards(model, batch: dict, count: int) -> None:
    """Run `count` forwards of `batch` whose outputs are discarded: under FSDP a process with fewer
    evaluation batches than the others would leave their all-gathers waiting."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for _ in range(count):
                model(**batch)
    finally:
        model.train(was_training)


def save_engine_state(accelerator, tmp_dir: Path) -> Path | None:
    """Under FSDP: accelerate's ``save_state`` (sharded weights + optimizer, RNG) into `tmp_dir`, written by
    every process (a collective); the main process moves it into the checkpoint. Else None."""
    if not is_fsdp(accelerator):
        return None
    if accelerator.is_main_process and tmp_dir.exists():  # left by a run killed mid-save
        shutil.rmtree(tmp_dir)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp_dir))
    accelerator.wait_for_everyone()
    return tmp_dir


def load_engine_state(accelerator, checkpoint: Path) -> bool:
    """Under FSDP: the weights and the optimizer state from the checkpoint's ``ENGINE_SUBDIR`` (accelerate's
    ``load_state``, every process). Returns whether it loaded them (False: not FSDP)."""
    if not is_fsdp(accelerator):
        return False
    engine_dir = checkpoint / ENGINE_SUBDIR
    if not engine_dir.is_dir():
        raise FileNotFoundError(f"checkpoint {str(checkpoint)!r} has no {ENGINE_SUBDIR}/ (accelerate's sharded FSDP "
                                "state): it was not written under FSDP and cannot resume an FSDP run")
    accelerator.load_state(str(engine_dir))
    return True
