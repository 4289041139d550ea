"""Evaluation metrics of a CausalModel on labelled batches, and the two value baselines.

Every metric is taken at the positions that carry a label (``labels != -100`` after the
transformers shift: position i predicts ``labels[i + 1]``):

* ``loss_cls`` / ``loss_reg`` / ``loss``: L_cls (mean over labelled positions), L_reg
  (gated Cauchy NLL summed and divided by the number of ``<NUM>`` labels) and
  ``loss_cls + reg_weight * loss_reg``, aggregated exactly over the whole split (not a mean of
  batch means).
* ``accuracy``: next-token accuracy of the deterministic mode, token = argmax_k P_k of the OvR
  probabilities over all V rows.
* ``num_precision`` / ``num_recall`` / ``num_f1``: ``<NUM>`` as a class, "predicted <NUM>"
  meaning argmax_k P_k is ``<NUM>``.
* ``value_mae`` / ``value_median_ae``: |loc_Y - y| at ``<NUM>`` labels (value = loc_Y, the
  deterministic mode's value).
* ``coverage_50`` / ``_80`` / ``_90`` / ``_95``: share of ``<NUM>`` labels inside the central interval
  the model reports at that level: the calibrated one (``intervals``: loc_Y +- c_q scale_Y, the
  adapter's split-conformal map) when the adapter has a calibration map, else the raw Cauchy one;
  ``cauchy_coverage_*`` beside: always the raw Cauchy interval loc_Y +- tan(pi q / 2) scale_Y.
* ``aci_coverage_*`` (with a calibration map): the same, for the adaptive conformal intervals
  (`modeling.adaptive`) with the labels taken as ordered in evaluation order (the rows' order: a time
  series split by time), each label's interval from the earlier labels only; ``winkler_90`` /
  ``aci_winkler_90``: the mean interval score of the calibrated / adaptive 90% intervals.
* ``perplexity``: exp of the mean cross-entropy of softmax(loc_S), the softmax-compatible mode.
* Baselines (from the ``target`` / ``previous`` columns of the rows, when present):
  ``baseline_constant_*`` predicts the median of the TRAIN split's targets,
  ``baseline_persistence_*`` the previous value of the series (the last number of the prompt).
  For the built-in corpora every row has exactly one ``<NUM>`` label (its completion), so the
  model's value metrics and the baselines are taken on the same items.

The [n, V] score tensors are only formed for labelled positions, in row chunks.
"""
from __future__ import annotations

import math
import statistics
from typing import Any, Iterable, Mapping, Sequence

import torch
from torch import Tensor

from ..config import IGNORE_INDEX, METRIC_LABELS
from ..data.pipeline import NumericCollator
from ..modeling.cauchy import ovr_probability
from ..modeling.heads import full_precision
from ..modeling.recent_numbers import packed_row_starts
from ..modeling.adaptive import adaptive_interval
from ..modeling.intervals import interval, winkler
from ..modeling.loss import total_loss
from ..modeling.series import position_keys
from ..modeling.series_ar import mixed_locations, row_ar
from ..modeling.value_transform import ValueMap
from ..records import value_targets
from ..saving.fsdp import whole_root_parameters
from ..saving.unwrap import unwrap_model

INTERVAL_LEVELS = (0.5, 0.8, 0.9, 0.95)
SCORE_CHUNK_ROWS = 128  # rows of [rows, V] scores formed at once (128 x 151,936 x 4 B = 78 MB per tensor)


def _median(xs: Sequence[float]) -> float | None:
    return float(statistics.median(xs)) if len(xs) else None


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


