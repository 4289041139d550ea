"""TRL's `SFTTrainer` for a `CausalModel`: `CausalSFTTrainer` (docs/integrations.md, "TRL").

Plain `SFTTrainer` would train a CausalModel as a softmax LM on digit strings: it tokenises the rows
with the processing class (a number becomes digit tokens), patches a fused lm_head onto the model and
computes the softmax NLL from it. `CausalSFTTrainer` keeps TRL's trainer (its arguments, logging,
callbacks, accelerate / DeepSpeed / FSDP handling) and changes what touches numbers:

* rows: ``prompt`` + ``completion`` (loss on the completion only, TRL's default for such rows;
  ``completion_only_loss=False`` gives the prompt's text tokens the token loss too) or a text column
  (``dataset_text_field``), tokenised by `data.pipeline.tokenize_dataset` with a `NumberTokenizer`: each
  number one ``<NUM>`` with its value, EOS after every completion (``SFTConfig.max_length`` truncates).
  TRL's own dataset preparation is skipped (``dataset_kwargs={"skip_prepare_dataset": True}``);
* batches: `NumericCollator` (``numeric_values`` / ``label_values`` reach ``forward``), so Trainer must
  keep the columns (``remove_unused_columns=False``);
* loss: the CausalModel's own (L_cls + lambda L_reg); TRL's fused-lm_head patch is taken off the model;
* the value head: fitted as `training.loop.train` does it (`training.value_head`): value units and the
  ridge warm start before step 1 of a fresh run, then after the last step the refit on the final
  features and the width's calibration on the evaluation rows;
* files: adapter-only checkpoints and ``save_model`` (`saving.hf_trainer.CausalTrainer`).

trl is an optional extra (``pip install causal-adapter[trl]``); importing this module needs it.
"""
from __future__ import annotations

from typing import Any

import torch
from transformers import Trainer
from trl import SFTConfig, SFTTrainer

from ..data.pipeline import NumericCollator, number_layout, tokenize_dataset
from ..numbers import NumberTokenizer
from ..saving.hf_trainer import CausalTrainer
from ..saving.unwrap import unwrap_causal_model
from .config import TrainConfig
from .data import pad_token_id, rows_at
from .engines import inference_precision
from .metrics import MODEL_INPUTS, MetricAccumulator, accumulate
from .value_head import base_scale, calibrate_regression_scale, fit_value_head, refit_value_head

#: SFTConfig options that rearrange tokens in ways numbers-as-values does not support
UNSUPPORTED = ("packing", "padding_free", "assistant_only_loss")


def sft_config(args: SFTConfig | None = None, **overrides: Any) -> SFTConfig:
    """`args` (or a new SFTConfig from `overrides`) as `CausalSFTTrainer` needs it: TRL's dataset
    preparation skipped, the numeric columns kept. Refuses packing / padding-free / assistant-only loss."""
    args = args if args is not None else SFTConfig(**overrides)
    bad = [name for name in UNSUPPORTED if getattr(args, name, False)]
    if bad:
        raise ValueError(f"CausalSFTTrainer does not support {', '.join(bad)}=True: a <NUM> token carries its value "
                         "beside input_ids, which TRL's packing / padding-free / chat masks do not carry")
    args.dataset_kwargs = {**(args.dataset_kwargs or {}), "skip_prepare_dataset": True}
    args.remove_unused_columns = False  # Trainer would drop numeric_values / label_values
    return args


