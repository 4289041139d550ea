"""The series a row belongs to, and what each series' values may be: one file may mix series of any support.

A training file can hold many series side by side: counts that can be 0, rates that go below zero, positive
quantities from 0.4 to 17,000. One choice for the whole adapter would let one series with a 0 take the positive
floor away from every other series (issue 66), so the choice is made per series.

How a row finds its series: by its own text. Its text up to its first record names it (the title of a
`data.corpora.series_rows` row: ``Yearly sunspot numbers 1700: 5; 1701: 11; ...`` -> ``Yearly sunspot numbers``;
``Series 7. 1990: 5; ...`` -> ``Series 7.``, the title's numbers with their values; a chat row's template and
question up to the first record), hashed into a key (`row_key`, 16 hex digits). Records repeat the text between
their numbers (``": "``, ``"; "``, ...); the numbers before the first that breaks the repetition are the title's
(`title_numbers`). Two series with the same title share one key, and so the
more permissive of their supports. A packed row's key is its packed segment's. Padding is not part of the text.

What each series seen in the training and validation files gets (`CausalAdapterConfig.value_series`, written by
`train()`, `training.value_head.series`):

    support  "positive": every value there > 0; "nonneg": every value >= 0, some 0; "signed": some value < 0.
             A positive or nonneg series never gets a value or an interval bound below 0 (`RowSeries.floored`).
    scale    the series' own width factor: the median normalised residual |y - loc_Y| / scale_Y of its
             validation rows over the panel's (a quiet series narrows, a noisy one widens); absent (1) for a
             series with fewer than `MIN_SERIES_ROWS` validation rows, which keeps the panel's width.

A row whose key is not in the table (a series training never saw, a title written differently) gets its support
from its own numbers of the value's kind (`row_units.same_role`): "signed" when one of them is < 0, else
"nonneg" (floored at 0); without such numbers, none (the adapter's own `value_positive` alone). Its width factor
is 1. An adapter without a table (saved before it) floors by its `value_positive` alone.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from .row_units import MAX_PERIOD, row_period, same_role
from .series_ar import row_ar

#: validation rows a series needs before its width gets a factor of its own
MIN_SERIES_ROWS = 20


def row_key(title_ids: Sequence[int], title_values: Sequence[float] = ()) -> str:
    """The key of a series from the token ids that name it and the values of its title's numbers (16 hex digits, the
    same on every machine)."""
    digest = hashlib.blake2b(np.asarray(list(title_ids), dtype=np.int64).tobytes(), digest_size=8)
    digest.update(np.asarray(list(title_values), dtype=np.float64).tobytes())
    return digest.hexdigest()


def _alike(a: tuple, b: tuple) -> bool:
    """Two separators between numbers of records: the same tokens, but one in four may differ (a label's digit:
    ``" Q1: "`` and ``" Q2: "``; ``". "`` and ``": "`` differ)."""
    return len(a) == len(b) and sum(x != y for x, y in zip(a, b)) <= len(a) // 4


def title_numbers(ids: Sequence[int], num_token_id: int) -> int:
    """How many of a text's numbers belong to its title, not to its records. Records repeat their separators (the
    text between two numbers) with their period p: ``1990: 5; 1991: 6`` is ``": "``, ``"; "``, ``": "``, ...;
    walking back from the text's end, the first number whose separator breaks that repetition and the numbers before
    it are the title's: ``Series 7. 1990: 5; ...`` -> 1 (``". "``), ``Yearly sunspot numbers 1700: 5; ...`` -> 0."""
    nums = [i for i, t in enumerate(ids) if t == num_token_id]
    seps = [tuple(ids[a + 1:b]) for a, b in zip(nums, nums[1:])]
    for p in range(1, MAX_PERIOD + 1):  # the shortest period the last separators repeat with
        tail = range(max(len(seps) - 2 * p, 0), len(seps) - p)
        if len(seps) > p and all(_alike(seps[i], seps[i + p]) for i in tail):
            break
    else:
        return 0
    for i in range(len(seps) - p - 1, -1, -1):
        if not _alike(seps[i], seps[i + p]):
            return i + 1
    return 0


