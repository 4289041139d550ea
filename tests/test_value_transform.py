"""A value head on log y for a positive quantity (`modeling.value_transform`, `CausalAdapterConfig.value_transform`,
`TrainConfig.value_transform`): the point value is exp(loc_Y), the intervals exp of the log ones, the NLL carries the
Jacobian; `auto` takes log where the data allow it and it wins on validation; a positive quantity never gets a
negative value or bound, whichever transform; generation writes the exp'd values; old adapters load as identity."""
from __future__ import annotations

import json
import math
import random

import pytest
import torch

from causal_adapter import CausalAdapterConfig
from causal_adapter.commands.main import main
from causal_adapter.modeling.cauchy import cauchy_nll
from causal_adapter.modeling.intervals import interval
from causal_adapter.modeling.value_transform import ValueMap
from causal_adapter.numbers import format_number

from test_default_recipe import _jsonl
from test_train import small_model

TINY32 = ["--tiny-hidden-size", "32", "--tiny-layers", "1"]
LOG = ValueMap("log")


def test_the_log_map_maps_quantiles_and_densities_exactly():
    g = torch.Generator().manual_seed(0)
    loc, scale = torch.randn(500, generator=g, dtype=torch.float64), torch.rand(500, generator=g, dtype=torch.float64)
    h = loc + scale * torch.tan(math.pi * (torch.rand(500, generator=g, dtype=torch.float64) - 0.5))
    y = LOG.to_value(h)
    for q in (0.5, 0.9):  # a value is inside the mapped interval exactly when its log is inside the log one
        lo, hi = interval(loc, scale, q, None, LOG)
        lo_h, hi_h = interval(loc, scale, q, None)
        assert torch.equal((y >= lo) & (y <= hi), (h >= lo_h) & (h <= hi_h))
        assert bool((lo > 0).all()) and bool((hi - LOG.to_value(loc) > LOG.to_value(loc) - lo).all())  # skewed up
    # NLL of y = NLL of log y + log y: the density of exp(Cauchy), checked against a difference of its CDF
    y0, dy = torch.tensor([3.0], dtype=torch.float64), 1e-6
    cdf = lambda v: 0.5 + torch.atan((torch.log(v) - 1.0) / 0.5) / math.pi  # noqa: E731
    density = (cdf(y0 + dy) - cdf(y0 - dy)) / (2 * dy)
    nll = cauchy_nll(LOG.to_head(y0), torch.tensor(1.0, dtype=torch.float64), torch.tensor(0.5, dtype=torch.float64))
    assert float(nll + LOG.nll_offset(y0)) == pytest.approx(-float(density.log()), rel=1e-6)
    assert bool(LOG.to_head(torch.tensor([0.0, -1.0])).isnan().all())  # no log of a value <= 0
    floored = ValueMap("identity", positive=True)
    assert floored.to_value(torch.tensor([-3.0, 2.0])).tolist() == [0.0, 2.0]
    with pytest.raises(ValueError, match="value_transform"):
        ValueMap("sqrt")


