"""The Triton sweep of the fused OvR loss (modeling/ovr_triton.py), run on CPU by Triton's interpreter:
values and every gradient against `reference_ovr_loss` (W frozen and trained, the row override, ignored
rows, a zero row under a tiny floor, a large floor, extreme inputs against mpmath), several super-blocks,
bf16 operands, determinism, and the backend / precision defaults."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from triton_interpreter import interpreted_ovr_triton

ovr_triton = interpreted_ovr_triton()
pytestmark = pytest.mark.skipif(ovr_triton is None, reason="triton is not installed (pip install triton)")

from causal_adapter.modeling import ovr_loss as loss_module  # noqa: E402
from causal_adapter.modeling.loss import fused_ovr_loss, reference_ovr_loss  # noqa: E402
from test_loss import (  # noqa: E402
    CASES, FLOOR, assert_rel, extreme_case, loss_and_grads, make_case, mp_loss_and_grads,
)

# tiles of 16 and super-blocks of 32 rows x 64 columns: many tiles, ragged edges, several super-blocks in
# both loop orders (rows outer; vocabulary outer when W trains)
SMALL = dict(BT=16, BV=16, BK=16, BVW=16, BN=16, BKT=16, rows=32, scratch_bytes=2 * 4 * 32 * 64)


@pytest.fixture(params=["small", "default"])
def blocks(request, monkeypatch):
    if request.param == "small":
        monkeypatch.setattr(ovr_triton, "DEFAULT_BLOCKS", dataclasses.replace(ovr_triton.DEFAULT_BLOCKS, **SMALL))
    return request.param


def triton_loss(*args, **kw):
    return fused_ovr_loss(*args, backend="triton", **kw)


@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference_float32(case, blocks):
    args, kw, wrt = make_case(N=45, C=20, V=70, dtype=torch.float32, **CASES[case])
    ref_loss, ref_g = loss_and_grads(reference_ovr_loss, args, kw, wrt)
    loss, g = loss_and_grads(triton_loss, args, kw, wrt, gemm_precision="fp32")
    assert loss.dtype == torch.float32
    assert_rel(loss, ref_loss, 1e-5, "loss")
    # with a row override, b's and C's gradients at the overridden columns are the kernel's base-row terms minus
    # the correction's (another float32 formula): a cancellation that keeps ~1e-7 of a large target term
    rtol = 1e-4 if kw["row_override"] is not None else 1e-5
    for i, (a, b) in enumerate(zip(g, ref_g)):
        assert a is not None and a.dtype == b.dtype and a.shape == b.shape
        assert torch.isfinite(a).all()
        assert_rel(a, b, rtol, f"grad {i}")
    if kw["row_override"] is not None and args[2].requires_grad:
        gW = g[[x is args[2] for x in wrt].index(True)]
        assert (gW[kw["row_override"][0]] == 0).all()  # never to W through overridden rows


@pytest.mark.parametrize("case", ["frozen_W", "override_rows_train_W", "no_bias_vector_thr_learnable"])
def test_bf16_operands(case, blocks):
    """bf16 operands and scratch, float32 accumulation: within bf16's rounding of the exact loss, and close to
    the torch loop's emulation of the same roundings."""
    args, kw, wrt = make_case(N=45, C=20, V=70, dtype=torch.float32, W_dtype=torch.bfloat16, **CASES[case])
    ref_loss, ref_g = loss_and_grads(reference_ovr_loss, args, kw, wrt)
    emu_loss, emu_g = loss_and_grads(fused_ovr_loss, args, kw, wrt, backend="torch", gemm_precision="bf16")
    loss, g = loss_and_grads(triton_loss, args, kw, wrt, gemm_precision="bf16")
    assert_rel(loss, ref_loss, 1e-4, "loss")
    assert_rel(loss, emu_loss, 2e-5, "loss vs emulation")
    for i, (a, r, e) in enumerate(zip(g, ref_g, emu_g)):
        assert torch.isfinite(a).all()
        assert_rel(a, r, 1.5e-2, f"grad {i}")
        assert_rel(a, e, 5e-3, f"grad {i} vs emulation")


@pytest.mark.parametrize("floor", [1e-6, 0.5, 50.0])
def test_follows_the_scale_floor(floor):
    # 50: most of scale_S is floored (no gradient through |W| or scale_Up there); 1e-6: only the zero row
    args, kw, wrt = make_case(N=30, C=8, V=40, dtype=torch.float32, train_W=True, learn_thr=True)
    ref = loss_and_grads(reference_ovr_loss, args, kw, wrt, scale_floor=floor)
    got = loss_and_grads(triton_loss, args, kw, wrt, scale_floor=floor, gemm_precision="fp32")
    assert_rel(got[0], ref[0], 1e-5, "loss")
    for i, (a, b) in enumerate(zip(got[1], ref[1])):
        assert_rel(a, b, 1e-5, f"grad {i}")


def test_extreme_inputs_against_mpmath():
    args = extreme_case(torch.float32)
    mp_loss, mp_db, mp_dsu = mp_loss_and_grads(args)
    loss = triton_loss(*args, scale_floor=FLOOR, gemm_precision="fp32")
    grads = torch.autograd.grad(loss, (args[0], args[1], args[2], args[3]))
    assert torch.isfinite(loss) and all(torch.isfinite(g).all() for g in grads)
    assert loss.item() == pytest.approx(mp_loss, rel=2e-5)
    torch.testing.assert_close(grads[3].double(), mp_db, rtol=1e-3, atol=1e-30)
    torch.testing.assert_close(grads[1][:, 0].double(), mp_dsu, rtol=1e-3, atol=1e-30)
    torch.testing.assert_close(grads[2][-2:, 0].double(), mp_db[-2:], rtol=1e-3, atol=1e-30)


