"""The fused, chunked OvR loss (`ovr_loss.fused_ovr_loss` is its entry point): one sweep over [n, V] in [T, Vc]
blocks that never holds more than one block (`chunk_sizes` sizes them from a memory budget), every column first
taken as a non-target, each row's target column then corrected in O(n C) (`_target_columns`); the forward computes
the gradients too unless asked to recompute them (`_FusedOvR`). The sweep runs in torch here or in Triton
(`ovr_triton`); which one, at what GEMM precision, and whether the block kernel is compiled: `ovr_backends`."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .cauchy import ovr_log_probs, ovr_log_probs_grads
from .heads import full_precision
from .ovr_backends import _gemm_operand, _run_compiled_kernel, _tf32_matmuls, _triton_sweep

DEFAULT_MEMORY_BUDGET_MB = 160  # working memory of one block of the fused loss (not its outputs)
MAX_TOKEN_CHUNK = 1024  # measured: larger token chunks buy no GEMM speed, only memory
MIN_VOCAB_CHUNK, MAX_VOCAB_CHUNK = 256, 8192
# On CUDA without Triton the torch loop takes GPU-sized blocks: 1 GiB of working memory, 4,096-token chunks
# (H200: 47 ms vs 175 ms at the CPU-sized default for N = 8,192 at the 0.5B head; docs/mixed_precision.md, "Backends")
CUDA_MEMORY_BUDGET_MB, CUDA_MAX_TOKEN_CHUNK = 1024, 4096


def _column_offset(b: Tensor | None, thr: Tensor, cols: slice | Tensor, dtype) -> Tensor:
    """b_k - C_k for the given columns ([cols], or 0-dim when b is None and C is a scalar)."""
    t = thr.to(dtype)
    off = -(t[cols] if thr.numel() > 1 else t.reshape(()))
    return off if b is None else b[cols].to(dtype) + off


@dataclass(frozen=True)
class _Plan:
    dtype: torch.dtype
    floor: float
    token_chunk: int
    vocab_chunk: int
    recompute: bool  # forward computes the loss only; backward redoes the chunks
    exclude: Tensor | None  # W rows that get no gradient (replaced by row_override)
    compiled: bool = False  # elementwise part of a block as one torch.compile'd kernel
    gemm: str = "fp32"  # GEMM_PRECISIONS
    backend: str = "torch"  # BACKENDS
    scratch_mb: float | None = None  # the Triton sweep's scratch (None: its default)


def chunk_sizes(n, V, C, esize, w_temps, vocab_chunk, token_chunk, memory_budget_mb,
                max_token_chunk=MAX_TOKEN_CHUNK):
    """(T, Vc): a [T, Vc] block needs 6 float buffers + 1 bool; each W chunk row needs
    `w_temps` [C] temporaries (|W|, a cast copy, trainable-W accumulators)."""
    budget = (memory_budget_mb or DEFAULT_MEMORY_BUDGET_MB) * 2**20
    T = token_chunk or max(1, min(n, max_token_chunk))

    def cols(T):
        per_col = T * (6 * esize + 1) + w_temps * C * esize
        return budget // per_col // 256 * 256

    if not token_chunk:
        while T > 64 and cols(T) < 1024:  # a tight budget shrinks tokens before vocab
            T //= 2
    Vc = vocab_chunk or max(MIN_VOCAB_CHUNK, min(MAX_VOCAB_CHUNK, cols(T)))
    return T, max(1, min(Vc, V))


def _block_terms(Z: Tensor, S: Tensor, R: Tensor, B1: Tensor, B2: Tensor, Nf: Tensor, grads: bool) -> Tensor:
    """Sum of log(1 - P) over one [t, v] block, all columns taken as non-targets (0-dim, on the device).

    Z holds z = loc_S - C, S the floored scale s; R, B1, B2, Nf are scratch of the same
    shape. If `grads`, S is overwritten with pi * d/dz and Z with -pi * d/ds of -log(1 - P):
        d(-log(1-P))/dz = s / (u theta),  d(-log(1-P))/ds = -z / (u theta),
        u = z^2 + s^2,  theta = pi (1 - P) = atan2(s, z)          (see cauchy.py)
    Everything is in place (out=): at these sizes the block is memory-bound, and fresh
    allocations would also fault their pages in every time.
    """
    # r = min(P, 1-P) = atan2(s, |z|)/pi, the small angle: accurate in both tails.
    torch.abs(Z, out=R)
    torch.atan2(S, R, out=R).mul_(1.0 / math.pi)
    torch.lt(Z, 0, out=Nf)  # 1.0 where z < 0, i.e. P < 1/2 and 1 - P = 1 - r
    torch.neg(R, out=B1).log1p_()  # log(1-P) where z < 0
    torch.log(R, out=B2)  # log(1-P) where z >= 0
    torch.lerp(B2, B1, Nf, out=B2)  # exact select for weights 0/1 (torch.where is not vectorised)
    total = B2.sum()
    if grads:
        torch.sub(1.0, R, out=B1)
        q = torch.lerp(R, B1, Nf, out=R)  # 1 - P = theta / pi
        den = torch.mul(Z, Z, out=B1).addcmul_(S, S).mul_(q)  # u theta / pi
        S.div_(den)
        Z.div_(den)
    return total


def _floor_bounds(su_c: Tensor, W: Tensor, tok, vch, dt, need_rows: bool) -> tuple[list[float], list[float]]:
    """(min_c scale_Up per token chunk, min_k sum_c |W_kc| per vocab chunk), read in ONE host sync:
    scale_S >= min_c(scale_Up_i) * sum_c |W_kc| lets whole blocks skip the floor mask (only blocks
    touching near-zero W rows pay for it). Without `need_rows` (compiled kernel: it masks itself) the
    row bounds are 0."""
    parts = [su_c[a:e].min() for a, e in tok]
    if need_rows:
        parts += [W[v0:v1].abs().sum(1, dtype=dt).min() for v0, v1 in vch]
    vals = torch.stack(parts).tolist() if parts else []
    return vals[:len(tok)], vals[len(tok):] if need_rows else [0.0] * len(vch)


def _ovr_pass(lu, su, W, b, thr, y, plan: _Plan, needs):
    """One sweep over [n, V] in [T, Vc] blocks.

    lu, su: [n, C] (rows with a label); W: [V, C]; b: [V] or None; thr: 0-dim or [V]; y: [n];
    needs: which of (lu, su, W, b, thr) need a gradient.
    Returns (sum over rows of sum_k log-terms as a 0-dim device tensor, grads) where the loss is
    -sum/n and grads is (g_lu, g_su, g_W, g_b, g_thr) of the MEAN loss (None where not needed).
    Every column is first treated as a non-target (term log(1 - P)); each row's target
    column is then corrected with an O(n C) gather (term log P - log(1 - P)). One host sync in all
    (`_floor_bounds`): the block sums accumulate on the device.
    """
    if plan.backend == "triton":
        return _triton_pass(lu, su, W, b, thr, y, plan, needs)
    need_W = needs[2]
    grads = any(needs)
    n, C = lu.shape
    V = W.shape[0]
    dt, floor, gemm = plan.dtype, plan.floor, plan.gemm if plan.dtype == torch.float32 else "fp32"
    T, Vc = plan.token_chunk, plan.vocab_chunk
    inv = 1.0 / max(1, n)
    lu_c, su_c = lu.to(dt), su.to(dt)
    lu_g, su_g = _gemm_operand(lu_c, gemm), _gemm_operand(su_c, gemm)
    dev = lu.device
    g_lu, g_su, g_W, colsum, gz_total = _grad_accumulators(lu_c, su_c, W, thr, needs)
    total = torch.zeros((), dtype=torch.float64 if dev.type != "mps" else dt, device=dev)

    tok = [(t0, min(n, t0 + T)) for t0 in range(0, n, T)]
    vch = [(v0, min(V, v0 + Vc)) for v0 in range(0, V if n else 0, Vc)]
    compiled = plan.compiled
    smin, rowmins = _floor_bounds(su_c, W, tok, vch, dt, need_rows=not compiled)
    flat, mask_flat, acc_flat = _block_buffers(n, T, Vc, C, dt, dev, need_W)
    floor_t = torch.tensor(floor, dtype=dt, device=dev)

    for (v0, v1), rowmin in zip(vch, rowmins):
        v = v1 - v0
        Wc = W[v0:v1].to(dt)
        aWc = Wc.abs()  # |W| per chunk, never for the whole matrix
        Wg, aWg = _gemm_operand(Wc, gemm), _gemm_operand(aWc, gemm)
        off = _column_offset(b, thr, slice(v0, v1), dt).expand(v)  # addmm's bias
        accL, accS = (acc_flat[j, : v * C].view(v, C).zero_() for j in range(2)) if need_W else (None, None)
        for (t0, t1), sm in zip(tok, smin):
            l, si = lu_g[t0:t1], su_g[t0:t1]
            block = tuple(buf[: (t1 - t0) * v].view(t1 - t0, v) for buf in flat)  # Z, S, R, B1, B2, Nf
            _block_scores(block, off, l, si, Wg, aWg)
            Fm = None
            if compiled and _run_compiled_kernel(flat[0], flat[1], flat[2], block[0].numel(), floor_t, grads):
                total.add_(block[2].sum())  # (the floor mask is already applied)
            else:
                if compiled:  # the kernel failed (and may have written into the block): eager from here on
                    compiled = False
                    _block_scores(block, off, l, si, Wg, aWg)
                floored = not (sm > 0 and sm * rowmin >= 2 * floor)
                Fm = _eager_block(block, mask_flat if floored else None, floor, grads, total)
            if not grads:
                continue
            if Fm is not None:
                block[0].mul_(Fm)
            _add_block_grads(block[1], block[0], Wg, aWg, l, si, slice(t0, t1), slice(v0, v1), inv / math.pi, gemm,
                             (g_lu, g_su, colsum, gz_total, accL, accS))
        if need_W:  # d|W|/dW = sign(W)
            g_W[v0:v1] = accL.addcmul_(torch.sign(Wc), accS)

    total.add_(_target_columns(lu_c, su_c, W, b, thr, y, tok, floor, inv, grads,
                               g_lu, g_su, g_W, colsum, gz_total))
    if not grads:
        return total, None
    return total, _mean_loss_grads(lu, su, b, thr, plan, needs, (g_lu, g_su, g_W, colsum, gz_total))


def _triton_pass(lu, su, W, b, thr, y, plan: _Plan, needs):
    """`_ovr_pass` by the Triton sweep (modeling/ovr_triton.py), the same contract."""
    blocks = _triton_sweep().default_blocks()
    if plan.scratch_mb:
        blocks = dataclasses.replace(blocks, scratch_bytes=int(plan.scratch_mb * 2**20))
    with full_precision(lu.device):  # (cuBLAS's products keep the dtypes chosen here under a caller's autocast)
        total, grads = _triton_sweep().ovr_sweep(lu.to(plan.dtype).contiguous(), su.to(plan.dtype).contiguous(), W,
                                                 b, thr, y, plan.floor, plan.gemm, needs, blocks)
    if grads is None:
        return total, None
    g_lu, g_su, g_W, g_b, g_thr = grads
    if g_W is not None and plan.exclude is not None:
        g_W[plan.exclude] = 0  # those rows are replaced: their gradient goes to the override
    return total, (None if g_lu is None else g_lu.to(lu.dtype), None if g_su is None else g_su.to(su.dtype),
                   g_W, g_b, g_thr)


def _grad_accumulators(lu_c: Tensor, su_c: Tensor, W: Tensor, thr: Tensor, needs) -> tuple:
    """Zeroed gradient accumulators of a sweep, None where not needed: g_lu, g_su [n, C] (compute dtype),
    g_W [V, C] (W's dtype), colsum [V] (the column sums of dL/dz: b's gradient, and a vector C's) and
    gz_total 0-dim (a scalar C's)."""
    need_lu, need_su, need_W, need_b, need_thr = needs
    thr_vec = thr.numel() > 1
    dt, dev = lu_c.dtype, lu_c.device
    return (torch.zeros_like(lu_c) if need_lu else None,
            torch.zeros_like(su_c) if need_su else None,
            torch.zeros_like(W) if need_W else None,
            torch.zeros(W.shape[0], dtype=dt, device=dev) if (need_b or (need_thr and thr_vec)) else None,
            torch.zeros((), dtype=dt, device=dev) if (need_thr and not thr_vec) else None)


def _block_scores(block: tuple[Tensor, ...], off: Tensor, l: Tensor, si: Tensor, Wg: Tensor, aWg: Tensor) -> None:
    """The block's two GEMMs, into its first two [t, v] buffers: Z = loc_S - C, S = the raw scale_S."""
    torch.addmm(off, l, Wg.T, out=block[0])  # z = loc_S - C
    torch.mm(si, aWg.T, out=block[1])  # raw scale_S


def _eager_block(block: tuple[Tensor, ...], mask_flat: Tensor | None, floor: float, grads: bool,
                 total: Tensor) -> Tensor | None:
    """`_block_terms` on block = (Z, S, R, B1, B2, Nf), its sum added to `total`. With `mask_flat` (some
    scale_S of the block may be under the floor) S is floored first and the mask of where the floor is
    inactive (clamp_min's grad mask, [t, v] bool) is returned; else None."""
    Z, S = block[0], block[1]
    Fm = None
    if mask_flat is not None:
        Fm = mask_flat[: Z.numel()].view_as(Z)
        torch.ge(S, floor, out=Fm)  # where the floor is inactive (clamp_min's grad mask)
        S.clamp_min_(floor)
    total.add_(_block_terms(*block, grads))
    return Fm


def _mean_loss_grads(lu: Tensor, su: Tensor, b: Tensor | None, thr: Tensor, plan: _Plan, needs, acc: tuple) -> tuple:
    """(g_lu, g_su, g_W, g_b, g_thr) from the accumulators acc = (g_lu, g_su, g_W, colsum, gz_total), each in
    its input's dtype and shape (None where not needed); W rows replaced by a row override get 0."""
    need_lu, need_su, need_W, need_b, need_thr = needs
    g_lu, g_su, g_W, colsum, gz_total = acc
    if need_W and plan.exclude is not None:
        g_W[plan.exclude] = 0  # those rows are replaced: their gradient goes to the override
    g_b = colsum.to(b.dtype) if need_b else None
    thr_vec = thr.numel() > 1
    g_thr = (-(colsum if thr_vec else gz_total)).to(thr.dtype).reshape(thr.shape) if need_thr else None  # dz/dC = -1
    return g_lu.to(lu.dtype) if need_lu else None, g_su.to(su.dtype) if need_su else None, g_W, g_b, g_thr


def _add_block_grads(gz: Tensor, gsn: Tensor, Wg: Tensor, aWg: Tensor, l: Tensor, si: Tensor, rows: slice,
                     cols: slice, a: float, gemm: str, acc: tuple) -> None:
    """Add one [t, v] block's gradients into the accumulators acc = (g_lu, g_su, colsum, gz_total,
    accL, accS) (None = not needed): gz = pi * dL/dz and gsn = -pi * dL/ds of the block (floor mask
    applied), Wg / aWg the chunk's W and |W| and l / si the token chunk's loc_U and scale_U' as the
    GEMMs read them, a = 1 / (n pi)."""
    g_lu, g_su, colsum, gz_total, accL, accS = acc
    if colsum is not None:  # (sums, not GEMMs: from the exact gz)
        colsum[cols].add_(gz.sum(0), alpha=a)
    if gz_total is not None:
        gz_total.add_(gz.sum(), alpha=a)
    gz, gsn = _gemm_operand(gz, gemm), _gemm_operand(gsn, gemm)
    if g_lu is not None:
        g_lu[rows].addmm_(gz, Wg, alpha=a)
    if g_su is not None:
        g_su[rows].addmm_(gsn, aWg, alpha=-a)
    if accL is not None:
        accL.addmm_(gz.T, l, alpha=a)
        accS.addmm_(gsn.T, si, alpha=-a)


def _block_buffers(n, T, Vc, C, dt, dev, need_W):
    """Reused scratch of a sweep: six [T * Vc] float buffers, a bool floor mask and, for a trainable W,
    the per-vocabulary-chunk accumulators [2, Vc * C] of its loc and |W| gradients (None when n = 0)."""
    if not n:
        return [], None, None
    flat = [torch.empty(T * Vc, dtype=dt, device=dev) for _ in range(6)]
    mask = torch.empty(T * Vc, dtype=torch.bool, device=dev)
    return flat, mask, torch.empty(2, Vc * C, dtype=dt, device=dev) if need_W else None


def _target_columns(lu_c, su_c, W, b, thr, y, tok, floor, inv, grads, g_lu, g_su, g_W, colsum, gz_total) -> Tensor:
    """Target column of each row: the sum of log P - log(1 - P) (0-dim, on the device), O(n C),
    nothing [n, V]; adds its gradients into the accumulators given (None = not needed)."""
    dt = lu_c.dtype
    total = torch.zeros((), dtype=dt, device=lu_c.device)
    for t0, t1 in tok:
        l, si, yt = lu_c[t0:t1], su_c[t0:t1], y[t0:t1]
        Wy = W[yt].to(dt)
        aWy = Wy.abs()
        z = (l * Wy).sum(1) + _column_offset(b, thr, yt, dt)
        s_raw = (si * aWy).sum(1)
        s = s_raw.clamp_min(floor)
        log_p, log_1mp = ovr_log_probs(z, s)
        total += (log_p - log_1mp).sum()
        if not grads:
            continue
        gz, gs = ovr_log_probs_grads(z, s, -inv, inv)  # of (-log P + log(1 - P)) / n
        gs = gs * (s_raw >= floor)
        if g_lu is not None:
            g_lu[t0:t1].addcmul_(gz[:, None], Wy)
        if g_su is not None:
            g_su[t0:t1].addcmul_(gs[:, None], aWy)
        if colsum is not None:
            colsum.index_add_(0, yt, gz)
        if gz_total is not None:
            gz_total.add_(gz.sum())
        if g_W is not None:
            gw = gz[:, None] * l + torch.sign(Wy) * (gs[:, None] * si)
            g_W.index_add_(0, yt, gw.to(W.dtype))
    return total


class _FusedOvR(torch.autograd.Function):
    """Chunked OvR loss. Default: forward also computes the gradients (one sweep, four or
    six GEMMs per block) and backward only scales them by grad_output. Recompute mode
    (plan.recompute, or when the stored gradients were already handed out, e.g. a second
    backward through a retained graph or gradcheck) computes the loss only in forward and
    redoes the sweep in backward."""

    @staticmethod
    def forward(ctx, lu, su, W, b, thr, y, plan: _Plan):
        needs = tuple(ctx.needs_input_grad[:5])
        eager = not plan.recompute and any(needs)
        with _tf32_matmuls(plan.gemm == "tf32" and lu.is_cuda):
            total, grads = _ovr_pass(lu, su, W, b, thr, y, plan, needs if eager else (False,) * 5)
        ctx.grads = grads
        ctx.plan = plan
        ctx.save_for_backward(lu, su, W, b, thr, y)
        n = max(1, lu.shape[0])
        return (total / -n).to(plan.dtype)  # stays on the device: no host sync

    @staticmethod
    def backward(ctx, grad_out):
        if torch.is_grad_enabled():  # create_graph=True: the sweep is not itself differentiable
            raise RuntimeError("fused_ovr_loss supports first derivatives only (no create_graph=True / "
                               "double backward); use reference_ovr_loss for higher-order gradients")
        grads, ctx.grads = ctx.grads, None  # hand them out once (autograd can then steal them)
        if grads is None:
            with _tf32_matmuls(ctx.plan.gemm == "tf32" and grad_out.is_cuda):
                _, grads = _ovr_pass(*ctx.saved_tensors, ctx.plan, tuple(ctx.needs_input_grad[:5]))
        # times grad_out on the device (reading it to skip a multiplication by 1 would be a host sync)
        grads = tuple(None if g is None else g.mul_(grad_out.to(g.dtype)) for g in grads)
        g_lu, g_su, g_W, g_b, g_thr = grads
        return g_lu, g_su, g_W, g_b, g_thr, None, None