class CausalSFTTrainer(CausalTrainer, SFTTrainer):
    """`trl.SFTTrainer` for a `CausalModel` (see the module docstring).

    model: a CausalModel (`get_causal_model(...)`). args: an `SFTConfig` (see `sft_config`; its
    ``learning_rate`` is the heads' too: `train()`'s default is 1e-2). train_dataset / eval_dataset:
    `datasets.Dataset`s of raw rows (prompt/completion or text) or already tokenised by
    `tokenize_dataset`. processing_class: the base's tokenizer (required: it defines the number
    tokenisation). value_fit: the value-head settings of `TrainConfig` (``regression_init``,
    ``value_loss``, ``bf16_safe_head``, ``calibrate_scale``, ``per_device_eval_batch_size``; default
    `TrainConfig()`'s, as `causal-adapter train`). Other keyword arguments are SFTTrainer's.
    """

    def __init__(self, model=None, args: SFTConfig | None = None, train_dataset=None, eval_dataset=None,
                 processing_class=None, data_collator=None, value_fit: TrainConfig | None = None, **kwargs):
        inner = unwrap_causal_model(model)
        if inner is None:
            raise TypeError(f"CausalSFTTrainer trains a causal_adapter CausalModel, got {type(model).__name__}; "
                            "use trl.SFTTrainer for other models")
        if processing_class is None:
            raise ValueError("CausalSFTTrainer needs processing_class=<the base model's tokenizer>: it defines how "
                             "numbers are tokenised")
        args = sft_config(args if args is not None else SFTConfig("causal-sft"))
        self.value_fit = value_fit or TrainConfig()
        ntok = NumberTokenizer(processing_class, inner.num_token_id)
        train_dataset = self._number_features(train_dataset, ntok, args)
        if isinstance(eval_dataset, dict):
            eval_dataset = {k: self._number_features(v, ntok, args, completion_only=True) for k, v in eval_dataset.items()}
        elif eval_dataset is not None:
            eval_dataset = self._number_features(eval_dataset, ntok, args, completion_only=True)
        if data_collator is None:
            data_collator = NumericCollator(pad_token_id(ntok, inner), padding_side="right")
        prefix, contexts = number_layout(train_dataset, inner.num_token_id, processing_class)
        inner.causal_config.number_prefix_id, inner.causal_config.number_contexts = prefix, contexts
        super().__init__(model, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset,
                         processing_class=processing_class, data_collator=data_collator, **kwargs)
        # TRL's fused lm_head (softmax log-probs) is an instance attribute over forward: not this model's loss
        self.model.__dict__.pop("forward", None)

    @staticmethod
    def _number_features(dataset, ntok: NumberTokenizer, args: SFTConfig, completion_only: bool = False):
        """Raw rows -> the model's features (`tokenize_dataset`); tokenised datasets keep their features."""
        if dataset is None:
            raise ValueError("CausalSFTTrainer needs a train_dataset")
        if "input_ids" not in dataset.column_names:
            prompt_loss = "text" if args.completion_only_loss is False and not completion_only else "none"
            dataset = tokenize_dataset(dataset, ntok, text_column=args.dataset_text_field, max_length=args.max_length,
                                       add_eos_token=True, prompt_loss=prompt_loss)
        return dataset.select_columns([c for c in MODEL_INPUTS if c in dataset.column_names])

    def _eval_rows(self):
        """The evaluation dataset the value head is calibrated on (the first, when several), or None."""
        ds = self.eval_dataset
        if isinstance(ds, dict):
            ds = next(iter(ds.values()), None)
        return ds if ds is not None and len(ds) else None

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs):
        """Trainer's `train`, with the value head fitted before step 1 of a fresh run and refitted and
        calibrated after the last step (what `save_model` then writes)."""
        inner = unwrap_causal_model(self.model)
        if not resume_from_checkpoint:  # a resumed run takes the units and heads from its checkpoint
            with inference_precision(inner):  # the features the saved adapter will see
                fit_value_head(inner, self.value_fit, self.train_dataset, self.data_collator, self.args.device,
                               verbose=self.is_world_process_zero(), eval_ds=self._eval_rows())
        output = super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)
        self.fit_value_head_after_training()
        return output

    def fit_value_head_after_training(self) -> dict | bool:
        """The value head refitted on the final features (when training moved them) and the width
        calibrated on the evaluation rows, as at the end of `train()`. Every process computes the same."""
        inner = unwrap_causal_model(self.accelerator.unwrap_model(self.model))
        eval_ds, cfg = self._eval_rows(), self.value_fit
        refit_value_head(inner, cfg, self.train_dataset, self.data_collator, self.args.device, self.accelerator,
                         self.is_world_process_zero(), eval_ds)
        if eval_ds is None or not cfg.calibrate_scale:
            return False

        def predict() -> dict:
            bs = cfg.per_device_eval_batch_size
            batches = (self.data_collator(rows_at(eval_ds, range(i, min(i + bs, len(eval_ds)))))
                       for i in range(0, len(eval_ds), bs))
            acc = MetricAccumulator(inner.num_token_id, inner.causal_config.reg_weight,
                                    calibration=inner.causal_config.value_calibration)
            with torch.no_grad(), inference_precision(inner):
                return accumulate(inner, batches, acc, device=self.args.device).predictions()

        return calibrate_regression_scale(inner, predict(), base_scale(inner, predict))

    def compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch=None):
        """The CausalModel's loss (Trainer's compute_loss: ``outputs.loss``), not TRL's softmax NLL."""
        return Trainer.compute_loss(self, model, inputs, return_outputs, num_items_in_batch)

    def prediction_step(self, model, inputs, prediction_loss_only: bool, ignore_keys=None):
        """Trainer's (TRL's reads ``outputs.logits``, which a CausalOutput does not have)."""
        return Trainer.prediction_step(self, model, inputs, prediction_loss_only, ignore_keys)

    def create_model_card(self, *args, **kwargs) -> None:
        """No TRL card in ``output_dir``: the adapter's own card is written with every save (`save_adapter_into`)."""
