"""The value head's width after training, calibrated on the validation rows (`calibrate_regression_scale`): how
much of a fitted per-row width to keep (its exponent, against the width without it: `base_scale`), the scale
|b_noise_Y| at the median normalised residual, and the split-conformal map of every level
(`modeling.intervals.fit_calibration`), a residual below the written resolution counted at it
(`written_resolution`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import Tensor

from ...config import DEFAULT_SCALE_FLOOR
from ...modeling.intervals import choose_scale_exponent, fit_calibration
from .series import series_scale_factors


@dataclass
class Calibration:
    """What `calibrate_regression_scale` did. scale_exponent: a of the per-row width's fitted part (None: not
    chosen, no such part); interval_scores: the held-out interval score of each exponent tried; exact_rows: the
    validation rows whose residual is below the written resolution (None: none)."""
    scale_exponent: float | None = None
    interval_scores: dict[float, float] = field(default_factory=dict)
    exact_rows: str | None = None
    series_scaled: int | None = None

    def log_items(self) -> dict[str, object]:
        """The items of the log line ``value scale: ...`` (only what was done)."""
        items: dict[str, object] = {}
        if self.scale_exponent is not None:
            items["scale_exponent"] = self.scale_exponent
            items.update({f"interval_score_a{k:g}": round(v, 6) for k, v in self.interval_scores.items()})
        if self.exact_rows is not None:
            items["exact_rows"] = self.exact_rows
        if self.series_scaled is not None:
            items["series_with_own_width"] = self.series_scaled
        return items


def base_scale(inner, predict: Callable[[], dict]) -> list[float] | None:
    """With a fitted per-row part of the width (`ActionHead.per_row_log_scale`: w_scale_Y . loc_U in the adapter's
    units, w_row_scale . x in per-row units): the validation widths without it (that part 0; the out-of-depth factor
    and the row's own units kept), from one more pass of `predict` (rows in the order of the last evaluation's);
    else None."""
    act = inner.action
    part = act.per_row_log_scale()
    if part is None or act.b_noise_Y is None:
        return None
    saved = tuple(t.detach().clone() for t in part)
    try:
        with torch.no_grad():
            for t in part:
                t.zero_()
        return predict()["scale"]
    finally:
        with torch.no_grad():
            for t, old in zip(part, saved):
                t.copy_(old)


def calibrate_regression_scale(inner, predictions: dict | None, base_scale: Sequence[float] | None = None,
                               series_widths: bool = False) -> Calibration | None:
    """After training, on the validation predictions (y_true: values; loc, scale: on the head's scale, `value_map`,
    where every residual is taken). With a per-row scale and `base_scale` (`base_scale`):
    shrink the per-row part of the width, scale = base * (scale / base)^a, with a chosen by a held-out
    interval score (`intervals.choose_scale_exponent`: conformal maps cross-fitted on halves of the
    validation rows; in per-row units on the rows divided by their base width, so that every scale counts alike)
    and applied to that part's weights and clamp range (`ActionHead.per_row_log_scale`: w_scale_Y and
    log_scale_range, or w_row_scale and row_log_scale_range) as *= a (still an exact Cauchy; the out-of-depth
    factor stays). Then multiply |b_noise_Y| by the median normalised residual
    |y - loc_Y| / scale_Y (a Cauchy's scale is its median absolute deviation, so the raw 50% interval is
    calibrated), and fit the split-conformal map of every level on the rescaled normalised residuals
    (`intervals.fit_calibration`) into `config.value_calibration`; with `series_widths`, on the rows rescaled by
    each series' own width factor first (`series.series_scale_factors`, `TrainConfig.series_widths`). Returns a
    `Calibration`; None (nothing done) without a regression scale of its own or validation values."""
    act = inner.action
    if act.b_noise_Y is None or not predictions or not predictions["y_true"]:
        return None
    y, loc, scale = (torch.tensor(predictions[k], dtype=torch.float64) for k in ("y_true", "loc", "scale"))
    vm = act.value_map  # the residuals are taken on the head's scale (log y for a log head), where loc / scale live
    logs = predictions.get("log")
    if vm.series and logs is not None and len(logs) == len(y):  # a "series" head: each row on its own scale
        vm = vm.rows(torch.tensor(logs, dtype=torch.bool))
    value_y, y = y, vm.to_head(y)
    ok = torch.isfinite(y)  # a value with no place on the head's scale (<= 0 for a log head) calibrates nothing
    base = None if base_scale is None or len(base_scale) != len(scale) else torch.tensor(base_scale, dtype=torch.float64)
    keys = predictions.get("series")
    keys = keys if keys is not None and len(keys) == len(y) else None
    if not bool(ok.all()):
        value_y, y, loc, scale = value_y[ok], y[ok], loc[ok], scale[ok]
        vm = vm.rows(vm.log_rows[ok]) if vm.log_rows is not None else vm
        base = None if base is None else base[ok]
        keys = None if keys is None else [k for k, keep in zip(keys, ok.tolist()) if keep]
    info = Calibration()
    part = act.per_row_log_scale()
    if base is not None and part is not None:
        if act.row_rule is not None:  # scored in each row's own width: a series of 0.07 counts as one of 9,000
            a, scores = choose_scale_exponent(y / base, loc / base, torch.ones_like(base), scale / base)
        else:
            a, scores = choose_scale_exponent(y, loc, base, scale / base)
        info = Calibration(scale_exponent=a, interval_scores=scores)
        if a != 1.0:
            with torch.no_grad():
                for t in part:
                    t.mul_(a)
            scale = base * (scale / base) ** a
    # a residual below the resolution of the written value (half a unit in its last place) says only that the
    # head matched the text: it counts as that resolution, so an exact fit (deterministic data: arithmetic, a
    # column copied from the prompt) still gets calibrated intervals, as narrow as the text can tell
    resolution = vm.head_resolution(value_y, written_resolution(value_y, inner.causal_config.value_decimals))
    resid = (y - loc).abs()
    exact = int((resid < resolution).sum())
    factor = float((resid.clamp_min(resolution) / scale).median())
    if not math.isfinite(factor) or factor <= 0:
        return None
    with torch.no_grad():
        new = max(float(act.b_noise_Y.abs().max()) * factor, DEFAULT_SCALE_FLOOR)
        act.b_noise_Y.fill_(new)
    floored_loc = torch.where(resid < resolution, y - resolution, loc)  # |y - loc| at least the resolution
    scale = scale * factor
    table = inner.causal_config.value_series
    if table:
        for entry in table.values():  # a refit's calibration drops the widths of an earlier one
            entry.pop("scale", None)
    if keys is not None and table and series_widths:  # each series' own width (`series.series_scale_factors`)
        scale = scale * series_scale_factors(keys, resid.clamp_min(resolution) / scale, table)
        info.series_scaled = sum("scale" in e for e in table.values())
    inner.causal_config.value_calibration = fit_calibration(y, floored_loc, scale.clamp_min(act.scale_floor))
    if exact:
        info.exact_rows = f"{exact}/{len(y)} (residual below the written resolution: counted at it)"
    return info


def written_resolution(y: Tensor, decimals: int | None) -> Tensor:
    """[n] half a unit in the last place of each value as the adapter writes it: 0.5 * 10^-decimals, or with
    `decimals` None (6 significant digits, `numbers.format_number`) half a unit of the 6th significant digit."""
    if decimals is not None:
        return torch.full_like(y, 0.5 * 10.0 ** -decimals)
    magnitude = torch.floor(torch.log10(y.abs().clamp_min(1e-300)))
    return 0.5 * 10.0 ** (magnitude - 5)