@pytest.mark.parametrize("c", [1e-3, 1e3])
def test_a_log_head_in_row_units_multiplies_values_and_intervals_by_c(c):
    """Per-row units in log space: a row multiplied by c moves its log level by log c and keeps its step, so the
    value and both bounds are multiplied by c (the correction and the log-width included)."""
    K = 16
    model = small_model(recent_values=K, value_loc=0.0, value_scale=1.0, value_row_units="last", value_row_net=2,
                        value_row_net_hidden=8, value_row_scale=True)
    model.set_value_transform("log", (0.0, 1.0), positive=True)
    act = model.action.double()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        act.w_recent.copy_(torch.randn(K, generator=g, dtype=torch.float64) * 0.3)
        act.recent_range.copy_(torch.tensor([[-20.0] * K, [20.0] * K], dtype=torch.float64))
        for buf in act.row_net_parts().values():
            buf.copy_(torch.randn(buf.shape, generator=g, dtype=torch.float64) * 0.2)
        act.w_row_scale.copy_(torch.randn(act.w_row_scale.shape, generator=g, dtype=torch.float64) * 0.2)
        act.row_log_scale_range.copy_(torch.tensor([-2.0, 2.0], dtype=torch.float64))
    act.set_row_units("last", 0.5)
    rows = []
    for i in range(30):  # dated values (a year before each), levels 10^-2 .. 10^4, growing by a few percent a step
        level = 10.0 ** (torch.rand(1, generator=g).item() * 6 - 2)
        path = level * torch.exp(0.03 * torch.randn(6, generator=g, dtype=torch.float64).cumsum(0))
        numbers = [x for j, v in enumerate(path.tolist()) for x in (2000.0 + j, v)] + [2006.0]
        rows.append(torch.tensor(numbers[::-1], dtype=torch.float64))
    R = torch.nn.functional.pad(torch.stack(rows), (0, K - 13), value=math.nan)
    scaled = c * R  # the whole context, as a forward of the scaled text reads it
    with torch.no_grad():
        loc, scale = act.row_regression(R, R[:, 0])
        loc_c, scale_c = act.row_regression(scaled, R[:, 0])
    vm = act.value_map
    torch.testing.assert_close(vm.to_value(loc_c), c * vm.to_value(loc), rtol=1e-9, atol=0)
    torch.testing.assert_close(scale_c, scale, rtol=1e-9, atol=0)
    for q in (0.5, 0.9):
        lo, hi = interval(loc, scale, q, None, vm)
        lo_c, hi_c = interval(loc_c, scale_c, q, None, vm)
        torch.testing.assert_close(lo_c, c * lo, rtol=1e-9, atol=0)
        torch.testing.assert_close(hi_c, c * hi, rtol=1e-9, atol=0)


