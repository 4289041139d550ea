"""Fine-tuning entry point (accelerate): ``causal-adapter train``, ``python -m causal_adapter train``,
``accelerate launch -m causal_adapter train`` and the Python API `train(model, TrainConfig(...))`.
docs/cli.md and docs/values.md (the training recipe) show how to run it; the settings are
`training.config.TrainConfig`, the checkpoints `training.checkpoints`, the plot `training.plotting`;
`train` reads as its steps (`_start`, `_build_model_and_data`, `_prepare_optimization`,
`_resume_and_open_log`, `_train_steps`, `_finish`), which share one `Run`.

What a run does
* Model: a local Qwen2/Qwen2.5/Qwen3 directory or hub name (``AutoModelForCausalLM``) or, by
  default, the embedded tiny Qwen with the real Qwen tokenizer (`saving.assets.load_base`), wrapped by
  `get_causal_model` (frozen backbone, or LoRA through peft). A frozen backbone with nothing
  trainable below the heads runs under ``torch.no_grad()`` inside `CausalModel.forward`: no
  activations, no backward through the transformer.
* Data: local files (`data.pipeline.load_text_dataset`: jsonl/json/csv/tsv/parquet/txt, a ``text``
  column or ``prompt`` + ``completion``) or a built-in offline corpus (`data.corpora.build_corpus`,
  default ``sunspots``), tokenised number-aware (`data.pipeline.tokenize_dataset`), padded on the right.
* Optimisation: AdamW (weight decay on matrices only), `transformers.get_scheduler`, gradient
  accumulation, gradient clipping, mixed precision via accelerate.
* Order of examples: epoch e uses the permutation drawn from ``seed + e`` (padded to a multiple
  of the number of processes and sharded like ``DistributedSampler``); nothing else touches
  the global RNGs except the model itself (LoRA dropout), so a run is reproducible from its seed.
* Checkpoints ``OUTPUT_DIR/checkpoint-STEP`` (`checkpoints`): adapter-only, optimizer, scheduler,
  RNG and trainer state, written atomically; resuming ends with the same adapter as an
  uninterrupted run (bit-identical on CPU).
* Evaluation on the validation split every ``eval_steps`` and at the end (`metrics`), sharded
  over processes and gathered; ``metrics.jsonl`` log, accelerate trackers (``report_to``),
  tqdm on the main process, and a PNG of the curves and of the validation values with
  their predicted 50% / 90% bands (`plotting`, matplotlib optional).
* Distributed: one ``forward`` holds embedding, backbone, heads and loss (what DDP needs);
  ``find_unused_parameters=True`` by default so a parameter that gets no gradient on a step
  cannot stall DDP. Multi-process CPU runs use gloo:
  ``ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 --num_machines 1
  --mixed_precision no --dynamo_backend no -m causal_adapter train ...``
  (``accelerate launch --cpu --num_processes 2`` starts ONE process: detected and warned).
  FSDP2 (``examples/accelerate_configs/fsdp2.yaml``): the setup, the evaluation's padded forwards and the
  sharded checkpoint state are `engines`' (docs/distributed.md); FSDP1 and DeepSpeed are refused at start.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import math
import os
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Sampler

from ..config import DEFAULT_SCALE_FLOOR, IGNORE_INDEX
from ..data.corpora import build_corpus
from ..data.pipeline import NumericCollator, load_text_dataset, number_layout, tokenize_dataset
from ..modeling.intervals import choose_scale_exponent, fit_calibration
from ..numbers import NumberTokenizer
from ..saving.assets import load_base
from ..saving.integrations import unwrap_model
from ..saving.model import get_causal_model
from . import engines
from .checkpoints import (
    CHECKPOINT_PREFIX,
    TrainState,
    list_checkpoints,
    load_checkpoint,
    remove_old_checkpoints,
    resolve_resume,
    rng_state,
    write_checkpoint,
)
from .config import PARAMETER_GROUPS, TrainConfig
from .metrics import MODEL_INPUTS, MetricAccumulator, accumulate, train_median
from .plotting import plot_training
from .value_fit import BF16_MAX_SHIFT, fit_value_units, ridge_warm_start, value_decimals

ADAPTER_SUBDIR = "adapter"
METRICS_LOG = "metrics.jsonl"
FINAL_METRICS = "final_metrics.json"
PLOT_NAME = "training.png"


class LaunchWarning(UserWarning):
    """The launch did not give the processes that were asked for."""



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
    """(base model, tokenizer) for `config` (`saving.assets.load_base`): the embedded tiny Qwen + the real
    Qwen tokenizer by default, else ``AutoModelForCausalLM`` / ``AutoTokenizer`` from ``base_model``."""
    return load_base(config.base_model, config.tiny_arch, config.torch_dtype, config.tiny_hidden_size,
                     config.tiny_layers, tokenizer=config.tokenizer, quantization=config.quantization)


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

    def tok(ds, prompt_loss="none"):
        if ds is None or "input_ids" in ds.column_names:
            return ds
        if number_tokenizer is None:
            raise ValueError("the dataset is not tokenised (no input_ids column): pass tokenizer=... to train()")
        return tokenize_dataset(ds, number_tokenizer, text_column=config.text_column,
                                prompt_column=config.prompt_column, completion_column=config.completion_column,
                                max_length=config.max_length, add_eos_token=config.add_eos_token,
                                prompt_loss=prompt_loss)

    ctx = accelerator.main_process_first() if accelerator is not None else contextlib.nullcontext()
    with ctx:
        # validation keeps completion-only labels: its metrics stay those of `causal-adapter eval`
        train_dataset, eval_dataset = tok(train_dataset, config.prompt_loss), tok(eval_dataset)
    train_dataset = _feature_columns(train_dataset, config)
    if eval_dataset is not None:
        eval_dataset = _feature_columns(eval_dataset, config)
    return train_dataset, eval_dataset, targets


def features_trained(inner) -> bool:
    """True when training changed what the regression head reads (LoRA, W_loc / b_loc, d)."""
    return any(p.requires_grad for n, p in inner.named_parameters()
               if n.startswith(("backbone.", "abduction.loc.", "numeric_embedding.")))


def fit_value_head(inner, config: TrainConfig, train_ds, collator, device, verbose: bool = False,
                   max_rows: int = 8192, eval_ds=None) -> dict:
    """Before step 1 of a fresh run: fit the value units (and decimals) on the training targets
    when the adapter has none, then, with ``regression_init='ridge'``, the ridge warm start of the
    regression head (`value_fit`). Every process computes the same from the same rows."""
    summary: dict = {}
    rows = train_ds.select(range(min(len(train_ds), max_rows)))
    num_id = inner.num_token_id
    value_column = "label_values" if "label_values" in rows.column_names else "numeric_values"  # as forward
    values = [v for labels, vals in zip(rows["labels"], rows[value_column])
              for lab, v in zip(labels, vals) if lab == num_id]
    if not values:
        return summary
    if inner.causal_config.value_loc is None:
        loc, scale = fit_value_units(values)
        inner.set_value_units(loc, scale, value_decimals(values))
        summary.update(value_loc=loc, value_scale=scale, value_decimals=inner.causal_config.value_decimals)
    if config.regression_init == "ridge":
        inner.to(device)
        bs = config.per_device_eval_batch_size

        def batches(ds):
            return (collator(_rows(ds, range(i, min(i + bs, len(ds))))) for i in range(0, min(len(ds), max_rows), bs))

        val = batches(eval_ds) if eval_ds is not None and len(eval_ds) else None
        summary.update(ridge_warm_start(inner, batches(rows), device, max_rows, val_batches=val,
                                        loss=config.value_loss, max_shift=_head_shift_bound(inner, config)) or {})
    if verbose and summary:
        print("value head: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                         for k, v in summary.items()), file=sys.stderr)
    return summary


def _refit_value_head(inner, config: TrainConfig, train_ds, collator, device, accelerator, verbose: bool,
                      eval_ds=None) -> bool:
    """When training moves the features the value head reads (LoRA, W_loc, d; `features_trained`) and
    ``regression_init='ridge'``: fit the head again on them (`fit_value_head`, under the training
    autocast) and drop the calibration map, which described the old head (the end of `train` fits a new
    one). Without this a head fitted at step 0 reads features that drifted (a stale head: sunspots
    validation MAE 21,963,900 mid-run with W_loc trained). Returns whether it refitted."""
    if config.regression_init != "ridge" or not features_trained(inner):
        return False
    with engines.inference_precision(inner):  # the features the saved adapter will see (no autocast)
        fit_value_head(inner, config, train_ds, collator, device, verbose=verbose, eval_ds=eval_ds)
    inner.causal_config.value_calibration = None
    return True


def _head_shift_bound(inner, config: TrainConfig) -> float:
    """The bf16 bound of the value head's fit (`value_fit.BF16_MAX_SHIFT`) or inf, per `bf16_safe_head`.
    'auto' = on only when the heads themselves are 16-bit (`autocast_adapter_dtype=False` on a 16-bit base):
    the only case where loc_U is rounded. On a bf16 base the heads compute in fp32 and the fit sees the
    16-bit features it will run on, so its validation-chosen penalty already accounts for them (sunspots,
    60 bf16 steps, validation MAE 24.97 with the bound off vs 36.89 on: docs/values.md); under bf16
    autocast on a float32 base the fit sees the float32 features inference computes
    (`engines.inference_precision`)."""
    if config.bf16_safe_head == "auto":
        return BF16_MAX_SHIFT if inner.action.w_reg.dtype in (torch.bfloat16, torch.float16) else math.inf
    return BF16_MAX_SHIFT if config.bf16_safe_head == "on" else math.inf


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



# ---------------------------------------------------------------------------- launch checks
def launch_warnings(num_processes: int, expected: int | None = None, env: dict | None = None) -> list[str]:
    """Messages for a launch that did not give the processes that were asked for."""
    env = os.environ if env is None else env
    msgs = []
    cpu_recipe = ("for N CPU processes (DDP over gloo) use: ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu "
                  "--num_processes N --num_machines 1 --mixed_precision no --dynamo_backend no "
                  "-m causal_adapter train ...")
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
@dataclass
class Run:
    """Everything one `train` call holds between its steps (plain fields, no behaviour)."""

    config: TrainConfig
    accelerator: Any
    out_dir: Path
    is_main: bool
    world: int
    rank: int
    inner: Any = None  # the CausalModel (unwrapped)
    model: Any = None  # what accelerate prepared (DDP wrapper / autocast forward)
    eval_model: Any = None  # the unwrapped model (accelerate's autocast forward; evaluated without it)
    tokenizer: Any = None
    train_ds: Any = None
    eval_ds: Any = None
    collator: Any = None
    constant: float | None = None
    resumed_from: Path | None = None
    sampler: Any = None
    loader: Any = None
    batches_per_epoch: int = 0
    total_steps: int = 0
    optimizer: Any = None
    scheduler: Any = None
    device: Any = None
    trainable: list = dataclasses.field(default_factory=list)
    state: TrainState | None = None
    history: list = dataclasses.field(default_factory=list)
    log_path: Path | None = None
    last_eval: dict | None = None
    last_eval_step: int = -1
    refitted_eval_step: int = -1  # the step of the last evaluation taken with a refitted head
    predictions: dict | None = None
    last_train_loss: float | None = None


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
    run = _start(config or TrainConfig())
    _build_model_and_data(run, model, tokenizer, train_dataset, eval_dataset, train_targets)
    _prepare_optimization(run)
    _resume_and_open_log(run)
    _train_steps(run, callbacks)
    return _finish(run)


def _start(config: TrainConfig) -> Run:
    """The accelerator (refusing DeepSpeed / FSDP1: `engines.check_engine`), launch warnings, the output directory, the seed."""
    from accelerate.utils import set_seed

    accelerator = _make_accelerator(config)
    engines.check_engine(accelerator)
    run = Run(config=config, accelerator=accelerator, out_dir=Path(config.output_dir),
              is_main=accelerator.is_main_process, world=accelerator.num_processes, rank=accelerator.process_index)
    for msg in launch_warnings(run.world, config.expected_num_processes):
        warnings.warn(msg, LaunchWarning, stacklevel=3)
    if run.is_main:
        run.out_dir.mkdir(parents=True, exist_ok=True)
    set_seed(config.seed)
    return run


def _build_model_and_data(run: Run, model, tokenizer, train_dataset, eval_dataset, train_targets) -> None:
    """The CausalModel (built from the config unless given; frozen parts, checkpointing), the datasets,
    the constant baseline, the collator and, for a fresh run, the value head's warm start."""
    config = run.config
    if model is None:
        base, loaded_tok = load_base_and_tokenizer(config)
        tokenizer = tokenizer or loaded_tok
        if config.quantization:
            from peft import prepare_model_for_kbit_training

            # peft's QLoRA preparation: every base weight frozen, the non-quantised ones (norms, embedding,
            # lm_head) in fp32; checkpointing is --gradient-checkpointing's business (below)
            base = prepare_model_for_kbit_training(base, use_gradient_checkpointing=False)
        model = get_causal_model(base, config.adapter_config(), tokenizer=tokenizer)
    run.inner, run.tokenizer = model, tokenizer
    if config.freeze:
        freeze_parts(model, config.freeze)
    if config.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    ntok = NumberTokenizer(tokenizer, model.num_token_id) if tokenizer is not None else None
    run.train_ds, run.eval_ds, targets = prepare_datasets(config, ntok, train_dataset, eval_dataset, run.accelerator)
    if train_targets is None:
        train_targets = targets
    run.constant = train_median(train_targets) if train_targets else None
    run.collator = NumericCollator(_pad_token_id(ntok, model), padding_side="right")
    run.resumed_from = resolve_resume(config)
    if ntok is not None:  # where the value head is fitted (the data's, so a resumed run gets the same)
        prefix, contexts = number_layout(run.train_ds, model.num_token_id, ntok.tokenizer)
        model.causal_config.number_prefix_id, model.causal_config.number_contexts = prefix, contexts
    if run.resumed_from is None:  # a resumed run takes the units and heads from its checkpoint
        with engines.inference_precision(model):  # the features the saved adapter will see (no autocast)
            fit_value_head(model, config, run.train_ds, run.collator, run.accelerator.device, verbose=run.is_main,
                           eval_ds=run.eval_ds)


