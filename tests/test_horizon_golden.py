"""A golden horizon: seeded horizons of `test_predict`'s toy adapter (continuations and free text, u drawn per path
and per step) and the per-step maps `fit_horizon_calibration` fits, compared with figures recorded in
tests/data/horizon_golden.json on main 1c2f799, when the horizon still ran a decoding loop of its own (before its
lanes became rows of `generation.loop.StepLoop`). Same seeds, same draws (one [N, C] draw per value, or one per path),
so every figure is the same number.

Tolerance: relative 1e-5. A sampled value is now computed in the heads' float32 (it was float64, then rounded to
float32 when fed back) and a value's heads read from another batch of rows: float32 rounding, at most 4.6e-7 relative
over these figures when the lanes moved onto the step loop (the maps' scores, ratios of small residuals, the most);
a value fed back carries it into the next step, and the mixture's quantile (bisection to 1e-9) adds none. A change of
draws or of what a lane feeds moves these figures by far more (planted: a continuation's numbers fed as 0, one extra
draw a value: each fails here).

Regenerate (only when a change of figures is meant, saying why in the commit): ``python tests/test_horizon_golden.py``.
"""
from __future__ import annotations

import json
import math
import pathlib

import pytest
import torch

GOLDEN = pathlib.Path(__file__).parent / "data" / "horizon_golden.json"
PROMPTS = [
    "Yearly sunspot numbers. 1969: 105.5; 1970: 104.5; 1971: 66.6; 1972: 68.9; 1973: 38; 1974: ",
    "Yearly sunspot numbers. 1975: 15.5; 1976: 12.6; 1977: ",
    "1978: 92.5; 1979: ",
]
CONTS = [["; 1975: ", "; 1976: ", "; 1977: "], ["; 1978: ", "; 1979: ", "; 1980: "], ["; 1980: ", "; 1981: ", "; 1982: "]]
FREE = ["Counts: 3 4 5 ", "Yearly sunspot numbers 105.5 104.5 66.6 "]
REL = 1e-5


def _rows(out: list[dict]) -> list[list[list[float]]]:
    return [[[s[k] for k in ("value", "lower_50", "upper_50", "lower_90", "upper_90")] for s in r["horizon"]]
            for r in out]


def figures(model, tokenizer) -> dict:
    """Every figure the golden file holds, computed now."""
    from datasets import Dataset

    from causal_adapter.data.pipeline import tokenize_dataset
    from causal_adapter.numbers import NumberTokenizer
    from causal_adapter.training.value_head import horizon as fit
    from test_horizon import _forecast_rows, numbers_always_win

    out = {}
    for individual, seed in (("path", 0), ("step", 1)):
        got = model.predict_horizon(PROMPTS, tokenizer=tokenizer, horizon=4, paths=20, continuations=CONTS,
                                    seed=seed, individual=individual, batch_size=2)
        out[f"continuations_{individual}"] = _rows(got)
    with numbers_always_win(model, layout=tokenizer.convert_tokens_to_ids("\u0120")):
        for individual in ("path", "step"):
            got = model.predict_horizon(FREE, tokenizer=tokenizer, horizon=3, paths=20, seed=0, individual=individual)
            out[f"free_{individual}"] = _rows(got)
    g = torch.Generator().manual_seed(1)
    series = []
    for k in range(2):
        walk = (torch.randn(24, generator=g, dtype=torch.float64) * 3.0).cumsum(0) + 60.0 * (k + 1)
        series.append((f"Series {k}.", [round(float(v), 1) for v in walk]))
    ds = tokenize_dataset(Dataset.from_list(_forecast_rows(series, 0, 24, 3, window=4)[:14]),
                          NumberTokenizer(tokenizer, model.num_token_id))
    try:
        summary = fit.fit_horizon_calibration(model, ds, paths=20)
        out["fit_scores"] = summary.scores
        out["fit_maps"] = [m["scores"] for m in model.causal_config.horizon_calibration["steps"]]
    finally:
        model.causal_config.horizon_calibration = None
    return out


def _close(got, want, where: str) -> None:
    if isinstance(want, dict):
        assert set(got) == set(want), where
        for k in want:
            _close(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, list):
        assert len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want)):
            _close(a, b, f"{where}[{i}]")
    else:
        assert math.isfinite(got) == math.isfinite(want), where
        assert got == pytest.approx(want, rel=REL, abs=1e-6), where


@pytest.fixture(scope="module")
def saved(tmp_path_factory, qwen_tokenizer):
    from test_predict import calibrated_adapter

    return calibrated_adapter(tmp_path_factory, qwen_tokenizer, "golden")


def test_seeded_horizons_and_step_maps_are_the_recorded_figures(saved, qwen_tokenizer):
    _, model = saved
    _close(figures(model, qwen_tokenizer), json.loads(GOLDEN.read_text()), "golden")


if __name__ == "__main__":  # record the figures (see the module docstring)
    import sys
    import tempfile

    sys.path.insert(0, str(pathlib.Path(__file__).parent))
    from causal_adapter.saving.assets import load_qwen_tokenizer
    from test_predict import calibrated_adapter

    class _Factory:
        def mktemp(self, name):
            return pathlib.Path(tempfile.mkdtemp(prefix=name))

    tok = load_qwen_tokenizer()
    _, m = calibrated_adapter(_Factory(), tok, "golden")
    GOLDEN.write_text(json.dumps(figures(m, tok), indent=1) + "\n")
    print(f"wrote {GOLDEN}")