class MetricAccumulator:
    """Accumulates the metrics of this module over batches; `state()` / `merge()` combine the
    accumulators of several processes (plain Python data, picklable)."""

    def __init__(self, num_token_id: int, reg_weight: float = 1.0, levels: Sequence[float] = INTERVAL_LEVELS,
                 calibration: dict | None = None, value_map: ValueMap | None = None):
        self.num_token_id = int(num_token_id)
        self.reg_weight = float(reg_weight)
        self.levels = tuple(float(q) for q in levels)
        self.calibration = calibration
        self.value_map = value_map  # the scale of loc_Y / scale_Y (None: the model's, at the first update)
        self.n_tokens = 0
        self.n_num_labels = 0
        self.sum_cls = 0.0
        self.sum_reg = 0.0
        self.correct = 0
        self.tp = self.fp = self.fn = 0
        self.softmax_nll = 0.0
        # per <NUM> label: true value, loc_Y, scale_Y (for the value metrics and the plot)
        self.y_true: list[float] = []
        self.y_loc: list[float] = []
        self.y_scale: list[float] = []
        self.y_series: list[str] = []  # the series key of each (`modeling.series.position_keys`)
        self.y_log: list[bool] = []  # a "series" head: whether each is told on log y (`CausalOutput.value_log`)
        self.y_recent: list[list[float]] = []  # the numbers the value head read before each (`CausalOutput.recent`)
        # per row with baseline columns: target, previous value
        self.targets: list[float] = []
        self.previous: list[float] = []

    # ------------------------------------------------------------------ update
    @torch.no_grad()
    def update(self, model, output, batch: Mapping[str, Any]) -> None:
        """Add one batch. `output` is the model's CausalOutput for `batch` (computed with
        `labels`, so loss_cls / loss_reg are set); `model` is the CausalModel (wrappers allowed)."""
        model = unwrap_model(model)
        if self.value_map is None:
            self.value_map = model.action.value_map
        heads = output.loc_Y.device  # the outputs' device: labels and values join them (device_map splits)
        labels = batch["labels"].to(heads)
        shifted = labels[:, 1:]
        keep = shifted != IGNORE_INDEX
        n = int(keep.sum())
        y = shifted[keep]
        is_num = y == self.num_token_id
        n_num = int(is_num.sum())
        if n:
            self.n_tokens += n
            self.sum_cls += float(output.loss_cls) * n
            self.sum_reg += float(output.loss_reg) * max(1, n_num)
            self.n_num_labels += n_num
            with full_precision(y.device):  # the scores as the model's forward computes them
                preds, nll = self._predict(model, output, keep, y)
            self.correct += int((preds == y).sum())
            pred_num = preds == self.num_token_id
            self.tp += int((pred_num & is_num).sum())
            self.fp += int((pred_num & ~is_num).sum())
            self.fn += int((~pred_num & is_num).sum())
            self.softmax_nll += nll
        if n_num:  # the value metrics (and the calibration read from them): the values, not a record's labels
            values = batch.get("label_values")
            if values is None:
                values = batch["numeric_values"]
            ids = batch["input_ids"].to(heads) if "input_ids" in batch else labels  # a hand-made batch: labels
            at = value_targets(ids, labels, self.num_token_id)[:, 1:]
            y_true = values.to(heads)[:, 1:][at].to(torch.float64)
            loc = output.loc_Y[:, :-1][at].to(torch.float64)
            scale = output.scale_Y[:, :-1][at].to(torch.float64)
            keys = _target_keys(batch, ids, values, at, self.num_token_id)
            value_log = getattr(output, "value_log", None)  # a hand-made output may not carry it
            log = None if value_log is None else value_log.to(heads)[:, :-1][at]
            recent = getattr(output, "recent", None)
            recent = None if recent is None else recent.to(heads)[:, :-1][at].double()
            # each series' own AR where training chose one (`modeling.series_ar`), as predict reads the value
            ars = row_ar(keys, getattr(model, "causal_config", None) and model.causal_config.value_series)
            loc = mixed_locations(loc, recent, self.value_map.log if log is None else log, ars)
            self.y_true += y_true.tolist()
            self.y_loc += loc.tolist()
            self.y_scale += scale.tolist()
            self.y_series += keys
            if log is not None:
                self.y_log += log.tolist()
            if recent is not None:
                self.y_recent += recent.tolist()
        if "target" in batch and "previous" in batch:
            self.targets += [float(v) for v in batch["target"].tolist()]
            self.previous += [float(v) for v in batch["previous"].tolist()]

    def _predict(self, model, output, keep: Tensor, y: Tensor) -> tuple[Tensor, float]:
        """argmax_k P_k at the labelled positions and the summed softmax(loc_S) NLL."""
        if output.loc_S is not None and output.scale_S is not None:
            chunks = [(output.loc_S[:, :-1][keep], output.scale_S[:, :-1][keep], slice(None))]
        else:
            C = output.loc_U.shape[-1]
            lu = output.loc_U[:, :-1][keep].reshape(-1, C)
            su = model.action.noisy_scale(output.scale_U[:, :-1][keep].reshape(-1, C))
            chunks = (
                (*model.action.scores(lu[i:i + SCORE_CHUNK_ROWS], su[i:i + SCORE_CHUNK_ROWS], model.W_cls),
                 slice(i, i + SCORE_CHUNK_ROWS))
                for i in range(0, lu.shape[0], SCORE_CHUNK_ROWS)
            )
        preds, nll = [], 0.0
        thresholds = model.action.threshold_scores()
        for loc_S, scale_S, rows in chunks:
            preds.append(ovr_probability(loc_S, scale_S, thresholds).argmax(-1))
            nll += float(torch.nn.functional.cross_entropy(loc_S.float(), y[rows], reduction="sum"))
        return torch.cat(preds), nll

    # ------------------------------------------------------------------ combine
    def state(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items()}

    def merge(self, states: Iterable[Mapping[str, Any]]) -> "MetricAccumulator":
        """Add other accumulators' `state()` into this one (returns self)."""
        for s in states:
            for k in ("n_tokens", "n_num_labels", "sum_cls", "sum_reg", "correct", "tp", "fp", "fn", "softmax_nll"):
                setattr(self, k, getattr(self, k) + s[k])
            for k in ("y_true", "y_loc", "y_scale", "y_series", "y_log", "y_recent", "targets", "previous"):
                getattr(self, k).extend(s.get(k, []))
        return self

    @classmethod
    def merged(cls, states: Sequence[Mapping[str, Any]]) -> "MetricAccumulator":
        first = states[0]
        acc = cls(first["num_token_id"], first["reg_weight"], first["levels"], first.get("calibration"),
                  first.get("value_map"))
        return acc.merge(states)

    # ------------------------------------------------------------------ results
    def compute(self, constant_value: float | None = None) -> dict[str, Any]:
        """The metrics as a flat dict (None where undefined, e.g. no <NUM> label in the split).
        `constant_value`: the constant baseline's prediction (median of the train targets)."""
        n, k = self.n_tokens, self.n_num_labels
        loss_cls = _ratio(self.sum_cls, n)
        loss_reg = self.sum_reg / max(1, k) if n else None
        prec = _ratio(self.tp, self.tp + self.fp)
        rec = _ratio(self.tp, self.tp + self.fn)
        f1 = None
        if prec is not None and rec is not None:
            f1 = 2 * prec * rec / (prec + rec) if prec + rec > 0 else 0.0
        elif rec is not None:  # nothing predicted as <NUM>: precision undefined, F1 = 0
            f1 = 0.0
        errors = [abs(a - b) for a, b in zip(self._values(), self.y_true)]
        out: dict[str, Any] = {
            "tokens": n,
            "num_targets": k,
            "loss": None if loss_cls is None else total_loss(loss_cls, loss_reg, self.reg_weight),
            "loss_cls": loss_cls,
            "loss_reg": loss_reg,
            "accuracy": _ratio(self.correct, n),
            "num_precision": prec,
            "num_recall": rec,
            "num_f1": f1,
            "value_mae": _ratio(sum(errors), len(errors)),
            "value_median_ae": _median(errors),
        }
        out.update(coverage_metrics(self.y_true, self.y_loc, self.y_scale, self.levels, self.calibration,
                                    self.row_map()))
        out["perplexity"] = math.exp(min(self.softmax_nll / n, 700.0)) if n else None
        out.update(baseline_metrics(self.targets, self.previous, constant_value))
        return out

    def _values(self) -> list[float]:
        """The point values: loc_Y mapped to the value (`value_transform.ValueMap.to_value`)."""
        if self.value_map is None or not self.y_loc:
            return list(self.y_loc)
        return self.row_map().to_value(torch.tensor(self.y_loc, dtype=torch.float64)).tolist()

    def row_map(self) -> ValueMap | None:
        """The value map of the accumulated targets: a "series" head's, each on its own scale (`y_log`)."""
        if self.value_map is None or not self.y_log or len(self.y_log) != len(self.y_loc):
            return self.value_map
        return self.value_map.rows(torch.tensor(self.y_log))

    def predictions(self) -> dict[str, list[float]]:
        """Per <NUM> label: true value, loc_Y, scale_Y (on the head's scale), the point value, its series key, whether
        it is on log y and the numbers the head read before it (in evaluation order)."""
        return {"y_true": list(self.y_true), "loc": list(self.y_loc), "scale": list(self.y_scale),
                "value": self._values(), "series": list(self.y_series), "log": list(self.y_log),
                "recent": list(self.y_recent)}


