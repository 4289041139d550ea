"""`CausalTrainer`: `transformers.Trainer` with adapter-only checkpoints (`_save` -> `save_pretrained`;
`_load_from_checkpoint` / `_load_best_model` read the adapter, strictly). Plain `Trainer` saves
`state_dict()` of any model that is not a `PreTrainedModel` / `PeftModel`, i.e. the whole base (or
crashes on tied weights). A module of its own so that importing causal_adapter does not import Trainer."""
from __future__ import annotations

import os

import torch
from torch import nn
from transformers import Trainer

from .adapter_io import load_adapter_into, save_adapter_into
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

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if not self.args.should_save:
            return
        os.makedirs(output_dir, exist_ok=True)
        inner = unwrap_causal_model(self.accelerator.unwrap_model(self.model, keep_torch_compile=False))
        metrics = None
        if self.state.log_history:
            last = {k: v for k, v in self.state.log_history[-1].items() if isinstance(v, (int, float))}
            metrics = last or None
        save_adapter_into(inner, output_dir, metrics=metrics)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        from transformers.trainer import TRAINING_ARGS_NAME

        torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        inner = unwrap_causal_model(model if model is not None else self.model)
        load_adapter_into(inner, resume_from_checkpoint)

    def _load_best_model(self) -> None:
        self._load_from_checkpoint(self.state.best_model_checkpoint)
