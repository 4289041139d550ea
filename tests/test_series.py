"""One file, many series (issue 66; `modeling.series`): each series of a training file keeps its own support and its
own width, found by its text.

The case, as a user meets it: one file mixing a yearly count with zeros, a small positive quantity and a rate that
goes below zero, trained with `causal-adapter train` and its defaults. Before, one 0 and one negative value made the
whole adapter unrestricted: the positive series' intervals reached below 0.

Claims, each failing when its mechanism is removed:
* the adapter records each series with its support (positive / nonneg / signed), found by the title of its rows;
* `predict` floors the values and bounds of the positive and nonneg series at 0, not the signed one's, and says
  per row which series, support and transform it used; a title training never saw falls back to the row's numbers;
* the horizon's paths and intervals of a nonneg series never go below 0;
* the calibration gives each series with enough validation rows its own width factor: a quiet series narrows, a
  noisy one widens, and one shared conformal map is fitted on the rows so rescaled.
"""
import math
import random

import pytest
import torch

from causal_adapter.commands.main import main
from causal_adapter.data.corpora import series_rows
from causal_adapter.modeling.series import MIN_SERIES_ROWS, last_keys, position_keys, positive_series, row_key
from test_default_recipe import TINY32, _jsonl

TITLES = {"count": "Yearly storm counts", "small": "Quarterly ratio of sales", "rate": "Monthly real rate"}


def _series(n: int, seed: int) -> dict[str, list[float]]:
    r = random.Random(seed)
    count = [float(max(0, round(3 + 3 * math.sin(i / 3) + r.gauss(0, 1.5)))) for i in range(n)]
    small = [round(max(0.05, 0.8 + 0.5 * math.sin(i / 2) + r.gauss(0, 0.35)), 2) for i in range(n)]
    rate = [round(0.5 + 2 * math.sin(i / 5) + r.gauss(0, 0.8), 2) for i in range(n)]
    return {"count": count, "small": small, "rate": rate}


def _split_rows(n: int = 90, window: int = 6, series: dict[str, list[float]] | None = None,
                titles: dict[str, str] = TITLES):
    """(train, validation, test) rows: each series (default `_series(n, 0)`) split by time 60 / 20 / 20%."""
    out = {"train": [], "val": [], "test": []}
    for name, values in (series or _series(n, 0)).items():
        times = [str(1900 + i) for i in range(n)]
        rows = series_rows(name, titles[name], times, values, window)
        a, b = int(0.6 * len(rows)), int(0.8 * len(rows))
        out["train"] += rows[:a]
        out["val"] += rows[a:b]
        out["test"] += rows[b:]
    return out


@pytest.fixture(scope="module")
def panel(tmp_path_factory, qwen_tokenizer):
    """(the reloaded adapter, the split rows) after `causal-adapter train` on the mixed file."""
    from causal_adapter.model import CausalModel
    from causal_adapter.saving.assets import load_base

    tmp = tmp_path_factory.mktemp("series")
    rows = _split_rows()
    assert any(float(r["target"]) == 0 for r in rows["train"] if r["series"] == "count")
    assert any(float(r["target"]) < 0 for r in rows["train"] if r["series"] == "rate")
    args = ["train", "--train-file", _jsonl(tmp / "train.jsonl", rows["train"]),
            "--validation-file", _jsonl(tmp / "val.jsonl", rows["val"]), "--max-steps", "20",
            "--output-dir", str(tmp / "run"), "--no-plot", "--no-progress", "--value-transform", "series", *TINY32]
    assert main(args) == 0
    base, _ = load_base(None, "qwen2", "float32", 32, 1)
    model = CausalModel.from_pretrained(base, tmp / "run" / "adapter", tokenizer=qwen_tokenizer)
    return model, rows


def test_each_series_is_recorded_with_its_support(panel):
    model, _ = panel
    cfg = model.causal_config
    assert cfg.value_positive is False  # the file as a whole holds a 0 and a negative value
    supports = {e["name"]: e["support"] for e in cfg.value_series.values()}
    assert supports == {TITLES["count"]: "nonneg", TITLES["small"]: "positive", TITLES["rate"]: "signed"}