def _prepare_optimization(run: Run) -> None:
    """The sampler and loader, the step plan, AdamW and the scheduler, accelerate's prepare."""
    from transformers import get_scheduler

    config = run.config
    run.sampler = EpochSampler(len(run.train_ds), run.world, run.rank, seed=config.seed)
    run.loader = DataLoader(run.train_ds, batch_size=config.per_device_train_batch_size, sampler=run.sampler,
                            collate_fn=run.collator, num_workers=config.dataloader_num_workers,
                            generator=torch.Generator().manual_seed(config.seed))  # own generator: global RNG untouched
    run.batches_per_epoch, run.total_steps, warmup = _step_plan(config, run.sampler.shard_size)
    optimizer = make_optimizer(run.inner, config)
    run.scheduler = get_scheduler(config.lr_scheduler_type, optimizer, num_warmup_steps=warmup,
                                  num_training_steps=run.total_steps)
    run.model, run.optimizer = engines.prepare(run.accelerator, run.inner, optimizer)
    run.eval_model = run.accelerator.unwrap_model(run.model)
    run.inner = unwrap_model(run.eval_model)
    run.device = run.accelerator.device
    run.trainable = [p for _, p in run.inner.trainable_parameters()]


def _resume_and_open_log(run: Run) -> None:
    """The trainer state (from the checkpoint when resuming), metrics.jsonl (cut at the resumed step)
    and accelerate's trackers."""
    config = run.config
    run.state = TrainState(total_steps=run.total_steps, batches_per_epoch=run.batches_per_epoch)
    if config.resume_from_checkpoint == "latest" and run.resumed_from is None and run.is_main:
        print(f"no checkpoint in {run.out_dir}: starting from scratch", file=sys.stderr)
    if run.resumed_from is not None:
        weights_loaded = engines.load_engine_state(run.accelerator, run.resumed_from)  # FSDP: sharded state
        run.history = load_checkpoint(run.resumed_from, run.inner, run.optimizer, run.scheduler, run.state, config,
                                      run.world, run.rank, len(run.train_ds), weights_loaded=weights_loaded)
    run.log_path = run.out_dir / METRICS_LOG
    if run.is_main:
        _reset_log(run.log_path, run.state.global_step if run.resumed_from is not None else None)
    if run.accelerator.log_with:
        run.accelerator.init_trackers("causal_adapter", config={k: v for k, v in config.to_dict().items()
                                                                if isinstance(v, (int, float, str, bool))})


