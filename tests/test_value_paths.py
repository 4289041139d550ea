"""The value and its interval on every path that reports one (docs/values.md; each test here fails under a
hand mutation that passed the suite before):

* the per-row width at and beyond the edges of its fitted range: the edge's width times the depth factor
  (mutation: the clamp to the fitted range replaced by a fixed +-30);
* under a bf16 autocast the heads of `generate`, of `predict_values`' p_num and of the mid-run metrics
  compute in float32, as `forward` does (mutation: `full_precision` removed from any one of them);
* `generate`'s interval_50 / interval_90 use the adapter's calibration map (mutation: built without it);
* a mid-run evaluation with the value head refitted leaves the training state, config included, as it
  was (mutation: the heads restored but not the config).
"""
import math

import pytest
import torch

from causal_adapter import CausalAdapterConfig, get_causal_model
from causal_adapter.modeling.intervals import cauchy_multiplier, fit_calibration
from conftest import small_vocab_qwen

NUM = 300


def wrap(dtype=torch.float32, **cfg):
    model = get_causal_model(small_vocab_qwen(num_layers=1, dtype=dtype, seed=3), CausalAdapterConfig(num_token_id=NUM, **cfg))
    model.set_value_units(400.0, 150.0, 2)
    return model


def prompt_ids(seed=0, B=3, S=9):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 290, (B, S), generator=g)
    ids[:, 2] = NUM
    values = torch.where(ids == NUM, 400 + 150 * torch.randn(B, S, generator=g), torch.zeros(B, S))
    return ids, values


def force_numbers(model):
    """P(<NUM>) ~ 1 at every position, so generation writes a number at its first step."""
    with torch.no_grad():
        model.action.b_cls[NUM] = 1e4


# --------------------------------------------------------------------------- the width's clamp
def test_width_beyond_the_fitted_range_is_the_edge_width_times_the_depth_factor():
    model = wrap()
    act = model.action
    C = act.w_scale_Y.numel()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        act.w_scale_Y.copy_(torch.randn(C, generator=g) / math.sqrt(C))
        act.log_scale_range.copy_(torch.tensor([-0.7, 0.4]))  # as the warm start fits it: the training rows' range
        act.b_noise_Y.fill_(0.3)
        act.depth_resid.fill_(1.0)  # depth factor max(1, |loc_U|): grows away from the training features
    w = act.w_scale_Y.detach()
    direction = w / w.square().sum()  # loc_U @ w moves by 1 per unit along it
    for edge, steps in ((0.4, (0.0, 0.5, 3.0, 40.0)), (-0.7, (0.0, -0.5, -3.0, -40.0))):
        for extra in steps:
            u = ((edge + extra) * direction).reshape(1, C)
            _, scale = act.regression(u, torch.ones_like(u))
            scale = scale.detach()
            depth = max(1.0, float(u.norm()))
            assert float(scale) == pytest.approx(150.0 * 0.3 * math.exp(edge) * depth, rel=1e-4), (edge, extra)
    inside = (0.1 * direction).reshape(1, C)  # inside the range the linear log-width holds
    _, scale = act.regression(inside, torch.ones_like(inside))
    scale = scale.detach()
    assert float(scale) == pytest.approx(150.0 * 0.3 * math.exp(0.1) * max(1.0, float(inside.norm())), rel=1e-4)


