"""`causal-adapter predict` and `CausalModel.predict_values` (docs/predict.md): real files (jsonl, csv),
the embedded tiny base with the real Qwen tokenizer, a saved adapter with value units and a
calibration map, bad rows, and the Python API equal to the command's output."""
import csv
import json
import math

import pytest
import torch

from causal_adapter.commands.main import main
from causal_adapter.modeling.intervals import cauchy_multiplier, conformal_multiplier, fit_calibration

TINY32 = ["--tiny-hidden-size", "32", "--tiny-layers", "1"]
PROMPTS = [
    "Yearly sunspot numbers. 1969: 105.5; 1970: 104.5; 1971: 66.6; 1972: 68.9; 1973: 38; 1974:",
    "Yearly sunspot numbers. 1975: 15.5; 1976: 12.6; 1977:",
    "1978: 92.5; 1979:",
]


def calibrated_adapter(tmp_path_factory, qwen_tokenizer, name: str = "predict"):
    """(adapter dir, the loaded model): value units and a calibration map whose 90% multiplier
    differs from the Cauchy one, so a test can tell calibrated from raw intervals."""
    from causal_adapter.saving.assets import load_base
    from causal_adapter.model import CausalModel, get_causal_model

    base, _ = load_base(None, "qwen2", "float32", 32, 1)
    model = get_causal_model(base, tokenizer=qwen_tokenizer)
    model.set_value_units(39.0, 38.0, 1)
    g = torch.Generator().manual_seed(0)
    y = torch.randn(200, generator=g, dtype=torch.float64) * 2.0  # normal residuals: c_90 ~ 3.3, not 6.3
    model.causal_config.value_calibration = fit_calibration(y, torch.zeros(200), torch.ones(200))
    path = tmp_path_factory.mktemp(name) / "adapter"
    model.save_pretrained(path)
    fresh, _ = load_base(None, "qwen2", "float32", 32, 1)
    return path, CausalModel.from_pretrained(fresh, path, tokenizer=qwen_tokenizer)


@pytest.fixture(scope="module")
def saved(tmp_path_factory, qwen_tokenizer):
    return calibrated_adapter(tmp_path_factory, qwen_tokenizer)


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_predict_values_reads_the_last_prompt_position_with_calibrated_intervals(saved, qwen_tokenizer):
    _, model = saved
    out = model.predict_values(PROMPTS, tokenizer=qwen_tokenizer, levels=(0.5, 0.9), batch_size=2)
    assert [r["row"] for r in out] == [0, 1, 2]
    from causal_adapter.numbers import NumberTokenizer

    ntok = NumberTokenizer(qwen_tokenizer)
    cal = model.causal_config.value_calibration
    for prompt, r in zip(PROMPTS, out):
        enc = ntok([prompt])  # alone: no padding
        ref = model(enc["input_ids"], enc["numeric_values"], enc["attention_mask"])
        assert r["value"] == pytest.approx(float(ref.loc_Y[0, -1]), rel=1e-5, abs=1e-4)
        assert r["scale"] == pytest.approx(float(ref.scale_Y[0, -1]), rel=1e-5)
        assert 0.0 <= r["p_num"] <= 1.0
        for level in (0.5, 0.9):
            n = round(100 * level)
            c, raw = conformal_multiplier(cal, level), cauchy_multiplier(level)
            assert r[f"upper_{n}"] - r["value"] == pytest.approx(c * r["scale"], rel=1e-6)
            assert r["value"] - r[f"lower_{n}"] == pytest.approx(c * r["scale"], rel=1e-6)
            assert r[f"raw_upper_{n}"] - r["value"] == pytest.approx(raw * r["scale"], rel=1e-6)
        assert r["upper_90"] - r["lower_90"] < 0.7 * (r["raw_upper_90"] - r["raw_lower_90"])  # calibrated, not raw
    # batching (left padding next to a longer prompt) changes nothing
    one = [model.predict_values([p], tokenizer=qwen_tokenizer)[0] for p in PROMPTS]
    for a, b in zip(out, one):
        assert a["value"] == pytest.approx(b["value"], rel=1e-5, abs=1e-4)
    with pytest.raises(ValueError, match="prompt 1 must be a non-empty string"):
        model.predict_values(["ok 1:", ""], tokenizer=qwen_tokenizer)
    with pytest.raises(ValueError, match=r"level must be in \(0, 1\)"):
        model.predict_values(PROMPTS, tokenizer=qwen_tokenizer, levels=(0.5, 1.5))


