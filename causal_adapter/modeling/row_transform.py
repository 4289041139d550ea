"""The one per-row transform of the value head: a row's recent numbers -> its units (m, s), the numbers in those
units (r), the unit of its width and the correction's inputs (x).

The head calls it at inference (`heads.ActionHead.units`) and the fit calls it on the rows it fits
(`training.value_head.row_head.row_rows`): one function, so that what the head was fitted on and what it reads
cannot drift apart (tests/test_row_transform.py compares the two sides).

    values -> (m, s)            `row_units.row_location_scale` (a rule: 'last' or 'median')
    r = (values - m) / s        0 where a slot holds no number
    width = s (c / s)^a         `row_units.row_width`
    x = [r clamped, present, log(s / mean |S|), log(c / s)]    `row_net.net_inputs`
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .row_net import net_inputs
from .row_units import row_location_scale, row_width


@dataclass
class RowFrame:
    """Rows in their own units (float64). values [..., K]: the same-kind numbers, newest first (NaN = none);
    loc, scale [...]: m and s; own [...]: the rows that got their own units (the others keep the fallback units);
    r [..., K]: (values - m) / s, 0 where none, unclamped; log_space: the numbers are logs (a log value head)."""
    values: Tensor
    loc: Tensor
    scale: Tensor
    own: Tensor
    r: Tensor
    log_space: bool = False

    @property
    def present(self) -> Tensor:
        """[..., K] bool: a number in that slot."""
        return ~torch.isnan(self.values)

    def standardize(self, y: Tensor) -> Tensor:
        """Values [...] -> (y - m) / s, the head's target in row units."""
        return (y - self.loc) / self.scale

    def width(self, power: float) -> Tensor:
        """[...] the width unit s (c / s)^power (`row_units.row_width`)."""
        return row_width(self.values, self.scale, self.own, power, self.log_space)

    def clamped(self, clamp: Tensor) -> Tensor:
        """r clamped to `clamp` [2, K] (the range the head reads r in)."""
        lo, hi = clamp.to(self.r.dtype)
        return torch.minimum(torch.maximum(self.r, lo), hi)

    def inputs(self, clamp: Tensor) -> Tensor:
        """[..., 2 K + 2] the correction's and the log-width's inputs x (`row_net.net_inputs`), r clamped to
        `clamp` [2, K]."""
        return net_inputs(self.values, self.scale, self.clamped(clamp), self.log_space)


def row_frame(recent: Tensor, rule: str, fallback_loc: float, fallback_scale: float, log_space: bool = False,
              keep: int | None = None) -> RowFrame:
    """recent [..., W] raw values, most recent first (NaN = none) -> the rows in their own units by `rule`, K =
    `keep` (default W) same-kind numbers each; a row with too few same-kind numbers keeps (fallback_loc,
    fallback_scale), the adapter's units (the head's: on log y when `log_space`, the numbers then their logs), and
    its K most recent numbers (`row_units.row_location_scale`)."""
    values, loc, scale, own = row_location_scale(recent, rule, fallback_loc, fallback_scale, log_space, keep)
    r = torch.nan_to_num((values - loc.unsqueeze(-1)) / scale.unsqueeze(-1), nan=0.0)
    return RowFrame(values, loc, scale, own, r, log_space)
