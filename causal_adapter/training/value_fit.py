"""Data-fitted starting point of the regression head (what `train()` does before step 1).

* `fit_value_units`: the value units Y = value_loc + value_scale * Y' from the training targets
  (median and IQR / 1.349, the normal-consistent robust spread), so the head predicts O(1)
  numbers: raw-unit regression with b_reg = 0 could not reach sunspots' median (39) in 300 steps.
* `value_decimals`: the most decimals the training targets are written with (generated values
  are shown that way).
* `ridge_warm_start`: the regression head from the model's own loc_U at the positions that predict
  a <NUM> target (a linear probe, then fine-tuning: "LP-FT"): loc_U centred there
  (`center_abduction`, exact for every token score), ridge on per-feature standardised features
  with the penalty chosen on the validation split and exact leave-one-out together (else leave-one-out) under an optional
  bf16-rounding bound (`fit_linear_head`), the loss (least squares, or a Huber / Cauchy M-estimate by
  IRLS) chosen per fit on validation by default, and, with
  the per-row scale, a log-linear width (`fit_log_scale`) and the out-of-depth statistics
  (`fit_depth`). docs/values.md has the validation figures behind each default. Measured before:
  the information about the value sits in low-variance directions of the final-norm features, where
  Adam from a random w_reg needs far more steps than a training run has (sunspots, frozen tiny base:
  MAE 48 after 3000 Adam steps vs 31 for the warm start).
"""
from __future__ import annotations

import math
from typing import Iterable, Mapping, Sequence

import torch
from torch import Tensor

from ..config import BF16_MAX_SHIFT
from ..modeling.row_net import net_inputs, row_net
from ..modeling.row_units import row_units, row_width
from ..numbers import format_number
from ..saving.fsdp import whole_root_parameters
from ..saving.unwrap import unwrap_causal_model
from .row_net_fit import MIN_ROWS, MIN_VALIDATION_ROWS, fit_row_net

#: ridge penalties tried, relative to the largest squared singular value of the centred features
RIDGE_GRID = tuple(10.0 ** (-k / 2) for k in range(0, 21))
#: IRLS iterations of a robust fit (per round; two rounds)
IRLS_ITERS = 30
#: losses a value head's fit can use (the order breaks ties of loss='auto')
LOSSES = ("squared", "huber", "cauchy", "tukey")
#: candidates of loss='auto' for a head that gradient training continues from (the warm start when W_loc,
#: LoRA or d train): no Tukey there. A head that gives the far rows weight 0 sent sunspots' W_loc training
#: astray at 40% shuffled targets (validation MAE of the final refit 31.5 vs 22.5; docs/values.md); the
#: final fit, with no training after it, chooses among all of LOSSES
WARM_START_LOSSES = ("squared", "huber", "cauchy")
#: Tukey bisquare's cut-off in robust sds (median |r| / 0.6745): rows beyond it get weight 0. 3, not the
#: textbook 4.685: on sunspots with 40% shuffled targets the MAD is inflated by the shuffled rows
#: (validation MAE 22.9 at 3 vs 25.2 at 4.685 and 37.6 at 2; docs/values.md)
TUKEY_C = 3.0
#: loss of the value head's fit: 'auto' = least squares unless a robust one of LOSSES wins on validation, per fit
#: (docs/values.md); 'cauchy', 'huber', 'tukey' or 'squared' fix it
ROBUST_LOSS = "auto"


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
    num_token_id = unwrap_causal_model(model).num_token_id
    feats, targets, recents, n = [], [], [], 0
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for batch in batches:
                labels = batch["labels"].to(device)
                out = model(batch["input_ids"].to(device), batch["numeric_values"].to(device),
                            batch["attention_mask"].to(device))
                pos = labels[:, 1:] == num_token_id
                at = pos.to(out.loc_U.device)  # heads may sit elsewhere
                feats.append(out.loc_U[:, :-1][at].double().cpu())
                if out.recent is not None:
                    recents.append(out.recent[:, :-1][at].double().cpu())
                values = batch["label_values"] if "label_values" in batch else batch["numeric_values"]
                targets.append(values.to(device)[:, 1:][pos].double().cpu())
                n += int(pos.sum())
                if n >= max_rows:
                    break
    finally:
        model.train(was_training)
    if not feats:
        empty = torch.zeros(0, 0, dtype=torch.float64)
        return empty, torch.zeros(0, dtype=torch.float64), empty
    X = torch.cat(feats)[:max_rows]
    R = torch.cat(recents)[:max_rows] if recents else torch.zeros(X.shape[0], 0, dtype=torch.float64)
    return X, torch.cat(targets)[:max_rows], R


