"""The run's data: the datasets prepared (files or corpus, streams materialised, tokenised, columns
selected), the order a process reads them in (`EpochSampler`) and the step plan it gives."""
from __future__ import annotations

import contextlib
import math
from typing import Sequence

import torch
from torch.utils.data import Sampler

from ..data.conversations import read_chat_template
from ..data.corpora import build_corpus
from ..data.packing import PackedCollator, pack_dataset
from ..data.pipeline import NumericCollator, load_text_dataset, tokenize_dataset
from .config import TrainConfig
from .metrics import MODEL_INPUTS


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



def _feature_columns(ds, config: TrainConfig):
    """Rename the baseline columns to target/previous and keep only what the loop uses."""
    cols = ds.column_names
    for src, dst in ((config.target_column, "target"), (config.previous_column, "previous")):
        if src != dst and src in cols and dst not in cols:
            ds = ds.rename_column(src, dst)
    keep = [c for c in (*MODEL_INPUTS, "target", "previous") if c in ds.column_names]
    return ds.select_columns(keep)


def read_datasets(config: TrainConfig, train_dataset=None, eval_dataset=None):
    """(train, validation or None), raw: the datasets given, else `config`'s files or built-in corpus.
    Nothing here needs the model: `train()` reads them before it loads the base, so a bad file fails in seconds."""
    if train_dataset is not None:
        return train_dataset, eval_dataset
    if config.train_file:
        columns = (config.text_column, config.prompt_column, config.completion_column)  # CSV: read as text
        train_dataset = load_text_dataset(config.train_file, file_type=config.file_type, string_columns=columns)
        if config.validation_file:
            eval_dataset = load_text_dataset(config.validation_file, file_type=config.file_type,
                                             string_columns=columns)
        return train_dataset, eval_dataset
    kw = {} if config.corpus_window is None else {"window": config.corpus_window}
    dd = build_corpus(config.dataset, **kw)
    return dd["train"], dd["validation"]


def prepare_datasets(config: TrainConfig, number_tokenizer, train_dataset=None, eval_dataset=None,
                     accelerator=None):
    """(train, validation or None, train targets or None): tokenised, columns selected.

    Datasets passed in are used as they are when they already have ``input_ids`` (pre-tokenised),
    else tokenised; otherwise the files or built-in corpus of `config` are loaded (`read_datasets`)."""
    import datasets

    train_dataset, eval_dataset = read_datasets(config, train_dataset, eval_dataset)
    train_dataset, eval_dataset = materialize_streams(config, train_dataset, eval_dataset, accelerator)
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

    chat_template = read_chat_template(config.chat_template) if config.chat_template else None

    def tok(ds, rows_name, prompt_loss="none", assistant_only_loss=True):
        if ds is None or "input_ids" in ds.column_names:
            return ds
        if number_tokenizer is None:
            raise ValueError("the dataset is not tokenised (no input_ids column): pass tokenizer=... to train()")
        return tokenize_dataset(ds, number_tokenizer, text_column=config.text_column,
                                prompt_column=config.prompt_column, completion_column=config.completion_column,
                                max_length=config.max_length, add_eos_token=config.add_eos_token,
                                prompt_loss=prompt_loss, messages_column=config.messages_column,
                                chat_template=chat_template, enable_thinking=config.enable_thinking,
                                assistant_only_loss=assistant_only_loss, rows_name=rows_name)

    ctx = accelerator.main_process_first() if accelerator is not None else contextlib.nullcontext()
    with ctx:
        # validation keeps completion-only (assistant-only) labels: its metrics stay those of `causal-adapter eval`
        train_dataset = tok(train_dataset, "training rows", config.prompt_loss, config.assistant_only_loss)
        eval_dataset = tok(eval_dataset, "validation rows")
    train_dataset = _feature_columns(train_dataset, config)
    if eval_dataset is not None:
        eval_dataset = _feature_columns(eval_dataset, config)
    return train_dataset, eval_dataset, targets


def loader_rows(config: TrainConfig, train_dataset, pad_id: int, accelerator=None):
    """(the rows the training loader reads, their collator): with `config.packing` the tokenised training rows
    packed into rows of `config.max_length` tokens (default: the longest row's; `data.packing`) and a
    `PackedCollator`; else the rows themselves, padded on the right by a `NumericCollator`."""
    if not config.packing:
        return train_dataset, NumericCollator(pad_id, padding_side="right")
    ctx = accelerator.main_process_first() if accelerator is not None else contextlib.nullcontext()
    with ctx:
        packed = pack_dataset(train_dataset, config.max_length)
    return packed, PackedCollator(pad_id)


def materialize_streams(config: TrainConfig, train_dataset, eval_dataset, accelerator=None):
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


def rows_at(ds, indices: Sequence[int]) -> list[dict]:
    """The rows of `ds` at `indices` as dicts (what the collator takes)."""
    cols = ds[list(indices)]
    keys = list(cols)
    return [dict(zip(keys, vals)) for vals in zip(*(cols[k] for k in keys))]


def pad_token_id(ntok, inner) -> int:
    """The padding id of the batches: the tokenizer's, else the backbone config's, else 0."""
    if ntok is not None:
        return ntok.pad_token_id
    pad_id = getattr(inner.backbone.config, "pad_token_id", None)
    return 0 if pad_id is None else int(pad_id)


def step_plan(config: TrainConfig, shard_size: int) -> tuple[int, int, int]:
    """(micro-batches per epoch, total optimizer steps, warmup steps) of a run over `shard_size`
    examples per process."""
    batches_per_epoch = math.ceil(shard_size / config.per_device_train_batch_size)
    updates_per_epoch = math.ceil(batches_per_epoch / config.gradient_accumulation_steps)
    total_steps = config.max_steps if config.max_steps > 0 else math.ceil(config.num_train_epochs * updates_per_epoch)
    warmup = config.warmup_steps or math.ceil(config.warmup_ratio * total_steps)
    return batches_per_epoch, total_steps, warmup
