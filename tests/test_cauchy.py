"""Stable Cauchy math (causal_adapter/modeling/cauchy.py) against mpmath and closed forms."""
from __future__ import annotations

import math

import mpmath
import pytest
import torch

from causal_adapter.modeling.cauchy import (
    cauchy_cdf,
    cauchy_icdf,
    cauchy_nll,
    ovr_log_probs,
    ovr_probability,
    sample_cauchy,
)

mpmath.mp.dps = 50

# t = z/s over the full required range, both signs, and s over [1e-6, 1e6].
T_GRID = [-1e8, -3e5, -1e3, -7.5, -1.0, -1e-3, 0.0, 1e-3, 0.5, 1.0, 20.0, 1e4, 1e8]
S_GRID = [1e-6, 1e-2, 1.0, 1e6]


def _mp_logs(z: float, s: float):
    """(log P, log(1-P), dlogP/dz, dlogP/ds, dlog(1-P)/dz, dlog(1-P)/ds) at the exact inputs."""
    z, s = mpmath.mpf(z), mpmath.mpf(s)
    p = mpmath.mpf(1) / 2 + mpmath.atan(z / s) / mpmath.pi
    dp_dz = s / (mpmath.pi * (s * s + z * z))
    dp_ds = -z / (mpmath.pi * (s * s + z * z))
    return (
        mpmath.log(p), mpmath.log(1 - p),
        dp_dz / p, dp_ds / p, -dp_dz / (1 - p), -dp_ds / (1 - p),
    )


def _grid(dtype):
    z = torch.tensor([t * s for t in T_GRID for s in S_GRID], dtype=dtype)
    s = torch.tensor([s for _ in T_GRID for s in S_GRID], dtype=dtype)
    return z, s


@pytest.mark.parametrize("dtype,rtol", [(torch.float64, 1e-13), (torch.float32, 2e-6)])
def test_ovr_log_probs_match_mpmath_values_and_gradients(dtype, rtol):
    z, s = _grid(dtype)
    z.requires_grad_(True)
    s.requires_grad_(True)
    log_p, log_1mp = ovr_log_probs(z, s)
    assert log_p.dtype == dtype and log_1mp.dtype == dtype
    gz_p, gs_p = torch.autograd.grad(log_p.sum(), (z, s), retain_graph=True)
    gz_q, gs_q = torch.autograd.grad(log_1mp.sum(), (z, s))
    got = [g.detach() for g in (log_p, log_1mp, gz_p, gs_p, gz_q, gs_q)]
    z, s = z.detach(), s.detach()
    for i in range(z.numel()):
        # reference at the *rounded* inputs, so only the function's own error is measured
        ref = _mp_logs(float(z[i]), float(s[i]))
        for name, g, r in zip(["logP", "log1mP", "dz logP", "ds logP", "dz log1mP", "ds log1mP"], got, ref):
            v = float(g[i])
            assert math.isfinite(v), (name, float(z[i]), float(s[i]))
            r = float(r)
            tol = rtol * abs(r) + (1e-300 if dtype == torch.float64 else 1e-37)
            # derivatives go through more roundings (s^2 + z^2, the product): a few ulps more
            if name.startswith("d"):
                tol *= 8
            assert abs(v - r) <= tol, (name, float(z[i]), float(s[i]), v, r)


def test_tails_follow_the_asymptotics():
    # t << 0: P ~ -1/(pi t) and log(1-P) ~ -P; t >> 0 mirrored. The naive 1/2 + atan(t)/pi
    # gives exactly 0 (float32) here, so relative accuracy is the real test.
    for dtype in (torch.float32, torch.float64):
        s = torch.tensor([1e-6, 1.0, 1e6], dtype=dtype)
        t = 1e8
        log_p, log_1mp = ovr_log_probs(-t * s, s)
        p = 1.0 / (math.pi * t)  # + O(t^-3)
        torch.testing.assert_close(log_p, torch.full_like(log_p, math.log(p)), rtol=1e-6, atol=0)
        torch.testing.assert_close(log_1mp, torch.full_like(log_1mp, -p), rtol=1e-5, atol=0)
        log_p, log_1mp = ovr_log_probs(t * s, s)
        torch.testing.assert_close(log_1mp, torch.full_like(log_p, math.log(p)), rtol=1e-6, atol=0)
        torch.testing.assert_close(log_p, torch.full_like(log_p, -p), rtol=1e-5, atol=0)
    naive = 0.5 + torch.atan(torch.tensor(-1e8)) / math.pi
    assert naive == 0.0  # why the stable form is needed