def _log(run: Run, record: dict) -> None:
    """One record into the history, metrics.jsonl (main process) and the trackers."""
    run.history.append(record)
    if run.is_main:
        with open(run.log_path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(record) + "\n")
    if run.accelerator.trackers:
        run.accelerator.log({f"{record['split']}/{k}": v for k, v in record.items()
                             if isinstance(v, (int, float)) and k not in ("step", "split")}, step=record["step"])


def _evaluate(run: Run) -> MetricAccumulator:
    """The validation split, sharded over processes and gathered: one merged MetricAccumulator."""
    from accelerate.utils import gather_object

    config, eval_ds, bs = run.config, run.eval_ds, run.config.per_device_eval_batch_size
    idx = list(range(run.rank, len(eval_ds), run.world))
    batches = (run.collator(_rows(eval_ds, idx[i:i + bs])) for i in range(0, len(idx), bs))
    # the unwrapped model: no DDP collective inside forward, so processes may run different numbers of
    # evaluation batches; run as the saved adapter runs at inference (no autocast: the metrics are `eval`'s)
    with engines.inference_precision(run.eval_model) as model:
        acc = accumulate(model, batches, MetricAccumulator(run.inner.num_token_id, run.inner.causal_config.reg_weight,
                                                           calibration=run.inner.causal_config.value_calibration),
                         device=run.device)
        # FSDP: as many forwards as the longest shard has batches (each one all-gathers the layers)
        missing = math.ceil(math.ceil(len(eval_ds) / run.world) / bs) - math.ceil(len(idx) / bs)
        if missing > 0 and engines.is_fsdp(run.accelerator):
            pad = {k: v.to(run.device) for k, v in run.collator(_rows(eval_ds, [0])).items() if k in MODEL_INPUTS}
            engines.pad_forwards(model, pad, missing)
    states = gather_object([acc.state()]) if run.world > 1 else [acc.state()]
    return MetricAccumulator.merged(states)


