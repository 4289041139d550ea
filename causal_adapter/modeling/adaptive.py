"""Intervals that adapt online as targets arrive, for ordered (time-ordered) rows: adaptive conformal
inference (ACI, Gibbs & Candes 2021, "Adaptive conformal inference under distribution shift").

The split-conformal map (`intervals.fit_calibration`) holds when the test rows are exchangeable with the
validation rows. Ordered data break that: a series drifts, and the validation residuals of its earlier
window understate (or overstate) the test ones. ACI keeps a running level per nominal level q, with
alpha = 1 - q::

    alpha_{t+1} = alpha_t + gamma (alpha - err_t),    err_t = 1 if y_t fell outside row t's interval

Row t's interval is loc_t -+ c_t scale_t with c_t the (1 - alpha_t) quantile of a pool of normalised
scores |y - loc| / scale: the calibration map's scores followed by the scores of the rows already seen
(the last `window` of them when a window is given). Row t uses only the targets of rows before it, so
the intervals can be issued one row at a time as targets arrive. A running level past what the pool can
give (alpha_t <= 0) gets the pool's largest score, alpha_t >= 1 the empty interval (c_t = 0): the widths
stay finite, so the interval score of a run is finite. Rows without a target (nan) get an interval and
change nothing. The long-run miss rate tends to alpha whatever the drift (Gibbs & Candes, Prop. 4.1).
"""
from __future__ import annotations

import bisect
import math
from collections import deque
from typing import Sequence

import torch
from torch import Tensor

from .intervals import check_level

#: ACI step size, chosen on validation over co2, sunspots, macro and elnino by the interval score
#: (benchmarks/numeric_quality.py --ordered; docs/predict.md, "Ordered data"). A large step (0.3, the default
#: before the value head read the recent values) swings to the pool's widest score after each miss, which the
#: interval score pays for.
DEFAULT_GAMMA = 0.02
#: scores kept in the pool (None: all; the validation halves, 10 to 26 rows, cannot tell windows apart)
DEFAULT_WINDOW: int | None = None


def _pool_quantile(pool: list[float], q: float) -> float:
    """The ceil((m + 1) q)-th smallest of the m sorted scores of `pool`, capped to the largest; 0 for q <= 0."""
    if q <= 0 or not pool:
        return 0.0
    k = min(math.ceil((len(pool) + 1) * q), len(pool))
    return pool[max(k, 1) - 1]


def adaptive_multipliers(y: Sequence[float] | Tensor, loc: Sequence[float] | Tensor,
                         scale: Sequence[float] | Tensor, level: float, calibration: dict | None,
                         gamma: float = DEFAULT_GAMMA, window: int | None = DEFAULT_WINDOW) -> Tensor:
    """ACI multipliers c_t [n] for rows (y, loc, scale) [n] in their order: row t's interval at `level`
    is loc_t -+ c_t scale_t, from the targets of rows 0..t-1 only. `calibration`: the adapter's map (its
    scores start the pool; None: an empty pool, so the first rows get c = 0 until targets arrive)."""
    alpha = 1.0 - check_level(level)
    if not gamma >= 0 or not math.isfinite(gamma):
        raise ValueError(f"the ACI step size gamma must be a finite number >= 0, got {gamma!r}")
    if window is not None and window < 1:
        raise ValueError(f"the ACI window must be a positive number of scores (or None), got {window!r}")
    y, loc, scale = (torch.as_tensor(v, dtype=torch.float64).reshape(-1) for v in (y, loc, scale))
    order = deque(float(s) for s in (calibration or {}).get("scores", []))  # arrival order (the map's: sorted)
    while window is not None and len(order) > window:
        order.popleft()
    pool = sorted(order)
    a_t, out = alpha, []
    for y_t, loc_t, scale_t in zip(y.tolist(), loc.tolist(), scale.tolist()):
        c = _pool_quantile(pool, 1.0 - a_t)
        out.append(c)
        if not math.isfinite(y_t):
            continue
        s = abs(y_t - loc_t) / scale_t
        err = float(abs(y_t - loc_t) > c * scale_t)
        a_t += gamma * (alpha - err)
        if math.isfinite(s):
            order.append(s)
            bisect.insort(pool, s)
            if window is not None and len(order) > window:
                pool.pop(bisect.bisect_left(pool, order.popleft()))
    return torch.tensor(out, dtype=torch.float64)


def adaptive_interval(y: Sequence[float] | Tensor, loc: Sequence[float] | Tensor, scale: Sequence[float] | Tensor,
                      level: float, calibration: dict | None, gamma: float = DEFAULT_GAMMA,
                      window: int | None = DEFAULT_WINDOW) -> tuple[Tensor, Tensor]:
    """(lower, upper) [n] of the ACI intervals (`adaptive_multipliers`) of ordered rows."""
    loc, scale = (torch.as_tensor(v, dtype=torch.float64).reshape(-1) for v in (loc, scale))
    half = adaptive_multipliers(y, loc, scale, level, calibration, gamma, window) * scale
    return loc - half, loc + half