def test_predict_command_jsonl_with_bad_rows_equals_the_python_api(tmp_path, saved, qwen_tokenizer, capsys):
    adapter, model = saved
    rows = [{"prompt": PROMPTS[0], "completion": " 40.1"}, {"prompt": None, "completion": " 3"},
            {"prompt": PROMPTS[1], "completion": " 27.5"}, {"prompt": "", "completion": " 1"},
            {"prompt": PROMPTS[2], "completion": None}]
    data = _jsonl(tmp_path / "rows.jsonl", rows)
    out = tmp_path / "pred.jsonl"
    assert main(["predict", str(adapter), *TINY32, "--data-file", str(data), "--output", str(out)]) == 0
    err = capsys.readouterr().err
    assert "row 1: column 'prompt' is null: skipped" in err
    assert "row 3: column 'prompt' is empty: skipped" in err
    assert "3 of 5 rows written" in err and "(2 skipped" in err
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["row"] for r in got] == [0, 2, 4]
    assert list(got[0]) == ["row", "value", "scale", "p_num", "lower_50", "upper_50", "raw_lower_50", "raw_upper_50",
                            "lower_90", "upper_90", "raw_lower_90", "raw_upper_90", "series", "support", "transform"]
    # the completion's text before its number is part of the prompt (where eval reads the value)
    api = model.predict_values([PROMPTS[0] + " ", PROMPTS[1] + " ", PROMPTS[2]], tokenizer=qwen_tokenizer)
    for g, a, row in zip(got, api, (0, 2, 4)):
        assert g["row"] == row
        for k in a:
            if isinstance(a[k], str):  # series, support, transform
                assert g[k] == a[k], k
            elif k != "row":
                assert g[k] == pytest.approx(a[k], rel=1e-5, abs=1e-4), k
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary file left


def test_predict_command_csv_levels_and_stdout(tmp_path, saved, qwen_tokenizer, capsys):
    adapter, model = saved
    data = tmp_path / "rows.csv"
    data.write_text("prompt\n" + "\n".join(f'"{p}"' for p in PROMPTS) + "\n")
    out = tmp_path / "pred.csv"
    args = ["predict", str(adapter), *TINY32, "--data-file", str(data), "--levels", "0.8", "0.95"]
    assert main(args + ["--output", str(out)]) == 0
    with open(out, newline="") as fh:
        got = list(csv.DictReader(fh))
    assert list(got[0]) == ["row", "value", "scale", "p_num", "lower_80", "upper_80", "raw_lower_80",
                            "raw_upper_80", "lower_95", "upper_95", "raw_lower_95", "raw_upper_95", "series", "support",
                            "transform"]
    api = model.predict_values(PROMPTS, tokenizer=qwen_tokenizer, levels=(0.8, 0.95))
    for g, a in zip(got, api):
        assert int(g["row"]) == a["row"]
        for k in ("value", "lower_80", "upper_95", "raw_lower_95", "p_num"):
            assert float(g[k]) == pytest.approx(a[k], rel=1e-5, abs=1e-4), k
    capsys.readouterr()
    # without --output: jsonl on stdout, nothing else there (messages and the bar go to stderr)
    assert main(args) == 0
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert len(lines) == 3 and all(math.isfinite(json.loads(x)["value"]) for x in lines)
    assert "predict: 3 of 3 rows written to stdout" in captured.err


def test_predict_command_errors_are_short_and_keep_the_previous_output(tmp_path, saved, capsys):
    adapter, _ = saved
    data = _jsonl(tmp_path / "rows.jsonl", [{"prompt": PROMPTS[2]}])
    out = tmp_path / "pred.jsonl"
    out.write_text("previous\n")
    for extra, needle in ((["--output", str(tmp_path / "p.txt")], "give a .jsonl or .csv file name"),
                          (["--levels", "0.5", "1.5"], "level must be in (0, 1)")):
        assert main(["predict", str(adapter), *TINY32, "--data-file", str(data), *extra]) == 1
        err = capsys.readouterr().err
        assert needle in err and len(err.strip().splitlines()) <= 2, err
    bad = _jsonl(tmp_path / "bad.jsonl", [{"prompt": None}, {"prompt": 3}])
    assert main(["predict", str(adapter), *TINY32, "--data-file", str(bad), "--output", str(out)]) == 1
    err = capsys.readouterr().err
    assert "row 1: column 'prompt' is not a string (3)" in err and "no row of" in err
    assert out.read_text() == "previous\n"  # a failed run leaves the previous file as it was
    nocol = _jsonl(tmp_path / "nocol.jsonl", [{"body": "x 1:"}])
    assert main(["predict", str(adapter), *TINY32, "--data-file", str(nocol)]) == 1
    assert "--prompt-column / --text-column" in capsys.readouterr().err


def test_demo_interval_summary_and_plot_use_the_calibration_map(tmp_path, saved):
    from causal_adapter.training.demo import format_interval_summary, interval_summary
    from causal_adapter.training.plotting import plot_training

    _, model = saved
    g = torch.Generator().manual_seed(1)
    y = (torch.randn(400, generator=g, dtype=torch.float64) * 2.0).tolist()  # the map's own residual law
    preds = {"y_true": y, "loc": [0.0] * 400, "scale": [1.0] * 400}
    s = interval_summary(model, preds)
    assert s["calibrated"] is True and s["n"] == 400
    assert s["coverage_50"] == pytest.approx(0.5, abs=0.08) and s["coverage_90"] == pytest.approx(0.9, abs=0.05)
    c90 = conformal_multiplier(model.causal_config.value_calibration, 0.9)
    assert s["width_90"] == pytest.approx([2 * c90] * 3)  # one scale: min = median = max
    assert "calibrated (split-conformal" in format_interval_summary(s)
    pytest.importorskip("matplotlib")
    raw = plot_training([], preds, tmp_path / "raw.png")
    cal = plot_training([], preds, tmp_path / "cal.png", calibration=model.causal_config.value_calibration)
    assert raw.read_bytes() != cal.read_bytes()
