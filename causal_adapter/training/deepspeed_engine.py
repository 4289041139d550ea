"""DeepSpeed ZeRO-2 / ZeRO-3 under `training.loop.train` (``accelerate launch`` of
examples/accelerate_configs/deepspeed_zero{2,3}.yaml): its setup, its backward and its checkpoint format.

* Setup (`configure`, before `prepare`): train() owns the step, so DeepSpeed's config gets the run's
  micro-batch (``train_micro_batch_size_per_gpu``), ``gradient_accumulation_steps: 1`` (the loop accumulates
  itself and tells the engine which micro-batch ends a step: `backward`) and ``gradient_clipping`` =
  ``max_grad_norm``. Then ``accelerator.prepare(model, optimizer)`` (a ``DeepSpeedEngine`` around the
  CausalModel, the AdamW inside DeepSpeed's ZeRO optimizer; the loop's scheduler still sets its lr).
* ZeRO-3 partitions every parameter, the heads' and lm_head's weight (W_cls) included. The heads read W_cls
  and their own parameters outside the forward of the module that owns them (OvR scores, the fused loss,
  ``action.regression``), so `prepare` registers them as external parameters of the CausalModel
  (``deepspeed.zero.register_external_parameter``): DeepSpeed gathers them for its whole forward and
  backward. Outside a forward (the value-head fits, the calibration, the adapter's save) `whole_heads`
  gathers them (``deepspeed.zero.GatheredParameters``; what it costs: docs/distributed.md).
* Every ZeRO-3 forward is a collective (the layers are all-gathered): the evaluation pads the shorter
  shards as under FSDP (`fsdp_engine.pad_forwards`); the value-head fits use the same rows on every process.
* Checkpoints: DeepSpeed's own sharded ones (``pytorch_model/``: the trainable weights,
  ``zero_pp_rank_R_*optim_states.pt`` per process, ``zero_to_fp32.py``) through accelerate's
  ``save_state`` / ``load_state`` into the checkpoint's ``ENGINE_SUBDIR``, without the frozen base
  (``exclude_frozen_parameters``); the adapter files beside them are gathered whole.
"""
from __future__ import annotations

import contextlib
import warnings
from pathlib import Path
from typing import Iterator

import torch

from .fsdp_engine import save_state as _save_state_dir


def zero_stage(accelerator) -> int:
    return int(accelerator.state.deepspeed_plugin.zero_stage)


def configure(accelerator, config) -> None:
    """The run's micro-batch, accumulation (1: the loop's own) and clipping into DeepSpeed's config
    (before `prepare`); a clipping value in the accelerate config that differs is overridden, with a warning."""
    ds = accelerator.state.deepspeed_plugin.deepspeed_config
    clip = float(config.max_grad_norm or 0.0)
    if ds.get("gradient_clipping", "auto") not in ("auto", clip):
        warnings.warn(f"DeepSpeed's gradient_clipping={ds['gradient_clipping']} (accelerate config) is replaced by "
                      f"train's max_grad_norm={clip}", stacklevel=3)
    ds.update(train_micro_batch_size_per_gpu=config.per_device_train_batch_size, gradient_accumulation_steps=1,
              gradient_clipping=clip, train_batch_size=config.per_device_train_batch_size * accelerator.num_processes)
    accelerator.gradient_accumulation_steps = 1


def head_parameters(inner) -> list[torch.nn.Parameter]:
    """W_cls and every parameter of the heads: what the CausalModel reads outside their modules' forward."""
    heads = [p for name in ("numeric_embedding", "abduction", "action") for p in getattr(inner, name).parameters()]
    return [inner.W_cls, *heads]


def prepare(accelerator, model, optimizer, config):
    """(DeepSpeedEngine, accelerate's optimizer wrapper). Under ZeRO-3 the heads' parameters and W_cls
    become external parameters of the CausalModel (gathered for its forward and backward)."""
    configure(accelerator, config)
    engine, optimizer = accelerator.prepare(model, optimizer)
    if zero_stage(accelerator) == 3:
        from deepspeed.runtime.zero import register_external_parameter

        for p in head_parameters(model):
            register_external_parameter(model, p)
    return engine, optimizer


def backward(engine, loss: torch.Tensor, sync: bool) -> None:
    """The micro-batch's backward; on the last micro-batch of a step (`sync`) the engine reduces,
    clips and steps (DeepSpeed's optimizer step; the loop's ``optimizer.step()`` is accelerate's no-op)."""
    engine.set_gradient_accumulation_boundary(is_boundary=sync)
    engine.backward(loss)
    if sync:
        engine.step()


@contextlib.contextmanager
def whole_heads(accelerator, inner, modify: bool = False) -> Iterator[None]:
    """Inside: under ZeRO-3, W_cls, the heads' and LoRA's parameters gathered whole on every process (a
    collective); with `modify`, what process 0 writes into them is kept (every process computes the same).
    Else nothing to do."""
    if zero_stage(accelerator) != 3:
        yield
        return
    from deepspeed.runtime.zero import GatheredParameters

    params = head_parameters(inner) + [p for n, p in inner.backbone.named_parameters() if "lora_" in n]
    with GatheredParameters(params, modifier_rank=0 if modify else None):
        yield


def whole_adapter_tensors(accelerator, inner) -> dict[str, torch.Tensor] | None:
    """Under ZeRO-3: the adapter's tensors gathered whole (copies; a collective). ZeRO-2: None (whole already)."""
    if zero_stage(accelerator) != 3:
        return None
    with whole_heads(accelerator, inner):
        return {k: v.detach().clone() for k, v in inner.adapter_state_dict().items()}


def save_state(accelerator, tmp_dir: Path) -> Path:
    """DeepSpeed's sharded checkpoint (trainable weights, every process's optimizer partition) through
    accelerate's ``save_state`` into `tmp_dir`, written by every process (a collective)."""
    return _save_state_dir(accelerator, tmp_dir, exclude_frozen_parameters=True)


def load_state(accelerator, engine_dir: Path) -> None:
    """The trainable weights and the optimizer partitions from `engine_dir` (every process); the frozen
    base is not in it (``load_module_strict=False``)."""
    if not engine_dir.is_dir():
        raise FileNotFoundError(f"checkpoint {str(engine_dir.parent)!r} has no {engine_dir.name}/ (DeepSpeed's "
                                "sharded state): it was not written under DeepSpeed and cannot resume a DeepSpeed run")
    accelerator.load_state(str(engine_dir), load_module_strict=False)
