"""TRL's `SFTTrainer` for a `CausalModel`: `CausalSFTTrainer` (docs/integrations.md, "TRL").

Plain `SFTTrainer` would train a CausalModel as a softmax LM on digit strings: it tokenises the rows
with the processing class (a number becomes digit tokens), patches a fused lm_head onto the model and
computes the softmax NLL from it. `CausalSFTTrainer` keeps TRL's trainer (its arguments, logging,
callbacks, accelerate / DeepSpeed / FSDP handling) and changes what touches numbers:

* rows: ``prompt`` + ``completion`` (loss on the completion only, TRL's default for such rows;
  ``completion_only_loss=False`` gives the prompt's text tokens the token loss too) or a text column
  (``dataset_text_field``), tokenised by `data.pipeline.tokenize_dataset` with a `NumberTokenizer`: each
  number one ``<NUM>`` with its value, EOS after every completion (``SFTConfig.max_length`` truncates).
  Conversations (TRL's ``messages`` column, or prompt/completion lists of messages) are rendered with the
  chat template and trained on the assistant turns only, each with its end-of-turn mark
  (`_number_features` says how ``assistant_only_loss`` / ``completion_only_loss`` map).
  TRL's own dataset preparation is skipped (``dataset_kwargs={"skip_prepare_dataset": True}``);
* batches: `NumericCollator` (``numeric_values`` / ``label_values`` reach ``forward``), so Trainer must
  keep the columns (``remove_unused_columns=False``); with ``packing=True`` (strategy ``"bfd"``) the training
  rows are packed into rows of ``max_length`` tokens (`data.packing.pack_dataset`), and with ``packing`` or
  ``padding_free=True`` each batch is flattened into one row (`data.packing.PackedCollator`): position ids
  restart at each row, no attention across rows, the value head's recent numbers restart too. Evaluation
  rows are never packed, and the value head's fits read the rows unpacked;
* loss: the CausalModel's own (L_cls + lambda L_reg); TRL's fused-lm_head patch is taken off the model;
* the value head: fitted as `training.loop.train` does it (`training.value_head`): value units and the
  ridge warm start before step 1 of a fresh run, then after the last step the refit on the final
  features and the width's calibration on the evaluation rows;
* files: adapter-only checkpoints and ``save_model`` (`saving.hf_trainer.CausalTrainer`).

trl is an optional extra (``pip install causal-adapter[trl]``); importing this module needs it.
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch
from transformers import Trainer
from trl import SFTConfig, SFTTrainer

from ..data.conversations import read_chat_template
from ..data.packing import PackedCollator, pack_dataset
from ..data.pipeline import NumericCollator, number_layout, tokenize_dataset
from ..numbers import NumberTokenizer
from ..saving.hf_trainer import CausalTrainer
from ..saving.unwrap import unwrap_causal_model
from .config import TrainConfig
from .data import pad_token_id, rows_at
from .engines import inference_precision
from .metrics import MODEL_INPUTS, MetricAccumulator, accumulate
from .value_head import Calibration, fit_after_training, fit_before_training

#: SFTConfig options that rearrange tokens in ways numbers-as-values does not support (none left: assistant-only
#: loss is what conversations get, from the rendered text's assistant spans, `data.conversations`)
UNSUPPORTED: tuple[str, ...] = ()
#: TRL's packing strategies CausalSFTTrainer runs: "bfd" keeps every row whole ("wrapped" cuts rows and lets one
#: attend to the next; "bfd_split" splits rows that `tokenize_dataset` has already cut to max_length)
PACKING_STRATEGIES = ("bfd",)


def sft_config(args: SFTConfig | None = None, **overrides: Any) -> SFTConfig:
    """`args` (or a new SFTConfig from `overrides`) as `CausalSFTTrainer` needs it: TRL's dataset
    preparation skipped, the numeric columns kept. Refuses `UNSUPPORTED` options and packing strategies other
    than `PACKING_STRATEGIES`."""
    args = args if args is not None else SFTConfig(**overrides)
    bad = [name for name in UNSUPPORTED if getattr(args, name, False)]
    if bad:
        raise ValueError(f"CausalSFTTrainer does not support {', '.join(bad)}=True: a <NUM> token carries its value "
                         "beside input_ids, which TRL's packing / padding-free / chat masks do not carry")
    if args.packing and args.packing_strategy not in PACKING_STRATEGIES:
        raise ValueError(f"CausalSFTTrainer packs with packing_strategy='bfd' (every row whole, none attending to "
                         f"another), not {args.packing_strategy!r}")
    if args.packing and args.max_length is None:
        raise ValueError("packing=True needs max_length (the length of the packed rows)")
    args.dataset_kwargs = {**(args.dataset_kwargs or {}), "skip_prepare_dataset": True}
    args.remove_unused_columns = False  # Trainer would drop numeric_values / label_values
    return args


class CausalSFTTrainer(CausalTrainer, SFTTrainer):
    """`trl.SFTTrainer` for a `CausalModel` (see the module docstring).

    model: a CausalModel (`get_causal_model(...)`). args: an `SFTConfig` (see `sft_config`; its
    ``learning_rate`` is the heads' too: `train()`'s default is 1e-2). train_dataset / eval_dataset:
    `datasets.Dataset`s of raw rows (TRL's formats: ``messages``, prompt/completion as strings or as
    lists of messages, or text) or already tokenised by `tokenize_dataset`. processing_class: the base's
    tokenizer (required: it defines the number tokenisation; its chat template renders conversations, or
    ``SFTConfig.chat_template_path``'s jinja file). value_fit: the value-head settings of `TrainConfig`
    (``regression_init``, ``value_loss``, ``bf16_safe_head``, ``calibrate_scale``,
    ``per_device_eval_batch_size``; default `TrainConfig()`'s, as `causal-adapter train`). enable_thinking:
    render conversations with Qwen3's thinking on (reasoning trained with its reply). Other keyword arguments
    are SFTTrainer's.
    """

    def __init__(self, model=None, args: SFTConfig | None = None, train_dataset=None, eval_dataset=None,
                 processing_class=None, data_collator=None, value_fit: TrainConfig | None = None,
                 enable_thinking: bool = False, **kwargs):
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
        chat = dict(enable_thinking=enable_thinking, chat_template=_chat_template(args))
        train_dataset = self._number_features(train_dataset, ntok, args, **chat)
        if isinstance(eval_dataset, dict):
            eval_dataset = {k: self._number_features(v, ntok, args, completion_only=True, rows_name=f"{k} rows", **chat)
                            for k, v in eval_dataset.items()}
        elif eval_dataset is not None:
            eval_dataset = self._number_features(eval_dataset, ntok, args, completion_only=True, **chat)
        # the value head's fits and calibration read whole rows, padded, whatever the training batches are
        self.row_collator = NumericCollator(pad_token_id(ntok, inner), padding_side="right")
        self.unpacked_train_dataset = train_dataset
        padding_free = bool(args.padding_free or args.packing)  # TRL's: packing "bfd" is padding-free
        if data_collator is None:
            data_collator = PackedCollator(self.row_collator.pad_token_id, flatten=True) if padding_free \
                else self.row_collator
        elif padding_free:
            raise ValueError("a custom data_collator is not supported with packing / padding_free (as in TRL): "
                             "CausalSFTTrainer flattens the batches itself (data.packing.PackedCollator)")
        prefix, contexts = number_layout(train_dataset, inner.num_token_id, processing_class)
        inner.causal_config.number_prefix_id, inner.causal_config.number_contexts = prefix, contexts
        if args.packing:
            train_dataset = pack_dataset(train_dataset, args.max_length)
        with _packing_hidden_from_trl(args), _assistant_mask_hidden_from_trl(args):
            super().__init__(model, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset,
                             processing_class=processing_class, data_collator=data_collator, **kwargs)
        # TRL's fused lm_head (softmax log-probs) is an instance attribute over forward: not this model's loss
        self.model.__dict__.pop("forward", None)

    @staticmethod
    def _number_features(dataset, ntok: NumberTokenizer, args: SFTConfig, completion_only: bool = False,
                         enable_thinking: bool = False, chat_template: str | None = None, rows_name: str | None = None):
        """Raw rows -> the model's features (`tokenize_dataset`); tokenised datasets keep their features.

        Which tokens train (TRL's options, read for our formats; evaluation rows (`completion_only`) always
        get the default): prompt/completion strings: the completion, and with ``completion_only_loss=False``
        the prompt's text tokens too. Conversations (``messages`` or prompt/completion lists of messages): the
        assistant turns with their end-of-turn marks, whatever ``assistant_only_loss`` says (TRL's default False
        would train the user's text); ``completion_only_loss=False`` with ``assistant_only_loss=False`` trains
        every text token. The prompt's / user's numbers are never value targets."""
        if dataset is None:
            raise ValueError("CausalSFTTrainer needs a train_dataset")
        if "input_ids" not in dataset.column_names:
            train_all = args.completion_only_loss is False and not completion_only
            dataset = tokenize_dataset(dataset, ntok, text_column=args.dataset_text_field, max_length=args.max_length,
                                       add_eos_token=True, prompt_loss="text" if train_all else "none",
                                       assistant_only_loss=not (train_all and not args.assistant_only_loss),
                                       enable_thinking=enable_thinking, chat_template=chat_template,
                                       rows_name=rows_name or ("evaluation rows" if completion_only
                                                               else "training rows"))
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
                fit_before_training(inner, self.value_fit, self.unpacked_train_dataset, self.row_collator,
                                    self.args.device, verbose=self.is_world_process_zero(), eval_ds=self._eval_rows(),
                                    decode=getattr(self.processing_class, "decode", None))
        output = super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)
        self.fit_value_head_after_training()
        return output

    def fit_value_head_after_training(self) -> Calibration | None:
        """The value head refitted on the final features (when training moved them) and the width
        calibrated on the evaluation rows (`value_head.fit_after_training`), as at the end of `train()`. Every
        process computes the same. Returns the `Calibration`, None when not calibrated."""
        inner = unwrap_causal_model(self.accelerator.unwrap_model(self.model))
        eval_ds, cfg = self._eval_rows(), self.value_fit

        def predict() -> dict:
            bs = cfg.per_device_eval_batch_size
            batches = (self.row_collator(rows_at(eval_ds, range(i, min(i + bs, len(eval_ds)))))
                       for i in range(0, len(eval_ds), bs))
            acc = MetricAccumulator(inner.num_token_id, inner.causal_config.reg_weight,
                                    calibration=inner.causal_config.value_calibration)
            with torch.no_grad(), inference_precision(inner):
                return accumulate(inner, batches, acc, device=self.args.device).predictions()

        # the Trainer logs its own evaluations: the final predictions are needed only for the calibration
        return fit_after_training(inner, cfg, self.unpacked_train_dataset, self.row_collator, self.args.device,
                                  self.is_world_process_zero(), eval_ds,
                                  lambda refitted: predict() if cfg.calibrate_scale else {}, predict)

    def compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch=None):
        """The CausalModel's loss (Trainer's compute_loss: ``outputs.loss``), not TRL's softmax NLL."""
        return Trainer.compute_loss(self, model, inputs, return_outputs, num_items_in_batch)

    def prediction_step(self, model, inputs, prediction_loss_only: bool, ignore_keys=None):
        """Trainer's (TRL's reads ``outputs.logits``, which a CausalOutput does not have)."""
        return Trainer.prediction_step(self, model, inputs, prediction_loss_only, ignore_keys)

    def create_model_card(self, *args, **kwargs) -> None:
        """No TRL card in ``output_dir``: the adapter's own card is written with every save (`save_adapter_into`)."""


def _chat_template(args: SFTConfig) -> str | None:
    """The text of ``SFTConfig.chat_template_path`` (a jinja file, as TRL reads one), None when unset. A tokenizer
    directory (TRL clones its template and adds its tokens to the embedding) is refused: an adapter never
    resizes the base's embedding."""
    path = args.chat_template_path
    if path is None:
        return None
    if not str(path).endswith((".jinja", ".j2")):
        raise ValueError(f"CausalSFTTrainer reads chat_template_path as a jinja file (.jinja / .j2), got {path!r}: "
                         "copying a tokenizer's template would add tokens to the base's embedding")
    return read_chat_template(path)


@contextlib.contextmanager
def _assistant_mask_hidden_from_trl(args: SFTConfig):
    """`args` with assistant_only_loss off while SFTTrainer.__init__ reads it: TRL would look for ``messages`` in
    the (already tokenised) rows and swap in a template with generation markers; `CausalSFTTrainer` has already
    masked the conversations. The user's value is back afterwards."""
    saved = args.assistant_only_loss
    args.assistant_only_loss = False
    try:
        yield args
    finally:
        args.assistant_only_loss = saved


@contextlib.contextmanager
def _packing_hidden_from_trl(args: SFTConfig):
    """`args` with packing / padding_free off while SFTTrainer.__init__ reads them: it would refuse the collator
    given and pack the (skipped) preparation itself; `CausalSFTTrainer` has already packed and chosen the
    collator. The user's values are back afterwards."""
    saved = args.packing, args.padding_free
    args.packing = args.padding_free = False
    try:
        yield args
    finally:
        args.packing, args.padding_free = saved
