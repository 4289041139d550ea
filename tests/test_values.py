"""The value head's claims (docs/values.md), each pinned by a test that a deliberate bug fails:

* the ridge penalty is the one with the best validation MAE (not the leave-one-out one);
* a robust fit (Huber / Cauchy IRLS) shrugs off shuffled targets that pull least squares away;
* the bf16 bound: rounding loc_U to bf16 moves loc_Y by < 1% of value_scale, and centring loc_U
  leaves every token score unchanged;
* per-row scale: wider in the noisier regime, much wider where the head never trained;
* the split-conformal map saved by train() is the validation split's normalised residuals, and the
  calibrated intervals cover at 0.5 / 0.8 / 0.9 / 0.95 on fresh data, tightly enough that a 2x wrong
  scale fails.

The synthetic rows are pre-tokenised: "tok R <NUM=base> tok | <NUM=target> eos" with the regime
token R giving the noise sd (`SD`), so the truth is known per row."""
import math

import pytest
import torch

from causal_adapter import CausalAdapterConfig, get_causal_model
from causal_adapter.modeling.intervals import fit_calibration, interval
from causal_adapter.training.metrics import coverage_metrics, evaluate_dataset
from causal_adapter.training.config import TrainConfig
from causal_adapter.training.loop import train
from causal_adapter.training.value_head.linear import LOSSES, RIDGE_GRID, bf16_shift, fit_linear_head, standardize
from causal_adapter.training.value_head.warm_start import center_abduction, ridge_warm_start
from conftest import small_vocab_qwen

NUM = 300
SD = {20: 0.5, 21: 1.0, 22: 4.0}  # regime token -> noise sd


def wrap(**cfg):
    return get_causal_model(small_vocab_qwen(num_layers=1), CausalAdapterConfig(num_token_id=NUM, **cfg))


def regime_rows(n, seed):
    """Pre-tokenised rows with a per-row noise sd given by the regime token; returns (dataset, sds)."""
    import datasets

    g = torch.Generator().manual_seed(seed)
    rows = {k: [] for k in ("input_ids", "numeric_values", "labels", "label_values", "target", "previous")}
    sds = []
    for _ in range(n):
        tok = list(SD)[int(torch.randint(len(SD), (), generator=g))]
        base = float(torch.rand((), generator=g) * 90 + 5)
        target = round(base + float(torch.randn((), generator=g)) * SD[tok], 2)
        rows["input_ids"].append([11, tok, NUM, 13, NUM, 14])
        rows["numeric_values"].append([0.0, 0.0, base, 0.0, target, 0.0])
        rows["labels"].append([-100, -100, -100, -100, NUM, 14])
        rows["label_values"].append([0.0, 0.0, 0.0, 0.0, target, 0.0])
        rows["target"].append(target)
        rows["previous"].append(base)
        sds.append(SD[tok])
    return datasets.Dataset.from_dict(rows), sds


def batches(ds, size=32):
    from causal_adapter.data.pipeline import NumericCollator

    collate = NumericCollator(0)
    return [collate([ds[j] for j in range(i, min(i + size, len(ds)))]) for i in range(0, len(ds), size)]


