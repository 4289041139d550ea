"""Fine-tuning entry point (accelerate): ``causal-adapter train``, ``python -m causal_adapter.train``,
``accelerate launch -m causal_adapter.train`` and the Python API `train(model, TrainConfig(...))`.

What a run does
* Model: a local Qwen2/Qwen2.5/Qwen3 directory or hub name (``AutoModelForCausalLM``) or, by
  default, the embedded tiny Qwen (`assets.build_tiny_qwen`, real 151,936-row vocabulary) with
  the real Qwen tokenizer (`assets.load_qwen_tokenizer`), wrapped by `get_causal_model` (frozen
  backbone, or LoRA through peft). A frozen backbone with nothing trainable below the heads
  runs under ``torch.no_grad()`` inside `CausalModel.forward`: no activations, no backward
  through the transformer.
* Data: local files (`data.load_text_dataset`: jsonl/json/csv/tsv/parquet/txt, a ``text``
  column or ``prompt`` + ``completion``) or a built-in offline corpus (`data.build_corpus`,
  default ``sunspots``), tokenised number-aware (`data.tokenize_dataset`), padded on the right.
* Optimisation: AdamW (weight decay on matrices only), `transformers.get_scheduler`, gradient
  accumulation, gradient clipping, mixed precision via accelerate.
* Order of examples: epoch e uses the permutation drawn from ``seed + e`` (padded to a multiple
  of the number of processes and sharded like ``DistributedSampler``); nothing else touches
  the global RNGs except the model itself (LoRA dropout), so a run is reproducible from its seed.
* Checkpoints ``OUTPUT_DIR/checkpoint-STEP``: adapter-only (the adapter's two files, loadable
  with `CausalModel.from_pretrained`), plus ``optimizer.pt``, ``scheduler.pt``,
  ``rng_state_RANK.json`` (python, numpy, torch, cuda) and ``trainer_state.json`` (step, epoch,
  position in the epoch). Never the base weights (accelerate's ``save_state`` would write the
  full model: it is not used). Written atomically (`artifacts.atomic_write_dir`); the last
  ``save_total_limit`` are kept. Resuming restores all of it and skips the batches of the
  current epoch already consumed (without loading them): a run interrupted at step k and
  resumed ends with the same adapter as an uninterrupted one (bit-identical on CPU).
* Evaluation on the validation split every ``eval_steps`` and at the end (`metrics`), sharded
  over processes and gathered; ``metrics.jsonl`` log, accelerate trackers (``report_to``),
  tqdm on the main process, and a PNG of the curves and of the validation values with
  their predicted 50% / 90% bands
  (matplotlib optional).
* Distributed: one ``forward`` holds embedding, backbone, heads and loss (what DDP needs);
  ``find_unused_parameters=True`` by default so a parameter that gets no gradient on a step
  cannot stall DDP. Multi-process CPU runs use gloo:
  ``ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 --num_machines 1
  --mixed_precision no --dynamo_backend no -m causal_adapter.train ...``
  (``accelerate launch --cpu --num_processes 2`` starts ONE process: detected and warned).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import random
import re
import shutil
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch.utils.data import DataLoader, Sampler

from .artifacts import atomic_write_dir, read_adapter_files, write_adapter_files
from .assets import DTYPES, load_base
from .config import DEFAULT_LORA_TARGETS, DEFAULT_SCALE_FLOOR, CausalAdapterConfig, LoraSettings
from .data import CORPORA, IGNORE_INDEX
from .integrations import unwrap_model
from .metrics import MODEL_INPUTS, MetricAccumulator, accumulate, format_metrics_table, train_median

CHECKPOINT_PREFIX = "checkpoint-"
ADAPTER_SUBDIR = "adapter"
METRICS_LOG = "metrics.jsonl"
FINAL_METRICS = "final_metrics.json"
PLOT_NAME = "training.png"
TRAINER_STATE = "trainer_state.json"

#: ``freeze`` groups -> parameter-name prefixes of `CausalModel` (any other string is taken as a prefix).
PARAMETER_GROUPS = {
    "abduction": ("abduction.",),
    "abduction_loc": ("abduction.loc.",),
    "abduction_scale": ("abduction.scale.",),
    "noise": ("action.b_noise",),
    "cls_bias": ("action.b_cls",),
    "num_row": ("action.num_row",),
    "regression": ("action.w_reg", "action.b_reg", "action.b_noise_Y"),
    "thresholds": ("action.thresholds",),
    "direction": ("numeric_embedding.direction",),
    "lora": ("backbone.",),
}


class LaunchWarning(UserWarning):
    """The launch did not give the processes that were asked for."""


def _opt(default, help: str, **kw):
    """A TrainConfig field with its command-line help (``type``/``choices``/``nargs`` optional)."""
    if isinstance(default, list):
        value = list(default)
        return field(default_factory=lambda: list(value), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class TrainConfig:
    """Every setting of a training run (the command-line flags are these names with dashes)."""

    # ---------------------------------------------------------------- model
    base_model: str | None = _opt(None, "local Qwen2/Qwen2.5/Qwen3 directory or hub name loaded with "
                                        "AutoModelForCausalLM.from_pretrained (default: the embedded tiny Qwen)",
                                  type=str, aliases=["--base"])
    tokenizer: str | None = _opt(None, "tokenizer directory/name (default: the base model's; the embedded "
                                       "Qwen tokenizer for the tiny default)", type=str)
    tiny_arch: str = _opt("qwen2", "architecture of the embedded tiny base", choices=["qwen2", "qwen3"],
                          aliases=["--arch"])
    tiny_hidden_size: int = _opt(64, "hidden size of the embedded tiny base")
    tiny_layers: int = _opt(2, "layers of the embedded tiny base")
    torch_dtype: str = _opt("float32", "dtype of the base weights",
                            choices=list(DTYPES), aliases=["--dtype"])
    # ---------------------------------------------------------------- adapter
    lora: bool = _opt(False, "tune the backbone with LoRA (peft) instead of freezing it")
    lora_r: int = _opt(8, "LoRA rank")
    lora_alpha: int = _opt(16, "LoRA alpha")
    lora_dropout: float = _opt(0.0, "LoRA dropout")
    lora_target_modules: list[str] = _opt(list(DEFAULT_LORA_TARGETS), "modules that get LoRA", nargs="+", type=str)
    learnable_direction: bool = _opt(False, "train the numeric-embedding direction d (backprop through the backbone)")
    learnable_threshold: bool = _opt(False, "train the OvR thresholds C_k")
    threshold_mode: str = _opt("scalar", "one threshold or one per vocabulary row", choices=["scalar", "vector"])
    train_num_row: bool = _opt(True, "train the <NUM> row of W_cls (saved as one row)")
    freeze: list[str] = _opt(["abduction_loc"], "adapter parts to keep frozen: " + ", ".join(PARAMETER_GROUPS)
                             + " (or parameter-name prefixes); 'none' trains every part. Default abduction_loc: "
                             "the OvR loss's updates of W_loc move loc_U under the warm-started regression "
                             "(measured: sunspots MAE 80,000 vs 15.6)", nargs="*", type=str)
    gamma0: float = _opt(10.0, "initial abduction scale")
    gate_alpha: float = _opt(1.0, "regression gate floor alpha (the adapter config's default is the seeds' 0.0; "
                                  "training uses 1.0: the regression learns from the first step, measured)")
    regression_init: str = _opt("ridge", "'ridge': the regression head starts as a least-squares probe on the "
                                "model's own features (penalty by leave-one-out) on a fresh run, and is fitted so "
                                "again after the last step when training changed those features (LoRA, W_loc); "
                                "'none': the random init, trained by the NLL only",
                                choices=["ridge", "none"])
    calibrate_scale: bool = _opt(True, "after training, set |b_noise_Y| so that the regression scale equals the "
                                       "median absolute validation residual (the half-width of the central 50 percent interval), when "
                                       "there is a validation split and the regression scale is independent")
    reg_weight: float = _opt(1.0, "lambda in L = L_cls + lambda L_reg")
    # ---------------------------------------------------------------- data
    dataset: str = _opt("sunspots", "built-in offline corpus used when no --train-file is given",
                        choices=list(CORPORA))
    corpus_window: int | None = _opt(None, "history length of a time-series corpus (default: the corpus's)", type=int)
    train_file: list[str] = _opt([], "training data files (jsonl/json/csv/tsv/parquet/txt, globs allowed)",
                            nargs="+", type=str)
    validation_file: list[str] = _opt([], "validation data files", nargs="+", type=str)
    file_type: str | None = _opt(None, "file type (default: from the extension)", type=str,
                                 choices=["json", "jsonl", "csv", "parquet", "text"])
    text_column: str = _opt("text", "column of full texts (loss on every token)")
    prompt_column: str = _opt("prompt", "prompt column (no loss)")
    completion_column: str = _opt("completion", "completion column (loss)")
    target_column: str = _opt("target", "numeric target column (baselines only; optional)")
    previous_column: str = _opt("previous", "previous-value column (persistence baseline; optional)")
    max_length: int | None = _opt(None, "truncate examples to this many tokens", type=int)
    add_eos_token: bool = _opt(False, "append EOS to every completion / text")
    max_train_samples: int | None = _opt(None, "use only the first N training examples", type=int)
    max_eval_samples: int | None = _opt(None, "use only the first N validation examples", type=int)
    # ---------------------------------------------------------------- optimisation
    learning_rate: float = _opt(1e-2, "peak learning rate of the adapter heads")
    lora_learning_rate: float | None = _opt(None, "learning rate of the LoRA weights (default: --learning-rate)",
                                            type=float)
    weight_decay: float = _opt(0.0, "AdamW weight decay (matrices only: abduction weights, LoRA)")
    adam_beta1: float = _opt(0.9, "AdamW beta1")
    adam_beta2: float = _opt(0.999, "AdamW beta2")
    adam_epsilon: float = _opt(1e-8, "AdamW epsilon")
    max_grad_norm: float = _opt(1.0, "gradient clipping (0 = off)")
    lr_scheduler_type: str = _opt("linear", "transformers.get_scheduler name (linear, cosine, constant, "
                                            "constant_with_warmup, ...)")
    warmup_steps: int = _opt(0, "warmup optimizer steps (overrides --warmup-ratio)")
    warmup_ratio: float = _opt(0.0, "warmup as a fraction of the total steps")
    num_train_epochs: float = _opt(3.0, "epochs (ignored when --max-steps > 0)")
    max_steps: int = _opt(-1, "total optimizer steps (> 0 overrides --num-train-epochs)")
    per_device_train_batch_size: int = _opt(8, "examples per process per micro-batch")
    per_device_eval_batch_size: int = _opt(8, "examples per process per evaluation batch")
    gradient_accumulation_steps: int = _opt(1, "micro-batches per optimizer step")
    mixed_precision: str | None = _opt(None, "no / fp16 / bf16 (default: accelerate's setting)", type=str,
                                       choices=["no", "fp16", "bf16"])
    seed: int = _opt(42, "seed of the adapter initialisation, the data order and every RNG")
    dataloader_num_workers: int = _opt(0, "DataLoader worker processes")
    # ---------------------------------------------------------------- evaluation / saving / logging
    eval_steps: int = _opt(0, "evaluate every N optimizer steps (0: only at the end)")
    eval_on_start: bool = _opt(False, "also evaluate before the first step")
    save_steps: int = _opt(0, "write a checkpoint every N optimizer steps (0: none; the final adapter is always saved)")
    save_total_limit: int = _opt(2, "keep only the last K checkpoints (0: keep all)")
    logging_steps: int = _opt(10, "log the training loss every N optimizer steps")
    output_dir: str = _opt("causal_adapter_output", "where the adapter, checkpoints, logs and plot go")
    resume_from_checkpoint: str | None = _opt(None, "a checkpoint directory, or 'latest' (the newest in "
                                                    "--output-dir; starts fresh if there is none)", type=str)
    report_to: list[str] = _opt([], "accelerate trackers (tensorboard, wandb, ..., all); skipped when not installed",
                           nargs="*", type=str)
    plot: bool = _opt(True, "write OUTPUT_DIR/training.png (needs matplotlib)")
    progress: bool = _opt(True, "tqdm progress bar (main process)")
    # ---------------------------------------------------------------- distributed
    cpu: bool = _opt(False, "force CPU (also: ACCELERATE_USE_CPU=1)")
    ddp_find_unused_parameters: bool = _opt(True, "DDP find_unused_parameters (safe when a head gets no gradient)")
    expected_num_processes: int | None = _opt(None, "warn when the launch gives another number of processes",
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
        if self.validation_file and not self.train_file:
            raise ValueError("--validation-file needs --train-file")
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
            alpha=self.gate_alpha, reg_weight=self.reg_weight, seed=self.seed,
        )


@dataclass
class TrainState:
    """Position of a run: optimizer steps done, epoch, micro-batches of this epoch consumed."""

    global_step: int = 0
    epoch: int = 0
    batches_in_epoch: int = 0
    total_steps: int = 0
    batches_per_epoch: int = 0

    @property
    def epoch_float(self) -> float:
        return self.epoch + self.batches_in_epoch / max(1, self.batches_per_epoch)


@dataclass
class TrainResult:
    """What `train` returns. `model` is the trained CausalModel (unwrapped)."""

    model: Any
    global_step: int
    train_loss: float | None
    eval_metrics: dict | None
    eval_history: list
    output_dir: Path
    adapter_dir: Path | None
    checkpoints: list
    log_path: Path | None
    plot_path: Path | None
    num_processes: int
    resumed_from: Path | None = None


# ============================================================================ building blocks
def load_base_and_tokenizer(config: TrainConfig):
    """(base model, tokenizer) for `config` (`assets.load_base`): the embedded tiny Qwen + the real
    Qwen tokenizer by default, else ``AutoModelForCausalLM`` / ``AutoTokenizer`` from ``base_model``."""
    return load_base(config.base_model, config.tiny_arch, config.torch_dtype, config.tiny_hidden_size,
                     config.tiny_layers, tokenizer=config.tokenizer)


def freeze_parts(model, parts: Sequence[str]) -> list[str]:
    """Set requires_grad=False on the adapter parameters of the named groups (`PARAMETER_GROUPS`)
    or name prefixes; returns the frozen names. Unknown names raise."""
    frozen = []
    for part in parts:
        if part == "none":  # `--freeze none`: train every part
            continue
        prefixes = PARAMETER_GROUPS.get(part, (part,))
        hits = [(n, p) for n, p in model.named_parameters() if p.requires_grad and n.startswith(prefixes)]
        if part == "lora":
            hits = [(n, p) for n, p in hits if "lora_" in n]
        if not hits:
            names = [n for n, _ in model.trainable_parameters()]
            raise ValueError(f"--freeze {part!r} matches no trainable parameter; groups: {list(PARAMETER_GROUPS)}; "
                             f"trainable parameters: {names}")
        for n, p in hits:
            p.requires_grad_(False)
            frozen.append(n)
    return frozen


def make_optimizer(model, config: TrainConfig) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices (ndim >= 2) only; LoRA weights may get their own lr."""
    groups: dict[tuple[float, float], list] = {}
    for name, p in model.trainable_parameters():
        lr = config.lora_learning_rate if ("lora_" in name and config.lora_learning_rate) else config.learning_rate
        wd = config.weight_decay if p.ndim >= 2 else 0.0
        groups.setdefault((lr, wd), []).append(p)
    if not groups:
        raise ValueError("nothing to train: every adapter parameter is frozen")
    return torch.optim.AdamW(
        [{"params": ps, "lr": lr, "weight_decay": wd} for (lr, wd), ps in groups.items()],
        lr=config.learning_rate, betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_epsilon,
    )