def test_predict_floors_the_non_negative_series_only(panel, qwen_tokenizer):
    model, rows = panel
    test = rows["test"]
    preds = model.predict_values([r["prompt"] for r in test], tokenizer=qwen_tokenizer, levels=(0.5, 0.9))
    by = {name: [p for p, r in zip(preds, test) if r["series"] == name] for name in TITLES}
    for name in ("count", "small"):
        assert all(p["series"] == TITLES[name] for p in by[name])
        assert all(min(p["value"], p["lower_90"], p["lower_50"]) >= 0 for p in by[name]), name
    assert {p["support"] for p in by["count"]} == {"nonneg"} and {p["support"] for p in by["small"]} == {"positive"}
    assert {p["support"] for p in by["rate"]} == {"signed"}
    # a "series" head: the positive series on log y, the others on the value (test_a_zero_in_one_series_...)
    assert model.value_map.transform == "series"
    assert {p["transform"] for p in by["small"]} == {"log"}
    assert {p["transform"] for p in by["count"] + by["rate"]} == {"identity"}
    # the floor is the series', not the adapter's: the signed series' intervals still reach below 0, and the raw
    # (unfloored) intervals of the positive series would have
    assert any(p["lower_90"] < 0 for p in by["rate"])
    assert any(p["raw_lower_90"] < 0 or p["lower_90"] == 0 for p in by["small"] + by["count"])


def test_a_zero_in_one_series_leaves_another_on_log_y(panel, qwen_tokenizer):
    """The count's zeros keep it on the value (floored), and the positive series is told on log y all the same:
    its bounds are positive by construction (exp of the log ones, not a floor at 0) and wider above than below."""
    model, rows = panel
    small = [r for r in rows["test"] if r["series"] == "small"]
    preds = model.predict_values([r["prompt"] for r in small], tokenizer=qwen_tokenizer, levels=(0.5, 0.9))
    assert {p["transform"] for p in preds} == {"log"}
    assert all(p["raw_lower_90"] > 0 and p["lower_90"] > 0 for p in preds)
    assert all(p["upper_90"] - p["value"] > p["value"] - p["lower_90"] for p in preds)
    # what generate writes for the same rows: on log y too (intervals positive and skewed the same way); <NUM> made
    # the argmax (a bias of 1e4), so every row writes a number
    with torch.no_grad():
        model.action.b_cls[model.num_token_id] += 1e4
    try:
        gen = model.generate([r["prompt"] for r in small[:4]], tokenizer=qwen_tokenizer, max_new_tokens=2,
                             mode="deterministic")
    finally:
        with torch.no_grad():
            model.action.b_cls[model.num_token_id] -= 1e4
    for p, numbers in zip(preds, gen.numbers):
        number = numbers[0]
        lo, hi = number["raw_interval_90"]
        assert number["value"] == pytest.approx(p["value"], abs=0.006)  # written with the data's 2 decimals
        assert 0 < lo < number["exact"] < hi and hi - number["exact"] > number["exact"] - lo


def test_only_a_positive_series_of_enough_values_is_told_on_log_y():
    """A table's rows, each a "series" of one value by its text, would each tell the sign of its own target."""
    table = {"a": {"support": "positive", "rows": MIN_SERIES_ROWS}, "b": {"support": "positive", "rows": 1},
             "c": {"support": "nonneg", "rows": 50}, "d": {"support": "signed", "rows": 50}}
    assert positive_series(["a", "b", "c", "d", "unseen"], table) == [True, False, False, False, False]
    assert positive_series(["a"], None) == [False]


def test_a_log_row_without_numbers_of_its_own_keeps_the_log_units(panel):
    """A row on log y with too few numbers for units of its own takes the head's units on log y (`head_log_units`,
    fitted on the positive series' logs), not the value's: the same standardised head, in the other units."""
    model, _ = panel
    act = model.action
    assert act.head_log_units is not None and act.row_rule is not None
    C = act.w_reg.numel()
    loc_U = torch.zeros(2, C, dtype=act.b_reg.dtype)
    recent = torch.full((2, act.recent_window), float("nan"), dtype=act.b_reg.dtype)
    with torch.no_grad():
        loc, _ = act.regression(loc_U, loc_U + 1, recent, torch.tensor([True, False]))
    (log_loc, log_scale), (loc0, scale0) = act.head_log_units, (act.head_loc, act.head_scale)
    assert (float(loc[0]) - log_loc) / log_scale == pytest.approx((float(loc[1]) - loc0) / scale0, rel=1e-4)
    assert abs(log_loc - loc0) > 1e-3 or abs(log_scale - scale0) > 1e-3  # the two units differ here


