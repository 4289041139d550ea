"""Each series' own AR on the row's window (issue 66; `modeling.series_ar`, `training.value_head.series_ar`): one
value head serves every series of a file, and a series whose dynamics the shared head misses gets, where its
validation rows choose it, its own AR mixed into the head's location.

The case: one file with a series that zigzags around its level (each value the mirror of the last: an AR(1) of
-0.9) beside a random walk over the same range and a trend, trained with `causal-adapter train` (each series' own
AR is on by default).
Claims, each failing when its mechanism is removed:
* training chooses an AR for the series the shared head misses (an ``ar`` entry in `value_series`), and it lowers
  that series' test error;
* `predict` gives the mix of the head's location and the AR, computed here by hand from the row's numbers;
* a series with an AR gets its own width factor (its errors are no longer the shared head's);
* `generate` writes the same value as `predict` for the same rows (the step loop mixes it too);
* a series the head already reads well keeps the head (the one-standard-error rule).
"""
import random

import numpy as np
import pytest
import torch

from causal_adapter.commands.main import main
from causal_adapter.training.value_head.series_ar import WindowRows, choose_series_ar
from causal_adapter.modeling.value_transform import ValueMap
from test_default_recipe import TINY32, _jsonl
from test_series import _split_rows as split_rows

TITLES = {"zigzag": "Weekly zigzag index", "walk": "Weekly wandering index", "trend": "Yearly output"}
WINDOW = 8


def _series(n: int, seed: int) -> dict[str, list[float]]:
    """Two series over the same range with opposite dynamics, which one set of weights on the last values cannot
    both read: a zigzag (each value the mirror of the last around 50) and a random walk from 50; and a trend."""
    r = random.Random(seed)
    zig, walk, trend = [50.0], [50.0], []
    for i in range(n):
        if i:
            zig.append(50 - 0.9 * (zig[-1] - 50) + r.gauss(0, 1))
            walk.append(walk[-1] + r.gauss(0, 1))
        trend.append(20 + 0.8 * i + r.gauss(0, 0.5))
    return {name: [round(v, 2) for v in values] for name, values in
            (("zigzag", zig), ("walk", walk), ("trend", trend))}


def _split_rows(n: int = 110):
    return split_rows(n, WINDOW, _series(n, 1), TITLES)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, qwen_tokenizer):
    from causal_adapter.model import CausalModel
    from causal_adapter.saving.assets import load_base

    tmp = tmp_path_factory.mktemp("series_ar")
    rows = _split_rows()
    args = ["train", "--train-file", _jsonl(tmp / "train.jsonl", rows["train"]),
            "--validation-file", _jsonl(tmp / "val.jsonl", rows["val"]), "--max-steps", "20",
            "--output-dir", str(tmp / "run"), "--no-plot", "--no-progress", *TINY32]
    assert main(args) == 0
    base, _ = load_base(None, "qwen2", "float32", 32, 1)
    model = CausalModel.from_pretrained(base, tmp / "run" / "adapter", tokenizer=qwen_tokenizer)
    return model, rows


def _by_name(model) -> dict:
    return {e["name"]: e for e in model.causal_config.value_series.values()}


def _predict(model, tokenizer, prompts, with_ar: bool):
    table = model.causal_config.value_series
    saved = {k: e.pop("ar") for k, e in table.items() if "ar" in e and not with_ar}
    try:
        return model.predict_values(prompts, tokenizer=tokenizer, levels=(0.5, 0.9))
    finally:
        for k, ar in saved.items():
            table[k]["ar"] = ar


def _by_hand(row: dict, loc_Y: float, ar: dict) -> float:
    """The mix of `modeling.series_ar`, from the row's values as written (every second number of the window)."""
    values = [float(p.split(": ")[1]) for p in row["prompt"].split("; ")[:-1]]
    S = np.array(values[::-1])  # newest first
    m, s = S[0], np.abs(np.diff(S)).mean()
    lags = len(ar["coef"])
    x = np.r_[1.0, (S[1:lags] - m) / s]
    return ar["mix"] * loc_Y + (1 - ar["mix"]) * (m + s * float(x @ np.array(ar["coef"])))


def _with_ar(model) -> str:
    """The series (of `TITLES`) training gave an AR."""
    names = [name for name, title in TITLES.items() if "ar" in _by_name(model)[title]]
    assert names, {k: e.get("ar") for k, e in _by_name(model).items()}
    return names[0]


def test_a_series_the_head_misses_gets_its_own_ar_and_a_lower_test_error(trained, qwen_tokenizer):
    """The shared head reads the zigzag and the trend (its weights on loc_U, which knows the title), not the walk
    beside the zigzag: the walk gets its AR (persistence, nearly: a walk's best forecast), the others keep the head."""
    model, rows = trained
    assert _with_ar(model) == "walk" and "ar" not in _by_name(model)[TITLES["trend"]]
    # its errors are no longer the shared head's: its width gets a factor of its own (20 validation rows), the
    # others keep the shared map's (no --series-widths)
    assert "scale" in _by_name(model)[TITLES["walk"]]
    assert all("scale" not in _by_name(model)[TITLES[n]] for n in ("zigzag", "trend"))
    test = [r for r in rows["test"] if r["series"] == "walk"]
    prompts = [r["prompt"] for r in test]
    y = np.array([float(r["target"]) for r in test])
    mixed = np.array([p["value"] for p in _predict(model, qwen_tokenizer, prompts, True)])
    head = np.array([p["value"] for p in _predict(model, qwen_tokenizer, prompts, False)])
    assert np.abs(mixed - y).mean() < 0.9 * np.abs(head - y).mean()