def series_title(ids: Sequence[int], values: Sequence[float], num_token_id: int) -> tuple[list[int], list[float]]:
    """What names a text's series: its tokens up to its first record (`title_numbers`), and the values of the
    numbers among them. `ids` / `values`: the text up to the position that reads it (no padding)."""
    nums = [i for i, t in enumerate(ids) if t == num_token_id]
    n_title = title_numbers(ids, num_token_id)
    end = nums[n_title] if n_title < len(nums) else len(ids)
    return list(ids[:end]), [float(values[i]) for i in nums[:n_title]]


def text_key(ids: Sequence[int], values: Sequence[float], num_token_id: int) -> str:
    """The series key of a text (`series_title`, `row_key`)."""
    return row_key(*series_title(ids, values, num_token_id))


def position_keys(input_ids: Tensor, numeric_values: Tensor, num_token_id: int, at: Tensor,
                  attention_mask: Tensor | None = None, row_starts: Tensor | None = None) -> list[str]:
    """input_ids, numeric_values, at [B, S] (at: bool) -> the series key of each position in `at`, in
    `input_ids[at]` order: its row's text up to it (packed: its segment's, `row_starts` [B, S] True where one
    begins) named by `series_title` (the position before the first number reads the title, as a prompt without
    numbers does). `attention_mask` [B, S]: its 0s (padding) are not text."""
    keys: list[str] = []
    at = at.bool()
    for b in at.any(-1).nonzero().flatten().tolist():
        ids, vals = input_ids[b].tolist(), numeric_values[b].tolist()
        keep = [True] * len(ids) if attention_mask is None else attention_mask[b].bool().tolist()
        starts = [0] if row_starts is None else sorted({0, *row_starts[b].nonzero().flatten().tolist()})
        for p in at[b].nonzero().flatten().tolist():
            start = max(s for s in starts if s <= p)
            text = [(t, v) for t, v, k in zip(ids[start:p + 1], vals[start:p + 1], keep[start:p + 1]) if k]
            keys.append(text_key([t for t, _ in text], [v for _, v in text], num_token_id))
    return keys


def last_keys(input_ids: Tensor, numeric_values: Tensor, num_token_id: int, attention_mask: Tensor | None = None
              ) -> list[str]:
    """[B, S] -> the key of each row at its last position (a prompt's: `prediction`, generation)."""
    at = torch.zeros_like(input_ids, dtype=torch.bool)
    at[:, -1] = True
    return position_keys(input_ids, numeric_values, num_token_id, at, attention_mask)


def own_support(recent: Tensor | None) -> list[str | None]:
    """recent [n, W] raw numbers (most recent first, NaN = none) -> per row "signed" when a number of the value's
    kind (`row_units.same_role`) is < 0, "nonneg" when it has such numbers and none is, None without any."""
    if recent is None:
        return []
    recent = recent.double().cpu()
    same = same_role(recent, row_period(recent))
    present = ~torch.isnan(same)
    negative = (torch.where(present, same, 0.0) < 0).any(-1)
    out: list[str | None] = []
    for has, neg in zip(present.any(-1).tolist(), negative.tolist()):
        out.append(None if not has else ("signed" if neg else "nonneg"))
    return out


def row_supports(keys: Sequence[str], table: dict | None, recent: Tensor | None = None) -> list[str | None]:
    """Per row: its series' support from `table` (`CausalAdapterConfig.value_series`), else `own_support` of its
    recent numbers [n, W] (module docstring); None: nothing known. An adapter without a table (saved before it, or
    never trained) gets None for every row: its `value_positive` alone, as before."""
    if table is None:
        return [None] * len(keys)
    fallback = own_support(recent) if recent is not None else [None] * len(keys)
    return [table[k]["support"] if k in table else f for k, f in zip(keys, fallback)]


def series_scales(keys: Sequence[str], table: dict | None, like: Tensor) -> Tensor:
    """[n] each row's width factor: its series' `scale` in `table`, 1 where it has none."""
    table = table or {}
    return torch.tensor([float(table.get(k, {}).get("scale", 1.0)) for k in keys], dtype=like.dtype,
                        device=like.device)


def series_of(keys: Sequence[str], table: dict | None) -> list[str]:
    """Per row the name of its series in `table` (its title, as training read it), or "" for one it never saw."""
    table = table or {}
    return [table[k].get("name", k) if k in table else "" for k in keys]


