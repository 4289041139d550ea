"""The value head's fit in per-row units (`modeling.row_units`: each row's location and scale from its own
numbers), on the rows `value_fit.ridge_warm_start` gathered: the linear head on the row's numbers in those units
(`fit_row_head`) and its width exponent (`choose_width_power`); the choice of per-row units over the adapter's
(`choose_row_units`); the nonlinear correction (`add_row_net`, its MLPs fitted by `row_net_fit`) and the
log-width (`add_row_scale`), each kept only when it wins on validation rows it was not fitted on; and loading the
result into the head (`set_row_head`). docs/values.md, "Values at every scale".
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import Tensor

from ..modeling.cauchy import cauchy_nll
from ..modeling.row_net import net_inputs, row_net
from ..modeling.row_units import row_units, row_width
from .linear_fit import (choose_recent_width, fit_linear_head, fit_log_scale, log_abs_residuals, penalty_score,
                         recent_range)
from .row_net_fit import MIN_ROWS, MIN_VALIDATION_ROWS, fit_row_net


def fit_row_head(R: Tensor, y: Tensor, R_val: Tensor | None, y_val: Tensor | None, rule: str, act, *,
                 loss: str, losses: Sequence[str], max_shift: float) -> dict:
    """The value head in per-row units (`modeling.row_units`, `rule`): targets (y - m_row) / s_row on the row's
    own same-kind numbers in those units (how many: `choose_recent_width`), no loc_U. R [n, K] raw recent values
    (NaN = none), y [n] targets (value units); the fallback units are `act`'s. Returns `fit_linear_head`'s
    dict (w padded to K) with "r" [n, K], "present" [n, K] (a number there), "errors" [n_val] (or LOO [n]):
    held-out absolute errors in value units."""
    train = _row_inputs(R, y, rule, act)
    r, t, s, present, ratio = (train[k] for k in ("r", "t", "s", "present", "ratio"))
    has_val = R_val is not None and y_val is not None and len(y_val) > 0
    val = _row_inputs(R_val, y_val, rule, act) if has_val else {}
    r_val, t_val, s_val, ratio_val = (val.get(k) for k in ("r", "t", "s", "ratio"))
    k = R.shape[1]

    def fit_width(width: int) -> dict:
        fit = fit_linear_head(r[:, :width], t, r_val[:, :width] if has_val else None, t_val, loss="squared",
                              max_shift=max_shift, exact_columns=width)
        val_errors = fit["abs_errors"] if has_val else None
        score = penalty_score(float(fit["loo"].abs().mean()), None if val_errors is None else float(val_errors.mean()))
        return {"width": width, "score": score, "loo": fit["loo"], "val_errors": val_errors}

    width = choose_recent_width(fit_width, k)["width"]
    fit = fit_linear_head(r[:, :width], t, r_val[:, :width] if has_val else None, t_val, loss=loss, losses=losses,
                          max_shift=max_shift, exact_columns=width)
    w = torch.zeros(k, dtype=fit["w"].dtype)
    w[:width] = fit["w"]
    errors = (t_val - (r_val @ w + fit["b"])).abs() * s_val if has_val else fit["loo"].abs() * s
    power = choose_width_power(errors / (s_val if has_val else s), ratio_val if has_val else ratio)
    return {**fit, "w": w, "width": width, "r": r, "present": present, "errors": errors, "width_power": power,
            "noise": max(float((fit["loo"].abs() / ratio ** power).median()), 1e-3)}


#: the exponents a of the per-row width s (c / s)^a that `choose_width_power` tries (`row_units.row_width`)
WIDTH_POWERS = (0.0, 0.5, 1.0)


def _cauchy_nll_at_median(u: Tensor, width: Tensor) -> Tensor:
    """[n] Cauchy NLL (less log pi) of residuals u under widths gamma * width, gamma = median(|u| / width) (a
    Cauchy's scale is its median absolute deviation)."""
    gamma = (u.abs() / width).median().clamp_min(torch.finfo(u.dtype).tiny)
    return torch.log(gamma * width) + torch.log1p((u / (gamma * width)).square())


def choose_width_power(u: Tensor, ratio: Tensor) -> float:
    """The exponent a of the width s (c / s)^a: u [n] held-out residuals in row units (error / s), ratio [n] c / s.
    Each a of WIDTH_POWERS gets the Cauchy NLL of u under widths ratio^a (their common scale at its median fit);
    an a > 0 replaces 0 (the width of s alone) only when its NLL is smaller by more than one standard error of
    the paired difference, and the best such is kept. Scale-free: a row's NLL moves by log c when it is
    multiplied by c, the same for every a."""
    if len(u) < 3:
        return 0.0
    ref = _cauchy_nll_at_median(u, torch.ones_like(u))
    best, best_nll = 0.0, float(ref.mean())
    for a in WIDTH_POWERS[1:]:
        nll = _cauchy_nll_at_median(u, ratio ** a)
        diff = ref - nll
        if float(diff.mean()) > float(diff.std() / math.sqrt(len(diff))) and float(nll.mean()) < best_nll:
            best, best_nll = a, float(nll.mean())
    return best


def scale_free_errors(errors: Tensor, R: Tensor, act) -> Tensor:
    """Absolute errors [n] (value units) divided by each row's own one-step naive error (`row_units` 'last';
    the adapter's value_scale for a row without): what the choice of units compares, so that a series of 0.07
    counts as much as one of 9,000."""
    return errors / row_units(R, "last", act.value_loc, act.value_scale)[2]


def choose_row_units(fit: dict, F_val: Tensor | None, X_val: Tensor | None, R: Tensor, y: Tensor,
                     R_val: Tensor | None, y_val: Tensor | None, act, rules: Sequence[str], force: bool, *,
                     loss: str, losses: Sequence[str], max_shift: float) -> dict | None:
    """The per-row units' fit (`fit_row_head`) that beats the adapter's units' `fit` (w [C + K], b; in
    standardised units) on scale-free held-out errors by more than one standard error, the best such; None
    to keep the adapter's units. `force`: the first rule's fit, unconditionally."""
    if not rules:
        return None
    has_val = y_val is not None and F_val is not None and len(y_val) > 0
    R_ref = R_val if has_val else R
    if has_val:
        adapter_errors = (y_val - act.to_value(F_val @ fit["w"] + fit["b"])).abs()
    else:
        adapter_errors = fit["loo"].abs() * act.value_scale
    ref = scale_free_errors(adapter_errors, R_ref, act)
    best = None
    for rule in rules:
        row = fit_row_head(R, y, R_val if has_val else None, y_val if has_val else None, rule, act, loss=loss,
                           losses=losses, max_shift=max_shift)
        errs = scale_free_errors(row["errors"], R_ref, act)
        diff = ref - errs
        se = float(diff.std() / math.sqrt(len(diff))) if len(diff) > 1 else math.inf
        row.update(rule=rule, units_score=round(float(errs.mean()), 6),
                   adapter_score=round(float(ref.mean()), 6))
        if force:
            return row
        if float(diff.mean()) > se and (best is None or row["units_score"] < best["units_score"]):
            best = row
    return best


def _row_inputs(R: Tensor, y: Tensor, rule: str, act, clamp: Tensor | None = None) -> dict[str, Tensor]:
    """The rows R [n, K], y [n] in per-row units by `rule` (the fallback units are `act`'s): r (0 where no number;
    clamped to `clamp` [2, K] as the head reads them, when given), "present" [n, K] (a number there), the
    target t, s, c / s ("ratio"; 1 where a row has no curvature) and, with `clamp`, the correction's inputs x
    (`row_net.net_inputs`)."""
    values, m, s, own = row_units(R, rule, act.value_loc, act.value_scale)
    r = torch.nan_to_num((values - m[:, None]) / s[:, None], nan=0.0)
    out = {"t": (y - m) / s, "s": s, "present": ~torch.isnan(values), "ratio": row_width(values, s, own, 1.0) / s}
    if clamp is None:
        return {**out, "r": r}
    r = torch.minimum(torch.maximum(r, clamp[0]), clamp[1])
    return {**out, "r": r, "x": net_inputs(values, s, r)}


def _head_residuals(row: dict, R: Tensor, y: Tensor, act) -> tuple[dict[str, Tensor], Tensor]:
    """(`_row_inputs` of the rows R [n, K], y [n], r clamped as the head of `row` reads it; their residuals [n] in
    row units under `row`'s linear head plus its correction when it has one)."""
    clamp = recent_range(row["r"], torch.where(row["present"], row["r"], math.nan))
    inputs = _row_inputs(R, y, row["rule"], act, clamp)
    u = inputs["t"] - (inputs["r"] @ row["w"] + row["b"])
    if row.get("net") is not None:
        u = u - row_net(inputs["x"], row["net"])
    return inputs, u


def add_row_net(row: dict, R: Tensor, y: Tensor, R_val: Tensor | None, y_val: Tensor | None, act, seed: int
                ) -> dict:
    """`row` (a `fit_row_head` fit, its rule in row["rule"]) with the head's nonlinear correction fitted to its
    residuals (`row_net_fit.fit_row_net`; the head's `row_net_members` MLPs, from `seed`, stopped on the even
    validation rows): "net" is their weights when their mean beats the linear head on the odd validation rows
    (errors in row units: "net_mae", "linear_mae") by more than one standard error of the paired difference,
    and then "errors", "width_power" and "noise" are its own (all validation rows); else None. Not tried
    without the correction's buffers or with fewer than MIN_ROWS / MIN_VALIDATION_ROWS rows."""
    members = act.row_net_members
    if not members or R_val is None or y_val is None or len(y) < MIN_ROWS or len(y_val) < MIN_VALIDATION_ROWS:
        return {**row, "net": None}
    (train, u_train), (val, u_linear) = _head_residuals(row, R, y, act), _head_residuals(row, R_val, y_val, act)
    # the members stop on every other validation row and are judged on the rest: rows that chose the epoch
    # would favour the correction (kept on random walks, where nothing in the window predicts the step)
    stop = torch.arange(len(u_linear)) % 2 == 0
    net = fit_row_net(train["x"], u_train, val["x"][stop], u_linear[stop], members, act.row_net_W1.shape[1], seed)
    u_net = u_linear - row_net(val["x"], net)
    diff = (u_linear.abs() - u_net.abs())[~stop]
    out = {**row, "net": None, "net_mae": round(float(u_net[~stop].abs().mean()), 6),
           "linear_mae": round(float(u_linear[~stop].abs().mean()), 6)}
    if not float(diff.mean()) > float(diff.std() / math.sqrt(len(diff))):
        return out
    power = choose_width_power(u_net, val["ratio"])
    return {**out, "net": net, "errors": u_net.abs() * val["s"], "width_power": power,
            "noise": max(float((u_net.abs() / val["ratio"] ** power).median()), 1e-3)}


def add_row_scale(row: dict, R_val: Tensor | None, y_val: Tensor | None, act) -> dict:
    """`row` (after `add_row_net`) with the per-row log-width: `fit_log_scale` of the validation rows' residuals in
    row units over (c / s)^a on the correction's inputs x (the window in row units and its shape,
    `row_net.net_inputs`). Validation rows, not training ones: the correction's training residuals are smaller
    than its errors on new rows, and by how much depends on the row. Fitted on every other validation row and
    judged on the rest: kept when its Cauchy NLL there beats a constant width's (each at its own level from the
    fitting rows) by more than one standard error of the paired difference (a log-width judged on its own rows
    is trusted too far: the hold-out's rate series lost its 90% coverage), then fitted again on every validation
    row. "scale" = {"w": [2 K + 2], "range": [2] the least and largest w . x on those rows} and "noise" = exp(its
    intercept); else None. Not tried without the head's buffers or with fewer than MIN_VALIDATION_ROWS validation
    rows."""
    if not act.row_scale or R_val is None or y_val is None or len(y_val) < MIN_VALIDATION_ROWS:
        return {**row, "scale": None}
    val, u = _head_residuals(row, R_val, y_val, act)
    u = u / val["ratio"] ** row["width_power"]
    fitting = torch.arange(len(u)) % 2 == 0
    x, x_held, u_fit, u_held = val["x"][fitting], val["x"][~fitting], u[fitting], u[~fitting]
    fit = fit_log_scale(x, u_fit, max_shift=math.inf)
    if not bool(fit["w"].abs().sum() > 0):  # a constant width did as well on the fitting rows
        return {**row, "scale": None}
    seen = x @ fit["w"]
    lo, hi = float(seen.min()), float(seen.max())
    constant = math.exp(float(log_abs_residuals(u_fit).mean()))  # a Cauchy's scale
    fitted = ((x_held @ fit["w"]).clamp(lo, hi) + fit["b"]).exp()
    diff = cauchy_nll(u_held, 0.0, constant) - cauchy_nll(u_held, 0.0, fitted)
    if not float(diff.mean()) > float(diff.std() / math.sqrt(len(diff))):
        return {**row, "scale": None}
    fit = fit_log_scale(val["x"], u, max_shift=math.inf)  # kept: fitted again on every validation row
    if not bool(fit["w"].abs().sum() > 0):
        return {**row, "scale": None}
    seen = val["x"] @ fit["w"]
    return {**row, "scale": {"w": fit["w"], "range": torch.stack([seen.min(), seen.max()])},
            "noise": math.exp(fit["b"])}


def set_row_head(act, row: dict, C: int) -> None:
    """Load a `fit_row_head` fit into the head: w_recent, b_reg, the range of r, |b_noise_Y| (the median |LOO
    residual| in row units over (c / s)^a, a Cauchy's scale); w_reg, w_scale_Y and the out-of-depth weights zero (the head
    reads no loc_U in row units)."""
    with torch.no_grad():
        act.w_reg.zero_()
        act.b_reg.fill_(row["b"])
        act.w_recent.copy_(row["w"].to(act.w_recent.dtype))
        act.recent_range.copy_(recent_range(row["r"], torch.where(row["present"], row["r"], math.nan))
                               .to(act.recent_range))
        if act.w_scale_Y is not None:
            act.w_scale_Y.zero_()
            act.log_scale_range.zero_()
            act.depth_weight.zero_()
            act.depth_resid.zero_()
        act.b_noise_Y.fill_(row["noise"])  # the median |LOO residual| / (c / s)^a, a Cauchy's scale
        for name, buf in act.row_net_parts().items():  # the nonlinear correction, or 0 (adds 0)
            net = row.get("net")
            buf.copy_(net[name].to(buf.dtype) if net is not None else torch.zeros_like(buf))
        if act.row_scale:  # the log-width, or 0 (a factor of 1)
            scale = row.get("scale")
            act.w_row_scale.copy_(scale["w"].to(act.w_row_scale.dtype) if scale else torch.zeros_like(act.w_row_scale))
            act.row_log_scale_range.copy_(scale["range"].to(act.row_log_scale_range.dtype) if scale
                                          else torch.zeros_like(act.row_log_scale_range))
