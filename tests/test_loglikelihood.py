"""`modeling.loglikelihood`'s number term (docs/evaluate.md): half a written unit either side of the written number,
and the Cauchy probability of that interval on the head's scale (identity or log y), accurate in the tails."""
import math

import pytest
import torch

D = dict(dtype=torch.float64)

from causal_adapter.modeling.loglikelihood import interval_log_probability, written_half_unit
from causal_adapter.modeling.value_transform import ValueMap


@pytest.mark.parametrize("text, half", [("42", 0.5), ("3.14", 0.005), ("1,234", 0.5), ("1,234.5", 0.05),
                                        ("1.5e3", 50.0), (".5", 0.05), ("5.", 0.5), ("-0.25", 0.005),
                                        ("\u22127", 0.5), ("2E-3", 0.0005), ("100", 0.5)])
def test_half_a_written_unit(text, half):
    assert written_half_unit(text) == pytest.approx(half, rel=1e-12)


def cdf_difference(loc, scale, lo, hi):
    c = torch.distributions.Cauchy(torch.tensor(loc, dtype=torch.float64), torch.tensor(scale, dtype=torch.float64))
    return float(c.cdf(torch.tensor(hi, dtype=torch.float64)) - c.cdf(torch.tensor(lo, dtype=torch.float64)))


@pytest.mark.parametrize("loc, scale, value, half", [(40.0, 10.0, 42.0, 0.5), (0.0, 1.0, 0.0, 0.05),
                                                     (-3.0, 0.2, -2.5, 0.005), (100.0, 30.0, 7.0, 0.5)])
def test_identity_is_the_cdf_difference(loc, scale, value, half):
    got = interval_log_probability(torch.tensor([loc], **D), torch.tensor([scale], **D), torch.tensor([value], **D),
                                   torch.tensor([half], **D), ValueMap())
    assert float(got) == pytest.approx(math.log(cdf_difference(loc, scale, value - half, value + half)), abs=1e-9)


def test_log_map_takes_the_interval_through_log_y():
    vm = ValueMap("log")
    got = interval_log_probability(torch.tensor([3.0, 3.0, 3.0], **D), torch.tensor([0.5, 0.5, 0.5], **D),
                                   torch.tensor([20.0, 0.2, -4.0], **D), torch.tensor([0.5, 0.5, 0.5], **D), vm)
    assert float(got[0]) == pytest.approx(math.log(cdf_difference(3.0, 0.5, math.log(19.5), math.log(20.5))), abs=1e-9)
    # an interval reaching 0 keeps (0, hi): F(log hi); one below 0 has no probability
    c = torch.distributions.Cauchy(torch.tensor(3.0, dtype=torch.float64), torch.tensor(0.5, dtype=torch.float64))
    assert float(got[1]) == pytest.approx(math.log(float(c.cdf(torch.tensor(math.log(0.7), dtype=torch.float64)))),
                                          abs=1e-9)
    assert float(got[2]) == -math.inf


def test_far_tail_keeps_its_digits():
    """1e6 scales from the location, an interval of width 1: P ~ scale / (pi x^2) * width, where F(hi) - F(lo)
    in float64 would have cancelled to 0 or noise."""
    got = float(interval_log_probability(torch.tensor([0.0], **D), torch.tensor([1.0], **D), torch.tensor([1e6], **D),
                                         torch.tensor([0.5], **D), ValueMap()))
    assert got == pytest.approx(math.log(1.0 / (math.pi * 1e12)), rel=1e-9)
