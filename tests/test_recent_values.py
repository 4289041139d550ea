"""The value head's recent values (`CausalAdapterConfig.recent_values` K, `modeling.heads.recent_values`):

    loc_Y' = w_reg . loc_U + w_recent . r + b_reg,   r = the K most recent numbers of the text, standardised

The value reaches the head exactly, beside the features that carry it through the backbone (a log-compressing
phi, bf16 residuals, random-base mixing). Claims, each failing when its mechanism is removed:

* `recent_values` lists the numbers at or before each position, most recent first, a cached prefix's included;
* a forward over a cache given the prefix's numbers (`recent_before`) equals one forward over the whole text,
  and `generate` reads the same numbers as `forward` (its value equals predict's);
* after `causal-adapter train` on a linear law of the prompt's number, the reloaded adapter predicts within
  1.1x the least-squares line's error, where the head on loc_U alone (`--recent-values 0`) is far off;
* the head's inputs are chosen by the one-standard-error rule: the recent values alone unless a set with loc_U's
  C columns is better by more than a standard error (pure-noise loc_U columns win a plain smallest-score choice
  in a third of draws), and loc_U when it carries the value;
* a head on the recent values alone has no out-of-depth widening from loc_U's distance;
* adapters written before the field load as K = 0.
"""
import math
import random

import pytest
import torch

from causal_adapter import CausalAdapterConfig
from causal_adapter.commands.main import main
from causal_adapter.modeling.recent_numbers import recent_values
from causal_adapter.training.config import TrainConfig

from test_default_recipe import _jsonl
from test_train import small_model

TINY32 = ["--tiny-hidden-size", "32", "--tiny-layers", "1"]
DEFAULT_K = TrainConfig().recent_values  # train's recipe
NAN = math.nan


def _same(a, b):
    return torch.equal(torch.nan_to_num(a, nan=-7.0), torch.nan_to_num(b, nan=-7.0))


def test_recent_values_lists_the_numbers_before_each_position_most_recent_first():
    ids = torch.tensor([[5, 9, 1, 9, 9, 2], [0, 0, 9, 3, 9, 4]])
    vals = torch.tensor([[0, 1.5, 0, 2.5, 3.5, 0], [0, 0, 7.0, 0, 8.0, 0]])
    r = recent_values(ids, vals, 9, 2)
    assert _same(r[0], torch.tensor([[NAN, NAN], [1.5, NAN], [1.5, NAN], [2.5, 1.5], [3.5, 2.5], [3.5, 2.5]]))
    assert _same(r[1], torch.tensor([[NAN, NAN], [NAN, NAN], [7.0, NAN], [7.0, NAN], [8.0, 7.0], [8.0, 7.0]]))
    before = torch.tensor([[10.0, 11.0], [NAN, NAN]])  # a cached prefix's numbers
    r = recent_values(ids, vals, 9, 2, before)
    assert _same(r[0, :2], torch.tensor([[10.0, 11.0], [1.5, 10.0]]))
    assert _same(r[1, 2], torch.tensor([7.0, NAN]))


def _model_reading_recent_values(k=3):
    model = small_model(recent_values=k).eval()
    act = model.action
    act.set_head_units(10.0, 4.0)
    with torch.no_grad():
        act.w_recent.copy_(torch.tensor([2.0, -1.0, 0.5])[:k])
    return model


def test_a_cached_forward_given_the_prefix_numbers_equals_one_forward():
    model = _model_reading_recent_values()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 290, (2, 12), generator=g)
    ids[:, [1, 4, 7, 9]] = 300
    vals = torch.zeros(2, 12)
    vals[:, [1, 4, 7, 9]] = torch.tensor([[3.0, 14.0, 8.5, 20.0], [1.0, 2.0, 30.0, 4.0]])
    with torch.no_grad():
        whole = model(ids, vals)
        head = model(ids[:, :6], vals[:, :6], use_cache=True)
        tail = model(ids[:, 6:], vals[:, 6:], cache=head.cache, position_ids=torch.arange(6, 12).expand(2, -1),
                     use_cache=True, recent_before=head.recent[:, -1])
        alone = model(ids[:, 6:], vals[:, 6:]).loc_Y
    torch.testing.assert_close(tail.loc_Y, whole.loc_Y[:, 6:], rtol=1e-5, atol=1e-4)
    assert float((whole.loc_Y[:, 6:] - alone).abs().max()) > 1.0  # the prefix numbers count


def _linear_rows(n, seed):
    r = random.Random(seed)
    rows = []
    for _ in range(n):
        x = round(r.uniform(100, 900), 1)
        rows.append({"prompt": f"Reading {x}; calibrated:", "completion": f" {round(0.5 * x + 40 + r.gauss(0, 2), 2)}"})
    return rows


@pytest.fixture(scope="module")
def linear_law(tmp_path_factory):
    """{K: the reloaded adapter} after `causal-adapter train` (40 steps) with train's default K and K = 0, both on the
    value's own scale (a linear law: what the inputs give, not the transform)."""
    from causal_adapter.saving.assets import load_base
    from causal_adapter.model import CausalModel

    tmp = tmp_path_factory.mktemp("recent")
    files = ["--train-file", _jsonl(tmp / "train.jsonl", _linear_rows(120, 0)),
             "--validation-file", _jsonl(tmp / "val.jsonl", _linear_rows(40, 1))]
    models = {}
    for k, extra in ((DEFAULT_K, []), (0, ["--recent-values", "0"])):
        out = tmp / f"k{k}"
        assert main(["train", *files, "--max-steps", "40", "--output-dir", str(out), "--no-plot", "--no-progress",
                     "--value-transform", "identity", *TINY32, *extra]) == 0
        base, _ = load_base(None, "qwen2", "float32", 32, 1)
        models[k] = CausalModel.from_pretrained(base, out / "adapter")
    return models


