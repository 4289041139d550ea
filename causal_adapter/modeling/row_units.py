"""Per-row value units: a location and a scale taken from the row's own numbers, so that one value head
serves a series of 0.07 and one of 9,000 (instance normalisation, as RevIN, Chronos or Lag-Llama do).

The head reads the K most recent numbers of the text at each position (`recent_numbers.recent_values`, most recent
first). Not all of them are the quantity the next number is: ``1999: 3.12; 2000: 3.05; 2001:`` holds years
between the values. A row's numbers come in records of p numbers (a year and a value: p = 2; a year, a
month and a value: p = 3), and the next number's own kind sits at lags p, 2p, ... (`same_role`). The
period p is found per row from the values alone: the right period splits the numbers into classes (the
years, the values) whose steps are far smaller than the steps between neighbouring numbers (`row_period`). No token ids are needed, so the rule
runs wherever the value head runs (training, prediction, the step loop, the server) from the numbers it
already reads.

From those same-kind numbers S (newest first), a rule gives the location m and scale s:

* ``"last"``: m = S[0], s = mean |S[i] - S[i+1]| (the window's own one-step naive error, as MASE scales);
* ``"median"``: m = median(S), s = mean |S - m|;
* ``"season"``: as "last", but a row whose window shows a season is located at its seasonal anchor: the value one
  cycle before, moved by the window's mean change over a cycle (on log y when the window is positive, where a
  season multiplies with the level). The cycle P is read from the records' labels (a year over its quarters:
  `row_season`), the season from the window's own numbers (`seasonal_anchor`); a row whose window shows no season,
  or fewer than two cycles' changes, keeps "last"'s m.

s is floored at `RELATIVE_FLOOR` x mean |S| (a flat window). The value's width is s |b_noise_Y| (c / s)^a
(`row_width`; times the head's fitted log-width, `heads.ActionHead.row_log_scale`): c = the window's mean
|second difference| (`curvature`), a in [0, 1] chosen on validation. s
says how far the series moves in a step; c how far it moves from the straight line through its last two
values, which is nearer the error of a head that reads the trend: a smooth series (a trend, a season) gets a
narrower interval and a noisy one a wider, where s alone gave both the same. A row with fewer than `MIN_CONTEXT` such
numbers, or s = 0, keeps the adapter's units (value_loc, value_scale). Every step is scale-free: numbers
multiplied by c give the same period and c m, c s.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

#: the longest record (numbers per record: a date's parts and the value) the period search tries
MAX_PERIOD = 4
#: same-kind numbers a row needs before its own units replace the adapter's
MIN_CONTEXT = 3
#: a period separates kinds when the mean step within its classes is below this fraction of the mean step between
#: neighbours: a row of one kind gives ~1 (iid) to ~1.4 (a random walk), years beside values 0.3 (values 50 times
#: the years, moving by half their size a step) down to 1e-4
SEPARATED = 0.5
#: among the periods that separate, the shortest whose ratio is within this factor of the least (2 against 4)
PERIOD_TOLERANCE = 1.5
#: a row's window shows its season when the seasonal anchor's errors within it are below this fraction of its
#: one-step changes (`seasonal_anchor`: a random walk's cycle changes spread twice its steps, a season's far less)
SEASON_GAIN = 0.75
#: s is at least this fraction of the window's mean |value| (a window of equal values)
RELATIVE_FLOOR = 1e-4


def _at_lags(recent: Tensor, idx: Tensor) -> Tensor:
    """recent [..., K] at lags idx [..., n] (NaN past the window)."""
    K = recent.shape[-1]
    picked = recent.gather(-1, idx.clamp(0, K - 1))
    return torch.where(idx < K, picked, torch.full_like(picked, math.nan))


def same_role(recent: Tensor, period: Tensor) -> Tensor:
    """recent [..., K] (most recent first, NaN = none), period [...] (long) -> [..., K]: the numbers at lags
    period - 1, 2 period - 1, ... (slot j holds lag (j + 1) period - 1: the kind of the number to come), NaN
    past the window and from the first slot whose record is not whole on (`whole_records`)."""
    K = recent.shape[-1]
    slots = torch.arange(K, device=recent.device)
    values = _at_lags(recent, (slots + 1) * period.unsqueeze(-1) - 1)
    return torch.where(whole_records(recent, period), values, torch.full_like(values, math.nan))


def whole_records(recent: Tensor, period: Tensor) -> Tensor:
    """[..., K] bool: slot j's record is whole and continues the records after it. A record is the number of
    slot j and the period - 1 numbers before it in the text (lags (j + 1) period .. (j + 1) period + period - 2:
    its year, its month); those companions must be there and each continue its own sequence (no step larger
    than both half its median size and 20 times its median step: 1871 after 10 is a jump, December to January
    is not). A number in a title (``Series 7.``, ``(10^8 m^3)``) before the first record so has no slot."""
    K = recent.shape[-1]
    slots = torch.arange(K, device=recent.device)
    ok = torch.ones(*recent.shape[:-1], K, dtype=torch.bool, device=recent.device)
    for offset in range(MAX_PERIOD - 1):
        used = offset < period - 1  # [...]: this companion exists for the row's period
        # the companion of the record to come (slot -1) first, then those of slots 0, 1, ...
        comp = _at_lags(recent, torch.cat([slots[:1] * 0, (slots + 1)]) * period.unsqueeze(-1) + offset)
        present = ~torch.isnan(comp)
        step = (comp[..., 1:] - comp[..., :-1]).abs()
        size = comp.abs().nanmedian(-1, keepdim=True).values
        usual = step.nanmedian(-1, keepdim=True).values
        jump = step > torch.maximum(0.5 * size, 20 * usual)
        whole = present[..., 1:] & ~jump
        ok &= ~used.unsqueeze(-1) | whole
    return ok.long().cumprod(-1).bool()  # from the first broken record on, nothing


def _count(values: Tensor) -> Tensor:
    return (~torch.isnan(values)).sum(-1)


def mean_abs(values: Tensor) -> Tensor:
    """[..., n] -> [...] mean |values| over the entries present (0 without one)."""
    present = ~torch.isnan(values)
    return torch.where(present, values.abs(), 0.0).sum(-1) / present.sum(-1).clamp_min(1)


def _mean_step(values: Tensor) -> Tensor:
    """[..., K] -> [...] mean |values[i] - values[i + 1]| over the pairs both present (0 without a pair)."""
    return mean_abs(values[..., :-1] - values[..., 1:])


def _step_sums(values: Tensor) -> tuple[Tensor, Tensor]:
    """[..., n] -> ([...] sum of |values[i] - values[i + 1]| over the pairs present, [...] their count)."""
    steps = (values[..., :-1] - values[..., 1:]).abs()
    present = ~torch.isnan(steps)
    return torch.where(present, steps, 0.0).sum(-1), present.sum(-1)


def step_ratio(recent: Tensor, period: int) -> Tensor:
    """[..., K] -> [...] the mean step within the classes of lags modulo `period` (years to years, values to
    values) over the mean step between neighbouring numbers: near 0 when `period` separates kinds, whatever
    their sizes (years beside values of 0.01 or of 10^5), ~1 or more when the row is one kind (a random walk's
    steps grow with the lag). 1 for a row with no step."""
    within = [_step_sums(recent[..., offset::period]) for offset in range(period)]
    mean_within = sum(total for total, _ in within) / sum(count for _, count in within).clamp_min(1)
    total, count = _step_sums(recent)
    mean_all = total / count.clamp_min(1)
    return torch.where(mean_all > 0, mean_within / mean_all.clamp_min(torch.finfo(total.dtype).tiny), 1.0)


def row_period(recent: Tensor) -> Tensor:
    """recent [..., K] -> [...] long: the record length p of each row, 1..MAX_PERIOD. A p > 1 is taken when it
    separates the numbers into classes (`step_ratio` below SEPARATED) and the next number's class holds
    MIN_CONTEXT numbers of whole records (`same_role`); among those the shortest within PERIOD_TOLERANCE of the best (a period of 2 also
    separates at 4). Else 1: the row's numbers are one kind."""
    ratios, eligible = [], []
    for p in range(2, min(MAX_PERIOD, recent.shape[-1]) + 1):
        ratio = step_ratio(recent, p)
        ratios.append(ratio)
        whole = same_role(recent, torch.full(recent.shape[:-1], p, dtype=torch.long, device=recent.device))
        eligible.append((ratio < SEPARATED) & (_count(whole) >= MIN_CONTEXT))
    best = torch.ones(recent.shape[:-1], dtype=torch.long, device=recent.device)
    if not ratios:
        return best
    ratio = torch.stack(ratios, -1)
    ok = torch.stack(eligible, -1)
    least = torch.where(ok, ratio, math.inf).amin(-1, keepdim=True)
    near = ok & (ratio <= least * PERIOD_TOLERANCE)
    first = near.long().argmax(-1) + 2  # the shortest such period
    return torch.where(near.any(-1), first, best)