def test_all_rows_ignored_recompute_and_retained_graph():
    args, kw, wrt = make_case(N=30, C=8, V=40, dtype=torch.float32, train_W=True, learn_thr=True, override=True)
    _, ref_g = loss_and_grads(reference_ovr_loss, args, kw, wrt)
    loss = triton_loss(*args, **kw, gemm_precision="fp32")
    g1 = torch.autograd.grad(loss, wrt, retain_graph=True)  # computed in the forward sweep
    g2 = torch.autograd.grad(3.0 * loss, wrt)  # the graph used again: a recompute sweep
    for a, b, r in zip(g1, g2, ref_g):
        assert_rel(a, r, 1e-5, "eager")
        assert_rel(b, 3.0 * r, 1e-5, "recompute x3")
    with torch.no_grad():
        assert_rel(triton_loss(*args, **kw), reference_ovr_loss(*args, **kw), 1e-5, "no_grad value")
    args[5][:] = -100
    loss = triton_loss(*args, **kw)
    assert loss.item() == 0.0 and loss.requires_grad
    assert all((g == 0).all() for g in torch.autograd.grad(loss, wrt))


def test_deterministic_mode_sums_columns_without_atomics(monkeypatch):
    """torch.use_deterministic_algorithms(True): b's gradient from per-row-tile partial sums, the same numbers
    as the atomic adds up to float32 rounding and the same bits from run to run."""
    monkeypatch.setattr(ovr_triton, "DEFAULT_BLOCKS", dataclasses.replace(ovr_triton.DEFAULT_BLOCKS, **SMALL))
    args, kw, wrt = make_case(N=45, C=20, V=70, dtype=torch.float32, learn_thr=True)
    _, g_atomic = loss_and_grads(triton_loss, args, kw, wrt, gemm_precision="fp32")
    prev = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        runs = [loss_and_grads(triton_loss, args, kw, wrt, gemm_precision="fp32")[1] for _ in range(2)]
    finally:
        torch.use_deterministic_algorithms(prev)
    for a, b, c in zip(*runs, g_atomic):
        assert torch.equal(a, b)
        assert_rel(a, c, 1e-6, "deterministic vs atomic")


def test_never_holds_an_n_by_v_tensor(monkeypatch):
    from torch.profiler import ProfilerActivity, profile

    blocks = dataclasses.replace(ovr_triton.DEFAULT_BLOCKS, **SMALL)
    monkeypatch.setattr(ovr_triton, "DEFAULT_BLOCKS", blocks)
    N, C, V = 256, 8, 1024
    args, kw, _ = make_case(N=N, C=C, V=V, dtype=torch.float32, override=True)
    largest = {}
    for name, fn in (("triton", triton_loss), ("reference", reference_ovr_loss)):
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fn(*args, **kw).backward()
        largest[name] = max(e.cpu_memory_usage for e in prof.events())
    assert largest["reference"] >= N * V * 4  # the check can see an [N, V] tensor
    assert largest["triton"] < N * V * 4 / 20  # scratch and gradients of [n, C], [V], nothing [n, V]


def test_backend_and_precision_defaults(monkeypatch):
    assert loss_module.resolve_backend(None, torch.float32, "cpu") == "torch"
    assert loss_module.resolve_backend(None, torch.float32, "cuda") == "triton"
    assert loss_module.resolve_backend(None, torch.float64, "cuda") == "torch"
    assert loss_module.resolve_gemm_precision(None, "torch", "cpu") == "fp32"
    assert loss_module.resolve_gemm_precision(None, "triton", "cuda") == loss_module.CUDA_TRITON_GEMM == "bf16"
    assert loss_module.resolve_gemm_precision(None, "torch", "cuda") == "tf32"
    monkeypatch.setenv(loss_module.BACKEND_ENV, "triton")
    assert loss_module.resolve_backend(None, torch.float32, "cpu") == "triton"  # the interpreter is on
    args, kw, wrt = make_case(dtype=torch.float64)
    with pytest.raises(ValueError, match="float64"):
        fused_ovr_loss(*args, **kw)
    with pytest.raises(ValueError, match="backend must be one of"):
        fused_ovr_loss(*args, **kw, backend="cuda")
    monkeypatch.setattr(ovr_triton, "INTERPRETED", False)
    with pytest.raises(ValueError, match="runs on CUDA tensors"):
        loss_module.resolve_backend("triton", torch.float32, "cpu")
    monkeypatch.setenv(ovr_triton.BLOCKS_ENV, '{"BT": 32}')
    assert ovr_triton.default_blocks().BT == 32
    monkeypatch.setenv(ovr_triton.BLOCKS_ENV, '{"tile": 32}')
    with pytest.raises(ValueError, match=ovr_triton.BLOCKS_ENV):
        ovr_triton.default_blocks()


def test_interpreter_bf16_fix():
    import triton
    import triton.language as tl

    @triton.jit
    def bf16_dot(a_ptr, b_ptr, out_ptr, N: tl.constexpr):
        r = tl.arange(0, N)
        a = tl.load(a_ptr + r[:, None] * N + r[None, :]).to(tl.bfloat16)
        b = tl.load(b_ptr + r[:, None] * N + r[None, :]).to(tl.bfloat16)
        tl.store(out_ptr + r[:, None] * N + r[None, :], tl.dot(a, b))

    g = torch.Generator().manual_seed(0)
    a, b, out = torch.randn(16, 16, generator=g), torch.randn(16, 16, generator=g), torch.empty(16, 16)
    bf16_dot[(1,)](a, b, out, N=16)
    torch.testing.assert_close(out, a.bfloat16().float() @ b.bfloat16().float(), rtol=1e-6, atol=1e-6)
