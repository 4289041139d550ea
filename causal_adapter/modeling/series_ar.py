"""A series' own linear forecast on the row's window, mixed into the value head's location (issue 66).

One value head serves every series of a file. A per-series AR on the window a row shows (the baseline a forecaster
fits to each series) can read a series' own dynamics better than the shared head: a noisy monthly count, a
mean-reverting index. So, after training, each series of the file with enough rows gets its AR, chosen on its
validation rows (`training.value_head.series_ar`: the least validation error of the head, the AR and their even
mix), and its location moves to

    loc = mix loc_Y + (1 - mix) (m + s (c_0 + sum_j c_j (S_j - m) / s)),   j = 1 .. lags - 1,   mix in {0, 0.5},

where S are the row's numbers of the value's kind, newest first (`row_units.same_role`), m = S_0 and s the window's
mean |step| (the "last" units of `row_units`), on the head's scale (logs for a row on log y), and c the series'
coefficients, fitted by least squares on its training rows. Each chosen series keeps its ``ar`` entry in
`CausalAdapterConfig.value_series`: ``{"coef": [c_0, ..., c_{lags-1}], "mix": mix}``. Every reader of a value
(`prediction.prediction_rows`: predict, the server, vLLM's pooling; the step loop's `generation.choose.heads`:
generate and a horizon's paths) applies it; a row whose series has none, or whose window is too short, keeps
loc_Y. The intervals' width is the head's (calibrated after the choice).
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import Tensor

from .row_units import row_location_scale

#: the window lengths (the newest value included) a series' AR may read
AR_LAGS = (2, 4, 8)


def window_features(recent: Tensor, log: Tensor | bool, lags: int) -> tuple[Tensor, Tensor, Tensor]:
    """recent [n, W] raw numbers (newest first, NaN none) -> (X [n, lags] = [1, (S_j - m) / s for j in 1..lags-1],
    m [n], s [n]) in float64 on the head's scale (`log` [n] bool or one bool: the row's numbers as logs). A row with
    fewer than `lags` numbers of the value's kind, or no step, has NaN features."""
    values, m, s, own = row_location_scale(recent.double(), "last", math.nan, math.nan, log_space=log)
    if values.shape[-1] < lags:
        values = torch.cat([values, values.new_full((*values.shape[:-1], lags - values.shape[-1]), math.nan)], -1)
    feats = (values[..., 1:lags] - m.unsqueeze(-1)) / s.unsqueeze(-1)
    X = torch.cat([torch.ones_like(m).unsqueeze(-1), feats], -1)
    bad = ~own | ~torch.isfinite(X).all(-1)
    return torch.where(bad.unsqueeze(-1), math.nan, X), m, s


def row_ar(keys: Sequence[str], table: dict | None) -> list[dict | None]:
    """Per row its series' ``ar`` entry in `table` (None: none)."""
    table = table or {}
    return [table.get(k, {}).get("ar") for k in keys]


def mixed_locations(loc: Tensor, recent: Tensor | None, log: Tensor | bool, ars: Sequence[dict | None]) -> Tensor:
    """loc [n] (the head's loc_Y on its scale), recent [n, W] the rows' raw numbers, ars [n] (`row_ar`) -> [n] each
    row's location: its series' mix of loc_Y and its AR, loc_Y where it has none or its window is too short."""
    if recent is None or not any(a is not None for a in ars):
        return loc
    out = loc.clone()
    log_t = (log if isinstance(log, Tensor) else torch.full((len(ars),), bool(log))).to(recent.device)
    for lags in sorted({len(a["coef"]) for a in ars if a is not None}):
        idx = [i for i, a in enumerate(ars) if a is not None and len(a["coef"]) == lags]
        at = torch.tensor(idx, device=recent.device)
        X, m, s = window_features(recent[at], log_t[at], lags)
        coef = torch.tensor([ars[i]["coef"] for i in idx], dtype=X.dtype, device=X.device)
        mix = torch.tensor([float(ars[i]["mix"]) for i in idx], dtype=X.dtype, device=X.device)
        ar = m + s * (X * coef).sum(-1)
        head = loc[at.to(loc.device)].to(X.dtype)
        out[at.to(loc.device)] = torch.where(torch.isfinite(ar), mix * head + (1 - mix) * ar, head).to(loc)
    return out