def _run_eval(run: Run, split: str = "eval") -> dict:
    """Evaluate, keep the metrics and predictions, log them under `split`."""
    merged = _evaluate(run)
    run.last_eval = merged.compute(run.constant)
    run.predictions = merged.predictions()
    run.last_eval_step = run.state.global_step
    _log(run, {"split": split, "step": run.state.global_step, "epoch": round(run.state.epoch_float, 4),
               **run.last_eval})
    return run.last_eval


def _eval_refitted(run: Run) -> dict:
    """An evaluation of the adapter a run stopped here would save: the closed-form value head fitted
    again on the features as they are now (`_refit_value_head`), then the heads and config restored,
    so evaluations leave the training path (and checkpoints, which resume exactly) unchanged."""
    inner = run.inner
    heads = {name: {k: v.clone() for k, v in getattr(inner, name).state_dict().items()}
             for name in ("numeric_embedding", "abduction", "action")}
    saved_config = copy.deepcopy(inner.causal_config)
    refitted = run.config.value_refit == "eval" and _refit_value_head(
        inner, run.config, run.train_ds, run.collator, run.device, run.accelerator, False, run.eval_ds)
    try:
        return _run_eval(run)
    finally:
        if refitted:
            run.refitted_eval_step = run.state.global_step
            with torch.no_grad():
                for name, state_dict in heads.items():
                    getattr(inner, name).load_state_dict(state_dict)
            inner.causal_config = saved_config