# --------------------------------------------------------------------------- full precision under autocast
def bf16_model():
    model = wrap(dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # a head whose bf16 rounding shows: |w| ~ 10, values far from the centre
        model.action.w_reg.copy_(torch.randn(model.action.w_reg.numel(), generator=g) * 2)
        model.action.b_reg.fill_(0.37)
    return model


def test_generate_heads_are_float32_under_bf16_autocast():
    model = bf16_model()
    force_numbers(model)
    ids, values = prompt_ids()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = model(ids, values)  # forward's heads are float32 (pinned in test_mixed_precision)
        gen = model.generate(input_ids=ids, numeric_values=values, max_new_tokens=1)
    for b in range(ids.shape[0]):
        n = gen.numbers[b][0]
        assert n["exact"] == pytest.approx(float(ref.loc_Y[b, -1].detach()), abs=1e-4 * 150)
        assert n["scale"] == pytest.approx(float(ref.scale_Y[b, -1].detach()), rel=1e-4)


def test_predict_p_num_is_float32_under_bf16_autocast():
    from causal_adapter.modeling.cauchy import ovr_probability
    from causal_adapter.modeling.prediction import predict_batch

    model = bf16_model()
    with torch.no_grad():  # P(<NUM>) mid-range, where a bf16 rounding of loc_S moves it
        model.action.b_cls[NUM] = 0.0
    ids, values = prompt_ids(seed=2)
    enc = {"input_ids": ids, "numeric_values": values, "attention_mask": torch.ones_like(ids)}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loc, scale, p_num = predict_batch(model, enc)
        out = model(ids, values)
    act = model.action
    loc_U, scale_Up = out.loc_U[:, -1].double(), act.noisy_scale(out.scale_U[:, -1]).double()
    w = act.num_weight(model.W_cls).double()
    loc_S = loc_U @ w + act.b_cls[NUM].double()
    scale_S = (scale_Up @ w.abs()).clamp_min(act.scale_floor)
    expected = ovr_probability(loc_S, scale_S, act.num_threshold().double())
    torch.testing.assert_close(p_num, expected, rtol=1e-4, atol=1e-9)
    torch.testing.assert_close(loc, out.loc_Y[:, -1].double(), rtol=1e-5, atol=1e-3)


def test_mid_run_metrics_score_tokens_in_float32_under_bf16_autocast():
    from causal_adapter.training.metrics import MetricAccumulator

    model = bf16_model()
    ids, values = prompt_ids(seed=3, B=4, S=16)
    batch = {"input_ids": ids, "numeric_values": values, "labels": ids, "label_values": values}
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(ids, values, labels=ids)
    results = []
    for enabled in (False, True):  # the same outputs, scored outside / inside the autocast of a training run
        acc = MetricAccumulator(NUM, 1.0)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
            acc.update(model, out, batch)
        results.append(acc.compute())
    plain, amp = results
    assert plain["perplexity"] is not None
    for key in ("accuracy", "num_recall", "perplexity"):
        assert amp[key] == pytest.approx(plain[key], rel=1e-6), key


# --------------------------------------------------------------------------- generate's calibrated intervals
def test_generate_reports_the_calibrated_intervals():
    model = wrap()
    force_numbers(model)
    g = torch.Generator().manual_seed(0)
    y = torch.randn(200, generator=g, dtype=torch.float64) * 2.0  # normal residuals: c_90 ~ 3.3, Cauchy's 6.3
    model.causal_config.value_calibration = fit_calibration(y, torch.zeros(200), torch.ones(200))
    ids, values = prompt_ids()
    gen = model.generate(input_ids=ids, numeric_values=values, max_new_tokens=1)
    for nums in gen.numbers:
        n = nums[0]
        loc, scale = torch.tensor(n["loc"], dtype=torch.float64), torch.tensor(n["scale"], dtype=torch.float64)
        for q in (0.5, 0.9):
            level = round(100 * q)
            lo, hi = model.value_interval(loc, scale, q)
            assert n[f"interval_{level}"] == pytest.approx((float(lo), float(hi)), rel=1e-9)
            raw = cauchy_multiplier(q) * float(scale)
            assert n[f"raw_interval_{level}"] == pytest.approx((float(loc) - raw, float(loc) + raw), rel=1e-9)
        assert n["interval_90"][1] - n["interval_90"][0] < 0.7 * (n["raw_interval_90"][1] - n["raw_interval_90"][0])


# --------------------------------------------------------------------------- the mid-run refit
def test_mid_run_refit_restores_the_config(tmp_path):
    from test_values import regime_rows

    from causal_adapter.training.config import TrainConfig
    from causal_adapter.training.loop import train

    train_ds, _ = regime_rows(64, 0)
    val_ds, _ = regime_rows(32, 1)
    seen = {}
    for eval_steps in (0, 1):
        model = wrap()  # W_loc trains (the default): the head is refitted for every mid-run evaluation
        g = torch.Generator().manual_seed(0)
        calibration = fit_calibration(torch.randn(50, generator=g, dtype=torch.float64), torch.zeros(50), torch.ones(50))
        model.causal_config.value_calibration = calibration  # a map from an earlier run: part of the training state
        configs = []
        cfg = TrainConfig(output_dir=str(tmp_path / f"run{eval_steps}"), max_steps=3, eval_steps=eval_steps,
                          per_device_train_batch_size=16, plot=False, progress=False, logging_steps=3,
                          calibrate_scale=False)
        train(model, cfg, train_dataset=train_ds, eval_dataset=val_ds,
              callbacks=[lambda state, logs: configs.append((model.causal_config.to_dict(), "eval" in logs))])
        seen[eval_steps] = [c for c, _ in configs]
        assert [e for _, e in configs] == [bool(eval_steps)] * 3  # evaluations after every step, or none
    assert seen[1] == seen[0]  # the evaluations (refitted heads, no calibration map) left no trace
    assert seen[1][0]["value_calibration"] == calibration
