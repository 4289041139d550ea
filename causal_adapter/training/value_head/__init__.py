"""The value head's closed-form fit, in one place: two calls a run makes, `fit_before_training` and
`fit_after_training` (`lifecycle`), and the steps they take, a module each:

    lifecycle     the two calls (and the refit a mid-run evaluation makes)
    warm_start    value units and decimals; the features at the <NUM> targets; the choice of the head's inputs;
                  the ridge warm start in the adapter's units, then the per-row units when they win
    linear        ridge / robust linear fits with exact leave-one-out, the penalty rule, a log-linear width
    choice        the one-standard-error rule (`beats_by_one_se`) every choice of the fit uses
    row_head      the head in per-row units: its fit, the choice of units, its log-width, loading into the head
    correction    the per-row head's nonlinear correction (small MLPs on the row's numbers) and its fit
    calibration   the width after training: the per-row part's exponent, the scale, the split-conformal map
    summary       the base of the fits' typed summaries, which still print one flat key=value log line

The head itself is `modeling.heads.ActionHead`; the per-row transform both it and the fit call is
`modeling.row_transform.row_frame`. docs/values.md has the figures behind each default.
"""
from .calibration import Calibration
from .lifecycle import fit_after_training, fit_before_training, refit_value_head

__all__ = ["Calibration", "fit_after_training", "fit_before_training", "refit_value_head"]
