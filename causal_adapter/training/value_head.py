"""The value head's closed-form fits in a run (the fits themselves are `value_fit`'s): the warm start
before step 1 (`fit_value_head`), the refit on the features training moved (`refit_value_head`) and the
calibration of the width after training (`calibrate_regression_scale`, on `base_scale`)."""
from __future__ import annotations

import math
import sys
from typing import Callable, Sequence

import torch
from torch import Tensor

from ..config import BF16_MAX_SHIFT, DEFAULT_SCALE_FLOOR, ROW_UNIT_RULES
from ..modeling.intervals import choose_scale_exponent, fit_calibration
from ..saving.unwrap import unwrap_causal_model
from .config import TrainConfig
from .data import rows_at
from .engines import inference_precision
from .linear_fit import LOSSES, WARM_START_LOSSES
from .value_fit import fit_value_units, ridge_warm_start, value_decimals


def features_trained(inner) -> bool:
    """True when training changed what the regression head reads (LoRA, W_loc / b_loc, d)."""
    return any(p.requires_grad for n, p in inner.named_parameters()
               if n.startswith(("backbone.", "abduction.loc.", "numeric_embedding.")))


def fit_value_head(model, config: TrainConfig, train_ds, collator, device, verbose: bool = False,
                   max_rows: int = 8192, eval_ds=None, final: bool | None = None) -> dict:
    """Before step 1 of a fresh run: fit the value units (and decimals) on the training targets
    when the adapter has none, then, with ``regression_init='ridge'``, the ridge warm start of the
    regression head (`value_fit`). Every process computes the same from the same rows. `model`: the
    CausalModel, or the module whose forward runs it (an FSDP1 root unit). `final`: no gradient training
    follows this head (default: when nothing moves the features), so `value_loss='auto'` chooses among
    all of `LOSSES` and the per-row head its nonlinear correction (`row_head_fit.add_row_net`); else among
    `WARM_START_LOSSES`, without the correction."""
    inner = unwrap_causal_model(model)
    summary: dict = {}
    rows = train_ds.select(range(min(len(train_ds), max_rows)))
    num_id = inner.num_token_id
    value_column = "label_values" if "label_values" in rows.column_names else "numeric_values"  # as forward
    values = [v for labels, vals in zip(rows["labels"], rows[value_column])
              for lab, v in zip(labels, vals) if lab == num_id]
    if not values:
        return summary
    if inner.causal_config.value_loc is None:
        loc, scale = fit_value_units(values)
        inner.set_value_units(loc, scale, value_decimals(values))
        summary.update(value_loc=loc, value_scale=scale, value_decimals=inner.causal_config.value_decimals)
    if config.regression_init == "ridge":
        final = not features_trained(inner) if final is None else final
        if model is inner:  # not yet prepared: on the accelerator's device for the features' forwards
            inner.to(device)
        bs = config.per_device_eval_batch_size

        def batches(ds):
            return (collator(rows_at(ds, range(i, min(i + bs, len(ds))))) for i in range(0, min(len(ds), max_rows), bs))

        val = batches(eval_ds) if eval_ds is not None and len(eval_ds) else None
        fit = ridge_warm_start(model, batches(rows), device, max_rows, val_batches=val, loss=config.value_loss,
                               max_shift=head_shift_bound(inner, config), losses=LOSSES if final else WARM_START_LOSSES,
                               row_correction=final,
                               **row_unit_choice(config.row_units))
        if fit:
            record_fit_precision(inner, fit["bf16_shift"])
        summary.update(fit or {})
    if verbose and summary:
        print("value head: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                         for k, v in summary.items()), file=sys.stderr)
    return summary


def row_unit_choice(setting: str) -> dict:
    """`TrainConfig.row_units` -> `ridge_warm_start`'s row_rules / force_row_units."""
    if setting == "auto":
        return {"row_rules": ROW_UNIT_RULES, "force_row_units": False}
    if setting == "off":
        return {"row_rules": (), "force_row_units": False}
    return {"row_rules": (setting,), "force_row_units": True}


def record_fit_precision(inner, bf16_shift: float) -> None:
    """Save with the adapter what the value head was fitted on: the features' dtype (the fit runs without
    autocast, `engines.inference_precision`, so the base's) and the bf16 shift of loc_Y (value units). A
    float32-fitted head with a large shift warns when it runs on 16-bit features (`CausalModel.forward`)."""
    inner.causal_config.value_fit_dtype = str(inner.backbone.get_input_embeddings().weight.dtype).replace("torch.", "")
    inner.causal_config.value_bf16_shift = float(bf16_shift)


def refit_value_head(model, config: TrainConfig, train_ds, collator, device, accelerator, verbose: bool,
                     eval_ds=None) -> bool:
    """When training moves the features the value head reads (LoRA, W_loc, d; `features_trained`) and
    ``regression_init='ridge'``: fit the head again on them (`fit_value_head`, on the features inference
    computes: `engines.inference_precision`) and drop the calibration map, which described the old head
    (the end of `train` fits a new one). Without this a head fitted at step 0 reads features that drifted (a stale head: sunspots
    validation MAE 21,963,900 mid-run with W_loc trained). `model`: as for `fit_value_head`. Returns
    whether it refitted."""
    inner = unwrap_causal_model(model)
    if config.regression_init != "ridge" or not features_trained(inner):
        return False
    with inference_precision(inner):  # the features the saved adapter will see (no autocast)
        fit_value_head(model, config, train_ds, collator, device, verbose=verbose, eval_ds=eval_ds, final=True)
    inner.causal_config.value_calibration = None
    return True


def head_shift_bound(inner, config: TrainConfig) -> float:
    """The bf16 bound of the value head's fit (`value_fit.BF16_MAX_SHIFT`) or inf, per `bf16_safe_head`.
    'auto' = on only when the heads themselves are 16-bit (`autocast_adapter_dtype=False` on a 16-bit base):
    the only case where loc_U is rounded. On a bf16 base the heads compute in fp32 and the fit sees the
    16-bit features it will run on, so its validation-chosen penalty already accounts for them (sunspots,
    60 bf16 steps, validation MAE 24.97 with the bound off vs 36.89 on: docs/values.md); under bf16
    autocast on a float32 base the fit sees the float32 features inference computes
    (`engines.inference_precision`)."""
    if config.bf16_safe_head == "auto":
        return BF16_MAX_SHIFT if inner.action.w_reg.dtype in (torch.bfloat16, torch.float16) else math.inf
    return BF16_MAX_SHIFT if config.bf16_safe_head == "on" else math.inf


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


def calibrate_regression_scale(inner, predictions: dict | None, base_scale: Sequence[float] | None = None
                                ) -> dict | bool:
    """After training, on the validation predictions. With a per-row scale and `base_scale` (`base_scale`):
    shrink the per-row part of the width, scale = base * (scale / base)^a, with a chosen by a held-out
    interval score (`intervals.choose_scale_exponent`: conformal maps cross-fitted on halves of the
    validation rows; in per-row units on the rows divided by their base width, so that every scale counts alike)
    and applied to that part's weights and clamp range (`ActionHead.per_row_log_scale`: w_scale_Y and
    log_scale_range, or w_row_scale and row_log_scale_range) as *= a (still an exact Cauchy; the out-of-depth
    factor stays). Then multiply |b_noise_Y| by the median normalised residual
    |y - loc_Y| / scale_Y (a Cauchy's scale is its median absolute deviation, so the raw 50% interval is
    calibrated), and fit the split-conformal map of every level on the rescaled normalised residuals
    (`intervals.fit_calibration`) into `config.value_calibration`. Returns {"scale_exponent": a, ...} (or
    True without the exponent's choice); False (nothing done) without a regression scale of its own or
    validation values."""
    act = inner.action
    if act.b_noise_Y is None or not predictions or not predictions["y_true"]:
        return False
    y, loc, scale = (torch.tensor(predictions[k], dtype=torch.float64) for k in ("y_true", "loc", "scale"))
    info: dict | bool = True
    part = act.per_row_log_scale()
    if base_scale is not None and part is not None and len(base_scale) == len(scale):
        base = torch.tensor(base_scale, dtype=torch.float64)
        if act.row_units is not None:  # scored in each row's own width: a series of 0.07 counts as one of 9,000
            a, scores = choose_scale_exponent(y / base, loc / base, torch.ones_like(base), scale / base)
        else:
            a, scores = choose_scale_exponent(y, loc, base, scale / base)
        info = {"scale_exponent": a, **{f"interval_score_a{k:g}": round(v, 6) for k, v in scores.items()}}
        if a != 1.0:
            with torch.no_grad():
                for t in part:
                    t.mul_(a)
            scale = base * (scale / base) ** a
    # a residual below the resolution of the written value (half a unit in its last place) says only that the
    # head matched the text: it counts as that resolution, so an exact fit (deterministic data: arithmetic, a
    # column copied from the prompt) still gets calibrated intervals, as narrow as the text can tell
    resolution = written_resolution(y, inner.causal_config.value_decimals)
    resid = (y - loc).abs()
    exact = int((resid < resolution).sum())
    factor = float((resid.clamp_min(resolution) / scale).median())
    if not math.isfinite(factor) or factor <= 0:
        return False
    with torch.no_grad():
        new = max(float(act.b_noise_Y.abs().max()) * factor, DEFAULT_SCALE_FLOOR)
        act.b_noise_Y.fill_(new)
    floored_loc = torch.where(resid < resolution, y - resolution, loc)  # |y - loc| at least the resolution
    inner.causal_config.value_calibration = fit_calibration(y, floored_loc, (scale * factor).clamp_min(act.scale_floor))
    if exact:
        info = {**(info if isinstance(info, dict) else {}),
                "exact_rows": f"{exact}/{len(y)} (residual below the written resolution: counted at it)"}
    return info


def written_resolution(y: Tensor, decimals: int | None) -> Tensor:
    """[n] half a unit in the last place of each value as the adapter writes it: 0.5 * 10^-decimals, or with
    `decimals` None (6 significant digits, `numbers.format_number`) half a unit of the 6th significant digit."""
    if decimals is not None:
        return torch.full_like(y, 0.5 * 10.0 ** -decimals)
    magnitude = torch.floor(torch.log10(y.abs().clamp_min(1e-300)))
    return 0.5 * 10.0 ** (magnitude - 5)
