"""The value head's nonlinear correction in per-row units (`modeling.row_net`, `training.value_head.correction.add_correction`).

Claims, each failing when its mechanism is removed:

* on series of two kinds, smooth waves and white noise, whose next value one linear head on the window cannot
  serve both (the wave's continues its curve, the noise's is its level), the correction is kept on validation and
  its validation MAE in row units is well below the linear head's; on random walks (whose next step nothing in
  the window predicts) it is not kept (one standard error);
* the head's forward gives what the fit measured: loc_Y = m + s (linear + net) on the validation rows;
* its inputs are scale-free: a window multiplied by c gives c times the value and the width, the correction on;
* the fields are validated, and an adapter with the correction saves and loads with identical outputs;
* in the adapter's own units (a table's fields, no per-row rule wins: rule "fixed"), the head's form with its
  correction is kept where the target is curved (100 + 20 a b: well below the best hyperplane's error) and not where
  it is linear.
"""
import math

import pytest
import torch

from causal_adapter import CausalAdapterConfig
from causal_adapter.modeling.row_units import row_location_scale
from causal_adapter.training.value_head.correction import add_correction
from causal_adapter.training.value_head.linear import LOSSES
from causal_adapter.training.value_head.row_head import fit_row_head, set_row_head

from test_train import small_model

K = 8  # the window: 8 values, newest first