def test_ovr_log_probs_bf16_and_gradcheck():
    z, s = _grid(torch.float32)
    lp, lq = ovr_log_probs(z.bfloat16().requires_grad_(), s.bfloat16())
    assert lp.dtype == torch.float32 and torch.isfinite(lp).all() and torch.isfinite(lq).all()
    z = torch.tensor([-30.0, -2.0, -0.3, 0.0, 0.4, 3.0, 50.0], dtype=torch.float64, requires_grad=True)
    s = torch.tensor([0.5, 1.0, 2.0, 0.7, 1e-3, 4.0, 0.1], dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: ovr_log_probs(a, b), (z, s))


def test_ovr_probability_and_cdf():
    loc = torch.tensor([[0.0, 3.0, -1e9, 1e9]], dtype=torch.float64)
    scale = torch.tensor([[1.0, 2.0, 10.0, 10.0]], dtype=torch.float64)
    thr = torch.tensor([0.0, 1.0, 0.0, 0.0], dtype=torch.float64)
    p = ovr_probability(loc, scale, thr)
    t = (loc - thr) / scale
    ref = [float(mpmath.mpf(1) / 2 + mpmath.atan(float(x)) / mpmath.pi) for x in t.flatten()]
    torch.testing.assert_close(p.flatten(), torch.tensor(ref, dtype=torch.float64), rtol=1e-14, atol=0)
    # scalar threshold broadcasts; 0-dim tensor and float agree
    torch.testing.assert_close(ovr_probability(loc, scale, 0.0), ovr_probability(loc, scale, torch.tensor(0.0)))
    # cdf(x) = P(X <= x) = ovr probability of loc=x against threshold=loc
    x = torch.tensor([-1e12, -3.0, 0.0, 2.0, 1e12], dtype=torch.float64)
    ref = torch.distributions.Cauchy(torch.tensor(1.0, dtype=torch.float64), 2.0).cdf(x)
    got = cauchy_cdf(x, 1.0, 2.0)
    torch.testing.assert_close(got[1:4], ref[1:4], rtol=1e-14, atol=0)
    # the left tail keeps relative precision (the naive cdf cancels)
    assert got[0].item() == pytest.approx(2.0 / (math.pi * (1e12 + 1.0)), rel=1e-9)