def _target_keys(batch: Mapping[str, Any], ids: Tensor, values: Tensor, at: Tensor, num_token_id: int) -> list[str]:
    """The series key (`modeling.series.position_keys`) of each value target `at` [B, S - 1] (targets of positions
    1..S - 1), read at the position that predicts it; a packed batch's segments are rows of their own."""
    before = torch.zeros_like(ids, dtype=torch.bool)
    before[:, :-1] = at
    mask = batch.get("attention_mask")
    starts = None
    if mask is None and batch.get("position_ids") is not None:
        starts = packed_row_starts(batch["position_ids"]).expand(ids.shape).cpu()
    numbers = batch.get("numeric_values", values)  # a hand-made batch may give label_values alone
    return position_keys(ids.cpu(), numbers.cpu(), num_token_id, before.cpu(),
                         None if mask is None else mask.cpu(), starts)


def coverage_metrics(y_true: Sequence[float], loc: Sequence[float], scale: Sequence[float],
                     levels: Sequence[float] = INTERVAL_LEVELS, calibration: dict | None = None,
                     value_map: ValueMap | None = None) -> dict[str, Any]:
    """``coverage_<100 q>`` (the reported interval: calibrated when `calibration` is given) and
    ``cauchy_coverage_<100 q>`` (raw Cauchy) for each level q; None without values. With `calibration`
    also ``aci_coverage_<100 q>`` (adaptive conformal, rows in the given order) and, at 90%,
    ``winkler_90`` / ``aci_winkler_90``."""
    out: dict[str, Any] = {}
    y, lo_, sc = (torch.tensor(list(v), dtype=torch.float64) for v in (y_true, loc, scale))
    vm = value_map or ValueMap()

    def adaptive():  # the online updates read the misses on the head's scale, where the interval is symmetric
        lo, hi = adaptive_interval(vm.to_head(y), lo_, sc, q, calibration)
        return vm.to_value(lo), vm.to_value(hi)
    for q in levels:
        name = round(100 * q)
        kinds = [(f"coverage_{name}", lambda: interval(lo_, sc, q, calibration, vm)),
                 (f"cauchy_coverage_{name}", lambda: interval(lo_, sc, q, None, vm))]
        if calibration:
            kinds.append((f"aci_coverage_{name}", adaptive))
        for key, make in kinds:
            if not len(y):
                out[key] = None
                continue
            lo, hi = make()
            out[key] = float(((y >= lo) & (y <= hi)).double().mean())
            if name == 90 and key != f"cauchy_coverage_{name}":
                out[key.replace("coverage", "winkler")] = float(winkler(y, lo, hi, q).mean())
    return out


