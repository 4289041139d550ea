"""The fused OvR loss sweep as Triton kernels (CUDA; Triton's interpreter runs them on CPU tensors for
the tests: TRITON_INTERPRET=1 set before this module is imported).

Same contract as `loss._ovr_pass`: the sum of the OvR log-terms over [n, V] and the gradients of the
MEAN loss, never holding [n, V]. Shapes: lu, su [n, C] (loc_U, scale_U'), W [V, C], b [V], thresholds
0-dim or [V], y [n] (targets, every row valid).

Why super-blocks and not one kernel: the gradient g_lu = dL/dz @ W needs, for a tile of rows, an
accumulator over ALL of C (896 .. 8192 floats a row), which fits neither registers nor shared memory,
and writing it back once per vocabulary tile costs more memory traffic than the GEMMs themselves. So
the sweep goes over super-blocks [Tc, Vr] of rows x vocabulary (Tc x Vr ~ 3M: a Python loop of
n V / 3M steps, four launches a step, no host sync), each step:
  1. |W| of the chunk's columns into a buffer (|W| per chunk, never whole; both GEMMs then read their
     operands straight from memory, which is what lets Triton pipeline the loads);
  2. `_scores_kernel`: tiles [BT, BV] of z = lu W^T + b - C and s = max(su |W|^T, floor) on chip
     (tensor-core dots), the log-terms and their derivatives in registers; adds the tile's loss sum and
     the column sums of dL/dz (b's and a vector C's gradient), and writes dL/dz, dL/ds into a scratch
     [Tc, Vr] (bf16 for bf16 operands: 12 MiB) that stays in L2;
  3. g_lu[Tc] += G_z W[Vr] and g_su[Tc] += G_s |W[Vr]| by cuBLAS with float32 accumulation (measured on
     an H200: 45 ms against 65 ms for the same products in a Triton kernel);
  4. when W trains, `_weight_grads_kernel`: acc_W[Vr] += G_z^T lu + sign(W) (G_s^T su).
Every column is scored as a non-target, log(1 - P); a row's target column is scored with z -> -z
(log P(z) = log(1 - P(-z)) for the symmetric Cauchy) and its dL/dz flips sign: no separate pass.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch sweep runs instead (loss.py)
    triton = None

_PI = math.pi
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # what triton.jit below decorates with


def available() -> bool:
    return triton is not None


@dataclass(frozen=True)
class Blocks:
    """Tile shapes of the scores kernel [BT, BV] (K step BK over C) and of the weight-gradient kernel [BVW, BN]
    (K step BKT over rows), their warps and pipeline stages; the super-block: `rows` (Tc) and the bytes of its
    two scratch buffers. Defaults measured on an H200 at the 0.5B head (docs/mixed_precision.md)."""
    BT: int = 64
    BV: int = 64
    BK: int = 64
    warps: int = 4
    stages: int = 3
    BVW: int = 64
    BN: int = 128
    BKT: int = 64
    grad_warps: int = 4
    grad_stages: int = 3
    scratch_bytes: int = 12 * 2**20
    rows: int = 2048  # Tc, the super-block's rows (fewer for small n)


BLOCKS_ENV = "CAUSAL_ADAPTER_OVR_BLOCKS"  # JSON of Blocks fields: a tuning run's choice, over the defaults


def default_blocks() -> Blocks:
    """Blocks(), with the fields of $CAUSAL_ADAPTER_OVR_BLOCKS (JSON) over it."""
    text = os.environ.get(BLOCKS_ENV)
    if not text:
        return DEFAULT_BLOCKS
    try:
        return dataclasses.replace(DEFAULT_BLOCKS, **json.loads(text))
    except (ValueError, TypeError) as e:
        raise ValueError(f"{BLOCKS_ENV} must be a JSON object of {sorted(DEFAULT_BLOCKS.__dataclass_fields__)}, "
                         f"got {text!r}: {e}") from None


DEFAULT_BLOCKS = Blocks()


def super_block(n: int, V: int, op_bytes: int, blocks: Blocks) -> tuple[int, int]:
    """(Tc, Vr): Tc rows (a multiple of BT and BKT) and Vr vocabulary columns (a multiple of BV and BVW)
    whose two scratch buffers of `op_bytes` per entry fit blocks.scratch_bytes."""
    row_unit = math.lcm(blocks.BT, blocks.BKT)
    col_unit = math.lcm(blocks.BV, blocks.BVW)
    Tc = max(row_unit, min(blocks.rows, -(-n // row_unit) * row_unit) // row_unit * row_unit)
    Vr = max(col_unit, blocks.scratch_bytes // (2 * op_bytes * Tc) // col_unit * col_unit)
    return Tc, min(Vr, -(-V // col_unit) * col_unit)


if triton is not None:

    @triton.jit
    def _atan_unit(x):
        """atan(x) for x in [0, 1], Cephes' atanf (relative error < 2e-7): libdevice's atan is not in the
        interpreter, and the polynomial is what loss._atan_unit computes."""
        big = x > 0.41421356237309503  # tan(pi/8)
        x = tl.where(big, (x - 1.0) / (x + 1.0), x)
        x2 = x * x
        p = (((8.05374449538e-2 * x2 - 1.38776856032e-1) * x2 + 1.99777106478e-1) * x2
             - 3.33329491539e-1) * x2 * x + x
        return tl.where(big, p + 0.7853981633974483, p)

    @triton.jit
    def _ovr_terms(z, s):
        """log(1 - P) with P = 1/2 + atan(z/s)/pi, and pi d/dz, -pi d/ds of -log(1 - P) (s > 0).

        As loss._block_kernel: r = atan2(s, |z|)/pi = min(P, 1-P) accurate in both tails, log1p(-r)
        as log(w) + e/w with w = fl(1 - r) and e its exact rounding error, and everything divided
        by m = max(|z|, s) first so that z^2 never overflows."""
        a = tl.abs(z)
        lo = tl.minimum(a, s)
        hi = tl.maximum(a, s)
        inv_hi = 1.0 / hi
        ang = _atan_unit(lo * inv_hi)
        r = tl.where(s <= a, ang, 1.5707963267948966 - ang) * 0.3183098861837907  # / pi
        neg = z < 0
        w = tl.where(neg, 1.0 - r, r)  # 1 - P
        e = tl.where(neg, (1.0 - w) - r, 0.0)
        zn = z * inv_hi
        sn = s * inv_hi
        un = zn * zn + sn * sn  # u / m^2 in [1, 2]
        inv_uw = 1.0 / (un * w)
        log_1mp = tl.log(w) + e * inv_uw * un
        k = inv_uw * inv_hi  # pi / (u theta), u = z^2 + s^2, theta = pi (1 - P)
        return log_1mp, sn * k, zn * k

    @triton.jit(do_not_specialize=["t0", "t1", "v0", "v1", "floor"])
    def _scores_kernel(lu_ptr, su_ptr, W_ptr, aW_ptr, b_ptr, thr_ptr, y_ptr, gz_ptr, gs_ptr, loss_ptr, colsum_ptr,
                       t0, t1, v0, v1, C, V, floor, n_vtiles, stride_g,
                       HAS_B: tl.constexpr, THR_VEC: tl.constexpr, NEED_G: tl.constexpr, COLSUM: tl.constexpr,
                       OP_BF16: tl.constexpr, PRECISION: tl.constexpr,
                       BT: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr):
        """One [BT, BV] tile of the super-block rows [t0, t1) x columns [v0, v1). lu, su, y hold the chunk's
        rows (row 0 = t0), W and aW = |W| the chunk's columns (row 0 = v0), all in the GEMM operand dtype.
        loss_ptr [Tc/BT, n_vtiles] accumulates (+=); COLSUM: 0 none, 1 atomic adds into colsum [V],
        2 deterministic partial sums into colsum [Tc/BT, V] (+=); gz, gs [Tc, stride_g] are overwritten."""
        pid = tl.program_id(0)
        n_t = tl.cdiv(t1 - t0, BT)
        pid_t = pid % n_t  # row tiles innermost: the programs that share a W tile run together
        pid_v = pid // n_t
        r_loc = pid_t * BT + tl.arange(0, BT)
        c_loc = pid_v * BV + tl.arange(0, BV)
        cols = v0 + c_loc
        rmask = r_loc < t1 - t0
        cmask = cols < v1
        ks = tl.arange(0, BK)
        lu_rows = lu_ptr + r_loc.to(tl.int64)[:, None] * C
        su_rows = su_ptr + r_loc.to(tl.int64)[:, None] * C
        w_rows = c_loc.to(tl.int64)[:, None] * C
        acc_z = tl.zeros((BT, BV), dtype=tl.float32)
        acc_s = tl.zeros((BT, BV), dtype=tl.float32)
        for k0 in range(0, C, BK):
            kk = k0 + ks
            kmask = kk < C
            a = tl.load(lu_rows + kk[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
            sa = tl.load(su_rows + kk[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
            w = tl.load(W_ptr + w_rows + kk[None, :], mask=cmask[:, None] & kmask[None, :], other=0.0)
            aw = tl.load(aW_ptr + w_rows + kk[None, :], mask=cmask[:, None] & kmask[None, :], other=0.0)
            if OP_BF16:
                acc_z = tl.dot(a, tl.trans(w), acc_z)
                acc_s = tl.dot(sa, tl.trans(aw), acc_s)
            else:
                acc_z = tl.dot(a, tl.trans(w), acc_z, input_precision=PRECISION)
                acc_s = tl.dot(sa, tl.trans(aw), acc_s, input_precision=PRECISION)
        if THR_VEC:
            off = -tl.load(thr_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        else:
            off = -tl.load(thr_ptr).to(tl.float32) + tl.zeros((BV,), dtype=tl.float32)
        if HAS_B:
            off += tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        z = acc_z + off[None, :]
        y = tl.load(y_ptr + r_loc, mask=rmask, other=-1)
        target = y[:, None] == cols[None, :]
        s = tl.maximum(acc_s, floor)
        log_term, gz, gs = _ovr_terms(tl.where(target, -z, z), s)  # target: log P(z) = log(1 - P(-z))
        valid = rmask[:, None] & cmask[None, :]
        loss_at = loss_ptr + pid_t * n_vtiles + (v0 // BV + pid_v)
        tl.store(loss_at, tl.load(loss_at) + tl.sum(tl.sum(tl.where(valid, log_term, 0.0), axis=1), axis=0))
        if NEED_G:
            gz = tl.where(valid, tl.where(target, -gz, gz), 0.0)
            gs = tl.where(valid & (acc_s >= floor), gs, 0.0)  # the floor's mask
            if COLSUM == 1:  # from the exact float32 dL/dz, before any rounding to the scratch's dtype
                tl.atomic_add(colsum_ptr + cols, tl.sum(gz, axis=0), mask=cmask, sem="relaxed")
            if COLSUM == 2:
                cs_at = colsum_ptr + pid_t * V + cols
                tl.store(cs_at, tl.load(cs_at, mask=cmask, other=0.0) + tl.sum(gz, axis=0), mask=cmask)
            g_at = r_loc[:, None] * stride_g + c_loc[None, :]
            tl.store(gz_ptr + g_at, gz.to(gz_ptr.dtype.element_ty), mask=valid)
            tl.store(gs_ptr + g_at, gs.to(gs_ptr.dtype.element_ty), mask=valid)

    @triton.jit(do_not_specialize=["t0", "t1", "v0", "v1"])
    def _weight_grads_kernel(gz_ptr, gs_ptr, lu_ptr, su_ptr, W_ptr, acc_ptr, t0, t1, v0, v1, C, stride_g,
                             OP_BF16: tl.constexpr, PRECISION: tl.constexpr,
                             BV: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        """acc[k, c] += sum_i G_z[i, k] lu[i, c] - sign(W[k, c]) sum_i G_s[i, k] su[i, c] (acc [Vr, C] float32;
        lu, su the chunk's rows, W its columns; G_s holds -pi dL/ds, hence the minus)."""
        pid = tl.program_id(0)
        n_v = tl.cdiv(v1 - v0, BV)
        pid_v = pid % n_v
        pid_n = pid // n_v
        v_loc = pid_v * BV + tl.arange(0, BV)
        cols = pid_n * BN + tl.arange(0, BN)
        vmask = v_loc < v1 - v0
        cmask = cols < C
        ks = tl.arange(0, BK)
        acc_l = tl.zeros((BV, BN), dtype=tl.float32)
        acc_s = tl.zeros((BV, BN), dtype=tl.float32)
        for k0 in range(0, t1 - t0, BK):
            kk = k0 + ks
            kmask = kk < t1 - t0
            g_at = kk[None, :] * stride_g + v_loc[:, None]  # [BV, BK]: G transposed
            gmask = vmask[:, None] & kmask[None, :]
            gz = tl.load(gz_ptr + g_at, mask=gmask, other=0.0)
            gs = tl.load(gs_ptr + g_at, mask=gmask, other=0.0)
            x_at = kk.to(tl.int64)[:, None] * C + cols[None, :]
            xmask = kmask[:, None] & cmask[None, :]
            lu = tl.load(lu_ptr + x_at, mask=xmask, other=0.0)
            su = tl.load(su_ptr + x_at, mask=xmask, other=0.0)
            if OP_BF16:
                acc_l = tl.dot(gz, lu, acc_l)
                acc_s = tl.dot(gs, su, acc_s)
            else:
                acc_l = tl.dot(gz, lu, acc_l, input_precision=PRECISION)
                acc_s = tl.dot(gs, su, acc_s, input_precision=PRECISION)
        w_at = v_loc.to(tl.int64)[:, None] * C + cols[None, :]
        omask = vmask[:, None] & cmask[None, :]
        w = tl.load(W_ptr + w_at, mask=omask, other=0.0).to(tl.float32)
        sign = tl.where(w > 0, 1.0, tl.where(w < 0, -1.0, 0.0))
        tl.store(acc_ptr + w_at, tl.load(acc_ptr + w_at, mask=omask, other=0.0) + acc_l - sign * acc_s, mask=omask)


def _accumulate_mm(out: Tensor, a: Tensor, b: Tensor, precision: str) -> None:
    """out += a @ b by cuBLAS, out float32: bf16 operands accumulate in float32 (addmm's out_dtype; off CUDA,
    where that is missing, the same products upcast); float32 operands in TF32 or IEEE as asked."""
    if a.dtype == torch.float32:
        prev = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
        try:
            out.addmm_(a, b)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = prev
    elif out.is_cuda:
        torch.addmm(out, a, b, out_dtype=torch.float32, out=out)
    else:
        out.addmm_(a.float(), b.float())


def ovr_sweep(lu: Tensor, su: Tensor, W: Tensor, b: Tensor | None, thr: Tensor, y: Tensor, floor: float,
              gemm: str, needs: tuple[bool, ...], blocks: Blocks | None = None):
    """(sum of the log-terms, 0-dim float64; grads of the mean loss (g_lu, g_su, g_W, g_b, g_thr), None where
    not needed); see the module docstring. lu, su float32 [n, C]; gemm "bf16" (bf16 operands and scratch),
    "tf32" or "fp32" (float32 scratch, TF32 or IEEE dots). Rows replaced by a row override are the caller's."""
    need_lu, need_su, need_W, need_b, need_thr = needs
    blocks = blocks or default_blocks()
    grads = any(needs)
    n, C = lu.shape
    V = W.shape[0]
    dev = lu.device
    op_bf16 = gemm == "bf16"
    op_dtype = torch.bfloat16 if op_bf16 else torch.float32
    if not op_bf16:  # float32 tiles take twice the shared memory: half the K step
        blocks = dataclasses.replace(blocks, BK=blocks.BK // 2, BKT=blocks.BKT // 2)
    precision = "ieee" if gemm == "fp32" else "tf32"
    Tc, Vr = super_block(n, V, 2 if op_bf16 else 4, blocks)
    n_tt, n_vt = Tc // blocks.BT, -(-V // blocks.BV)
    f32 = dict(dtype=torch.float32, device=dev)
    thr_vec = thr.numel() > 1
    need_colsum = grads and (need_b or need_thr)
    # column sums of dL/dz: atomic adds, or partial sums per row tile where the user asked for determinism
    colsum_mode = 0 if not need_colsum else 2 if torch.are_deterministic_algorithms_enabled() else 1
    thr_t = thr.reshape(-1).contiguous()
    b_t = b.contiguous() if b is not None else thr_t  # a pointer the kernel never reads when HAS_B is off
    y = y.contiguous()
    loss_part = torch.zeros(n_tt, n_vt, **f32)
    colsum = (torch.zeros(V, **f32) if colsum_mode == 1 else torch.zeros(n_tt, V, **f32) if colsum_mode == 2
              else loss_part)
    g_lu = torch.zeros(n, C, **f32) if need_lu else None
    g_su = torch.zeros(n, C, **f32) if need_su else None
    g_W = (torch.empty_like(W) if n else torch.zeros_like(W)) if need_W else None  # (filled chunk by chunk)
    acc_W = torch.empty(Vr, C, **f32) if need_W else None
    gz_buf, gs_buf = ([torch.empty(Tc, Vr, dtype=op_dtype, device=dev) for _ in range(2)] if grads
                      else [loss_part] * 2)
    aW_buf = torch.empty(Vr, C, dtype=op_dtype, device=dev)
    W_buf = torch.empty(Vr, C, dtype=op_dtype, device=dev) if W.dtype != op_dtype else None
    rows = [(t0, min(n, t0 + Tc)) for t0 in range(0, n, Tc)]
    cols = [(v0, min(V, v0 + Vr)) for v0 in range(0, V, Vr)]
    # rows outer: a chunk's operands and gradients stay in L2 across the vocabulary; with W training its
    # float32 accumulator is per vocabulary chunk, so the vocabulary goes outer
    order = [(r, c) for c in cols for r in rows] if need_W else [(r, c) for r in rows for c in cols]
    op_rows = op_cols = None
    for (t0, t1), (v0, v1) in order:
        if op_rows != (t0, t1):  # the rows' GEMM operands (bf16: cast once per chunk, not per tile)
            op_rows = (t0, t1)
            lu_op, su_op = lu[t0:t1].to(op_dtype), su[t0:t1].to(op_dtype)
        if op_cols != (v0, v1):  # the columns' W and |W| as GEMM operands (|W| per chunk, never whole)
            op_cols = (v0, v1)
            W_op = W[v0:v1] if W_buf is None else W_buf[: v1 - v0].copy_(W[v0:v1])
            aW_op = torch.abs(W_op, out=aW_buf[: v1 - v0])
        grid = (triton.cdiv(t1 - t0, blocks.BT) * triton.cdiv(v1 - v0, blocks.BV),)
        _scores_kernel[grid](
            lu_op, su_op, W_op, aW_op, b_t, thr_t, y[t0:t1], gz_buf, gs_buf, loss_part, colsum,
            t0, t1, v0, v1, C, V, float(floor), n_vt, Vr,
            HAS_B=b is not None, THR_VEC=thr_vec, NEED_G=grads, COLSUM=colsum_mode,
            OP_BF16=op_bf16, PRECISION=precision, BT=blocks.BT, BV=blocks.BV, BK=blocks.BK,
            num_warps=blocks.warps, num_stages=blocks.stages)
        gz, gs = gz_buf[: t1 - t0, : v1 - v0], gs_buf[: t1 - t0, : v1 - v0]
        if need_lu:
            _accumulate_mm(g_lu[t0:t1], gz, W_op, precision)
        if need_su:
            _accumulate_mm(g_su[t0:t1], gs, aW_op, precision)
        if need_W:
            if t0 == 0:
                acc_W.zero_()
            grid = (triton.cdiv(v1 - v0, blocks.BVW) * triton.cdiv(C, blocks.BN),)
            _weight_grads_kernel[grid](
                gz_buf, gs_buf, lu_op, su_op, W_op, acc_W, t0, t1, v0, v1, C, Vr,
                OP_BF16=op_bf16, PRECISION=precision, BV=blocks.BVW, BN=blocks.BN, BK=blocks.BKT,
                num_warps=blocks.grad_warps, num_stages=blocks.grad_stages)
            if t1 == n:
                g_W[v0:v1] = acc_W[: v1 - v0].mul_(1.0 / (max(1, n) * _PI)).to(W.dtype)
    total = loss_part.sum(dtype=torch.float64)
    if not grads:
        return total, None
    a = 1.0 / (max(1, n) * _PI)
    if need_lu:
        g_lu.mul_(a)
    if need_su:
        g_su.mul_(-a)  # the scratch held -pi dL/ds
    if need_colsum:
        colsum = (colsum if colsum_mode == 1 else colsum.sum(0)).mul_(a)
    g_b = colsum.to(b.dtype) if need_b else None
    g_thr = (-(colsum if thr_vec else colsum.sum())).to(thr.dtype).reshape(thr.shape) if need_thr else None
    return total, (g_lu, g_su, g_W, g_b, g_thr)
