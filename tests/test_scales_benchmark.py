"""Smoke test of benchmarks/scales.py at toy size (--quick): the three sets train and predict end to end,
the last printed line is the RESULT line with every headline key a finite number, each target gets a
PASS / FAIL line, and the tables and the JSON are written. The figures themselves are not checked (2 steps)."""
import importlib.util
import json
import math
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "scales.py"
KEYS = ("gm_vs_persistence", "gm_vs_best", "worst_vs_persistence", "n_series", "n_beat_persistence",
        "cov50_min", "cov50_max", "cov90_min", "cov90_max")


def _load():
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
