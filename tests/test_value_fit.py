"""Value units, the ridge warm start, scale calibration and value rounding (docs/values.md).

The numeric-quality figures are on docs/numeric_quality.md and docs/values.md; these tests pin the
mechanics at toy size: exact Cauchy mapping, reproducible fitted statistics, save/load of the
units, exact leave-one-out residuals, and a trained head that beats the constant with a sane
90% coverage on a synthetic series."""
import json
import math

import pytest
import torch

from causal_adapter import CausalAdapterConfig, CausalModel, get_causal_model
from causal_adapter.saving.artifacts import CONFIG_NAME
from causal_adapter.modeling.cauchy import cauchy_icdf
from causal_adapter.training.metrics import evaluate_dataset
from causal_adapter.training.config import TrainConfig
from causal_adapter.training.loop import train
from causal_adapter.training.value_head.linear import fit_linear_head
from causal_adapter.training.value_head.warm_start import fit_value_units, value_decimals
from conftest import small_vocab_qwen

NUM = 300


def wrap(**cfg):
    return get_causal_model(small_vocab_qwen(num_layers=1), CausalAdapterConfig(num_token_id=NUM, **cfg))


def series_rows(n, seed):
    """Pre-tokenised rows "tok tok <NUM=prev> tok | <NUM=target> eos": target = prev + noise."""
    import datasets

    g = torch.Generator().manual_seed(seed)
    rows = {k: [] for k in ("input_ids", "numeric_values", "labels", "label_values", "target", "previous")}
    for _ in range(n):
        prev = float(torch.rand((), generator=g) * 90 + 5)
        target = round(prev + float(torch.randn((), generator=g)) * 2.0, 1)
        ids = [11, 12, NUM, 13, NUM, 14]
        vals = [0.0, 0.0, prev, 0.0, target, 0.0]
        labels = [-100, -100, -100, -100, NUM, 14]
        rows["input_ids"].append(ids)
        rows["numeric_values"].append(vals)
        rows["labels"].append(labels)
        rows["label_values"].append([0.0, 0.0, 0.0, 0.0, target, 0.0])
        rows["target"].append(target)
        rows["previous"].append(prev)
    return datasets.Dataset.from_dict(rows)


def test_fit_value_units_is_robust_and_reproducible():
    values = [1.0, 2.0, 3.0, 4.0, 1000.0]
    loc, scale = fit_value_units(values)
    assert loc == 3.0
    q = torch.quantile(torch.tensor(values, dtype=torch.float64), torch.tensor([0.25, 0.75], dtype=torch.float64))
    assert scale == pytest.approx(float(q[1] - q[0]) / 1.349)
    assert fit_value_units(values) == (loc, scale)
    loc, scale = fit_value_units([7.0] * 5)  # no spread: a positive fallback, never 0
    assert loc == 7.0 and scale > 0
    with pytest.raises(ValueError, match="no finite <NUM> target"):
        fit_value_units([float("nan")])
    assert value_decimals([5.0, 12.25, 3.1]) == 2
    assert value_decimals([5.0, 12.0]) == 0


