"""Per-row value units (`causal_adapter.modeling.row_units`, `CausalAdapterConfig.value_row_units`).

Claims, each failing when its mechanism is removed:

* a row's units come from its numbers of the kind being predicted: the years of ``1999: 3.12; 2000: 3.05``
  are left out at any scale of the values (the period test), and a row with too few numbers keeps the
  adapter's units;
* after `causal-adapter train` on one file of series from 10^-3 to 10^5, the adapter chose per-row units on
  validation, and a context multiplied by c (10^-3, 10^3; the years left as they are) gives values, widths and
  calibrated intervals multiplied by c, to float32 rounding;
* the small series are predicted as well as the large ones (MAE / persistence), where the adapter's one unit
  system (``--row-units off``) fails them;
* the width's exponent a (s (c / s)^a, c the window's curvature) is chosen on validation: 1 where the errors
  follow c, 0 where they do not; a row multiplied by c gets its width multiplied by c;
* adapters written before the field load with the adapter's units and give the same outputs as before;
* K counts the values of the row's own series: a head of K = 4 over ``YYYY-MM: v`` records (three numbers
  each) reads the 4 most recent values, found in a window of 4 K numbers (`recent_window`, `train()`'s
  setting); over a window of K numbers (adapters written before the field) it read dates beside one value.
"""
import copy
import math
import random

import pytest
import torch

from causal_adapter import CausalAdapterConfig
from causal_adapter.commands.main import main
from causal_adapter.modeling.row_units import row_location_scale, row_period, row_width
from causal_adapter.training.value_head.row_head import choose_width_power
from causal_adapter.numbers import format_number

from test_default_recipe import _jsonl
from test_train import small_model

TINY32 = ["--tiny-hidden-size", "32", "--tiny-layers", "1"]
NAN = math.nan
SCALES = (1e-3, 1e-1, 1.0, 10.0, 1e3, 1e5)


def _dated(values, first_year=1990):
    """recent values as the head reads them at the next value: newest first, a year before each value, then
    the year of the value to come."""
    numbers = []
    for i, v in enumerate(values):
        numbers += [first_year + i, v]
    numbers.append(first_year + len(values))
    return torch.tensor([numbers[::-1]], dtype=torch.float64)