def _windows(n: int, seed: int, mixed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(R [n, K] the window's values newest first; y [n] the value to come). Each row is its own series at a level 10^U(-2, 4). `mixed`: half of the rows a smooth wave
    (the next value continues its curve), half white noise around a level (the next value is the level): one
    linear head on the window cannot be both, a head that reads the window's smoothness can. Else a random walk."""
    g = torch.Generator().manual_seed(seed)
    R, y = [], []
    for i in range(n):
        level = 10.0 ** (torch.rand(1, generator=g).item() * 6 - 2)
        t = torch.arange(9, dtype=torch.float64)
        noise = torch.randn(9, generator=g, dtype=torch.float64)
        if not mixed:
            path = torch.zeros(9, dtype=torch.float64)
            for j in range(1, 9):
                path[j] = path[j - 1] + noise[j]
        elif torch.rand(1, generator=g).item() < 0.5:
            omega, phase = 0.3 + 0.3 * torch.rand(1, generator=g).item(), 6.3 * torch.rand(1, generator=g).item()
            path = 10 * torch.sin(omega * t + phase) + 0.05 * noise
        else:
            path = 3 * noise
        path = (100 + path) * level
        R.append(path[:-1].flip(0))
        y.append(float(path[-1]))
    return torch.stack(R), torch.tensor(y, dtype=torch.float64)


def _fit(mixed: bool, members: int = 3):
    model = small_model(recent_values=K, value_loc=0.0, value_scale=1.0, value_row_units="last",
                        value_row_net=members, value_row_net_hidden=16)
    act = model.action
    R, y = _windows(600, 0, mixed)
    R_val, y_val = _windows(200, 1, mixed)
    row = fit_row_head(R, y, R_val, y_val, "last", act, loss="squared", losses=LOSSES, max_shift=math.inf)
    row = add_correction(row, R, y, R_val, y_val, act, seed=0)
    return model, row, (R_val, y_val)


def test_the_correction_is_kept_where_the_dynamics_are_nonlinear_and_the_forward_gives_its_fit():
    model, row, (R_val, y_val) = _fit(mixed=True)
    assert row.net is not None, row
    assert row.net_mae < 0.85 * row.linear_mae, (row.net_mae, row.linear_mae)
    set_row_head(model.action, row)
    model.set_row_units("last", row.width_power)
    with torch.no_grad():
        loc_Y, scale_Y = model.action.double().row_regression(R_val, R_val[:, 0])
    _, m, s, _ = row_location_scale(R_val, "last", 0.0, 1.0)
    # the head's MAE in row units on the validation rows that judged the correction is the one the fit measured
    assert float(((y_val - loc_Y) / s)[1::2].abs().mean()) == pytest.approx(row.net_mae, rel=1e-5)
    assert torch.all(scale_Y > 0)


def test_the_correction_is_not_kept_on_random_walks():
    _, row, _ = _fit(mixed=False)
    assert row.net is None and row.net_mae >= row.linear_mae - 0.02, row


@pytest.mark.parametrize("c", [1e-3, 1e3])
def test_a_window_multiplied_by_c_gives_c_times_the_value_with_the_correction(c):
    model, row, (R_val, _) = _fit(mixed=True, members=2)
    set_row_head(model.action, row)
    model.set_row_units("last", 0.5)
    head = model.action.double()
    assert any(bool(b.abs().sum() > 0) for b in head.row_net_parts().values())
    with torch.no_grad():
        loc, scale = head.row_regression(R_val, R_val[:, 0])
        loc_c, scale_c = head.row_regression(c * R_val, R_val[:, 0])
    assert torch.allclose(loc_c, c * loc, rtol=1e-9) and torch.allclose(scale_c, c * scale, rtol=1e-9)


def test_the_fields_are_validated_and_an_adapter_with_the_correction_round_trips(tmp_path):
    from causal_adapter.model import CausalModel
    from causal_adapter.saving.assets import build_tiny_qwen

    with pytest.raises(ValueError, match="value_row_net"):
        CausalAdapterConfig(recent_values=4, value_row_net=3)  # no width
    with pytest.raises(ValueError, match="value_row_net_hidden"):
        CausalAdapterConfig(recent_values=4, value_row_net=3, value_row_net_hidden=-1)
    old = CausalAdapterConfig().to_dict()
    del old["value_row_net"], old["value_row_net_hidden"]
    assert CausalAdapterConfig.from_dict(old).value_row_net == 0  # adapters written before the fields
    model, row, (R_val, _) = _fit(mixed=True, members=2)
    set_row_head(model.action, row)
    model.set_row_units("last", row.width_power)
    model.save_pretrained(tmp_path / "net")
    loaded = CausalModel.from_pretrained(build_tiny_qwen("qwen2", hidden_size=32, num_layers=1, vocab_size=320),
                                          tmp_path / "net")
    for name, buf in model.action.row_net_parts().items():
        assert torch.equal(loaded.action.row_net_parts()[name], buf), name
    ids = torch.tensor([[11, model.num_token_id, 12, model.num_token_id, 13, model.num_token_id, 14,
                         model.num_token_id, 15]])
    vals = torch.tensor([[0.0, 3.1, 0.0, 3.5, 0.0, 3.3, 0.0, 3.9, 0.0]])
    with torch.no_grad():
        a, b = model(ids, vals), loaded(ids, vals)
    assert torch.equal(a.loc_Y, b.loc_Y) and torch.equal(a.scale_Y, b.scale_Y)


def _batches(R: torch.Tensor, y: torch.Tensor, num_id: int, size: int = 100):
    """Token rows ``a <NUM> a <NUM> ... a <NUM>`` of each window (oldest first) and its next value, the last
    <NUM> the label: what `ridge_warm_start` reads at the position before it."""
    n = R.shape[1] + 1
    ids = torch.tensor([11, num_id] * n).repeat(len(y), 1)
    values = torch.zeros(len(y), 2 * n)
    values[:, 1::2] = torch.cat([R.flip(1), y[:, None]], 1).float()
    labels = torch.full_like(ids, -100)
    labels[:, -1] = num_id
    return [{"input_ids": ids[i:i + size], "numeric_values": values[i:i + size], "labels": labels[i:i + size],
             "attention_mask": torch.ones_like(ids[i:i + size])} for i in range(0, len(y), size)]


@pytest.fixture(scope="module")
def warm_started():
    """A model whose head `ridge_warm_start` fitted, as `train()` calls it, on mixed windows: (model, validation
    batches, validation windows and targets, the fit's summary)."""
    from causal_adapter.training.value_head.warm_start import ridge_warm_start

    model = small_model(recent_values=K, value_loc=0.0, value_scale=1.0, value_row_net=3, value_row_net_hidden=16)
    R, y = _windows(600, 0, True)
    R_val, y_val = _windows(200, 1, True)
    val = _batches(R_val, y_val, model.num_token_id)
    summary = ridge_warm_start(model, _batches(R, y, model.num_token_id), "cpu", val_batches=val, loss="squared",
                               row_rules=("last",), force_row_units=True)
    return model, val, (R_val, y_val), summary


def test_the_training_fit_keeps_the_correction_with_its_width_and_the_forward_reads_it(warm_started):
    """The correction kept, the width's exponent the adapter stores is the one chosen with it, and the model's
    forward gives the values the fit measured."""
    model, val, (R_val, y_val), summary = warm_started
    assert summary.row.row_net == "kept", summary
    assert model.causal_config.value_row_units == "last"
    assert model.causal_config.value_width_power == summary.row.width_power
    assert model.action.row_width_power == summary.row.width_power
    with torch.no_grad():
        loc_Y = torch.cat([model(b["input_ids"], b["numeric_values"], b["attention_mask"]).loc_Y[:, -2] for b in val])
    _, _, s, _ = row_location_scale(R_val, "last", 0.0, 1.0)
    mae = float(((y_val - loc_Y.double()) / s)[1::2].abs().mean())  # the rows that judged the correction
    assert mae == pytest.approx(summary.row.row_net_mae, rel=1e-3), (mae, summary)


def test_the_correction_under_a_bf16_autocast_computes_in_full_precision(warm_started):
    """The GPU path's mixed precision on CPU: under a bf16 autocast the heads run in their own float32
    (`heads.full_precision`), so the MLPs' matmuls are not rounded to bf16: loc_Y and scale_Y equal a float64 copy
    of the head on the same numbers (heads run under the autocast instead are off by ~1e-3)."""
    import copy

    from causal_adapter.modeling.recent_numbers import recent_values

    model, val, _, _ = warm_started
    b = val[0]
    recent = recent_values(b["input_ids"], b["numeric_values"], model.num_token_id, K)[:, -2].double()
    exact = copy.deepcopy(model.action).double().row_regression(recent, recent[:, 0])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(b["input_ids"], b["numeric_values"], b["attention_mask"])
    assert torch.allclose(out.loc_Y[:, -2].double(), exact[0], rtol=1e-5), (out.loc_Y[:, -2], exact[0])
    assert torch.allclose(out.scale_Y[:, -2].double(), exact[1], rtol=1e-5)


def _table(n: int, seed: int, curved: bool):
    """Rows of a table, not a series: three fields a, b, c of one kind and no period (the recent numbers, newest
    first, K slots), loc_U noise [n, 32], and a positive target: 100 + 20 a b (curved: one hyperplane in any units
    misses it) or 100 + 20 a + 30 b."""
    from causal_adapter.training.value_head.warm_start import WarmStartRows

    def part(n, g):
        a, b, c = (torch.rand(n, generator=g, dtype=torch.float64) * 9 + 1 for _ in range(3))
        # the noise grows with a where c > 5 (a width to read: train's recipe tries a log-width, here it must not
        # extrapolate to inf)
        noise = torch.randn(n, generator=g, dtype=torch.float64) * (0.5 + 0.3 * a * (c > 5))
        y = 100 + (20 * a * b if curved else 20 * a + 30 * b) + noise
        R = torch.full((n, K), math.nan, dtype=torch.float64)
        R[:, 0], R[:, 1], R[:, 2] = c, b, a
        return torch.randn(n, 32, generator=g, dtype=torch.float64) * 0.01, y, R

    g = torch.Generator().manual_seed(seed)
    X, y, R = part(n, g)
    X_val, y_val, R_val = part(n // 3, g)
    return WarmStartRows(X, y, R, X_val, y_val, R_val)


@pytest.mark.parametrize("curved", [True, False])
def test_in_the_adapters_units_the_correction_is_kept_only_where_the_target_is_curved(curved):
    """Where no per-row rule wins (a table's fields, not a series), the head's form in the adapter's units
    (rule "fixed") with its correction replaces the linear head only when it wins on held-out validation rows."""
    from causal_adapter.training.value_head.warm_start import fit_head

    rows = _table(600, 0, curved)
    model = small_model(recent_values=K, value_row_net=3, value_row_net_hidden=16, value_row_scale=True)
    model.set_value_units(float(rows.y.mean()), float(rows.y.std()))
    summary = fit_head(model, rows, loss="squared", max_shift=math.inf, losses=LOSSES, row_rules=("last", "median"))
    assert summary.units == ("fixed" if curved else "adapter"), summary
    with torch.no_grad():
        loc_Y, _ = model.action.double().regression(rows.X_val, torch.zeros_like(rows.X_val), rows.R_val)
    mae = float((rows.y_val - loc_Y).abs().mean())
    # least squares on the three fields: the best hyperplane's validation MAE
    A = torch.cat([rows.R[:, :3], torch.ones(len(rows.y), 1, dtype=torch.float64)], 1)
    coef = torch.linalg.lstsq(A, rows.y.unsqueeze(1)).solution[:, 0]
    A_val = torch.cat([rows.R_val[:, :3], torch.ones(len(rows.y_val), 1, dtype=torch.float64)], 1)
    plane = float((rows.y_val - A_val @ coef).abs().mean())
    if curved:  # the forward gives what the fit kept, well below the best hyperplane's error
        assert summary.row.row_net == "kept" and mae < 0.75 * plane, (mae, plane, summary)
    else:
        assert mae < 1.05 * plane, (mae, plane)