def test_predict_gives_the_mix_of_the_head_and_the_ar(trained, qwen_tokenizer):
    model, rows = trained
    name = _with_ar(model)
    ar = _by_name(model)[TITLES[name]]["ar"]
    test = [r for r in rows["test"] if r["series"] == name][:6]
    prompts = [r["prompt"] for r in test]
    mixed = _predict(model, qwen_tokenizer, prompts, True)
    head = _predict(model, qwen_tokenizer, prompts, False)
    assert model.value_map.transform == "identity"  # loc_Y is the value itself here
    for r, p, h in zip(test, mixed, head):
        assert p["value"] == pytest.approx(_by_hand(r, h["value"], ar), rel=1e-6, abs=1e-6)
        # the width is the head's: the interval moves with the location
        assert p["upper_90"] - p["lower_90"] == pytest.approx(h["upper_90"] - h["lower_90"], rel=1e-6)


def test_generate_writes_the_value_predict_gives(trained, qwen_tokenizer):
    model, rows = trained
    test = [r for r in rows["test"] if r["series"] == _with_ar(model)][:4]
    prompts = [r["prompt"] for r in test]
    preds = _predict(model, qwen_tokenizer, prompts, True)
    with torch.no_grad():
        model.action.b_cls[model.num_token_id] += 1e4  # <NUM> the argmax: every row writes a number
    try:
        gen = model.generate(prompts, tokenizer=qwen_tokenizer, max_new_tokens=2, mode="deterministic")
    finally:
        with torch.no_grad():
            model.action.b_cls[model.num_token_id] -= 1e4
    for p, numbers in zip(preds, gen.numbers):
        assert numbers[0]["value"] == pytest.approx(p["value"], abs=0.006)  # written with the data's 2 decimals


def test_a_series_the_head_reads_well_keeps_the_head(qwen_tokenizer):
    """`choose_series_ar` on rows built here: series "a" follows a straight line (its AR(2) is exact, a head at
    persistence is not), series "b" is the head's own prediction plus noise (no AR can beat it): only "a" gets one."""
    g = torch.Generator().manual_seed(0)
    n, W = 60, 16
    t = torch.arange(n + W, dtype=torch.float64)
    line = 3.0 * t + 7

    def windows(y):
        return torch.stack([y[i:i + W].flip(0) for i in range(n)]), y[W:W + n]

    ra, ya = windows(line)
    noise = torch.randn(n + W, generator=g, dtype=torch.float64)
    rb, yb = windows(100 + noise)
    train = WindowRows(["a"] * 40 + ["b"] * 40, torch.cat([ra[:40], rb[:40]]), torch.cat([ya[:40], yb[:40]]))
    val = WindowRows(["a"] * 20 + ["b"] * 20, torch.cat([ra[40:], rb[40:]]), torch.cat([ya[40:], yb[40:]]))
    head = torch.cat([ra[40:, 0], yb[40:] + 0.01 * torch.randn(20, generator=g, dtype=torch.float64)])
    table = {"a": {"support": "positive", "rows": 80}, "b": {"support": "positive", "rows": 80}}
    loc, chosen = choose_series_ar(table, ValueMap(), train, val, head)
    assert chosen == 1 and "ar" in table["a"] and "ar" not in table["b"]
    assert torch.allclose(loc[:20], ya[40:], atol=1e-3)  # the line, read exactly
    assert torch.equal(loc[20:], head[20:])


def test_evaluation_reads_the_value_predict_gives(trained, qwen_tokenizer):
    """`causal-adapter eval` and the validation metrics (`training.metrics`) score the mixed value, as predict
    gives it: the per-target values of an evaluation equal predict's for the same rows."""
    from datasets import Dataset

    from causal_adapter.data.pipeline import tokenize_dataset
    from causal_adapter.numbers import NumberTokenizer
    from causal_adapter.training.metrics import evaluate_dataset

    model, rows = trained
    test = [r for r in rows["test"] if r["series"] == _with_ar(model)][:6]
    ntok = NumberTokenizer(qwen_tokenizer, model.num_token_id)
    ds = tokenize_dataset(Dataset.from_list([{"prompt": r["prompt"], "completion": r["completion"]} for r in test]),
                          ntok)
    _, got = evaluate_dataset(model, ds, ntok.pad_token_id, batch_size=8, return_predictions=True)
    want = _predict(model, qwen_tokenizer, [r["prompt"] for r in test], True)
    assert got["value"] == pytest.approx([p["value"] for p in want], rel=1e-6, abs=1e-6)
