"""OvR loss: fused == reference (values and every gradient), gradcheck, extreme inputs
against mpmath, the <NUM> probability and the gated regression loss."""
from __future__ import annotations

import functools
import math
import os
import subprocess
import sys

import mpmath
import pytest
import torch

from causal_adapter.modeling.cauchy import cauchy_nll, ovr_probability
from causal_adapter.modeling import ovr_loss as loss_module
from causal_adapter.modeling.loss import fused_ovr_loss, gated_regression_loss, num_probability, reference_ovr_loss
from causal_adapter.modeling.ovr_loss import COMPILE_ENV, COMPILE_MIN_ELEMENTS, chunk_sizes, use_compiled

mpmath.mp.dps = 40


def make_case(N=23, C=5, V=37, dtype=torch.float64, *, train_W=False, bias=True, thr="vector",
              learn_thr=False, override=False, ignore=True, zero_row=True, W_dtype=None, seed=0):
    """Inputs of the loss as the model produces them, plus the list of tensors to differentiate."""
    g = torch.Generator().manual_seed(seed)
    loc_U = (torch.randn(N, C, generator=g, dtype=dtype) * 2).requires_grad_()
    scale_Up = (torch.rand(N, C, generator=g, dtype=dtype) + 0.2).requires_grad_()
    W = torch.randn(V, C, generator=g, dtype=dtype)
    if zero_row:
        W[3] = 0.0  # an untrained reserved row: scale_S at the floor
    W = W.to(W_dtype or dtype).requires_grad_(train_W)
    b = (torch.randn(V, generator=g, dtype=dtype) * 0.5).requires_grad_() if bias else None
    if thr == "vector":
        thresholds = torch.randn(V, generator=g, dtype=dtype)
    else:
        thresholds = torch.tensor(0.7, dtype=dtype)
    thresholds.requires_grad_(learn_thr)
    labels = torch.randint(0, V, (N,), generator=g)
    labels[1] = 3  # target on the zero row
    if ignore:
        labels[::4] = -100
    row_override = None
    if override:
        idx = torch.tensor([V - 2, 3])
        rows = torch.randn(2, C, generator=g, dtype=dtype).requires_grad_()
        labels[2] = V - 2  # a target on an overridden column
        row_override = (idx, rows)
    args = (loc_U, scale_Up, W, b, thresholds, labels)
    wrt = [t for t in (loc_U, scale_Up, W, b, thresholds) if t is not None and t.requires_grad]
    if override:
        wrt.append(row_override[1])
    return args, dict(row_override=row_override), wrt


def loss_and_grads(fn, args, kw, wrt, **extra):
    loss = fn(*args, **kw, **extra)
    grads = torch.autograd.grad(loss, wrt, allow_unused=True)
    return loss.detach(), grads


def assert_rel(a, b, rtol, what):
    scale = b.abs().max().clamp_min(1e-30)
    err = ((a.double() - b.double()).abs().max() / scale).item()
    assert err <= rtol, f"{what}: relative error {err:.3g} > {rtol:g}"


