"""Numerically stable Cauchy math (SPEC sections 2.7, 3, 4).

Notation: a Cauchy variable X ~ Cauchy(loc, scale); for a score S_k ~ Cauchy(loc_S, scale_S)
and a threshold C_k the one-vs-rest probability is

    P = P(S > C) = 1/2 + atan(t)/pi,   t = z / s,   z = loc_S - C,   s = scale_S > 0.

The textbook form loses everything in the tails: for t << 0, 1/2 + atan(t)/pi subtracts two
numbers close to 1/2 (P ~ -1/(pi t) ends up as 0 or noise). With theta = atan2(s, z) in (0, pi)
and phi = atan2(s, -z) = pi - theta (both exact identities for s > 0):

    P     = phi   / pi    (accurate when P is small: phi ~ s/|z| is computed without cancellation)
    1 - P = theta / pi    (accurate when 1 - P is small)

Neither form divides by s (s may sit at a tiny floor). The logs are taken from the branch
that has no cancellation: log P = log(phi/pi) when z <= 0 (P <= 1/2), log1p(-theta/pi) when
z > 0; symmetrically for log(1 - P).

Derivatives (u = s^2 + z^2, t = z/s):
    dP/dt = 1 / (pi (1 + t^2)),   dP/dz = s / (pi u),   dP/ds = -z / (pi u)
    d log P     / dz =  s / (u phi),     d log P     / ds = -z / (u phi)
    d log(1-P)  / dz = -s / (u theta),   d log(1-P)  / ds =  z / (u theta)
All are finite for s > 0: when phi -> 0 (t -> -inf), s / (u phi) -> 1/|z|; when
theta -> 0 (t -> +inf), s / (u theta) -> 1/z. `ovr_log_probs` implements them as its
backward (scaled so that z^2 never overflows); the fused loss (loss.py) uses the same
closed forms by hand.

Every function computes in at least float32 (bf16/fp16 inputs are upcast; float64 stays
float64) and accepts any broadcastable shapes.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

LOG_PI = math.log(math.pi)


def _compute_dtype(*xs: Tensor | float) -> torch.dtype:
    """float32, or float64 if any tensor input is float64 (bf16/fp16 are upcast)."""
    dt = torch.float32
    for x in xs:
        if isinstance(x, Tensor) and x.dtype == torch.float64:
            dt = torch.float64
    return dt


def _as(x: Tensor | float, dtype: torch.dtype, like: Tensor | None = None) -> Tensor:
    if isinstance(x, Tensor):
        return x.to(dtype)
    return torch.tensor(x, dtype=dtype, device=None if like is None else like.device)


class _OvRLogProbs(torch.autograd.Function):
    """(log P, log(1 - P)) with the closed-form, overflow-free backward of the module docstring.

    Autograd through atan2 would form z / (s^2 + z^2), whose z^2 overflows float32 for
    |z| > 1.8e19 (and then inf * 0 = NaN). Here everything is divided by m = max(|z|, s)
    first: with zn = z/m, sn = s/m, un = zn^2 + sn^2 in [1, 2],
        d log P / dz = sn / (m un phi),      d log P / ds = -zn / (m un phi),
        d log(1-P) / dz = -sn / (m un theta), d log(1-P) / ds = zn / (m un theta),
    evaluated in float64 (so phi ~ s/|z| keeps its precision where float32 would be
    subnormal). The backward is made of differentiable ops, so double backward works.
    """

    @staticmethod
    def forward(ctx, z: Tensor, s: Tensor):
        theta = torch.atan2(s, z)  # pi * (1 - P)
        phi = torch.atan2(s, -z)  # pi * P
        # the branch without cancellation (module docstring); where() never sees a NaN here
        log_p = torch.where(z > 0, torch.log1p(-theta / math.pi), torch.log(phi) - LOG_PI)
        log_1mp = torch.where(z < 0, torch.log1p(-phi / math.pi), torch.log(theta) - LOG_PI)
        ctx.save_for_backward(z, s)
        return log_p, log_1mp

    @staticmethod
    def backward(ctx, g_p: Tensor, g_1mp: Tensor):
        return ovr_log_probs_grads(*ctx.saved_tensors, g_p, g_1mp)


def ovr_log_probs_grads(z: Tensor, s: Tensor, g_p: Tensor | float, g_1mp: Tensor | float) -> tuple[Tensor, Tensor]:
    """(dL/dz, dL/ds) for L = sum(g_p * log P + g_1mp * log(1 - P)), elementwise, s > 0:
    the closed form of `_OvRLogProbs` (no z^2 overflow), in z's and s's dtypes."""
    wide = z.dtype if z.device.type == "mps" else torch.float64  # MPS has no float64
    zw, sw = z.to(wide), s.to(wide)
    g_p, g_1mp = torch.as_tensor(g_p, dtype=wide, device=z.device), torch.as_tensor(g_1mp, dtype=wide, device=z.device)
    m = torch.maximum(zw.abs(), sw)
    zn, sn = zw / m, sw / m
    mu = m * (zn * zn + sn * sn)
    # a zero upstream gradient stays zero even where 1/phi overflows (P underflowed)
    kp = torch.where(g_p != 0, g_p / (mu * torch.atan2(sw, -zw)), 0.0)
    k1 = torch.where(g_1mp != 0, g_1mp / (mu * torch.atan2(sw, zw)), 0.0)
    return ((kp - k1) * sn).to(z.dtype), ((k1 - kp) * zn).to(s.dtype)


def ovr_log_probs(z: Tensor, s: Tensor) -> tuple[Tensor, Tensor]:
    """(log P, log(1 - P)) for P = 1/2 + atan(z/s)/pi, elementwise, s > 0.

    z: loc_S - C (any shape); s: scale_S > 0 (broadcastable to z).
    Returns two tensors of the broadcast shape in float32 (float64 if an input is float64).
    Accurate (relative) in both tails; finite values and gradients for every finite z
    (float32: up to 3.4e38) and s in [1e-6, 1e6] (module docstring and `_OvRLogProbs`).
    """
    dt = _compute_dtype(z, s)
    z, s = torch.broadcast_tensors(z.to(dt), s.to(dt))
    return _OvRLogProbs.apply(z, s)


def ovr_probability(loc_S: Tensor, scale_S: Tensor, thresholds: Tensor | float) -> Tensor:
    """P_k = 1/2 + atan((loc_S_k - C_k)/scale_S_k)/pi, computed as atan2(s, -z)/pi.

    loc_S, scale_S: [..., V] (scale_S > 0); thresholds: scalar, 0-dim or [V] (broadcast).
    """
    dt = _compute_dtype(loc_S, scale_S, thresholds)
    z = loc_S.to(dt) - _as(thresholds, dt, loc_S)
    return torch.atan2(scale_S.to(dt), -z) / math.pi


def cauchy_cdf(x: Tensor, loc: Tensor | float, scale: Tensor | float) -> Tensor:
    """F(x) = 1/2 + atan((x - loc)/scale)/pi = atan2(scale, loc - x)/pi (accurate left tail)."""
    dt = _compute_dtype(x, loc, scale)
    x = x.to(dt)
    return torch.atan2(_as(scale, dt, x), _as(loc, dt, x) - x) / math.pi


def _standard_icdf(p: Tensor) -> Tensor:
    """tan(pi (p - 1/2)) without forming p - 1/2 in the tails.

    tan(pi (p - 1/2)) = -1/tan(pi p) = 1/tan(pi (1 - p)); the branch with the argument in
    (0, pi/2] keeps p's relative precision near 0 (1 - p is exact for p >= 1/2).
    p = 0 gives -inf and p = 1 gives +inf, the true quantiles.
    """
    low = p < 0.5
    q = torch.where(low, p, 1.0 - p)
    return torch.where(low, -1.0, 1.0) / torch.tan(math.pi * q)


def cauchy_icdf(p: Tensor, loc: Tensor | float = 0.0, scale: Tensor | float = 1.0) -> Tensor:
    """Quantile function loc + scale * tan(pi (p - 1/2)), p in [0, 1] (e.g. interval ends)."""
    dt = _compute_dtype(p, loc, scale)
    p = p.to(dt)
    return _as(loc, dt, p) + _as(scale, dt, p) * _standard_icdf(p)


def sample_cauchy(
    loc: Tensor, scale: Tensor | float, generator: torch.Generator | None = None
) -> Tensor:
    """One draw loc + scale * tan(pi (eps - 1/2)) per element, eps ~ U(0, 1) from `generator`.

    Shape = broadcast of loc and scale; reparameterised (gradients flow to loc and scale).
    eps is clamped to [tiny, 1 - tiny] (tiny = the dtype's resolution near 0 and 1) so a draw
    is never +-inf; this truncates the tails only beyond |x| ~ scale / (pi * tiny).
    """
    dt = _compute_dtype(loc, scale)
    loc = loc.to(dt)
    scale = _as(scale, dt, loc)
    shape = torch.broadcast_shapes(loc.shape, scale.shape)
    eps = torch.rand(shape, generator=generator, dtype=dt, device=loc.device)
    tiny = torch.finfo(dt).eps  # 1 - tiny is representable, so the upper clamp is real
    eps = eps.clamp(tiny, 1.0 - tiny)
    return loc + scale * _standard_icdf(eps)


def cauchy_nll(y: Tensor, loc: Tensor, scale: Tensor) -> Tensor:
    """-log Cauchy pdf = log(pi * scale) + log1p(((y - loc)/scale)^2), elementwise, scale > 0.

    Finite even when |y - loc| / scale ~ 1e300: for |d| > scale (d = y - loc) it uses
    log1p(r^2) = 2 log|d| - 2 log(scale) + log1p((scale/d)^2), which never squares a large
    number. Gradients are finite in both branches (torch.where arguments are kept in range).
    """
    dt = _compute_dtype(y, loc, scale)
    y, loc, scale = y.to(dt), _as(loc, dt, y), _as(scale, dt, y)
    d = y - loc
    a = d.abs()
    big = a > scale
    d_small = torch.where(big, torch.zeros_like(d), d)  # ratio <= 1 in the small branch
    a_big = torch.where(big, a, scale)  # ratio <= 1 in the big branch
    log_scale = torch.log(scale)
    small = torch.log1p((d_small / scale) ** 2)
    large = 2.0 * (torch.log(a_big) - log_scale) + torch.log1p((scale / a_big) ** 2)
    return LOG_PI + log_scale + torch.where(big, large, small)
