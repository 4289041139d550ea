"""The per-row value head's nonlinear correction (`modeling.row_net`), fitted after its linear head.

Each of the head's `row_net_members` MLPs is fitted by AdamW to the linear head's residuals in row units (an L1
loss: the figures are MAEs), from its own seed, and stopped at its best epoch on every other validation row
(`fit_row_net`). `add_correction` keeps their mean only when it beats the linear head on the other validation rows
by one standard error. Measured (docs/numeric_quality.md): the linear head is one autoregression for every series
and loses to each series' own AR / ETS; the correction closes most of it.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from ...modeling.row_net import PARTS, mlp_members, part_shapes, row_net
from .choice import beats_by_one_se
from .linear import LinearFit
from .row_head import MIN_ROWS, MIN_VALIDATION_ROWS, RowHeadFit, choose_width_power, fit_row_head, row_residuals

EPOCHS, PATIENCE, BATCH = 100, 20, 256
#: the least relative MAE gain for which the head's form in the adapter's units replaces their linear head: it gives
#: up the width read from loc_U (w_scale_Y); one standard error alone keeps an MLP 0.5% better than a plane that is
#: the truth (two near-equal residual vectors have a tiny paired spread)
FIXED_MIN_GAIN = 0.05
LEARNING_RATE, WEIGHT_DECAY = 3e-3, 1e-4


def _init_member(width: int, inputs: int, generator: torch.Generator) -> dict[str, Tensor]:
    """One member's weights [1, ...] in float32: nn.Linear's uniform init for the hidden layers, a zero output
    layer (the member starts as the linear head)."""
    shapes = part_shapes(1, width, inputs)
    bound = {"W1": inputs ** -0.5, "b1": inputs ** -0.5, "W2": width ** -0.5, "b2": width ** -0.5}
    return {k: ((torch.rand(shapes[k], generator=generator) * 2 - 1) * bound[k] if k in bound
                else torch.zeros(shapes[k])).requires_grad_() for k in PARTS}


def fit_member(x: Tensor, resid: Tensor, x_val: Tensor, resid_val: Tensor, width: int, seed: int
               ) -> dict[str, Tensor]:
    """One MLP x [n, D] -> resid [n] (L1, AdamW, minibatches of BATCH), its weights at the epoch of least
    validation MAE (at most EPOCHS, stopped PATIENCE epochs after the best). Returns PARTS [1, ...] float32."""
    g = torch.Generator().manual_seed(seed)
    parts = _init_member(width, x.shape[1], g)
    opt = torch.optim.AdamW(parts.values(), lr=LEARNING_RATE, weight_decay=WEIGHT_DECAY)
    x, resid, x_val, resid_val = x.float(), resid.float(), x_val.float(), resid_val.float()

    def out(z):
        return mlp_members(z, *(parts[k] for k in PARTS))[..., 0]

    best, best_epoch = float(resid_val.abs().mean()), -1
    kept = {k: v.detach().clone() for k, v in parts.items()}
    for epoch in range(EPOCHS):
        order = torch.randperm(len(resid), generator=g)
        for i in range(0, len(order), BATCH):
            batch = order[i:i + BATCH]
            loss = (out(x[batch]) - resid[batch]).abs().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        with torch.no_grad():
            val = float((out(x_val) - resid_val).abs().mean())
        if val < best:
            best, best_epoch = val, epoch
            kept = {k: v.detach().clone() for k, v in parts.items()}
        elif epoch - best_epoch > PATIENCE:
            break
    return kept


def fit_row_net(x: Tensor, resid: Tensor, x_val: Tensor, resid_val: Tensor, members: int, width: int, seed: int,
                standardize: bool = False) -> dict[str, Tensor]:
    """`members` MLPs (`fit_member`, seeds seed, seed + 1, ...) stacked: PARTS [members, ...] float64. With
    `standardize` each is fitted on x standardised per column on the training rows (a table's fields in the
    adapter's units span a hundredth of a unit: an MLP's init and step size expect ~1; in per-row units they are
    ~1 already), then the standardisation is folded into the first layer (W1 / sd, b1 - W1 . mean / sd: the same
    function of the raw x, no buffer to save)."""
    x, x_val = x.double(), x_val.double()
    mean, sd = x.mean(0), x.std(0)
    sd = torch.where(sd > 0, sd, torch.ones_like(sd))
    if not standardize:
        mean, sd = torch.zeros_like(mean), torch.ones_like(sd)
    with torch.enable_grad(), torch.autocast("cpu", enabled=False):
        fits = [fit_member((x - mean) / sd, resid, (x_val - mean) / sd, resid_val, width, seed + m)
                for m in range(members)]
    parts = {k: torch.cat([f[k] for f in fits]).double() for k in PARTS}
    W1 = parts["W1"] / sd  # [members, hidden, D]
    parts["b1"] = parts["b1"] - W1 @ mean
    parts["W1"] = W1
    return parts


def add_correction(row: RowHeadFit, R: Tensor, y: Tensor, R_val: Tensor | None, y_val: Tensor | None, act,
                   seed: int, X: Tensor | None = None, X_val: Tensor | None = None, log: Tensor | None = None,
                   log_val: Tensor | None = None) -> RowHeadFit:
    """`row` with the head's nonlinear correction fitted to its residuals (`fit_row_net`; the head's
    `row_net_members` MLPs, from `seed`, stopped on the even validation rows): "net" is their weights when their
    mean beats the linear head on the odd validation rows (errors in row units: "net_mae", "linear_mae") by one
    standard error of the paired difference, and then "errors", "width_power" and "noise" are its own (all
    validation rows); else None. Not tried without the correction's buffers or with fewer than MIN_ROWS /
    MIN_VALIDATION_ROWS rows."""
    members = act.row_net_members
    if not members or R_val is None or y_val is None or len(y) < MIN_ROWS or len(y_val) < MIN_VALIDATION_ROWS:
        return dataclasses.replace(row, net=None)
    (train, u_train), (val, u_linear) = (row_residuals(row, R, y, act, X, log),
                                         row_residuals(row, R_val, y_val, act, X_val, log_val))
    # the members stop on every other validation row and are judged on the rest: rows that chose the epoch
    # would favour the correction (kept on random walks, where nothing in the window predicts the step)
    stop = torch.arange(len(u_linear)) % 2 == 0
    net = fit_row_net(train.x, u_train, val.x[stop], u_linear[stop], members, act.row_net_W1.shape[1], seed,
                      standardize=row.rule == "fixed")
    u_net = u_linear - row_net(val.x, net)
    out = dataclasses.replace(row, net=None, net_mae=round(float(u_net[~stop].abs().mean()), 6),
                              linear_mae=round(float(u_linear[~stop].abs().mean()), 6))
    if not beats_by_one_se((u_linear.abs() - u_net.abs())[~stop]):
        return out
    power = choose_width_power(u_net, val.ratio)
    return dataclasses.replace(out, net=net, errors=u_net.abs() * val.frame.scale, width_power=power,
                               noise=max(float((u_net.abs() / val.ratio ** power).median()), 1e-3))


def fixed_units_correction(fit: LinearFit, F_val: Tensor | None, R: Tensor, y: Tensor, R_val: Tensor | None,
                           y_val: Tensor | None, act, seed: int, *, loss: str, losses, max_shift: float,
                           X: Tensor | None = None, X_val: Tensor | None = None) -> RowHeadFit | None:
    """Where the adapter's units were kept (no per-row rule won): the per-row head's form in those same units for
    every row (rule "fixed", `row_units.row_location_scale`): its linear head on the K most recent numbers (and
    loc_U when it wins), then the nonlinear correction (`add_correction`). A linear head is one hyperplane for
    every row: a price whose grade multiplies with its size, or a count whose season grows with the level, is
    curved in any units. Returned only when the correction is kept and the whole beats the adapter's units'
    linear `fit` (w, b on F = loc_U and the recent values) on the odd validation rows (those that neither fitted
    nor stopped it) by one standard error and by FIXED_MIN_GAIN of its MAE; else None. Not tried without the correction's buffers or validation
    rows. y, y_val on the head's scale."""
    if not act.row_net_members or F_val is None or R_val is None or y_val is None or len(y_val) < MIN_VALIDATION_ROWS:
        return None
    row = fit_row_head(R, y, R_val, y_val, "fixed", act, loss=loss, losses=losses, max_shift=max_shift, X=X,
                       X_val=X_val)
    row = add_correction(row, R, y, R_val, y_val, act, seed, X, X_val)
    if row.net is None:
        return None
    adapter_errors = (y_val - act.from_standard(F_val @ fit.w + fit.b)).abs()
    judged = torch.arange(len(y_val)) % 2 == 1
    gain = (adapter_errors - row.errors)[judged]
    enough = float(row.errors[judged].mean()) <= (1 - FIXED_MIN_GAIN) * float(adapter_errors[judged].mean())
    return row if enough and beats_by_one_se(gain) else None