def _save_checkpoint(run: Run) -> Path:
    """checkpoint-STEP (adapter, optimizer, scheduler, RNG of every process, trainer state), atomically.
    Under FSDP every process writes its shards first (`engines.save_engine_state`), then the main process
    moves them into the checkpoint with the rest."""
    from accelerate.utils import gather_object

    path = run.out_dir / f"{CHECKPOINT_PREFIX}{run.state.global_step}"
    rngs = gather_object([rng_state()]) if run.world > 1 else [rng_state()]
    tensors = engines.whole_adapter_tensors(run.accelerator, run.model)
    engine_dir = engines.save_engine_state(run.accelerator, run.out_dir / f".{path.name}.{engines.ENGINE_SUBDIR}")
    if run.is_main:
        write_checkpoint(path, run.inner, run.optimizer, run.scheduler, run.state, run.config, rngs, run.world,
                         len(run.train_ds), run.history, tensors=tensors, engine_dir=engine_dir)
        if run.config.save_total_limit:
            remove_old_checkpoints(run.out_dir, run.config.save_total_limit)
    run.accelerator.wait_for_everyone()
    return path


@dataclass
class _Window:
    """What the train log averages since its last line: loss sums [loss, loss_cls, loss_reg, micro-batches]
    (host), labelled tokens (device: read when logging), seconds."""

    running: Tensor
    tokens: Tensor
    seconds: float = 0.0


