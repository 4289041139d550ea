"""The one-standard-error rule, and the choices of the value head's fit built on it.

Every choice the fit makes (the loss, the head's inputs, how many recent values, the per-row units, the width's
exponent, the nonlinear correction, the log-width) compares a reference with a candidate on held-out rows of
both, and takes the candidate only when it is better by more than one standard error of the paired difference
(`beats_by_one_se`): on a few dozen validation rows a smaller mean alone is mostly noise.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence, TypeVar

from torch import Tensor


def paired_gap(*diffs: Tensor) -> tuple[float, float]:
    """(how much better the candidate is, its standard error) from paired differences ref - candidate [n] (one
    tensor, or several parts weighed equally: their means averaged, their standard errors pooled). A part of fewer
    than 2 rows has an infinite standard error."""
    means = [float(d.mean()) for d in diffs]
    ses = [float(d.std() / math.sqrt(len(d))) if len(d) > 1 else math.inf for d in diffs]
    if len(diffs) == 1:
        return means[0], ses[0]
    return sum(means) / len(diffs), math.sqrt(sum(se * se for se in ses)) / len(diffs)


def beats_by_one_se(*diffs: Tensor) -> bool:
    """True when the paired differences ref - candidate (`paired_gap`) are positive by more than one standard
    error: the candidate replaces the reference."""
    drop, se = paired_gap(*diffs)
    return drop > se


@dataclass
class Scored:
    """A candidate fit as a choice sees it: its `penalty_score` (the mean of the validation and leave-one-out
    MAEs), its leave-one-out residuals [n] and its validation absolute errors [n_val] (None without validation
    rows), with what the choice returns when it wins (`what`)."""
    score: float
    loo: Tensor
    val_errors: Tensor | None
    what: object = None


def score_diffs(ref: Scored, other: Scored) -> tuple[Tensor, ...]:
    """The paired differences ref - other that `penalty_score` weighs: of |LOO residuals|, and of validation
    absolute errors when there are validation rows."""
    parts = (ref.loo.abs() - other.loo.abs(),)
    return parts if ref.val_errors is None else parts + (ref.val_errors - other.val_errors,)


T = TypeVar("T")


def one_standard_error_choice(fits: Sequence[T], diffs: Callable[[T, T], tuple[Tensor, ...]],
                              score: Callable[[T], float]) -> T:
    """The first of `fits` (the reference: least squares among the losses, the recent values alone among the
    head's inputs) unless a later one `beats_by_one_se` on diffs(reference, it); among those, the smallest
    score."""
    better = [f for f in fits[1:] if beats_by_one_se(*diffs(fits[0], f))]
    return min(better, key=score) if better else fits[0]


def choose_recent_count(fit_count: Callable[[int], Scored], k: int) -> Scored:
    """How many of the K recent values a head reads: `fit_count(n)` for the K // 4, K // 2, then all K most recent
    values, each step taken only when it beats the current choice by one standard error (`score_diffs`)."""
    chosen = None
    for n in sorted({max(k // 4, 1), max(k // 2, 1), k}):  # more values only when they earn it, one step at a time
        f = fit_count(n)
        if chosen is None or beats_by_one_se(*score_diffs(chosen, f)):
            chosen = f
    return chosen