class EpochSampler(Sampler[int]):
    """Indices of one process for one epoch: a permutation drawn from ``seed + epoch`` (or the
    identity with shuffle=False), padded by wrapping to a multiple of ``num_replicas`` and taken
    ``rank::num_replicas`` (as ``DistributedSampler``), starting after the first ``start`` of them.
    Uses its own generator: the global RNGs are untouched."""

    def __init__(self, num_examples: int, num_replicas: int = 1, rank: int = 0, seed: int = 0, shuffle: bool = True):
        if num_examples <= 0:
            raise ValueError("the training set is empty")
        self.n, self.world, self.rank, self.seed, self.shuffle = num_examples, num_replicas, rank, seed, shuffle
        self.epoch, self.start = 0, 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start = epoch, start

    @property
    def shard_size(self) -> int:
        return math.ceil(self.n / self.world)

    def shard(self) -> list[int]:
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.n, generator=g).tolist()
        else:
            order = list(range(self.n))
        total = self.shard_size * self.world
        while len(order) < total:
            order += order[: total - len(order)]
        return order[self.rank:total:self.world]

    def __iter__(self):
        return iter(self.shard()[self.start:])

    def __len__(self) -> int:
        return self.shard_size - self.start


# ---------------------------------------------------------------------------- data
def _feature_columns(ds, config: TrainConfig):
    """Rename the baseline columns to target/previous and keep only what the loop uses."""
    cols = ds.column_names
    for src, dst in ((config.target_column, "target"), (config.previous_column, "previous")):
        if src != dst and src in cols and dst not in cols:
            ds = ds.rename_column(src, dst)
    keep = [c for c in (*MODEL_INPUTS, "target", "previous") if c in ds.column_names]
    return ds.select_columns(keep)