def standardize(X: Tensor, weights: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(mean [C], sd [C]) of the rows of X [n, C] (weighted when `weights` [n] is given); an sd below
    1e-6 of the median sd is floored there (a constant feature must not get an unbounded weight)."""
    wts = torch.ones(X.shape[0], dtype=X.dtype) if weights is None else weights
    wts = wts / wts.sum()
    mean = wts @ X
    sd = (wts @ (X - mean) ** 2).sqrt()
    floor = max(float(sd.median()) * 1e-6, 1e-12)
    return mean, sd.clamp_min(floor)


def bf16_shift(X: Tensor, w: Tensor, exact_columns: int = 0) -> float:
    """Largest |change of X @ w| over the rows of X [n, C] when X is rounded to bfloat16 (the
    head's conditioning: loc_U of a bf16 model carries that rounding), the last `exact_columns` (the
    recent values, which reach the head in full precision) kept as they are."""
    if X.numel() == 0:
        return 0.0
    rounded = X.to(torch.bfloat16).to(X.dtype)
    if exact_columns:
        rounded[:, -exact_columns:] = X[:, -exact_columns:]
    return float(((rounded - X) @ w).abs().max())


def _ridge_path(Xs: Tensor, t: Tensor, weights: Tensor, lams: Sequence[float]):
    """Weighted ridge on standardised features Xs [n, C] for every penalty of `lams`; yields (lam, w_s [C], intercept,
    LOO residuals [n]). Exact LOO residuals of the weighted problem, from one SVD."""
    wn = weights / weights.sum()
    mx, mt = wn @ Xs, wn @ t
    root = weights.sqrt()
    U, S, Vh = torch.linalg.svd(root[:, None] * (Xs - mx), full_matrices=False)
    proj = U.T @ (root * (t - mt))
    for lam in lams:
        w = Vh.T @ (S / (S ** 2 + lam) * proj)
        resid = t - mt - (Xs - mx) @ w
        hat = (U ** 2) @ (S ** 2 / (S ** 2 + lam)) + wn
        yield lam, w, float(mt - mx @ w), resid / (1.0 - hat).clamp_min(1e-12)


def robust_weights(resid: Tensor, loss: str) -> Tensor:
    """IRLS weights of the residuals [n] for an M-estimate: 'cauchy' 1 / (1 + (r / s)^2) with s the
    median |r| (a Cauchy's scale), 'huber' min(1, 1.345 s / |r|) with s = median |r| / 0.6745,
    'tukey' (1 - (r / (TUKEY_C s))^2)^2 inside TUKEY_C s and 0 beyond (redescending: a shuffled target
    far from the fit stops pulling), 'squared' ones."""
    s = max(float(resid.abs().median()), 1e-12)
    if loss == "cauchy":
        return 1.0 / (1.0 + (resid / s) ** 2)
    if loss == "huber":
        return (1.345 * s / 0.6745 / resid.abs().clamp_min(1e-300)).clamp(max=1.0)
    if loss == "squared":
        return torch.ones_like(resid)
    if loss == "tukey":
        u = (resid / (TUKEY_C * s / 0.6745)).clamp(-1.0, 1.0)
        return (1.0 - u ** 2) ** 2
    raise ValueError(f"unknown robust loss {loss!r}; use 'cauchy', 'huber', 'tukey' or 'squared'")


def _choose(path, score_fn, X: Tensor, sd: Tensor, max_shift: float, X_val: Tensor | None, exact_columns: int = 0):
    """The (score, lam, w_s, b, loo) of `path` with the smallest score_fn(w_raw, b, loo) among the
    penalties whose raw weights move X @ w by at most `max_shift` under bf16 rounding (on the training
    and validation rows); the most penalised entry when none qualifies."""
    best, first = None, None
    for lam, w, b, loo in path:
        w_raw = w / sd
        item = (score_fn(w_raw, b, loo), lam, w, b, loo)
        first = first or item
        rows = X if X_val is None else torch.cat([X, X_val])
        if bf16_shift(rows, w_raw, exact_columns) > max_shift:
            continue
        if best is None or item[0] < best[0]:
            best = item
    return best or first


def _standardized(X: Tensor) -> tuple[Tensor, Tensor, Tensor, float]:
    """(mean [C], sd [C], the standardised X [n, C], the largest squared singular value of its centred
    form: the unit of the relative ridge penalties)."""
    mean, sd = standardize(X)
    Xs = (X - mean) / sd
    return mean, sd, Xs, float(torch.linalg.matrix_norm(Xs - Xs.mean(0), ord=2) ** 2) or 1.0


def fit_linear_head(X: Tensor, t: Tensor, X_val: Tensor | None = None, t_val: Tensor | None = None, *,
                    loss: str = "cauchy", grid: Sequence[float] = RIDGE_GRID, max_shift: float = BF16_MAX_SHIFT,
                    iters: int = IRLS_ITERS, losses: Sequence[str] = LOSSES, exact_columns: int = 0,
                    exact_gain: float = 1.0) -> dict:
    """Robust ridge regression t [n] ~ X [n, C] on per-feature standardised features, folded back to
    raw units (a plain linear head). The penalty (relative to the largest squared singular value of
    the standardised features) is the grid entry with the smallest mean of the validation MAE (X_val, t_val)
    and the mean |LOO residual| (`penalty_score`), else of the latter alone, among those whose weights keep
    the bf16-rounding shift <= `max_shift` (the last `exact_columns` of X are not rounded; `exact_gain` divides
    their penalty by its square).
    loss != 'squared' ('huber', 'cauchy', 'tukey'): IRLS M-estimate started from the ridge solution, then the penalty is chosen again
    under the final weights and IRLS runs once more. loss 'auto': each of `losses` is fitted so; least
    squares is kept unless a robust fit's validation MAE (else mean |LOO residual|) is smaller by more
    than one standard error of the paired difference (`_one_standard_error_choice`).

    Returns {"w": [C], "b": float, "lam": relative penalty, "loo": LOO residuals [n], "weights": [n],
    "shift": bf16 shift, "chosen_on": str, "loss": the loss used, "score": its selection score,
    "scores": {loss: score} (the candidates'), "abs_errors": [n_val] (or [n]) held-out absolute errors}."""
    if loss == "auto":
        fits = [fit_linear_head(X, t, X_val, t_val, loss=name, grid=grid, max_shift=max_shift, iters=iters,
                                exact_columns=exact_columns, exact_gain=exact_gain) for name in losses]
        best = _one_standard_error_choice(fits)
        return {**best, "scores": {f["loss"]: f["score"] for f in fits}}
    robust_weights(t[:1], loss)  # an unknown loss fails here, before any work
    mean, sd, Xs, unit = _standardized(X)
    if exact_columns and exact_gain != 1.0:  # the last columns scaled up: their penalty is lam / gain^2
        sd = sd.clone()
        sd[-exact_columns:] /= exact_gain
        Xs = (X - mean) / sd
    has_val = X_val is not None and t_val is not None and len(t_val) > 0

    def score(w_raw, b, loo):
        val_mae = float((X_val @ w_raw + b - mean @ w_raw - t_val).abs().mean()) if has_val else None
        return penalty_score(float(loo.abs().mean()), val_mae)

    weights = torch.ones_like(t)
    rounds = 1 if loss == "squared" else 2
    for _ in range(rounds):
        _, lam, w, b, loo = _choose(_ridge_path(Xs, t, weights, [r * unit for r in grid]), score, X, sd,
                                    max_shift, X_val if has_val else None, exact_columns)
        if loss == "squared":
            break
        for _ in range(iters):  # IRLS at this penalty
            resid = t - b - Xs @ w
            weights = robust_weights(resid, loss).clamp_min(1e-12)
            _, w, b, loo = next(_ridge_path(Xs, t, weights, [lam]))
    w_raw = w / sd
    abs_errors = (X_val @ w_raw + b - mean @ w_raw - t_val).abs() if has_val else loo.abs()
    return {"w": w_raw, "b": b - float(mean @ w_raw), "lam": lam / unit, "loo": loo, "weights": weights,
            "shift": bf16_shift(X, w_raw, exact_columns), "chosen_on": "validation+leave-one-out" if has_val else "leave-one-out",
            "loss": loss, "score": float(abs_errors.mean()), "scores": {loss: float(abs_errors.mean())},
            "abs_errors": abs_errors}


def penalty_score(loo_mae: float, val_mae: float | None) -> float:
    """What a ridge penalty is chosen by: the mean of the validation MAE and the mean |LOO residual| (the
    latter alone without validation rows). Validation alone is a few dozen rows whose noise picks the
    penalty; leave-one-out alone misses a shift between training and validation (time-ordered corpora).
    Measured by choosing on one half of the validation rows and scoring on the other half (docs/values.md,
    "Choosing the penalty"): MAE of both / of validation only, income -> food 0.88, co2 0.92, nile 1.02."""
    return loo_mae if val_mae is None else 0.5 * (loo_mae + val_mae)


def _abs_error_gap(ref: dict, other: dict) -> tuple[float, float]:
    """(how much smaller `other`'s held-out absolute errors [n] are than `ref`'s on average, its standard error)."""
    diff = ref["abs_errors"] - other["abs_errors"]
    return float(diff.mean()), float(diff.std() / math.sqrt(len(diff))) if len(diff) > 1 else math.inf


def _one_standard_error_choice(fits: Sequence[dict], gap=_abs_error_gap) -> dict:
    """The first fit (the reference: least squares among the losses, the recent values alone among the head's
    inputs) unless a later one is better by more than one standard error of the paired difference (`gap`: of
    the held-out absolute errors, or `_score_gap`); among those, the smallest score (the one-standard-error
    rule: on a few dozen validation rows a smaller MAE alone is mostly noise)."""
    better = []
    for f in fits[1:]:
        drop, se = gap(fits[0], f)
        if drop > se:
            better.append(f)
    return min(better, key=lambda f: f["score"]) if better else fits[0]


def fit_log_scale(X: Tensor, resid: Tensor, X_val: Tensor | None = None, resid_val: Tensor | None = None, *,
                  grid: Sequence[float] = RIDGE_GRID, max_shift: float = 0.05) -> dict:
    """A per-row Cauchy scale s(x) = exp(w . x + b) from residuals [n] (out-of-sample: LOO) of a location
    head: ridge of log|r| on standardised X (for a Cauchy, E log|r| = log s exactly). The penalty is
    the one with the smallest Cauchy NLL of the validation residuals `resid_val` (else of the LOO
    log-residuals' predictions); a constant scale (w = 0, lam = inf) is kept when its NLL is no worse. Returns {"w": [C], "b": float, "lam": relative penalty, "nll": float}."""
    floor = max(float(resid.abs().median()) * 1e-3, 1e-12)
    target = resid.abs().clamp_min(floor).log()
    mean, sd, Xs, unit = _standardized(X)
    has_val = X_val is not None and resid_val is not None and len(resid_val) > 0

    def score(w_raw, b, loo):
        if has_val:
            log_s, r = X_val @ w_raw + b - mean @ w_raw, resid_val
        else:
            log_s, r = target - loo, resid
        return float((log_s + math.log(math.pi) + torch.log1p((r / log_s.exp()) ** 2)).mean())

    nll, lam, w, b, _ = _choose(_ridge_path(Xs, target, torch.ones_like(target), [r * unit for r in grid]),
                                score, X, sd, max_shift, X_val if has_val else None)
    w_raw = w / sd
    # a constant width (log |r| 's mean, LOO-exact) competes on the same held-out NLL: keep it when it wins
    n = len(target)
    const_loo = target - (target.sum() - target) / max(n - 1, 1)
    const_nll = score(torch.zeros_like(w_raw), float(target.mean()), const_loo)
    if const_nll <= nll:
        return {"w": torch.zeros_like(w_raw), "b": float(target.mean()), "lam": math.inf, "nll": const_nll}
    return {"w": w_raw, "b": b - float(mean @ w_raw), "lam": lam / unit, "nll": nll}


def fit_depth(X: Tensor, rank: int, rel_eps: float = 1e-3) -> dict:
    """Statistics of the training features X [n, C] for the out-of-depth width: with x~ = x - mean,
    d2(x) = resid |x~|^2 + sum_k weight_k (basis_k . x~)^2 is the Mahalanobis distance under the
    covariance's top `rank` directions plus an isotropic rest (both regularised by rel_eps x the mean
    variance), and ref = its largest value on the training rows. Tensors: mean [C], basis [rank, C],
    weight [rank], resid [1], ref [1] (zero rows pad the basis when n - 1 < rank)."""
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
    return {"mean": mean, "basis": basis, "weight": weight, "resid": torch.tensor([resid], dtype=X.dtype),
            "ref": torch.tensor([max(float(d2.max()), 1e-30)], dtype=X.dtype)}


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


def _score_gap(ref: dict, other: dict) -> tuple[float, float]:
    """(how much smaller `other`'s `penalty_score` is than `ref`'s, its standard error): the paired differences of
    absolute errors, validation and leave-one-out each averaged, as `penalty_score` weighs them."""
    parts = [ref["loo"].abs() - other["loo"].abs()]
    if ref["val_errors"] is not None:
        parts.append(ref["val_errors"] - other["val_errors"])
    means = [float(d.mean()) for d in parts]
    ses = [float(d.std() / math.sqrt(len(d))) if len(d) > 1 else math.inf for d in parts]
    return sum(means) / len(parts), math.sqrt(sum(se * se for se in ses)) / len(parts)


def choose_head_inputs(F: Tensor, t: Tensor, F_val: Tensor | None, t_val: Tensor | None, C: int,
                       max_shift: float) -> tuple[str, Tensor, float]:
    """Which inputs the value head reads, chosen per fit on held-out error: F [n, C + K] = loc_U, then the K
    recent values. Each candidate set is fitted by least squares (its own penalty) and scored by `penalty_score`
    (validation and leave-one-out MAE); a reference is kept unless another set is better by more than one
    standard error (the one-standard-error rule, as for the loss: on a few dozen validation rows a smaller MAE
    alone is mostly noise, and the C-column sets are the ones that then extrapolate badly). Two steps:

    1. How many recent values: the K // 4 most recent, then K // 2, then all K, each step taken only when it
       beats the current choice by more than one standard error. K is one default for every corpus: a series
       whose prompts label each value with a number (a year, or year and month) fills half or more of the
       slots with labels, and on a short series the older values may be noise.
    2. Which set of `HEAD_INPUTS` with those recent values: the recent values alone (the reference), loc_U
       alone (the SPEC's head), loc_U + the recent values with their penalty divided by 100, or both.

    Returns (name, e.g. ``loc_U+recent[:16]``, the kept columns [C + K] as a mask, the recent values' penalty
    gain). Without recent values (K = 0): loc_U."""
    k = F.shape[1] - C
    if not k:
        return "loc_U", torch.ones(C, dtype=torch.bool), 1.0
    has_val = F_val is not None and t_val is not None and len(t_val) > 0

    def fit_set(name: str, use_u: bool, width: int, gain: float) -> dict:
        keep = torch.cat([torch.full((C,), use_u), torch.arange(k) < width])
        fit = fit_linear_head(F[:, keep], t, F_val[:, keep] if has_val else None, t_val if has_val else None,
                              loss="squared", max_shift=max_shift, exact_columns=width, exact_gain=gain)
        val_errors = fit["abs_errors"] if has_val else None
        score = penalty_score(float(fit["loo"].abs().mean()), None if val_errors is None else float(val_errors.mean()))
        return {"name": name, "keep": keep, "gain": gain, "score": score, "loo": fit["loo"], "val_errors": val_errors,
                "width": width}

    chosen = choose_recent_width(lambda w: fit_set("recent", False, w, 1.0), k)
    width = chosen["width"]
    label = "recent" if width == k else f"recent[:{width}]"
    # HEAD_INPUTS[0], the recent values alone, is the fit step 1 chose: reused as the reference
    fits = [{**chosen, "name": label}] + [fit_set(name.replace("recent", label), use_u, width if use_recent else 0, gain)
                                         for name, use_u, use_recent, gain in HEAD_INPUTS[1:]]
    best = _one_standard_error_choice(fits, gap=_score_gap)
    return best["name"], best["keep"], best["gain"]


def choose_recent_width(fit_width, k: int) -> dict:
    """Step 1 of `choose_head_inputs`: `fit_width(w)` (a fit with `penalty_score`'s "score" and held-out
    errors) for the K // 4, K // 2, then all K most recent values, each step taken only when it beats the
    current choice by more than one standard error."""
    chosen = None
    for w in sorted({max(k // 4, 1), max(k // 2, 1), k}):  # more values only when they earn it, one step at a time
        f = fit_width(w)
        drop, se = _score_gap(chosen, f) if chosen is not None else (math.inf, 0.0)
        if drop > se:
            chosen = f
    return chosen


def fit_row_head(R: Tensor, y: Tensor, R_val: Tensor | None, y_val: Tensor | None, rule: str, act, *,
                 loss: str, losses: Sequence[str], max_shift: float) -> dict:
    """The value head in per-row units (`modeling.row_units`, `rule`): targets (y - m_row) / s_row on the row's
    own same-kind numbers in those units (how many: `choose_recent_width`), no loc_U. R [n, K] raw recent values
    (NaN = none), y [n] targets (value units); the fallback units are `act`'s. Returns `fit_linear_head`'s
    dict (w padded to K) with "r" [n, K], "present" [n, K] (a number there), "errors" [n_val] (or LOO [n]):
    held-out absolute errors in value units."""
    train = _row_inputs(R, y, rule, act)
    r, t, s, present, ratio = (train[k] for k in ("r", "t", "s", "present", "ratio"))
    has_val = R_val is not None and y_val is not None and len(y_val) > 0
    val = _row_inputs(R_val, y_val, rule, act) if has_val else {}
    r_val, t_val, s_val, ratio_val = (val.get(k) for k in ("r", "t", "s", "ratio"))
    k = R.shape[1]

    def fit_width(width: int) -> dict:
        fit = fit_linear_head(r[:, :width], t, r_val[:, :width] if has_val else None, t_val, loss="squared",
                              max_shift=max_shift, exact_columns=width)
        val_errors = fit["abs_errors"] if has_val else None
        score = penalty_score(float(fit["loo"].abs().mean()), None if val_errors is None else float(val_errors.mean()))
        return {"width": width, "score": score, "loo": fit["loo"], "val_errors": val_errors}

    width = choose_recent_width(fit_width, k)["width"]
    fit = fit_linear_head(r[:, :width], t, r_val[:, :width] if has_val else None, t_val, loss=loss, losses=losses,
                          max_shift=max_shift, exact_columns=width)
    w = torch.zeros(k, dtype=fit["w"].dtype)
    w[:width] = fit["w"]
    errors = (t_val - (r_val @ w + fit["b"])).abs() * s_val if has_val else fit["loo"].abs() * s
    power = choose_width_power(errors / (s_val if has_val else s), ratio_val if has_val else ratio)
    return {**fit, "w": w, "width": width, "r": r, "present": present, "errors": errors, "width_power": power,
            "noise": max(float((fit["loo"].abs() / ratio ** power).median()), 1e-3)}


#: the exponents a of the per-row width s (c / s)^a that `choose_width_power` tries (`row_units.row_width`)
WIDTH_POWERS = (0.0, 0.5, 1.0)


def _cauchy_nll_at_median(u: Tensor, width: Tensor) -> Tensor:
    """[n] Cauchy NLL (less log pi) of residuals u under widths gamma * width, gamma = median(|u| / width) (a
    Cauchy's scale is its median absolute deviation)."""
    gamma = (u.abs() / width).median().clamp_min(torch.finfo(u.dtype).tiny)
    return torch.log(gamma * width) + torch.log1p((u / (gamma * width)).square())


def choose_width_power(u: Tensor, ratio: Tensor) -> float:
    """The exponent a of the width s (c / s)^a: u [n] held-out residuals in row units (error / s), ratio [n] c / s.
    Each a of WIDTH_POWERS gets the Cauchy NLL of u under widths ratio^a (their common scale at its median fit);
    an a > 0 replaces 0 (the width of s alone) only when its NLL is smaller by more than one standard error of
    the paired difference, and the best such is kept. Scale-free: a row's NLL moves by log c when it is
    multiplied by c, the same for every a."""
    if len(u) < 3:
        return 0.0
    ref = _cauchy_nll_at_median(u, torch.ones_like(u))
    best, best_nll = 0.0, float(ref.mean())
    for a in WIDTH_POWERS[1:]:
        nll = _cauchy_nll_at_median(u, ratio ** a)
        diff = ref - nll
        if float(diff.mean()) > float(diff.std() / math.sqrt(len(diff))) and float(nll.mean()) < best_nll:
            best, best_nll = a, float(nll.mean())
    return best


def scale_free_errors(errors: Tensor, R: Tensor, act) -> Tensor:
    """Absolute errors [n] (value units) divided by each row's own one-step naive error (`row_units` 'last';
    the adapter's value_scale for a row without): what the choice of units compares, so that a series of 0.07
    counts as much as one of 9,000."""
    return errors / row_units(R, "last", act.value_loc, act.value_scale)[2]


def recent_range(Rs: Tensor, R: Tensor) -> Tensor:
    """[2, K] the range the head clamps r to: per column, the training rows' range of r (NaN rows of R, no
    number there, left out) widened by its width on each side. A linear head may extrapolate a trend a
    little (co2's last months lie above every training month), not without bound."""
    seen = ~torch.isnan(R)
    lo = torch.where(seen, Rs, torch.full_like(Rs, math.inf)).amin(0)
    hi = torch.where(seen, Rs, torch.full_like(Rs, -math.inf)).amax(0)
    none = ~seen.any(0)
    lo, hi = torch.where(none, 0.0, lo), torch.where(none, 0.0, hi)
    width = hi - lo
    return torch.stack([lo - width, hi + width])


def ridge_loo(X: Tensor, t: Tensor, grid: Sequence[float] = RIDGE_GRID, X_val: Tensor | None = None,
              t_val: Tensor | None = None) -> tuple[Tensor, float, Tensor]:
    """Least-squares `fit_linear_head`: (w [C + 1], the intercept last; the relative penalty; LOO
    residuals [n])."""
    fit = fit_linear_head(X, t, X_val, t_val, loss="squared", grid=grid)
    return torch.cat([fit["w"], torch.tensor([fit["b"]], dtype=fit["w"].dtype)]), fit["lam"], fit["loo"]


def ridge_warm_start(model, batches: Iterable[Mapping[str, Tensor]], device, max_rows: int = 8192,
                     val_batches: Iterable[Mapping[str, Tensor]] | None = None, loss: str = ROBUST_LOSS,
                     max_shift: float = BF16_MAX_SHIFT, losses: Sequence[str] = LOSSES,
                     row_rules: Sequence[str] = (), force_row_units: bool = False, row_correction: bool = True
                     ) -> dict | None:
    """Set the regression head from a robust ridge fit (`fit_linear_head`) on the model's own features at
    its <NUM> targets, in standardised units: w_reg, b_reg; |b_noise_Y| (the median |LOO residual|, a
    Cauchy's scale) when the scale is independent; with a per-row scale also w_scale_Y, |b_noise_Y| from
    `fit_log_scale` and the out-of-depth statistics (`fit_depth`; off, a factor of 1, when the head reads no
    loc_U). Penalties are chosen on `val_batches` when given, else by leave-one-out, under the bf16 bound `max_shift` (inf: none); `losses`: the candidates
    of loss 'auto'. `row_rules`: per-row units to try (`fit_row_head`); one is kept over the adapter's units when
    its held-out errors, each divided by its row's naive error (`scale_free_errors`), are smaller by more than
    one standard error (`force_row_units`: the first rule, unconditionally), with its nonlinear correction when
    `row_correction` and it wins (`add_row_net`), then its log-width (`add_row_scale`). Returns a summary, or None with
    fewer than 2 targets. `model`: as for `num_label_features`."""
    X, y, R = num_label_features(model, batches, device, max_rows)
    if X.shape[0] < 2:
        return None
    inner = unwrap_causal_model(model)  # the heads' attributes (`model` runs the forward)
    act = inner.action
    t = (y - act.value_loc) / act.value_scale
    X_val = t_val = R_val = y_val = None
    if val_batches is not None:
        X_val, y_val, R_val = num_label_features(model, val_batches, device, max_rows)
        t_val = (y_val - act.value_loc) / act.value_scale
    with whole_root_parameters(model):  # FSDP1: W_cls whole
        mean = center_abduction(inner, X.mean(0))
    X = X - mean
    X_val = None if X_val is None else X_val - mean
    # the head's inputs: loc_U, then the recent values (standardised, exact: not rounded by the bf16 bound)
    C, k = X.shape[1], R.shape[1]
    F = torch.cat([X, act.standardized_recent(R)], 1)
    F_val = None if X_val is None else torch.cat([X_val, act.standardized_recent(R_val)], 1)
    inputs, keep, gain = choose_head_inputs(F, t, F_val, t_val, C, max_shift)
    fit = fit_linear_head(F[:, keep], t, None if F_val is None else F_val[:, keep], t_val, loss=loss,
                          max_shift=max_shift, losses=losses, exact_columns=int(keep[C:].sum()), exact_gain=gain)
    w = torch.zeros(C + k, dtype=fit["w"].dtype)
    w[keep] = fit["w"]
    fit["w"] = w
    summary = {"rows": int(X.shape[0]), "inputs": inputs, "loss": fit["loss"], "ridge_lambda": fit["lam"],
               "chosen_on": fit["chosen_on"],
               "w_norm": float(fit["w"].norm()), "bf16_shift": fit["shift"] * act.value_scale,
               "loo_mae": float(fit["loo"].abs().mean()) * act.value_scale,
               "finite": bool(math.isfinite(float(fit["w"].abs().sum())))}
    scale = max(float(fit["loo"].abs().median()), 1e-3)
    if k:
        summary["w_recent_norm"] = float(fit["w"][C:].norm())
    row = choose_row_units(fit, F_val, X_val, R, y, R_val, y_val if val_batches is not None else None, act,
                           row_rules, force_row_units, loss=loss, losses=losses, max_shift=max_shift) if k else None
    if row is not None and row_correction:
        row = add_row_net(row, R, y, R_val, y_val if val_batches is not None else None, act, inner.causal_config.seed)
        row = add_row_scale(row, R_val, y_val if val_batches is not None else None, act)
    inner.set_row_units(None if row is None else row["rule"], 0.0 if row is None else row["width_power"])
    if row is not None:
        set_row_head(act, row, C)
        summary.update(units=row["rule"], inputs=f"recent[:{row['width']}] in row units", loss=row["loss"],
                       ridge_lambda=row["lam"], bf16_shift=0.0, w_recent_norm=float(row["w"].norm()),
                       units_score=row["units_score"], adapter_units_score=row["adapter_score"],
                       width_power=row["width_power"])
        if "net_mae" in row:  # the correction was tried: validation MAEs in row units
            summary.update(row_net="kept" if row["net"] is not None else "not kept", row_net_mae=row["net_mae"],
                           row_linear_mae=row["linear_mae"])
        if "scale" in row:  # the log-width was tried
            summary.update(row_scale="kept" if row["scale"] is not None else "not kept")
        return summary
    summary["units"] = "adapter"
    with torch.no_grad():
        act.w_reg.copy_(fit["w"][:C].to(act.w_reg.dtype))
        act.b_reg.fill_(fit["b"])
        if k:
            act.w_recent.copy_(fit["w"][C:].to(act.w_recent.dtype))
            act.recent_range.copy_(recent_range(F[:, C:], R).to(act.recent_range))
        if act.w_scale_Y is not None:
            resid_val = None if t_val is None else t_val - (F_val @ fit["w"] + fit["b"])
            sfit = fit_log_scale(X, fit["loo"], X_val, resid_val)
            act.w_scale_Y.copy_(sfit["w"].to(act.w_scale_Y.dtype))
            seen = X @ sfit["w"]
            act.log_scale_range.copy_(torch.stack([seen.min(), seen.max()]).to(act.log_scale_range))
            scale = math.exp(sfit["b"])
            depth = fit_depth(X, act.depth_basis.shape[0])
            if not bool(keep[:C].any()):  # the head reads no loc_U: loc_U's distance says nothing of its error
                depth = {**depth, "weight": torch.zeros_like(depth["weight"]), "resid": torch.zeros_like(depth["resid"])}
            act.set_depth(depth)
            summary.update(scale_lambda=sfit["lam"], scale_w_norm=float(sfit["w"].norm()),
                           depth="loc_U" if bool(keep[:C].any()) else "off")
        if act.b_noise_Y is not None:
            act.b_noise_Y.fill_(scale)
    return summary


def choose_row_units(fit: dict, F_val: Tensor | None, X_val: Tensor | None, R: Tensor, y: Tensor,
                     R_val: Tensor | None, y_val: Tensor | None, act, rules: Sequence[str], force: bool, *,
                     loss: str, losses: Sequence[str], max_shift: float) -> dict | None:
    """The per-row units' fit (`fit_row_head`) that beats the adapter's units' `fit` (w [C + K], b; in
    standardised units) on scale-free held-out errors by more than one standard error, the best such; None
    to keep the adapter's units. `force`: the first rule's fit, unconditionally."""
    if not rules:
        return None
    has_val = y_val is not None and F_val is not None and len(y_val) > 0
    R_ref = R_val if has_val else R
    if has_val:
        adapter_errors = (y_val - act.to_value(F_val @ fit["w"] + fit["b"])).abs()
    else:
        adapter_errors = fit["loo"].abs() * act.value_scale
    ref = scale_free_errors(adapter_errors, R_ref, act)
    best = None
    for rule in rules:
        row = fit_row_head(R, y, R_val if has_val else None, y_val if has_val else None, rule, act, loss=loss,
                           losses=losses, max_shift=max_shift)
        errs = scale_free_errors(row["errors"], R_ref, act)
        diff = ref - errs
        se = float(diff.std() / math.sqrt(len(diff))) if len(diff) > 1 else math.inf
        row.update(rule=rule, units_score=round(float(errs.mean()), 6),
                   adapter_score=round(float(ref.mean()), 6))
        if force:
            return row
        if float(diff.mean()) > se and (best is None or row["units_score"] < best["units_score"]):
            best = row
    return best


def _row_inputs(R: Tensor, y: Tensor, rule: str, act, clamp: Tensor | None = None) -> dict[str, Tensor]:
    """The rows R [n, K], y [n] in per-row units by `rule` (the fallback units are `act`'s): r (0 where no number;
    clamped to `clamp` [2, K] as the head reads them, when given), "present" [n, K] (a number there), the
    target t, s, c / s ("ratio"; 1 where a row has no curvature) and, with `clamp`, the correction's inputs x
    (`row_net.net_inputs`)."""
    values, m, s, own = row_units(R, rule, act.value_loc, act.value_scale)
    r = torch.nan_to_num((values - m[:, None]) / s[:, None], nan=0.0)
    out = {"t": (y - m) / s, "s": s, "present": ~torch.isnan(values), "ratio": row_width(values, s, own, 1.0) / s}
    if clamp is None:
        return {**out, "r": r}
    r = torch.minimum(torch.maximum(r, clamp[0]), clamp[1])
    return {**out, "r": r, "x": net_inputs(values, s, r)}


def add_row_net(row: dict, R: Tensor, y: Tensor, R_val: Tensor | None, y_val: Tensor | None, act, seed: int
                ) -> dict:
    """`row` (a `fit_row_head` fit, its rule in row["rule"]) with the head's nonlinear correction fitted to its
    residuals (`row_net_fit.fit_row_net`; the head's `row_net_members` MLPs, from `seed`, stopped on the even
    validation rows): "net" is their weights when their mean beats the linear head on the odd validation rows
    (errors in row units: "net_mae", "linear_mae") by more than one standard error of the paired difference,
    and then "errors", "width_power" and "noise" are its own (all validation rows); else None. Not tried
    without the correction's buffers or with fewer than MIN_ROWS / MIN_VALIDATION_ROWS rows."""
    members = act.row_net_members
    if not members or R_val is None or y_val is None or len(y) < MIN_ROWS or len(y_val) < MIN_VALIDATION_ROWS:
        return {**row, "net": None}
    clamp = recent_range(row["r"], torch.where(row["present"], row["r"], math.nan))
    train, val = _row_inputs(R, y, row["rule"], act, clamp), _row_inputs(R_val, y_val, row["rule"], act, clamp)
    u_train, u_linear = (d["t"] - (d["r"] @ row["w"] + row["b"]) for d in (train, val))
    # the members stop on every other validation row and are judged on the rest: rows that chose the epoch
    # would favour the correction (kept on random walks, where nothing in the window predicts the step)
    stop = torch.arange(len(u_linear)) % 2 == 0
    net = fit_row_net(train["x"], u_train, val["x"][stop], u_linear[stop], members, act.row_net_W1.shape[1], seed)
    u_net = u_linear - row_net(val["x"], net)
    diff = (u_linear.abs() - u_net.abs())[~stop]
    out = {**row, "net": None, "net_mae": round(float(u_net[~stop].abs().mean()), 6),
           "linear_mae": round(float(u_linear[~stop].abs().mean()), 6)}
    if not float(diff.mean()) > float(diff.std() / math.sqrt(len(diff))):
        return out
    power = choose_width_power(u_net, val["ratio"])
    return {**out, "net": net, "errors": u_net.abs() * val["s"], "width_power": power,
            "noise": max(float((u_net.abs() / val["ratio"] ** power).median()), 1e-3)}


def add_row_scale(row: dict, R_val: Tensor | None, y_val: Tensor | None, act) -> dict:
    """`row` (after `add_row_net`) with the per-row log-width: `fit_log_scale` of the validation rows' residuals in
    row units over (c / s)^a on the correction's inputs x (the window in row units and its shape,
    `row_net.net_inputs`). Validation rows, not training ones: the correction's training residuals are smaller
    than its errors on new rows, and by how much depends on the row. Fitted on every other validation row and
    judged on the rest: kept when its Cauchy NLL there beats a constant width's (each at its own level from the
    fitting rows) by more than one standard error of the paired difference (a log-width judged on its own rows
    is trusted too far: the hold-out's rate series lost its 90% coverage), then fitted again on every validation
    row. "scale" = {"w": [2 K + 2], "range": [2] the least and largest w . x on those rows} and "noise" = exp(its
    intercept); else None. Not tried without the head's buffers or with fewer than MIN_VALIDATION_ROWS validation
    rows."""
    if not act.row_scale or R_val is None or y_val is None or len(y_val) < MIN_VALIDATION_ROWS:
        return {**row, "scale": None}
    clamp = recent_range(row["r"], torch.where(row["present"], row["r"], math.nan))
    val = _row_inputs(R_val, y_val, row["rule"], act, clamp)
    u = val["t"] - (val["r"] @ row["w"] + row["b"])
    if row.get("net") is not None:
        u = u - row_net(val["x"], row["net"])
    u = u / val["ratio"] ** row["width_power"]
    fitting = torch.arange(len(u)) % 2 == 0
    x, x_held, u_fit, u_held = val["x"][fitting], val["x"][~fitting], u[fitting], u[~fitting]
    fit = fit_log_scale(x, u_fit, max_shift=math.inf)
    if not bool(fit["w"].abs().sum() > 0):  # a constant width did as well on the fitting rows
        return {**row, "scale": None}
    seen = x @ fit["w"]
    lo, hi = float(seen.min()), float(seen.max())
    constant = float(u_fit.abs().clamp_min(float(u_fit.abs().median()) * 1e-3).log().mean())  # a Cauchy's log-scale
    diff = (_cauchy_nll(u_held, torch.full_like(u_held, constant))
            - _cauchy_nll(u_held, (x_held @ fit["w"]).clamp(lo, hi) + fit["b"]))
    if not float(diff.mean()) > float(diff.std() / math.sqrt(len(diff))):
        return {**row, "scale": None}
    fit = fit_log_scale(val["x"], u, max_shift=math.inf)  # kept: fitted again on every validation row
    if not bool(fit["w"].abs().sum() > 0):
        return {**row, "scale": None}
    seen = val["x"] @ fit["w"]
    return {**row, "scale": {"w": fit["w"], "range": torch.stack([seen.min(), seen.max()])},
            "noise": math.exp(fit["b"])}


def _cauchy_nll(u: Tensor, log_scale: Tensor) -> Tensor:
    """[n] Cauchy NLL (less log pi) of residuals u under scales exp(log_scale)."""
    return log_scale + torch.log1p((u / log_scale.exp()).square())


def set_row_head(act, row: dict, C: int) -> None:
    """Load a `fit_row_head` fit into the head: w_recent, b_reg, the range of r, |b_noise_Y| (the median |LOO
    residual| in row units over (c / s)^a, a Cauchy's scale); w_reg, w_scale_Y and the out-of-depth weights zero (the head
    reads no loc_U in row units)."""
    with torch.no_grad():
        act.w_reg.zero_()
        act.b_reg.fill_(row["b"])
        act.w_recent.copy_(row["w"].to(act.w_recent.dtype))
        act.recent_range.copy_(recent_range(row["r"], torch.where(row["present"], row["r"], math.nan))
                               .to(act.recent_range))
        if act.w_scale_Y is not None:
            act.w_scale_Y.zero_()
            act.log_scale_range.zero_()
            act.depth_weight.zero_()
            act.depth_resid.zero_()
        act.b_noise_Y.fill_(row["noise"])  # the median |LOO residual| / (c / s)^a, a Cauchy's scale
        for name, buf in act.row_net_parts().items():  # the nonlinear correction, or 0 (adds 0)
            net = row.get("net")
            buf.copy_(net[name].to(buf.dtype) if net is not None else torch.zeros_like(buf))
        if act.row_scale:  # the log-width, or 0 (a factor of 1)
            scale = row.get("scale")
            act.w_row_scale.copy_(scale["w"].to(act.w_row_scale.dtype) if scale else torch.zeros_like(act.w_row_scale))
            act.row_log_scale_range.copy_(scale["range"].to(act.row_log_scale_range.dtype) if scale
                                          else torch.zeros_like(act.row_log_scale_range))