def test_an_unseen_title_falls_back_to_the_rows_numbers(panel, qwen_tokenizer):
    model, rows = panel
    count = next(r for r in rows["test"] if r["series"] == "count")
    rate = next(r for r in rows["test"] if r["series"] == "rate" and "-" in r["prompt"].split(TITLES["rate"])[1])
    renamed = [count["prompt"].replace(TITLES["count"], "Some other counts"),
               rate["prompt"].replace(TITLES["rate"], "Some other rate")]
    p_count, p_rate = model.predict_values(renamed, tokenizer=qwen_tokenizer, levels=(0.9,))
    assert p_count["series"] == "" and p_count["support"] == "nonneg" and p_count["lower_90"] >= 0
    assert p_rate["series"] == "" and p_rate["support"] == "signed"


def test_the_horizon_of_a_non_negative_series_stays_above_zero(panel, qwen_tokenizer):
    model, rows = panel
    prompts = [r["prompt"] for r in rows["test"] if r["series"] in ("count", "small")][:4]
    out = model.predict_horizon(prompts, tokenizer=qwen_tokenizer, horizon=4, paths=40, levels=(0.9,),
                                continuations=[[f"; {2100 + h}:" for h in range(3)]] * len(prompts), seed=0)
    lows = [s["lower_90"] for r in out for s in r["horizon"]] + [s["value"] for r in out for s in r["horizon"]]
    assert min(lows) >= 0


def test_keys_name_the_row_by_its_text_up_to_its_first_record():
    num = 7
    ids = torch.tensor([[0, 0, 5, 6, num, 9, num, 3],   # left padding (0) is not text
                        [5, 6, num, 9, num, 3, 1, 1]])
    vals = torch.zeros(2, 8)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1]])
    a, b = last_keys(ids, vals, num, mask)
    assert a == b == row_key([5, 6])
    # packed: each segment is a row of its own; the position before the first number reads the title so far
    packed = torch.tensor([[5, 6, num, 9, 8, num, 2]])
    starts = torch.tensor([[True, False, False, False, True, False, False]])
    at = torch.tensor([[False, True, True, False, True, False, True]])
    assert position_keys(packed, torch.zeros(1, 7), num, at, row_starts=starts) == [row_key([5, 6])] * 2 + \
        [row_key([8])] * 2


def test_a_number_in_the_title_names_the_series(qwen_tokenizer):
    """``Series 7. 1990: 5; ...`` and ``Series 8. ...``: the title's number is part of the name (the records, a year
    and a value, start after it), so the two are two series; the records' numbers are not."""
    from causal_adapter.numbers import NumberTokenizer
    from causal_adapter.modeling.series import text_key, title_numbers

    ntok = NumberTokenizer(qwen_tokenizer)

    def key(text):
        e = ntok.encode_batch([text], return_offsets=False)[0]
        return text_key(e.input_ids, e.numeric_values, ntok.num_token_id)

    rows = {s: "; ".join(f"{1990 + i}: {v}" for i, v in enumerate(vals))
            for s, vals in (("a", [5, 6, 7, 6, 8]), ("b", [50, 61, 57, 66, 80]))}
    enc = ntok.encode_batch([f"Series 7. {rows['a']}; 1995:", "Monthly 1990 Q1: 5; 1990 Q2: 6; 1990 Q3: 7; 1990 Q4:"],
                            return_offsets=False)
    assert [title_numbers(e.input_ids, ntok.num_token_id) for e in enc] == [1, 0]
    assert key(f"Series 7. {rows['a']}; 1995:") == key(f"Series 7. {rows['b']}; 1995:")  # the same series
    assert key(f"Series 7. {rows['a']}; 1995:") != key(f"Series 8. {rows['a']}; 1995:")
    assert key(f"Yearly sunspots {rows['a']}; 1995:") == key(f"Yearly sunspots {rows['b']}; 1995:")