def prepare_datasets(config: TrainConfig, number_tokenizer, train_dataset=None, eval_dataset=None,
                     accelerator=None):
    """(train, validation or None, train targets or None): tokenised, columns selected.

    Datasets passed in are used as they are when they already have ``input_ids`` (pre-tokenised),
    else tokenised; otherwise the files or built-in corpus of `config` are loaded."""
    import datasets

    from .data import build_corpus, load_text_dataset, tokenize_dataset

    if train_dataset is None:
        if config.train_file:
            columns = (config.text_column, config.prompt_column, config.completion_column)  # CSV: read as text
            train_dataset = load_text_dataset(config.train_file, file_type=config.file_type, string_columns=columns)
            if config.validation_file:
                eval_dataset = load_text_dataset(config.validation_file, file_type=config.file_type,
                                                 string_columns=columns)
        else:
            kw = {} if config.corpus_window is None else {"window": config.corpus_window}
            dd = build_corpus(config.dataset, **kw)
            train_dataset, eval_dataset = dd["train"], dd["validation"]
    train_dataset, eval_dataset = _materialize_streams(config, train_dataset, eval_dataset, accelerator)
    for ds in (train_dataset, eval_dataset):
        if ds is not None and not isinstance(ds, datasets.Dataset):
            raise ValueError(f"training needs a datasets.Dataset or a streaming datasets.IterableDataset, got "
                             f"{type(ds).__name__}")
    if config.max_train_samples:
        train_dataset = train_dataset.select(range(min(config.max_train_samples, len(train_dataset))))
    if eval_dataset is not None and config.max_eval_samples:
        eval_dataset = eval_dataset.select(range(min(config.max_eval_samples, len(eval_dataset))))
    targets = None
    if config.target_column in train_dataset.column_names:
        targets = [v for v in train_dataset[config.target_column] if isinstance(v, (int, float))]

    def tok(ds):
        if ds is None or "input_ids" in ds.column_names:
            return ds
        if number_tokenizer is None:
            raise ValueError("the dataset is not tokenised (no input_ids column): pass tokenizer=... to train()")
        return tokenize_dataset(ds, number_tokenizer, text_column=config.text_column,
                                prompt_column=config.prompt_column, completion_column=config.completion_column,
                                max_length=config.max_length, add_eos_token=config.add_eos_token)

    ctx = accelerator.main_process_first() if accelerator is not None else contextlib.nullcontext()
    with ctx:
        train_dataset, eval_dataset = tok(train_dataset), tok(eval_dataset)
    train_dataset = _feature_columns(train_dataset, config)
    if eval_dataset is not None:
        eval_dataset = _feature_columns(eval_dataset, config)
    return train_dataset, eval_dataset, targets