@pytest.mark.parametrize("c", [1e-3, 1.0, 1e3, 1e5])
def test_the_units_come_from_the_values_not_the_years(c):
    values = [3.12, 3.05, 3.3, 2.9, 3.0, 3.4]
    recent = _dated([v * c for v in values])
    assert int(row_period(recent)) == 2
    same, loc, scale, own = row_location_scale(recent, "last", 0.0, 1.0)
    steps = [abs(a - b) for a, b in zip(values, values[1:])]
    assert bool(own)
    assert float(loc) == pytest.approx(values[-1] * c, rel=1e-12)
    assert float(scale) == pytest.approx(c * sum(steps) / len(steps), rel=1e-9)
    assert torch.allclose(same[0, :len(values)], torch.tensor(values[::-1], dtype=torch.float64) * c)
    _, med, spread, _ = row_location_scale(recent, "median", 0.0, 1.0)
    m = sorted(values)[len(values) // 2 - 1: len(values) // 2 + 1]
    assert float(med) == pytest.approx(c * min(m), rel=1e-12)  # torch's median: the lower middle value


def test_a_row_of_one_kind_keeps_every_number_and_a_short_row_the_adapters_units():
    walk = torch.tensor([[5.0, 5.2, 4.9, 5.1, 5.3, 5.0, NAN, NAN]], dtype=torch.float64)
    assert int(row_period(walk)) == 1
    month = torch.tensor([[3, 1991, 350.2, 2, 1991, 349.8, 1, 1991, 349.1, 12, 1990, 348.7]], dtype=torch.float64)
    assert int(row_period(month)) == 3  # year, month, value
    _, loc, scale, own = row_location_scale(torch.tensor([[2.0, 1999.0, NAN, NAN]]), "last", 7.0, 3.0)
    assert not bool(own) and float(loc) == 7.0 and float(scale) == 3.0


def _series_rows(seed: int, n_series_per_scale: int = 2, length: int = 60, window: int = 8):
    """Random walks with drift at each of SCALES, written ``Series k. 1990: v; ...; 1998:`` -> `` v``, split by
    time 70 / 15 / 15 per series."""
    rng = random.Random(seed)
    splits = {"train": [], "validation": [], "test": []}
    k = 0
    for scale in SCALES:
        for _ in range(n_series_per_scale):
            level, drift = rng.uniform(50, 150), rng.uniform(-0.5, 0.5)
            values = []
            for _ in range(length):
                level = max(level + drift + rng.gauss(0, 3), 1.0)
                values.append(float(format_number(level * scale)))
            for i in range(window, length):
                history = "; ".join(f"{1900 + j}: {format_number(values[j])}" for j in range(i - window, i))
                split = "train" if i < 0.7 * length else "validation" if i < 0.85 * length else "test"
                splits[split].append({"prompt": f"Series {k}. {history}; {1900 + i}:",
                                      "completion": f" {format_number(values[i])}", "target": values[i],
                                      "previous": values[i - 1], "scale": scale})
            k += 1
    return splits


@pytest.fixture(scope="module")
def mixed_scales(tmp_path_factory):
    """{row_units setting: the reloaded adapter} after `causal-adapter train` on one mixed-scale file, and the
    rows."""
    from causal_adapter.model import CausalModel
    from causal_adapter.saving.assets import load_base

    tmp = tmp_path_factory.mktemp("scales")
    rows = _series_rows(0)
    files = ["--train-file", _jsonl(tmp / "train.jsonl", rows["train"]),
             "--validation-file", _jsonl(tmp / "val.jsonl", rows["validation"])]
    models = {}
    # on the value's own scale ("auto" and "off": what per-row units do), and on log y with per-row units
    for name, flags in (("auto", ["--row-units", "auto", "--value-transform", "identity"]),
                        ("off", ["--row-units", "off", "--value-transform", "identity"]),
                        ("log", ["--row-units", "last", "--value-transform", "log"])):
        out = tmp / name
        assert main(["train", *files, "--max-steps", "20", "--output-dir", str(out), "--no-plot", "--no-progress",
                     *flags, *TINY32]) == 0
        base, _ = load_base(None, "qwen2", "float32", 32, 1)
        models[name] = CausalModel.from_pretrained(base, out / "adapter")
    return models, rows


def _scaled_prompt(prompt: str, c: float) -> str:
    """The prompt with every value multiplied by c and the years as they are."""
    head, _, history = prompt.partition(". ")
    items = []
    for item in history.split("; "):
        year, sep, value = item.partition(": ")
        items.append(f"{year}{sep}{format_number(float(value) * c)}" if value else item)
    return f"{head}. " + "; ".join(items)


@pytest.mark.parametrize("c", [1e-3, 1e3])
@pytest.mark.parametrize("head", ["auto", "log"])
def test_a_context_multiplied_by_c_gives_values_and_intervals_multiplied_by_c(mixed_scales, qwen_tokenizer, c, head):
    """On the value's scale (units chosen on validation) and on log y (the log level an offset, the log step the
    scale): the same property."""
    models, rows = mixed_scales
    model = models[head]
    assert model.causal_config.value_row_units in ("last", "median")  # chosen on validation, saved
    assert model.causal_config.value_transform == ("log" if head == "log" else "identity")
    prompts = [r["prompt"] for r in rows["test"] if r["scale"] == 1.0][:6]
    before = model.predict_values(prompts, tokenizer=qwen_tokenizer)
    after = model.predict_values([_scaled_prompt(p, c) for p in prompts], tokenizer=qwen_tokenizer)
    for a, b in zip(before, after):
        for key in ("value", "scale", "lower_50", "upper_50", "lower_90", "upper_90"):
            factor = 1.0 if key == "scale" and head == "log" else c  # scale_Y of a log head: on log y
            assert b[key] == pytest.approx(factor * a[key], rel=2e-5), (key, a, b)


def _mae_ratio(model, rows, scale, tokenizer):
    test = [r for r in rows["test"] if r["scale"] == scale]
    pred = model.predict_values([r["prompt"] for r in test], tokenizer=tokenizer)
    mae = sum(abs(p["value"] - r["target"]) for p, r in zip(pred, test))
    return mae / sum(abs(r["previous"] - r["target"]) for r in test)


def test_small_series_are_predicted_as_well_as_large_ones(mixed_scales, qwen_tokenizer):
    models, rows = mixed_scales
    small, large = (_mae_ratio(models["auto"], rows, s, qwen_tokenizer) for s in (1e-3, 1e5))
    assert small < 1.3 and large < 1.3 and small == pytest.approx(large, rel=0.15), (small, large)
    off = _mae_ratio(models["off"], rows, 1e-3, qwen_tokenizer)  # one unit system, fitted on all targets together
    assert off > 3 * small, (off, small)


def test_adapters_written_before_the_field_load_with_the_adapters_units(tmp_path):
    from causal_adapter.model import CausalModel
    from causal_adapter.saving.assets import build_tiny_qwen

    old = CausalAdapterConfig().to_dict()
    del old["value_row_units"], old["value_width_power"]
    assert CausalAdapterConfig.from_dict(old).value_row_units is None
    assert CausalAdapterConfig.from_dict(old).value_width_power == 0.0
    with pytest.raises(ValueError, match="value_width_power"):
        CausalAdapterConfig(value_width_power=1.5)
    with pytest.raises(ValueError, match="value_row_units"):
        CausalAdapterConfig(value_row_units="mean")
    with pytest.raises(ValueError, match="recent_values"):
        CausalAdapterConfig(value_row_units="last")
    model = small_model(recent_values=4, value_loc=10.0, value_scale=2.0)
    with torch.no_grad():
        model.action.w_recent.copy_(torch.tensor([0.5, 0.2, 0.1, 0.0]))
    model.save_pretrained(tmp_path / "old")
    config_file = tmp_path / "old" / "causal_adapter_config.json"
    text = config_file.read_text()
    assert '"value_row_units": null' in text
    assert '"value_width_power": 0.0' in text
    # as an adapter saved before the fields
    config_file.write_text(text.replace('"value_row_units": null,', "").replace('"value_width_power": 0.0,', ""))
    loaded = CausalModel.from_pretrained(build_tiny_qwen("qwen2", hidden_size=32, num_layers=1, vocab_size=320),
                                          tmp_path / "old")
    assert loaded.action.row_rule is None
    ids = torch.tensor([[11, model.num_token_id, 12, model.num_token_id, 13, model.num_token_id, 14]])
    vals = torch.tensor([[0.0, 1999.0, 0.0, 3.5, 0.0, 2000.0, 0.0]])
    with torch.no_grad():
        a, b = model(ids, vals), loaded(ids, vals)
    assert torch.equal(a.loc_Y, b.loc_Y) and torch.equal(a.scale_Y, b.scale_Y)


def _monthly(values, first=(1990, 1)):
    """Numbers of ``YYYY-MM: v`` records as the text holds them (year, month, value), oldest first, then the
    date of the value to come."""
    year, month = first
    numbers = []
    for v in values:
        numbers += [year, month, v]
        year, month = (year + 1, 1) if month == 12 else (year, month + 1)
    return numbers + [year, month]


def test_k_counts_the_rows_own_values_not_every_number():
    from causal_adapter.training.config import TrainConfig
    from causal_adapter.modeling.row_units import MAX_PERIOD

    values = [31.7, 33.2, 32.9, 30.4, 29.8, 31.1, 32.5, 33.0]
    k = 4
    numbers = _monthly(values)
    ids = torch.tensor([[11] + [300, 12] * len(numbers)])
    vals = torch.tensor([[0.0] + [x for n in numbers for x in (float(n), 0.0)]])
    reads = {}
    for window in (None, MAX_PERIOD * k):
        model = small_model(recent_values=k, recent_window=window, value_loc=0.0, value_scale=1.0,
                            regression_scale="independent").eval()
        model.action.set_row_units("last")
        with torch.no_grad():
            out = model(ids, vals)
        recent = out.recent[0, -1]  # at the last position: the value to come
        assert recent.shape[-1] == (window or k)
        frame_r = model.action.units(recent.unsqueeze(0), out.loc_U[0, -1:, 0])[2][0]
        reads[window] = (recent, frame_r)
    # W = 4 K numbers: the 4 most recent values, newest first, in the row's units (m = the last value)
    same, loc, scale, own = row_location_scale(reads[MAX_PERIOD * k][0].unsqueeze(0).double(), "last", 0.0, 1.0,
                                               keep=k)
    assert bool(own) and torch.allclose(same[0].float(), torch.tensor(values[::-1][:k]))
    steps = [abs(a - b) for a, b in zip(values[::-1][:k], values[::-1][1:k])]
    expected_r = torch.tensor([(v - values[-1]) / (sum(steps) / len(steps)) for v in values[::-1][:k]])
    assert torch.allclose(reads[MAX_PERIOD * k][1], expected_r, atol=1e-5)
    # W = K numbers (an adapter written before the field): one value among dates, not the series' 4 values
    old_same = row_location_scale(reads[None][0].unsqueeze(0).double(), "last", 0.0, 1.0)[0][0]
    assert int((~torch.isnan(old_same) & (old_same > 1000)).sum()) + int((old_same <= 12).sum()) >= 2
    # what train() writes, and what an adapter written before the field loads as
    assert TrainConfig(recent_values=k).adapter_config().recent_window == MAX_PERIOD * k
    old = {**CausalAdapterConfig(recent_values=k).to_dict()}
    del old["recent_window"]
    assert CausalAdapterConfig.from_dict(old).recent_window is None
    with pytest.raises(ValueError, match="recent_window"):
        CausalAdapterConfig(recent_values=k, recent_window=k - 1)


def _series_windows(n_rows: int, seed: int) -> torch.Tensor:
    """[n, K] recent values of dated rows: half of them smooth (a trend, small curvature), half rough."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n_rows):
        level, step = 10.0 ** (torch.rand(1, generator=g).item() * 6 - 2), torch.rand(1, generator=g).item() + 0.5
        noise = 0.05 if i % 2 else 1.0
        t = torch.arange(8, dtype=torch.float64)
        values = level * (1 + 0.01 * (step * t + noise * torch.randn(8, generator=g, dtype=torch.float64)))
        rows.append(_dated(values.tolist())[0])
    return torch.stack(rows)


@pytest.mark.parametrize("errors_follow_curvature", [True, False])
def test_the_width_exponent_is_chosen_on_the_residuals(errors_follow_curvature):
    R = _series_windows(400, seed=3)
    values, _, s, own = row_location_scale(R, "last", 0.0, 1.0)
    ratio = row_width(values, s, own, 1.0) / s
    assert own.all() and ratio.std() > 0.3  # smooth rows and rough rows differ in c / s
    g = torch.Generator().manual_seed(4)
    cauchy = torch.tan(math.pi * (torch.rand(len(R), generator=g, dtype=torch.float64) - 0.5))
    u = cauchy * (ratio if errors_follow_curvature else 1.0)
    assert choose_width_power(u, ratio) == (1.0 if errors_follow_curvature else 0.0)
    for c in (1e-3, 1e3):  # the width unit of a row multiplied by c is c times its own
        values_c, _, s_c, own_c = row_location_scale(R * c, "last", 0.0, 1.0)
        assert torch.allclose(row_width(values_c, s_c, own_c, 0.5), c * row_width(values, s, own, 0.5), rtol=1e-9)


@pytest.mark.parametrize("head", ["auto", "log"])
@pytest.mark.parametrize("c", [1e-3, 1e3])
def test_generate_writes_the_value_predict_gives_in_row_units(mixed_scales, qwen_tokenizer, c, head):
    """Number feedback in generation reads the same numbers, hence the same row units, as a forward: the first
    number written after a small (or large) series' window is predict's value for that window (exp of the head's
    location for a head on log y)."""
    model = mixed_scales[0][head]
    prompts = [_scaled_prompt(r["prompt"], c) for r in mixed_scales[1]["test"] if r["scale"] == 1.0][:4]
    gen = model.generate(prompts, tokenizer=qwen_tokenizer, max_new_tokens=2)
    pred = model.predict_values(prompts, tokenizer=qwen_tokenizer)
    for nums, p in zip(gen.numbers, pred):
        assert nums, gen.texts
        assert nums[0]["value"] == pytest.approx(p["value"], rel=1e-4), (nums[0], p)
        assert nums[0]["scale"] == pytest.approx(p["scale"], rel=1e-4), (nums[0], p)


@pytest.mark.parametrize("c", [1e-3, 1e3])
def test_causal_sampling_writes_the_value_in_the_series_units(mixed_scales, qwen_tokenizer, c):
    """Causal sampling (a sampled u per step) in per-row units: the value written is the head's own Cauchy for the
    row's own numbers at the quantile the sampled u gives it, loc_Y + scale_Y t (`heads.individual_draw`), in the
    series' units, with loc_Y and scale_Y as predict gives them, for a small and a large series alike (a value left
    in standardised row units would be ~1 whatever the series)."""
    model = mixed_scales[0]["auto"]
    assert model.action.row_rule is not None
    assert not bool(model.action.w_reg.abs().sum() > 0)  # the fit kept no loc_U: t is u's first coordinate's deviate
    prompts = [_scaled_prompt(r["prompt"], c) for r in mixed_scales[1]["test"] if r["scale"] == 1.0][:4]
    gen = model.generate(prompts, tokenizer=qwen_tokenizer, max_new_tokens=2, mode="causal", seed=0,
                         return_eps=True)
    pred = model.predict_values(prompts, tokenizer=qwen_tokenizer)
    vm = model.value_map
    written = [(b, nums[0], p) for b, (nums, p) in enumerate(zip(gen.numbers, pred)) if nums]
    assert len(written) >= 2, gen.texts  # the trained head writes a number after the label on most rows
    for b, first, p in written:
        # loc_Y and scale_Y (on the head's scale) are predict's, in the series' units
        assert float(vm.to_value(torch.tensor(first["loc"], dtype=torch.float64))) == pytest.approx(p["value"], rel=1e-4)
        assert first["scale"] == pytest.approx(p["scale"], rel=1e-4), (first, p)
        t = math.tan(math.pi * (float(gen.eps[b, first["position"], 0]) - 0.5))
        h = torch.tensor(first["loc"] + first["scale"] * t, dtype=torch.float64)
        assert first["exact"] == pytest.approx(float(vm.to_value(h)), rel=1e-4), (first, p, t)
    assert any(abs(first["exact"] - p["value"]) > 1e-3 * abs(p["value"]) for _, first, p in written)  # u moved it


@pytest.mark.parametrize("c", [1e-3, 1e3])
def test_the_causal_value_scales_with_the_row(mixed_scales, c):
    """The unit form: the causal value `individual_value(loc_Y, scale_Y, eps, scale_U')` of a row multiplied by c is
    c times the row's (loc_Y and scale_Y of per-row units move with the row; the deviate is the same u's)."""
    model = mixed_scales[0]["auto"]
    act = copy.deepcopy(model.action).double()
    R = _series_windows(40, seed=7)  # 17 numbers a row (8 dated values), NaN past them
    R = torch.nn.functional.pad(R, (0, act.recent_values - R.shape[1]), value=math.nan)
    g = torch.Generator().manual_seed(1)
    C = act.w_reg.shape[0]
    loc_U = torch.randn(len(R), C, generator=g, dtype=torch.float64)
    scale_Up = torch.rand(len(R), C, generator=g, dtype=torch.float64) + 0.1
    eps = torch.rand(len(R), C, generator=g, dtype=torch.float64)
    with torch.no_grad():
        value = act.value_map.to_value(act.individual_value(*act.regression(loc_U, scale_Up, R), eps, scale_Up))
        loc_c, scale_c = act.regression(loc_U, scale_Up, c * R)
        value_c = act.value_map.to_value(act.individual_value(loc_c, scale_c, eps, scale_Up))
        loc_Y, _ = act.regression(loc_U, scale_Up, R)
    assert not torch.allclose(value, act.value_map.to_value(loc_Y))  # the individual's draw, not the location
    # rows whose width stays above the absolute floor of scale_Y (`scale_floor`: the one term that is not per row)
    free = scale_c > 10 * act.scale_floor
    assert int(free.sum()) >= len(R) // 2
    torch.testing.assert_close(value_c[free], c * value[free], rtol=1e-9, atol=0)  # row units would not move with c


def test_per_row_units_under_a_bf16_autocast_keep_full_precision_values(mixed_scales, qwen_tokenizer):
    """The GPU path's mixed precision on CPU: under a bf16 autocast the backbone runs in bf16, the heads in their
    own float32 (`heads.full_precision`), so a value of ~10^5 is not rounded to bf16's 3 digits (a step of 512
    there): the value follows the row's own numbers within float32 rounding and a bf16-sized change of loc_U."""
    from causal_adapter.modeling.recent_numbers import recent_values
    from causal_adapter.numbers import NumberTokenizer

    model = mixed_scales[0]["auto"]
    prompts = [r["prompt"] for r in mixed_scales[1]["test"] if r["scale"] == 1e5][:4]
    batch = NumberTokenizer(qwen_tokenizer)(prompts)
    last = batch["attention_mask"].sum(-1) - 1
    with torch.no_grad():
        ref = model(**batch)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            amp = model(**batch)
    rows = torch.arange(len(prompts))
    # the head in float64 on the same numbers: what loc_Y and scale_Y are, to float32 rounding
    recent = recent_values(batch["input_ids"], batch["numeric_values"], model.num_token_id,
                           model.causal_config.recent_values)[rows, last].double()
    exact = copy.deepcopy(model.action).double().row_regression(recent, recent[:, 0])
    assert exact[0].abs().min() > 1e4  # values where bf16 would round by hundreds
    for out in (ref, amp):
        assert torch.allclose(out.loc_Y[rows, last].double(), exact[0], rtol=1e-5), (out.loc_Y[rows, last], exact[0])
        assert torch.allclose(out.scale_Y[rows, last].double(), exact[1], rtol=1e-5)