CASES = {
    "frozen_W": dict(),
    "train_W_vector_thr_learnable": dict(train_W=True, learn_thr=True),
    "override_rows_train_W": dict(train_W=True, override=True, learn_thr=True),
    "override_rows_frozen_W_no_bias_scalar_thr": dict(override=True, bias=False, thr="scalar", learn_thr=True),
    "scalar_thr_fixed_no_ignore": dict(thr="scalar", ignore=False),
    "no_bias_vector_thr_learnable": dict(bias=False, learn_thr=True, train_W=True),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype,rtol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("chunks", [(8, 5), (16, None), (None, None)], ids=["v8t5", "v16", "auto"])
def test_fused_matches_reference(case, dtype, rtol, chunks):
    args, kw, wrt = make_case(dtype=dtype, **CASES[case])
    ref_loss, ref_g = loss_and_grads(reference_ovr_loss, args, kw, wrt)
    loss, g = loss_and_grads(fused_ovr_loss, args, kw, wrt, vocab_chunk=chunks[0], token_chunk=chunks[1])
    assert loss.dtype == dtype
    assert_rel(loss, ref_loss, rtol, "loss")
    for i, (a, b) in enumerate(zip(g, ref_g)):
        assert a is not None and b is not None and a.dtype == b.dtype
        assert torch.isfinite(a).all()
        assert_rel(a, b, rtol, f"grad {i}")
    if kw["row_override"] is not None and args[2].requires_grad:
        gW = g[[x is args[2] for x in wrt].index(True)]
        assert (gW[kw["row_override"][0]] == 0).all()  # never to W through overridden rows


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("chunks", [(8, 5), (None, None)], ids=["v8t5", "auto"])
def test_compiled_kernel_matches_reference_float32(case, chunks):
    """The torch.compile'd block kernel (polynomial atan, one log, scaled gradient) against
    the reference; it must really run (no silent fallback to the eager kernel)."""
    args, kw, wrt = make_case(dtype=torch.float32, **CASES[case])
    ref_loss, ref_g = loss_and_grads(reference_ovr_loss, args, kw, wrt)
    loss, g = loss_and_grads(fused_ovr_loss, args, kw, wrt, vocab_chunk=chunks[0], token_chunk=chunks[1],
                             compile=True)
    assert not loss_module._compile_error and loss_module._compiled_kernels
    assert_rel(loss, ref_loss, 1e-5, "loss")
    for i, (a, b) in enumerate(zip(g, ref_g)):
        assert torch.isfinite(a).all()
        assert_rel(a, b, 1e-5, f"grad {i}")


@pytest.mark.parametrize("grads", [True, False])
def test_compiled_kernel_follows_the_scale_floor(grads):
    # regression: with the floor passed as a Python float, torch 2.13 reused one compiled
    # graph for every floor value (silently wrong loss on floored columns)
    args, kw, wrt = make_case(dtype=torch.float32, train_W=True)
    for floor in (1e-6, 0.5, 2.0):
        want = loss_and_grads(fused_ovr_loss, args, kw, wrt, scale_floor=floor, compile=False)
        got = loss_and_grads(fused_ovr_loss, args, kw, wrt, scale_floor=floor, compile=True) if grads else \
            (fused_ovr_loss(*args, **kw, scale_floor=floor, compile=True).detach(), want[1])
        assert_rel(got[0], want[0], 1e-5, f"loss floor={floor}")
        for a, b in zip(got[1], want[1]):
            assert_rel(a, b, 1e-5, f"grad floor={floor}")


_CROSS_ISA_PROBE = """
import torch
from causal_adapter.modeling import ovr_loss as loss
from causal_adapter.modeling.loss import fused_ovr_loss
torch.manual_seed(0)
N, C, V = 23, 5, 37
args = (torch.randn(N, C), torch.rand(N, C) + 0.1, torch.randn(V, C), torch.randn(V), 0.0, torch.randint(0, V, (N,)))
out = [float(fused_ovr_loss(*args, compile=c)) for c in (False, True)]
assert not loss._compile_error, loss._compile_error
print(out[0], out[1])
"""


def _cpu_vector_width(env: dict) -> int:
    code = "from torch._inductor.cpu_vec_isa import pick_vec_isa; print(pick_vec_isa().bit_width())"
    return int(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                              check=True).stdout.split()[-1])


def test_the_compiled_kernel_cached_under_one_vector_width_is_not_reused_under_another(tmp_path):
    """The same inductor cache directory used natively (AVX-512 here) and then under ATEN_CPU_CAPABILITY=avx2
    (the code path of a CPU without AVX-512): inductor's graph cache does not key on that variable, and a kernel
    written for 16 lanes run with 8 gave losses of 1e19 or a crash. loss._inductor_options keys it."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    env.pop("ATEN_CPU_CAPABILITY", None)
    avx2 = {**env, "ATEN_CPU_CAPABILITY": "avx2"}
    if _cpu_vector_width(env) == _cpu_vector_width(avx2) or _cpu_vector_width(avx2) != 256:
        pytest.skip("this CPU's native vector width is AVX2's (or not x86): nothing to mix up")
    for run_env in (env, avx2):
        done = subprocess.run([sys.executable, "-c", _CROSS_ISA_PROBE], env=run_env, capture_output=True,
                              text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        eager, compiled = map(float, done.stdout.split()[-2:])
        assert abs(compiled - eager) <= 1e-5 * abs(eager), (run_env.get("ATEN_CPU_CAPABILITY"), eager, compiled)


def test_compile_is_automatic_for_large_float32_problems_on_cuda_only(monkeypatch):
    monkeypatch.delenv(COMPILE_ENV, raising=False)
    big = COMPILE_MIN_ELEMENTS // 151936 + 1
    assert use_compiled(None, torch.float32, big, 151936, "cuda")
    assert not use_compiled(None, torch.float32, big - 2, 151936, "cuda")
    assert not use_compiled(None, torch.float32, big, 151936, "cpu")  # opt-in on CPU (README)
    assert not use_compiled(True, torch.float64, big, 151936, "cpu")  # float64 stays exact (eager)
    assert use_compiled(True, torch.float32, 1, 10, "cpu") and not use_compiled(False, torch.float32, big, 151936, "cuda")
    monkeypatch.setenv(COMPILE_ENV, "0")
    assert not use_compiled(None, torch.float32, big, 151936, "cuda")
    monkeypatch.setenv(COMPILE_ENV, "1")
    assert use_compiled(None, torch.float32, 1, 10, "cpu")


def test_compile_failure_falls_back_to_eager_with_a_warning(tmp_path):
    """A machine without a working C++ compiler: the loss still comes out right, with one
    warning naming the fallback (real torch.compile failure, fresh cache, CXX=/bin/false)."""
    script = """