def test_ridge_loo_residuals_equal_refits():
    g = torch.Generator().manual_seed(0)
    X = torch.randn(30, 4, generator=g, dtype=torch.float64)
    t = X @ torch.tensor([1.0, -2.0, 0.5, 0.0], dtype=torch.float64) + 3 + 0.3 * torch.randn(30, generator=g,
                                                                                                 dtype=torch.float64)
    X = X * torch.tensor([1.0, 4.0, 0.01, 1.0], dtype=torch.float64)  # features on very different scales
    t = t / 10  # standardised-unit targets: the bf16 bound (BF16_MAX_SHIFT) is in these units
    fit = fit_linear_head(X, t, loss="squared")
    w, lam, loo = torch.cat([fit.w, torch.tensor([fit.b], dtype=fit.w.dtype)]), fit.lam, fit.loo
    Xs = (X - X.mean(0)) / X.std(0, unbiased=False)  # the fit is on per-feature standardised features
    lam = lam * float(torch.linalg.matrix_norm(Xs, ord=2) ** 2)  # the penalty is relative to the top sv^2
    for i in (0, 7, 29):  # leave row i out, refit with the same penalty and standardisation, predict it
        keep = torch.arange(30) != i
        Xi, ti = Xs[keep], t[keep]
        mx, mt = Xi.mean(0), ti.mean()
        A = (Xi - mx).T @ (Xi - mx) + lam * torch.eye(4, dtype=torch.float64)
        wi = torch.linalg.solve(A, (Xi - mx).T @ (ti - mt))
        pred = mt + (Xs[i] - mx) @ wi
        assert float(t[i] - pred) == pytest.approx(float(loo[i]), rel=1e-8, abs=1e-10)
    assert float((X @ w[:-1] + w[-1] - t).abs().mean()) < 0.05  # the fit itself is good


def test_value_units_map_intervals_exactly_and_round_trip(tmp_path):
    model = wrap(value_loc=120.0, value_scale=35.0, value_decimals=1)
    ids = torch.tensor([[11, 12, NUM, 13]])
    vals = torch.tensor([[0.0, 0.0, 118.5, 0.0]])
    with torch.no_grad():
        out = model(ids, vals)
        loc_U, scale_U = model.abduction(out.hidden_states)
        loc_std = loc_U @ model.action.w_reg + model.action.b_reg
        scale_std = model.action.b_noise_Y.abs()
    q = torch.tensor(0.95, dtype=torch.float64)
    # the 90% interval of Y is the mapped 90% interval of Y'
    upper_Y = cauchy_icdf(q, out.loc_Y.double(), out.scale_Y.double())
    upper_std = cauchy_icdf(q, loc_std.double(), scale_std.double())
    torch.testing.assert_close(upper_Y, 120.0 + 35.0 * upper_std, rtol=1e-6, atol=1e-4)
    # phi sees the standardised value at <NUM> positions only
    e = model.embed(ids, vals)
    e0 = model.backbone.get_input_embeddings()(ids)
    torch.testing.assert_close(e[0, 2] - e0[0, 2], math.log1p((120.0 - 118.5) / 35.0) * -model.numeric_embedding.direction)
    assert torch.equal(e[0, [0, 1, 3]], e0[0, [0, 1, 3]])
    model.save_pretrained(tmp_path / "a")
    saved = json.loads((tmp_path / "a" / CONFIG_NAME).read_text())["adapter_config"]
    assert (saved["value_loc"], saved["value_scale"], saved["value_decimals"]) == (120.0, 35.0, 1)
    again = CausalModel.from_pretrained(small_vocab_qwen(num_layers=1), tmp_path / "a")
    with torch.no_grad():
        out2 = again(ids, vals)
    assert torch.equal(out2.loc_Y, out.loc_Y) and torch.equal(out2.scale_Y, out.scale_Y)


def test_adapter_saved_before_value_units_loads_with_the_seeds_heads(tmp_path):
    old = wrap(regression_scale="shared", direction_norm=1.0)
    old.save_pretrained(tmp_path / "old")
    meta_path = tmp_path / "old" / CONFIG_NAME
    meta = json.loads(meta_path.read_text())
    for key in ("regression_scale", "direction_norm", "value_loc", "value_scale", "standardize_inputs",
                "b_noise_Y_init", "value_decimals"):
        meta["adapter_config"].pop(key)
    meta_path.write_text(json.dumps(meta))  # what a version without these fields wrote
    loaded = CausalModel.from_pretrained(small_vocab_qwen(num_layers=1), tmp_path / "old")
    assert loaded.causal_config.regression_scale == "shared" and loaded.action.b_noise_Y is None
    ids = torch.tensor([[11, 12, 13]])
    with torch.no_grad():
        assert torch.equal(loaded(ids).scale_Y, old(ids).scale_Y)