def features_trained(inner) -> bool:
    """True when training changed what the regression head reads (LoRA, W_loc / b_loc, d)."""
    return any(p.requires_grad for n, p in inner.named_parameters()
               if n.startswith(("backbone.", "abduction.loc.", "numeric_embedding.")))


def fit_value_head(inner, config: TrainConfig, train_ds, collator, device, verbose: bool = False,
                   max_rows: int = 8192) -> dict:
    """Before step 1 of a fresh run: fit the value units (and decimals) on the training targets
    when the adapter has none, then, with ``regression_init='ridge'``, the ridge warm start of the
    regression head (`value_fit`). Every process computes the same from the same rows."""
    from .value_fit import fit_value_units, ridge_warm_start, value_decimals

    summary: dict = {}
    rows = train_ds.select(range(min(len(train_ds), max_rows)))
    num_id = inner.num_token_id
    value_column = "label_values" if "label_values" in rows.column_names else "numeric_values"  # as forward
    values = [v for labels, vals in zip(rows["labels"], rows[value_column])
              for lab, v in zip(labels, vals) if lab == num_id]
    if not values:
        return summary
    if inner.config.value_loc is None:
        loc, scale = fit_value_units(values)
        inner.set_value_units(loc, scale, value_decimals(values))
        summary.update(value_loc=loc, value_scale=scale, value_decimals=inner.config.value_decimals)
    if config.regression_init == "ridge":
        inner.to(device)
        batches = (collator(_rows(rows, range(i, min(i + config.per_device_eval_batch_size, len(rows)))))
                   for i in range(0, len(rows), config.per_device_eval_batch_size))
        summary.update(ridge_warm_start(inner, batches, device, max_rows) or {})
    if verbose and summary:
        print("value head: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                         for k, v in summary.items()), file=sys.stderr)
    return summary


def _materialize_streams(config: TrainConfig, train_dataset, eval_dataset, accelerator=None):
    """Streaming `datasets.IterableDataset`s: the training stream is read up to the examples the run
    consumes (max_steps x per-device batch x accumulation x processes, in stream order; it needs
    max_steps > 0) and the validation stream up to max_eval_samples (or to its end); both are then
    map-style datasets for the rest of the run. So a resumed run re-reads the same first examples of
    the (deterministic) stream and continues exactly where it stopped, as for a map-style dataset; a
    stream shorter than what the run needs is cycled over as epochs."""
    import datasets

    world = accelerator.num_processes if accelerator is not None else 1

    def take(ds, n):
        rows = list(ds.take(n) if n is not None else ds)
        if not rows:
            raise ValueError("the streaming dataset yielded no example")
        return datasets.Dataset.from_list(rows)

    if isinstance(train_dataset, datasets.IterableDataset):
        if config.max_steps <= 0:
            raise ValueError("a streaming train_dataset (datasets.IterableDataset) has no length: set max_steps > 0 "
                             "(num_train_epochs cannot be counted on a stream)")
        n = config.max_steps * config.per_device_train_batch_size * config.gradient_accumulation_steps * world
        if config.max_train_samples:
            n = min(n, config.max_train_samples)
        train_dataset = take(train_dataset, n)
    if isinstance(eval_dataset, datasets.IterableDataset):
        eval_dataset = take(eval_dataset, config.max_eval_samples)
    return train_dataset, eval_dataset


def _rows(ds, indices: Sequence[int]) -> list[dict]:
    cols = ds[list(indices)]
    keys = list(cols)
    return [dict(zip(keys, vals)) for vals in zip(*(cols[k] for k in keys))]


# ---------------------------------------------------------------------------- RNG / checkpoints
def _rng_state() -> dict:
    """JSON-safe states of the python, numpy, torch and cuda generators."""
    import numpy as np

    py = random.getstate()
    npk, npstate, nppos, nphg, npg = np.random.get_state()
    state = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [npk, npstate.tolist(), int(nppos), int(nphg), float(npg)],
        "torch": torch.get_rng_state().tolist(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def _set_rng_state(state: dict) -> None:
    import numpy as np

    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    k, st, pos, hg, g = state["numpy"]
    np.random.set_state((k, np.array(st, dtype=np.uint32), pos, hg, g))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])


def list_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """``checkpoint-STEP`` directories of `output_dir`, oldest first."""
    out = Path(output_dir)
    if not out.is_dir():
        return []
    found = []
    for p in out.iterdir():
        m = re.fullmatch(re.escape(CHECKPOINT_PREFIX) + r"(\d+)", p.name)
        if m and p.is_dir() and (p / TRAINER_STATE).is_file():
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def _resolve_resume(config: TrainConfig) -> Path | None:
    r = config.resume_from_checkpoint
    if r is None:
        return None
    if r == "latest":
        ckpts = list_checkpoints(config.output_dir)
        return ckpts[-1] if ckpts else None
    path = Path(r)
    if not (path / TRAINER_STATE).is_file():
        raise FileNotFoundError(f"{str(path)!r} is not a training checkpoint (no {TRAINER_STATE})")
    return path


# ---------------------------------------------------------------------------- launch checks
def launch_warnings(num_processes: int, expected: int | None = None, env: dict | None = None) -> list[str]:
    """Messages for a launch that did not give the processes that were asked for."""
    env = os.environ if env is None else env
    msgs = []
    cpu_recipe = ("for N CPU processes (DDP over gloo) use: ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu "
                  "--num_processes N --num_machines 1 --mixed_precision no --dynamo_backend no "
                  "-m causal_adapter.train ...")
    if expected is not None and expected != num_processes:
        msgs.append(f"expected {expected} processes but this run has {num_processes}; {cpu_recipe}")
    if num_processes == 1:
        world = int(env.get("WORLD_SIZE", "1") or 1)
        if world > 1:
            msgs.append(f"WORLD_SIZE={world} but accelerate set up ONE process (no GPU and not in CPU mode?): "
                        f"pass --cpu or set ACCELERATE_USE_CPU=1; {cpu_recipe}")
        elif "MASTER_ADDR" in env and "ACCELERATE_USE_CPU" in env and "LOCAL_RANK" not in env:
            # accelerate's simple launcher sets MASTER_ADDR only for --num_processes > 1, and starts one process
            msgs.append("accelerate launch was asked for several processes but started ONE "
                        "(`accelerate launch --cpu --num_processes N` does not start DDP); " + cpu_recipe)
    return msgs


def _make_accelerator(config: TrainConfig):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedDataParallelKwargs

    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    cpu = config.cpu or (world > 1 and not torch.cuda.is_available())
    log_with = _available_trackers(config.report_to)
    kwargs = dict(cpu=cpu, mixed_precision=config.mixed_precision,
                  kwargs_handlers=[DistributedDataParallelKwargs(
                      find_unused_parameters=config.ddp_find_unused_parameters)])
    if log_with:
        kwargs.update(log_with=log_with, project_dir=config.output_dir)
    try:
        return Accelerator(**kwargs)
    except ValueError as e:
        # a previous run in this (single) process fixed another mixed precision: start afresh
        if "already been initialized" not in str(e) or world > 1:
            raise
        AcceleratorState._reset_state()
        return Accelerator(**kwargs)


