"""FSDP (FSDP1 with ``use_orig_params``, FSDP2) under `training.loop.train`: its setup and its checkpoint format.

* Setup: decoder layers sharded, the heads replicated through ``fsdp_ignored_modules`` =
  `saving.fsdp.FSDP_IGNORED_MODULES`; after `prepare`, `finish_fsdp_wrap` (head gradients averaged over
  the processes, the values kept in their dtype). FSDP1 with LoRA: peft's wrap policy
  (`saving.fsdp.set_lora_wrap_policy`) gives each LoRA matrix a unit of its own, so an fp32 LoRA on a
  bf16 base never shares a flat parameter with the base ("Must flatten tensors with uniform dtype").
  FSDP1 turns the root's parameters (embeddings, lm_head = W_cls) back into shards after each forward:
  evaluations and value-head fits run the root unit itself (`engines.eval_model`) and read W_cls inside
  `saving.fsdp.whole_root_parameters`; clipping goes through the root's `clip_grad_norm_`.
* Every forward is a collective (FSDP all-gathers the layers), so every process runs the same number of
  forwards: the value-head fits already use the same rows on every process, the evaluation pads the
  shorter shards (`pad_forwards`).
* Checkpoints: the weights and the optimizer state go through accelerate's ``save_state`` /
  ``load_state`` (torch.distributed.checkpoint, sharded with ``fsdp_state_dict_type: SHARDED_STATE_DICT``)
  into the checkpoint's ``ENGINE_SUBDIR``; the adapter files beside them are gathered whole
  (`whole_adapter_tensors`), so a checkpoint still loads with `CausalModel.from_pretrained`.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

from ..saving.fsdp import (
    finish_fsdp_wrap,
    full_adapter_state_dict,
    init_fsdp1_optimizer_state,
    set_lora_wrap_policy,
    whole_root_parameters,
)


def is_fsdp1(accelerator) -> bool:
    from accelerate.utils import DistributedType

    return accelerator.distributed_type == DistributedType.FSDP and accelerator.state.fsdp_plugin.fsdp_version == 1


def prepare(accelerator, model, optimizer):
    """(prepared model, prepared optimizer): FSDP2 shards the model in place and the optimizer's parameters
    become its DTensors; FSDP1 returns its root unit around the model (accelerate). The heads must stay
    replicated (`finish_fsdp_wrap` refuses a config without ``fsdp_ignored_modules``)."""
    set_lora_wrap_policy(accelerator, model)  # FSDP1 + LoRA: LoRA matrices in units of their own
    model, optimizer = accelerator.prepare(model, optimizer)
    finish_fsdp_wrap(model)
    return model, optimizer


def whole_adapter_tensors(model) -> dict[str, torch.Tensor]:
    """The adapter's tensors gathered whole (a collective: call on every process)."""
    return full_adapter_state_dict(model)


def pad_forwards(model, batch: dict, count: int) -> None:
    """Run `count` forwards of `batch` whose outputs are discarded: a process with fewer evaluation
    batches than the others would leave their all-gathers waiting (FSDP1: also the all-gather of the
    root's parameters that each evaluation batch's scores take, `metrics.accumulate`)."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for _ in range(count):
                model(**batch)
                with whole_root_parameters(model):
                    pass
    finally:
        model.train(was_training)


def save_state(accelerator, tmp_dir: Path, **save_kwargs) -> Path:
    """accelerate's ``save_state`` (sharded weights + optimizer, RNG) into `tmp_dir`, written by every
    process (a collective); the main process moves it into the checkpoint. `save_kwargs`: for the engine's
    own save (DeepSpeed's ``save_checkpoint``)."""
    if accelerator.is_main_process and tmp_dir.exists():  # left by a run killed mid-save
        shutil.rmtree(tmp_dir)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp_dir), **save_kwargs)
    accelerator.wait_for_everyone()
    return tmp_dir


def load_state(accelerator, engine_dir: Path, optimizer) -> None:
    """The weights and the optimizer state from `engine_dir` (accelerate's ``load_state``, every process)."""
    if not engine_dir.is_dir():
        raise FileNotFoundError(f"checkpoint {str(engine_dir.parent)!r} has no {engine_dir.name}/ (accelerate's "
                                "sharded FSDP state): it was not written under FSDP and cannot resume an FSDP run")
    if is_fsdp1(accelerator):
        init_fsdp1_optimizer_state(optimizer)  # else accelerate would load nothing into the fresh optimizer
    accelerator.load_state(str(engine_dir))
