"""Packed and padding-free batches: several tokenised rows in one sequence, none attending to another.

* `pack_dataset`: the rows of a tokenised dataset (`pipeline.tokenize_dataset` features ``input_ids``,
  ``numeric_values``, ``labels``, ``label_values``) packed best-fit-decreasing into rows of at most
  ``max_length`` tokens, with ``position_ids`` that restart at 0 where each original row begins (a `datasets`
  batched map, as TRL's ``pack_dataset(strategy="bfd")``).
* `PackedCollator`: packed rows (or plain tokenised rows) -> a batch with ``position_ids`` and NO
  ``attention_mask``, either one row per packed row (padded at the end) or everything flattened into one row
  (``flatten=True``: transformers' ``DataCollatorWithFlattening``, TRL's ``padding_free``).

What keeps rows apart (the model is written against it, `model.CausalModel.forward`):

* attention: transformers builds the packed-sequence mask (sdpa, eager) or runs varlen flash attention
  from position ids when there is no attention_mask and no cache; a new row starts wherever the position
  does not follow the previous one by 1 (`modeling.recent_numbers.packed_row_starts`);
* the value head's recent numbers (`modeling.recent_numbers.recent_values`) restart at each row's start;
* the loss: the first label of every row is -100 (and its label value 0.0), so the last token of one row
  never predicts the first token of the next (``DataCollatorWithFlattening``'s separator). The unpacked
  row never uses that label either (labels are shifted inside the model), so a row carries the same
  targets packed or padded;
* padding: ``input_ids`` the pad id, values 0.0, labels -100, and position ids 0, 1, 2, ... of their own:
  a padded tail is a row of its own, which no real token attends to.

A row's numbers stay with their tokens: ``numeric_values`` / ``label_values`` are cut and joined exactly as
``input_ids`` (a number is one ``<NUM>`` position). A row longer than ``max_length`` keeps its first
``max_length`` tokens (`tokenize_dataset(max_length=...)` has already cut it when given the same length).
"""
from __future__ import annotations

import bisect
from typing import Any, Mapping, Sequence

from ..config import IGNORE_INDEX
from ..numbers import to_list
from .collator import batch_length, padded_features

__all__ = ["PACKED_COLUMNS", "PackedCollator", "pack_dataset", "pack_rows"]

#: the columns of a packed row
PACKED_COLUMNS = ("input_ids", "numeric_values", "labels", "label_values", "position_ids")


