"""One per-row transform for training and serving (`modeling.row_transform.row_frame`): the rows the value head's fit
reads (`training.value_head.row_head.row_rows`) and the rows the head reads at inference (`ActionHead.units`) are
the same tensors, for the same raw recent values. Either side changed alone (a clamp, a unit, an input of the
correction) fails here."""
from __future__ import annotations

import copy
import math

import pytest
import torch

from causal_adapter.training.value_head.correction import add_correction
from causal_adapter.training.value_head.linear import LOSSES
from causal_adapter.training.value_head.row_head import add_row_scale, fit_row_head, row_rows, set_row_head

from test_train import small_model

K = 16


def _rows(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dated windows (a year before each value, newest first) at levels 10^-2 .. 10^4, some shorter than K (NaN
    past them), some too short for their own units; and each row's next value."""
    g = torch.Generator().manual_seed(seed)
    R = torch.full((n, K), math.nan, dtype=torch.float64)
    y = torch.empty(n, dtype=torch.float64)
    for i in range(n):
        level = 10.0 ** (torch.rand(1, generator=g).item() * 6 - 2)
        length = (2, 4, 6)[i % 3]  # values in the window
        path = level * (1 + 0.02 * torch.randn(length + 1, generator=g, dtype=torch.float64).cumsum(0))
        numbers = []
        for j, v in enumerate(path[:-1].tolist()):
            numbers += [2000.0 + j, v] if length > 2 else [v]  # two bare numbers: too few for their own units
        numbers += [2000.0 + length] if length > 2 else []
        R[i, :len(numbers)] = torch.tensor(numbers[::-1], dtype=torch.float64)
        y[i] = path[-1]
    return R, y


@pytest.fixture(scope="module")
def fitted_head():
    """A float64 head in per-row units with a correction and a log-width fitted by the fit's own steps."""
    model = small_model(recent_values=K, value_loc=5.0, value_scale=3.0, value_row_units="last",
                        value_row_net=2, value_row_net_hidden=8, value_row_scale=True)
    act = model.action.double()
    R, y = _rows(300, 0)
    R_val, y_val = _rows(120, 1)
    row = fit_row_head(R, y, R_val, y_val, "last", act, loss="squared", losses=LOSSES, max_shift=math.inf)
    row = add_row_scale(add_correction(row, R, y, R_val, y_val, act, seed=0), R_val, y_val, act)
    set_row_head(act, row)
    act.set_row_units("last", 0.5)
    return act, row


@pytest.mark.parametrize("narrow", [False, True])
def test_the_fit_and_the_head_read_the_same_rows(fitted_head, narrow):
    """`narrow`: the head's clamp shrunk (and the fit given the same), so that r leaves it on most rows and the
    clamp reaches the correction's inputs."""
    act, row = fitted_head
    assert torch.equal(act.recent_range, row.clamp())  # the head clamps r to the fit's range
    if narrow:
        act = copy.deepcopy(act)
        act.recent_range.mul_(0.05)
    R, y = _rows(90, 2)
    fit = row_rows(R, y, "last", act, act.recent_range)
    loc, scale, r, width, x = act.units(R, R[:, 0])
    own = fit.frame.own
    assert bool(own.any()) and not bool(own.all())  # both kinds of rows: their own units and the adapter's
    assert torch.equal(loc, fit.frame.loc) and torch.equal(scale, fit.frame.scale)
    assert torch.equal(r, fit.frame.r)  # what the linear head reads (it clamps r to recent_range itself)
    assert torch.equal(x, fit.x)  # the correction's and the log-width's inputs, r clamped
    if narrow:
        assert not torch.equal(fit.r, fit.frame.r)  # the clamp was reached
    assert torch.equal(width, fit.frame.width(act.row_width_power))
    torch.testing.assert_close(width / scale, fit.ratio ** act.row_width_power, rtol=1e-12, atol=0)
    # the target the fit regresses is the head's value in the same units: loc_Y = m + s t for the fit's t
    torch.testing.assert_close(loc + scale * fit.t, y, rtol=1e-12, atol=0)


def test_the_head_gives_the_value_the_fit_fitted(fitted_head):
    """The head's loc_Y, in row units, is the fit's linear head plus its correction on the fit's inputs."""
    act, row = fitted_head
    R, y = _rows(60, 3)
    fit = row_rows(R, y, "last", act, row.clamp())
    with torch.no_grad():
        loc_Y, _ = act.row_regression(R, R[:, 0])
    expected = fit.r @ row.linear.w + row.linear.b
    if row.net is not None:
        from causal_adapter.modeling.row_net import row_net
        expected = expected + row_net(fit.x, row.net)
    torch.testing.assert_close((loc_Y - fit.frame.loc) / fit.frame.scale, expected, rtol=1e-9, atol=1e-9)


def test_a_slot_some_rows_leave_empty_is_read_as_the_fit_read_it():
    """Rows with fewer numbers than K (a table whose rows hold 4 or 5 numbers) read r = 0 in the empty slots, in
    the fit and in the forward: the clamp range holds 0 there, so the forward gives the fit's predictions (a range
    of the rows that have a number alone clamped those zeros away: every short row moved, a price 0.68x its fit)."""
    from causal_adapter.training.value_head.linear import recent_range

    R = torch.tensor([[3.0, 1500.0], [4.0, math.nan], [5.0, math.nan]], dtype=torch.float64)
    r = torch.nan_to_num((R - 2.0) / 1.0, nan=0.0)  # standardised as the head reads them, 0 where none
    lo, hi = recent_range(r, R)
    assert bool((lo <= r).all()) and bool((r <= hi).all())  # clamping changes no training row
    assert float(lo[1]) <= 0.0 <= float(hi[1])


# --------------------------------------------------------------------------- a window W = 4 K, as `train` sets it
WK = 4  # K: the row's own values the head reads; its window W = 4 K numbers


def _monthly_rows(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Monthly records as a text writes them ("Series. 2016-07: 31.7; 2016-08: 33.2; ...; 2017-01:"), the 4 K most
    recent numbers of the text parsed back (newest first: the next month's month and year, then value, month,
    year, ...), levels 10^-2 .. 10^4, each a random walk of 2% steps; and each row's next value. The first K
    numbers of such a window hold one value: its own units need the whole window."""
    from causal_adapter.numbers import find_numbers, format_number

    g = torch.Generator().manual_seed(seed)
    R = torch.empty(n, 4 * WK, dtype=torch.float64)
    y = torch.empty(n, dtype=torch.float64)
    for i in range(n):
        level = 10.0 ** (torch.rand(1, generator=g).item() * 6 - 2)
        path = level * (1 + 0.02 * torch.randn(8, generator=g, dtype=torch.float64).cumsum(0))
        months = [(2016 + (6 + j) // 12, (6 + j) % 12 + 1) for j in range(8)]
        text = "Series. " + "; ".join(f"{yr}-{m:02d}: {format_number(float(v))}"
                                      for (yr, m), v in zip(months[:-1], path[:-1].tolist()))
        text += f"; {months[-1][0]}-{months[-1][1]:02d}:"
        numbers = [n.value for n in find_numbers(text)]
        R[i] = torch.tensor(numbers[::-1][:4 * WK], dtype=torch.float64)
        y[i] = path[-1]
    return R, y


def _windowed_model():
    model = small_model(recent_values=WK, recent_window=4 * WK, value_loc=5.0, value_scale=3.0,
                        value_row_units="last", regression_scale="independent")
    assert model.action.recent_window == 4 * WK
    return model.double()


def test_the_fit_and_the_head_find_the_kinds_over_the_whole_window():
    """With a window of W = 4 K numbers (year, month, value records), the fit's rows (`row_rows`) and the head's
    (`ActionHead.units`) find each row's kinds over all W numbers: every row gets its own units from K values of
    its own kind, and both sides read the same m, s, r and width (a side that read only the K most recent numbers
    would find one value there and keep the adapter's units)."""
    act = _windowed_model().action
    R, y = _monthly_rows(40, 0)
    fit = row_rows(R, y, "last", act, act.recent_range)
    loc, scale, r, width, _ = act.units(R, R[:, 0])
    assert bool(fit.frame.own.all())  # K own values each, found over the whole window
    torch.testing.assert_close(fit.frame.loc, R[:, 2], rtol=0, atol=0)  # "last": the newest value (lag 2)
    assert torch.equal(loc, fit.frame.loc) and torch.equal(scale, fit.frame.scale) and torch.equal(r, fit.frame.r)
    assert torch.equal(width, fit.frame.width(act.row_width_power))
    torch.testing.assert_close(loc + scale * fit.t, y, rtol=1e-12, atol=0)


def test_a_head_fitted_on_a_window_of_4k_numbers_predicts_as_the_fit_did():
    """`fit_head` on rows whose window is W = 4 K numbers (monthly records at levels 10^-2 .. 10^4), per-row units
    forced: the head then predicts the validation rows with the relative error of persistence (random walks: the
    last value is the best forecast) within 10%, reading the same window. A fit that found the kinds on the first
    K numbers only (one value there: the adapter's units) fits weights the head then applies in row units: 1.6 x
    persistence's error here."""
    from causal_adapter.training.value_head.warm_start import WarmStartRows, fit_head

    model = _windowed_model()
    act = model.action
    R, y = _monthly_rows(400, 1)
    R_val, y_val = _monthly_rows(100, 2)
    g = torch.Generator().manual_seed(3)
    C = act.w_reg.shape[0]
    X, X_val = (torch.randn(len(t), C, generator=g, dtype=torch.float64) * 0.1 for t in (y, y_val))
    fit_head(model, WarmStartRows(X, y, R, X_val, y_val, R_val), loss="squared", row_rules=("last",),
             force_row_units=True, row_correction=False)
    assert act.row_rule == "last"
    with torch.no_grad():
        loc_Y, _ = act.regression(X_val, torch.zeros_like(X_val), R_val)
    head = ((loc_Y - y_val).abs() / y_val).mean()
    persistence = ((R_val[:, 2] - y_val).abs() / y_val).mean()
    assert float(head) < 1.1 * float(persistence), (float(head), float(persistence))
