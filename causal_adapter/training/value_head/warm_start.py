"""The warm start of the value head (what a run does before step 1, and again on the final features): the
value units and decimals from the training targets, then the head fitted in closed form on the model's own
features at its <NUM> targets.

* `fit_value_units`: the value units Y = value_loc + value_scale * Y' from the training targets
  (median and IQR / 1.349, the normal-consistent robust spread), so the head predicts O(1)
  numbers: raw-unit regression with b_reg = 0 could not reach sunspots' median (39) in 300 steps.
* `value_decimals`: the most decimals the training targets are written with (generated values
  are shown that way).
* `ridge_warm_start`: the regression head from the model's own loc_U and the row's recent numbers at the positions
  that predict a <NUM> target (a linear probe, then fine-tuning: "LP-FT"): loc_U centred there
  (`center_abduction`, exact for every token score); the head's inputs chosen on held-out error
  (`choose_head_inputs`); a ridge / robust fit (`linear.fit_linear_head`); with the per-row scale, a log-linear
  width (`linear.fit_log_scale`) and the out-of-depth statistics (`fit_depth`); then the per-row units when they
  win (`row_head.choose_row_units`, `correction.add_correction`, `row_head.add_row_scale`). docs/values.md has the
  validation figures behind each default. Measured before: the information about the value sits in low-variance
  directions of the final-norm features, where Adam from a random w_reg needs far more steps than a training run
  has (sunspots, frozen tiny base: MAE 48 after 3000 Adam steps vs 31 for the warm start).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import torch
from torch import Tensor

from ...config import BF16_MAX_SHIFT
from ...modeling.series import series_log_rows
from ...numbers import format_number
from ...records import value_targets
from ...saving.fsdp import whole_root_parameters
from ...saving.unwrap import unwrap_causal_model
from .choice import Scored, choose_recent_count, one_standard_error_choice, score_diffs
from .correction import add_correction, fixed_units_correction
from .linear import LOSSES, fit_linear_head, fit_log_scale, penalty_score, recent_range
from .row_head import add_row_scale, choose_row_units, set_row_head
from .summary import LogSummary

#: loss of the value head's fit: 'auto' = least squares unless a robust one of LOSSES wins on validation, per fit
#: (docs/values.md); 'cauchy', 'huber', 'tukey' or 'squared' fix it
ROBUST_LOSS = "auto"


@dataclass
class DepthStats:
    """The out-of-depth statistics of the training features (`fit_depth`; `ActionHead.set_depth` loads them)."""
    mean: Tensor
    basis: Tensor
    weight: Tensor
    resid: Tensor
    ref: Tensor


@dataclass
class RowUnitsSummary(LogSummary):
    """`HeadFitSummary.row`: the per-row units' head (`row_head.RowHeadFit`). units_score / adapter_units_score: the
    held-out scale-free errors of these units and of the adapter's (None: not measured, still printed);
    width_power: a of the width; row_net ('kept' / 'not kept'), row_net_mae, row_linear_mae: the nonlinear
    correction's validation MAE against the linear head's, in row units (None: not tried); row_scale: the log-width
    ('kept' / 'not kept'; None: not tried)."""
    kept_none = ("units_score", "adapter_units_score")
    units_score: float | None
    adapter_units_score: float | None
    width_power: float
    row_net: str | None = None
    row_net_mae: float | None = None
    row_linear_mae: float | None = None
    row_scale: str | None = None


@dataclass
class HeadFitSummary(LogSummary):
    """What `fit_head` fitted, for the log (`as_dict`: the "value head:" line's keys). rows: training rows;
    inputs: what the head reads; loss, ridge_lambda, chosen_on: the linear fit's loss, penalty and what chose it;
    w_norm, bf16_shift (value units), loo_mae (head units x head_scale), finite: of the first linear fit;
    w_recent_norm: the weights on the recent values (None: the head reads none); units: the per-row rule, or
    'adapter'; row: the per-row head (None in the adapter's units); scale_lambda, scale_w_norm, depth: the
    adapter-units log-width and the out-of-depth statistics (None: no per-row scale)."""
    rows: int
    inputs: str
    loss: str
    ridge_lambda: float
    chosen_on: str
    w_norm: float
    bf16_shift: float
    loo_mae: float
    finite: bool
    w_recent_norm: float | None = None
    units: str = "adapter"
    row: RowUnitsSummary | None = None
    scale_lambda: float | None = None
    scale_w_norm: float | None = None
    depth: str | None = None


def fit_value_units(values: Sequence[float], floor: float = 1e-6) -> tuple[float, float]:
    """(median, max(IQR / 1.349, floor-ish)) of `values`; the spread falls back to the mean
    absolute deviation from the median, then to max(|median|, 1) * 1e-3, for degenerate data."""
    v = torch.as_tensor(list(values), dtype=torch.float64)
    v = v[torch.isfinite(v)]
    if v.numel() == 0:
        raise ValueError("no finite <NUM> target in the training data: cannot fit the value units; "
                         "set CausalAdapterConfig(value_loc=..., value_scale=...)")
    loc = float(v.median())
    q = torch.quantile(v, torch.tensor([0.25, 0.75], dtype=torch.float64))
    scale = float(q[1] - q[0]) / 1.349
    if not scale > 0:
        scale = float((v - loc).abs().mean())
    if not scale > 0:
        scale = max(abs(loc), 1.0) * 1e-3
    return loc, max(scale, floor)


def value_decimals(values: Iterable[float], max_decimals: int = 6) -> int:
    """The most decimals of the canonical text of `values` (at most `max_decimals`)."""
    most = 0
    for v in values:
        text = format_number(float(v))
        if "e" in text.lower():
            return max_decimals
        if "." in text:
            most = max(most, len(text.split(".", 1)[1]))
    return min(most, max_decimals)


def num_label_features(model, batches: Iterable[Mapping[str, Tensor]], device, max_rows: int = 8192
                       ) -> tuple[Tensor, Tensor, Tensor]:
    """(loc_U [n, C] float64, targets [n] float64, the recent values the head reads there [n, K] float64, raw,
    NaN = none; K = 0 without) at the positions that predict a <NUM> label. `model`: the CausalModel or the
    module whose forward runs it (an FSDP1 root unit)."""
    return label_rows(model, batches, device, max_rows)[:3]


def label_rows(model, batches: Iterable[Mapping[str, Tensor]], device, max_rows: int = 8192
               ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`num_label_features`, and [n] bool: the rows of a positive series of the adapter's `value_series` (those a
    "series" head tells on log y: `modeling.series.series_log_rows`)."""
    inner = unwrap_causal_model(model)
    num_token_id, table = inner.num_token_id, inner.causal_config.value_series
    feats, targets, recents, logs, n = [], [], [], [], 0
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for batch in batches:
                labels = batch["labels"].to(device)
                out = model(batch["input_ids"].to(device), batch["numeric_values"].to(device),
                            batch["attention_mask"].to(device))
                pos = value_targets(batch["input_ids"].to(device), labels, num_token_id)[:, 1:]  # not the labels
                at = pos.to(out.loc_U.device)  # heads may sit elsewhere
                feats.append(out.loc_U[:, :-1][at].double().cpu())
                if out.recent is not None:
                    recents.append(out.recent[:, :-1][at].double().cpu())
                values = batch["label_values"] if "label_values" in batch else batch["numeric_values"]
                targets.append(values.to(device)[:, 1:][pos].double().cpu())
                logs.append(series_log_rows(batch["input_ids"], batch["numeric_values"], num_token_id, table,
                                            batch["attention_mask"])[:, 1:][pos.cpu()])
                n += int(pos.sum())
                if n >= max_rows:
                    break
    finally:
        model.train(was_training)
    if not feats:
        empty = torch.zeros(0, 0, dtype=torch.float64)
        return empty, torch.zeros(0, dtype=torch.float64), empty, torch.zeros(0, dtype=torch.bool)
    X = torch.cat(feats)[:max_rows]
    R = torch.cat(recents)[:max_rows] if recents else torch.zeros(X.shape[0], 0, dtype=torch.float64)
    return X, torch.cat(targets)[:max_rows], R, torch.cat(logs)[:max_rows]


def fit_depth(X: Tensor, rank: int, rel_eps: float = 1e-3) -> DepthStats:
    """Statistics of the training features X [n, C] for the out-of-depth width: with x~ = x - mean,
    d2(x) = resid |x~|^2 + sum_k weight_k (basis_k . x~)^2 is the Mahalanobis distance under the
    covariance's top `rank` directions plus an isotropic rest (both regularised by rel_eps x the mean
    variance), and ref = its largest value on the training rows. Tensors: mean [C], basis [rank, C],
    weight [rank], resid [1], ref [1] (zero rows pad the basis when n - 1 < rank): a `DepthStats`."""
    n, C = X.shape
    mean = X.mean(0)
    _, S, Vh = torch.linalg.svd((X - mean) / math.sqrt(max(n - 1, 1)), full_matrices=False)
    eig = S ** 2
    k = min(rank, eig.numel())
    reg = rel_eps * float(eig.sum()) / C + 1e-30
    rest = (float(eig.sum()) - float(eig[:k].sum())) / max(C - k, 1)
    resid = 1.0 / (rest + reg)
    basis = torch.zeros(rank, C, dtype=X.dtype)
    weight = torch.zeros(rank, dtype=X.dtype)
    basis[:k], weight[:k] = Vh[:k], 1.0 / (eig[:k] + reg) - resid
    Xc = X - mean
    d2 = resid * (Xc ** 2).sum(-1) + ((Xc @ basis.T) ** 2) @ weight
    return DepthStats(mean, basis, weight, torch.tensor([resid], dtype=X.dtype),
                      torch.tensor([max(float(d2.max()), 1e-30)], dtype=X.dtype))


def center_abduction(model, mean: Tensor) -> Tensor:
    """Shift loc_U by -mean [C] (b_loc -= mean) and every token score back (b_cls += W_cls mean, the <NUM>
    row's own when it trains): loc_S and the sampled scores are unchanged, while loc_U at the <NUM>
    positions becomes centred, so rounding it to bf16 (relative error 2^-9 of |loc_U|) no longer
    swamps the small variations of large-mean features that carry the value. Returns `mean`."""
    act, loc = model.action, model.abduction.loc
    with torch.no_grad():
        m = mean.to(device=loc.bias.device, dtype=loc.bias.dtype)
        loc.bias.sub_(m)
        W = model.W_cls
        m32 = m.to(W.device, torch.float32)
        shift = torch.cat([W[i:i + 16384].float() @ m32 for i in range(0, W.shape[0], 16384)]).to(act.b_cls)
        if act.num_row is not None:
            shift[act.num_token_id] = act.num_row @ m.to(act.num_row)
        act.b_cls.add_(shift)
    return mean


#: the value head's input sets `choose_head_inputs` picks from: (name, reads loc_U, reads the recent values,
#: penalty gain of the recent values), the reference first. A least-squares head on a random base's loc_U
#: (thousands of near-collinear columns) fits the training months and extrapolates badly; on the recent values
#: alone it is an autoregression (co2, validation / test MAE 0.34 / 0.40 vs 0.59 / 2.12 for both under one
#: penalty), or a linear regression on the prompt's numbers
HEAD_INPUTS = (("recent", False, True, 1.0), ("loc_U", True, False, 1.0), ("loc_U+recent/100", True, True, 10.0),
               ("loc_U+recent", True, True, 1.0))


@dataclass
class HeadInputs:
    """Which inputs the value head reads (`choose_head_inputs`): its name (e.g. ``loc_U+recent[:16]``), the kept
    columns of [loc_U, recent values] [C + K] bool, the recent values' penalty gain."""
    name: str
    keep: Tensor
    gain: float


def choose_head_inputs(F: Tensor, t: Tensor, F_val: Tensor | None, t_val: Tensor | None, C: int,
                       max_shift: float) -> HeadInputs:
    """Which inputs the value head reads, chosen per fit on held-out error: F [n, C + K] = loc_U, then the K
    recent values. Each candidate set is fitted by least squares (its own penalty) and scored by `penalty_score`
    (validation and leave-one-out MAE); a reference is kept unless another set is better by more than one
    standard error (`choice.one_standard_error_choice`: on a few dozen validation rows a smaller MAE alone is mostly
    noise, and the C-column sets are the ones that then extrapolate badly). Two steps:

    1. How many recent values: the K // 4 most recent, then K // 2, then all K, each step taken only when it
       beats the current choice by more than one standard error (`choice.choose_recent_count`). K is one default
       for every corpus: a series whose prompts label each value with a number (a year, or year and month) fills
       half or more of the slots with labels, and on a short series the older values may be noise.
    2. Which set of `HEAD_INPUTS` with those recent values: the recent values alone (the reference), loc_U
       alone (the SPEC's head), loc_U + the recent values with their penalty divided by 100, or both.

    Without recent values (K = 0): loc_U."""
    k = F.shape[1] - C
    if not k:
        return HeadInputs("loc_U", torch.ones(C, dtype=torch.bool), 1.0)
    has_val = F_val is not None and t_val is not None and len(t_val) > 0

    def fit_set(name: str, use_u: bool, count: int, gain: float) -> Scored:
        keep = torch.cat([torch.full((C,), use_u), torch.arange(k) < count])
        fit = fit_linear_head(F[:, keep], t, F_val[:, keep] if has_val else None, t_val if has_val else None,
                              loss="squared", max_shift=max_shift, exact_columns=count, exact_gain=gain)
        val_errors = fit.abs_errors if has_val else None
        score = penalty_score(float(fit.loo.abs().mean()), None if val_errors is None else float(val_errors.mean()))
        return Scored(score, fit.loo, val_errors, (HeadInputs(name, keep, gain), count))

    chosen = choose_recent_count(lambda n: fit_set("recent", False, n, 1.0), k)
    count = chosen.what[1]
    label = "recent" if count == k else f"recent[:{count}]"
    # HEAD_INPUTS[0], the recent values alone, is the fit step 1 chose: reused as the reference
    reference = Scored(chosen.score, chosen.loo, chosen.val_errors, (HeadInputs(label, chosen.what[0].keep, 1.0), count))
    fits = [reference] + [fit_set(name.replace("recent", label), use_u, count if use_recent else 0, gain)
                          for name, use_u, use_recent, gain in HEAD_INPUTS[1:]]
    return one_standard_error_choice(fits, score_diffs, lambda f: f.score).what[0]


@dataclass
class WarmStartRows:
    """The rows the head is fitted on, at the positions that predict a <NUM> target: loc_U centred X [n, C], the
    targets y [n] (values), the recent values R [n, K] (raw, NaN = none); the same of the validation rows (None
    without them); log [n], log_val [n_val] bool: the rows of a positive series (`label_rows`; None: none), those
    a "series" head tells on log y. `gather_rows`."""
    X: Tensor
    y: Tensor
    R: Tensor
    X_val: Tensor | None = None
    y_val: Tensor | None = None
    R_val: Tensor | None = None
    log: Tensor | None = None
    log_val: Tensor | None = None


def gather_rows(model, batches: Iterable[Mapping[str, Tensor]], device, max_rows: int = 8192,
                val_batches: Iterable[Mapping[str, Tensor]] | None = None) -> WarmStartRows | None:
    """The model's own features at its <NUM> targets (`num_label_features`), loc_U centred there first
    (`center_abduction`: the model is changed, its token scores are not); None with fewer than 2 targets. `model`:
    as for `num_label_features`."""
    X, y, R, log = label_rows(model, batches, device, max_rows)
    if X.shape[0] < 2:
        return None
    X_val = y_val = R_val = log_val = None
    if val_batches is not None:
        X_val, y_val, R_val, log_val = label_rows(model, val_batches, device, max_rows)
    with whole_root_parameters(model):  # FSDP1: W_cls whole
        mean = center_abduction(unwrap_causal_model(model), X.mean(0))
    return WarmStartRows(X - mean, y, R, None if X_val is None else X_val - mean, y_val, R_val, log, log_val)


def ridge_warm_start(model, batches: Iterable[Mapping[str, Tensor]], device, max_rows: int = 8192,
                     val_batches: Iterable[Mapping[str, Tensor]] | None = None, loss: str = ROBUST_LOSS,
                     max_shift: float = BF16_MAX_SHIFT, losses: Sequence[str] = LOSSES,
                     row_rules: Sequence[str] = (), force_row_units: bool = False, row_correction: bool = True
                     ) -> HeadFitSummary | None:
    """`gather_rows`, then `fit_head` on them (its arguments). Returns a summary for the log, or None with fewer
    than 2 targets."""
    rows = gather_rows(model, batches, device, max_rows, val_batches)
    if rows is None:
        return None
    return fit_head(unwrap_causal_model(model), rows, loss=loss, max_shift=max_shift, losses=losses,
                    row_rules=row_rules, force_row_units=force_row_units, row_correction=row_correction)


def fit_head(inner, rows: WarmStartRows, *, loss: str = ROBUST_LOSS, max_shift: float = BF16_MAX_SHIFT,
             losses: Sequence[str] = LOSSES, row_rules: Sequence[str] = (), force_row_units: bool = False,
             row_correction: bool = True) -> HeadFitSummary:
    """Set the regression head from a robust ridge fit (`linear.fit_linear_head`) on `rows`, on the head's scale
    (`ActionHead.value_map`: the value, or log y) in its standardised units: w_reg, w_recent, b_reg; |b_noise_Y|
    (the median |LOO residual|, a Cauchy's scale) when the scale is independent; with a per-row scale also
    w_scale_Y, |b_noise_Y| from `linear.fit_log_scale` and the out-of-depth statistics (`fit_depth`; off, a factor
    of 1, when the head reads no loc_U). Penalties are chosen on the validation rows when given, else by
    leave-one-out, under the bf16 bound `max_shift` (inf: none); `losses`: the candidates of loss 'auto'.
    `row_rules`: per-row units to try (`row_head.choose_row_units`; `force_row_units`: the first rule,
    unconditionally), with the nonlinear correction when `row_correction` and it wins
    (`correction.add_correction`), then the log-width (`row_head.add_row_scale`); where no rule won, the same form
    in the adapter's units when its correction wins (`correction.fixed_units_correction`, rule "fixed"). A
    validation row whose value has no place on the head's scale (<= 0 for log) is left out. Returns a summary for
    the log (`HeadFitSummary`)."""
    act = inner.action
    vm = act.value_map
    # a "series" head: each row on its series' scale (log y for a positive series), always in per-row units
    log = rows.log if vm.series else None
    X, R, y = rows.X, rows.R, vm.rows(log).to_head(rows.y)
    t = (y - act.head_loc) / act.head_scale
    X_val = t_val = R_val = y_val = log_val = None
    if rows.X_val is not None:
        log_val = rows.log_val if vm.series else None
        y_val = vm.rows(log_val).to_head(rows.y_val)
        keep = torch.isfinite(y_val)
        X_val, R_val, y_val = rows.X_val[keep], rows.R_val[keep], y_val[keep]
        log_val = None if log_val is None else log_val[keep]
        t_val = (y_val - act.head_loc) / act.head_scale
    force_row_units = force_row_units or vm.series
    # the head's inputs: loc_U, then the recent values (standardised, exact: not rounded by the bf16 bound)
    C, k = X.shape[1], act.recent_values if R.shape[1] else 0  # R: the head's window, W >= K numbers
    F = torch.cat([X, act.standardized_recent(R)], 1)
    F_val = None if X_val is None else torch.cat([X_val, act.standardized_recent(R_val)], 1)
    inputs = choose_head_inputs(F, t, F_val, t_val, C, max_shift)
    keep = inputs.keep
    fit = fit_linear_head(F[:, keep], t, None if F_val is None else F_val[:, keep], t_val, loss=loss,
                          max_shift=max_shift, losses=losses, exact_columns=int(keep[C:].sum()),
                          exact_gain=inputs.gain).padded(keep)
    summary = HeadFitSummary(rows=int(X.shape[0]), inputs=inputs.name, loss=fit.loss, ridge_lambda=fit.lam,
                             chosen_on=fit.chosen_on, w_norm=float(fit.w.norm()), bf16_shift=fit.shift * act.head_scale,
                             loo_mae=float(fit.loo.abs().mean()) * act.head_scale,
                             finite=bool(math.isfinite(float(fit.w.abs().sum()))))
    scale = max(float(fit.loo.abs().median()), 1e-3)
    if k:
        summary.w_recent_norm = float(fit.w[C:].norm())
    has_val = X_val is not None
    row = choose_row_units(fit, F_val, R, y, R_val, y_val if has_val else None, act, row_rules, force_row_units,
                           loss=loss, losses=losses, max_shift=max_shift, X=X, X_val=X_val, log=log,
                           log_val=log_val) if k else None
    if row is not None and row_correction:
        row = add_correction(row, R, y, R_val, y_val if has_val else None, act, inner.causal_config.seed, X, X_val,
                             log, log_val)
        row = add_row_scale(row, R_val, y_val if has_val else None, act, X_val, log_val)
    elif row is None and k and row_correction and row_rules and not force_row_units:
        # no log-width in the adapter's units: its inputs' shape statistics (the row's step over the target's
        # unit) are near-constant columns there, and a log-linear fit on them extrapolates to inf
        row = fixed_units_correction(fit, F_val, R, y, R_val, y_val if has_val else None, act,
                                     inner.causal_config.seed, loss=loss, losses=losses, max_shift=max_shift, X=X,
                                     X_val=X_val)
    inner.set_row_units(None if row is None else row.rule, 0.0 if row is None else row.width_power)
    if row is not None:
        set_row_head(act, row)
        reads = "loc_U+" if row.w_loc is not None else ""
        summary.units, summary.inputs = row.rule, f"{reads}recent[:{row.recent_count}] in row units"
        summary.loss, summary.ridge_lambda, summary.bf16_shift = row.linear.loss, row.linear.lam, 0.0
        summary.w_recent_norm = float(row.linear.w.norm())
        summary.row = RowUnitsSummary(units_score=row.units_score, adapter_units_score=row.adapter_score,
                                      width_power=row.width_power)
        if row.net_mae is not None:  # the correction was tried: validation MAEs in row units
            summary.row.row_net = "kept" if row.net is not None else "not kept"
            summary.row.row_net_mae, summary.row.row_linear_mae = row.net_mae, row.linear_mae
        if row.scale_tried:
            summary.row.row_scale = "kept" if row.scale is not None else "not kept"
        return summary
    with torch.no_grad():
        act.w_reg.copy_(fit.w[:C].to(act.w_reg.dtype))
        act.b_reg.fill_(fit.b)
        if k:
            act.w_recent.copy_(fit.w[C:].to(act.w_recent.dtype))
            act.recent_range.copy_(recent_range(F[:, C:], R[:, :k]).to(act.recent_range))
        if act.w_scale_Y is not None:
            resid_val = None if t_val is None else t_val - (F_val @ fit.w + fit.b)
            sfit = fit_log_scale(X, fit.loo, X_val, resid_val)
            act.w_scale_Y.copy_(sfit.w.to(act.w_scale_Y.dtype))
            seen = X @ sfit.w
            act.log_scale_range.copy_(torch.stack([seen.min(), seen.max()]).to(act.log_scale_range))
            scale = math.exp(sfit.b)
            reads_u = bool(keep[:C].any())
            depth = fit_depth(X, act.depth_basis.shape[0])
            if not reads_u:  # the head reads no loc_U: loc_U's distance says nothing of its error
                depth = DepthStats(depth.mean, depth.basis, torch.zeros_like(depth.weight),
                                   torch.zeros_like(depth.resid), depth.ref)
            act.set_depth(depth)
            summary.scale_lambda, summary.scale_w_norm = sfit.lam, float(sfit.w.norm())
            summary.depth = "loc_U" if reads_u else "off"
        if act.b_noise_Y is not None:
            act.b_noise_Y.fill_(scale)
    return summary
