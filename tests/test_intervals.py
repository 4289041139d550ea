"""Interval multipliers: raw Cauchy and split-conformal with the (n + 1) correction."""
import math

import pytest
import torch

from causal_adapter import CausalAdapterConfig
from causal_adapter.modeling.intervals import (
    MAX_SCORES,
    SCALE_EXPONENTS,
    choose_scale_exponent,
    conformal_multiplier,
    crossfit_interval_score,
    fit_calibration,
    interval,
    multiplier,
    winkler,
)


def test_raw_cauchy_interval_has_its_nominal_coverage():
    g = torch.Generator().manual_seed(0)
    y = torch.tan(math.pi * (torch.rand(200_000, generator=g, dtype=torch.float64) - 0.5)) * 3.0 + 5.0
    for level in (0.5, 0.8, 0.9, 0.95):
        lo, hi = interval(torch.full_like(y, 5.0), torch.full_like(y, 3.0), level)
        assert abs(float(((y >= lo) & (y <= hi)).double().mean()) - level) < 0.005


def test_conformal_multiplier_is_the_n_plus_1_order_statistic():
    calib = fit_calibration([1.0, 2.0, 3.0, 4.0], [0.0] * 4, [1.0] * 4)
    assert calib == {"n": 4, "scores": [1.0, 2.0, 3.0, 4.0]}
    assert conformal_multiplier(calib, 0.5) == 3.0  # ceil(5 * 0.5) = 3rd smallest
    assert conformal_multiplier(calib, 0.8) == 4.0
    assert conformal_multiplier(calib, 0.81) == math.inf  # past n / (n + 1)
    assert multiplier(0.5) == pytest.approx(1.0)  # tan(pi / 4)


def test_conformal_coverage_on_fresh_draws_with_a_wrong_scale():
    # residuals from a normal with sd 2, predicted scale 1 (wrong family, wrong width): conformal fixes both
    g = torch.Generator().manual_seed(1)
    cal = torch.randn(5000, generator=g, dtype=torch.float64) * 2.0
    test = torch.randn(100_000, generator=g, dtype=torch.float64) * 2.0
    calib = fit_calibration(cal, torch.zeros_like(cal), torch.ones_like(cal))
    assert len(calib["scores"]) <= 1001 and calib["n"] == 5000
    for level in (0.5, 0.8, 0.9, 0.95):
        lo, hi = interval(torch.zeros_like(test), torch.ones_like(test), level, calib)
        assert abs(float(((test >= lo) & (test <= hi)).double().mean()) - level) < 0.02


def test_a_thinned_map_interpolates_between_its_kept_order_statistics():
    """A map of n > MAX_SCORES scores keeps MAX_SCORES evenly spaced order statistics (both ends) and c_q is
    interpolated between them: on the scores 1..n (evenly spaced) c_q is the exact ceil((n + 1) q)-th smallest to
    within half a unit (the rounding of the kept ranks) at every level; a map that read the nearest kept order
    statistic below instead is off by up to n / MAX_SCORES = 5 units, which a coverage check cannot see."""
    n = 5000
    calib = fit_calibration(torch.arange(1, n + 1, dtype=torch.float64), [0.0] * n, [1.0] * n)
    assert calib["n"] == n and len(calib["scores"]) == MAX_SCORES
    assert calib["scores"][0] == 1.0 and calib["scores"][-1] == float(n)
    for q in torch.linspace(0.01, 0.995, 198, dtype=torch.float64).tolist():
        assert abs(conformal_multiplier(calib, q) - math.ceil((n + 1) * q)) <= 0.5 + 1e-9, q
    assert conformal_multiplier(calib, n / (n + 1)) == float(n)  # the largest finite one: the last score kept
    assert conformal_multiplier(calib, 0.9999) == math.inf  # ceil(5001 x 0.9999) = 5001 > n


def test_calibration_map_round_trips_through_the_config_and_is_validated():
    calib = fit_calibration([0.5, -1.0, 2.0], [0.0] * 3, [1.0] * 3)
    cfg = CausalAdapterConfig(value_calibration=calib)
    assert CausalAdapterConfig.from_json(cfg.to_json()).value_calibration == calib
    for bad in ({"n": 3}, {"n": 0, "scores": [1.0]}, {"n": 2, "scores": [2.0, 1.0]}, {"n": 1, "scores": [float("nan")]}):
        with pytest.raises(ValueError, match="value_calibration"):
            CausalAdapterConfig(value_calibration=bad)
    with pytest.raises(ValueError, match="level"):
        multiplier(1.0)


def _hetero_rows(n, seed, informative=True):
    """(y, loc, base, ratio): Cauchy-free normal residuals with sd = ratio when `informative`, else sd 1
    whatever the ratio (then the per-row part of the width is noise)."""
    g = torch.Generator().manual_seed(seed)
    ratio = torch.exp(torch.randn(n, generator=g, dtype=torch.float64))
    sd = ratio if informative else torch.ones(n, dtype=torch.float64)
    y = torch.randn(n, generator=g, dtype=torch.float64) * sd
    return y, torch.zeros(n, dtype=torch.float64), torch.ones(n, dtype=torch.float64), ratio


def test_crossfit_interval_score_fits_on_one_half_and_scores_the_other():
    y, loc, base, ratio = _hetero_rows(41, 0)
    got = crossfit_interval_score(y, loc, ratio, levels=(0.5, 0.8))
    halves = (torch.arange(0, 41, 2), torch.arange(1, 41, 2))
    expected = []
    for fit_rows, score_rows in (halves, halves[::-1]):
        scores = ((y[fit_rows] - loc[fit_rows]).abs() / ratio[fit_rows]).sort().values
        for q in (0.5, 0.8):
            c = float(scores[math.ceil((len(fit_rows) + 1) * q) - 1])  # (n + 1) order statistic, OTHER half
            lo, hi = loc[score_rows] - c * ratio[score_rows], loc[score_rows] + c * ratio[score_rows]
            expected.append(float(winkler(y[score_rows], lo, hi, q).mean()))
    assert got == pytest.approx(sum(expected) / len(expected), rel=1e-12)
    assert math.isnan(crossfit_interval_score(y[:2], loc[:2], ratio[:2], levels=(0.9,)))  # no finite quantile


def test_scale_exponent_keeps_an_informative_width_and_drops_a_noise_one():
    y, loc, base, ratio = _hetero_rows(400, 1, informative=True)
    a, scores = choose_scale_exponent(y, loc, base, ratio)
    assert a == 1.0 and set(scores) == set(SCALE_EXPONENTS)
    assert a == min(scores, key=scores.get)
    y, loc, base, ratio = _hetero_rows(400, 2, informative=False)
    a, scores = choose_scale_exponent(y, loc, base, ratio)
    assert a == 0.0 and scores[0.0] < 0.9 * scores[1.0], scores  # a noise width costs interval score
    assert choose_scale_exponent(y[:5], loc[:5], base[:5], ratio[:5])[0] == 1.0  # too few rows: no choice