def _train_steps(run: Run, callbacks) -> None:
    """The optimizer steps from the current one to the last, with logging, evaluation, checkpoints and
    callbacks after each."""
    from tqdm.auto import tqdm

    config, state = run.config, run.state
    bar = tqdm(total=run.total_steps, initial=state.global_step, desc="train", dynamic_ncols=True,
               disable=not (run.is_main and config.progress))
    if config.eval_on_start and run.eval_ds is not None and state.global_step == 0:
        _run_eval(run)
    run.model.train()
    window = _Window(torch.zeros(4, dtype=torch.float64), torch.zeros((), dtype=torch.long, device=run.device))
    it = None
    try:
        while state.global_step < run.total_steps:
            if it is None:
                run.sampler.set_epoch(state.epoch, start=state.batches_in_epoch * config.per_device_train_batch_size)
                it = iter(run.loader)
            _optimizer_step(run, it, window)
            if state.batches_in_epoch >= run.batches_per_epoch:
                state.epoch, state.batches_in_epoch, it = state.epoch + 1, 0, None
            bar.update(1)
            logs = _after_step(run, window, bar)
            for cb in callbacks:
                cb(state, logs)
    finally:
        bar.close()


def _optimizer_step(run: Run, it, window: _Window) -> None:
    """One optimizer step: the accumulated micro-batches (gradient sync on the last), clipping, the
    step and the scheduler; the losses into `window`. A non-finite loss stops the run, naming the step."""
    config, state, accelerator = run.config, run.state, run.accelerator
    group = min(config.gradient_accumulation_steps, run.batches_per_epoch - state.batches_in_epoch)
    t_step = time.perf_counter()
    for j in range(group):
        batch = next(it)
        inputs = {k: batch[k].to(run.device) for k in MODEL_INPUTS if k in batch}
        sync = j == group - 1
        with contextlib.nullcontext() if sync else accelerator.no_sync(run.model):
            out = run.model(**inputs)
            # the micro-batch's one host sync: the three losses together
            losses = torch.stack([out.loss, out.loss_cls, out.loss_reg]).detach().to("cpu", torch.float64)
            if not torch.isfinite(losses).all():
                loss, loss_cls, loss_reg = losses.tolist()
                raise FloatingPointError(f"non-finite loss {loss} at step {state.global_step + 1} "
                                         f"(loss_cls={loss_cls}, loss_reg={loss_reg})")
            accelerator.backward(out.loss / group)
        window.running[:3] += losses
        window.running[3] += 1
        window.tokens += (inputs["labels"][:, 1:] != IGNORE_INDEX).sum()  # on the device, read when logging
    if config.max_grad_norm:
        accelerator.clip_grad_norm_(run.trainable, config.max_grad_norm)
    run.optimizer.step()
    if not accelerator.optimizer_step_was_skipped:
        run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    window.seconds += time.perf_counter() - t_step
    state.global_step += 1
    state.batches_in_epoch += group