import warnings, torch
from causal_adapter.modeling.loss import fused_ovr_loss, reference_ovr_loss
g = torch.Generator().manual_seed(0)
lu, su = torch.randn(6, 4, generator=g), torch.rand(6, 4, generator=g) + 0.5
W, y = torch.randn(50, 4, generator=g), torch.randint(0, 50, (6,), generator=g)
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    a = fused_ovr_loss(lu, su, W, None, 0.3, y, compile=True)
    b = fused_ovr_loss(lu, su, W, None, 0.3, y, compile=True)
msgs = [str(x.message) for x in w if str(x.message).startswith("fused_ovr_loss")]
assert len(msgs) == 1 and "using the eager kernel" in msgs[0], msgs
print(msgs[0])
r = reference_ovr_loss(lu, su, W, None, 0.3, y)
assert torch.allclose(a, r, rtol=1e-5) and torch.equal(a, b), (a, b, r)
print("ok")
"""
    env = dict(os.environ, CXX="/bin/false", TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_fused_moderate_size_float32():
    # model-like magnitudes (SPEC init: thresholds 100, scale_U ~ 10, small W), V not a
    # multiple of the automatic chunk, trainable W so all six GEMMs run.
    g = torch.Generator().manual_seed(1)
    N, C, V = 300, 48, 9001
    loc_U = (torch.randn(N, C, generator=g) * 3).requires_grad_()
    scale_Up = (10 + torch.rand(N, C, generator=g)).requires_grad_()
    W = (torch.randn(V, C, generator=g) * 0.05).requires_grad_()
    b = torch.zeros(V).requires_grad_()
    thr = torch.tensor(100.0)
    labels = torch.randint(0, V, (N,), generator=g)
    labels[::7] = -100
    args, wrt = (loc_U, scale_Up, W, b, thr, labels), [loc_U, scale_Up, W, b]
    ref_loss, ref_g = loss_and_grads(reference_ovr_loss, args, {}, wrt)
    for compile in (False, True):
        loss, gr = loss_and_grads(fused_ovr_loss, args, {}, wrt, memory_budget_mb=8, compile=compile)
        assert_rel(loss, ref_loss, 1e-5, f"loss compile={compile}")
        for a, b_ in zip(gr, ref_g):
            assert_rel(a, b_, 1e-5, f"grad compile={compile}")


def test_gradcheck_fused_float64():
    args, kw, wrt = make_case(N=6, C=3, V=7, train_W=True, learn_thr=True, override=True,
                              zero_row=False, seed=3)
    loc_U, scale_Up, W, b, thr, labels = args
    idx, _ = kw["row_override"]

    def f(lu, su, w, bb, t, rows):
        return fused_ovr_loss(lu, su, w, bb, t, labels, row_override=(idx, rows), vocab_chunk=3, token_chunk=2)

    assert torch.autograd.gradcheck(f, tuple(wrt))

    def f_scalar(lu, su, t):  # recompute mode, scalar learnable threshold, no bias
        return fused_ovr_loss(lu, su, W.detach(), None, t, labels, vocab_chunk=4, recompute=True)

    t0 = torch.tensor(0.3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(f_scalar, (loc_U, scale_Up, t0))


def test_all_rows_ignored_gives_zero_with_graph():
    for fn in (reference_ovr_loss, fused_ovr_loss):
        args, kw, wrt = make_case(dtype=torch.float32, train_W=True, learn_thr=True, override=True)
        args[5][:] = -100
        loss = fn(*args, **kw)
        assert loss.item() == 0.0 and loss.requires_grad
        grads = torch.autograd.grad(loss, wrt, allow_unused=True)
        for g in grads:
            assert g is not None and torch.isfinite(g).all() and (g == 0).all()


def test_eager_recompute_retain_graph_and_grad_scaling():
    args, kw, wrt = make_case(train_W=True, learn_thr=True, override=True)
    _, ref_g = loss_and_grads(reference_ovr_loss, args, kw, wrt)
    loss = fused_ovr_loss(*args, **kw, vocab_chunk=8)
    g1 = torch.autograd.grad(loss, wrt, retain_graph=True)  # grads computed in forward
    g2 = torch.autograd.grad(3.0 * loss, wrt)  # second use of the graph: recompute path
    for a, b, r in zip(g1, g2, ref_g):
        assert_rel(a, r, 1e-10, "eager")
        assert_rel(b, 3.0 * r, 1e-10, "recompute x3")
    _, g3 = loss_and_grads(fused_ovr_loss, args, kw, wrt, recompute=True)
    for a, r in zip(g3, ref_g):
        assert_rel(a, r, 1e-10, "recompute flag")
    with torch.no_grad():
        v = fused_ovr_loss(*args, **kw)
    assert_rel(v, reference_ovr_loss(*args, **kw).detach(), 1e-12, "no_grad value")
    with pytest.raises(RuntimeError):  # double backward is not supported: fail loudly
        loss = fused_ovr_loss(*args, **kw)
        (g,) = torch.autograd.grad(loss, [args[0]], create_graph=True)
        g.sum().backward()


def test_bf16_weights_and_inputs():
    # bf16 W with float32 activations (the usual frozen-backbone case), then all bf16
    args, kw, wrt = make_case(dtype=torch.float32, W_dtype=torch.bfloat16, override=True)
    ref_loss, ref_g = loss_and_grads(reference_ovr_loss, args, kw, wrt)
    loss, g = loss_and_grads(fused_ovr_loss, args, kw, wrt, vocab_chunk=8)
    assert_rel(loss, ref_loss, 1e-5, "loss")
    for a, b in zip(g, ref_g):
        assert_rel(a, b, 1e-5, "grad")
    lu, su, W, b, thr, labels = args
    lu16 = lu.detach().bfloat16().requires_grad_()
    su16 = su.detach().bfloat16().requires_grad_()
    W16 = W.detach().bfloat16().requires_grad_()
    for fn in (reference_ovr_loss, fused_ovr_loss):
        out = fn(lu16, su16, W16, b, thr, labels)
        assert out.dtype == torch.float32 and torch.isfinite(out)
        grads = torch.autograd.grad(out, (lu16, su16, W16))
        assert all(x.dtype == torch.bfloat16 and torch.isfinite(x).all() for x in grads)
    assert_rel(fused_ovr_loss(lu16, su16, W16, b, thr, labels).detach(),
               reference_ovr_loss(lu16, su16, W16, b, thr, labels).detach(), 1e-5, "bf16 loss")


def test_fused_never_allocates_an_n_by_v_tensor():
    # largest single allocation during forward + backward, positive control: the reference
    from torch.profiler import ProfilerActivity, profile

    N, C, V = 256, 4, 4096
    args, kw, _ = make_case(N=N, C=C, V=V, dtype=torch.float32, train_W=True, learn_thr=True, override=True)
    nv_bytes = N * V * 4
    largest = {}
    for name, fn, extra in (("fused", fused_ovr_loss, dict(vocab_chunk=512, token_chunk=64)),
                            ("reference", reference_ovr_loss, {})):
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fn(*args, **kw, **extra).backward()
        largest[name] = max(e.cpu_memory_usage for e in prof.events())
    assert largest["reference"] >= nv_bytes  # the check can see an [N, V] tensor
    assert largest["fused"] <= 6 * 64 * 512 * 4 < nv_bytes / 5  # one block of scratch at most


# ---- extreme inputs against an independent mpmath computation ------------------------
T_VALUES = [-1e8, -1e4, -1.0, 0.0, 0.3, 1e3, 1e8]
S_VALUES = [1e-6, 1.0, 1e6]
FLOOR = 5e-7  # below the smallest scale 1e-6 so only the tiny and zero rows are floored


def extreme_case(dtype):
    """C = 1, loc_U = scale_Up = 1, threshold 0: column k has z_k = w_k + b_k and
    s_k = |w_k|, chosen so that t = z/s covers +-1e8 for s in [1e-6, 1e6]; plus a zero row
    and a tiny row (|w| < floor), both with scale_S at the floor."""
    ws, bs = [], []
    for s in S_VALUES:
        for t in T_VALUES:
            ws.append(s)
            bs.append(t * s - s)
    ws += [1e-9, 0.0]  # tiny row (floor active, |W| has a gradient there) and zero row
    bs += [0.25, -0.5]
    W = torch.tensor(ws, dtype=dtype)[:, None].requires_grad_()
    b = torch.tensor(bs, dtype=dtype).requires_grad_()
    V = W.shape[0]
    labels = torch.tensor([0, V - 1, 6, 9, 17, V - 2])  # both tails, the floored rows
    N = labels.numel()
    loc_U = torch.ones(N, 1, dtype=dtype, requires_grad=True)
    scale_Up = torch.ones(N, 1, dtype=dtype, requires_grad=True)
    thr = torch.tensor(0.0, dtype=dtype)
    return (loc_U, scale_Up, W, b, thr, labels)


def mp_loss_and_grads(args):
    """Loss, dL/db_k and dL/dscale_Up_i in 40 digits from the same rounded z_k, s_k."""
    loc_U, scale_Up, W, b, thr, labels = args
    with torch.no_grad():
        z = (loc_U[0] * W[:, 0] + b).tolist()  # one product + one add: as rounded in the loss
        absw = W[:, 0].abs().tolist()
    n = len(labels)
    total, dz, dsu = mpmath.mpf(0), [mpmath.mpf(0)] * len(z), []
    for y in labels.tolist():
        dsu_i = mpmath.mpf(0)
        for k, (zk, wk) in enumerate(zip(z, absw)):
            zk, sk = mpmath.mpf(zk), mpmath.mpf(max(wk, FLOOR))
            p = mpmath.mpf(1) / 2 + mpmath.atan(zk / sk) / mpmath.pi
            dp_dz = sk / (mpmath.pi * (sk * sk + zk * zk))
            dp_ds = -zk / (mpmath.pi * (sk * sk + zk * zk))
            dl_dp = -1 / p if k == y else 1 / (1 - p)
            total += -mpmath.log(p) if k == y else -mpmath.log(1 - p)
            dz[k] += dl_dp * dp_dz / n
            if wk >= FLOOR:  # scale_S = max(scale_Up |w|, floor): no gradient while floored
                dsu_i += dl_dp * dp_ds * wk / n
        dsu.append(dsu_i)
    as_t = lambda xs: torch.tensor([float(x) for x in xs], dtype=torch.float64)  # noqa: E731
    return float(total / n), as_t(dz), as_t(dsu)


compiled_ovr_loss = functools.partial(fused_ovr_loss, compile=True)


@pytest.mark.parametrize("dtype,rtol", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
@pytest.mark.parametrize("fn", [reference_ovr_loss, fused_ovr_loss, compiled_ovr_loss],
                         ids=["reference", "fused", "compiled"])
def test_extreme_inputs_against_mpmath(fn, dtype, rtol):
    args = extreme_case(dtype)
    mp_loss, mp_db, mp_dsu = mp_loss_and_grads(args)
    kw = dict(vocab_chunk=4, token_chunk=2) if fn is not reference_ovr_loss else {}
    loss = fn(*args, scale_floor=FLOOR, **kw)
    grads = torch.autograd.grad(loss, (args[0], args[1], args[2], args[3]))
    assert torch.isfinite(loss)
    assert all(torch.isfinite(g).all() for g in grads)
    assert loss.item() == pytest.approx(mp_loss, rel=rtol)
    # dL/db_k = dL/dz_k: every column, including the 1e8 tails and the floored rows
    torch.testing.assert_close(grads[3].double(), mp_db, rtol=50 * rtol, atol=1e-30)
    torch.testing.assert_close(grads[1][:, 0].double(), mp_dsu, rtol=50 * rtol, atol=1e-30)
    # floored rows: no gradient through |W|, so the W grad is dz * loc_U (= dz) exactly
    torch.testing.assert_close(grads[2][-2:, 0].double(), mp_db[-2:], rtol=50 * rtol, atol=1e-30)


def test_extreme_inputs_bf16_finite():
    args = extreme_case(torch.float32)
    lu, su, W, b, thr, labels = args
    W16 = W.detach().bfloat16().requires_grad_()
    for fn in (reference_ovr_loss, fused_ovr_loss, compiled_ovr_loss):
        loss = fn(lu, su, W16, b, thr, labels)
        grads = torch.autograd.grad(loss, (lu, su, W16, b))
        assert torch.isfinite(loss) and all(torch.isfinite(g).all() for g in grads)


def test_chunk_sizes_adapt_to_budget_and_shapes():
    T, Vc = chunk_sizes(8192, 151936, 896, 4, 1, None, None, None)
    assert T <= 2048 and 4096 <= Vc <= 8192
    T2, Vc2 = chunk_sizes(8192, 151936, 896, 4, 1, None, None, 16)
    assert T2 * Vc2 * 25 <= 16 * 2**20 and T2 * Vc2 < T * Vc
    assert chunk_sizes(7, 151936, 896, 4, 1, None, None, None)[0] == 7  # few rows
    assert chunk_sizes(100, 50, 8, 4, 1, None, None, None)[1] == 50  # tiny vocab
    assert chunk_sizes(100, 5000, 8, 4, 1, 1000, 30, None) == (30, 1000)  # explicit


# ---- <NUM> probability and gated regression --------------------------------------------
def test_num_probability_matches_ovr_probability_and_is_detached():
    g = torch.Generator().manual_seed(5)
    lu = torch.randn(9, 4, generator=g, requires_grad=True)
    su = (torch.rand(9, 4, generator=g) + 0.1).requires_grad_()
    w = torch.randn(4, generator=g, requires_grad=True)
    b, c = torch.tensor(0.3, requires_grad=True), torch.tensor(1.5)
    p = num_probability(lu, su, w, b, c)
    ref = ovr_probability(lu @ w + b, torch.clamp_min(su @ w.abs(), 1e-6), c)
    torch.testing.assert_close(p, ref.detach())
    assert p.shape == (9,) and not p.requires_grad
    p0 = num_probability(lu, su, torch.zeros(4), torch.tensor(0.0), torch.tensor(100.0))
    assert torch.isfinite(p0).all() and (p0 < 1e-6).all()  # zero row: scale at the floor


def test_gated_regression_loss_value_gate_detached_and_masks():
    num = 11
    labels = torch.tensor([num, 5, num, -100, num])
    loc = torch.tensor([0.5, math.inf, -1.0, math.nan, 2.0], requires_grad=True)
    scale = torch.tensor([1.0, 0.0, 2.0, math.nan, 0.5], requires_grad=True)
    values = torch.tensor([1.0, math.nan, 3.0, math.inf, 2.0])
    p_num = torch.tensor([0.9, math.nan, 0.2, 0.5, 0.6], requires_grad=True)
    alpha = 0.25
    out = gated_regression_loss(loc, scale, values, labels, num, p_num, alpha)
    m = [0, 2, 4]
    nll = [math.log(math.pi * scale[i].item()) + math.log1p(((values[i] - loc[i]).item() / scale[i].item()) ** 2)
           for i in m]
    gate = [alpha + (1 - alpha) * p_num[i].item() for i in m]
    assert out.item() == pytest.approx(sum(g * x for g, x in zip(gate, nll)) / 3, rel=1e-6)
    g_loc, g_scale, g_p = torch.autograd.grad(out, (loc, scale, p_num), allow_unused=True)
    assert g_p is None  # the gate is detached
    assert torch.isfinite(g_loc).all() and torch.isfinite(g_scale).all()
    assert g_loc[1] == 0 and g_loc[3] == 0 and g_scale[1] == 0 and g_scale[3] == 0
    # d/dloc of gate * nll / 3 at a masked-in row, closed form
    r = (values[0] - loc[0]).item() / scale[0].item()
    assert g_loc[0].item() == pytest.approx(-gate[0] * 2 * r / (scale[0].item() * (1 + r * r)) / 3, rel=1e-5)
    # alpha = 1: the plain mean Cauchy NLL over <NUM> rows
    out1 = gated_regression_loss(loc, scale, values, labels, num, p_num, 1.0)
    torch.testing.assert_close(out1, cauchy_nll(values[m], loc[m], scale[m]).mean())
    # no <NUM> label: exactly 0, still differentiable
    out0 = gated_regression_loss(loc, scale, values, torch.full((5,), 5), num, p_num, 0.0)
    assert out0.item() == 0.0 and out0.requires_grad