def _bins_best_fit_decreasing(lengths: Sequence[int], max_length: int) -> list[list[int]]:
    """Row indices grouped into bins of total length <= max_length: longest row first, each into the open bin it
    fills most tightly (best fit decreasing), else a new bin. Deterministic: ties keep the rows' order."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (free tokens, bin index), sorted: the tightest fit is the first >= length
    for i in order:
        n = lengths[i]
        at = bisect.bisect_left(free, (n, -1))
        if at < len(free):
            space, b = free.pop(at)
        else:
            space, b = max_length, len(bins)
            bins.append([])
        bins[b].append(i)
        if space - n > 0:
            bisect.insort(free, (space - n, b))
    return bins


def pack_rows(batch: Mapping[str, Sequence[Sequence]], max_length: int) -> dict[str, list[list]]:
    """A batch of tokenised rows (a `datasets` batched-map dict: column -> list of rows) -> packed rows
    (`PACKED_COLUMNS`), each at most `max_length` tokens. Rows longer than `max_length` keep their first
    `max_length` tokens; empty rows are dropped. ``labels`` default to -100 everywhere, ``numeric_values`` to
    0.0, ``label_values`` to ``numeric_values`` where labels != -100."""
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
        raise ValueError(f"max_length must be a positive integer, got {max_length!r}")
    rows = []
    for i, ids in enumerate(batch["input_ids"]):
        ids = to_list(ids)[:max_length]
        n = len(ids)
        if not n:
            continue
        vals = to_list(batch["numeric_values"][i])[:n] if "numeric_values" in batch else [0.0] * n
        labels = to_list(batch["labels"][i])[:n] if "labels" in batch else [IGNORE_INDEX] * n
        if "label_values" in batch:
            lvals = to_list(batch["label_values"][i])[:n]
        else:
            lvals = [v if lab != IGNORE_INDEX else 0.0 for v, lab in zip(vals, labels)]
        if not len(vals) == len(labels) == len(lvals) == n:
            raise ValueError(f"row {i}: numeric_values / labels / label_values are not as long as input_ids ({n})")
        # the row's first label would be predicted by the previous row's last token once packed
        rows.append((ids, vals, [IGNORE_INDEX] + labels[1:], [0.0] + lvals[1:]))
    out: dict[str, list[list]] = {c: [] for c in PACKED_COLUMNS}
    for members in _bins_best_fit_decreasing([len(r[0]) for r in rows], max_length):
        packed: dict[str, list] = {c: [] for c in PACKED_COLUMNS}
        for i in members:
            ids, vals, labels, lvals = rows[i]
            packed["input_ids"] += ids
            packed["numeric_values"] += vals
            packed["labels"] += labels
            packed["label_values"] += lvals
            packed["position_ids"] += range(len(ids))
        for c in PACKED_COLUMNS:
            out[c].append(packed[c])
    return out


def pack_dataset(dataset, max_length: int | None = None, batch_size: int = 1000):
    """A tokenised `datasets.Dataset` -> its rows packed (`pack_rows`) into rows of at most `max_length` tokens
    (None: the longest row's length, so no row is cut), columns `PACKED_COLUMNS` (others, e.g. ``target``, are
    per-row and dropped). Rows are packed within each map batch of `batch_size` rows, in the dataset's order:
    shuffle before packing to mix them."""
    import datasets

    if "input_ids" not in dataset.column_names:
        raise ValueError("pack_dataset takes tokenised rows (input_ids, numeric_values, labels, label_values: "
                         "data.pipeline.tokenize_dataset)")
    if max_length is None:
        max_length = max((len(ids) for ids in dataset["input_ids"]), default=1)
    features = datasets.Features({
        "input_ids": datasets.List(datasets.Value("int64")),
        "numeric_values": datasets.List(datasets.Value("float32")),
        "labels": datasets.List(datasets.Value("int64")),
        "label_values": datasets.List(datasets.Value("float32")),
        "position_ids": datasets.List(datasets.Value("int64")),
    })
    return dataset.map(pack_rows, batched=True, batch_size=batch_size, fn_kwargs={"max_length": max_length},
                       remove_columns=dataset.column_names, features=features, desc="packing rows")


class PackedCollator:
    """Packed rows (`pack_dataset`) or plain tokenised rows -> a batch without ``attention_mask``.

    ``flatten=False``: [B, S], one row per feature, padded at the end to the longest (or to a multiple of
    ``pad_to_multiple_of``). ``flatten=True``: [1, total], the features one after another (padding-free).
    Returns ``input_ids``, ``labels``, ``position_ids`` (long), ``numeric_values``, ``label_values``
    (float32). A feature without ``position_ids`` is one row (0, 1, 2, ...). At every position 0 the label is
    -100 and the label value 0.0 (no row predicts the next row's first token); padding follows the module's
    rules (its own position ids from 0, labels -100)."""

    def __init__(self, pad_token_id, flatten: bool = False, pad_to_multiple_of: int | None = None):
        if hasattr(pad_token_id, "pad_token_id"):
            pad_token_id = pad_token_id.pad_token_id
        if isinstance(pad_token_id, bool) or not isinstance(pad_token_id, int) or pad_token_id < 0:
            raise ValueError(f"pad_token_id must be a non-negative int, got {pad_token_id!r}")
        if pad_to_multiple_of is not None and (not isinstance(pad_to_multiple_of, int) or pad_to_multiple_of < 1):
            raise ValueError(f"pad_to_multiple_of must be a positive int or None, got {pad_to_multiple_of!r}")
        self.pad_token_id, self.flatten, self.pad_to_multiple_of = pad_token_id, flatten, pad_to_multiple_of

    def __repr__(self) -> str:
        return (f"PackedCollator(pad_token_id={self.pad_token_id}, flatten={self.flatten}, "
                f"pad_to_multiple_of={self.pad_to_multiple_of})")

    def _row(self, i: int, f: Mapping[str, Any]) -> tuple[list, list, list, list, list]:
        if "input_ids" not in f:
            raise ValueError(f"feature {i} has no 'input_ids' (keys: {sorted(f)})")
        ids = to_list(f["input_ids"])
        n = len(ids)
        vals = to_list(f["numeric_values"]) if f.get("numeric_values") is not None else [0.0] * n
        labels = to_list(f["labels"]) if f.get("labels") is not None else [IGNORE_INDEX] * n
        if f.get("label_values") is not None:
            lvals = to_list(f["label_values"])
        else:
            lvals = [v if lab != IGNORE_INDEX else 0.0 for v, lab in zip(vals, labels)]
        pos = to_list(f["position_ids"]) if f.get("position_ids") is not None else list(range(n))
        for name, seq in (("numeric_values", vals), ("labels", labels), ("label_values", lvals),
                          ("position_ids", pos)):
            if len(seq) != n:
                raise ValueError(f"feature {i}: {name} has length {len(seq)} but input_ids has {n}")
        return ids, vals, labels, lvals, pos

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict:
        import torch

        if not features:
            raise ValueError("PackedCollator got an empty batch")
        rows = [self._row(i, f) for i, f in enumerate(features)]
        if self.flatten:
            rows = [tuple(sum((list(r[c]) for r in rows), []) for c in range(5))]
        length = batch_length([len(r[0]) for r in rows], self.pad_to_multiple_of, minimum=1)
        out = padded_features(len(rows), length, self.pad_token_id)
        out["position_ids"] = torch.zeros((len(rows), length), dtype=torch.long)
        for i, (ids, vals, labels, lvals, pos) in enumerate(rows):
            k = len(ids)
            # padding: positions 0, 1, 2, ... of its own (a row of its own: nothing real attends to it)
            out["position_ids"][i, k:] = torch.arange(length - k, dtype=torch.long)
            if k == 0:
                continue
            out["input_ids"][i, :k] = torch.tensor(ids, dtype=torch.long)
            out["numeric_values"][i, :k] = torch.tensor(vals, dtype=torch.float32)
            out["labels"][i, :k] = torch.tensor(labels, dtype=torch.long)
            out["label_values"][i, :k] = torch.tensor(lvals, dtype=torch.float32)
            out["position_ids"][i, :k] = torch.tensor(pos, dtype=torch.long)
        starts = out["position_ids"] == 0  # every row's first token: its label belongs to no row before it
        out["labels"][starts] = IGNORE_INDEX
        out["label_values"][starts] = 0.0
        return out
