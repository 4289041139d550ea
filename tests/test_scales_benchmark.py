"""Smoke test of benchmarks/scales.py at toy size (--quick): the three sets train and predict end to end,
the last printed line is the RESULT line with every headline key a finite number, each target gets a
PASS / FAIL line, and the tables and the JSON are written. The figures themselves are not checked (2 steps).
The coverage reference (what exact intervals would give on the same series) against binomial sums written out;
the pieces of the targets against values computed by hand: the effective n of clustered misses, the moving-block
bootstrap, the multiplicative series of set c, the best WINDOW baseline (never ETS); those pieces live in
benchmarks/baselines.py."""
import json
import math

import numpy as np

from conftest import load_benchmark, result_items

KEYS = ("gm_vs_persistence", "gm_vs_best_window", "gm_vs_best", "gm_vs_ar", "gm_vs_ets", "worst_vs_persistence",
        "worst_vs_persistence_lo90", "worst_vs_persistence_hi90", "n_series", "n_beat_persistence", "neg_bounds90",
        "cov50_min", "cov50_max", "cov90_min", "cov90_max", "cov50_out", "cov50_out_exact", "cov50_off",
        "cov50_off_exact", "cov50_off_q95", "cov50_off_iid", "cov90_out", "cov90_out_exact", "cov90_off",
        "cov90_off_exact", "cov90_off_q95", "cov90_off_iid")
#: set c only: its series of each kind (--quick: one additive, one multiplicative)
KIND_KEYS = ("mult_n_series", "mult_gm_vs_ar", "mult_worst_vs_ar", "add_n_series", "add_gm_vs_ar")




def test_quick_run_prints_a_finite_result_line(tmp_path, capsys):
    scales = load_benchmark("scales")
    out = tmp_path / "scales.md"
    assert scales.main(["--quick", "--output", str(out)]) == 0
    printed = capsys.readouterr().out.strip().splitlines()

    last = printed[-1]
    kv = result_items(printed)
    for name in ("a", "b", "c"):
        for key in KEYS:
            assert math.isfinite(float(kv[f"{name}_{key}"])), (name, key)
        assert int(kv[f"{name}_n_series"]) >= 1
        for q in ("50", "90"):
            assert 0.0 <= float(kv[f"{name}_cov{q}_min"]) <= float(kv[f"{name}_cov{q}_max"]) <= 1.0
        assert float(kv[f"{name}_worst_vs_persistence_lo90"]) <= float(kv[f"{name}_worst_vs_persistence_hi90"])
    assert math.isfinite(float(kv["a_max_abs_copy_deviation"]))
    for key in KIND_KEYS:
        assert math.isfinite(float(kv[f"c_{key}"])), key
    assert int(kv["c_mult_n_series"]) == 1 and int(kv["c_add_n_series"]) == 1

    # one PASS / FAIL line per target: six on every set (worst series, gm vs best window, gm vs persistence,
    # coverage 50 and 90, negative bounds), set a's copy target, set c's multiplicative one
    verdicts = [line for line in printed if line.startswith(("PASS ", "FAIL "))]
    assert len(verdicts) == 7 + 6 + 7
    assert sum("multiplying season" in v for v in verdicts) == 1 and sum("copy" in v for v in verdicts) == 1

    data = json.loads(out.with_suffix(".json").read_text(encoding="utf-8"))
    assert data["result_line"] == last
    assert set(data["results"]) == {"a", "b", "c"}
    copies = data["results"]["a"]["copies"]
    assert all(math.isfinite(v) for by in copies.values() for v in by.values())
    text = out.read_text(encoding="utf-8")
    assert "### a:" in text and "### targets" in text


def _binomial_outside(n: int, level: float, lo: float, hi: float) -> float:
    """P(k / n outside [lo, hi]) for k ~ Binomial(n, level), summed term by term."""
    return sum(math.comb(n, k) * level ** k * (1 - level) ** (n - k) for k in range(n + 1) if not lo <= k / n <= hi)


