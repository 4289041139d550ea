"""`TrainConfig`, every setting of a training run, and its command line (`causal-adapter train`
flags through `transformers.HfArgumentParser`, ``--config FILE``)."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from ..config import DEFAULT_LORA_TARGETS, ROW_UNIT_RULES, VALUE_TRANSFORMS, CausalAdapterConfig, LoraSettings
from ..data.corpora import CORPORA
from ..modeling.row_units import MAX_PERIOD
from ..saving.assets import DTYPES

#: hidden units of each member of the value head's nonlinear correction (`TrainConfig.row_net`)
ROW_NET_HIDDEN = 64

#: ``freeze`` groups -> parameter-name prefixes of `CausalModel` (any other string is taken as a prefix).
PARAMETER_GROUPS = {
    "abduction": ("abduction.",),
    "abduction_loc": ("abduction.loc.",),
    "abduction_scale": ("abduction.scale.",),
    "noise": ("action.b_noise",),
    "cls_bias": ("action.b_cls",),
    "num_row": ("action.num_row",),
    "regression": ("action.w_reg", "action.b_reg", "action.b_noise_Y", "action.w_scale_Y"),
    "thresholds": ("action.thresholds",),
    "direction": ("numeric_embedding.direction",),
    "lora": ("backbone.",),
}



def flag(default, help: str, **kw):
    """A TrainConfig field with its command-line help (``type``/``choices``/``nargs`` optional)."""
    if isinstance(default, list):
        value = list(default)
        return field(default_factory=lambda: list(value), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class TrainConfig:
    """Every setting of a training run (the command-line flags are these names with dashes)."""

    # ---------------------------------------------------------------- model
    base_model: str | None = flag(None, "local Qwen2/Qwen2.5/Qwen3 directory or hub name loaded with "
                                        "AutoModelForCausalLM.from_pretrained (default: the embedded tiny Qwen)",
                                  type=str, aliases=["--base"])
    tokenizer: str | None = flag(None, "tokenizer directory/name (default: the base model's; the embedded "
                                       "Qwen tokenizer for the tiny default)", type=str)
    tiny_arch: str = flag("qwen2", "architecture of the embedded tiny base", choices=["qwen2", "qwen3"],
                          aliases=["--arch"])
    tiny_hidden_size: int = flag(64, "hidden size of the embedded tiny base")
    tiny_layers: int = flag(2, "layers of the embedded tiny base")
    torch_dtype: str = flag("float32", "dtype of the base weights",
                            choices=list(DTYPES), aliases=["--dtype"])
    quantization: str | None = flag(None, "load --base-model quantised with bitsandbytes (QLoRA; lm_head and the "
                                          "embedding stay full precision): 4bit (NF4) or 8bit", type=str,
                                    choices=["4bit", "8bit"])
    # ---------------------------------------------------------------- adapter
    lora: bool = flag(False, "tune the backbone with LoRA (peft) instead of freezing it")
    lora_r: int = flag(8, "LoRA rank")
    lora_alpha: int = flag(16, "LoRA alpha")
    lora_dropout: float = flag(0.0, "LoRA dropout")
    lora_target_modules: list[str] = flag(list(DEFAULT_LORA_TARGETS), "modules that get LoRA", nargs="+", type=str)
    learnable_direction: bool = flag(False, "train the numeric-embedding direction d (backprop through the backbone)")
    learnable_threshold: bool = flag(False, "train the OvR thresholds C_k")
    threshold_mode: str = flag("scalar", "one threshold or one per vocabulary row", choices=["scalar", "vector"])
    train_num_row: bool = flag(True, "train the <NUM> row of W_cls (saved as one row)")
    freeze: list[str] = flag([], "adapter parts to keep frozen: " + ", ".join(PARAMETER_GROUPS)
                             + " (or parameter-name prefixes); 'none' or nothing (the default) trains every part. "
                             "W_loc trains by default: with the value head refitted on the moving features "
                             "(--value-refit) its validation MAE is within 3 percent of W_loc frozen's "
                             "(--freeze abduction_loc; docs/values.md)", nargs="*", type=str)
    gamma0: float = flag(0.1, "initial abduction scale (the seeds' value is 10: a scale Adam moves by ~0.01 a step, "
                              "out of reach of a short run; 0.1 with --threshold-init 1 lets the token side learn where "
                              "a number and the end of the answer come, docs/predict.md)")
    threshold_init: float = flag(1.0, "initial OvR threshold C_k (P_k = 1/2 + atan((loc_S_k - C_k) / scale_S_k) / pi; "
                                      "the seeds' value is 100, which no bias reaches in a short run)")
    gate_alpha: float = flag(1.0, "regression gate floor alpha (the adapter config's default is the seeds' 0.0; "
                                  "training uses 1.0: the regression learns from the first step, measured)")
    regression_init: str = flag("ridge", "'ridge': the regression head starts as a least-squares probe on the "
                                "model's own features (penalty chosen on the validation split, else by "
                                "leave-one-out) on a fresh run, and is fitted so again after the last step when "
                                "training changed those features (LoRA, W_loc); 'none': the random init, trained "
                                "by the NLL only",
                                choices=["ridge", "none"])
    value_refit: str = flag("eval", "when training moves the features the value head reads (LoRA, W_loc, d) and "
                            "--regression-init ridge: 'eval' evaluates during training with the head fitted again "
                            "on the current features (the adapter a run stopped there would save), then restores "
                            "the training state (evaluations leave the run unchanged); 'end': evaluations during "
                            "training use the head fitted on older features. The head is fitted again after the "
                            "last step either way", choices=["eval", "end"])
    value_loss: str = flag("auto", "loss of the value head's fit before / after training: 'auto' fits each of "
                           "least squares ('squared') and the robust M-estimates by IRLS from the ridge solution "
                           "('huber', 'cauchy', 'tukey') and keeps least squares "
                           "unless a robust fit's validation MAE (else LOO MAE) is smaller by one standard error; "
                           "a name fixes it. docs/values.md has the validation figures behind the default",
                           choices=["auto", "cauchy", "huber", "squared", "tukey"])
    bf16_safe_head: str = flag("auto", "bound the value head's ridge penalty so that rounding loc_U to bf16 moves "
                               "loc_Y by < 0.5 percent of value_scale: 'on', 'off', or 'auto' = on when the heads "
                               "themselves are 16-bit (elsewhere the heads compute in fp32 and the bound costs "
                               "accuracy: docs/values.md)", choices=["auto", "on", "off"])
    calibrate_scale: bool = flag(True, "after training, on the validation split: scale |b_noise_Y| so that the "
                                       "median normalised residual |y - loc_Y| / scale_Y is 1 (the raw 50 percent "
                                       "interval is calibrated), then save the split-conformal map of those "
                                       "residuals in the adapter (value_calibration: intervals calibrated at "
                                       "every level); needs a validation split and a per-row or independent scale")
    series_ar: bool = flag(True, "after training, give each series of the file with >= 10 validation rows its own "
                                 "AR on the row's window (2, 4 or 8 values, fitted on its training rows): the head's "
                                 "value, the AR's or their even mix, whichever errs least on those rows "
                                 "(docs/predict.md, 'Many series in one file'; --no-series-ar: the head alone)")
    series_widths: bool = flag(False, "with calibrate_scale: give each series of the file with >= 20 validation "
                                      "rows its own width factor (the median of its normalised residuals) before the "
                                      "shared conformal map (docs/predict.md, 'Many series in one file'); off by "
                                      "default: on time-ordered validation rows a series' median is noisy (horizon.py "
                                      "set a: 50 percent coverage 0.51 -> 0.36 with it, together with 'season')")
    reg_weight: float = flag(1.0, "lambda in L = L_cls + lambda L_reg")
    recent_values: int = flag(32, "K: the value head also reads the values of the K most recent numbers of the "
                              "text, exactly, beside loc_U (fitted by the closed-form fits with the rest of the "
                              "head); 0 = loc_U alone, the SPEC's head. docs/values.md has the validation figures "
                              "behind the default")
    row_units: str = flag("auto", "per-row value units: each row's values, width and the numbers the value head "
                          "reads are put in a location and scale taken from the row's own numbers: those of the "
                          "predicted kind when the numbers come in records (a year and a value), else all of them "
                          "(ids, years and title numbers included), so one adapter serves values of every scale. "
                          "'auto' = the rule ('last': the last value and the mean step; 'median': the median and "
                          "the mean deviation) or the adapter's one unit system, whichever predicts the validation "
                          "rows better, each error divided by its row's own scale; 'off' = the adapter's units; "
                          "'last' / 'median' / 'season' = that rule (docs/values.md)", choices=["auto", "off", *ROW_UNIT_RULES, "season"])
    value_transform: str = flag("auto", "the scale the value's Cauchy lives on: 'log' = log y (a positive quantity: "
                                "the value exp(loc), intervals exp of the log ones, never below 0), 'identity' = "
                                "the value itself, 'auto' = log where every training target (and, in dated rows, "
                                "every number of the value's kind) is > 0 and it predicts the validation rows better than "
                                "identity by one standard error (errors divided by each row's own scale); in a file "
                                "mixing series, 'series' (log y for the rows of a series whose values are all > 0, "
                                "the value for the others) where it does; else identity (docs/values.md)",
                                choices=["auto", *VALUE_TRANSFORMS])
    row_net: int = flag(5, "in per-row units, the value head's nonlinear correction: the mean of N small MLPs "
                        "(2 x 64 GELU units) on the row's numbers and its window's shape, fitted after the linear "
                        "head and kept when it predicts the validation rows better (one standard error); 0 = the "
                        "linear head alone (docs/values.md)")
    row_scale: bool = flag(True, "in per-row units, each row's interval width also follows its window's shape: a "
                           "log-width regressed on the row's numbers and shape statistics, fitted on the validation "
                           "rows' residuals and kept when it beats a constant width there; off = the width follows "
                           "the row's scale alone (docs/values.md)")
    # ---------------------------------------------------------------- data
    dataset: str = flag("sunspots", "built-in offline corpus used when no --train-file is given (also: --corpus)",
                        choices=list(CORPORA), aliases=["--corpus"])
    corpus_window: int | None = flag(None, "history length of a time-series corpus (default: the corpus's)", type=int)
    train_file: list[str] = flag([], "training data files (jsonl/json/csv/tsv/parquet/txt, globs allowed)",
                            nargs="+", type=str)
    validation_file: list[str] = flag([], "validation data files", nargs="+", type=str)
    file_type: str | None = flag(None, "file type (default: from the extension)", type=str,
                                 choices=["json", "jsonl", "csv", "parquet", "text"])
    text_column: str = flag("text", "column of full texts (loss on every token)")
    prompt_column: str = flag("prompt", "prompt column (no loss)")
    completion_column: str = flag("completion", "completion column (loss)")
    messages_column: str = flag("messages", "column of conversations (TRL's format: lists of {role, content} "
                                "messages; prompt/completion columns of such lists work too): rendered with the "
                                "chat template, loss on the assistant turns (docs/chat.md)")
    chat_template: str | None = flag(None, "a jinja chat-template file to render conversations with (default: the "
                                           "tokenizer's; needed for a base whose tokenizer has none)", type=str)
    enable_thinking: bool = flag(False, "render conversations with thinking on (Qwen3's switch): the assistant's "
                                        "reasoning (reasoning_content, a <think> block) is trained with its reply; "
                                        "off, reasoning is dropped and replies follow the empty think block")
    assistant_only_loss: bool = flag(True, "conversations: the loss on the assistant turns only, each with its "
                                           "end-of-turn mark (--no-assistant-only-loss: on every text token; the "
                                           "numbers outside assistant turns are never value targets)")
    target_column: str = flag("target", "numeric target column (baselines only; optional)")
    previous_column: str = flag("previous", "previous-value column (persistence baseline; optional)")
    max_length: int | None = flag(None, "truncate examples to this many tokens", type=int)
    packing: bool = flag(False, "pack the training rows into rows of --max-length tokens (default: the longest "
                                "row's), none attending to another (position ids restart at each row; the value "
                                "head's recent numbers too): no padding computed. Evaluation stays unpacked "
                                "(docs/integrations.md, Packing)")
    add_eos_token: bool = flag(True, "append EOS to every completion / text, so that generation ends the answer "
                                     "after its number (--no-add-eos-token: the seeds' completions without it)")
    prompt_loss: str = flag("none", "'text': the prompt's text tokens of the training rows get the token loss too (the "
                                    "layout around numbers, e.g. the separator after one); its numbers never train the "
                                    "value head. 'none': completions only (prompt/completion strings; conversations: "
                                    "--no-assistant-only-loss)", choices=["none", "text"])
    max_train_samples: int | None = flag(None, "use only the first N training examples", type=int)
    max_eval_samples: int | None = flag(None, "use only the first N validation examples", type=int)
    # ---------------------------------------------------------------- optimisation
    learning_rate: float = flag(1e-2, "peak learning rate of the adapter heads")
    lora_learning_rate: float | None = flag(None, "learning rate of the LoRA weights (default: --learning-rate)",
                                            type=float)
    weight_decay: float = flag(0.0, "AdamW weight decay (matrices only: abduction weights, LoRA)")
    adam_beta1: float = flag(0.9, "AdamW beta1")
    adam_beta2: float = flag(0.999, "AdamW beta2")
    adam_epsilon: float = flag(1e-8, "AdamW epsilon")
    max_grad_norm: float = flag(1.0, "gradient clipping (0 = off)")
    lr_scheduler_type: str = flag("linear", "transformers.get_scheduler name (linear, cosine, constant, "
                                            "constant_with_warmup, ...)")
    warmup_steps: int = flag(0, "warmup optimizer steps (overrides --warmup-ratio)")
    warmup_ratio: float = flag(0.0, "warmup as a fraction of the total steps")
    num_train_epochs: float = flag(3.0, "epochs (ignored when --max-steps > 0)")
    max_steps: int = flag(-1, "total optimizer steps (> 0 overrides --num-train-epochs)")
    per_device_train_batch_size: int = flag(8, "examples per process per micro-batch")
    per_device_eval_batch_size: int = flag(8, "examples per process per evaluation batch")
    gradient_accumulation_steps: int = flag(1, "micro-batches per optimizer step")
    gradient_checkpointing: bool = flag(False, "activation checkpointing in the backbone's layers (transformers', "
                                               "non-reentrant): less activation memory for one more backbone "
                                               "forward per step; matters only when the backbone gets gradients "
                                               "(--lora, --learnable-direction)")
    mixed_precision: str | None = flag(None, "no / fp16 / bf16 (default: accelerate's setting)", type=str,
                                       choices=["no", "fp16", "bf16"])
    seed: int = flag(42, "seed of the adapter initialisation, the data order and every RNG")
    dataloader_num_workers: int = flag(0, "DataLoader worker processes")
    # ---------------------------------------------------------------- evaluation / saving / logging
    eval_steps: int = flag(0, "evaluate every N optimizer steps (0: only at the end)")
    eval_on_start: bool = flag(False, "also evaluate before the first step")
    save_steps: int = flag(0, "write a checkpoint every N optimizer steps (0: none; the final adapter is always saved)")
    save_total_limit: int = flag(2, "keep only the last K checkpoints (0: keep all)")
    logging_steps: int = flag(10, "log the training loss every N optimizer steps")
    output_dir: str = flag("causal_adapter_output", "where the adapter, checkpoints, logs and plot go")
    resume_from_checkpoint: str | None = flag(None, "a checkpoint directory, or 'latest' (the newest in "
                                                    "--output-dir; starts fresh if there is none)", type=str)
    report_to: list[str] = flag([], "accelerate trackers (tensorboard, wandb, ..., all); skipped when not installed",
                           nargs="*", type=str)
    plot: bool = flag(True, "write OUTPUT_DIR/training.png (needs matplotlib)")
    progress: bool = flag(True, "tqdm progress bar (main process)")
    # ---------------------------------------------------------------- distributed
    cpu: bool = flag(False, "force CPU (also: ACCELERATE_USE_CPU=1)")
    ddp_backend: str | None = flag(None, "torch.distributed backend (nccl, gloo, ...; default: accelerate's, gloo for "
                                         "DeepSpeed on CPUs)", type=str)
    ddp_find_unused_parameters: bool = flag(True, "DDP find_unused_parameters (safe when a head gets no gradient)")
    expected_num_processes: int | None = flag(None, "warn when the launch gives another number of processes",
                                              type=int)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        def positive(name, allow_zero=False):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0 or (v == 0 and not allow_zero):
                raise ValueError(f"{name} must be a {'non-negative' if allow_zero else 'positive'} integer, got {v!r}")

        for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps",
                     "tiny_hidden_size", "tiny_layers", "lora_r"):
            positive(name)
        for name in ("eval_steps", "save_steps", "save_total_limit", "logging_steps", "warmup_steps",
                     "dataloader_num_workers"):
            positive(name, allow_zero=True)
        if not isinstance(self.max_steps, int) or isinstance(self.max_steps, bool):
            raise ValueError(f"max_steps must be an integer, got {self.max_steps!r}")
        if self.max_steps <= 0 and not self.num_train_epochs > 0:
            raise ValueError("give num_train_epochs > 0 or max_steps > 0")
        if not self.learning_rate > 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate!r}")
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise ValueError(f"warmup_ratio must be in [0, 1), got {self.warmup_ratio!r}")
        if self.weight_decay < 0 or self.max_grad_norm < 0:
            raise ValueError("weight_decay and max_grad_norm must be >= 0")
        if self.quantization is not None and self.base_model is None:
            raise ValueError("--quantization needs --base-model (the embedded tiny base is built in memory)")
        if self.chat_template is not None and not os.path.isfile(self.chat_template):
            raise ValueError(f"--chat-template {self.chat_template!r}: no such file (a jinja chat-template file)")
        if self.validation_file and not self.train_file:
            raise ValueError("--validation-file needs --train-file")
        if isinstance(self.row_net, bool) or not isinstance(self.row_net, int) or not 0 <= self.row_net <= 64:
            raise ValueError(f"row_net must be an integer in [0, 64], got {self.row_net!r}")
        for name in ("max_train_samples", "max_eval_samples", "max_length", "corpus_window", "expected_num_processes"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
                raise ValueError(f"{name} must be a positive integer or None, got {v!r}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def adapter_config(self) -> CausalAdapterConfig:
        """The CausalAdapterConfig this run builds (when no model is passed to `train`)."""
        lora = None
        if self.lora:
            lora = LoraSettings(r=self.lora_r, alpha=self.lora_alpha, dropout=self.lora_dropout,
                                target_modules=list(self.lora_target_modules))
        return CausalAdapterConfig(
            lora=lora, learnable_direction=self.learnable_direction, learnable_threshold=self.learnable_threshold,
            threshold_mode=self.threshold_mode, train_num_row=self.train_num_row, gamma0=self.gamma0,
            threshold_init=self.threshold_init,
            alpha=self.gate_alpha, reg_weight=self.reg_weight, seed=self.seed, recent_values=self.recent_values,
            recent_window=self.recent_values * MAX_PERIOD if self.recent_values else None,
            value_row_net=self.row_net if self.recent_values else 0,
            value_row_net_hidden=ROW_NET_HIDDEN if self.recent_values and self.row_net else 0,
            value_row_scale=bool(self.row_scale and self.recent_values),
        )
