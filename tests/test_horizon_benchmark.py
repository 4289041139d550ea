"""benchmarks/horizon.py: the quick run trains one adapter per set (a, b, c of benchmarks/scales.py in the forecasting
layout) and forecasts H = 4 steps; its RESULT line holds finite per-step figures, step 1 equal to `predict`, and the
paths' time against one deterministic path (the figures themselves are not checked: 2 steps). The baselines iterate
on their own forecasts, and the forecasting rows split by where their values lie."""
import json
import math

import numpy as np
import pytest

from conftest import load_benchmark, result_items

pytest.importorskip("statsmodels", reason="benchmarks/scales.py's bundled series come from statsmodels")





@pytest.fixture(scope="module")
def bench():
    return load_benchmark("horizon")


@pytest.fixture
def one_thread():
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def test_quick_run_prints_a_finite_per_step_result_line(bench, tmp_path, capsys, one_thread):
    out = tmp_path / "horizon.md"
    assert bench.main(["--quick", "--output", str(out)]) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    last = printed[-1]
    kv = result_items(printed)
    H = bench.QUICK["horizon"]
    for s in "abc":
        assert kv[f"{s}_step1_equals_predict"] == "True"
        for h in range(1, H + 1):
            for k in ("gm_vs_best_window", "cov50", "cov90"):
                assert math.isfinite(float(kv[f"{s}_h{h}_{k}"])), (s, h, k)
            assert 0.0 <= float(kv[f"{s}_h{h}_cov90"]) <= 1.0
        assert float(kv[f"{s}_speed_vs_one"]) > 0
    assert float(kv["speed_paths100_h12_vs_one"]) > 0
    data = json.loads(out.with_suffix(".json").read_text(encoding="utf-8"))
    assert data["result_line"] == last and set(data["results"]) == set("abc")
    assert data["results"]["c"]["run"]["calibrated_steps"] == H  # set c's validation rows reach every step


def test_baselines_iterate_and_rows_split_by_their_values(bench):
    entry = {"y": np.arange(40, dtype=float), "window": 8, "season": 4, "train_end": 28, "val_end": 34,
             "name": "s", "rows": [{"t_index": i, "prompt": f"p{i}", "completion": f" {i}", "time": f"t{i}"}
                                   for i in range(8, 40)]}
    fc = bench.iterated(entry, 20, 3, (*load_benchmark("baselines").ar_fit(entry["y"], 28, 1), 1))
    assert fc["persistence"].tolist() == [19, 19, 19]
    assert fc["seasonal_naive"].tolist() == [16, 17, 18]
    assert fc["window_drift"].tolist() == pytest.approx([20, 21, 22])
    assert fc["ar"].tolist() == pytest.approx([20, 21, 22], abs=1e-6)  # a line: AR(1) with intercept iterates it
    rows = bench.forecast_rows(entry, 3)
    assert all(r["first"] + 2 < 28 for r in rows["train"])
    assert all(28 <= r["first"] and r["first"] + 2 < 34 for r in rows["validation"])
    assert all(r["first"] >= 34 for r in rows["test"]) and rows["test"][-1]["first"] == 37
    assert rows["test"][0]["completion"] == " 34; t35: 35; t36: 36"
    assert rows["test"][0]["continuations"] == ["; t35:", "; t36:"]