def _after_step(run: Run, window: _Window, bar) -> dict:
    """The train log line (every `logging_steps` and at the last step, reduced over processes), the
    evaluation every `eval_steps`, the checkpoint every `save_steps` and at the end. Returns the logs."""
    config, accelerator, step = run.config, run.accelerator, run.state.global_step
    logs: dict = {}
    if step % max(1, config.logging_steps) == 0 or step == run.total_steps:
        stats, tok, dt = window.running, int(window.tokens), window.seconds
        if run.world > 1:
            stats = accelerator.reduce(window.running.to(run.device), reduction="sum").cpu()
            tok = int(accelerator.reduce(window.tokens.clone(), "sum").item())
            dt = accelerator.reduce(torch.tensor(window.seconds, device=run.device), "mean").item()
        n = max(1.0, float(stats[3]))
        logs = {"split": "train", "step": step, "epoch": round(run.state.epoch_float, 4),
                "loss": float(stats[0]) / n, "loss_cls": float(stats[1]) / n, "loss_reg": float(stats[2]) / n,
                "lr": run.scheduler.get_last_lr()[0], "label_tokens_per_s": tok / dt if dt > 0 else None}
        run.last_train_loss = logs["loss"]
        _log(run, logs)
        bar.set_postfix(loss=f"{logs['loss']:.4g}")
        window.running.zero_()
        window.tokens.zero_()
        window.seconds = 0.0
    if run.eval_ds is not None and config.eval_steps and step % config.eval_steps == 0:
        logs = {**logs, "eval": _eval_refitted(run)}
    if config.save_steps and (step % config.save_steps == 0 or step == run.total_steps):
        _save_checkpoint(run)
    return logs


def _finish(run: Run) -> TrainResult:
    """After the last step: the value head fitted on the final features, the last evaluation, the
    calibration of the width, the adapter, final_metrics.json, the plot; the TrainResult."""
    config, inner, state = run.config, run.inner, run.state
    if _refit_value_head(inner, config, run.train_ds, run.collator, run.device, run.accelerator, run.is_main,
                         run.eval_ds) and run.refitted_eval_step != state.global_step:
        run.last_eval_step = -1  # the head changed since the step's evaluation (not taken with this same refit)
    if run.eval_ds is not None and run.last_eval_step != state.global_step:
        _run_eval(run)
    if run.eval_ds is not None and config.calibrate_scale:
        base = _base_scale(inner, lambda: _evaluate(run).predictions())
        calibrated = _calibrate_regression_scale(inner, run.predictions, base)
        if calibrated:
            if run.is_main and calibrated is not True:
                print("value scale: " + ", ".join(f"{k}={v}" for k, v in calibrated.items()), file=sys.stderr)
            _run_eval(run, "eval_calibrated")  # the final metrics, logged apart from the step's own evaluation
    adapter_dir = run.out_dir / ADAPTER_SUBDIR
    tensors = engines.whole_adapter_tensors(run.accelerator, run.model)  # FSDP: gathered on every process
    plot_path = _write_outputs(run, adapter_dir, tensors) if run.is_main else None
    run.accelerator.wait_for_everyone()
    if run.accelerator.trackers:
        run.accelerator.end_training()
    return TrainResult(
        model=inner, global_step=state.global_step, train_loss=run.last_train_loss, eval_metrics=run.last_eval,
        eval_history=[h for h in run.history if h.get("split") == "eval"], output_dir=run.out_dir,
        adapter_dir=adapter_dir, checkpoints=list_checkpoints(run.out_dir), log_path=run.log_path,
        plot_path=plot_path, num_processes=run.world, resumed_from=run.resumed_from,
    )


def _write_outputs(run: Run, adapter_dir: Path, tensors: dict | None = None) -> Path | None:
    """The main process's files: the adapter (with its card's metrics; `tensors`: gathered whole under
    FSDP), final_metrics.json, the plot."""
    state, last_eval = run.state, run.last_eval
    run.inner.save_pretrained(adapter_dir, adapter_tensors=tensors,
                              metrics={"global_step": state.global_step, "train_loss": run.last_train_loss,
                                       **{f"eval_{k}": v for k, v in (last_eval or {}).items()}})
    final = {"global_step": state.global_step, "train_loss": run.last_train_loss, "eval": last_eval,
             "num_processes": run.world, "adapter_dir": str(adapter_dir)}
    (run.out_dir / FINAL_METRICS).write_text(json.dumps(final, indent=2) + "\n")
    if not run.config.plot:
        return None
    return plot_training(run.history, run.predictions, run.out_dir / PLOT_NAME,
                         calibration=run.inner.causal_config.value_calibration)