def _price_rows(n: int, seed: int) -> list[dict]:
    """Positive, skewed prices that multiply with size and with a grade named by a word: log price = 4 + 0.35 size +
    1.2 [grade B] + noise (sd 0.08)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        size, grade = round(rng.uniform(0.5, 6.0), 1), rng.choice("AB")
        price = round(math.exp(4 + 0.35 * size + 1.2 * (grade == "B") + rng.gauss(0, 0.08)))
        rows.append({"prompt": f"An item of size {format_number(size)}, grade {grade}. Price:",
                     "completion": f" {price}", "target": float(price)})
    return rows


@pytest.fixture(scope="module")
def prices(tmp_path_factory):
    """{transform flag: the reloaded adapter} trained on the prices, and the test rows."""
    from causal_adapter.model import CausalModel
    from causal_adapter.saving.assets import load_base

    tmp = tmp_path_factory.mktemp("prices")
    files = ["--train-file", _jsonl(tmp / "train.jsonl", _price_rows(240, 0)),
             "--validation-file", _jsonl(tmp / "val.jsonl", _price_rows(80, 1))]
    models = {}
    for flag in ("auto", "identity"):
        out = tmp / flag
        assert main(["train", *files, "--max-steps", "20", "--output-dir", str(out), "--no-plot", "--no-progress",
                     "--value-transform", flag, *TINY32]) == 0
        base, _ = load_base(None, "qwen2", "float32", 32, 1)
        models[flag] = CausalModel.from_pretrained(base, out / "adapter")
        models[flag + "_dir"] = out / "adapter"
    return models, _price_rows(60, 2)


def test_auto_takes_log_for_prices_that_multiply_and_it_predicts_them_better(prices, qwen_tokenizer):
    models, test = prices
    auto, identity = models["auto"], models["identity"]
    assert auto.causal_config.value_transform == "log" and auto.causal_config.value_positive
    assert identity.causal_config.value_transform == "identity" and identity.causal_config.value_positive
    truth = [r["target"] for r in test]
    mae = {}
    for name, model in (("auto", auto), ("identity", identity)):
        pred = model.predict_values([r["prompt"] for r in test], tokenizer=qwen_tokenizer)
        mae[name] = sum(abs(p["value"] - t) for p, t in zip(pred, truth)) / len(test)
        for p in pred:  # a positive quantity: no value and no bound below 0, whichever transform
            assert p["value"] >= 0 and p["lower_50"] >= 0 and p["lower_90"] >= 0 and p["raw_lower_90"] >= 0, p
    assert mae["auto"] < mae["identity"], mae


def test_a_log_adapter_round_trips_and_generation_writes_the_predicted_value(prices, qwen_tokenizer):
    models, test = prices
    model = models["auto"]
    saved = json.loads((models["auto_dir"] / "causal_adapter_config.json").read_text())["adapter_config"]
    assert saved["value_transform"] == "log" and len(saved["value_log_units"]) == 2
    prompts = [r["prompt"] for r in test[:4]]
    pred = model.predict_values(prompts, tokenizer=qwen_tokenizer)
    for p in pred:  # exp of a symmetric log interval: wider above the median than below
        assert p["upper_90"] - p["value"] > p["value"] - p["lower_90"] > 0, p
    gen = model.generate(prompts, tokenizer=qwen_tokenizer, max_new_tokens=2)
    for nums, p in zip(gen.numbers, pred):
        assert nums, gen.texts
        assert nums[0]["exact"] == pytest.approx(p["value"], rel=1e-4), (nums[0], p)  # exp(loc_Y) written
        lo, hi = nums[0]["interval_90"]
        assert lo == pytest.approx(p["lower_90"], rel=1e-4) and hi == pytest.approx(p["upper_90"], rel=1e-4)


def test_old_adapters_load_as_identity_and_the_fields_are_checked():
    old = CausalAdapterConfig().to_dict()
    for name in ("value_transform", "value_log_units", "value_positive", "value_range"):
        del old[name]
    cfg = CausalAdapterConfig.from_dict(old)
    assert cfg.value_transform == "identity" and cfg.value_log_units is None and cfg.value_positive is False
    assert cfg.value_range is None
    for bad in ([1.0], [2.0, 1.0], [0.0, math.inf], "1,2"):
        with pytest.raises(ValueError, match="value_range"):
            CausalAdapterConfig(value_range=bad)
    with pytest.raises(ValueError, match="value_transform"):
        CausalAdapterConfig(value_transform="sqrt")
    with pytest.raises(ValueError, match="value_log_units"):
        CausalAdapterConfig(value_transform="log", value_loc=1.0, value_scale=1.0)
    with pytest.raises(ValueError, match="value_log_units"):
        CausalAdapterConfig(value_log_units=[0.0, -1.0])


def test_log_is_refused_where_a_target_is_not_positive(tmp_path, capsys):
    rows = _price_rows(40, 0)
    rows[3] = {**rows[3], "completion": " -5", "target": -5.0}
    files = ["--train-file", _jsonl(tmp_path / "train.jsonl", rows),
             "--validation-file", _jsonl(tmp_path / "val.jsonl", _price_rows(10, 1))]
    code = main(["train", *files, "--max-steps", "1", "--output-dir", str(tmp_path / "out"), "--no-plot",
                 "--no-progress", "--value-transform", "log", *TINY32])
    assert code != 0 and "every training target > 0" in capsys.readouterr().err
    assert not (tmp_path / "out" / "adapter").exists()


def _word_rows(n: int, seed: int) -> list[dict]:
    """Dated random walks whose next value goes up or down by 4 of its own steps, as a word right before it says
    (``2008 (up):``): the row's numbers alone cannot tell the direction, its words can."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        level, step = rng.uniform(20, 80), rng.uniform(0.5, 2.0)
        values = [level]
        for _ in range(7):
            values.append(values[-1] + rng.gauss(0, step))
        direction = rng.choice(["up", "down"])
        steps = sum(abs(a - b) for a, b in zip(values[1:], values[:-1])) / 7
        target = values[-1] + (4 if direction == "up" else -4) * steps
        history = "; ".join(f"{2000 + i}: {format_number(round(v, 2))}" for i, v in enumerate(values))
        rows.append({"prompt": f"{history}; 2008 ({direction}):", "completion": f" {format_number(round(target, 2))}",
                     "direction": direction, "last": round(values[-1], 2)})
    return rows


