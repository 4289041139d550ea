"""The scale the value's Cauchy lives on: the value itself (``identity``) or its log (``log``, for a positive quantity).

The value head predicts a Cauchy on h = T(y): loc_Y and scale_Y are its location and scale there. The value a user
sees is T^-1 of it: the point value T^-1(loc_Y), the median (T is increasing, so quantiles map exactly), and each
interval T^-1 of the interval on h (`intervals.interval`). Under ``log`` a value multiplies where it would add, its
interval is wider above than below, and neither ever reaches 0. The NLL in the value's own units carries the
Jacobian, NLL(y) = NLL(h) + log y, so NLLs under both transforms compare (`ValueMap.nll_offset`).

``positive``: training saw only positive values of the quantity. Under ``identity`` the value and the interval's
bounds are then floored at 0 (the interval meets (0, inf), where every value it should cover lies, so its coverage of
positive values is unchanged); under ``log`` they are positive by construction.

A head on log y writes only what it can (`ValueMap.bounds`, docs/values.md "What a log head writes"): its bounds are
the training values' range on log y, widened by that range's width on each side (at least a factor of 10: a range of
one value); a head in per-row units has none (`ActionHead.value_map`: it is scale-equivariant, any scale is its own). Generation never writes a number whose h lies outside them (`writable`): at a position the head was never
fitted at (a second number after the answer, where loc_Y can be 1,250 on log y) the row ends there, saying why. Every
other reader (`predict`, the intervals, the horizon's paths) gets h clamped to them; and, whatever the range, to what
exp can represent in h's own dtype (`log_limits`: 88.7 in float32, 709 in float64), so no finite h gives an infinite
value.

``series`` (one file, many series): each row is on log y when its series is positive (`series.RowSeries.log`: every
value training and validation saw of it > 0), on the value otherwise; the per-row head reads its numbers on the same
scale (`row_units.row_location_scale`'s per-row `log_space`). `ValueMap.rows` gives the map of a batch of rows
(`log_rows`, broadcast over trailing dimensions), `ValueMap.row` the plain map of one row ("log" or the floored
value).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..config import VALUE_TRANSFORMS as TRANSFORMS
#: the largest h that `to_value` exponentiates in float64 (exp(709) is the largest finite float64)
MAX_LOG = 709.0
#: the least widening of a log head's bounds on each side of its training range, on log y (a factor of 10)
MIN_LOG_WIDENING = math.log(10.0)


def log_limits(dtype: torch.dtype) -> tuple[float, float]:
    """The h whose exp is a finite normal number of `dtype` (float32 and bfloat16: -87.3 to 88.7, float16: -9.7 to
    11.09, float64: -708.4 to 709): the exp runs in h's own dtype, so its clamp is that dtype's."""
    info = torch.finfo(dtype)
    return math.log(info.tiny), (math.log(info.max) - 1e-3 if dtype != torch.float64 else MAX_LOG)


def log_bounds(value_range) -> tuple[float, float] | None:
    """A log head's bounds on h from its training values' [min, max] (module docstring); None without a range or
    with a value <= 0 in it (no log)."""
    if value_range is None or not value_range[0] > 0:
        return None
    lo, hi = math.log(value_range[0]), math.log(value_range[1])
    widen = max(hi - lo, MIN_LOG_WIDENING)
    return lo - widen, hi + widen


@dataclass(frozen=True, eq=False)
class ValueMap:
    """The value's transform T, whether the quantity is positive, and under log the bounds of h it writes within
    (module docstring; None: the dtype's limit alone, as adapters saved before `value_range`). `log_rows` [...] bool
    (a "series" map of a batch, `rows`): the rows on log y, the others on the value."""
    transform: str = "identity"
    positive: bool = False
    bounds: tuple[float, float] | None = None
    log_rows: Tensor | None = None

    def __post_init__(self) -> None:
        if self.transform not in TRANSFORMS:
            raise ValueError(f"value_transform must be one of {TRANSFORMS}, got {self.transform!r}")

    @property
    def log(self) -> bool:
        return self.transform == "log"

    @property
    def series(self) -> bool:
        """Each row on its own series' scale (module docstring)."""
        return self.transform == "series"

    def rows(self, log_rows: Tensor | None) -> "ValueMap":
        """The map of a batch of rows [...] of a "series" map, `log_rows` [...] bool those on log y (None: none);
        any other map is its own."""
        if not self.series or log_rows is None:
            return self
        return dataclasses.replace(self, log_rows=log_rows.bool())

    def row(self, floored: bool = False, log: bool = False) -> "ValueMap":
        """The plain map of one row: log y for a row on it (`log`, a "series" map's), else this map floored at 0
        when `floored` (its series never goes below 0, `series.RowSeries.floored`)."""
        if self.series:
            return ValueMap("log", True) if log else ValueMap("identity", self.positive or floored)
        return self.floored(floored)

    def _mask(self, x: Tensor) -> Tensor:
        """`log_rows` broadcast against x [..., *trailing]."""
        m = self.log_rows.to(x.device)
        return m.reshape(m.shape + (1,) * (x.dim() - m.dim()))

    def to_head(self, y: Tensor) -> Tensor:
        """Values -> h = T(y); under log a value <= 0 (or NaN) has no h: NaN."""
        if not self.log and self.log_rows is None:
            return y
        h = torch.where(y > 0, y.clamp_min(torch.finfo(y.dtype).tiny).log(), torch.full_like(y, math.nan))
        return h if self.log else torch.where(self._mask(y), h, y)

    def to_value(self, h: Tensor) -> Tensor:
        """h -> the value T^-1(h) (a location, a bound, or a sampled h), floored at 0 for a positive quantity; under
        log h is kept within `bounds` and within what exp represents in h's dtype (a NaN stays NaN)."""
        if self.log or self.log_rows is not None:
            lo, hi = log_limits(h.dtype)
            if self.bounds is not None:
                lo, hi = max(lo, self.bounds[0]), min(hi, self.bounds[1])
            y = h.clamp(min=lo, max=hi).exp()
            if self.log:
                return y
        value = h.clamp_min(0.0) if self.positive else h
        return torch.where(self._mask(h), y, value) if self.log_rows is not None else value

    def floored(self, floor: bool = True) -> "ValueMap":
        """This map, floored at 0 (`positive`) when `floor`: a row whose series never goes below 0
        (`series.RowSeries.floored`)."""
        return dataclasses.replace(self, positive=True) if floor and not self.positive else self

    def writable(self, h: Tensor) -> Tensor:
        """[...] bool: h is a value the head can write: finite and, under log, within `bounds` (generation ends a
        row rather than write a number at h outside them: `generation.record.faults`)."""
        ok = torch.isfinite(h)
        if self.log and self.bounds is not None:
            ok &= (h >= self.bounds[0]) & (h <= self.bounds[1])
        return ok

    def nll_offset(self, y: Tensor) -> Tensor:
        """-log |dh/dy| at y: what turns the NLL of h into the NLL of y (log y under log, else 0)."""
        if self.log_rows is not None:
            return torch.where(self._mask(y), self.to_head(y), torch.zeros_like(y))
        return self.to_head(y) if self.log else torch.zeros_like(y)

    def head_resolution(self, y: Tensor, resolution: Tensor) -> Tensor:
        """A resolution of the value at y (half a written unit) on the head's scale: resolution / y under log."""
        relative = resolution / y.abs().clamp_min(torch.finfo(y.dtype).tiny)
        if self.log_rows is not None:
            return torch.where(self._mask(y), relative, resolution)
        return relative if self.log else resolution


def value_map_of(config) -> ValueMap:
    """The `ValueMap` of a `CausalAdapterConfig` (adapters saved before the fields: identity, not positive, no
    bounds beyond the dtype's)."""
    transform = getattr(config, "value_transform", "identity")
    bounds = log_bounds(getattr(config, "value_range", None)) if transform == "log" else None
    return ValueMap(transform, bool(getattr(config, "value_positive", False)), bounds)