def test_the_head_reads_the_prompts_number_exactly(linear_law, qwen_tokenizer):
    train, test = _linear_rows(120, 0), _linear_rows(30, 2)
    x = torch.tensor([[float(r["prompt"].split()[1].rstrip(";")), 1.0] for r in train], dtype=torch.float64)
    y = torch.tensor([float(r["completion"]) for r in train], dtype=torch.float64)
    line = torch.linalg.lstsq(x, y.unsqueeze(-1)).solution.squeeze(-1)
    truth = [float(r["completion"]) for r in test]
    x_test = [float(r["prompt"].split()[1].rstrip(";")) for r in test]
    line_mae = sum(abs(line[0] * a + line[1] - t) for a, t in zip(x_test, truth)) / len(test)
    mae = {}
    for k, model in linear_law.items():
        assert model.causal_config.recent_values == k  # saved and reloaded with the adapter
        pred = model.predict_values([r["prompt"] for r in test], tokenizer=qwen_tokenizer)
        mae[k] = sum(abs(p["value"] - t) for p, t in zip(pred, truth)) / len(test)
    assert mae[DEFAULT_K] <= 1.1 * float(line_mae), (mae, float(line_mae))
    assert mae[0] > 2 * mae[DEFAULT_K], mae  # loc_U alone: the value through a random base's features


def test_generate_reads_the_numbers_forward_reads(linear_law, qwen_tokenizer):
    model = linear_law[DEFAULT_K]
    prompts = [r["prompt"] for r in _linear_rows(6, 3)]
    gen = model.generate(prompts, tokenizer=qwen_tokenizer, max_new_tokens=3)
    pred = model.predict_values(prompts, tokenizer=qwen_tokenizer)
    for nums, p in zip(gen.numbers, pred):
        assert nums and nums[0]["exact"] == pytest.approx(p["value"], abs=0.05 * (p["upper_90"] - p["lower_90"]))


def test_width_ignores_loc_U_distance_when_the_head_reads_no_loc_U():
    """The out-of-depth factor widens the interval with loc_U's distance from the training features: right for a
    head on loc_U, noise for a head on the recent values alone (co2: intervals 1.3x a constant width's Winkler)."""
    from causal_adapter.training.value_head.warm_start import ridge_warm_start
    from test_values import batches, regime_rows, wrap

    train_ds, _ = regime_rows(120, 0)
    val_ds, _ = regime_rows(40, 1)
    for k, inputs, widens in ((2, "recent[:1]", False), (0, "loc_U", True)):  # target = the one number + noise
        model = wrap(value_loc=50.0, value_scale=25.0, recent_values=k)
        summary = ridge_warm_start(model, batches(train_ds), "cpu", val_batches=batches(val_ds))
        act = model.action
        far = act.depth_mean + 50 * act.depth_basis[0]  # far out along the features' main direction
        assert summary.inputs == inputs and (float(act.depth_factor(far)) > 2) == widens, summary


def test_adapters_written_before_the_field_load_without_it():
    old = CausalAdapterConfig().to_dict()
    del old["recent_values"]
    assert CausalAdapterConfig.from_dict(old).recent_values == 0
    with pytest.raises(ValueError, match="recent_values"):
        CausalAdapterConfig(recent_values=-1)
    model = small_model(recent_values=2)
    assert model.action.w_recent.shape == (2,) and "action.w_recent" in model.adapter_state_dict()


def _inputs_case(seed: int, signal_in_loc_U: bool, n: int = 60, n_val: int = 20, C: int = 24, k: int = 4,
                 columns: tuple[int, int] = (0, 1)):
    """F [n, C + k] = (loc_U, recent values), targets from two `columns` of the recent values (or of loc_U), plus
    validation rows."""
    g = torch.Generator().manual_seed(seed)

    def rows(m):
        U, R = torch.randn(m, C, generator=g, dtype=torch.float64), torch.randn(m, k, generator=g, dtype=torch.float64)
        src = U if signal_in_loc_U else R
        noise = torch.randn(m, generator=g, dtype=torch.float64)
        return torch.cat([U, R], 1), 0.8 * src[:, columns[0]] + 0.3 * src[:, columns[1]] + 0.3 * noise

    return (*rows(n), *rows(n_val), C)


def test_head_inputs_one_standard_error_rule():
    from causal_adapter.training.value_head.warm_start import choose_head_inputs

    noise_picks = [choose_head_inputs(*_inputs_case(seed, False), max_shift=math.inf).name for seed in range(12)]
    # the target reads the 2 most recent values: those alone (K // 2 of 4), and loc_U (noise) almost never
    assert sum(name.startswith("loc_U") for name in noise_picks) <= 1, noise_picks  # smallest score alone: 4 of 12
    assert sum(name == "recent[:2]" for name in noise_picks) >= 10, noise_picks
    for seed in range(3):
        chosen = choose_head_inputs(*_inputs_case(seed, True), max_shift=math.inf)
        name, keep = chosen.name, chosen.keep
        assert name.startswith("loc_U") and bool(keep[:24].all()), name
        # an older value carries the signal: all K recent values are kept
        chosen = choose_head_inputs(*_inputs_case(seed, False, columns=(3, 0)), max_shift=math.inf)
        name, keep = chosen.name, chosen.keep
        assert "recent[" not in name and bool(keep[24:].all()), name
