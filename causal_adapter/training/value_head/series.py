"""The series table of a run (`modeling.series`): each series of the training and validation files, found by its
text, with its support (`series_table`, before training) and its width factor (`series_scale_factors`, in the
calibration after training)."""
from __future__ import annotations

from collections import defaultdict
from typing import Callable, Sequence

import torch
from torch import Tensor

from ...modeling.series import MIN_SERIES_ROWS, row_key, title_ids
from ...records import value_label_mask


def _support(values: Sequence[float]) -> str:
    if all(v > 0 for v in values):
        return "positive"
    return "nonneg" if all(v >= 0 for v in values) else "signed"


def series_values(datasets, num_token_id: int) -> tuple[dict[str, list[float]], dict[str, list[int]]]:
    """({key: the values of its series}, {key: the ids that name it}) over the rows of `datasets` (tokenised:
    input_ids, labels, numeric_values and maybe label_values): each completion value (`records.value_label_mask`)
    goes to the series its row's text names (`modeling.series.position_keys`, unpacked rows)."""
    values: dict[str, list[float]] = defaultdict(list)
    titles: dict[str, list[int]] = {}
    for ds in datasets:
        if ds is None or not len(ds):
            continue
        column = "label_values" if "label_values" in ds.column_names else "numeric_values"
        for ids, labels, vals in zip(ds["input_ids"], ds["labels"], ds[column]):
            mask = value_label_mask(ids, labels, num_token_id)
            if not any(mask):
                continue
            title = title_ids(ids, num_token_id)
            key = row_key(title)
            titles.setdefault(key, title)
            values[key] += [float(v) for v, m in zip(vals, mask) if m]
    return dict(values), titles


def series_table(datasets, num_token_id: int, decode: Callable[[list[int]], str] | None = None) -> dict:
    """`CausalAdapterConfig.value_series` from the training and validation rows: per series its support
    ("positive": every value > 0, "nonneg": every value >= 0, "signed": one < 0), how many values it has and its
    name (its title, decoded by `decode`; else its key)."""
    values, titles = series_values(datasets, num_token_id)
    return {key: {"support": _support(v), "rows": len(v),
                  "name": decode(titles[key]).strip() if decode is not None else key}
            for key, v in values.items()}


def series_scale_factors(keys: Sequence[str], normalised: Tensor, table: dict) -> Tensor:
    """The width factor of each series with >= `MIN_SERIES_ROWS` validation rows, written into `table` as its
    ``scale``: the median of its rows' `normalised` residuals |y - loc_Y| / scale_Y [n] (a Cauchy's scale is its
    median absolute deviation, so the series' 50% interval is calibrated on its own rows); other series keep 1 (and
    lose a stale factor), and all keep 1 when fewer than two series have that many rows (one series' factor is the
    panel's own). Returns [n] each row's factor."""
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
