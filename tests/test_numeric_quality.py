"""Smoke test of benchmarks/numeric_quality.py at toy size (--quick): every variant trains a
couple of steps, the table and the JSON have every row with finite numbers, and the last line is
the RESULT line. Plus: the plain-LoRA loss on the kept positions equals the full labels loss."""
import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "numeric_quality.py"


@pytest.fixture(scope="module")
def nq():
    if str(BENCH.parent) not in sys.path:
        sys.path.append(str(BENCH.parent))  # the script imports benchmarks/common.py
    spec = importlib.util.spec_from_file_location("numeric_quality_bench", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _number(cell: str) -> float:
    return float(cell.strip())


def test_quick_run_writes_complete_tables(nq, tmp_path, capsys):
    out = tmp_path / "nq.md"
    assert nq.main(["--quick", "--output", str(out)]) == 0
    printed = capsys.readouterr().out.strip().splitlines()

    # the last printed line is the RESULT line with the keys per corpus, plain finite numbers
    last = printed[-1]
    assert last.startswith("RESULT ") and sum(1 for line in printed if line.startswith("RESULT")) == 1
    kv = dict(item.split("=", 1) for item in last[len("RESULT "):].split())
    for corpus, ref in (("sunspots", "persistence"), ("diabetes", "constant")):
        for key in ("frozen_vs_probe", f"lora_vs_{ref}", "lora_vs_digit", "cov50", "cov90", "lora_cov50", "lora_cov90"):
            assert math.isfinite(float(kv[f"{corpus}_{key}"])), (corpus, key)
        for key in ("cov50", "cov80", "cov90", "cov95", "lora_cov50", "lora_cov90"):
            assert 0.0 <= float(kv[f"{corpus}_{key}"]) <= 1.0
        assert float(kv[f"{corpus}_winkler50_vs_constwidth"]) > 0
        # 4 validation rows have no finite conformal 90% quantile (it needs n >= 9): inf / inf there
        assert f"{corpus}_winkler90_vs_constwidth" in kv and f"{corpus}_pinball_vs_constwidth" in kv
        # the digit LoRA's sampled intervals and the cost beside the quality (docs/numeric_quality.md)
        assert 0.0 <= float(kv[f"{corpus}_digit_sample_parse_rate"]) <= 1.0
        assert float(kv[f"{corpus}_winkler50_vs_digit_sampled"]) > 0
        assert float(kv[f"{corpus}_forwards_per_pred_causal"]) == 1.0
        assert float(kv[f"{corpus}_forwards_per_pred_digit"]) >= 4  # 4 samples (--quick), >= 1 token each
        assert float(kv[f"{corpus}_seconds_per_pred_causal"]) > 0 and float(kv[f"{corpus}_seconds_per_pred_digit"]) > 0
    assert kv["input_path"] == "default"

    # the markdown: one table per corpus, a row per variant that applies, finite MAE and ratio
    text = out.read_text(encoding="utf-8")
    data = json.loads(out.with_suffix(".json").read_text(encoding="utf-8"))
    for corpus, absent in (("sunspots", ()), ("diabetes", ("persistence", "seasonal_naive"))):
        res = data["results"][corpus]
        block = text.split(f"| {corpus} TEST")[1].split("\n\n")[0]
        for name in nq.VARIANTS:
            if name in absent or name in nq.ABLATIONS or (name == "seasonal_naive" and corpus not in nq.SEASON):
                assert name not in res
                continue
            row = next(line for line in block.splitlines() if line.startswith(f"| {nq.LABELS[name]} |"))
            cells = [c.strip() for c in row.strip("|").split("|")]
            assert math.isfinite(float(cells[1])) and math.isfinite(float(cells[3])), (corpus, name, cells)
            t = res[name]["test"]
            assert float(cells[1]) == pytest.approx(t["mae"], rel=1e-3)
            if name in ("ridge_probe", "causal_frozen", "causal_lora"):  # Cauchy intervals
                assert 0.0 <= t["coverage_50"] <= t["coverage_90"] <= 1.0 and t["width_90"] > 0
                assert math.isfinite(t["nll"])
            else:
                assert cells[4] == cells[5] == "n/a"
        ref = "persistence" if corpus == "sunspots" else "constant"
        assert float(kv[f"{corpus}_lora_vs_{ref}"]) == pytest.approx(
            res["causal_lora"]["test"]["mae"] / res[ref]["test"]["mae"], rel=1e-3)
        assert res["causal_frozen"]["steps"] == res["causal_lora"]["steps"] == data["settings"]["steps"]
        # item 7: the validation split's MAE of the frozen adapter, in the RESULT line and the interval table
        assert float(kv[f"{corpus}_frozen_val_mae"]) == pytest.approx(res["causal_frozen"]["validation"]["mae"], rel=1e-3)
        smp = res["digit_lora"]["sampled"]
        assert smp["samples_per_prompt"] == 4 and smp["nll"] is None
        assert "| digit-token LoRA, quantiles of 4 samples (T = 1) |" in text
    # the baselines' figures, recomputed from the corpora (--quick: the first 12 train and 4 test rows):
    # the constant is the train median (not the mean, not a test statistic), persistence the window's last value
    from causal_adapter.data.corpora import build_corpus
    from causal_adapter.numbers import find_numbers

    for corpus in ("sunspots", "diabetes"):
        dd = build_corpus(corpus)
        train_y = sorted(float(v) for v in dd["train"]["target"][:12])
        median = (train_y[5] + train_y[6]) / 2
        test_y = [float(v) for v in dd["test"]["target"][:4]]
        res = data["results"][corpus]
        assert res["constant"]["test"]["mae"] == pytest.approx(sum(abs(y - median) for y in test_y) / 4, rel=1e-9)
        if corpus == "sunspots":
            last = [find_numbers(p)[-2].value for p in dd["test"]["prompt"][:4]]  # "...; 1978: 92.5; 1979:"
            assert res["persistence"]["test"]["mae"] == pytest.approx(
                sum(abs(y - v) for y, v in zip(test_y, last)) / 4, rel=1e-9)
    # the AR(p) baseline really uses the window: on sunspots it beats the constant
    sun = data["results"]["sunspots"]
    assert sun["linear"]["choice"].startswith("AR(")


def test_history_and_ridge_helpers(nq):
    assert nq.history("Title 1990: 5; 1991: 11.5; 1992:") == [5.0, 11.5]
    X = torch.tensor([[0.0], [1.0], [2.0], [3.0]], dtype=torch.float64)
    w = nq.ridge_fit(X, 2 * X[:, 0] + 1, 0.0)
    torch.testing.assert_close(w, torch.tensor([2.0, 1.0], dtype=torch.float64))
    assert nq.input_path(nq.parse_args(["--quick", "--input-path", "seeds"])) == dict(standardize_inputs=False,
                                                                                       direction_norm=1.0)
    assert nq.input_path(nq.parse_args(["--quick"])) == {}
    s = nq.score([1.0, 2.0], [1.5, 4.0], scales=[1.0, 1.0])
    assert s["mae"] == pytest.approx(1.25) and s["coverage_50"] == 0.5 and s["coverage_90"] == 1.0


def test_plain_lora_kept_positions_loss_equals_full_labels_loss(nq, qwen_tokenizer):
    args = nq.parse_args(["--quick"])
    from causal_adapter.data.corpora import build_corpus

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


def test_sample_intervals_use_the_right_quantile_levels(nq):
    # row i's samples are 10 i + 0..100: its tau-quantile is exactly 10 i + 100 tau (order shuffled, one
    # unparsable sample per row that must be ignored)
    g = torch.Generator().manual_seed(0)
    texts = [[f" {10 * i + k}" for k in torch.randperm(101, generator=g).tolist()] + [" n/a"] for i in range(3)]
    y = [3.0, 10 + 50.0, 20 + 99.0]  # below the 5%, at the median, between the 95% and the max
    s = nq.score_samples(texts, y, fallback=-1.0)
    assert s["parse_rate"] == pytest.approx(303 / 306) and s["prompts_without_number"] == 0 and s["nll"] is None
    # 90%: [10 i + 5, 10 i + 95]; 50%: [10 i + 25, 10 i + 75]
    cover90 = [5 <= 3 <= 95, True, False]
    assert s["coverage_90"] == pytest.approx(sum(cover90) / 3) and s["width_90"] == pytest.approx(90.0)
    w90 = [90 + 20 * (5 - 3), 90, 90 + 20 * (99 - 95)]
    w50 = [50 + 4 * (25 - 3), 50, 50 + 4 * (99 - 75)]
    assert s["winkler_90"] == pytest.approx(sum(w90) / 3) and s["winkler_50"] == pytest.approx(sum(w50) / 3)
    rel = [3.0, 50.0, 99.0]  # y - 10 i, against the quantile 100 tau
    pin = [max(t * (r - 100 * t), (t - 1) * (r - 100 * t)) for t in nq.PINBALL_LEVELS for r in rel]
    assert s["pinball"] == pytest.approx(sum(pin) / len(pin))
    # 50%: only the median row; 95% = [10 i + 2.5, 10 i + 97.5]: rows 0 and 1
    assert s["coverage_50"] == pytest.approx(1 / 3) and s["coverage_95"] == pytest.approx(2 / 3)


def test_sample_intervals_missing_samples_and_fallback(nq):
    s = nq.score_samples([[" 10", "none", " 30 and 99"], ["x", "y"]], [20.0, 7.0], fallback=7.0)
    assert s["parse_rate"] == pytest.approx(2 / 5) and s["prompts_without_number"] == 1
    # row 0: samples [10, 30] -> 90% [11, 29] covers 20; row 1: the point 7 (= y: covered, zero width)
    assert s["coverage_90"] == 1.0 and s["width_90"] == pytest.approx(18 / 2)
    assert s["winkler_90"] == pytest.approx(18 / 2)


def test_cauchy_interval_scores_closed_form(nq):
    y = torch.tensor([0.5, -20.0, 3.0], dtype=torch.float64)
    loc, scale = torch.zeros(3, dtype=torch.float64), torch.tensor([1.0, 2.0, 0.5], dtype=torch.float64)
    s = nq.interval_scores(y, loc, scale)

    def q(tau, i):  # the Cauchy tau-quantile of row i
        return float(scale[i]) * math.tan(math.pi * (tau - 0.5))
    w90 = [q(0.95, i) - q(0.05, i) + 20 * (max(q(0.05, i) - float(y[i]), 0) + max(float(y[i]) - q(0.95, i), 0))
           for i in range(3)]
    assert s["winkler_90"] == pytest.approx(sum(w90) / 3)
    pin = [max(t * (float(y[i]) - q(t, i)), (t - 1) * (float(y[i]) - q(t, i))) for t in nq.PINBALL_LEVELS
           for i in range(3)]
    assert s["pinball"] == pytest.approx(sum(pin) / len(pin))
    # |y| / scale = 0.5, 10, 6: the 50% half-width is 1, the 95% one tan(0.475 pi) = 12.7
    assert s["coverage_50"] == pytest.approx(1 / 3) and s["coverage_95"] == 1.0
