"""Smoke test of benchmarks/scales.py at toy size (--quick): the three sets train and predict end to end,
the last printed line is the RESULT line with every headline key a finite number, each target gets a
PASS / FAIL line, and the tables and the JSON are written. The figures themselves are not checked (2 steps).
The coverage reference (what exact intervals would give on the same series) against binomial sums written out."""
import importlib.util
import json
import math
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "scales.py"
KEYS = ("gm_vs_persistence", "gm_vs_best", "gm_vs_ar", "gm_vs_ets", "worst_vs_persistence", "n_series",
        "n_beat_persistence", "cov50_min", "cov50_max", "cov90_min", "cov90_max", "cov50_out", "cov50_out_exact",
        "cov50_off", "cov90_out", "cov90_out_exact", "cov90_off")


def _load():
    if str(BENCH.parent) not in sys.path:
        sys.path.append(str(BENCH.parent))  # the script imports benchmarks/common.py
    spec = importlib.util.spec_from_file_location("scales_bench", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_quick_run_prints_a_finite_result_line(tmp_path, capsys):
    scales = _load()
    out = tmp_path / "scales.md"
    assert scales.main(["--quick", "--output", str(out)]) == 0
    printed = capsys.readouterr().out.strip().splitlines()

    last = printed[-1]
    assert last.startswith("RESULT ") and sum(line.startswith("RESULT") for line in printed) == 1
    kv = dict(item.split("=", 1) for item in last[len("RESULT "):].split())
    for name in ("a", "b", "c"):
        for key in KEYS:
            assert math.isfinite(float(kv[f"{name}_{key}"])), (name, key)
        assert int(kv[f"{name}_n_series"]) >= 1
        for q in ("50", "90"):
            assert 0.0 <= float(kv[f"{name}_cov{q}_min"]) <= float(kv[f"{name}_cov{q}_max"]) <= 1.0
    assert math.isfinite(float(kv["a_max_abs_copy_deviation"]))

    # one PASS / FAIL line per target: set a has the copy target besides the five of every set
    verdicts = [line for line in printed if line.startswith(("PASS ", "FAIL "))]
    assert len(verdicts) == 6 + 5 + 5

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
    scales = _load()
    # three series: one in both bands, one under at 90% (15 / 20 = 0.75 is inside, 14 / 20 is not), one with
    # 50 rows covering all of them at 90% (over the band) and 10 / 50 at 50% (under it, and off the level)
    rows = [{"n_test": 20, "cov50": 0.5, "cov90": 0.9}, {"n_test": 20, "cov50": 0.45, "cov90": 0.7},
            {"n_test": 50, "cov50": 0.2, "cov90": 1.0}]
    ref = scales.coverage_reference(rows)
    for q, level in (("50", 0.5), ("90", 0.9)):
        lo, hi = scales.TARGETS[f"cov{q}"]
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
