"""Closed-form linear fits of the value head, on tensors (no model): ridge regression on per-feature standardised
features with exact leave-one-out residuals along a penalty path, under an optional bf16-rounding bound
(`fit_linear_head` -> `LinearFit`); robust M-estimates by IRLS (Huber, Cauchy, Tukey; `robust_weights`); the
penalty rule (`penalty_score`: the mean of the validation and leave-one-out MAEs); a log-linear Cauchy width
(`fit_log_scale` -> `LogScaleFit`); the clamp range of the recent values (`recent_range`). docs/values.md has the
figures behind each default.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from ...config import BF16_MAX_SHIFT
from .choice import one_standard_error_choice


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


@dataclass
class LinearFit:
    """A linear head t ~ X @ w + b (`fit_linear_head`), in the raw units of X's columns.

    w [C], b; lam: the relative penalty chosen; loo [n]: leave-one-out residuals; weights [n]: the IRLS weights
    (ones for least squares); shift: the bf16-rounding shift of X @ w; chosen_on: what chose the penalty; loss:
    the loss used; score: the mean held-out absolute error; scores: {loss: score} of the candidates of
    loss='auto'; abs_errors [n_val] (or [n]): held-out absolute errors (validation, else leave-one-out)."""
    w: Tensor
    b: float
    lam: float
    loo: Tensor
    weights: Tensor
    shift: float
    chosen_on: str
    loss: str
    score: float
    scores: dict[str, float]
    abs_errors: Tensor

    def padded(self, keep: Tensor) -> "LinearFit":
        """The fit with w spread over the columns `keep` [C'] bool marks (zeros elsewhere)."""
        w = torch.zeros(keep.numel(), dtype=self.w.dtype)
        w[keep] = self.w
        return dataclasses.replace(self, w=w)


@dataclass
class LogScaleFit:
    """A log-linear Cauchy width s(x) = exp(w . x + b) (`fit_log_scale`): w [C], b, the relative penalty (inf for
    a constant width) and its held-out Cauchy NLL."""
    w: Tensor
    b: float
    lam: float
    nll: float


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


def ridge_path(Xs: Tensor, t: Tensor, weights: Tensor, lams: Sequence[float]):
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


def standardized(X: Tensor) -> tuple[Tensor, Tensor, Tensor, float]:
    """(mean [C], sd [C], the standardised X [n, C], the largest squared singular value of its centred
    form: the unit of the relative ridge penalties)."""
    mean, sd = standardize(X)
    Xs = (X - mean) / sd
    return mean, sd, Xs, float(torch.linalg.matrix_norm(Xs - Xs.mean(0), ord=2) ** 2) or 1.0


def fit_linear_head(X: Tensor, t: Tensor, X_val: Tensor | None = None, t_val: Tensor | None = None, *,
                    loss: str = "cauchy", grid: Sequence[float] = RIDGE_GRID, max_shift: float = BF16_MAX_SHIFT,
                    iters: int = IRLS_ITERS, losses: Sequence[str] = LOSSES, exact_columns: int = 0,
                    exact_gain: float = 1.0) -> LinearFit:
    """Robust ridge regression t [n] ~ X [n, C] on per-feature standardised features, folded back to
    raw units (a plain linear head). The penalty (relative to the largest squared singular value of
    the standardised features) is the grid entry with the smallest mean of the validation MAE (X_val, t_val)
    and the mean |LOO residual| (`penalty_score`), else of the latter alone, among those whose weights keep
    the bf16-rounding shift <= `max_shift` (the last `exact_columns` of X are not rounded; `exact_gain` divides
    their penalty by its square).
    loss != 'squared' ('huber', 'cauchy', 'tukey'): IRLS M-estimate started from the ridge solution, then the penalty is chosen again
    under the final weights and IRLS runs once more. loss 'auto': each of `losses` is fitted so; least
    squares is kept unless a robust fit's validation MAE (else mean |LOO residual|) is smaller by more
    than one standard error of the paired difference (`choice.one_standard_error_choice`).

    Returns a `LinearFit`."""
    if loss == "auto":
        fits = [fit_linear_head(X, t, X_val, t_val, loss=name, grid=grid, max_shift=max_shift, iters=iters,
                                exact_columns=exact_columns, exact_gain=exact_gain) for name in losses]
        best = one_standard_error_choice(fits, lambda ref, f: (ref.abs_errors - f.abs_errors,), lambda f: f.score)
        return dataclasses.replace(best, scores={f.loss: f.score for f in fits})
    robust_weights(t[:1], loss)  # an unknown loss fails here, before any work
    mean, sd, Xs, unit = standardized(X)
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
        _, lam, w, b, loo = _choose(ridge_path(Xs, t, weights, [r * unit for r in grid]), score, X, sd,
                                    max_shift, X_val if has_val else None, exact_columns)
        if loss == "squared":
            break
        for _ in range(iters):  # IRLS at this penalty
            resid = t - b - Xs @ w
            weights = robust_weights(resid, loss).clamp_min(1e-12)
            _, w, b, loo = next(ridge_path(Xs, t, weights, [lam]))
    w_raw = w / sd
    abs_errors = (X_val @ w_raw + b - mean @ w_raw - t_val).abs() if has_val else loo.abs()
    return LinearFit(w=w_raw, b=b - float(mean @ w_raw), lam=lam / unit, loo=loo, weights=weights,
                     shift=bf16_shift(X, w_raw, exact_columns),
                     chosen_on="validation+leave-one-out" if has_val else "leave-one-out", loss=loss,
                     score=float(abs_errors.mean()), scores={loss: float(abs_errors.mean())}, abs_errors=abs_errors)


def penalty_score(loo_mae: float, val_mae: float | None) -> float:
    """What a ridge penalty is chosen by: the mean of the validation MAE and the mean |LOO residual| (the
    latter alone without validation rows). Validation alone is a few dozen rows whose noise picks the
    penalty; leave-one-out alone misses a shift between training and validation (time-ordered corpora).
    Measured by choosing on one half of the validation rows and scoring on the other half (docs/values.md,
    "Choosing the penalty"): MAE of both / of validation only, income -> food 0.88, co2 0.92, nile 1.02."""
    return loo_mae if val_mae is None else 0.5 * (loo_mae + val_mae)


def log_abs_residuals(resid: Tensor) -> Tensor:
    """[n] log |resid|, floored at 1e-3 of the median |resid| (an exact fit's zeros): what `fit_log_scale`
    regresses; its mean is a constant Cauchy's log-scale (for a Cauchy, E log |r| = log s)."""
    return resid.abs().clamp_min(max(float(resid.abs().median()) * 1e-3, 1e-12)).log()


def fit_log_scale(X: Tensor, resid: Tensor, X_val: Tensor | None = None, resid_val: Tensor | None = None, *,
                  grid: Sequence[float] = RIDGE_GRID, max_shift: float = 0.05) -> LogScaleFit:
    """A per-row Cauchy scale s(x) = exp(w . x + b) from residuals [n] (out-of-sample: LOO) of a location
    head: ridge of log|r| on standardised X (for a Cauchy, E log|r| = log s exactly). The penalty is
    the one with the smallest Cauchy NLL of the validation residuals `resid_val` (else of the LOO
    log-residuals' predictions); a constant scale (w = 0, lam = inf) is kept when its NLL is no worse."""
    target = log_abs_residuals(resid)
    mean, sd, Xs, unit = standardized(X)
    has_val = X_val is not None and resid_val is not None and len(resid_val) > 0

    def score(w_raw, b, loo):
        if has_val:
            log_s, r = X_val @ w_raw + b - mean @ w_raw, resid_val
        else:
            log_s, r = target - loo, resid
        return float((log_s + math.log(math.pi) + torch.log1p((r / log_s.exp()) ** 2)).mean())

    nll, lam, w, b, _ = _choose(ridge_path(Xs, target, torch.ones_like(target), [r * unit for r in grid]),
                                score, X, sd, max_shift, X_val if has_val else None)
    w_raw = w / sd
    # a constant width (log |r| 's mean, LOO-exact) competes on the same held-out NLL: keep it when it wins
    n = len(target)
    const_loo = target - (target.sum() - target) / max(n - 1, 1)
    const_nll = score(torch.zeros_like(w_raw), float(target.mean()), const_loo)
    if const_nll <= nll:
        return LogScaleFit(w=torch.zeros_like(w_raw), b=float(target.mean()), lam=math.inf, nll=const_nll)
    return LogScaleFit(w=w_raw, b=b - float(mean @ w_raw), lam=lam / unit, nll=nll)


def recent_range(Rs: Tensor, R: Tensor) -> Tensor:
    """[2, K] the range the head clamps r to: per column, the training rows' range of r (a row of R with NaN, no
    number there, reads r = 0: the range then holds 0) widened by its width on each side. A linear head may
    extrapolate a trend a little (co2's last months lie above every training month), not without bound."""
    seen = ~torch.isnan(R)
    lo = torch.where(seen, Rs, torch.full_like(Rs, math.inf)).amin(0)
    hi = torch.where(seen, Rs, torch.full_like(Rs, -math.inf)).amax(0)
    none = ~seen.any(0)
    lo, hi = torch.where(none, 0.0, lo), torch.where(none, 0.0, hi)
    # a row with no number in a slot reads r = 0 there, in the fit as in the forward: the range holds 0 (else the
    # forward would clamp that 0 to a range of the rows that have one, and predict what the fit never did)
    absent = (~seen).any(0)
    lo, hi = torch.where(absent, lo.clamp(max=0.0), lo), torch.where(absent, hi.clamp(min=0.0), hi)
    width = hi - lo
    return torch.stack([lo - width, hi + width])