def test_the_words_reach_a_value_in_row_units_and_the_nll_reaches_w_loc(tmp_path, qwen_tokenizer):
    """Per-row units with loc_U in the row's units (loc_Y = m + s (w_reg . loc_U + w_recent . r + b)): a direction
    carried only by a word is learned (the fit keeps loc_U, the value moves up or down with the word), and the
    NLL's gradient reaches W_loc through it."""
    from causal_adapter.model import CausalModel
    from causal_adapter.numbers import NumberTokenizer
    from causal_adapter.saving.assets import load_base

    files = ["--train-file", _jsonl(tmp_path / "train.jsonl", _word_rows(300, 0)),
             "--validation-file", _jsonl(tmp_path / "val.jsonl", _word_rows(100, 1))]
    assert main(["train", *files, "--max-steps", "2", "--output-dir", str(tmp_path / "out"), "--no-plot",
                 "--no-progress", "--row-units", "last", "--value-transform", "identity", *TINY32]) == 0
    base, _ = load_base(None, "qwen2", "float32", 32, 1)
    model = CausalModel.from_pretrained(base, tmp_path / "out" / "adapter")
    assert model.causal_config.value_row_units == "last" and bool(model.action.w_reg.abs().sum() > 0)
    test = _word_rows(40, 2)
    pred = model.predict_values([r["prompt"] for r in test], tokenizer=qwen_tokenizer)
    right = sum((p["value"] > r["last"]) == (r["direction"] == "up") for p, r in zip(pred, test))
    assert right >= 36, right  # the numbers alone: a coin toss
    batch = NumberTokenizer(qwen_tokenizer)([r["prompt"] + r["completion"] for r in test[:8]])
    model.abduction.loc.weight.requires_grad_(True)
    out = model(**batch, labels=batch["input_ids"])
    out.loss_reg.backward()
    assert float(model.abduction.loc.weight.grad.abs().sum()) > 0  # through w_reg . loc_U in row units


def test_log_is_allowed_where_the_values_are_positive_and_a_tables_zero_count_does_not_forbid_it():
    from causal_adapter.training.value_head.lifecycle import log_allowed
    from causal_adapter.training.value_head.warm_start import WarmStartRows

    def rows(R, y):
        R = torch.tensor(R, dtype=torch.float64)
        return WarmStartRows(torch.zeros(len(R), 2, dtype=torch.float64), torch.tensor(y, dtype=torch.float64), R)

    dated = [[2003.0, 5.0, 2002.0, 4.0, 2001.0, 6.0, 2000.0], [2003.0, 7.0, 2002.0, 6.0, 2001.0, 5.0, 2000.0]]
    assert log_allowed(rows(dated, [5.5, 7.5]))
    assert not log_allowed(rows(dated, [5.5, -1.0]))  # a target <= 0
    zero = [[2003.0, 5.0, 2002.0, 0.0, 2001.0, 6.0, 2000.0], dated[1]]
    assert not log_allowed(rows(zero, [5.5, 7.5]))  # a value of the series' own kind is 0
    table = [[2.0, 0.0, 3.0, 5850.0, float("nan"), float("nan"), float("nan")],  # stories, garages, bedrooms, lot
             [1.0, 1.0, 2.0, 4000.0, float("nan"), float("nan"), float("nan")]]
    assert log_allowed(rows(table, [42000.0, 38500.0]))  # no record of a value's kind: a 0 count is no value


def test_a_log_head_under_a_bf16_autocast_computes_in_full_precision(prices, qwen_tokenizer):
    """The GPU path's mixed precision on CPU: under a bf16 autocast the backbone runs in bf16 and the heads in their
    own float32 (`heads.full_precision`): loc_Y on log y equals a float64 copy of the head on the same loc_U and
    numbers, to float32 rounding (a head run under the autocast is off by bf16's ~4e-3), and the value stays > 0."""
    import copy

    from causal_adapter.numbers import NumberTokenizer

    models, test = prices
    model = models["auto"]
    batch = NumberTokenizer(qwen_tokenizer)([r["prompt"] for r in test[:6]])
    last = batch["attention_mask"].sum(-1) - 1
    rows = torch.arange(len(last))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(**batch)
    head = copy.deepcopy(model.action).double()
    loc_U, recent = out.loc_U[rows, last].double(), out.recent[rows, last].double()
    with torch.no_grad():
        exact, _ = head.regression(loc_U, torch.zeros_like(loc_U), recent)
    assert out.loc_Y.dtype == torch.float32
    torch.testing.assert_close(out.loc_Y[rows, last].double(), exact, rtol=1e-5, atol=1e-5)
    assert bool((model.value_map.to_value(out.loc_Y[rows, last]) > 0).all())


