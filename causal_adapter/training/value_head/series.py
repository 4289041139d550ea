"""The series table of a run (`modeling.series`): each series of the training and validation files, found by its
text, with its support (`series_table`, before training) and its width factor (`series_scale_factors`, in the
calibration after training)."""
from __future__ import annotations

from collections import defaultdict
from typing import Callable, Sequence

import torch
from torch import Tensor

from ...modeling.series import MIN_SERIES_ROWS, row_key, series_title
from ...number_grammar import format_number
from ...records import value_label_mask


def _support(values: Sequence[float]) -> str:
    if all(v > 0 for v in values):
        return "positive"
    return "nonneg" if all(v >= 0 for v in values) else "signed"


def series_values(datasets, num_token_id: int) -> tuple[dict[str, list[float]], dict[str, tuple[list, list]]]:
    """({key: the values of its series}, {key: the (ids, title numbers' values) that name it}) over the rows of `datasets` (tokenised:
    input_ids, labels, numeric_values and maybe label_values): each completion value (`records.value_label_mask`)
    goes to the series its row's text before its first value names (`modeling.series.series_title`, unpacked
    rows)."""
    values: dict[str, list[float]] = defaultdict(list)
    titles: dict[str, tuple[list, list]] = {}
    for ds in datasets:
        if ds is None or not len(ds):
            continue
        column = "label_values" if "label_values" in ds.column_names else "numeric_values"
        for ids, labels, numbers, vals in zip(ds["input_ids"], ds["labels"], ds["numeric_values"], ds[column]):
            mask = value_label_mask(ids, labels, num_token_id)
            if not any(mask):
                continue
            first = mask.index(True)  # the text before the row's first value names it, as a prompt does
            title, title_values = series_title(ids[:first], numbers[:first], num_token_id)
            key = row_key(title, title_values)
            titles.setdefault(key, (title, title_values))
            values[key] += [float(v) for v, m in zip(vals, mask) if m]
    return dict(values), titles


def series_table(datasets, num_token_id: int, decode: Callable[[list[int]], str] | None = None) -> dict:
    """`CausalAdapterConfig.value_series` from the training and validation rows: per series its support
    ("positive": every value > 0, "nonneg": every value >= 0, "signed": one < 0), how many values it has and its
    name (its title, decoded by `decode`; else its key)."""
    values, titles = series_values(datasets, num_token_id)
    return {key: {"support": _support(v), "rows": len(v),
                  "name": _title_text(*titles[key], num_token_id, decode) if decode is not None else key}
            for key, v in values.items()}


def _title_text(ids: list[int], values: list[float], num_token_id: int, decode: Callable[[list[int]], str]) -> str:
    """The title as text: its tokens decoded, each <NUM> written as its value."""
    pieces, run, numbers = [], [], iter(values)
    for t in ids:
        if t == num_token_id:
            pieces += [decode(run), format_number(next(numbers))]
            run = []
        else:
            run.append(t)
    return "".join(pieces + [decode(run)]).strip()


def series_scale_factors(keys: Sequence[str], normalised: Tensor, table: dict) -> Tensor:
    """The width factor of each series with >= `MIN_SERIES_ROWS` validation rows,
    written into `table` as its ``scale``: the median of its rows' `normalised` residuals |y - loc_Y| / scale_Y [n]
    (a Cauchy's scale is its median absolute deviation, so the series' 50% interval is calibrated on its own rows);
    other series keep 1 (and lose a stale factor), and all keep 1 when fewer than two series have that many rows
    (one series' factor is the panel's own). Returns [n] each row's factor."""
    rows: dict[str, list[int]] = defaultdict(list)
    for i, key in enumerate(keys):
        rows[key].append(i)
    factors = torch.ones_like(normalised)
    for entry in table.values():
        entry.pop("scale", None)
    if sum(len(idx) >= MIN_SERIES_ROWS for idx in rows.values()) < 2:  # one series: the panel's width is its own
        return factors
    for key, entry in table.items():
        idx = rows.get(key, [])
        if len(idx) < MIN_SERIES_ROWS:
            continue
        f = float(normalised[idx].median())
        if f > 0 and torch.isfinite(torch.tensor(f)):
            entry["scale"] = f
            factors[idx] = f
    return factors
