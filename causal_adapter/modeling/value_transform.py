"""The scale the value's Cauchy lives on: the value itself (``identity``) or its log (``log``, for a positive quantity).

The value head predicts a Cauchy on h = T(y): loc_Y and scale_Y are its location and scale there. The value a user
sees is T^-1 of it: the point value T^-1(loc_Y), the median (T is increasing, so quantiles map exactly), and each
interval T^-1 of the interval on h (`intervals.interval`). Under ``log`` a value multiplies where it would add, its
interval is wider above than below, and neither ever reaches 0. The NLL in the value's own units carries the
Jacobian, NLL(y) = NLL(h) + log y, so NLLs under both transforms compare (`ValueMap.nll_offset`).

``positive``: training saw only positive values of the quantity. Under ``identity`` the value and the interval's
bounds are then floored at 0 (the interval meets (0, inf), where every value it should cover lies, so its coverage of
positive values is unchanged); under ``log`` they are positive by construction.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..config import VALUE_TRANSFORMS as TRANSFORMS
#: the largest h that `to_value` exponentiates (exp(709) is the largest finite float64)
MAX_LOG = 709.0


@dataclass(frozen=True)
class ValueMap:
    """The value's transform T and whether the quantity is positive (module docstring)."""
    transform: str = "identity"
    positive: bool = False

    def __post_init__(self) -> None:
        if self.transform not in TRANSFORMS:
            raise ValueError(f"value_transform must be one of {TRANSFORMS}, got {self.transform!r}")

    @property
    def log(self) -> bool:
        return self.transform == "log"

    def to_head(self, y: Tensor) -> Tensor:
        """Values -> h = T(y); under log a value <= 0 (or NaN) has no h: NaN."""
        if not self.log:
            return y
        return torch.where(y > 0, y.clamp_min(torch.finfo(y.dtype).tiny).log(), torch.full_like(y, math.nan))

    def to_value(self, h: Tensor) -> Tensor:
        """h -> the value T^-1(h) (a location, a bound, or a sampled h), floored at 0 for a positive quantity."""
        if self.log:
            return h.clamp(max=MAX_LOG).exp()
        return h.clamp_min(0.0) if self.positive else h

    def nll_offset(self, y: Tensor) -> Tensor:
        """-log |dh/dy| at y: what turns the NLL of h into the NLL of y (log y under log, else 0)."""
        return self.to_head(y) if self.log else torch.zeros_like(y)

    def head_resolution(self, y: Tensor, resolution: Tensor) -> Tensor:
        """A resolution of the value at y (half a written unit) on the head's scale: resolution / y under log."""
        return resolution / y.abs().clamp_min(torch.finfo(y.dtype).tiny) if self.log else resolution


def value_map_of(config) -> ValueMap:
    """The `ValueMap` of a `CausalAdapterConfig` (adapters saved before the fields: identity, not positive)."""
    return ValueMap(getattr(config, "value_transform", "identity"), bool(getattr(config, "value_positive", False)))
