"""The value head's fit in a run, two calls: `fit_before_training` (before step 1 of a fresh run) and
`fit_after_training` (after the last step). The plain loop (`training.loop.train`) and the TRL trainer
(`training.sft.CausalSFTTrainer`) both make them, and nothing else of the fit.

    before training   value units and decimals (`warm_start.fit_value_units`), then the warm start
                      (`warm_start.ridge_warm_start`: the head in closed form on the model's own features)
    after training    the refit on the features training moved (`refit_value_head`), the validation
                      predictions, the width without its per-row part (`calibration.base_scale`), the
                      calibration (`calibration.calibrate_regression_scale`)
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass, fields
from typing import Any, Callable

import torch
from torch import Tensor

from ...config import BF16_MAX_SHIFT, ROW_UNIT_RULES, SERIES_SUPPORTS
from ...records import value_label_mask
from ...saving.unwrap import unwrap_causal_model
from ..config import TrainConfig
from ..data import rows_at
from ..engines import inference_precision
from ...modeling.row_units import row_location_scale, row_period, same_role
from .calibration import Calibration, base_scale, calibrate_regression_scale
from .horizon import fit_horizon_calibration
from .choice import beats_by_one_se
from .linear import LOSSES, WARM_START_LOSSES
from .series import series_table
from .series_ar import WindowRows, choose_series_ar, head_log_rows, window_rows
from .summary import LogSummary
from .warm_start import HeadFitSummary, WarmStartRows, fit_head, fit_value_units, gather_rows, value_decimals


def features_trained(inner) -> bool:
    """True when training changed what the regression head reads (LoRA, W_loc / b_loc, d)."""
    return any(p.requires_grad for n, p in inner.named_parameters()
               if n.startswith(("backbone.", "abduction.loc.", "numeric_embedding.")))


@dataclass
class ValueUnitsSummary(LogSummary):
    """`BeforeTrainingSummary.units`: the value units a fresh run fitted (value_loc, value_scale, value_decimals),
    whether every training target is > 0, the series recorded and, per support of `config.SERIES_SUPPORTS`, how
    many have it (printed as series_<support>)."""
    value_loc: float
    value_scale: float
    value_decimals: int | None
    value_positive: bool
    series: int
    series_support: dict[str, int]

    def as_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "series_support"}
        return {**out, **{f"series_{k}": n for k, n in self.series_support.items()}}


@dataclass
class BeforeTrainingSummary(LogSummary):
    """What `fit_before_training` did, for the log (`as_dict`: the "value head:" line). units: the fresh run's
    value units (None: the adapter had them); value_transform_identity_score / _log_score / _series_score: 'auto''s
    scores of the scales it compared (`choose_transform`; None: not compared); head: the warm start's fit (None: no ridge warm start);
    value_transform: the scale the head was fitted on (None: no head fitted). All None: nothing was fitted."""
    units: ValueUnitsSummary | None = None
    value_transform_identity_score: float | None = None
    value_transform_log_score: float | None = None
    value_transform_series_score: float | None = None
    head: HeadFitSummary | None = None
    value_transform: str | None = None


def fit_before_training(model, config: TrainConfig, train_ds, collator, device, verbose: bool = False,
                        max_rows: int = 8192, eval_ds=None, final: bool | None = None,
                        decode: Callable[[list[int]], str] | None = None) -> BeforeTrainingSummary:
    """Before step 1 of a fresh run: fit the value units (and decimals) on the training targets when the adapter
    has none, then, with ``regression_init='ridge'``, the warm start of the regression head
    (`warm_start.ridge_warm_start`). Every process computes the same from the same rows. `model`: the
    CausalModel, or the module whose forward runs it (an FSDP1 root unit). `final`: no gradient training follows
    this head (default: when nothing moves the features), so `value_loss='auto'` chooses among all of `LOSSES`
    and the per-row head its nonlinear correction; else among `WARM_START_LOSSES`, without the correction.
    A fresh run also records the series of the training and validation files with their supports
    (`series.series_table`; `decode`: the tokenizer's, to name them). Returns the summary the log prints
    (`BeforeTrainingSummary`)."""
    inner = unwrap_causal_model(model)
    summary = BeforeTrainingSummary()
    num_id = inner.num_token_id
    rows, masks = spread_rows(train_ds, num_id, max_rows)
    value_column = "label_values" if "label_values" in rows.column_names else "numeric_values"  # as forward
    values = [v for mask, vals in zip(masks, rows[value_column]) for keep, v in zip(mask, vals) if keep]  # not labels
    if not values:
        return summary
    fresh = inner.causal_config.value_loc is None
    if fresh:
        loc, scale = fit_value_units(values)
        inner.set_value_units(loc, scale, value_decimals(values))
        positive = all(v > 0 for v in values)
        inner.set_value_transform("identity", positive=positive, value_range=(min(values), max(values)))
        table = series_table([train_ds, eval_ds], num_id, decode)
        inner.causal_config.value_series = table
        summary.units = ValueUnitsSummary(
            value_loc=loc, value_scale=scale, value_decimals=inner.causal_config.value_decimals,
            value_positive=positive, series=len(table),
            series_support={k: sum(e["support"] == k for e in table.values()) for k in SERIES_SUPPORTS})
        if config.value_transform == "log":
            _set_log_units(inner, values)
        elif config.value_transform == "series" and config.row_units == "off":
            raise ValueError("value_transform 'series' tells each row on its own series' scale, in per-row units: "
                             "it needs row_units other than 'off'")
    if config.regression_init == "ridge":
        final = not features_trained(inner) if final is None else final
        if model is inner:  # not yet prepared: on the accelerator's device for the features' forwards
            inner.to(device)
        bs = config.per_device_eval_batch_size

        def batches(ds):
            return (collator(rows_at(ds, range(i, min(i + bs, len(ds))))) for i in range(0, min(len(ds), max_rows), bs))

        val = batches(spread_rows(eval_ds, num_id, max_rows)[0]) if eval_ds is not None and len(eval_ds) else None
        gathered = gather_rows(model, batches(rows), device, max_rows, val_batches=val)
        if gathered is not None:

            def fit() -> HeadFitSummary:
                return fit_head(inner, gathered, loss=config.value_loss, max_shift=head_shift_bound(inner, config),
                                losses=LOSSES if final else WARM_START_LOSSES, row_correction=final,
                                **row_unit_choice(config.row_units))

            fit_summary = None
            # 'auto' is chosen again by the final head (its trained features, its correction): chosen on the
            # untrained features, log beat the value by one SE on set c of benchmarks/horizon.py and its heads, the
            # value's per-row one with its correction, then lost on test: 1.12-1.19x the best window against 1.01-1.04
            if (fresh or final) and config.value_transform == "auto" and log_allowed(gathered):
                fit_summary = choose_transform(inner, gathered, values, fit, summary)
            elif (fresh or final) and config.value_transform in ("auto", "series") and series_allowed(gathered, config):
                # one file, many series: log y for the rows of its positive series, the value for the others
                fit_summary = choose_transform(inner, gathered, values, fit, summary, "series",
                                               force=config.value_transform == "series")
            fit_summary = fit_summary or fit()
            record_fit_precision(inner, fit_summary.bf16_shift)
            summary.head, summary.value_transform = fit_summary, inner.causal_config.value_transform
    line = summary.as_dict()
    if verbose and line:
        print("value head: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                         for k, v in line.items()), file=sys.stderr)
    return summary


def _evenly(n: int, k: int) -> list[int]:
    return torch.linspace(0, n - 1, k).round().long().unique().tolist() if k < n else list(range(n))


def spread_rows(ds, num_id: int, max_targets: int):
    """(rows, their `records.value_label_mask`s): the rows of `ds` the head's fit reads, spread evenly over the
    whole file (a file ordered by series gives every series its share, where its first rows gave the first series
    alone), about `max_targets` values in all (a forecasting row holds several)."""
    rows = ds.select(_evenly(len(ds), max_targets))
    masks = [value_label_mask(ids, labels, num_id) for ids, labels in zip(rows["input_ids"], rows["labels"])]
    total = sum(map(sum, masks))
    if total > max_targets:
        keep = _evenly(len(rows), max(1, len(rows) * max_targets // total))
        rows, masks = rows.select(keep), [masks[i] for i in keep]
    return rows, masks


def _set_log_units(inner, values) -> None:
    """The head on log y, its units fitted on the log training targets (all > 0: else a ValueError)."""
    if not all(v > 0 for v in values):
        raise ValueError("value_transform 'log' needs every training target > 0 (the value's Cauchy lives on log y); "
                         "use 'identity' or 'auto'")
    inner.set_value_transform("log", fit_value_units([math.log(v) for v in values]))


def log_allowed(rows: WarmStartRows) -> bool:
    """Whether the data allow a head on log y: every training target > 0 and, in the rows whose numbers come in
    records (a date and a value: `row_units.row_period` > 1), every number of the value's own kind
    (`row_units.same_role`) > 0. A row of numbers of one kind or of no period (a table's fields: a count of 0
    garages is not the price) is not held to it: a number <= 0 there is read as none on log y."""
    if not bool((rows.y > 0).all()):
        return False
    if not rows.R.shape[-1]:  # the head reads no recent numbers
        return True
    R = rows.R.double()
    period = row_period(R)
    same = same_role(R, period)[period > 1]
    return bool((same[~torch.isnan(same)] > 0).all())


def series_allowed(rows: WarmStartRows, config: TrainConfig) -> bool:
    """Whether a "series" head is possible: per-row units, and rows of a positive series beside others (rows of
    positive series alone: `log_allowed` decides the adapter's log)."""
    return (config.row_units != "off" and rows.log is not None and rows.R.shape[-1] > 0
            and bool(rows.log.any()) and not bool(rows.log.all()))


def _set_series_units(inner, rows: WarmStartRows) -> None:
    """The "series" head: the value's own units, and on log y those of the positive series' targets."""
    inner.set_value_transform("series", fit_value_units(rows.y[rows.log].log().tolist()))


def choose_transform(inner, rows: WarmStartRows, values, fit: Callable[[], HeadFitSummary],
                     summary: BeforeTrainingSummary, other: str = "log", force: bool = False
                     ) -> HeadFitSummary | None:
    """`value_transform='auto'` where `log_allowed` (`other` "log") or `series_allowed` ("series"): the head fitted
    on the value and under `other` (`fit`), each scored on the validation rows by its errors in value units divided
    by each row's own one-step naive error (scale-free, `validation_errors`); `other` is kept when it
    `beats_by_one_se` (or `force`), identity otherwise. Both scores go into `summary`. Returns `other`'s fit's
    summary when it is kept (the head is fitted), else None (the head is left on the value's scale, to be
    fitted)."""
    if rows.X_val is None or rows.y_val is None or len(rows.y_val) < 2:
        if not force:
            return None
        _set_series_units(inner, rows)
        return fit()
    errors = {}
    fitted = {}
    for transform in ("identity", other):
        if transform == "log":
            _set_log_units(inner, values)
        elif transform == "series":
            _set_series_units(inner, rows)
        else:
            inner.set_value_transform("identity")
        fitted[transform] = fit()
        errors[transform] = validation_errors(inner, rows)
    summary.value_transform_identity_score = round(float(errors["identity"].mean()), 6)
    setattr(summary, f"value_transform_{other}_score", round(float(errors[other].mean()), 6))
    if force or beats_by_one_se(errors["identity"] - errors[other]):
        return fitted[other]
    inner.set_value_transform("identity")
    return None


@torch.no_grad()
def validation_errors(inner, rows: WarmStartRows) -> Tensor:
    """[n_val] |y - the head's point value| on the validation rows, each divided by its row's own one-step naive
    error in value units (`row_head.scale_free_errors` under identity): what the transforms are compared by."""
    act = inner.action
    dtype = act.b_reg.dtype
    X = rows.X_val.to(device=act.b_reg.device, dtype=dtype)
    R = rows.R_val.to(device=act.b_reg.device, dtype=dtype)
    log = rows.log_val if act.value_map.series else None
    loc, _ = act.regression(X, torch.zeros_like(X), R, None if log is None else log.to(X.device))
    value = act.value_map.rows(log).to_value(loc.double().cpu())
    cfg = inner.causal_config
    if rows.R_val.shape[-1]:
        naive = row_location_scale(rows.R_val, "last", cfg.value_loc, cfg.value_scale, keep=act.recent_values)[2]
    else:  # no recent numbers: every row in the value's units
        naive = torch.full_like(rows.y_val, cfg.value_scale)
    return (rows.y_val - value).abs() / naive


def row_unit_choice(setting: str) -> dict:
    """`TrainConfig.row_units` ('auto', 'off' or a rule of `config.ROW_UNIT_RULES`) -> `ridge_warm_start`'s
    row_rules / force_row_units."""
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


def refit_value_head(model, config: TrainConfig, train_ds, collator, device, verbose: bool, eval_ds=None) -> bool:
    """When training moves the features the value head reads (LoRA, W_loc, d; `features_trained`) and
    ``regression_init='ridge'``: fit the head again on them (`fit_before_training` with final=True, on the features
    inference computes: `engines.inference_precision`) and drop the calibration map, which described the old head.
    Without this a head fitted at step 0 reads features that drifted (a stale head: sunspots validation MAE
    21,963,900 mid-run with W_loc trained). Also what a mid-run evaluation of the adapter a run would save does
    (`loop._eval_refitted`). `model`: as for `fit_before_training`. Returns whether it refitted."""
    inner = unwrap_causal_model(model)
    if config.regression_init != "ridge" or not features_trained(inner):
        return False
    with inference_precision(inner):  # the features the saved adapter will see (no autocast)
        fit_before_training(model, config, train_ds, collator, device, verbose=verbose, eval_ds=eval_ds, final=True)
    inner.causal_config.value_calibration = None
    return True


def fit_after_training(model, config: TrainConfig, train_ds, collator, device, verbose: bool, eval_ds,
                       validation_predictions: Callable[[bool], dict], predict: Callable[[], dict]
                       ) -> Calibration | None:
    """After the last step: the head refitted on the final features (`refit_value_head`), then, with validation
    rows, `validation_predictions(refitted)` (the predictions of the head as it now is, as the caller evaluates
    it: it may log them), and with ``calibrate_scale`` the width calibrated on them (`calibrate_regression_scale`,
    with `base_scale` from one more pass of `predict`, which predicts the validation rows in the same order).
    Returns the `Calibration` (None: not calibrated)."""
    inner = unwrap_causal_model(model)
    refitted = refit_value_head(model, config, train_ds, collator, device, verbose, eval_ds)
    if eval_ds is None:
        return None
    for entry in (inner.causal_config.value_series or {}).values():
        entry.pop("ar", None)  # an earlier fit's ARs described the old head: the predictions below are the head's
    predictions = validation_predictions(refitted)
    if config.series_ar:
        fit_series_ar(inner, train_ds, predictions, verbose)
    calibrated = None
    if config.calibrate_scale:
        calibrated = calibrate_regression_scale(inner, predictions, base_scale(inner, predict),
                                                series_widths=config.series_widths)
    fit_horizon_calibration(inner, eval_ds, verbose)  # rows with several values: the horizon's per-step maps
    return calibrated


def fit_series_ar(inner, train_ds, predictions: dict | None, verbose: bool, max_rows: int = 8192) -> int | None:
    """Each series' own AR where its validation rows choose it (`series_ar.choose_series_ar`, on the training rows
    `spread_rows` reads). The validation `predictions` keep the head's loc, which the calibration then reads: the
    chosen locations were chosen on those rows and err less there than on new rows (set a of `benchmarks/scales.py`:
    calibrated on them, 12 series off their 90% level against 6). None (nothing done): no series table, or a head
    that reads no numbers."""
    table, act = inner.causal_config.value_series, inner.action
    recent = (predictions or {}).get("recent")
    if not table or not act.recent_values or not recent or len(recent) != len(predictions["loc"]):
        return None
    rows, masks = spread_rows(train_ds, inner.num_token_id, max_rows)
    train = window_rows(rows, masks, inner.num_token_id, len(recent[0]))
    val = WindowRows(list(predictions["series"]), torch.tensor(recent, dtype=torch.float64),
                     torch.tensor(predictions["y_true"], dtype=torch.float64))
    before = torch.tensor(predictions["loc"], dtype=torch.float64)
    loc, chosen = choose_series_ar(table, act.value_map, train, val, before)
    if verbose:
        y = act.value_map.rows(head_log_rows(act.value_map, val.keys, table)).to_head(val.y)
        ok = torch.isfinite(y)
        mae = [float((v - y)[ok].abs().mean()) for v in (before, loc)]
        alone = sum(e.get("ar", {}).get("mix") == 0.0 for e in table.values())
        print(f"series AR: {chosen} of {len(table)} series, {alone} of them the AR alone (validation MAE on the "
              f"head's scale {mae[0]:.4g} -> {mae[1]:.4g})", file=sys.stderr)
    return chosen


def head_shift_bound(inner, config: TrainConfig) -> float:
    """The bf16 bound of the value head's fit (`config.BF16_MAX_SHIFT`) or inf, per `bf16_safe_head`.
    'auto' = on only when the heads themselves are 16-bit (`autocast_adapter_dtype=False` on a 16-bit base):
    the only case where loc_U is rounded. On a bf16 base the heads compute in fp32 and the fit sees the
    16-bit features it will run on, so its validation-chosen penalty already accounts for them (sunspots,
    60 bf16 steps, validation MAE 24.97 with the bound off vs 36.89 on: docs/values.md); under bf16
    autocast on a float32 base the fit sees the float32 features inference computes
    (`engines.inference_precision`)."""
    if config.bf16_safe_head == "auto":
        return BF16_MAX_SHIFT if inner.action.w_reg.dtype in (torch.bfloat16, torch.float16) else math.inf
    return BF16_MAX_SHIFT if config.bf16_safe_head == "on" else math.inf
