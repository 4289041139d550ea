"""Each series' own AR on the row's window, fitted on its training rows and mixed into the head's location where its
validation rows say so (`modeling.series_ar`, `TrainConfig.series_ar`): after training, before the calibration."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from ...modeling.series import positive_series, row_key, series_title
from ...modeling.series_ar import AR_LAGS, MIXES, mixed_locations, window_features
from ...modeling.value_transform import ValueMap
from .choice import beats_by_one_se

#: validation rows a series needs before its AR may replace the head (12: a year of a monthly series)
MIN_AR_VAL_ROWS = 10
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
    numbers before each and the series its text names (`modeling.series.series_title`, as a prompt is named)."""
    value_column = "label_values" if "label_values" in rows.column_names else "numeric_values"
    keys, recent, y = [], [], []
    for ids, numbers, values, mask in zip(rows["input_ids"], rows["numeric_values"], rows[value_column], masks):
        seen: list[float] = []
        for i, (t, keep) in enumerate(zip(ids, mask)):
            if keep:
                keys.append(row_key(*series_title(ids[:i], numbers[:i], num_token_id)))
                newest = seen[::-1][:window]
                recent.append(newest + [float("nan")] * (window - len(newest)))
                y.append(float(values[i]))
            if t == num_token_id:
                seen.append(float(numbers[i]))
    return WindowRows(keys, torch.tensor(recent, dtype=torch.float64).reshape(len(y), window),
                      torch.tensor(y, dtype=torch.float64))


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


def choose_series_ar(table: dict, value_map: ValueMap, train: WindowRows, val: WindowRows, val_loc: Tensor
                     ) -> tuple[Tensor, int]:
    """Per series of `table` with >= `MIN_AR_VAL_ROWS` validation rows: its AR of each of `AR_LAGS` fitted on its
    training rows, mixed with the head by each of `MIXES`; the candidate of least validation error (on the head's
    scale) is written as the series' ``ar`` entry when it beats the head by one standard error there
    (`choice.beats_by_one_se`). val_loc [n_val]: the head's loc_Y of the validation rows. Returns (the validation
    rows' locations with the chosen ARs, how many series got one); a refit drops the entries of an earlier one."""
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
        head = val_loc[at_val].double()
        head_err = (head - y_val[at_val]).abs()
        best, best_err = None, head_err
        for lags in AR_LAGS:
            coef = fit_ar(train.recent[at_train], y_train[at_train], log_train[at_train], lags)
            if coef is None:
                continue
            alone = mixed_locations(head, val.recent[at_val], log_val[at_val],
                                    [{"coef": coef, "mix": 0.0}] * len(at_val))
            for mix in MIXES:  # the AR's location once, then each mix of it (a short window keeps the head's)
                ar = {"coef": coef, "mix": mix}
                err = (mix * head + (1 - mix) * alone - y_val[at_val]).abs()
                if bool(torch.isfinite(err).all()) and float(err.mean()) < float(best_err.mean()):
                    best, best_err = ar, err
        if best is not None and beats_by_one_se(head_err - best_err):
            entry["ar"] = best
            chosen += 1
    loc = mixed_locations(val_loc.double(), val.recent, log_val, [table.get(k, {}).get("ar") for k in val.keys])
    return loc, chosen
