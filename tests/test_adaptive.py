"""Intervals on ordered data (docs/predict.md, "Ordered data"): adaptive conformal inference keeps its coverage on a
drifting series where the split-conformal map (fitted before the drift) does not; `predict --targets-column`
uses it, row by row, from earlier rows' targets only."""
import json

import pytest
import torch

from causal_adapter.commands.main import main
from causal_adapter.modeling.adaptive import adaptive_interval, adaptive_multipliers
from causal_adapter.modeling.intervals import fit_calibration, interval


def drifting_series(n: int = 600, seed: int = 0):
    """(y, loc, scale, calibration): predictions loc = 0, scale = 1 on a series whose noise and bias grow
    with time; the calibration map is fitted on 200 rows before the drift (noise sd 1, no bias)."""
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(n, dtype=torch.float64) / n
    y = (1.0 + 3.0 * t) * torch.randn(n, generator=g, dtype=torch.float64) + 2.0 * t
    cal = fit_calibration(torch.randn(200, generator=g, dtype=torch.float64), torch.zeros(200), torch.ones(200))
    return y, torch.zeros(n), torch.ones(n), cal


def _coverage(y, lo, hi) -> float:
    return float(((y >= lo) & (y <= hi)).double().mean())


@pytest.mark.parametrize("level", [0.5, 0.9])
def test_adaptive_intervals_hold_coverage_under_drift_where_split_conformal_fails(level):
    y, loc, scale, cal = drifting_series()
    static = _coverage(y, *interval(loc, scale, level, cal))
    adaptive = _coverage(y, *adaptive_interval(y, loc, scale, level, cal, gamma=0.02))
    assert static < level - 0.15  # the drift breaks exchangeability
    assert abs(adaptive - level) < 0.04


def test_adaptive_row_uses_only_earlier_targets():
    y, loc, scale, cal = drifting_series(n=80)
    c = adaptive_multipliers(y, loc, scale, 0.9, cal, gamma=0.05)
    changed = y.clone()
    changed[40:] = 1e6  # later targets cannot move earlier rows' intervals
    c2 = adaptive_multipliers(changed, loc, scale, 0.9, cal, gamma=0.05)
    assert torch.equal(c[:41], c2[:41]) and not torch.equal(c, c2)
    assert c[0] == adaptive_multipliers(y[:1], loc[:1], scale[:1], 0.9, cal)[0]  # row 0: the map alone
    missing = y.clone()
    missing[10] = float("nan")  # a row without a target changes nothing after it
    c3 = adaptive_multipliers(missing, loc, scale, 0.9, cal, gamma=0.05)
    ref = adaptive_multipliers(torch.cat([y[:10], y[11:]]), torch.cat([loc[:10], loc[11:]]),
                               torch.cat([scale[:10], scale[11:]]), 0.9, cal, gamma=0.05)
    assert torch.equal(torch.cat([c3[:10], c3[11:]]), ref)
    with pytest.raises(ValueError, match="gamma"):
        adaptive_multipliers(y, loc, scale, 0.9, cal, gamma=-1.0)


def test_predict_targets_column_adapts_in_file_order(tmp_path, capsys, saved_adapter_for_aci):
    path, model, tok = saved_adapter_for_aci
    rows = [{"prompt": f"Yearly sunspot numbers. {1900 + i}:", "completion": f" {v:g}", "target": v}
            for i, v in enumerate([40.0 + 9.0 * i for i in range(24)])]  # a trend: misses grow
    data = tmp_path / "series.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    plain, adapted = tmp_path / "plain.jsonl", tmp_path / "adapted.jsonl"
    base = ["predict", str(path), "--data-file", str(data), "--tiny-hidden-size", "32", "--tiny-layers", "1"]
    assert main(base + ["--output", str(plain)]) == 0
    assert main(base + ["--output", str(adapted), "--targets-column", "target", "--aci-gamma", "0.05"]) == 0
    p = [json.loads(x) for x in plain.read_text().splitlines()]
    a = [json.loads(x) for x in adapted.read_text().splitlines()]
    assert [r["target"] for r in a] == [r["target"] for r in rows]
    assert [r["value"] for r in a] == [r["value"] for r in p] and a[0]["upper_90"] == p[0]["upper_90"]
    y, loc, scale = (torch.tensor([r[k] for r in a], dtype=torch.float64) for k in ("target", "value", "scale"))
    lo, hi = adaptive_interval(y, loc, scale, 0.9, model.causal_config.value_calibration, gamma=0.05)
    assert [r["lower_90"] for r in a] == pytest.approx(lo.tolist())
    assert [r["upper_90"] for r in a] == pytest.approx(hi.tolist())
    covered = lambda rs: sum(r["lower_90"] <= t["target"] <= r["upper_90"] for r, t in zip(rs, rows))
    assert covered(a) > covered(p)
    assert main(base + ["--targets-column", "nope"]) == 1
    assert "nope" in capsys.readouterr().err


@pytest.fixture(scope="module")
def saved_adapter_for_aci(tmp_path_factory, qwen_tokenizer):
    """A saved toy adapter whose calibration map is far too narrow for a trending series (scores ~ 0.01)."""
    from causal_adapter.saving.assets import load_base
    from causal_adapter.model import CausalModel, get_causal_model

    base, _ = load_base(None, "qwen2", "float32", 32, 1)
    model = get_causal_model(base, tokenizer=qwen_tokenizer)
    model.set_value_units(60.0, 20.0, 1)
    g = torch.Generator().manual_seed(0)
    model.causal_config.value_calibration = fit_calibration(torch.rand(50, generator=g, dtype=torch.float64) * 0.01,
                                                            torch.zeros(50), torch.ones(50))
    path = tmp_path_factory.mktemp("aci") / "adapter"
    model.save_pretrained(path)
    fresh, _ = load_base(None, "qwen2", "float32", 32, 1)
    return path, CausalModel.from_pretrained(fresh, path, tokenizer=qwen_tokenizer), qwen_tokenizer


def test_evaluate_reports_adaptive_coverage_in_row_order():
    from causal_adapter.training.metrics import coverage_metrics

    y, loc, scale, cal = drifting_series()
    m = coverage_metrics(y.tolist(), loc.tolist(), scale.tolist(), levels=(0.5, 0.9), calibration=cal)
    assert m["coverage_90"] < 0.75 and abs(m["aci_coverage_90"] - 0.9) < 0.04 and abs(m["aci_coverage_50"] - 0.5) < 0.04
    assert m["aci_winkler_90"] < m["winkler_90"]
    assert "aci_coverage_90" not in coverage_metrics(y.tolist(), loc.tolist(), scale.tolist(), levels=(0.9,))