def test_coverage_reference_is_what_exact_intervals_give():
    bl = load_benchmark("baselines")
    # three series: one in both bands, one under at 90% (15 / 20 = 0.75 is inside, 14 / 20 is not), one with
    # 50 rows covering all of them at 90% (over the band) and 10 / 50 at 50% (under it, and off the level)
    rows = [{"n_test": 20, "cov50": 0.5, "cov90": 0.9}, {"n_test": 20, "cov50": 0.45, "cov90": 0.7},
            {"n_test": 50, "cov50": 0.2, "cov90": 1.0}]
    ref = bl.coverage_reference(rows)
    for q, level in (("50", 0.5), ("90", 0.9)):
        lo, hi = bl.COVERAGE_BANDS[q]
        p_out = [_binomial_outside(r["n_test"], level, lo, hi) for r in rows]
        assert math.isclose(ref[f"cov{q}_out_exact"], sum(p_out), rel_tol=1e-9)
        assert math.isclose(ref[f"cov{q}_all_in_exact"], math.prod(1 - p for p in p_out), rel_tol=1e-9)
    # n = 20 at 90%: outside when 14 or fewer are covered, or all 20 (1.0 > 0.98): 0.9^20 = 0.12 of the time alone
    assert math.isclose(_binomial_outside(20, 0.9, 0.75, 0.98), 0.9 ** 20 + sum(
        math.comb(20, k) * 0.9 ** k * 0.1 ** (20 - k) for k in range(15)), rel_tol=1e-12)
    assert ref["cov50_out"] == 1 and ref["cov90_out"] == 2
    # off the level at 1% (two-sided exact test): 10 / 50 at 50% (p 2e-5) is; 14 / 20 at 90% (p 0.011) is not,
    # 50 / 50 at 90% (p 0.008) is
    assert ref["cov50_off"] == 1 and ref["cov90_off"] == 1


def test_effective_n_of_miss_sequences():
    bl = load_benchmark("baselines")
    # alternating misses: m = 1/2, the 19 lag-1 products are all -1/4, the squares sum to 20 / 4:
    # rho = -19 / 20, n (1 - rho) / (1 + rho) = 20 * 39 = 780: clamped to n
    alternating = [0, 1] * 10
    assert math.isclose(bl.lag1_autocorrelation(alternating), -0.95, rel_tol=1e-12)
    assert bl.effective_n(alternating) == 20
    # ten misses in a row, then ten hits: 18 products +1/4, one -1/4: rho = 17 / 20,
    # n_eff = 20 * 0.15 / 1.85 = 1.62
    clustered = [1] * 10 + [0] * 10
    assert math.isclose(bl.lag1_autocorrelation(clustered), 0.85, rel_tol=1e-12)
    assert math.isclose(bl.effective_n(clustered), 20 * 0.15 / 1.85, rel_tol=1e-12)
    # runs of two: the products alternate +1/4, -1/4 (10 and 9 of them): rho = 1 / 20, n_eff = 20 * 0.95 / 1.05
    assert math.isclose(bl.effective_n([1, 1, 0, 0] * 5), 20 * 0.95 / 1.05, rel_tol=1e-12)
    # no miss at all (no variance): rho 0, every row counts; one run of misses filling all but one row: >= 1
    assert bl.effective_n([0] * 20) == 20
    assert bl.effective_n([1] * 19 + [0]) >= 1


def test_coverage_reference_counts_clustered_misses_once():
    bl = load_benchmark("baselines")
    # 20 test rows, the 90% interval missing ten in a row: 10 / 20 is far off the level as 20 independent rows
    # (p ~ 1e-5), but n_eff = 1.62 -> 2 rows, 1 of 2 covered: P(k <= 1 | Binomial(2, 0.9)) = 0.01 + 0.18, not off
    row = {"n_test": 20, "cov50": 0.5, "cov90": 0.5, "neff50": 20.0,
           "neff90": bl.effective_n([1] * 10 + [0] * 10)}
    ref = bl.coverage_reference([row])
    assert ref["cov90_off_iid"] == 1 and ref["cov90_off"] == 0
    # 2 effective rows at 90%: off at 1% at most when 0 of 2 are covered (p-value P(0) = 0.01, at the threshold),
    # so exact intervals leave a series off with probability <= 0.01 and the 95th percentile of the count is 0;
    # the coverages 2 rows can give (0, 0.5, 1) all lie outside the band [0.75, 0.98]
    assert 0 <= ref["cov90_off_exact"] <= 0.01 + 1e-12 and ref["cov90_off_q95"] == 0
    assert math.isclose(ref["cov90_out_exact"], 1.0, rel_tol=1e-12)
    # the 95th percentile of a Poisson-binomial count, by hand: two fair coins -> P(<= 1) = 0.75, P(<= 2) = 1;
    # five series off with probability 0.01 each: P(0) = 0.99^5 = 0.951 >= 0.95
    assert bl.poisson_binomial_quantile([0.5, 0.5], 0.95) == 2
    assert bl.poisson_binomial_quantile([0.5, 0.5], 0.75) == 1
    assert bl.poisson_binomial_quantile([0.01] * 5, 0.95) == 0
    assert bl.poisson_binomial_quantile([0.01] * 6, 0.95) == 1  # 0.99^6 = 0.941