def test_icdf_inverts_cdf_and_is_accurate_in_tails():
    p = torch.tensor([1e-300, 1e-20, 1e-3, 0.25, 0.5, 0.75, 1 - 1e-12], dtype=torch.float64)
    x = cauchy_icdf(p, 2.0, 3.0)
    with mpmath.workdps(400):  # p - 1/2 must not lose p = 1e-300 in the reference either
        ref = [2.0 + 3.0 * float(mpmath.tan(mpmath.pi * (mpmath.mpf(float(q)) - mpmath.mpf(1) / 2))) for q in p]
    torch.testing.assert_close(x, torch.tensor(ref, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(cauchy_cdf(x[1:-1], 2.0, 3.0), p[1:-1], rtol=1e-10, atol=0)
    ends = cauchy_icdf(torch.tensor([0.0, 1.0]))
    assert ends[0] == -math.inf and ends[1] == math.inf
    # interval helper use: central 50% interval of Cauchy(loc, scale) is loc +- scale
    lo_hi = cauchy_icdf(torch.tensor([0.25, 0.75]), torch.tensor(5.0), torch.tensor(2.0))
    torch.testing.assert_close(lo_hi, torch.tensor([3.0, 7.0]))


def test_sample_cauchy_distribution_seed_and_grad():
    loc = torch.full((40000,), 3.0, requires_grad=True)
    scale = torch.tensor(2.0, requires_grad=True)
    g = torch.Generator().manual_seed(123)
    x = sample_cauchy(loc, scale, generator=g)
    assert x.shape == (40000,) and torch.isfinite(x).all()
    x2 = sample_cauchy(loc, scale, generator=torch.Generator().manual_seed(123))
    assert torch.equal(x, x2)
    # quartiles of Cauchy(3, 2) are 1 and 5 (std error of a sample quartile ~ 0.02 here)
    q = torch.quantile(x.detach(), torch.tensor([0.25, 0.5, 0.75]))
    torch.testing.assert_close(q, torch.tensor([1.0, 3.0, 5.0]), atol=0.1, rtol=0)
    x.sum().backward()  # reparameterised: dx/dloc = 1
    assert torch.equal(loc.grad, torch.ones_like(loc)) and torch.isfinite(scale.grad)


def test_sample_cauchy_never_infinite(monkeypatch):
    # eps exactly 0 (possible from torch.rand) must not give an infinite or wrongly-signed draw
    real_rand = torch.rand

    def edge_rand(*shape, generator=None, dtype=None, device=None):
        out = real_rand(*shape, dtype=dtype, device=device)
        out.view(-1)[0::2] = 0.0
        out.view(-1)[1::2] = 1.0 - torch.finfo(out.dtype).eps / 4  # rounds to 1.0 in float32
        return out

    monkeypatch.setattr(torch, "rand", edge_rand)
    for dtype in (torch.float32, torch.float64):
        x = sample_cauchy(torch.zeros(4, dtype=dtype), 1.0)
        assert torch.isfinite(x).all()
        assert (x[0::2] < -1e6).all() and (x[1::2] > 1e6).all()


def test_cauchy_nll_closed_form_and_extremes():
    y = torch.tensor([0.0, 1.0, -4.0, 10.0, 3.0], dtype=torch.float64)
    loc = torch.tensor([0.0, 0.5, 2.0, -1.0, 3.0], dtype=torch.float64)
    scale = torch.tensor([1.0, 0.1, 3.0, 50.0, 1e-6], dtype=torch.float64)
    ref = -torch.distributions.Cauchy(loc, scale).log_prob(y)
    torch.testing.assert_close(cauchy_nll(y, loc, scale), ref, rtol=1e-13, atol=1e-13)
    # |y - loc| / scale ~ 1e300 (r^2 would overflow): compare with mpmath, and grads finite
    y = torch.tensor([1e300, -1e290, 1e10], dtype=torch.float64, requires_grad=True)
    loc = torch.tensor([0.0, 5.0, 0.0], dtype=torch.float64, requires_grad=True)
    scale = torch.tensor([1.0, 1e-10, 1e-290], dtype=torch.float64, requires_grad=True)
    out = cauchy_nll(y, loc, scale)
    for i in range(3):
        yy, ll, ss = (mpmath.mpf(float(v[i].detach())) for v in (y, loc, scale))
        r = float(mpmath.log(mpmath.pi * ss) + mpmath.log1p(((yy - ll) / ss) ** 2))
        assert out[i].item() == pytest.approx(r, rel=1e-13)
    grads = torch.autograd.grad(out.sum(), (y, loc, scale))
    assert all(torch.isfinite(g).all() for g in grads)
    # d/dy = 2 r / (scale (1 + r^2)) ~ 2/(y - loc) for large r
    assert grads[0][0].item() == pytest.approx(2.0 / 1e300, rel=1e-12)
    # float32: r = 1e30 squared overflows float32; still finite and correct
    o32 = cauchy_nll(torch.tensor([1e30]), torch.tensor([0.0]), torch.tensor([1.0]))
    assert o32.item() == pytest.approx(math.log(math.pi) + 60 * math.log(10), rel=1e-6)


def test_cauchy_nll_gradcheck():
    y = torch.tensor([0.3, -2.0, 5.0, 0.0], dtype=torch.float64, requires_grad=True)
    loc = torch.tensor([0.0, 1.0, -3.0, 0.1], dtype=torch.float64, requires_grad=True)
    scale = torch.tensor([1.0, 0.5, 2.0, 0.1], dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(cauchy_nll, (y, loc, scale))
    assert torch.autograd.gradcheck(lambda x: cauchy_cdf(x, 0.5, 2.0), (y,))
    p = torch.tensor([0.01, 0.3, 0.6, 0.99], dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda q, l, s: cauchy_icdf(q, l, s), (p, loc, scale))