_TRACKER_MODULES = {"tensorboard": ("tensorboard", "tensorboardX"), "wandb": ("wandb",), "mlflow": ("mlflow",),
                    "comet_ml": ("comet_ml",), "aim": ("aim",), "clearml": ("clearml",), "dvclive": ("dvclive",),
                    "swanlab": ("swanlab",), "trackio": ("trackio",)}


def _available_trackers(report_to: Sequence[str]) -> list[str] | str | None:
    import importlib.util

    names = [r for r in report_to if r and r != "none"]
    if not names:
        return None
    if "all" in names:
        return "all"
    ok = []
    for n in names:
        mods = _TRACKER_MODULES.get(n, (n,))
        if any(importlib.util.find_spec(m) is not None for m in mods):
            ok.append(n)
        else:
            warnings.warn(f"tracker {n!r} is not installed: skipped (pip install {mods[0]})")
    return ok or None


# ============================================================================ train
def train(
    model=None,
    config: TrainConfig | None = None,
    *,
    train_dataset=None,
    eval_dataset=None,
    tokenizer=None,
    train_targets: Sequence[float] | None = None,
    callbacks: Sequence[Callable[[TrainState, dict], None]] = (),
) -> TrainResult:
    """Train a causal adapter; see the module docstring.

    model: a `CausalModel` to train, or None to build one from `config` (base model, tokenizer,
        adapter settings). train_dataset / eval_dataset: `datasets.Dataset`s, raw (text or
        prompt/completion columns; then `tokenizer` is needed unless the model is built here) or
        tokenised (`data.tokenize_dataset` features); default: `config`'s files or corpus.
    train_targets: train-split target values for the constant baseline (default: the train
        dataset's target column, when it has one).
    callbacks: called on every process after each optimizer step (after logging, evaluation and
        checkpointing) with the `TrainState` and the step's logs.
    """
    from accelerate.utils import gather_object, set_seed
    from transformers import get_scheduler

    from .model import get_causal_model
    from .numbers import NumberTokenizer

    config = config or TrainConfig()
    accelerator = _make_accelerator(config)
    is_main = accelerator.is_main_process
    world, rank = accelerator.num_processes, accelerator.process_index
    for msg in launch_warnings(world, config.expected_num_processes):
        warnings.warn(msg, LaunchWarning, stacklevel=2)
    out_dir = Path(config.output_dir)
    if is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
    set_seed(config.seed)

    # ---------------------------------------------------------------- model + data
    if model is None:
        base, loaded_tok = load_base_and_tokenizer(config)
        tokenizer = tokenizer or loaded_tok
        model = get_causal_model(base, config.adapter_config(), tokenizer=tokenizer)
    inner = model
    if config.freeze:
        freeze_parts(inner, config.freeze)
    ntok = NumberTokenizer(tokenizer, inner.num_token_id) if tokenizer is not None else None
    train_ds, eval_ds, targets = prepare_datasets(config, ntok, train_dataset, eval_dataset, accelerator)
    if train_targets is None:
        train_targets = targets
    constant = train_median(train_targets) if train_targets else None
    if ntok is not None:
        pad_id = ntok.pad_token_id
    else:
        pad_id = getattr(inner.backbone.config, "pad_token_id", None)
        pad_id = 0 if pad_id is None else int(pad_id)
    from .data import NumericCollator

    collator = NumericCollator(pad_id, padding_side="right")

    resumed_from = _resolve_resume(config)
    if resumed_from is None:  # a resumed run takes the units and heads from its checkpoint
        fit_value_head(inner, config, train_ds, collator, accelerator.device, verbose=is_main)

    bs, accum = config.per_device_train_batch_size, config.gradient_accumulation_steps
    sampler = EpochSampler(len(train_ds), world, rank, seed=config.seed)
    loader = DataLoader(train_ds, batch_size=bs, sampler=sampler, collate_fn=collator,
                        num_workers=config.dataloader_num_workers,
                        generator=torch.Generator().manual_seed(config.seed))  # own generator: global RNG untouched
    batches_per_epoch = math.ceil(sampler.shard_size / bs)
    updates_per_epoch = math.ceil(batches_per_epoch / accum)
    total_steps = config.max_steps if config.max_steps > 0 else math.ceil(config.num_train_epochs * updates_per_epoch)
    warmup = config.warmup_steps or math.ceil(config.warmup_ratio * total_steps)

    optimizer = make_optimizer(inner, config)
    scheduler = get_scheduler(config.lr_scheduler_type, optimizer, num_warmup_steps=warmup,
                              num_training_steps=total_steps)
    from accelerate.utils import DistributedType

    if accelerator.distributed_type in (DistributedType.DEEPSPEED, DistributedType.FSDP):
        if accelerator.distributed_type == DistributedType.DEEPSPEED and accum > 1:
            raise ValueError("under DeepSpeed set gradient_accumulation_steps in the DeepSpeed config and keep "
                             "--gradient-accumulation-steps 1 (DeepSpeed steps inside backward)")
        warnings.warn(f"{accelerator.distributed_type} is not exercised by causal_adapter's CPU test-suite: "
                      "check that a saved checkpoint reloads (CausalModel.from_pretrained) before relying on it",
                      stacklevel=2)
    model, optimizer = accelerator.prepare(inner, optimizer)
    eval_model = accelerator.unwrap_model(model)
    inner = unwrap_model(eval_model)
    device = accelerator.device
    trainable = [p for _, p in inner.trainable_parameters()]

    state = TrainState(total_steps=total_steps, batches_per_epoch=batches_per_epoch)
    history: list[dict] = []
    if config.resume_from_checkpoint == "latest" and resumed_from is None and is_main:
        print(f"no checkpoint in {out_dir}: starting from scratch", file=sys.stderr)
    if resumed_from is not None:
        history = _load_checkpoint(resumed_from, inner, optimizer, scheduler, state, config, world, rank,
                                   len(train_ds))
    log_path = out_dir / METRICS_LOG
    if is_main:
        _reset_log(log_path, state.global_step if resumed_from is not None else None)
    if accelerator.log_with:
        accelerator.init_trackers("causal_adapter", config={k: v for k, v in config.to_dict().items()
                                                            if isinstance(v, (int, float, str, bool))})

    def log(record: dict) -> None:
        history.append(record)
        if is_main:
            with open(log_path, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(record) + "\n")
        if accelerator.trackers:
            accelerator.log({f"{record['split']}/{k}": v for k, v in record.items()
                             if isinstance(v, (int, float)) and k not in ("step", "split")}, step=record["step"])

    last_eval: dict | None = None
    last_eval_step = -1
    predictions: dict | None = None

    def run_eval(split: str = "eval") -> dict:
        nonlocal last_eval, last_eval_step, predictions
        idx = list(range(rank, len(eval_ds), world))
        batches = (collator(_rows(eval_ds, idx[i:i + config.per_device_eval_batch_size]))
                   for i in range(0, len(idx), config.per_device_eval_batch_size))
        # the unwrapped model (keeps accelerate's autocast wrapper): no DDP collective inside forward,
        # so processes may run different numbers of evaluation batches
        acc = accumulate(eval_model, batches, MetricAccumulator(inner.num_token_id, inner.config.reg_weight),
                         device=device)
        states = gather_object([acc.state()]) if world > 1 else [acc.state()]
        merged = MetricAccumulator.merged(states)
        last_eval = merged.compute(constant)
        predictions = merged.predictions()
        last_eval_step = state.global_step
        log({"split": split, "step": state.global_step, "epoch": round(state.epoch_float, 4), **last_eval})
        return last_eval

    def save_checkpoint() -> Path:
        path = out_dir / f"{CHECKPOINT_PREFIX}{state.global_step}"
        rngs = gather_object([_rng_state()]) if world > 1 else [_rng_state()]
        if is_main:
            _write_checkpoint(path, inner, optimizer, scheduler, state, config, rngs, world, len(train_ds), history)
            if config.save_total_limit:
                for stale in out_dir.glob(".deleting-*"):  # left by a process killed mid-delete
                    shutil.rmtree(stale, ignore_errors=True)
                for old in list_checkpoints(out_dir)[:-config.save_total_limit]:
                    # rename first (atomic): a kill mid-delete leaves no half checkpoint behind
                    trash = old.with_name(f".deleting-{old.name}")
                    old.rename(trash)
                    shutil.rmtree(trash, ignore_errors=True)
        accelerator.wait_for_everyone()
        return path

    # ---------------------------------------------------------------- loop
    from tqdm.auto import tqdm

    bar = tqdm(total=total_steps, initial=state.global_step, desc="train", dynamic_ncols=True,
               disable=not (is_main and config.progress))
    if config.eval_on_start and eval_ds is not None and state.global_step == 0:
        run_eval()
    model.train()
    running = torch.zeros(4, dtype=torch.float64)  # loss, loss_cls, loss_reg, micro-batches
    tokens, train_time = 0, 0.0  # labelled tokens and seconds of training steps since the last log
    last_train_loss = None
    it = None
    try:
        while state.global_step < total_steps:
            if it is None:
                sampler.set_epoch(state.epoch, start=state.batches_in_epoch * bs)
                it = iter(loader)
            group = min(accum, batches_per_epoch - state.batches_in_epoch)
            t_step = time.perf_counter()
            for j in range(group):
                batch = next(it)
                inputs = {k: batch[k].to(device) for k in MODEL_INPUTS if k in batch}
                sync = j == group - 1
                with contextlib.nullcontext() if sync else accelerator.no_sync(model):
                    out = model(**inputs)
                    if not torch.isfinite(out.loss):
                        raise FloatingPointError(f"non-finite loss {out.loss.item()} at step {state.global_step + 1} "
                                                 f"(loss_cls={out.loss_cls.item()}, loss_reg={out.loss_reg.item()})")
                    accelerator.backward(out.loss / group)
                running += torch.tensor([out.loss.item(), out.loss_cls.item(), out.loss_reg.item(), 1.0],
                                        dtype=torch.float64)
                tokens += int((inputs["labels"][:, 1:] != IGNORE_INDEX).sum())
            if config.max_grad_norm:
                accelerator.clip_grad_norm_(trainable, config.max_grad_norm)
            optimizer.step()
            if not accelerator.optimizer_step_was_skipped:
                scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            train_time += time.perf_counter() - t_step
            state.global_step += 1
            state.batches_in_epoch += group
            if state.batches_in_epoch >= batches_per_epoch:
                state.epoch, state.batches_in_epoch, it = state.epoch + 1, 0, None
            bar.update(1)

            logs: dict = {}
            step = state.global_step
            if step % max(1, config.logging_steps) == 0 or step == total_steps:
                stats, tok, dt = running, tokens, train_time
                if world > 1:
                    stats = accelerator.reduce(running.to(device), reduction="sum").cpu()
                    tok = int(accelerator.reduce(torch.tensor(tokens, device=device), "sum").item())
                    dt = accelerator.reduce(torch.tensor(train_time, device=device), "mean").item()
                n = max(1.0, float(stats[3]))
                logs = {"split": "train", "step": step, "epoch": round(state.epoch_float, 4),
                        "loss": float(stats[0]) / n, "loss_cls": float(stats[1]) / n, "loss_reg": float(stats[2]) / n,
                        "lr": scheduler.get_last_lr()[0], "label_tokens_per_s": tok / dt if dt > 0 else None}
                last_train_loss = logs["loss"]
                log(logs)
                bar.set_postfix(loss=f"{logs['loss']:.4g}")
                running.zero_()
                tokens, train_time = 0, 0.0
            if eval_ds is not None and config.eval_steps and step % config.eval_steps == 0:
                logs = {**logs, "eval": run_eval()}
            if config.save_steps and (step % config.save_steps == 0 or step == total_steps):
                save_checkpoint()
            for cb in callbacks:
                cb(state, logs)
    finally:
        bar.close()

    # ---------------------------------------------------------------- end
    if config.regression_init == "ridge" and features_trained(inner):
        # the features moved under the head (LoRA, W_loc, d): the least-squares probe again, on them
        fit_value_head(inner, config, train_ds, collator, device, verbose=is_main)
        last_eval_step = -1
    if eval_ds is not None and last_eval_step != state.global_step:
        run_eval()
    if (eval_ds is not None and config.calibrate_scale and inner.action.b_noise_Y is not None and predictions
            and predictions["y_true"]):
        # a Cauchy's scale is its median absolute deviation: match it on held-out residuals
        resid = [abs(y - loc) for y, loc in zip(predictions["y_true"], predictions["loc"])]
        scale = max(float(torch.tensor(resid, dtype=torch.float64).median()) / inner.action.value_scale,
                    DEFAULT_SCALE_FLOOR)
        with torch.no_grad():
            inner.action.b_noise_Y.fill_(scale)
        run_eval("eval_calibrated")  # the final metrics, logged apart from the step's own evaluation
    adapter_dir = out_dir / ADAPTER_SUBDIR
    plot_path = None
    if is_main:
        inner.save_pretrained(adapter_dir, metrics={"global_step": state.global_step, "train_loss": last_train_loss,
                                                    **{f"eval_{k}": v for k, v in (last_eval or {}).items()}})
        final = {"global_step": state.global_step, "train_loss": last_train_loss, "eval": last_eval,
                 "num_processes": world, "adapter_dir": str(adapter_dir)}
        (out_dir / FINAL_METRICS).write_text(json.dumps(final, indent=2) + "\n")
        if config.plot:
            plot_path = plot_training(history, predictions, out_dir / PLOT_NAME)
    accelerator.wait_for_everyone()
    if accelerator.trackers:
        accelerator.end_training()
    return TrainResult(
        model=inner, global_step=state.global_step, train_loss=last_train_loss, eval_metrics=last_eval,
        eval_history=[h for h in history if h.get("split") == "eval"], output_dir=out_dir, adapter_dir=adapter_dir,
        checkpoints=list_checkpoints(out_dir), log_path=log_path, plot_path=plot_path, num_processes=world,
        resumed_from=resumed_from,
    )


