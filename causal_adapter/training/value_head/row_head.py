"""The value head in per-row units (`modeling.row_units`: each row's location and scale from its own numbers), on
the rows the warm start gathered: the linear head on the row's numbers in those units (`fit_row_head`) and its
width exponent (`choose_width_power`); the choice of per-row units over the adapter's (`choose_row_units`); the
log-width (`add_row_scale`), kept only when it wins on validation rows it was not fitted on; loading the result
into the head (`set_row_head`). The rows are put in row units by the head's own transform
(`modeling.row_transform.row_frame`, through `row_rows`). Its nonlinear correction is `correction`'s.
docs/values.md, "Values at every scale".
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from ...modeling.cauchy import cauchy_nll
from ...modeling.row_net import row_net
from ...modeling.row_transform import RowFrame, row_frame
from ...modeling.row_units import row_location_scale
from .choice import Scored, beats_by_one_se, choose_recent_count, score_diffs
from .linear import LinearFit, fit_linear_head, fit_log_scale, log_abs_residuals, penalty_score, recent_range

#: the correction and the log-width are tried with at least this many training and validation rows (fewer: an MLP
#: overfits them; half of the validation rows fit or stop, the other half judge)
MIN_ROWS, MIN_VALIDATION_ROWS = 200, 40

#: the largest |intercept| of a per-row log-width kept (exp of it is |b_noise_Y|): beyond, the fit extrapolated
MAX_LOG_NOISE = 50.0

#: the exponents a of the per-row width s (c / s)^a that `choose_width_power` tries (`row_units.row_width`)
WIDTH_POWERS = (0.0, 0.5, 1.0)


@dataclass
class RowScale:
    """The per-row log-width w . x (`add_row_scale`): w [2 K + 2] on the correction's inputs, clamped to range
    [2] (the least and largest w . x on the rows it was fitted on)."""
    w: Tensor
    range: Tensor


@dataclass
class RowHeadFit:
    """The value head in per-row units by `rule` (`fit_row_head`, then `correction.add_correction` and
    `add_row_scale`).

    linear: the linear head on r (w padded to K); recent_count: how many recent values it reads; r, present [n, K]: the
    training rows in row units and where a number is (their range is the head's clamp, `clamp`); errors [n_val]
    (or [n]): held-out absolute errors in value units; width_power: a of the width s (c / s)^a; noise: |b_noise_Y|
    (a Cauchy's scale in those widths); units_score / adapter_score: the scale-free held-out errors of these and
    of the adapter's units (`choose_row_units`); net: the correction's weights (`modeling.row_net.PARTS`), None
    when not kept; net_mae / linear_mae: its validation MAE against the linear head's (None when not tried);
    scale: the log-width, None when not kept; scale_tried: whether `add_row_scale` ran; w_loc [C]: the weights on
    the centred loc_U in row units when the head reads it (the words of the row reach the value), else None."""
    rule: str
    linear: LinearFit
    recent_count: int
    r: Tensor
    present: Tensor
    errors: Tensor
    width_power: float
    noise: float
    units_score: float | None = None
    adapter_score: float | None = None
    net: dict[str, Tensor] | None = None
    net_mae: float | None = None
    linear_mae: float | None = None
    scale: RowScale | None = None
    scale_tried: bool = False
    w_loc: Tensor | None = None

    def clamp(self) -> Tensor:
        """[2, K] the range the head clamps r to (`linear.recent_range` of the training rows)."""
        return recent_range(self.r, torch.where(self.present, self.r, math.nan))


@dataclass
class RowRows:
    """Rows as the per-row fit reads them: the head's transform (`frame`), the targets t = (y - m) / s [n], c / s
    [n] ("ratio": the width unit at a = 1 over s; 1 where a row has no curvature), r [n, K] (clamped when a clamp
    was given) and the correction's inputs x [n, 2 K + 2] (None without a clamp)."""
    frame: RowFrame
    t: Tensor
    ratio: Tensor
    r: Tensor
    x: Tensor | None


def row_rows(R: Tensor, y: Tensor, rule: str, act, clamp: Tensor | None = None, log: Tensor | None = None
             ) -> RowRows:
    """The rows R [n, K] (raw recent values, NaN = none), y [n] (on the head's scale: the value, or log y) in
    per-row units by `rule`, through the head's transform (`row_transform.row_frame`; the fallback units are `act`'s): r clamped to `clamp` [2, K] and the
    correction's inputs x when a clamp is given, as the head reads them (`ActionHead.units`; `log` [n]: a "series"
    head's rows on log y)."""
    frame = row_frame(R, rule, *act.fallback_units(log, R), act.log_space(log), keep=act.recent_values)
    ratio = frame.width(1.0) / frame.scale
    if clamp is None:
        return RowRows(frame, frame.standardize(y), ratio, frame.r, None)
    return RowRows(frame, frame.standardize(y), ratio, frame.clamped(clamp), frame.inputs(clamp))


def row_residuals(row: RowHeadFit, R: Tensor, y: Tensor, act, X: Tensor | None = None, log: Tensor | None = None
                  ) -> tuple[RowRows, Tensor]:
    """(`row_rows` of R [n, K], y [n] with r clamped as `row`'s head reads it; their residuals [n] in row units
    under `row`'s linear head (on loc_U too, X [n, C], when it reads it) plus its correction when it has one)."""
    rows = row_rows(R, y, row.rule, act, row.clamp(), log)
    u = rows.t - (rows.r @ row.linear.w + row.linear.b)
    if row.w_loc is not None:
        u = u - X @ row.w_loc
    if row.net is not None:
        u = u - row_net(rows.x, row.net)
    return rows, u


def fit_row_head(R: Tensor, y: Tensor, R_val: Tensor | None, y_val: Tensor | None, rule: str, act, *,
                 loss: str, losses: Sequence[str], max_shift: float, X: Tensor | None = None,
                 X_val: Tensor | None = None, log: Tensor | None = None, log_val: Tensor | None = None) -> RowHeadFit:
    """The value head in per-row units (`rule`): targets (y - m_row) / s_row on the row's own same-kind numbers in
    those units (how many: `choice.choose_recent_count`), and on the centred loc_U X [n, C] (X_val) when given and
    it wins (`choose_row_inputs`: what the row's words say reaches the value). R [n, K] raw recent values (NaN =
    none), y [n] targets (on the head's scale); validation rows R_val, y_val (None: leave-one-out); the fallback
    units are `act`'s; log, log_val [n]: a "series" head's rows on log y."""
    train = row_rows(R, y, rule, act, log=log)
    has_val = R_val is not None and y_val is not None and len(y_val) > 0
    val = row_rows(R_val, y_val, rule, act, log=log_val) if has_val else None
    k = act.recent_values  # R holds the head's whole window (`ActionHead.recent_window`); r its K own values

    def fit_count(count: int) -> Scored:
        fit = fit_linear_head(train.r[:, :count], train.t, val.r[:, :count] if has_val else None,
                              val.t if has_val else None, loss="squared", max_shift=max_shift, exact_columns=count)
        val_errors = fit.abs_errors if has_val else None
        score = penalty_score(float(fit.loo.abs().mean()), None if val_errors is None else float(val_errors.mean()))
        return Scored(score, fit.loo, val_errors, count)

    chosen = choose_recent_count(fit_count, k)
    count = chosen.what
    reads_u = X is not None and choose_row_inputs(chosen, train, val, X, X_val, count, max_shift)
    C = X.shape[1] if reads_u else 0
    F = torch.cat([X, train.r[:, :count]], 1) if reads_u else train.r[:, :count]
    F_val = None if not has_val else torch.cat([X_val, val.r[:, :count]], 1) if reads_u else val.r[:, :count]
    both = fit_linear_head(F, train.t, F_val, val.t if has_val else None, loss=loss, losses=losses,
                           max_shift=max_shift, exact_columns=count)
    w_loc = both.w[:C] if reads_u else None
    fit = dataclasses.replace(both, w=both.w[C:]).padded(torch.arange(k) < count)
    if has_val:
        errors = (val.t - (F_val @ both.w + fit.b)).abs() * val.frame.scale
        power = choose_width_power(errors / val.frame.scale, val.ratio)
    else:
        errors = fit.loo.abs() * train.frame.scale
        power = choose_width_power(errors / train.frame.scale, train.ratio)
    return RowHeadFit(rule=rule, linear=fit, recent_count=count, r=train.r, present=train.frame.present, errors=errors,
                      width_power=power, noise=max(float((fit.loo.abs() / train.ratio ** power).median()), 1e-3),
                      w_loc=w_loc)


def choose_row_inputs(reference: Scored, train: RowRows, val: RowRows | None, X: Tensor, X_val: Tensor | None,
                      count: int, max_shift: float) -> bool:
    """Whether the per-row head also reads the centred loc_U X [n, C] (what the row's words say), beside its
    `count` recent values in row units: a least-squares fit on both replaces `reference` (the recent values alone)
    only when it `beats_by_one_se` on `choice.score_diffs` (validation and leave-one-out errors in row units)."""
    has_val = val is not None and X_val is not None
    fit = fit_linear_head(torch.cat([X, train.r[:, :count]], 1), train.t,
                          torch.cat([X_val, val.r[:, :count]], 1) if has_val else None,
                          val.t if has_val else None, loss="squared", max_shift=max_shift, exact_columns=count)
    val_errors = fit.abs_errors if has_val else None
    both = Scored(penalty_score(float(fit.loo.abs().mean()), None if val_errors is None else float(val_errors.mean())),
                  fit.loo, val_errors)
    return beats_by_one_se(*score_diffs(reference, both))


def _cauchy_nll_at_median(u: Tensor, width: Tensor) -> Tensor:
    """[n] Cauchy NLL (less log pi) of residuals u under widths gamma * width, gamma = median(|u| / width) (a
    Cauchy's scale is its median absolute deviation)."""
    gamma = (u.abs() / width).median().clamp_min(torch.finfo(u.dtype).tiny)
    return torch.log(gamma * width) + torch.log1p((u / (gamma * width)).square())


def choose_width_power(u: Tensor, ratio: Tensor) -> float:
    """The exponent a of the width s (c / s)^a: u [n] held-out residuals in row units (error / s), ratio [n] c / s.
    Each a of WIDTH_POWERS gets the Cauchy NLL of u under widths ratio^a (their common scale at its median fit);
    an a > 0 replaces 0 (the width of s alone) only when its NLL `beats_by_one_se`, and the best such is kept.
    Scale-free: a row's NLL moves by log c when it is multiplied by c, the same for every a."""
    if len(u) < 3:
        return 0.0
    ref = _cauchy_nll_at_median(u, torch.ones_like(u))
    best, best_nll = 0.0, float(ref.mean())
    for a in WIDTH_POWERS[1:]:
        nll = _cauchy_nll_at_median(u, ratio ** a)
        if beats_by_one_se(ref - nll) and float(nll.mean()) < best_nll:
            best, best_nll = a, float(nll.mean())
    return best


def scale_free_errors(errors: Tensor, R: Tensor, act, log: Tensor | None = None) -> Tensor:
    """Absolute errors [n] (on the head's scale) divided by each row's own one-step naive error there (rule 'last';
    the head's value_scale for a row without): what the choice of units compares, so that a series of 0.07 counts as much as
    one of 9,000."""
    return errors / row_location_scale(R, "last", *act.fallback_units(log, R), act.log_space(log),
                                       act.recent_values)[2]


def choose_row_units(fit: LinearFit, F_val: Tensor | None, R: Tensor, y: Tensor, R_val: Tensor | None,
                     y_val: Tensor | None, act, rules: Sequence[str], force: bool, *, loss: str,
                     losses: Sequence[str], max_shift: float, X: Tensor | None = None,
                     X_val: Tensor | None = None, log: Tensor | None = None, log_val: Tensor | None = None
                     ) -> RowHeadFit | None:
    """The per-row units' fit (`fit_row_head`) against the adapter's units' `fit` (w [C + K], b on F = loc_U and
    the recent values, standardised), on scale-free held-out errors; None to keep the adapter's units. `force`: the
    best rule's fit, unconditionally (the first of one). The best rule is kept when it `beats_by_one_se` the adapter's units, on the
    value and on log y alike. (Keeping the per-row units on log y unless the adapter's beat them, for their
    scale-equivariance, was tried: on a table's rows, where no row has units of its own, the tie went to a per-row
    head that was the adapter's units without their loc_U-read width, and the salaries' 90% coverage fell from
    0.875 to 0.787, `benchmarks/tabular.py`.)"""
    if not rules:
        return None
    has_val = y_val is not None and F_val is not None and len(y_val) > 0
    R_ref, log_ref = (R_val, log_val) if has_val else (R, log)
    if has_val:
        adapter_errors = (y_val - act.from_standard(F_val @ fit.w + fit.b)).abs()
    else:
        adapter_errors = fit.loo.abs() * act.head_scale
    ref = scale_free_errors(adapter_errors, R_ref, act, log_ref)
    scored = []
    for rule in rules:
        row = fit_row_head(R, y, R_val if has_val else None, y_val if has_val else None, rule, act, loss=loss,
                           losses=losses, max_shift=max_shift, X=X, X_val=X_val if has_val else None, log=log,
                           log_val=log_val if has_val else None)
        errs = scale_free_errors(row.errors, R_ref, act, log_ref)
        row = dataclasses.replace(row, units_score=round(float(errs.mean()), 6),
                                  adapter_score=round(float(ref.mean()), 6))
        scored.append((row, errs))
    if force:
        return min(scored, key=lambda pair: float(pair[1].mean()))[0]
    winners = [(row, errs) for row, errs in scored if beats_by_one_se(ref - errs)]
    return min(winners, key=lambda pair: float(pair[1].mean()))[0] if winners else None


def add_row_scale(row: RowHeadFit, R_val: Tensor | None, y_val: Tensor | None, act, X_val: Tensor | None = None,
                  log_val: Tensor | None = None) -> RowHeadFit:
    """`row` (after `correction.add_correction`) with the per-row log-width: `linear.fit_log_scale` of the
    validation rows' residuals in row units over (c / s)^a on the correction's inputs x (the window in row units and
    its shape, `row_net.net_inputs`). Validation rows, not training ones: the correction's training residuals are
    smaller than its errors on new rows, and by how much depends on the row. Fitted on every other validation row
    and judged on the rest: kept when its Cauchy NLL there beats a constant width's (each at its own level from the
    fitting rows) by one standard error (a log-width judged on its own rows is trusted too far: the hold-out's rate
    series lost its 90% coverage), then fitted again on every validation row; "noise" becomes exp(its intercept).
    Not tried without the head's buffers or with fewer than MIN_VALIDATION_ROWS validation rows."""
    row = dataclasses.replace(row, scale=None, scale_tried=True)
    if not act.row_scale or R_val is None or y_val is None or len(y_val) < MIN_VALIDATION_ROWS:
        return row
    val, u = row_residuals(row, R_val, y_val, act, X_val, log_val)
    u = u / val.ratio ** row.width_power
    fitting = torch.arange(len(u)) % 2 == 0
    x, x_held, u_fit, u_held = val.x[fitting], val.x[~fitting], u[fitting], u[~fitting]
    fit = fit_log_scale(x, u_fit, max_shift=math.inf)
    if not bool(fit.w.abs().sum() > 0):  # a constant width did as well on the fitting rows
        return row
    seen = x @ fit.w
    lo, hi = float(seen.min()), float(seen.max())
    constant = math.exp(float(log_abs_residuals(u_fit).mean()))  # a Cauchy's scale
    fitted = ((x_held @ fit.w).clamp(lo, hi) + fit.b).exp()
    if not beats_by_one_se(cauchy_nll(u_held, 0.0, constant) - cauchy_nll(u_held, 0.0, fitted)):
        return row
    fit = fit_log_scale(val.x, u, max_shift=math.inf)  # kept: fitted again on every validation row
    if not bool(fit.w.abs().sum() > 0) or not abs(fit.b) < MAX_LOG_NOISE:
        return row
    seen = val.x @ fit.w
    return dataclasses.replace(row, scale=RowScale(fit.w, torch.stack([seen.min(), seen.max()])),
                               noise=math.exp(fit.b))


def set_row_head(act, row: RowHeadFit) -> None:
    """Load a per-row fit into the head: w_recent, b_reg, the range of r, |b_noise_Y| (the median |LOO residual| in
    row units over (c / s)^a, a Cauchy's scale), the correction and the log-width (or zeros), w_reg (its weights on
    loc_U in row units, or zero); w_scale_Y and the out-of-depth weights zero (the width reads no loc_U)."""
    with torch.no_grad():
        if row.w_loc is not None:
            act.w_reg.copy_(row.w_loc.to(act.w_reg.dtype))
        else:
            act.w_reg.zero_()
        act.b_reg.fill_(row.linear.b)
        act.w_recent.copy_(row.linear.w.to(act.w_recent.dtype))
        act.recent_range.copy_(row.clamp().to(act.recent_range))
        if act.w_scale_Y is not None:
            act.w_scale_Y.zero_()
            act.log_scale_range.zero_()
            act.depth_weight.zero_()
            act.depth_resid.zero_()
        act.b_noise_Y.fill_(row.noise)
        for name, buf in act.row_net_parts().items():  # the nonlinear correction, or 0 (adds 0)
            buf.copy_(row.net[name].to(buf.dtype) if row.net is not None else torch.zeros_like(buf))
        if act.row_scale:  # the log-width, or 0 (a factor of 1)
            scale = row.scale
            act.w_row_scale.copy_(scale.w.to(act.w_row_scale.dtype) if scale else torch.zeros_like(act.w_row_scale))
            act.row_log_scale_range.copy_(scale.range.to(act.row_log_scale_range.dtype) if scale
                                          else torch.zeros_like(act.row_log_scale_range))