def test_each_series_gets_its_own_width_and_one_shared_map():
    """The calibration on validation predictions of a quiet and a noisy series whose head gives both the same
    width: the quiet one's factor < 1 < the noisy one's, and the shared map is fitted on the rescaled rows."""
    from causal_adapter.training.value_head.calibration import calibrate_regression_scale
    from test_values import wrap

    model = wrap()
    model.set_value_units(0.0, 1.0, 2)
    gen = torch.Generator().manual_seed(0)
    n = 4 * MIN_SERIES_ROWS
    noise = torch.randn(2 * n, generator=gen, dtype=torch.float64)
    sd = torch.cat([torch.full((n,), 0.2), torch.full((n,), 5.0)]).double()
    y = 10 + sd * noise
    keys = ["quiet"] * n + ["noisy"] * n + ["rare"] * (MIN_SERIES_ROWS - 1)
    y = torch.cat([y, 10 + torch.randn(MIN_SERIES_ROWS - 1, generator=gen, dtype=torch.float64)])
    model.causal_config.value_series = {k: {"support": "positive", "rows": 100, "name": k}
                                        for k in ("quiet", "noisy", "rare")}
    preds = {"y_true": y.tolist(), "loc": [10.0] * len(y), "scale": [1.0] * len(y), "series": keys}
    calibrate_regression_scale(model, preds, series_widths=True)
    table = model.causal_config.value_series
    assert "scale" not in table["rare"]  # too few validation rows: the panel's width
    quiet, noisy = table["quiet"]["scale"], table["noisy"]["scale"]
    own = [float((y[rows] - 10).abs().median()) for rows in (slice(0, n), slice(n, 2 * n))]  # their own medians
    assert quiet < 0.5 < 2.0 < noisy and noisy / quiet == pytest.approx(own[1] / own[0], rel=1e-6)
    # per series, the calibrated 50% interval covers about half of its own rows
    c50 = model.causal_config.value_calibration
    from causal_adapter.modeling.intervals import conformal_multiplier
    b = float(model.action.b_noise_Y.detach().abs().max())
    for name, f, rows in (("quiet", quiet, slice(0, n)), ("noisy", noisy, slice(n, 2 * n))):
        half = conformal_multiplier(c50, 0.5) * b * f
        cover = float(((y[rows] - 10).abs() <= half).double().mean())
        assert 0.3 < cover < 0.7, (name, cover)


def test_generate_writes_no_value_below_zero_for_a_non_negative_series(panel, qwen_tokenizer):
    """Causal sampling draws values from the head's Cauchy: on the count (never below 0, and on the value: it has
    zeros) many land below 0; each is floored (and its intervals), while the signed series writes what it draws.
    <NUM> made the argmax (a bias of 1e4), so every row writes numbers."""
    import copy

    model, rows = panel
    eager = copy.deepcopy(model)
    with torch.no_grad():
        eager.action.b_cls[eager.num_token_id] += 1e4
    count = [r["prompt"] for r in rows["test"] if r["series"] == "count"][:6]
    rate = [r["prompt"] for r in rows["test"] if r["series"] == "rate"][:6]
    gen = eager.generate(count + rate, tokenizer=qwen_tokenizer, max_new_tokens=4, mode="causal", seed=0)
    floored = [n for nums in gen.numbers[:6] for n in nums]
    signed = [n for nums in gen.numbers[6:] for n in nums]
    assert floored and signed
    assert all(n["value"] >= 0 and min(*n["interval_90"], *n["interval_50"]) >= 0 for n in floored)
    assert any(n["value"] == 0 for n in floored)  # the case is met: a draw below 0, floored
    assert any(n["value"] < 0 for n in signed)


# --------------------------------------------------------------------------- seasons inside the window
def _window(labels, values, target_label):
    """A row's recent numbers (newest first) as `heads.recent_values` reads ``L1 Q.: v1; L2 Q.: v2; ...; L:``."""
    nums = [x for pair in zip(labels, values) for x in pair] + [target_label]
    return torch.tensor(nums[::-1], dtype=torch.float64).unsqueeze(0)