def _pad_token_id(ntok, inner) -> int:
    """The padding id of the batches: the tokenizer's, else the backbone config's, else 0."""
    if ntok is not None:
        return ntok.pad_token_id
    pad_id = getattr(inner.backbone.config, "pad_token_id", None)
    return 0 if pad_id is None else int(pad_id)


def _step_plan(config: TrainConfig, shard_size: int) -> tuple[int, int, int]:
    """(micro-batches per epoch, total optimizer steps, warmup steps) of a run over `shard_size`
    examples per process."""
    batches_per_epoch = math.ceil(shard_size / config.per_device_train_batch_size)
    updates_per_epoch = math.ceil(batches_per_epoch / config.gradient_accumulation_steps)
    total_steps = config.max_steps if config.max_steps > 0 else math.ceil(config.num_train_epochs * updates_per_epoch)
    warmup = config.warmup_steps or math.ceil(config.warmup_ratio * total_steps)
    return batches_per_epoch, total_steps, warmup


def _base_scale(inner, predict: Callable[[], dict]) -> list[float] | None:
    """With a per-row scale: the validation widths without their per-row part (w_scale_Y . loc_U = 0, the
    out-of-depth factor kept), from one more pass of `predict` (rows in the order of the last evaluation's);
    else None."""
    act = inner.action
    if act.w_scale_Y is None or act.b_noise_Y is None:
        return None
    saved = act.w_scale_Y.detach().clone(), act.log_scale_range.clone()
    try:
        with torch.no_grad():
            act.w_scale_Y.zero_()
            act.log_scale_range.zero_()
        return predict()["scale"]
    finally:
        with torch.no_grad():
            act.w_scale_Y.copy_(saved[0])
            act.log_scale_range.copy_(saved[1])


def _calibrate_regression_scale(inner, predictions: dict | None, base_scale: Sequence[float] | None = None
                                ) -> dict | bool:
    """After training, on the validation predictions. With a per-row scale and `base_scale` (`_base_scale`):
    shrink the per-row part of the width, scale = base * (scale / base)^a, with a chosen by a held-out
    interval score (`intervals.choose_scale_exponent`: conformal maps cross-fitted on halves of the
    validation rows) and applied as w_scale_Y *= a, log_scale_range *= a (still an exact Cauchy; the
    out-of-depth factor stays). Then multiply |b_noise_Y| by the median normalised residual
    |y - loc_Y| / scale_Y (a Cauchy's scale is its median absolute deviation, so the raw 50% interval is
    calibrated), and fit the split-conformal map of every level on the rescaled normalised residuals
    (`intervals.fit_calibration`) into `config.value_calibration`. Returns {"scale_exponent": a, ...} (or
    True without the exponent's choice); False (nothing done) without a regression scale of its own or
    validation values."""
    act = inner.action
    if act.b_noise_Y is None or not predictions or not predictions["y_true"]:
        return False
    y, loc, scale = (torch.tensor(predictions[k], dtype=torch.float64) for k in ("y_true", "loc", "scale"))
    info: dict | bool = True
    if base_scale is not None and act.w_scale_Y is not None and len(base_scale) == len(scale):
        base = torch.tensor(base_scale, dtype=torch.float64)
        a, scores = choose_scale_exponent(y, loc, base, scale / base)
        info = {"scale_exponent": a, **{f"interval_score_a{k:g}": round(v, 6) for k, v in scores.items()}}
        if a != 1.0:
            with torch.no_grad():
                act.w_scale_Y.mul_(a)
                act.log_scale_range.mul_(a)
            scale = base * (scale / base) ** a
    factor = float(((y - loc).abs() / scale).median())
    if not math.isfinite(factor) or factor <= 0:
        return False
    with torch.no_grad():
        new = max(float(act.b_noise_Y.abs().max()) * factor, DEFAULT_SCALE_FLOOR)
        act.b_noise_Y.fill_(new)
    inner.causal_config.value_calibration = fit_calibration(y, loc, (scale * factor).clamp_min(act.scale_floor))
    return info


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