@dataclass
class RowSeries:
    """What each of n prompt rows gets: names [n] (its series' title, "" when unseen), supports [n] (`row_supports`),
    scale [n] (its width factor, `series_scales`), log [n] bool (on log y: a "series" head's rows of a positive
    series, `series_log_rows`; None for any other head), ars [n] its series' own AR (`series_ar.row_ar`; None:
    none) and recent [n, W] the numbers it reads (None: the head reads none)."""
    names: list[str]
    supports: list[str | None]
    scale: Tensor
    log: Tensor | None = None
    ars: list[dict | None] | None = None
    recent: Tensor | None = None

    @property
    def floored(self) -> Tensor:
        """[n] bool: the rows whose values and bounds are floored at 0 (a positive or nonneg series)."""
        return torch.tensor([s in ("positive", "nonneg") for s in self.supports], dtype=torch.bool,
                            device=self.scale.device)


def prompt_series(input_ids: Tensor, numeric_values: Tensor, attention_mask: Tensor | None, recent: Tensor | None,
                  num_token_id: int, table: dict | None, like: Tensor) -> RowSeries:
    """The `RowSeries` of left-padded prompts [n, S] read at their last position, `recent` [n, W] its recent
    numbers (None: the head reads none), `like`: the dtype and device of the width factors."""
    keys = last_keys(input_ids.cpu(), numeric_values.cpu(), num_token_id,
                     None if attention_mask is None else attention_mask.cpu())
    return RowSeries(series_of(keys, table), row_supports(keys, table, recent), series_scales(keys, table, like),
                     ars=row_ar(keys, table), recent=recent)


def prompt_support(ids: Sequence[int], values: Sequence[float], num_token_id: int, table: dict | None,
                   window: int = 16) -> tuple[bool, float, bool, dict | None]:
    """One prompt (ids and values, no padding) -> (whether its series never goes below 0, its width factor, whether
    it is positive, its series' own AR): what generation floors the values a row writes by, widens its intervals by
    (`row_supports`, the fallback reading its `window` most recent numbers; `series_scales`), for a "series" head
    tells on log y (`positive_series`) and mixes into its values (`series_ar.row_ar`)."""
    numbers = [float(v) for t, v in zip(ids, values) if t == num_token_id][::-1][:window]
    recent = torch.tensor([numbers + [math.nan] * (window - len(numbers))], dtype=torch.float64)
    key = text_key(list(ids), list(values), num_token_id)
    floored = row_supports([key], table, recent)[0] in ("positive", "nonneg")
    return (floored, float(series_scales([key], table, recent[0])[0]), positive_series([key], table)[0],
            row_ar([key], table)[0])


def positive_series(keys: Sequence[str], table: dict | None) -> list[bool]:
    """Per key: its series is positive in `table` (every value training and validation saw > 0, at least
    `MIN_SERIES_ROWS` of them): the rows a "series" head tells on log y (`value_transform`). An unseen series is
    not (its own numbers cannot say that a 0 will never come), nor one of a few values: a table's rows, each its own
    "series" by its text, would each say the sign of its own target."""
    table = table or {}
    return [table.get(k, {}).get("support") == "positive" and table[k].get("rows", 0) >= MIN_SERIES_ROWS
            for k in keys]


def series_log_rows(input_ids: Tensor, numeric_values: Tensor | None, num_token_id: int, table: dict | None,
                    attention_mask: Tensor | None = None, row_starts: Tensor | None = None) -> Tensor:
    """[B, S] -> [B, S] bool: the positions whose row (packed: segment, `row_starts` [B, S]) is of a positive series
    (`positive_series`), each row named by its whole text (`text_key`; padding, `attention_mask`'s 0s, left out)."""
    out = torch.zeros(input_ids.shape, dtype=torch.bool)
    if not table:
        return out.to(input_ids.device)
    ids_all = input_ids.tolist()
    vals_all = (torch.zeros(input_ids.shape) if numeric_values is None else numeric_values).tolist()
    for b, (ids, vals) in enumerate(zip(ids_all, vals_all)):
        keep = [True] * len(ids) if attention_mask is None else attention_mask[b].bool().tolist()
        starts = [0] if row_starts is None else sorted({0, *row_starts[b].nonzero().flatten().tolist()})
        for start, end in zip(starts, starts[1:] + [len(ids)]):
            text = [(t, v) for t, v, k in zip(ids[start:end], vals[start:end], keep[start:end]) if k]
            key = text_key([t for t, _ in text], [v for _, v in text], num_token_id)
            out[b, start:end] = positive_series([key], table)[0]
    return out.to(input_ids.device)