def test_block_bootstrap_keeps_blocks_and_brackets_the_ratio():
    bl = load_benchmark("baselines")
    # 16 rows, blocks of sqrt(16) = 4: every 4 consecutive rows of a period-4 pattern hold one 4 and three 0s,
    # so EVERY block resample has ratio 16 / 16 = 1 exactly; resampling single rows would spread it (0.25..1.75)
    model = [0.0, 0.0, 0.0, 4.0] * 4
    pers = [1.0] * 16
    assert bl.block_bootstrap_ratio(model, pers) == (1.0, 1.0)
    lo, hi = bl.block_bootstrap_ratio(model, pers, block=1)
    assert lo < 0.8 and hi > 1.2
    # a made-up series whose model error is 20..90% of persistence's on EVERY row: every resample's ratio is < 1,
    # so the interval lies below 1 and brackets the ratio on all rows; the same seed gives the same interval
    rng = np.random.default_rng(1)
    pers = rng.uniform(0.5, 2.0, 30)
    model = pers * rng.uniform(0.2, 0.9, 30)
    lo, hi = bl.block_bootstrap_ratio(model, pers)
    assert 0.2 < lo <= model.sum() / pers.sum() <= hi < 1.0
    assert bl.block_bootstrap_ratio(model, pers) == (lo, hi)


def test_multiplicative_series_swing_with_their_level():
    bl = load_benchmark("baselines")
    # 20 years of months, the level growing e^1 = 2.7x, season amplitude 0.3 (phase 0: +1 at month 3, -1 at month 9
    # of each year), little noise: each year's swing (max - min) is ~2 * 0.3 = 0.6 of its mean, first year to last
    n, amp = 240, 0.3
    y = bl.multiplicative_values(n, 100.0, growth=1.0, period=12, amplitude=amp, phase=0.0, phi=0.5, sd=0.005,
                                     rng=np.random.default_rng(0))
    years = y.reshape(20, 12)
    swing, mean = years.max(1) - years.min(1), years.mean(1)
    assert np.all(np.abs(swing / mean - 2 * amp) < 0.08)
    assert swing[-1] / swing[0] > 2.0  # the swing grows with the level (an additive season would keep it)
    assert 0.85 < (swing[-1] / mean[-1]) / (swing[0] / mean[0]) < 1.15

    # the panel: round(0.4 n) series multiplicative (chosen by the seed), marked, with a season; every value > 0
    panel = bl.synthetic_panel(10, (96, 144), seed=3)
    mult = [e for e in panel if e["multiplicative"]]
    assert len(mult) == 4 and all(e["period"] in (4, 12) and e["season"] == e["period"] for e in mult)
    assert all((e["y"] > 0).all() for e in panel)
    assert [e["name"] for e in bl.synthetic_panel(10, (96, 144), seed=3) if e["multiplicative"]] == \
        [e["name"] for e in mult]


def test_best_window_baseline_is_never_ets(monkeypatch):
    bl = load_benchmark("baselines")
    # ETS forecasting every value exactly: the best of all baselines on validation, never the best WINDOW one
    monkeypatch.setattr(bl, "ets_forecasts", lambda y, train_end, season: np.asarray(y, dtype=float).copy())
    t = np.arange(60, dtype=float)
    y = 50 + 0.05 * t ** 2 + 3 * np.sin(2 * np.pi * t / 12)
    entry = {"y": y, "train_end": 42, "season": 12, "window": 4}
    base = bl.one_step_baselines(entry, {"validation": np.arange(42, 51), "test": np.arange(51, 60)})
    assert base["best"] == "ets" and base["mae"]["ets"]["validation"] == 0
    # the season of 12 does not fit in a window of 4 values: seasonal naive is not a window candidate
    assert base["window_candidates"] == ["persistence", "window_drift", "ar"]
    assert base["best_window"] in base["window_candidates"]
    # the window drift at t = 10 by hand: y[9] + (y[9] - y[6]) / 3
    assert math.isclose(base["forecasts"]["window_drift"][10], y[9] + (y[9] - y[6]) / 3, rel_tol=1e-12)
    entry["window"] = 12
    base = bl.one_step_baselines(entry, {"validation": np.arange(42, 51), "test": np.arange(51, 60)})
    assert base["best"] == "ets" and base["best_window"] != "ets"
    assert base["window_candidates"] == ["persistence", "window_drift", "seasonal_naive", "ar"]
