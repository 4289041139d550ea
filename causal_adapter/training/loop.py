"""Fine-tuning entry point (accelerate): ``causal-adapter train``, ``python -m causal_adapter train``,
``accelerate launch -m causal_adapter train`` and the Python API `train(model, TrainConfig(...))`.
docs/cli.md and docs/values.md (the training recipe) show how to run it; the settings are
`training.config.TrainConfig`, the datasets and their order `training.data`, the value head's fits
`training.value_head`, the accelerator and each engine's setup and checkpoint state `training.engines`,
the checkpoints `training.checkpoints`, the plot `training.plotting`; `train` reads as its steps (`_start`,
`_build_model_and_data`, `_training_rows`, `_prepare_optimization`,
`_resume_and_open_log`, `_train_steps`, `_finish`), which share one `Run`.

What a run does
* Model: a local Qwen2/Qwen2.5/Qwen3 directory or hub name (``AutoModelForCausalLM``) or, by
  default, the embedded tiny Qwen with the real Qwen tokenizer (`saving.assets.load_base`), wrapped by
  `get_causal_model` (frozen backbone, or LoRA through peft). A frozen backbone with nothing
  trainable below the heads runs under ``torch.no_grad()`` inside `CausalModel.forward`: no
  activations, no backward through the transformer.
* Data: local files (`data.pipeline.load_text_dataset`: jsonl/json/csv/tsv/parquet/txt, a ``text``
  column, ``prompt`` + ``completion``, or conversations: ``messages`` rendered with the chat template, loss on
  the assistant turns, `data.conversations`) or a built-in offline corpus (`data.corpora.build_corpus`,
  default ``sunspots``), tokenised number-aware (`data.pipeline.tokenize_dataset`), padded on the right;
  with ``packing`` the training rows are packed into rows of ``max_length`` tokens instead (`data.packing`:
  no attention across rows, the value head's recent numbers restart at each), evaluation and the value
  head's fits keep the rows unpacked.
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
  FSDP2 and FSDP1 (``examples/accelerate_configs/fsdp2.yaml``, ``fsdp.yaml``): the setup, the evaluation's
  model and padded forwards, the clipping and the sharded checkpoint state are `engines`'
  (docs/distributed.md); DeepSpeed ZeRO-2 / ZeRO-3 (``examples/accelerate_configs/deepspeed_zero{2,3}.yaml``):
  `engines` too (the backward, the gathered heads under ZeRO-3, DeepSpeed's own sharded checkpoint);
  ZeRO-0/1 are refused at start.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import Tensor
from torch.utils.data import DataLoader

from ..config import IGNORE_INDEX
from ..data.pipeline import NumericCollator, number_layout
from ..numbers import NumberTokenizer
from ..saving.assets import load_base
from ..saving.unwrap import unwrap_model
from ..model import get_causal_model
from ..saving.process_groups import keep_gloo_groups_to_process_end
from . import engines
from .checkpoints import (
    CHECKPOINT_PREFIX,
    TrainState,
    check_same_resume,
    list_checkpoints,
    load_checkpoint,
    remove_old_checkpoints,
    resolve_resume,
    rng_state,
    write_checkpoint,
)
from .config import PARAMETER_GROUPS, TrainConfig
from .data import EpochSampler, loader_rows, pad_token_id, prepare_datasets, read_datasets, rows_at, step_plan
from .metrics import MODEL_INPUTS, MetricAccumulator, accumulate, train_median
from .plotting import plot_training
from .value_head import fit_after_training, fit_before_training, refit_value_head

ADAPTER_SUBDIR = "adapter"
METRICS_LOG = "metrics.jsonl"
FINAL_METRICS = "final_metrics.json"
PLOT_NAME = "training.png"



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
    eval_model: Any = None  # what evaluations and value-head fits run (`engines.eval_model`; without autocast)
    tokenizer: Any = None
    train_ds: Any = None
    eval_ds: Any = None
    collator: Any = None  # pads rows (evaluation, the value head's fits)
    loader_ds: Any = None  # the rows the training loader reads: train_ds, or its rows packed (`packing`)
    loader_collator: Any = None
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
    _training_rows(run)
    _prepare_optimization(run)
    _resume_and_open_log(run)
    _train_steps(run, callbacks)
    return _finish(run)


def _start(config: TrainConfig) -> Run:
    """The accelerator (refusing what `engines.check_engine` refuses), launch warnings, the output directory, the seed."""
    from accelerate.utils import set_seed

    accelerator = engines.make_accelerator(config)
    engines.check_engine(accelerator)
    keep_gloo_groups_to_process_end()  # no gloo teardown during interpreter exit (it aborted now and then)
    run = Run(config=config, accelerator=accelerator, out_dir=Path(config.output_dir),
              is_main=accelerator.is_main_process, world=accelerator.num_processes, rank=accelerator.process_index)
    for msg in engines.launch_warnings(run.world, config.expected_num_processes):
        warnings.warn(msg, engines.LaunchWarning, stacklevel=3)
    if run.is_main:
        run.out_dir.mkdir(parents=True, exist_ok=True)
    set_seed(config.seed)
    return run


def _build_model_and_data(run: Run, model, tokenizer, train_dataset, eval_dataset, train_targets) -> None:
    """The CausalModel (built from the config unless given; frozen parts, checkpointing), the datasets,
    the constant baseline, the collator and, for a fresh run, the value head's warm start."""
    config = run.config
    train_dataset, eval_dataset = read_datasets(config, train_dataset, eval_dataset)  # a bad file: before the base
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
    run.collator = NumericCollator(pad_token_id(ntok, model), padding_side="right")
    run.resumed_from = resolve_resume(config)
    check_same_resume(run.resumed_from, run.accelerator)  # a node without the checkpoint: refused, not a hang
    if ntok is not None:  # where the value head is fitted (the data's, so a resumed run gets the same)
        prefix, contexts = number_layout(run.train_ds, model.num_token_id, ntok.tokenizer)
        model.causal_config.number_prefix_id, model.causal_config.number_contexts = prefix, contexts
    if run.resumed_from is None:  # a resumed run takes the units and heads from its checkpoint
        with engines.inference_precision(model):  # the features the saved adapter will see (no autocast)
            fit_before_training(model, config, run.train_ds, run.collator, run.accelerator.device,
                                verbose=run.is_main, eval_ds=run.eval_ds,
                                decode=None if ntok is None else ntok.tokenizer.decode)