def baseline_metrics(targets: Sequence[float], previous: Sequence[float],
                     constant_value: float | None) -> dict[str, Any]:
    """MAE / median absolute error of the constant (`constant_value`) and persistence
    (`previous`) predictors of `targets`; empty dict without targets."""
    if not targets:
        return {}
    out: dict[str, Any] = {"baseline_examples": len(targets)}
    if constant_value is not None:
        err = [abs(t - constant_value) for t in targets]
        out["baseline_constant_mae"] = sum(err) / len(err)
        out["baseline_constant_median_ae"] = _median(err)
    if previous:
        err = [abs(t - p) for t, p in zip(targets, previous)]
        out["baseline_persistence_mae"] = sum(err) / len(err)
        out["baseline_persistence_median_ae"] = _median(err)
    return out


def train_median(values: Iterable[float]) -> float | None:
    """The constant baseline's prediction: the median of the train split's targets."""
    vals = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    return _median(vals)


#: the batch keys `CausalModel.forward` takes (position_ids: packed rows, `data.packing`)
MODEL_INPUTS = ("input_ids", "numeric_values", "attention_mask", "labels", "label_values", "position_ids")


@torch.no_grad()
def accumulate(model, batches: Iterable[Mapping[str, Any]], accumulator: MetricAccumulator | None = None, *,
               device: torch.device | str | None = None) -> MetricAccumulator:
    """Run `model` (a CausalModel, possibly wrapped) on collated `batches` (dicts with at least
    input_ids and labels, as `NumericCollator` builds them) in eval mode (the previous mode is
    restored) and add them to `accumulator` (a new one by default), which is returned."""
    inner = unwrap_model(model)
    acc = accumulator or MetricAccumulator(inner.num_token_id, inner.causal_config.reg_weight,
                                           calibration=inner.causal_config.value_calibration)
    device = torch.device(device) if device is not None else inner.input_device
    was_training = model.training
    model.eval()
    try:
        for batch in batches:
            batch = {k: (v.to(device) if isinstance(v, Tensor) else v) for k, v in batch.items()}
            out = model(**{k: batch[k] for k in MODEL_INPUTS if k in batch})
            with whole_root_parameters(model):  # FSDP1: W_cls whole for the token scores
                acc.update(inner, out, batch)
    finally:
        model.train(was_training)
    return acc


