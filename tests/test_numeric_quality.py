"""Smoke test of benchmarks/numeric_quality.py at toy size (--quick): every variant trains a
couple of steps, the table and the JSON have every row with finite numbers, and the last line is
the RESULT line. Plus: the plain-LoRA loss on the kept positions equals the full labels loss."""
import importlib.util
import json
import math
import re
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "numeric_quality.py"


@pytest.fixture(scope="module")
def nq():
    spec = importlib.util.spec_from_file_location("numeric_quality_bench", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _number(cell: str) -> float:
    return float(cell.strip())


def test_quick_run_writes_complete_table(nq, tmp_path, capsys):
    out = tmp_path / "nq.md"
    assert nq.main(["--quick", "--output", str(out)]) == 0
    printed = capsys.readouterr().out.strip().splitlines()

    # the last printed line is the RESULT line with plain finite numbers
    last = printed[-1]
    assert last.startswith("RESULT ")
    kv = dict(item.split("=", 1) for item in last[len("RESULT "):].split())
    for name in nq.VARIANTS:
        assert math.isfinite(float(kv[f"{name}_mae"]))
    for name in nq.VARIANTS[:-1]:
        assert math.isfinite(float(kv[f"{name}_ratio"]))
    assert 0.0 <= float(kv["plain_lora_parse_rate"]) <= 1.0
    assert sum(1 for line in printed if line.startswith("RESULT")) == 1

    # the markdown table: one row per variant, finite MAE / median AE / ratio / validation MAE
    table = out.read_text(encoding="utf-8")
    rows = {}
    for line in table.splitlines():
        for name, label in nq.LABELS.items():
            if line.startswith(f"| {label} |"):
                rows[name] = [c.strip() for c in line.strip("|").split("|")]
    assert set(rows) == set(nq.VARIANTS)
    for name, cells in rows.items():
        mae, med, ratio, cov50, cov90, parse, std, val_mae = cells[1:]
        for c in (mae, med, ratio, std, val_mae):
            assert math.isfinite(_number(c)), (name, cells)
        if name.startswith("causal"):
            assert 0.0 <= _number(cov50) <= _number(cov90) <= 1.0
        else:
            assert cov50 == cov90 == "n/a"
        if name == "plain_lora":
            assert 0.0 <= _number(parse) <= 1.0
    assert _number(rows["persistence"][3]) == 1.0
    assert re.search(r"train median \(\S+\) in its MAE", table)

    # the JSON beside it holds the same numbers
    data = json.loads(out.with_suffix(".json").read_text(encoding="utf-8"))
    res = data["results"]
    n_test = len(data["test_targets"])
    for name in nq.VARIANTS:
        for split in ("validation", "test"):
            assert math.isfinite(res[name][split]["mae"]) and math.isfinite(res[name][split]["median_ae"])
        assert res[name]["test"]["n"] == n_test
        assert float(kv[f"{name}_mae"]) == pytest.approx(res[name]["test"]["mae"], rel=1e-5)
    for name in ("causal_frozen", "causal_lora", "plain_lora"):
        assert res[name]["steps"] == data["settings"]["steps"]
    assert len(res["plain_lora"]["test"]["texts"]) == n_test


def test_plain_lora_kept_positions_loss_equals_full_labels_loss(nq, qwen_tokenizer):
    args = nq.parse_args(["--quick"])
    from causal_adapter.corpora import build_corpus

    rows = nq.encode_plain(build_corpus("sunspots")["train"].select(range(5)), qwen_tokenizer)
    rows[1] = {**rows[1], "prompt_ids": rows[1]["prompt_ids"][:-7], "input_ids": rows[1]["input_ids"][7:],
               "labels": rows[1]["labels"][7:]}  # rows of different lengths: padding and clamped positions
    batch = nq.collate_plain(rows, qwen_tokenizer.pad_token_id)
    model = nq.build_plain_lora(args)
    with torch.no_grad():
        kept = nq.plain_loss(model, batch)
        full = nq.plain_loss(model, batch, full=True)
    assert torch.isfinite(kept)
    assert kept.item() == pytest.approx(full.item(), rel=1e-5, abs=1e-6)


def test_score_plain_counts_failures_and_uses_fallback(nq):
    s = nq.score_plain([" 12.5", " no number", "7 and 9"], [10.0, 20.0, 8.0], fallback=15.0)
    assert s["parsed"] == 2 and s["parse_rate"] == pytest.approx(2 / 3)
    assert s["predictions"] == [12.5, 15.0, 7.0]
    assert s["mae"] == pytest.approx((2.5 + 5.0 + 1.0) / 3)
    assert s["mae_parsed_only"] == pytest.approx((2.5 + 1.0) / 2)
