"""Data-fitted starting point of the regression head (what `train()` does before step 1).

* `fit_value_units`: the value units Y = value_loc + value_scale * Y' from the training targets
  (median and IQR / 1.349, the normal-consistent robust spread), so the head predicts O(1)
  numbers: raw-unit regression with b_reg = 0 could not reach sunspots' median (39) in 300 steps.
* `value_decimals`: the most decimals the training targets are written with (generated values
  are shown that way).
* `ridge_warm_start`: w_reg, b_reg by ridge regression of the standardised targets on loc_U at
  the positions that predict them (a linear probe, then fine-tuning: "LP-FT"), with the ridge
  penalty chosen on the validation split when there is one (else by exact leave-one-out
  error), and |b_noise_Y| set to the median absolute leave-one-out residual (the scale of a Cauchy is its median absolute deviation). Measured:
  the information about the value sits in low-variance directions of the final-norm features,
  where Adam from a random w_reg needs far more steps than a training run has (sunspots, frozen
  tiny base: MAE 48 after 3000 Adam steps vs 31 for the warm start).
"""
from __future__ import annotations

import math
from typing import Iterable, Mapping, Sequence

import torch
from torch import Tensor

from .numbers import format_number

#: ridge penalties tried, relative to the largest squared singular value of the centred features
RIDGE_GRID = tuple(10.0 ** (-k / 2) for k in range(0, 21))


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
                       ) -> tuple[Tensor, Tensor]:
    """(loc_U [n, C] float64, targets [n] float64) at the positions that predict a <NUM> label."""
    feats, targets, n = [], [], 0
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for batch in batches:
                labels = batch["labels"].to(device)
                out = model(batch["input_ids"].to(device), batch["numeric_values"].to(device),
                            batch["attention_mask"].to(device))
                pos = labels[:, 1:] == model.num_token_id
                feats.append(out.loc_U[:, :-1][pos.to(out.loc_U.device)].double().cpu())  # heads may sit elsewhere
                values = batch["label_values"] if "label_values" in batch else batch["numeric_values"]
                targets.append(values.to(device)[:, 1:][pos].double().cpu())
                n += int(pos.sum())
                if n >= max_rows:
                    break
    finally:
        model.train(was_training)
    if not feats:
        return torch.zeros(0, 0, dtype=torch.float64), torch.zeros(0, dtype=torch.float64)
    return torch.cat(feats)[:max_rows], torch.cat(targets)[:max_rows]


def ridge_loo(X: Tensor, t: Tensor, grid: Sequence[float] = RIDGE_GRID, X_val: Tensor | None = None,
              t_val: Tensor | None = None) -> tuple[Tensor, float, Tensor]:
    """Ridge regression of t [n] on X [n, C] with an unpenalised intercept. The penalty (one of
    `grid`, times the largest squared singular value) is the one with the smallest mean absolute
    error on (X_val, t_val) when given (a validation split: it sees a shift in time that the
    training rows do not), else with the smallest mean absolute leave-one-out residual. The
    leave-one-out residuals are exact, from the SVD (no refits).

    Returns (w [C + 1], the last entry the intercept; the chosen penalty; LOO residuals [n])."""
    n = X.shape[0]
    mean_x, mean_t = X.mean(0), t.mean()
    U, S, Vh = torch.linalg.svd(X - mean_x, full_matrices=False)
    proj = U.T @ (t - mean_t)
    best = None
    for rel in grid:
        lam = rel * float(S[0] ** 2) if S.numel() else rel
        w = Vh.T @ (S / (S ** 2 + lam) * proj)
        resid = t - mean_t - (X - mean_x) @ w
        hat = (U ** 2) @ (S ** 2 / (S ** 2 + lam)) + 1.0 / n
        loo = resid / (1.0 - hat).clamp_min(1e-12)
        if X_val is not None and t_val is not None and len(t_val):
            score = float((mean_t + (X_val - mean_x) @ w - t_val).abs().mean())
        else:
            score = float(loo.abs().mean())
        if best is None or score < best[0]:
            best = (score, lam, w, loo)
    _, lam, w, loo = best
    return torch.cat([w, (mean_t - mean_x @ w).reshape(1)]), lam, loo


def ridge_warm_start(model, batches: Iterable[Mapping[str, Tensor]], device, max_rows: int = 8192,
                     val_batches: Iterable[Mapping[str, Tensor]] | None = None) -> dict | None:
    """Set w_reg, b_reg (and |b_noise_Y| when the regression scale is independent) from a ridge
    fit on the model's own features at its <NUM> targets, in standardised units; the penalty is
    chosen on `val_batches` when given, else by leave-one-out. Returns a summary, or None when
    there are fewer than 2 targets."""
    X, y = num_label_features(model, batches, device, max_rows)
    if X.shape[0] < 2:
        return None
    act = model.action
    t = (y - act.value_loc) / act.value_scale
    X_val = t_val = None
    if val_batches is not None:
        X_val, y_val = num_label_features(model, val_batches, device, max_rows)
        t_val = (y_val - act.value_loc) / act.value_scale
    w, lam, loo = ridge_loo(X, t, X_val=X_val, t_val=t_val)
    scale = max(float(loo.abs().median()), 1e-3)
    with torch.no_grad():
        act.w_reg.copy_(w[:-1].to(act.w_reg.dtype))
        act.b_reg.fill_(float(w[-1]))
        if act.b_noise_Y is not None:
            act.b_noise_Y.fill_(scale)
    return {"rows": int(X.shape[0]), "ridge_lambda": lam, "chosen_on": "validation" if t_val is not None and len(t_val)
            else "leave-one-out", "w_norm": float(w[:-1].norm()), "loo_mae": float(loo.abs().mean()) * act.value_scale,
            "loo_median_ae": scale * act.value_scale, "finite": bool(math.isfinite(float(w.abs().sum())))}