def _reset_log(path: Path, keep_until: int | None) -> None:
    """Fresh run: empty the log. Resume from step k: keep the records of steps <= k."""
    lines = []
    if keep_until is not None and path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                if json.loads(line).get("step", 0) <= keep_until:
                    lines.append(line)
            except json.JSONDecodeError:
                continue
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")


def _write_checkpoint(path: Path, inner, optimizer, scheduler, state: TrainState, config: TrainConfig,
                      rngs: list[dict], world: int, n_train: int, history: list[dict]) -> None:
    meta, tensors = inner.adapter_metadata(), inner.adapter_state_dict()
    opt_state, sched_state = optimizer.state_dict(), scheduler.state_dict()
    trainer_state = {
        "global_step": state.global_step, "epoch": state.epoch, "batches_in_epoch": state.batches_in_epoch,
        "total_steps": state.total_steps, "batches_per_epoch": state.batches_per_epoch, "num_processes": world,
        "per_device_train_batch_size": config.per_device_train_batch_size,
        "gradient_accumulation_steps": config.gradient_accumulation_steps, "seed": config.seed,
        "train_examples": n_train, "train_config": config.to_dict(), "log_history": history,
    }

    def write(tmp: Path) -> None:
        write_adapter_files(tmp, meta, tensors)
        torch.save(opt_state, tmp / "optimizer.pt")
        torch.save(sched_state, tmp / "scheduler.pt")
        for r, s in enumerate(rngs):
            (tmp / f"rng_state_{r}.json").write_text(json.dumps(s))
        (tmp / TRAINER_STATE).write_text(json.dumps(trainer_state, indent=1) + "\n")

    atomic_write_dir(path, write)