def test_alpha_zero_stays_the_config_default():
    assert CausalAdapterConfig().alpha == 0.0
    assert TrainConfig().gate_alpha == 1.0
    assert TrainConfig().adapter_config().alpha == 1.0
    assert TrainConfig(gate_alpha=0.0).adapter_config().alpha == 0.0


def test_trained_head_beats_constant_with_sane_coverage(tmp_path):
    train_ds, val_ds, test_ds = series_rows(96, 0), series_rows(24, 1), series_rows(40, 2)
    model = wrap()
    cfg = TrainConfig(output_dir=str(tmp_path / "run"), max_steps=12, per_device_train_batch_size=8,
                      learning_rate=1e-2, plot=False, progress=False, logging_steps=4)
    result = train(model, cfg, train_dataset=train_ds, eval_dataset=val_ds)
    units = (model.causal_config.value_loc, model.causal_config.value_scale, model.causal_config.value_decimals)
    assert units == (*fit_value_units(train_ds["target"]), 1)
    metrics = evaluate_dataset(result.model, test_ds, pad_token_id=0, batch_size=16,
                               train_targets=train_ds["target"])
    assert metrics["value_mae"] < 0.5 * metrics["baseline_constant_mae"], metrics
    assert 0.6 <= metrics["coverage_90"] <= 1.0, metrics
    assert 0.2 <= metrics["coverage_50"] <= 0.8, metrics
    # the same run again gives the same units and head (fitted statistics are reproducible)
    again = train(wrap(), TrainConfig(**{**cfg.to_dict(), "output_dir": str(tmp_path / "run2")}),
                  train_dataset=train_ds, eval_dataset=val_ds).model
    assert again.causal_config.value_loc == model.causal_config.value_loc
    assert torch.equal(again.action.w_reg, model.action.w_reg)


def test_generated_values_are_rounded_to_the_data_precision():
    model = wrap(value_loc=50.0, value_scale=10.0, value_decimals=1)
    with torch.no_grad():  # make <NUM> the sure next token, and the value a long decimal
        model.action.b_cls[NUM] = 1e4
        model.action.b_reg.fill_(0.123456)
    out = model.generate(torch.tensor([[11, 12, 13]]), max_new_tokens=1, mode="deterministic")
    n = out.numbers[0][0]
    assert n["exact"] == pytest.approx(n["loc"], rel=1e-6)
    assert n["value"] == pytest.approx(round(n["exact"], 1), abs=1e-5)  # float32 values
    assert n["text"] == f"{round(n['exact'], 1):g}" and abs(n["value"] - n["exact"]) > 1e-3
    assert float(out.new_values[0, 0]) == n["value"]  # the rounded value is what is fed back


def test_a_fit_summary_prints_its_fields_flat_in_order_leaving_out_what_the_fit_did_not_reach():
    """`LogSummary.as_dict`, the "value head:" log line: fields in order, a nested summary flattened in its place,
    None left out unless the field keeps it (a per-row head's unmeasured score still prints)."""
    from causal_adapter.training.value_head.warm_start import HeadFitSummary, RowUnitsSummary

    head = HeadFitSummary(rows=10, inputs="loc_U", loss="squared", ridge_lambda=0.1, chosen_on="leave-one-out",
                          w_norm=1.0, bf16_shift=0.0, loo_mae=2.0, finite=True)
    assert list(head.as_dict())[-2:] == ["finite", "units"] and head["units"] == "adapter"
    head.row = RowUnitsSummary(units_score=None, adapter_units_score=0.5, width_power=1.0, row_scale="kept")
    head.depth = "off"
    assert list(head.items())[-6:] == [("units", "adapter"), ("units_score", None), ("adapter_units_score", 0.5),
                                       ("width_power", 1.0), ("row_scale", "kept"), ("depth", "off")]
    with pytest.raises(KeyError):
        head["row_net"]
