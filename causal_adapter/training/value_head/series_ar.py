"""Each series' own AR on the row's window, fitted on its training rows and mixed into the head's location where its
validation rows say so (`modeling.series_ar`, `TrainConfig.series_ar`): after training, before the calibration."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from ...modeling.recent_numbers import recent_values
from ...modeling.series import positive_series, row_key, series_title
from ...modeling.series_ar import AR_LAGS, mixed_locations, window_features
from ...modeling.value_transform import ValueMap

#: validation rows a series needs before its AR may replace the head (12: a year of a monthly series)
MIN_AR_VAL_ROWS = 10
#: the head's share of the location in the even mix of the head and a series' AR
HALF = 0.5
#: the ridge penalty of an AR fit, times its rows (the features are scale-free: steps of the row's own size)
AR_RIDGE = 1e-3


@dataclass
class WindowRows:
    """Value targets with what the AR reads: their series keys [n], recent [n, W] the raw numbers before each
    (newest first, NaN none), y [n] the values."""
    keys: list[str]
    recent: Tensor
    y: Tensor


def window_rows(rows, masks: Sequence[Sequence[bool]], num_token_id: int, window: int) -> WindowRows:
    """The value targets of tokenised `rows` (`masks`: `records.value_label_mask` of each) with the `window`
    numbers before each (`modeling.recent_numbers.recent_values`, as the head reads them) and the series its text
    names (`modeling.series.series_title`, as a prompt is named)."""
    value_column = "label_values" if "label_values" in rows.column_names else "numeric_values"
    ids, numbers = rows["input_ids"], rows["numeric_values"]
    if not len(ids):
        return WindowRows([], torch.empty(0, window, dtype=torch.float64), torch.empty(0, dtype=torch.float64))
    # the numbers at or before each position of the rows padded to one length (a pad is no number), one row of
    # NaN in front: position i holds those of position i - 1, the numbers before target i
    S = max(map(len, ids))
    ids_t = torch.tensor([[-1] + list(r) + [-1] * (S - len(r)) for r in ids])
    nums_t = torch.tensor([[0.0] + [float(v) for v in r] + [0.0] * (S - len(r)) for r in numbers], dtype=torch.float64)
    seen = recent_values(ids_t, nums_t, num_token_id, window)
    keys, at, y = [], [], []
    for b, (row_ids, row_numbers, values, mask) in enumerate(zip(ids, numbers, rows[value_column], masks)):
        for i in (i for i, keep in enumerate(mask) if keep):
            keys.append(row_key(*series_title(row_ids[:i], row_numbers[:i], num_token_id)))
            at.append((b, i))
            y.append(float(values[i]))
    b, i = (torch.tensor(v, dtype=torch.long) for v in zip(*at)) if at else (torch.zeros(0, dtype=torch.long),) * 2
    return WindowRows(keys, seen[b, i], torch.tensor(y, dtype=torch.float64))


def head_log_rows(value_map: ValueMap, keys: Sequence[str], table: dict | None) -> Tensor:
    """[n] bool: the rows told on log y (a log head: all; a "series" head: those of a positive series)."""
    if value_map.series:
        return torch.tensor(positive_series(keys, table), dtype=torch.bool)
    return torch.full((len(keys),), bool(value_map.log))


def fit_ar(recent: Tensor, y: Tensor, log: Tensor, lags: int) -> list[float] | None:
    """The coefficients [lags] of y's location in the row's own units (`modeling.series_ar.window_features`; y on the
    head's scale) by ridge least squares, None with fewer than 3 x lags usable rows."""
    X, m, s = window_features(recent, log, lags)
    t = (y - m) / s
    ok = torch.isfinite(X).all(-1) & torch.isfinite(t)
    if int(ok.sum()) < 3 * lags:
        return None
    X, t = X[ok], t[ok]
    coef = torch.linalg.solve(X.T @ X + AR_RIDGE * len(t) * torch.eye(lags, dtype=X.dtype), X.T @ t)
    return coef.tolist() if bool(torch.isfinite(coef).all()) else None


def mae(loc: Tensor, y: Tensor) -> float:
    return float((loc - y).abs().mean())


def choose_series_ar(table: dict, value_map: ValueMap, train: WindowRows, val: WindowRows, val_loc: Tensor
                     ) -> tuple[Tensor, int]:
    """Per series of `table` with >= `MIN_AR_VAL_ROWS` validation rows: its AR of each of `AR_LAGS` fitted on its
    training rows, the lag whose even mix with the head (mix 0.5) errs least on the validation rows (on the head's
    scale); then the least validation error of the head alone (no entry), that mix and that AR alone (mix 0), the
    AR written as the series' ``ar`` entry. val_loc [n_val]: the head's loc_Y of the validation rows. Returns (the
    validation rows' locations with the chosen ARs, how many series got one); a refit drops the entries of an
    earlier one.

    Why no margin: the mix errs at most as much as the mean of the head and the AR (|a/2 + b/2| <= |a|/2 + |b|/2),
    so a wrong choice among the three costs little, and a dozen validation rows rarely show a margin of one
    standard error. With one (the head unless an AR beat it by one SE), the panel's sunspot.month kept the head at
    1.37x persistence on test (its AR 1.18x) and its monthly multiplying seasons were 1.125x AR(4)
    (`benchmarks/panel.py`); with the mix the default unless beaten by one SE, the demo's sunspots took the mix,
    worse than the head on validation and 8% worse on test."""
    for entry in table.values():
        entry.pop("ar", None)
    log_train, log_val = (head_log_rows(value_map, r.keys, table) for r in (train, val))
    y_train, y_val = value_map.rows(log_train).to_head(train.y), value_map.rows(log_val).to_head(val.y)
    chosen = 0
    for key, entry in table.items():
        at_val = [i for i, k in enumerate(val.keys) if k == key]
        at_train = [i for i, k in enumerate(train.keys) if k == key]
        if len(at_val) < MIN_AR_VAL_ROWS or not at_train:
            continue
        head, y = val_loc[at_val].double(), y_val[at_val]
        fits = []  # (coef, the AR's validation locations: the head's where the window is too short)
        for lags in AR_LAGS:
            coef = fit_ar(train.recent[at_train], y_train[at_train], log_train[at_train], lags)
            if coef is not None:
                alone = mixed_locations(head, val.recent[at_val], log_val[at_val],
                                        [{"coef": coef, "mix": 0.0}] * len(at_val))
                if bool(torch.isfinite(alone - y).all()):
                    fits.append((coef, alone))
        if not fits:
            continue
        coef, alone = min(fits, key=lambda f: mae(HALF * head + HALF * f[1], y))
        errors = {HALF: mae(HALF * head + HALF * alone, y), 1.0: mae(head, y), 0.0: mae(alone, y)}
        mix = min(errors, key=errors.get)  # the mix first: it wins a tie
        if mix < 1.0:
            entry["ar"] = {"coef": coef, "mix": mix}
            chosen += 1
    loc = mixed_locations(val_loc.double(), val.recent, log_val, [table.get(k, {}).get("ar") for k in val.keys])
    return loc, chosen