def _load_checkpoint(path: Path, inner, optimizer, scheduler, state: TrainState, config: TrainConfig,
                     world: int, rank: int, n_train: int) -> list[dict]:
    ts = json.loads((path / TRAINER_STATE).read_text())
    meta, tensors = read_adapter_files(path)
    if meta.get("num_token_id") != inner.num_token_id or meta.get("vocab_size") != inner.vocab_size:
        raise ValueError(f"checkpoint {str(path)!r} was made for num_token_id={meta.get('num_token_id')}, "
                         f"vocab_size={meta.get('vocab_size')}; this model has num_token_id={inner.num_token_id}, "
                         f"vocab_size={inner.vocab_size}")
    inner.load_adapter_state_dict(tensors)
    saved = meta.get("adapter_config", {})
    if saved.get("value_loc") is not None:
        inner.set_value_units(saved["value_loc"], saved["value_scale"], saved.get("value_decimals"))
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True))
    scheduler.load_state_dict(torch.load(path / "scheduler.pt", map_location="cpu", weights_only=True))
    mismatch = {k: (ts.get(k), v) for k, v in (
        ("num_processes", world), ("per_device_train_batch_size", config.per_device_train_batch_size),
        ("gradient_accumulation_steps", config.gradient_accumulation_steps), ("seed", config.seed),
        ("train_examples", n_train), ("total_steps", state.total_steps)) if ts.get(k) != v}
    if mismatch:
        warnings.warn(f"resuming from {str(path)!r} with different settings {mismatch} (checkpoint, now): "
                      "the run will not be identical to an uninterrupted one", stacklevel=3)
    state.global_step, state.epoch, state.batches_in_epoch = ts["global_step"], ts["epoch"], ts["batches_in_epoch"]
    if state.batches_in_epoch >= state.batches_per_epoch:
        state.epoch, state.batches_in_epoch = state.epoch + 1, 0
    rng_file = path / f"rng_state_{rank}.json"
    if rng_file.is_file():
        _set_rng_state(json.loads(rng_file.read_text()))
    else:
        warnings.warn(f"{rng_file} missing: random streams (dropout) restart from the seed", stacklevel=3)
    return list(ts.get("log_history", []))


