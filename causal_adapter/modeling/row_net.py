"""A nonlinear correction to the value head in per-row units: the mean of a few small MLPs on the row's own
numbers, added to the linear head's y' (`heads.ActionHead.row_regression`).

A linear head on the row's numbers in its own units (`row_units`) is one autoregression for every series: it
cannot be a seasonal one for co2 and a mean-reverting one for the Nile. Per-series least squares on the same
window is better (docs/design-notes/value-head.md), and a global model that reads the window's shape can be
better still (N-BEATS, the M4 winners): the MLPs read the window in row units, which of its slots hold a
number, and two scale-free shape statistics, log(s / mean |S|) (how far the series moves a step against its
level) and log(c / s) (how smooth it is: `row_units.floored_curvature`). Every input is scale-free, so a context
multiplied by c still gives c times the value.

The weights are buffers fitted after the linear head (`training.value_head.correction.fit_row_net`), zero until then:
a zero last layer adds exactly 0 (initialisation and adapters without the net behave as before).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .row_units import floored_curvature, level

#: the shape statistics are clamped to these logs (a flat window, a window with no step)
LOG_STEP_RANGE = (-14.0, 7.0)
LOG_SMOOTH_RANGE = (-7.0, 7.0)
#: the names and shapes of the buffers, for `members` MLPs of `width` hidden units on `inputs` features
PARTS = ("W1", "b1", "W2", "b2", "w3", "b3")


def part_shapes(members: int, width: int, inputs: int) -> dict[str, tuple[int, ...]]:
    return {"W1": (members, width, inputs), "b1": (members, width), "W2": (members, width, width),
            "b2": (members, width), "w3": (members, width), "b3": (members,)}


def net_inputs(values: Tensor, scale: Tensor, r: Tensor, log_space: bool = False) -> Tensor:
    """values [..., K] the same-kind numbers (NaN = none), scale [...] s, r [..., K] the numbers in row units
    (clamped as the linear head reads them, 0 where none) -> [..., 2 K + 2]: r, presence, log(s / mean |S|)
    (log s in log space, where s is relative already: `row_units.level`), log(c / s)."""
    present = (~torch.isnan(values)).to(r.dtype)
    unit = level(values, log_space).clamp_min(torch.finfo(values.dtype).tiny)
    c = floored_curvature(values, log_space)
    log_step = torch.log((scale / unit).clamp_min(torch.finfo(values.dtype).tiny)).clamp(*LOG_STEP_RANGE)
    log_smooth = torch.log((c / scale).clamp_min(torch.finfo(values.dtype).tiny)).clamp(*LOG_SMOOTH_RANGE)
    stats = torch.stack([log_step, log_smooth], -1).to(r.dtype)
    return torch.cat([r, present, torch.nan_to_num(stats)], -1)


def mlp_members(x: Tensor, W1: Tensor, b1: Tensor, W2: Tensor, b2: Tensor, w3: Tensor, b3: Tensor) -> Tensor:
    """x [..., D] -> [..., E]: each of the E members' output, w3 . gelu(W2 gelu(W1 x + b1) + b2) + b3."""
    h = torch.nn.functional.gelu(torch.einsum("...d,ehd->...eh", x, W1) + b1)
    h = torch.nn.functional.gelu(torch.einsum("...eh,egh->...eg", h, W2) + b2)
    return (h * w3).sum(-1) + b3


def row_net(x: Tensor, parts: dict[str, Tensor]) -> Tensor:
    """x [..., D] -> [...]: the members' mean (`mlp_members`), in x's dtype."""
    return mlp_members(x, *(parts[k].to(x.dtype) for k in PARTS)).mean(-1)
