"""Prediction intervals for a value Y ~ Cauchy(loc_Y, scale_Y) (SPEC 2, "Calibration map").

* raw: the central Cauchy interval, loc_Y +- tan(pi q / 2) scale_Y;
* calibrated: loc_Y +- c_q scale_Y, with c_q the split-conformal quantile of the normalised
  validation residuals |y - loc_Y| / scale_Y with the (n + 1) correction: the ceil((n + 1) q)-th
  smallest of n scores. A level past n / (n + 1) has no finite conformal quantile: c_q = inf.

The calibration map is a small dict stored in `CausalAdapterConfig.value_calibration` (hence in
the adapter's config file): ``{"n": n, "scores": [...]}``, the sorted scores, thinned to at most
`MAX_SCORES` evenly spaced order statistics (interpolated between) for large validation sets.

Assumption: the split-conformal guarantee (coverage >= q) holds when the rows predicted are
exchangeable with the validation rows the map was fitted on (e.g. rows drawn at random from one
pool). Ordered data break it: on a time series split by time the test rows come after the
validation ones, and under drift their residuals are larger (or smaller), so the intervals under-
(or over-) cover. For ordered rows with targets arriving, `adaptive` (adaptive conformal inference)
updates the level online from the misses so far (`predict --targets-column`, `eval`'s
``aci_coverage_*``); docs/predict.md, "Ordered data".

`choose_scale_exponent` picks how much of a fitted per-row width to keep (scale = base * ratio^a) by a
held-out interval score: conformal maps cross-fitted on halves of the validation rows
(`crossfit_interval_score`), so no map is scored on the rows it was fitted on.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import Tensor

from .value_transform import ValueMap

#: most order statistics kept in a calibration map (the config file stays small)
MAX_SCORES = 1001


def check_level(level: float) -> float:
    level = float(level)
    if not 0.0 < level < 1.0:
        raise ValueError(f"an interval level must be in (0, 1), got {level!r}")
    return level


def cauchy_multiplier(level: float) -> float:
    """Half-width of the central `level` interval of a standard Cauchy: tan(pi level / 2)."""
    return math.tan(math.pi * check_level(level) / 2.0)


def fit_calibration(y: Sequence[float] | Tensor, loc: Sequence[float] | Tensor, scale: Sequence[float] | Tensor,
                    max_scores: int = MAX_SCORES) -> dict | None:
    """The calibration map of validation targets `y` [n] under predictions (loc, scale) [n], or None
    when no finite score exists. Its intervals assume the rows they are used on are exchangeable with
    these (module docstring); ordered rows: `adaptive.adaptive_interval`."""
    y, loc, scale = (torch.as_tensor(t, dtype=torch.float64).reshape(-1) for t in (y, loc, scale))
    scores = ((y - loc).abs() / scale).sort().values
    scores = scores[torch.isfinite(scores)]
    n = int(scores.numel())
    if n == 0:
        return None
    if n > max_scores:  # evenly spaced order statistics, both ends kept
        idx = torch.linspace(0, n - 1, max_scores, dtype=torch.float64).round().long()
        scores = scores[idx]
    return {"n": n, "scores": [float(s) for s in scores]}


def conformal_multiplier(calibration: dict, level: float) -> float:
    """c_q of `calibration` for `level`: the ceil((n + 1) q)-th smallest score (inf past n / (n + 1))."""
    level = check_level(level)
    n, scores = int(calibration["n"]), calibration["scores"]
    k = math.ceil((n + 1) * level)
    if k > n:
        return math.inf
    if len(scores) == n:
        return float(scores[k - 1])
    pos = (k - 1) / max(n - 1, 1) * (len(scores) - 1)  # thinned: interpolate the order statistics
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(scores) - 1)
    return float(scores[lo] + (pos - lo) * (scores[hi] - scores[lo]))


def multiplier(level: float, calibration: dict | None = None) -> float:
    """The calibrated c_q when a calibration map is given, else the raw Cauchy tan(pi q / 2)."""
    return conformal_multiplier(calibration, level) if calibration else cauchy_multiplier(level)


def interval(loc: Tensor, scale: Tensor, level: float, calibration: dict | None = None,
             value_map: ValueMap | None = None) -> tuple[Tensor, Tensor]:
    """(lower, upper) of the central `level` interval: loc -+ c_q scale (shapes of loc / scale), on the scale of loc;
    with `value_map`, mapped to the value (`ValueMap.to_value`: exp of both bounds under log, which maps the
    quantiles exactly)."""
    c = multiplier(level, calibration)
    half = scale * c if math.isfinite(c) else torch.full_like(scale, math.inf)
    lo, hi = loc - half, loc + half
    if value_map is None:
        return lo, hi
    return value_map.to_value(lo), value_map.to_value(hi)


#: exponents tried on the per-row part of the width (scale = base * ratio^a: 0 = a constant width times the
#: out-of-depth factor, 1 = the fitted per-row width), `choose_scale_exponent`
SCALE_EXPONENTS = (0.0, 0.25, 0.5, 0.75, 1.0)
#: levels whose interval (Winkler) scores are summed by `choose_scale_exponent`
SCORE_LEVELS = (0.5, 0.8, 0.9)


def winkler(y: Tensor, lower: Tensor, upper: Tensor, level: float) -> Tensor:
    """Interval (Winkler) score of the central `level` interval per row: width + 2 / (1 - level) x miss."""
    a = 1.0 - check_level(level)
    return (upper - lower) + (2.0 / a) * ((lower - y).clamp_min(0) + (y - upper).clamp_min(0))


def crossfit_interval_score(y: Tensor, loc: Tensor, scale: Tensor, levels: Sequence[float] = SCORE_LEVELS) -> float:
    """Held-out interval score of conformal intervals loc -+ c_q scale: the rows split into two interleaved
    halves; the calibration map is fitted on one half and the mean Winkler score summed over `levels` taken
    on the other, both ways, averaged. A level with no finite conformal quantile on a half is skipped (the
    same levels for any `scale` of the same rows); nan when no level is left."""
    halves = (torch.arange(0, len(y), 2), torch.arange(1, len(y), 2))
    total, used = 0.0, 0
    for fit_rows, score_rows in (halves, halves[::-1]):
        cal = fit_calibration(y[fit_rows], loc[fit_rows], scale[fit_rows])
        if cal is None:
            continue
        for q in levels:
            c = conformal_multiplier(cal, q)
            if not math.isfinite(c):
                continue
            half = c * scale[score_rows]
            lo, hi = loc[score_rows] - half, loc[score_rows] + half
            total += float(winkler(y[score_rows], lo, hi, q).mean())
            used += 1
    return total / used if used else math.nan


def choose_scale_exponent(y: Sequence[float] | Tensor, loc: Sequence[float] | Tensor, base: Sequence[float] | Tensor,
                          ratio: Sequence[float] | Tensor, exponents: Sequence[float] = SCALE_EXPONENTS
                          ) -> tuple[float, dict]:
    """The exponent a of `exponents` whose widths base * ratio^a give the smallest held-out interval score
    (`crossfit_interval_score`) on validation rows (y, loc), with `base` [n] the width without the per-row
    part and `ratio` [n] > 0 the per-row part. Returns (a, {a: score}); a = 1 (the fitted width) with fewer
    than 8 rows or no finite score; the earlier of `exponents` on a tie."""
    y, loc, base, ratio = (torch.as_tensor(v, dtype=torch.float64).reshape(-1) for v in (y, loc, base, ratio))
    keep = torch.isfinite(y) & torch.isfinite(loc) & (base > 0) & (ratio > 0)
    y, loc, base, log_r = y[keep], loc[keep], base[keep], ratio[keep].log()
    if len(y) < 8:
        return 1.0, {}
    scores = {float(a): crossfit_interval_score(y, loc, base * (a * log_r).exp()) for a in exponents}
    finite = {a: s for a, s in scores.items() if math.isfinite(s)}
    if len(y) < 8 or not finite:
        return 1.0, scores
    return min(finite, key=finite.get), scores