QUARTER_YEARS = [1990, 1990, 1990, 1991, 1991, 1991, 1991, 1992]  # 1990 Q2 .. 1992 Q1, the row asks 1992 Q2


def test_a_series_season_is_read_at_its_period():
    """A quarterly series whose season multiplies with a growing level: the labels give the cycle (4 records a
    year), and the "season" rule locates the row at the value a year before times the window's yearly growth:
    the truth here, where "last" is 27% off."""
    from causal_adapter.modeling.row_units import row_location_scale, row_period, row_season

    factors = [1.0, 1.3, 0.8, 0.9]
    values = [100 * 1.05 ** t * factors[(t + 1) % 4] for t in range(9)]
    recent = _window(QUARTER_YEARS, values[:8], 1992)
    assert int(row_season(recent, row_period(recent))) == 4
    aligned = _window([1990] * 4 + [1991] * 4, values[:8], 1992)  # Q1..Q4 twice: the asked label's change counts
    assert int(row_season(aligned, row_period(aligned))) == 4
    loc = float(row_location_scale(recent, "season", 0.0, 1.0, keep=8)[1])
    last = float(row_location_scale(recent, "last", 0.0, 1.0, keep=8)[1])
    assert loc == pytest.approx(values[8], rel=1e-9) and abs(last - values[8]) > 0.2 * values[8]
    # yearly labels change at every record: no cycle; a quarterly random walk shows no season: "last"'s m
    yearly = _window(list(range(1990, 1998)), [5, 7, 6, 8, 9, 7, 8, 10], 1998)
    assert int(row_season(yearly, row_period(yearly))) == 0
    walk = [10.0, 11.2, 10.1, 12.0, 12.5, 11.7, 13.1, 12.2]
    recent = _window(QUARTER_YEARS, walk, 1992)
    assert float(row_location_scale(recent, "season", 0.0, 1.0, keep=8)[1]) == walk[-1]


def test_a_series_width_factor_widens_its_calibrated_intervals_in_predict_and_generate(panel, qwen_tokenizer):
    """A width factor of 3 on the signed series (no floor to cut its intervals): its calibrated intervals are 3 times
    as wide in `predict` and in the numbers `generate` writes, its raw ones unchanged, the other series untouched."""
    import copy

    model, rows = panel
    wide = copy.deepcopy(model)
    key = next(k for k, e in wide.causal_config.value_series.items() if e["name"] == TITLES["rate"])
    wide.causal_config.value_series[key]["scale"] = 3.0
    prompts = [r["prompt"] for r in rows["test"] if r["series"] == "rate"][:3] + \
        [r["prompt"] for r in rows["test"] if r["series"] == "small"][:2]
    a, b = (m.predict_values(prompts, tokenizer=qwen_tokenizer, levels=(0.5,)) for m in (model, wide))
    for i, (p, q) in enumerate(zip(a, b)):
        f = 3.0 if i < 3 else 1.0
        assert q["upper_50"] - q["lower_50"] == pytest.approx(f * (p["upper_50"] - p["lower_50"]), rel=1e-6)
        assert (q["raw_lower_50"], q["raw_upper_50"]) == pytest.approx((p["raw_lower_50"], p["raw_upper_50"]))
    for m in (model, wide):
        with torch.no_grad():
            m.action.b_cls[m.num_token_id] += 1e4  # every row writes a number
    try:
        g, h = (m.generate(prompts[:3], tokenizer=qwen_tokenizer, max_new_tokens=2, mode="deterministic")
                for m in (model, wide))
    finally:
        for m in (model, wide):
            with torch.no_grad():
                m.action.b_cls[m.num_token_id] -= 1e4
    for nums_g, nums_h in zip(g.numbers, h.numbers):
        assert nums_g and len(nums_g) == len(nums_h)
        for x, y in zip(nums_g, nums_h):
            lo, hi = x["interval_50"]
            assert y["interval_50"][1] - y["interval_50"][0] == pytest.approx(3.0 * (hi - lo), rel=1e-6)