def _training_rows(run: Run) -> None:
    """What the training loader reads: the tokenised rows padded, or packed with `packing` (`data.loader_rows`)."""
    run.loader_ds, run.loader_collator = loader_rows(run.config, run.train_ds, run.collator.pad_token_id,
                                                     run.accelerator)


def _prepare_optimization(run: Run) -> None:
    """The sampler and loader, the step plan, AdamW and the scheduler, accelerate's prepare."""
    from transformers import get_scheduler

    config = run.config
    run.sampler = EpochSampler(len(run.loader_ds), run.world, run.rank, seed=config.seed)
    run.loader = DataLoader(run.loader_ds, batch_size=config.per_device_train_batch_size, sampler=run.sampler,
                            collate_fn=run.loader_collator, num_workers=config.dataloader_num_workers,
                            generator=torch.Generator().manual_seed(config.seed))  # own generator: global RNG untouched
    run.batches_per_epoch, run.total_steps, warmup = step_plan(config, run.sampler.shard_size)
    optimizer = make_optimizer(run.inner, config)
    run.scheduler = get_scheduler(config.lr_scheduler_type, optimizer, num_warmup_steps=warmup,
                                  num_training_steps=run.total_steps)
    run.model, run.optimizer = engines.prepare(run.accelerator, run.inner, optimizer, config)
    run.eval_model = engines.eval_model(run.accelerator, run.model)
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
        weights_loaded = engines.load_engine_state(run.accelerator, run.resumed_from, run.optimizer)  # FSDP: sharded state
        run.history = load_checkpoint(run.resumed_from, run.inner, run.optimizer, run.scheduler, run.state, config,
                                      run.world, run.rank, len(run.loader_ds), weights_loaded=weights_loaded)
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

    eval_ds, bs = run.eval_ds, run.config.per_device_eval_batch_size
    idx = list(range(run.rank, len(eval_ds), run.world))
    batches = (run.collator(rows_at(eval_ds, idx[i:i + bs])) for i in range(0, len(idx), bs))
    # the unwrapped model: no DDP collective inside forward, so processes may run different numbers of
    # evaluation batches; run as the saved adapter runs at inference (no autocast: the metrics are `eval`'s)
    with engines.inference_precision(run.eval_model) as model:
        acc = accumulate(model, batches, MetricAccumulator(run.inner.num_token_id, run.inner.causal_config.reg_weight,
                                                           calibration=run.inner.causal_config.value_calibration, value_map=run.inner.value_map),
                         device=run.device)
        # FSDP: as many forwards as the longest shard has batches (each one all-gathers the layers)
        missing = math.ceil(math.ceil(len(eval_ds) / run.world) / bs) - math.ceil(len(idx) / bs)
        if missing > 0:
            pad = {k: v.to(run.device) for k, v in run.collator(rows_at(eval_ds, [0])).items() if k in MODEL_INPUTS}
            engines.pad_forwards(run.accelerator, model, pad, missing)
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
    again on the features as they are now (`refit_value_head`), then the heads and config restored,
    so evaluations leave the training path (and checkpoints, which resume exactly) unchanged."""
    inner = run.inner
    saved_config = copy.deepcopy(inner.causal_config)
    with engines.whole_heads(run.accelerator, inner, modify=True):  # ZeRO-3: gathered for the fit and its undoing
        heads = {name: {k: v.clone() for k, v in getattr(inner, name).state_dict().items()}
                 for name in ("numeric_embedding", "abduction", "action")}
        refitted = run.config.value_refit == "eval" and refit_value_head(
            run.eval_model, run.config, run.train_ds, run.collator, run.device, False, run.eval_ds)
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
                         len(run.loader_ds), run.history, tensors=tensors, engine_dir=engine_dir)
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
        with engines.no_sync(accelerator, run.model, sync):
            out = run.model(**inputs)
            # the micro-batch's one host sync: the three losses together
            losses = torch.stack([out.loss, out.loss_cls, out.loss_reg]).detach().to("cpu", torch.float64)
            if not torch.isfinite(losses).all():
                loss, loss_cls, loss_reg = losses.tolist()
                raise FloatingPointError(f"non-finite loss {loss} at step {state.global_step + 1} "
                                         f"(loss_cls={loss_cls}, loss_reg={loss_reg})")
            engines.backward(accelerator, run.model, out.loss / group, sync)
        window.running[:3] += losses
        window.running[3] += 1
        window.tokens += (inputs["labels"][:, 1:] != IGNORE_INDEX).sum()  # on the device, read when logging
    if config.max_grad_norm:
        engines.clip_grad_norm_(accelerator, run.model, run.trainable, config.max_grad_norm)
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
    inner, state = run.inner, run.state
    with engines.whole_heads(run.accelerator, inner, modify=True):  # ZeRO-3: the heads gathered, the fits kept
        _fit_final_heads(run)
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


def _fit_final_heads(run: Run) -> None:
    """The value head after training (`value_head.fit_after_training`: refitted on the final features, the last
    evaluation, the calibration of the width), then the calibrated evaluation."""
    step = run.state.global_step

    def final_evaluation(refitted: bool) -> dict:
        if refitted and run.refitted_eval_step != step:
            run.last_eval_step = -1  # the head changed since the step's evaluation (not taken with this same refit)
        if run.last_eval_step != step:
            _run_eval(run)
        return run.predictions

    calibrated = fit_after_training(run.eval_model, run.config, run.train_ds, run.collator, run.device, run.is_main,
                                    run.eval_ds, final_evaluation, lambda: _evaluate(run).predictions())
    if calibrated is not None:
        if run.is_main and calibrated.log_items():
            print("value scale: " + ", ".join(f"{k}={v}" for k, v in calibrated.log_items().items()), file=sys.stderr)
        _run_eval(run, "eval_calibrated")  # the final metrics, logged apart from the step's own evaluation


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
                         calibration=run.inner.causal_config.value_calibration, value_map=run.inner.value_map)


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