# --------------------------------------------------------------------------- the fit itself
def _shifted_problem(seed=0):
    """Train rows from one linear model, validation rows from a shifted one: the validation-best penalty is
    not the leave-one-out-best one."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(60, 8, generator=g, dtype=torch.float64)
    w = torch.tensor([1.0, -0.5, 0.3, 0, 0, 0, 0, 0.2], dtype=torch.float64) / 4
    t = X @ w + 0.05 * torch.randn(60, generator=g, dtype=torch.float64)
    Xv = torch.randn(40, 8, generator=g, dtype=torch.float64)
    tv = Xv @ (0.3 * w) + 0.05 * torch.randn(40, generator=g, dtype=torch.float64)  # validation favours shrinkage
    return X, t, Xv, tv


def _brute_force_fit(Xs, t, rel, unit, drop=None):
    """(mean of t, w [C]) of ridge on the centred standardised rows (all, or all but `drop`)."""
    keep = torch.ones(len(t), dtype=torch.bool)
    if drop is not None:
        keep[drop] = False
    Xk, tk = Xs[keep], t[keep]
    Xc = Xk - Xk.mean(0)
    A = Xc.T @ Xc + rel * unit * torch.eye(Xs.shape[1], dtype=torch.float64)
    return tk.mean(), Xk.mean(0), torch.linalg.solve(A, Xc.T @ (tk - tk.mean()))


def test_penalty_is_the_best_of_the_grid_on_validation_and_leave_one_out_together():
    X, t, Xv, tv = _shifted_problem()
    fit = fit_linear_head(X, t, Xv, tv, loss="squared")
    mean, sd = standardize(X)
    Xs = (X - mean) / sd
    unit = float(torch.linalg.matrix_norm(Xs - Xs.mean(0), ord=2) ** 2)
    val_mae, loo_mae = [], []
    for rel in RIDGE_GRID:  # brute force: refit at every penalty (and without each row), score both ways
        t0, x0, ws = _brute_force_fit(Xs, t, rel, unit)
        val_mae.append(float((t0 + ((Xv - mean) / sd - x0) @ ws - tv).abs().mean()))
        loo = []
        for i in range(len(t)):
            ti, xi, wi = _brute_force_fit(Xs, t, rel, unit, drop=i)
            loo.append(float((ti + (Xs[i] - xi) @ wi - t[i]).abs()))
        loo_mae.append(sum(loo) / len(loo))
    argmin = lambda scores: RIDGE_GRID[min(range(len(scores)), key=scores.__getitem__)]  # noqa: E731
    both = argmin([(a + b) / 2 for a, b in zip(val_mae, loo_mae)])
    assert fit.lam == pytest.approx(both, rel=1e-9) and fit.chosen_on == "validation+leave-one-out"
    # the problem separates the rules: validation alone and leave-one-out alone each pick another penalty
    assert argmin(val_mae) != pytest.approx(both, rel=1e-3) and argmin(loo_mae) != pytest.approx(both, rel=1e-3)
    loo = fit_linear_head(X, t, loss="squared")  # without validation: leave-one-out alone
    assert loo.chosen_on == "leave-one-out" and loo.lam == pytest.approx(argmin(loo_mae), rel=1e-9)


@pytest.mark.parametrize("loss", ["huber", "cauchy"])
def test_robust_fit_resists_shuffled_targets(loss):
    g = torch.Generator().manual_seed(1)
    X = torch.randn(300, 5, generator=g, dtype=torch.float64)
    w = torch.tensor([1.0, -1.0, 0.5, 0.0, 0.25], dtype=torch.float64)
    t = X @ w + 0.1 * torch.randn(300, generator=g, dtype=torch.float64)
    bad = torch.randperm(300, generator=g)[:120]  # 40% of the targets shuffled among themselves
    t_noisy = t.clone()
    t_noisy[bad] = t[bad[torch.randperm(120, generator=g)]]
    Xv = torch.randn(100, 5, generator=g, dtype=torch.float64)
    tv = Xv @ w
    err = {name: float((fit_linear_head(X, t_noisy, Xv, tv, loss=name, max_shift=math.inf).w - w).norm())
           for name in ("squared", loss)}
    assert err[loss] < 0.3 * err["squared"] and err["squared"] > 0.5, err


def test_tukey_fit_gives_far_shuffled_targets_no_weight():
    """Tukey's bisquare weight is 0 beyond TUKEY_C robust sds, so with 40% of the targets
    shuffled the rows far from the fit stop pulling (a Cauchy weight never reaches 0), the fit lands on
    least squares over the clean rows, and `auto` has it among its candidates."""
    from causal_adapter.training.value_head.linear import TUKEY_C

    g = torch.Generator().manual_seed(0)
    X = torch.randn(300, 5, generator=g, dtype=torch.float64)
    w = torch.tensor([1.0, -1.0, 0.5, 0.0, 0.25], dtype=torch.float64)
    t = X @ w + 0.1 * torch.randn(300, generator=g, dtype=torch.float64)
    bad = torch.randperm(300, generator=g)[:120]  # 40% of the targets shuffled among themselves
    t[bad] = t[bad[torch.randperm(120, generator=g)]]
    Xv = torch.randn(100, 5, generator=g, dtype=torch.float64)
    clean = torch.ones(300, dtype=torch.bool)
    clean[bad] = False
    oracle = fit_linear_head(X[clean], t[clean], Xv, Xv @ w, loss="squared", max_shift=math.inf)
    fit = fit_linear_head(X, t, Xv, Xv @ w, loss="tukey", max_shift=math.inf)
    resid = t - X @ fit.w - fit.b
    far = resid.abs() > TUKEY_C * float(resid.abs().median()) / 0.6745
    assert int(far[bad].sum()) > 60 and float(fit.weights[far].max()) <= 1e-12
    assert float((fit.w - oracle.w).norm()) < 0.01  # least squares on all rows: 0.57
    assert "tukey" in fit_linear_head(X, t, Xv, Xv @ w, loss="auto", max_shift=math.inf).scores


def test_auto_considers_tukey_only_for_a_head_no_training_follows():
    """The warm start of a run that trains W_loc chooses among WARM_START_LOSSES (a Tukey head sent
    sunspots' W_loc training astray at 40% shuffled targets); with W_loc frozen the warm start is the final
    head and Tukey competes (here it wins on validation)."""
    from causal_adapter.data.pipeline import NumericCollator
    from causal_adapter.training.value_head import fit_before_training

    ds, _ = regime_rows(300, 0)
    val, _ = regime_rows(80, 10)
    g = torch.Generator().manual_seed(0)
    bad = torch.randperm(300, generator=g)[:120].tolist()  # 40% of the targets shuffled among themselves
    perm = torch.randperm(120, generator=g).tolist()
    label_values, values = [list(r) for r in ds["label_values"]], [list(r) for r in ds["numeric_values"]]
    for i, j in zip(bad, perm):
        label_values[i][4] = values[i][4] = ds[bad[j]]["label_values"][4]
    ds = ds.remove_columns(["label_values", "numeric_values"])
    ds = ds.add_column("label_values", label_values).add_column("numeric_values", values)
    losses = {}
    for frozen in (False, True):
        model = wrap(seed=0)
        model.abduction.loc.requires_grad_(not frozen)
        summary = fit_before_training(model, TrainConfig(output_dir="unused"), ds, NumericCollator(0),
                                      torch.device("cpu"), eval_ds=val)
        losses[frozen] = summary.head.loss
        line = list(summary.as_dict())  # the "value head:" log line's keys, in their order (benchmarks parse them)
        assert line[:5] == ["value_loc", "value_scale", "value_decimals", "value_positive", "series"], line
        assert line[-1] == "value_transform" and summary["loss"] == summary.head.loss, line
    assert losses == {False: "cauchy", True: "tukey"}, losses


def _corrupted_problem(seed):
    """(X, t, t with 30% of the targets shuffled, Xv, clean tv) of one linear model with noise sd 0.3."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(200, 5, generator=g, dtype=torch.float64)
    w = torch.tensor([1.0, -1.0, 0.5, 0.0, 0.25], dtype=torch.float64)
    t = X @ w + 0.3 * torch.randn(200, generator=g, dtype=torch.float64)
    bad = torch.randperm(200, generator=g)[:60]
    noisy = t.clone()
    noisy[bad] = t[bad[torch.randperm(60, generator=g)]]
    Xv = torch.randn(60, 5, generator=g, dtype=torch.float64)
    return X, t, noisy, Xv, Xv @ w + 0.3 * torch.randn(60, generator=g, dtype=torch.float64)


def test_auto_loss_is_the_validation_best_fit():
    X, t, noisy, Xv, tv = _corrupted_problem(1)
    fits = {name: fit_linear_head(X, noisy, Xv, tv, loss=name, max_shift=math.inf) for name in LOSSES}
    val_mae = {name: float((Xv @ f.w + f.b - tv).abs().mean()) for name, f in fits.items()}
    auto = fit_linear_head(X, noisy, Xv, tv, loss="auto", max_shift=math.inf)
    assert auto.loss == min(val_mae, key=val_mae.get) == "cauchy", val_mae
    torch.testing.assert_close(auto.w, fits["cauchy"].w)
    assert auto.scores == pytest.approx(val_mae, rel=1e-9) and auto.chosen_on == "validation+leave-one-out"
    # without validation rows the LOO MAE decides, and picks another loss on these data
    assert fit_linear_head(X, noisy, loss="auto", max_shift=math.inf).loss == "tukey"
    # clean targets: least squares wins on validation and is kept
    X, t, _, Xv, tv = _corrupted_problem(0)
    assert fit_linear_head(X, t, Xv, tv, loss="auto", max_shift=math.inf).loss == "squared"
    with pytest.raises(ValueError, match="robust loss"):
        fit_linear_head(X, t, loss="l1")


def test_auto_loss_keeps_least_squares_unless_a_robust_fit_wins_by_one_standard_error():
    from causal_adapter.training.value_head.choice import one_standard_error_choice

    gen = torch.Generator().manual_seed(0)
    ref = torch.rand(40, generator=gen) * 10
    noise = torch.randn(40, generator=gen)

    def fit(name, errors):
        return {"loss": name, "abs_errors": errors, "score": float(errors.mean())}

    def choose(fits):  # as fit_linear_head's loss 'auto' chooses: paired held-out absolute errors, then the score
        return one_standard_error_choice(fits, lambda r, f: (r["abs_errors"] - f["abs_errors"],), lambda f: f["score"])
    # a smaller MAE by less than one standard error of the paired difference: least squares stays
    slightly = fit("cauchy", ref - 0.05 + noise)
    assert slightly["score"] < ref.mean()
    assert choose([fit("squared", ref), slightly])["loss"] == "squared"
    # clearly smaller: the robust fit with the smallest MAE among those that clear the bar
    clearly_h, clearly_c = fit("huber", ref * 0.5), fit("cauchy", ref * 0.4)
    assert choose([fit("squared", ref), clearly_h, clearly_c])["loss"] == "cauchy"
    assert choose([fit("squared", ref), clearly_h, slightly])["loss"] == "huber"


def test_bf16_bound_and_centring_keep_scores():
    train_ds, _ = regime_rows(120, 0)
    val_ds, _ = regime_rows(40, 1)
    model = wrap(value_loc=50.0, value_scale=25.0)
    ids, vals = torch.tensor([[11, 20, NUM, 13, 9, 14]]), torch.tensor([[0.0, 0.0, 40.0, 0.0, 0.0, 0.0]])
    with torch.no_grad():
        before = model(ids, vals, return_scores=True)
    summary = ridge_warm_start(model, batches(train_ds), "cpu", val_batches=batches(val_ds), max_shift=0.005)
    with torch.no_grad():
        after = model(ids, vals, return_scores=True)
        torch.testing.assert_close(after.loc_S, before.loc_S, rtol=0, atol=2e-5)  # centring: same token scores
        out = model(torch.tensor(val_ds["input_ids"]), torch.tensor(val_ds["numeric_values"]))
        loc_U = model.abduction(out.hidden_states)[0][:, 3]  # the positions that predict the <NUM> targets
        rounded, _ = model.action.regression(loc_U.bfloat16().float(), loc_U)
        exact, _ = model.action.regression(loc_U, loc_U)
    assert float((rounded - exact).abs().max()) < 0.01 * 25.0, summary
    assert summary.bf16_shift <= 0.005 * 25.0 + 1e-9
    # the same fit without the bound is ill-conditioned on these features: the bound is what holds it
    X = loc_U.double()
    loose = fit_linear_head(X - X.mean(0), torch.tensor(val_ds["target"], dtype=torch.float64) / 25.0,
                            loss="squared", max_shift=math.inf)
    assert bf16_shift(X, loose.w) > 0.01


def test_centring_is_exact_for_the_num_row():
    model = wrap()
    ids = torch.tensor([[11, 12, 13]])
    with torch.no_grad():
        before = model(ids, return_scores=True).loc_S
        center_abduction(model, torch.full((32,), 0.3, dtype=torch.float64))
        after = model(ids, return_scores=True).loc_S
    torch.testing.assert_close(after, before, rtol=0, atol=2e-5)


# --------------------------------------------------------------------------- trained: scale and calibration
@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    train_ds, _ = regime_rows(240, 0)
    val_ds, _ = regime_rows(240, 1)
    model = wrap()
    cfg = TrainConfig(output_dir=str(tmp_path_factory.mktemp("values") / "run"), max_steps=4,
                      per_device_train_batch_size=16, learning_rate=1e-3, plot=False, progress=False,
                      logging_steps=4)
    result = train(model, cfg, train_dataset=train_ds, eval_dataset=val_ds)
    return result.model, val_ds


def test_calibration_map_is_the_validation_residuals(trained):
    model, val_ds = trained
    cal = model.causal_config.value_calibration
    _, preds = evaluate_dataset(model, val_ds, pad_token_id=0, batch_size=64, return_predictions=True)
    y, loc, scale = (torch.tensor(preds[k], dtype=torch.float64) for k in ("y_true", "loc", "scale"))
    # a residual below the written resolution (half a unit of the last of value_decimals places) counts at it
    resolution = 0.5 * 10.0 ** -model.causal_config.value_decimals
    # each regime token names a series of its own (`modeling.series`); without `series_widths` none gets a width
    assert len(model.causal_config.value_series) == len(SD)
    assert not any("scale" in e for e in model.causal_config.value_series.values())
    expected = fit_calibration(y, torch.where((y - loc).abs() < resolution, y - resolution, loc), scale)
    assert cal["n"] == expected["n"] == len(val_ds)
    torch.testing.assert_close(torch.tensor(cal["scores"]), torch.tensor(expected["scores"]), rtol=1e-4, atol=1e-6)
    assert float(((y - loc).abs() / scale).median()) == pytest.approx(1.0, abs=0.02)  # raw 50% calibrated too


def test_per_row_scale_follows_the_regime_and_widens_out_of_depth(trained):
    model, _ = trained
    test_ds, sds = regime_rows(300, 2)
    _, preds = evaluate_dataset(model, test_ds, pad_token_id=0, batch_size=64, return_predictions=True)
    scale, sds = torch.tensor(preds["scale"]), torch.tensor(sds)
    calm, wild = float(scale[sds == 0.5].median()), float(scale[sds == 4.0].median())
    assert wild > 3.0 * calm, (calm, wild)  # the truth is 8x
    with torch.no_grad():  # positions that never predicted a <NUM> in training (text positions)
        out = model(torch.tensor(test_ds["input_ids"][:50]), torch.tensor(test_ds["numeric_values"][:50]))
    at_num, elsewhere = out.scale_Y[:, 3], out.scale_Y[:, [0, 1, 2, 4, 5]]
    assert float(elsewhere.median()) > 20 * float(at_num.max()), (float(elsewhere.median()), float(at_num.max()))


def test_calibrated_coverage_at_every_level_on_fresh_data(trained):
    model, _ = trained
    test_ds, _ = regime_rows(600, 3)
    _, preds = evaluate_dataset(model, test_ds, pad_token_id=0, batch_size=64, return_predictions=True)
    cal = model.causal_config.value_calibration
    cov = coverage_metrics(preds["y_true"], preds["loc"], preds["scale"], calibration=cal)
    for q in (0.5, 0.8, 0.9, 0.95):
        # 240 calibration rows and 600 test rows: sd of a coverage ~0.03; a 2x wrong scale is off by >= 0.2
        assert abs(cov[f"coverage_{round(100 * q)}"] - q) < 0.08, cov
    # the same bands with a 2x wrong scale fail (what the test must catch)
    doubled = coverage_metrics(preds["y_true"], preds["loc"], [2 * s for s in preds["scale"]], calibration=cal)
    assert any(abs(doubled[f"coverage_{round(100 * q)}"] - q) >= 0.08 for q in (0.5, 0.8, 0.9, 0.95)), doubled
    lo, hi = interval(torch.tensor(preds["loc"]), torch.tensor(preds["scale"]), 0.9, cal)
    assert bool((hi > lo).all())


@pytest.mark.parametrize("informative", [False, True])
def test_calibration_chooses_the_width_exponent_and_sets_it_in_the_model(informative):
    from causal_adapter.training.value_head.calibration import calibrate_regression_scale

    model = wrap(value_loc=0.0, value_scale=1.0)
    act = model.action
    w0 = torch.linspace(-0.2, 0.2, act.w_scale_Y.numel())
    with torch.no_grad():
        act.w_scale_Y.copy_(w0)
        act.log_scale_range.copy_(torch.tensor([-1.0, 1.0]))
    g = torch.Generator().manual_seed(4)
    ratio = torch.exp(torch.randn(300, generator=g, dtype=torch.float64))
    base = torch.full((300,), 2.0, dtype=torch.float64)
    y = torch.randn(300, generator=g, dtype=torch.float64) * (2.0 * ratio if informative else 2.0)
    preds = {"y_true": y.tolist(), "loc": [0.0] * 300, "scale": (base * ratio).tolist()}
    info = calibrate_regression_scale(model, preds, base.tolist())
    a = info.scale_exponent
    assert a == (1.0 if informative else 0.0), info
    torch.testing.assert_close(act.w_scale_Y.detach(), a * w0)  # the choice is in the adapter, not only the map
    torch.testing.assert_close(act.log_scale_range, torch.tensor([-a, a]))
    width = base * ratio ** a
    factor = float((y.abs() / width).median())
    assert float(act.b_noise_Y.detach().abs()) == pytest.approx(factor, rel=1e-5)  # |b_noise_Y| was 1
    expected = fit_calibration(y, torch.zeros(300), width * factor)
    torch.testing.assert_close(torch.tensor(model.causal_config.value_calibration["scores"]),
                               torch.tensor(expected["scores"]), rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("decimals", [2, None])
def test_an_exact_validation_fit_is_calibrated_at_the_written_resolution(decimals):
    """Residuals exactly 0 (a head that fits deterministic validation rows, built here without float
    rounding): calibration still runs, at half a unit in the last written place, and says so. Each row has a
    width of its own (20 resolutions), so each row's calibrated 50% interval must be its OWN resolution wide."""
    from causal_adapter.training.value_head.calibration import calibrate_regression_scale

    model = wrap(value_loc=0.0, value_scale=1.0)
    model.causal_config.value_decimals = decimals
    y = [3.25, 12.5, 7.75, 40.0, 0.5, 19.25, 3.25, 8.0]
    resolution = 0.5 * 10.0 ** (torch.floor(torch.log10(torch.tensor(y, dtype=torch.float64))) - 5)
    if decimals == 2:
        resolution = torch.full_like(resolution, 0.005)
    scale = 20 * resolution
    preds = {"y_true": y, "loc": list(y), "scale": scale.tolist()}
    info = calibrate_regression_scale(model, preds)
    assert info and "8/8" in info.exact_rows, info
    cal = model.causal_config.value_calibration
    assert cal is not None and cal["n"] == len(y)
    width = scale * float(model.action.b_noise_Y.detach().abs())  # the rows' scales, rescaled (|b_noise_Y| was 1)
    lo, hi = interval(torch.tensor(y, dtype=torch.float64), width, 0.5, cal)
    torch.testing.assert_close((hi - lo) / 2, resolution, rtol=1e-6, atol=0)


def test_independent_scale_adapters_still_load_and_behave(tmp_path):
    from causal_adapter import CausalModel

    old = wrap(regression_scale="independent", value_loc=10.0, value_scale=2.0)
    with torch.no_grad():
        old.action.b_noise_Y.fill_(0.7)
    old.save_pretrained(tmp_path / "old")
    loaded = CausalModel.from_pretrained(small_vocab_qwen(num_layers=1), tmp_path / "old")
    assert loaded.action.w_scale_Y is None and "action.w_scale_Y" not in loaded.adapter_state_dict()
    ids = torch.tensor([[11, 12, NUM, 13]])
    vals = torch.tensor([[0.0, 0.0, 4.0, 0.0]])
    with torch.no_grad():
        scale = loaded(ids, vals).scale_Y
    torch.testing.assert_close(scale, torch.full_like(scale, 1.4))  # one width for every row, as before


def test_bf16_bound_is_on_for_16_bit_heads_only():
    from causal_adapter.training.value_head.lifecycle import head_shift_bound
    from causal_adapter.config import BF16_MAX_SHIFT

    fp32 = wrap()
    base16 = small_vocab_qwen(num_layers=1, dtype=torch.bfloat16)
    bf16_base = get_causal_model(base16, CausalAdapterConfig(num_token_id=NUM))  # fp32 heads (default)
    bf16_heads = get_causal_model(small_vocab_qwen(num_layers=1, dtype=torch.bfloat16),
                                  CausalAdapterConfig(num_token_id=NUM, autocast_adapter_dtype=False))
    assert bf16_base.action.w_reg.dtype == torch.float32 and bf16_heads.action.w_reg.dtype == torch.bfloat16
    assert head_shift_bound(fp32, TrainConfig()) == math.inf
    assert head_shift_bound(fp32, TrainConfig(mixed_precision="bf16")) == math.inf  # heads stay fp32
    assert head_shift_bound(bf16_base, TrainConfig()) == math.inf
    assert head_shift_bound(bf16_heads, TrainConfig()) == BF16_MAX_SHIFT
    assert head_shift_bound(fp32, TrainConfig(bf16_safe_head="on")) == BF16_MAX_SHIFT
    assert head_shift_bound(bf16_heads, TrainConfig(bf16_safe_head="off")) == math.inf