def test_auto_is_chosen_again_by_the_final_head_when_training_moved_its_features(tmp_path, capsys):
    """The transform 'auto' chose on the untrained features is chosen again on the final ones, by the heads the
    adapter will keep (each with its correction): both refits scored, as the warm start's two."""
    files = ["--train-file", _jsonl(tmp_path / "train.jsonl", _price_rows(120, 0)),
             "--validation-file", _jsonl(tmp_path / "val.jsonl", _price_rows(40, 1))]
    assert main(["train", *files, "--max-steps", "3", "--output-dir", str(tmp_path / "run"), "--no-plot",
                 "--no-progress", *TINY32]) == 0
    heads = [line for line in capsys.readouterr().err.splitlines() if line.startswith("value head:")]
    assert len(heads) == 2, heads  # the warm start, the refit on the trained features
    assert all("value_transform_identity_score=" in h and "value_transform_log_score=" in h for h in heads), heads
    saved = json.loads((tmp_path / "run" / "adapter" / "causal_adapter_config.json").read_text())["adapter_config"]
    assert saved["value_transform"] == heads[-1].rsplit("value_transform=", 1)[1].split(",")[0]


def test_a_log_heads_loss_reg_is_the_gated_nll_of_the_value_with_its_jacobian():
    """A head on log y: the forward's loss_reg is the NLL of the value itself, sum_i gate_i (NLL_Cauchy(log y_i;
    loc_Y_i, scale_Y_i) + log y_i) / n_<NUM> (the Jacobian log y: what makes it compare with an identity head's
    and what the evaluation loss and metrics.jsonl report), gate_i = alpha + (1 - alpha) P_num_i, all computed
    here from the forward's own loc_Y, scale_Y and OvR scores."""
    model = small_model(alpha=0.5, threshold_init=0.0)
    model.set_value_transform("log", (3.0, 0.8), positive=True)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 290, (2, 9), generator=g)
    vals = torch.zeros(2, 9)
    for row, pos, v in ((0, 3, 12.5), (0, 6, 480.0), (1, 2, 0.37), (1, 5, 55.0), (1, 8, 2100.0)):
        ids[row, pos], vals[row, pos] = 300, v
    with torch.no_grad():
        out = model(ids, vals, labels=ids, return_scores=True)
    C = model.action.thresholds.reshape(())
    p_num = 0.5 + torch.atan((out.loc_S[..., 300] - C) / out.scale_S[..., 300]) / math.pi
    total, n = 0.0, 0
    for b in range(2):
        for i in range(8):
            if ids[b, i + 1] != 300:
                continue
            y = vals[b, i + 1].double()
            nll = cauchy_nll(y.log(), out.loc_Y[b, i].double(), out.scale_Y[b, i].double()) + y.log()
            total += float((0.5 + 0.5 * p_num[b, i].double()) * nll)
            n += 1
    assert n == 5 and float(out.loss_reg) == pytest.approx(total / n, rel=1e-5)


def test_a_log_head_set_without_value_units_reloads_with_its_log_units(tmp_path):
    """`set_value_transform("log", log_units)` alone (no `set_value_units`): the saved adapter reloads with the head's
    units on log y, so it predicts what it predicted before saving (it once reloaded with units (0, 1))."""
    from causal_adapter.model import CausalModel

    model = small_model(regression_scale="independent")
    model.set_value_transform("log", (4.0, 1.0), positive=True)
    ids = torch.tensor([[5, 6, 7, 8]])
    before = model(ids).loc_Y
    model.save_pretrained(tmp_path / "a")
    again = CausalModel.from_pretrained(small_model().backbone, tmp_path / "a")
    assert (again.action.head_loc, again.action.head_scale) == (4.0, 1.0)
    torch.testing.assert_close(again(ids).loc_Y, before)
