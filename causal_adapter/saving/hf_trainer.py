"""`CausalTrainer`: `transformers.Trainer` with adapter-only checkpoints (`_save` -> `save_pretrained`;
`_load_from_checkpoint` / `_load_best_model` read the adapter, strictly). Plain `Trainer` saves
`state_dict()` of any model that is not a `PreTrainedModel` / `PeftModel`, i.e. the whole base (or
crashes on tied weights). A module of its own so that importing causal_adapter does not import Trainer.

Under FSDP (``accelerate launch`` with examples/accelerate_configs/fsdp2.yaml or fsdp.yaml): the heads stay
replicated (``fsdp_ignored_modules``) and `finish_fsdp_wrap` averages their gradients after Trainer's
`prepare` (FSDP1 with LoRA: peft's wrap policy first, `set_lora_wrap_policy`); checkpoints hold Trainer's
own sharded model and optimizer (``pytorch_model_fsdp_0/``, ``optimizer_0/``; resume loads them) beside
the adapter files, gathered whole; `save_model` writes the adapter only."""
from __future__ import annotations

import os
import warnings

import torch
from torch import nn
from transformers import Trainer

from .adapter_io import load_adapter_into, save_adapter_into
from .process_groups import keep_gloo_groups_to_process_end
from .fsdp import finish_fsdp_wrap, full_adapter_state_dict, init_fsdp1_optimizer_state, set_lora_wrap_policy
from .unwrap import unwrap_causal_model


class CausalTrainer(Trainer):
    """`transformers.Trainer` for a `CausalModel`: every checkpoint (and `save_model`) holds the
    adapter only (our files, peft's LoRA files when LoRA is on, the model card) next to Trainer's own
    optimizer / scheduler / rng / trainer_state files; `resume_from_checkpoint` and
    `load_best_model_at_end` read the adapter back strictly. Pass ``data_collator=NumericCollator(pad_id)``
    (numeric_values and label_values are model inputs). Everything else is Trainer's.
    """

    def __init__(self, model=None, *args, **kwargs):
        if unwrap_causal_model(model) is None and not (model is None and kwargs.get("model_init") is not None):
            raise TypeError(f"CausalTrainer trains a causal_adapter CausalModel, got {type(model).__name__}; "
                            "use transformers.Trainer for other models")
        super().__init__(model, *args, **kwargs)
        keep_gloo_groups_to_process_end()  # no gloo teardown during interpreter exit (it aborted now and then)
        if self.is_deepspeed_enabled:  # ZeRO-3 partitions W_cls, which the heads read outside lm_head's forward
            raise ValueError("CausalTrainer does not run under DeepSpeed yet: train with causal_adapter.training.loop."
                             "train / `causal-adapter train` (ZeRO-2 and ZeRO-3, docs/distributed.md), or use FSDP "
                             "with CausalTrainer")

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        if self.is_fsdp_enabled:
            set_lora_wrap_policy(self.accelerator, self.model)
            self._unfuse_adamw_under_fsdp2()
        model, train_dataloader = super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)
        if self.is_fsdp_enabled:
            finish_fsdp_wrap(model)  # the replicated heads' gradients averaged over the processes
        return model, train_dataloader

    def _unfuse_adamw_under_fsdp2(self) -> None:
        """Fused AdamW (Trainer's default) steps a parameter group in one kernel, which refuses a group holding
        FSDP2's DTensors (sharded LoRA) next to the replicated heads' plain tensors ("got mixed torch.Tensor and
        DTensor"): the same AdamW unfused (foreach), with a warning."""
        from transformers.training_args import OptimizerNames

        if self.accelerator.state.fsdp_plugin.fsdp_version == 2 and self.args.optim == OptimizerNames.ADAMW_TORCH_FUSED:
            warnings.warn("CausalTrainer under FSDP2: optim adamw_torch_fused cannot step the sharded LoRA and the "
                          "replicated heads in one group; using adamw_torch", stacklevel=3)
            self.args.optim = OptimizerNames.ADAMW_TORCH

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        if not self.is_fsdp_enabled:
            return super().save_model(output_dir, _internal_call)
        # Trainer writes nothing here under SHARDED_STATE_DICT and would gather the whole model under
        # FULL_STATE_DICT: the adapter's tensors only, gathered on every process (a collective)
        self._save(output_dir, adapter_tensors=full_adapter_state_dict(self.model))

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None,
              adapter_tensors: dict | None = None) -> None:
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if not self.args.should_save:
            return
        os.makedirs(output_dir, exist_ok=True)
        inner = unwrap_causal_model(self.accelerator.unwrap_model(self.model, keep_torch_compile=False))
        metrics = None
        if self.state.log_history:
            last = {k: v for k, v in self.state.log_history[-1].items() if isinstance(v, (int, float))}
            metrics = last or None
        save_adapter_into(inner, output_dir, metrics=metrics, adapter_tensors=adapter_tensors)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        from transformers.trainer import TRAINING_ARGS_NAME

        torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        if self.is_fsdp_enabled:  # the sharded model Trainer checkpointed (pytorch_model_fsdp_0/)
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        inner = unwrap_causal_model(model if model is not None else self.model)
        load_adapter_into(inner, resume_from_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint) -> None:
        if checkpoint is not None and self.is_fsdp_enabled and self.accelerator.state.fsdp_plugin.fsdp_version == 1:
            init_fsdp1_optimizer_state(self.optimizer)  # else accelerate would load nothing into the fresh optimizer
        super()._load_optimizer_and_scheduler(checkpoint)

    def _load_best_model(self) -> None:
        self._load_from_checkpoint(self.state.best_model_checkpoint)