def row_location_scale(recent: Tensor, rule: str, fallback_loc: float, fallback_scale: float,
                       log_space: bool | Tensor = False, keep: int | None = None
                       ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """recent [..., W] raw (NaN = none) -> (same-kind numbers [..., K], m [...], s [...], own [...] bool), in
    float64, K = `keep` (default W): the row's K most recent numbers of its own kind, found on all W (a window
    of W numbers in records of p holds W / p of them), or, for a row that keeps the fallback, its K most recent
    numbers. By `rule` (`config.ROW_HEAD_RULES`; "fixed": every row keeps the fallback). `own` marks the rows that got their own units; the others keep
    (fallback_loc, fallback_scale) and their numbers as they come (p = 1). `log_space`: the kinds are found on the
    raw numbers, then the numbers are their logs (a number <= 0 has none: NaN), so m is a log level and s the mean
    |step of log y|: a row multiplied by c moves m by log c and keeps s. A tensor [...] of bools: per row (a
    "series" head, `value_transform`)."""
    recent = recent.double()
    log_space = log_rows(log_space, recent)
    if rule == "fixed":  # the adapter's units for every row, its K most recent numbers of any kind
        values = _logs_where(log_space, recent[..., :keep])
        own = torch.zeros(values.shape[:-1], dtype=torch.bool, device=values.device)
        zero = torch.zeros_like(values[..., 0])  # the fallback: floats, or [...] per row
        return values, zero + fallback_loc, zero + fallback_scale, own
    period = row_period(recent)
    values = same_role(recent, period)[..., :keep]
    recent_raw, recent = recent, recent[..., :keep]
    values, recent = _logs_where(log_space, values), _logs_where(log_space, recent)
    if rule == "last":
        loc, scale = values[..., 0], _mean_step(values)
    elif rule == "season":  # "last", but a row whose window shows a season is located at its seasonal anchor
        anchor, usable = seasonal_anchor(values, row_season(recent_raw, period), log_space)
        loc, scale = torch.where(usable, anchor, values[..., 0]), _mean_step(values)
    elif rule == "median":
        loc = values.nanmedian(-1).values
        scale = mean_abs(values - loc.unsqueeze(-1))
    else:  # checked where a rule is set (`config.check_row_rule`)
        raise ValueError(f"unknown per-row units rule {rule!r}")
    scale = torch.maximum(scale, RELATIVE_FLOOR * level(values, log_space))
    own = (_count(values) >= MIN_CONTEXT) & (scale > 0) & torch.isfinite(scale) & torch.isfinite(loc)
    loc = torch.where(own, loc, fallback_loc)
    scale = torch.where(own, scale, fallback_scale)
    values = torch.where(own.unsqueeze(-1), values, recent)
    return values, loc, scale, own


def row_season(recent: Tensor, period: Tensor) -> Tensor:
    """recent [..., W] raw (most recent first, NaN = none), period [...] (`row_period`) -> [...] long: P, the records
    of one cycle of the row's labels: how many records lie between two changes of the label furthest from the
    value (a year over its quarters: ``1990 Q4: 5; 1991 Q1: 6`` -> 4; over its months: 12). The labels read are the
    record to come's and those of the records before it. 0 where the records carry no label (p = 1), the labels
    change fewer than twice in the window, their changes are not evenly spaced, or P < 2 (a yearly series)."""
    W = recent.shape[-1]
    slots = torch.arange(W // 2 + 1, device=recent.device)
    p = period.unsqueeze(-1)
    labels = _at_lags(recent, slots * p + (p - 2).clamp_min(0))  # the record to come's label, then each record's
    labels = torch.where(p >= 2, labels, torch.full_like(labels, math.nan))
    change = (labels[..., :-1] != labels[..., 1:]) & ~torch.isnan(labels[..., :-1]) & ~torch.isnan(labels[..., 1:])
    count = change.long().cumsum(-1)
    at = torch.arange(change.shape[-1], device=recent.device).expand_as(change)

    def nth(k: int) -> Tensor:  # the position of the k-th change (0 without one)
        return torch.where(change & (count == k), at, 0).amax(-1)

    first, second, third = nth(1), nth(2), nth(3)
    P = second - first
    n = count[..., -1] if change.shape[-1] else torch.zeros_like(period)
    even = (n < 3) | (third - second == P)
    return torch.where((n >= 2) & even & (P >= 2), P, torch.zeros_like(P))


def seasonal_anchor(values: Tensor, season: Tensor, log_space: bool | Tensor = False) -> tuple[Tensor, Tensor]:
    """values [..., K] same-kind numbers (newest first, NaN = none), season [...] (`row_season`) -> (anchor [...],
    usable [...] bool). The anchor is the value one cycle before the one to come moved by the window's mean change
    over a cycle, S[P - 1] + mean_i (S[i] - S[i + P]); on log y (`log_space`, or a window of positive numbers, whose
    season multiplies with the level) S[P - 1] times the geometric mean ratio S[i] / S[i + P]. Usable where the
    window holds two cycles' changes and its own numbers say the season is there: the anchor's errors within the
    window, |S[i] - S[i + P] - the mean change|, below `SEASON_GAIN` times its one-step changes."""
    K = values.shape[-1]
    P = season.clamp(1, max(K - 1, 1))
    present = ~torch.isnan(values)
    positive = (torch.where(present, values, 1.0) > 0).all(-1) & ~log_rows(log_space, values)
    work = torch.where(positive.unsqueeze(-1), _log(values), values)
    i = torch.arange(K, device=values.device)
    change = work - _at_lags(work, i + P.unsqueeze(-1))  # S[i] - S[i + P], NaN past the window
    mean_change = change.nansum(-1) / _count(change).clamp_min(1)
    base = work.gather(-1, (P - 1).clamp_min(0).unsqueeze(-1)).squeeze(-1)
    anchor = base + mean_change
    anchor = torch.where(positive, anchor.clamp(max=709.0).exp(), anchor)
    seasonal_error = mean_abs(change - mean_change.unsqueeze(-1))
    step_error = _mean_step(work)
    usable = (season >= 2) & (_count(change) >= 2) & torch.isfinite(anchor) & (seasonal_error < SEASON_GAIN * step_error)
    return anchor, usable


def _log(values: Tensor) -> Tensor:
    return torch.where(values > 0, values.clamp_min(torch.finfo(values.dtype).tiny).log(),
                       torch.full_like(values, math.nan))


def log_rows(log_space: bool | Tensor, values: Tensor) -> Tensor:
    """[...] bool: the rows of values [..., K] whose numbers are logs (`log_space`: one bool for all, or per row)."""
    if isinstance(log_space, Tensor):
        return log_space.to(values.device).bool().expand(values.shape[:-1])
    return torch.full(values.shape[:-1], bool(log_space), dtype=torch.bool, device=values.device)


def _logs_where(log_space: Tensor, values: Tensor) -> Tensor:
    """values [..., K] with the rows of `log_space` [...] as their logs."""
    if not bool(log_space.any()):
        return values
    return torch.where(log_space.unsqueeze(-1), _log(values), values)


def level(values: Tensor, log_space: bool | Tensor = False) -> Tensor:
    """[..., K] -> [...] the unit the floors are relative to: mean |S| (1 in log space, where steps are relative
    already)."""
    return torch.where(log_rows(log_space, values), torch.ones_like(values[..., 0]), mean_abs(values))


def curvature(values: Tensor) -> Tensor:
    """[..., K] same-kind numbers (newest first, NaN = none) -> [...] mean |values[i] - 2 values[i + 1] +
    values[i + 2]| over the triples present (0 without one)."""
    return mean_abs(values[..., :-2] - 2 * values[..., 1:-1] + values[..., 2:])


def floored_curvature(values: Tensor, log_space: bool | Tensor = False) -> Tensor:
    """[..., K] -> [...] c: `curvature` floored at RELATIVE_FLOOR x `level` (a straight line)."""
    return torch.maximum(curvature(values), RELATIVE_FLOOR * level(values, log_space))


def row_width(values: Tensor, scale: Tensor, own: Tensor, power: float, log_space: bool | Tensor = False) -> Tensor:
    """The width unit of each row [...]: s (c / s)^power for the rows with their own units (`row_location_scale`'s values,
    s, own), c = `floored_curvature`; s where a row has no
    second difference or keeps the adapter's units, and for power 0."""
    if power == 0:
        return scale
    c = floored_curvature(values, log_space)
    usable = own & (_count(values) >= 3) & (c > 0) & torch.isfinite(c)
    return torch.where(usable, scale * (c / scale).clamp_min(torch.finfo(scale.dtype).tiny) ** power, scale)