def evaluate(model, batches: Iterable[Mapping[str, Any]], *, constant_value: float | None = None,
             device: torch.device | str | None = None, return_predictions: bool = False):
    """Metrics of `model` on collated `batches` (see `accumulate`). `constant_value`: the
    constant baseline's prediction (`train_median` of the train targets). Returns the metrics
    dict (and `MetricAccumulator.predictions()` with ``return_predictions=True``)."""
    acc = accumulate(model, batches, device=device)
    metrics = acc.compute(constant_value)
    return (metrics, acc.predictions()) if return_predictions else metrics


def evaluate_dataset(model, dataset, pad_token_id: int, *, batch_size: int = 8,
                     train_targets: Iterable[float] | None = None, return_predictions: bool = False):
    """Convenience: evaluate a tokenized dataset (features of `data.tokenize_dataset`, plus the
    optional ``target`` / ``previous`` columns) in order. `train_targets`: the train split's
    targets, for the constant baseline."""
    collate = NumericCollator(pad_token_id)
    keep = [c for c in (*MODEL_INPUTS, "target", "previous") if c in dataset.column_names]
    ds = dataset.select_columns(keep)
    batches = (collate([ds[j] for j in range(i, min(i + batch_size, len(ds)))]) for i in range(0, len(ds), batch_size))
    constant = train_median(train_targets) if train_targets is not None else None
    return evaluate(model, batches, constant_value=constant, return_predictions=return_predictions)


#: how the tables (`format_metrics_table`, the demo's before / after table) name each metric
TABLE_ROWS = tuple((key, METRIC_LABELS[key]) for key in (
    "loss", "loss_cls", "loss_reg", "accuracy", "num_precision", "num_recall", "num_f1", "perplexity",
    "coverage_50", "coverage_80", "coverage_90", "coverage_95", "cauchy_coverage_50", "cauchy_coverage_90",
    "aci_coverage_50", "aci_coverage_90"))


def format_value(v) -> str:
    """A metric as a table shows it: "n/a" for None, an int as is, else 4 significant digits."""
    if v is None:
        return "n/a"
    if isinstance(v, int):
        return str(v)
    return f"{v:.4g}"


def format_metrics_table(metrics: Mapping[str, Any], title: str = "validation") -> str:
    """A markdown table of the metrics with the baselines beside the model's value errors."""
    fmt = format_value
    lines = [f"| metric ({title}) | value |", "| --- | --- |"]
    for key, label in TABLE_ROWS:
        if key in metrics:
            lines.append(f"| {label} | {fmt(metrics[key])} |")
    lines += ["", "| value prediction at <NUM> targets | MAE | median AE |", "| --- | --- | --- |",
              f"| causal adapter (loc_Y), n={metrics.get('num_targets', 0)} | {fmt(metrics.get('value_mae'))} | "
              f"{fmt(metrics.get('value_median_ae'))} |"]
    if "baseline_examples" in metrics:
        n = metrics["baseline_examples"]
        if "baseline_constant_mae" in metrics:
            lines.append(f"| constant baseline (train median), n={n} | {fmt(metrics['baseline_constant_mae'])} | "
                         f"{fmt(metrics['baseline_constant_median_ae'])} |")
        if "baseline_persistence_mae" in metrics:
            lines.append(f"| persistence baseline (previous value), n={n} | "
                         f"{fmt(metrics['baseline_persistence_mae'])} | "
                         f"{fmt(metrics['baseline_persistence_median_ae'])} |")
    return "\n".join(lines)