# ============================================================================ plot
def plot_training(history: Sequence[dict], predictions: dict | None, path: str | os.PathLike) -> Path | None:
    """PNG with the training curves (train/eval losses, eval metrics) and the validation values
    (data order) with loc_Y and its 50% / 90% Cauchy interval bands. Returns None (quietly) without matplotlib."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None
    from .cauchy import cauchy_icdf

    train = [h for h in history if h.get("split") == "train"]
    evals = [h for h in history if h.get("split") == "eval"]
    fig = Figure(figsize=(16, 4.6))
    FigureCanvasAgg(fig)
    ax1, ax2, ax3 = fig.subplots(1, 3)
    for key, style in (("loss_cls", "-"), ("loss_reg", "--")):
        if train:
            ax1.plot([h["step"] for h in train], [h[key] for h in train], style, label=f"train {key}")
        pts = [(h["step"], h[key]) for h in evals if h.get(key) is not None]
        if pts:
            ax1.plot(*zip(*pts), style + "o", label=f"eval {key}")
    ax1.set_yscale("symlog")
    ax1.set_xlabel("step")
    ax1.set_title("losses")
    ax1.legend(fontsize=8)
    for key in ("accuracy", "num_recall", "num_f1", "coverage_50", "coverage_90"):
        pts = [(h["step"], h[key]) for h in evals if h.get(key) is not None]
        if pts:
            ax2.plot(*zip(*pts), "o-", label=key)
    for h in history:  # the final evaluation after the scale calibration
        if h.get("split") == "eval_calibrated":
            for key, color in (("coverage_50", "tab:red"), ("coverage_90", "tab:purple")):
                if h.get(key) is not None:
                    ax2.plot([h["step"]], [h[key]], "*", color=color, ms=12, label=f"{key} (calibrated)")
    ax2.set_ylim(-0.02, 1.02)
    ax2.set_xlabel("step")
    ax2.set_title("validation metrics")
    ax2.legend(fontsize=8)
    if predictions and predictions["y_true"]:
        # in data order (time order for the built-in series): the truth, loc_Y and its interval bands
        y = torch.tensor(predictions["y_true"], dtype=torch.float64)
        loc = torch.tensor(predictions["loc"], dtype=torch.float64)
        scale = torch.tensor(predictions["scale"], dtype=torch.float64)
        x = torch.arange(len(y)).numpy()
        for q, alpha in ((0.9, 0.18), (0.5, 0.35)):
            lo = cauchy_icdf(torch.tensor((1 - q) / 2, dtype=torch.float64), loc, scale)
            hi = cauchy_icdf(torch.tensor((1 + q) / 2, dtype=torch.float64), loc, scale)
            ax3.fill_between(x, lo.numpy(), hi.numpy(), color="tab:blue", alpha=alpha, lw=0,
                             label=f"{round(100 * q)}% interval")
        ax3.plot(x, loc.numpy(), "-", color="tab:blue", lw=1.2, label="loc_Y (prediction)")
        ax3.plot(x, y.numpy(), "ko", ms=3, label="true value")
        span = float(y.max() - y.min()) or 1.0
        ax3.set_ylim(float(y.min()) - 0.6 * span, float(y.max()) + 0.6 * span)
        ax3.set_xlabel("validation example (data order)")
        ax3.set_ylabel("value")
        ax3.legend(fontsize=8)
    ax3.set_title("validation: value at <NUM> with its intervals")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    return path


# ============================================================================ command line
#: what a training run writes into its output directory (a new run refuses to replace them without --overwrite)
RUN_OUTPUTS = (ADAPTER_SUBDIR, METRICS_LOG, FINAL_METRICS, PLOT_NAME, CHECKPOINT_PREFIX + "*")


def build_arg_parser(prog: str = "causal-adapter train"):
    """`transformers.HfArgumentParser` over `TrainConfig`: one flag per field (dashes or underscores,
    ``--no-x`` for booleans, no abbreviations), plus ``--config FILE``, ``--overwrite`` and ``--debug``."""
    import argparse

    from transformers import HfArgumentParser

    from .cli import DEBUG_HELP, ShortErrorsMixin

    class TrainArgumentParser(ShortErrorsMixin, HfArgumentParser):
        pass

    ap = TrainArgumentParser(TrainConfig, prog=prog, allow_abbrev=False,
                             description="Fine-tune a causal adapter on a Qwen checkpoint (works under "
                                         "`accelerate launch`). Every flag is a TrainConfig field.")
    for action in ap._actions:  # --help and errors show the dashed spelling first, as the other commands
        action.option_strings.sort(key=lambda s: ("_" in s, s not in ("--base", "--dtype")))
    for f in dataclasses.fields(TrainConfig):
        if f.default is False:  # HfArgumentParser adds --no-x only to the booleans that default to True
            ap.add_argument("--no-" + f.name.replace("_", "-"), dest=f.name, action="store_false",
                            help=argparse.SUPPRESS)
    ap.add_argument("--config", metavar="FILE", default=None,
                    help="json or yaml file of TrainConfig fields; flags on the command line override it")
    ap.add_argument("--overwrite", action="store_true",
                    help="replace the outputs of a previous run in --output-dir instead of refusing")
    ap.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    return ap


def read_config_file(path: str | os.PathLike, parser=None) -> dict[str, Any]:
    """The TrainConfig fields of a json / yaml file (keys with underscores or dashes); errors name
    the file and the problem."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--config {str(path)!r}: no such file")
    text = p.read_text(encoding="utf-8")
    if p.suffix.lower() in (".yaml", ".yml"):
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f"line {mark.line + 1}: " if mark is not None else ""
            raise ValueError(f"--config {str(path)!r}: {where}not valid YAML ({getattr(e, 'problem', e)})") from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--config {str(path)!r}: line {e.lineno}: not valid JSON ({e.msg})") from None
    if not isinstance(data, dict):
        raise ValueError(f"--config {str(path)!r} must hold a mapping of TrainConfig fields, got {type(data).__name__}")
    data = {str(k).replace("-", "_"): v for k, v in data.items()}
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    allowed = set(fields) | ({a.dest for a in parser._actions} - {"help", "config"} if parser is not None else set())
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise ValueError(f"--config {str(path)!r}: unknown keys {unknown}; the keys are TrainConfig field names "
                         "(causal-adapter train --help)")
    for k, v in data.items():
        if k in fields and isinstance(v, str) and "list" in str(fields[k].type):
            data[k] = [v]
    return data


def parse_train_args(argv: Sequence[str] | None = None):
    """(TrainConfig, namespace of the other flags) from a command line, through HfArgumentParser;
    ``--config FILE`` supplies the defaults. A bad value raises ValueError; a bad flag exits (2)."""
    from .cli import CliParser

    argv = sys.argv[1:] if argv is None else list(argv)
    ap = build_arg_parser()
    pre = CliParser(prog=ap.prog, add_help=False)
    pre.add_argument("--config", default=None)
    known, _ = pre.parse_known_args(argv)
    if known.config:
        ap.set_defaults(**read_config_file(known.config, ap))
    config, extras, rest = ap.parse_args_into_dataclasses(argv, return_remaining_strings=True,
                                                          look_for_args_file=False)
    if rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    return config, extras


def config_from_args(args) -> TrainConfig:
    return TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})


def main(argv: list[str] | None = None) -> int:
    """``causal-adapter train ...`` / ``python -m causal_adapter.train ...``: train, print the
    validation table, return 0. Refuses (before any work) a base model that cannot load and an
    output directory that holds a previous run (unless --overwrite or --resume-from-checkpoint)."""
    from .cli import check_base, existing_outputs, refuse_overwrite, remove_if_left_empty

    try:
        config, extras = parse_train_args(argv)
    except ValueError as e:
        print(f"causal-adapter train: error: {e}", file=sys.stderr)
        return 2
    check_base(config.base_model, "--base")
    if config.tokenizer:
        check_base(config.tokenizer, "--tokenizer")
    if config.resume_from_checkpoint is None:
        if not extras.overwrite:
            refuse_overwrite(config.output_dir, existing_outputs(config.output_dir, RUN_OUTPUTS),
                             extra=", --resume-from-checkpoint latest to continue them")
        elif int(os.environ.get("RANK", "0") or 0) == 0:
            for old in list_checkpoints(config.output_dir):  # a stale checkpoint-N would pass for the newest
                shutil.rmtree(old, ignore_errors=True)
    with remove_if_left_empty(config.output_dir):
        result = train(None, config)
    from accelerate import PartialState

    if PartialState().is_main_process:
        if result.eval_metrics is not None:
            print(format_metrics_table(result.eval_metrics))
        print(f"steps: {result.global_step}  processes: {result.num_processes}  adapter: {result.adapter_dir}")
        print(f"log: {result.log_path}" + (f"  plot: {result.plot_path}" if result.plot_path else ""))
    return 0


if __name__ == "__main__":
    from .cli import main as cli_main

    sys.exit(cli_main(["train", *sys.argv[1:]]))
