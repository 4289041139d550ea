"""Fitting the value head's nonlinear correction in per-row units (`modeling.row_net`), after its linear fit.

Each of the head's `row_net_members` MLPs is fitted by AdamW to the linear head's residuals in row units
(an L1 loss: the figures are MAEs), from its own seed, and stopped at its best epoch on the validation rows.
`row_head_fit.add_row_net` keeps their mean only when it beats the linear head on validation by more than one
standard error. Measured (docs/numeric_quality.md, "Values at every scale"): the linear head is one
autoregression for every series and loses to each series' own AR / ETS; the correction closes most of it.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..modeling.row_net import PARTS, mlp_members, part_shapes

#: the correction is tried with at least this many training and validation rows (fewer: an MLP overfits them;
#: half of the validation rows stop the members, the other half judge them)
MIN_ROWS, MIN_VALIDATION_ROWS = 200, 40
EPOCHS, PATIENCE, BATCH = 100, 20, 256
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


def fit_row_net(x: Tensor, resid: Tensor, x_val: Tensor, resid_val: Tensor, members: int, width: int, seed: int
                ) -> dict[str, Tensor]:
    """`members` MLPs (`fit_member`, seeds seed, seed + 1, ...) stacked: PARTS [members, ...] float64."""
    with torch.enable_grad(), torch.autocast("cpu", enabled=False):
        fits = [fit_member(x, resid, x_val, resid_val, width, seed + m) for m in range(members)]
    return {k: torch.cat([f[k] for f in fits]).double() for k in PARTS}
