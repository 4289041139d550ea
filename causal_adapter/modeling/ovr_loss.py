"""The one-vs-rest (OvR) classification loss over the whole vocabulary (SPEC section 3), the reference formula and
its fused chunked implementation; `modeling.loss` combines it with the regression loss.

Shapes: N token rows (the caller flattens batch x sequence), C causal size, V vocabulary rows.

    loc_S   = loc_U @ W.T + b_cls                          [N, V]
    scale_S = max(scale_Up @ |W|.T, scale_floor)           [N, V]
    P_ik    = 1/2 + atan((loc_S_ik - C_k) / scale_S_ik) / pi
    L_cls   = mean over rows with labels != ignore_index of
              -sum_k [y_ik log P_ik + (1 - y_ik) log(1 - P_ik)],   y = one_hot(labels)

`reference_ovr_loss` is this formula verbatim (it materialises [N, V]); `fused_ovr_loss`
gives the same value and gradients without ever holding more than one [T, Vc] block (its sweep in torch here, or
in Triton: `ovr_triton`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import warnings
from dataclasses import dataclass

import torch
from torch import Tensor

from ..config import DEFAULT_SCALE_FLOOR, IGNORE_INDEX
from .cauchy import ovr_log_probs, ovr_log_probs_grads
from .heads import full_precision

RowOverride = tuple[Tensor, Tensor]  # (indices LongTensor [R], rows [R, C])

DEFAULT_MEMORY_BUDGET_MB = 160  # working memory of one block of the fused loss (not its outputs)
MAX_TOKEN_CHUNK = 1024  # measured: larger token chunks buy no GEMM speed, only memory
MIN_VOCAB_CHUNK, MAX_VOCAB_CHUNK = 256, 8192
# Below this many [n, V] elements the one-time torch.compile of the block kernel (about
# 35 s on 2 CPU cores, then cached on disk) costs more than it saves.
COMPILE_MIN_ELEMENTS = 2**24
COMPILE_ENV = "CAUSAL_ADAPTER_COMPILE_LOSS"  # "0": never compile the block kernel, "1": always
# Precision of the block GEMMs of a float32 fused loss (docs/mixed_precision.md has the accuracy cost):
# "fp32" true float32 (default until a GPU measures the speed), "tf32" TF32 tensor cores on CUDA,
# "bf16" bf16-rounded operands with float32 accumulation.
GEMM_PRECISIONS = ("fp32", "tf32", "bf16")
GEMM_ENV = "CAUSAL_ADAPTER_LOSS_GEMM"  # overrides the default gemm_precision
# The sweep's implementation: "triton" (modeling/ovr_triton.py: tiles on chip, CUDA; Triton's interpreter
# on CPU for tests) or "torch" (the chunked loop below: CPU, float64, or CUDA without Triton).
BACKENDS = ("torch", "triton")
BACKEND_ENV = "CAUSAL_ADAPTER_LOSS_BACKEND"
# On CUDA without Triton the torch loop takes GPU-sized blocks: 1 GiB of working memory, 4,096-token chunks
# (H200: 47 ms vs 175 ms at the CPU-sized default for N = 8,192 at the 0.5B head; docs/mixed_precision.md, "Backends")
CUDA_MEMORY_BUDGET_MB, CUDA_MAX_TOKEN_CHUNK = 1024, 4096

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------- helpers
def _flatten_rows(loc_U: Tensor, scale_Up: Tensor, labels: Tensor, ignore_index: int):
    """[..., C] -> [n, C] keeping only rows whose label is not ignore_index (n may be 0)."""
    C = loc_U.shape[-1]
    loc_U, scale_Up, labels = loc_U.reshape(-1, C), scale_Up.reshape(-1, C), labels.reshape(-1)
    valid = labels != ignore_index
    if not bool(valid.all()):  # indexing copies rows (and scatters their grads back): skip if no-op
        loc_U, scale_Up, labels = loc_U[valid], scale_Up[valid], labels[valid]
    return loc_U, scale_Up, labels


def _compute_dtype(*xs: Tensor | None) -> torch.dtype:
    """float64 if an activation is float64, else float32 (bf16 inputs are upcast)."""
    return torch.float64 if any(x is not None and x.dtype == torch.float64 for x in xs) else torch.float32


def _as_threshold(thresholds: Tensor | float, dtype: torch.dtype, device) -> Tensor:
    if isinstance(thresholds, Tensor):
        return thresholds
    return torch.tensor(float(thresholds), dtype=dtype, device=device)


def _column_offset(b: Tensor | None, thr: Tensor, cols: slice | Tensor, dtype) -> Tensor:
    """b_k - C_k for the given columns ([cols], or 0-dim when b is None and C is a scalar)."""
    t = thr.to(dtype)
    off = -(t[cols] if thr.numel() > 1 else t.reshape(()))
    return off if b is None else b[cols].to(dtype) + off


# --------------------------------------------------------------------------- reference
def reference_ovr_loss(
    loc_U: Tensor,
    scale_Up: Tensor,
    W: Tensor,
    b_cls: Tensor | None,
    thresholds: Tensor | float,
    labels: Tensor,
    *,
    row_override: RowOverride | None = None,
    scale_floor: float = DEFAULT_SCALE_FLOOR,
    ignore_index: int = IGNORE_INDEX,
) -> Tensor:
    """The OvR loss exactly as written in SPEC 3, materialising [N, V] (tests only).

    loc_U, scale_Up: [N, C]; W: [V, C] (any float dtype); b_cls: [V] or None;
    thresholds: 0-dim or [V] (or a float); labels: [N] ints (ignore_index = no loss).
    row_override: (indices [R], rows [R, C]): rows[j] replaces W[indices[j]].
    Returns a 0-dim tensor (float32, float64 for float64 activations); 0.0 if no valid row.
    """
    lu, su, y = _flatten_rows(loc_U, scale_Up, labels, ignore_index)
    dt = _compute_dtype(lu, su)
    Wd = W.to(dt)
    if row_override is not None:
        idx, rows = row_override
        Wd = Wd.index_copy(0, idx, rows.to(dt))  # grads go to rows, and are 0 for W[idx]
    loc_S = lu.to(dt) @ Wd.T
    if b_cls is not None:
        loc_S = loc_S + b_cls.to(dt)
    scale_S = torch.clamp_min(su.to(dt) @ Wd.abs().T, scale_floor)
    thr = _as_threshold(thresholds, dt, lu.device).to(dt)
    log_p, log_1mp = ovr_log_probs(loc_S - thr, scale_S)
    onehot = torch.nn.functional.one_hot(y, Wd.shape[0]).bool()
    per_row = -torch.where(onehot, log_p, log_1mp).sum(dim=1)
    return per_row.sum() / max(1, y.numel())


# --------------------------------------------------------------------------- fused
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


_TAN_PI_8 = math.tan(math.pi / 8)


def _atan_unit(x: Tensor) -> Tensor:
    """atan(x) for x in [0, 1], Cephes' atanf (relative error < 2e-7, exact ~x near 0).

    Written as plain tensor ops so that torch.compile fuses it into the block kernel: the
    library atan2 is a call the compiler cannot inline and costs about twice as much."""
    big = x > _TAN_PI_8
    x = torch.where(big, (x - 1.0) / (x + 1.0), x)  # atan(x) = pi/4 + atan((x-1)/(x+1))
    x2 = x * x
    p = (((8.05374449538e-2 * x2 - 1.38776856032e-1) * x2 + 1.99777106478e-1) * x2 - 3.33329491539e-1) * x2 * x + x
    return torch.where(big, p + math.pi / 4, p)


def _block_kernel(Zb: Tensor, Sb: Tensor, Lb: Tensor, numel: int, floor: Tensor, grads: bool) -> None:
    """`_block_terms` in one pass over memory, for torch.compile (float32 blocks).

    Zb, Sb, Lb: whole 1-D block buffers, of which the first `numel` entries are the block
    (passing views instead would put their storage offsets and bases into the compiled
    graph's guards: a second compile for ragged blocks).

    Z holds z = loc_S - C, S the RAW scale; the floor (a 0-dim tensor: torch 2.13 reused a
    graph compiled for one Python-float floor for other values) is applied here. Writes
    L = log(1 - P) per element; if `grads`, S <- pi * d/dz and Z <- -pi * d/ds of -log(1 - P),
    floor mask included. Same formulas as `_block_terms`, with two changes that only a fused
    kernel makes cheap: log1p(-r) = log(w) + e/w with w = fl(1 - r) and e = (1 - w) - r its
    exact rounding error (Fast2Sum; one log instead of log and log1p), and the gradient
    divided by m = max(|z|, s) first, so z^2 never overflows.
    """
    Z, S, L = Zb[:numel], Sb[:numel], Lb[:numel]
    s = torch.clamp_min(S, floor)
    a = Z.abs()
    lo, hi = torch.minimum(a, s), torch.maximum(a, s)
    inv_hi = 1.0 / hi  # divisions are the costly flops here: two in all (measured 30% faster than five)
    ang = _atan_unit(lo * inv_hi)
    r = torch.where(s <= a, ang, math.pi / 2 - ang) * (1.0 / math.pi)  # atan2(s, |z|)/pi = min(P, 1-P)
    neg = Z < 0
    w = torch.where(neg, 1.0 - r, r)  # 1 - P
    e = torch.where(neg, (1.0 - w) - r, 0.0)
    zn, sn = Z * inv_hi, s * inv_hi
    un = zn * zn + sn * sn  # u / m^2, in [1, 2]
    inv_uw = 1.0 / (un * w)
    L.copy_(torch.log(w) + e * inv_uw * un)  # e / w
    if grads:
        k = inv_uw * inv_hi  # pi / (u theta), u = z^2 + s^2, theta = pi w
        gsn = torch.where(S >= floor, zn * k, 0.0)  # (read S before it is overwritten)
        S.copy_(sn * k)
        Z.copy_(gsn)


def _inductor_options(device_type: str) -> dict:
    """On CPU, the vector width inductor picks, written into its config: with `cpp.simdlen` unset inductor
    picks the width from ATEN_CPU_CAPABILITY, which its on-disk graph cache does not key on, so a kernel cached
    under one width (AVX-512) was reused under another (AVX2) and gave wrong losses (tests/test_loss.py,
    `test_the_compiled_kernel_cached_under_one_vector_width_is_not_reused_under_another`)."""
    if device_type != "cpu":
        return {}
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    bits = pick_vec_isa().bit_width()
    return {"cpp.simdlen": bits} if bits else {}


_compiled_kernels: dict = {}
_compile_error: list[str] = []  # set once when torch.compile failed: eager from then on


def _run_compiled_kernel(Zb: Tensor, Sb: Tensor, Lb: Tensor, numel: int, floor: Tensor, grads: bool) -> bool:
    """Run `_block_kernel` compiled; False if torch.compile is unusable (the first failure warns once, and
    every later call returns False at once). A failure may have written into the buffers: the caller
    recomputes the block before the eager kernel."""
    if _compile_error:
        return False
    try:  # torch.compile is lazy: compiling happens at the first call, inside this try
        fn = _compiled_kernels.get(Zb.device.type)
        if fn is None:
            logger.info("compiling the OvR block kernel with torch.compile (once; cached on disk)")
            fn = _compiled_kernels[Zb.device.type] = torch.compile(_block_kernel, dynamic=True, fullgraph=True,
                                                                   options=_inductor_options(Zb.device.type))
        fn(Zb, Sb, Lb, numel, floor, grads)
    except Exception as e:  # no C++ compiler / Triton, unsupported platform, ...
        _compile_error.append(f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}")
        warnings.warn(f"fused_ovr_loss: torch.compile of the block kernel failed ({_compile_error[0]}); "
                      f"using the eager kernel (slower elementwise part). Set {COMPILE_ENV}=0 to skip the attempt.",
                      RuntimeWarning, stacklevel=3)
        return False
    return True


# The default operand precision of the Triton sweep on CUDA, chosen by measurement (docs/mixed_precision.md)
CUDA_TRITON_GEMM = "bf16"


def resolve_gemm_precision(gemm_precision: str | None, backend: str = "torch", device_type: str = "cpu") -> str:
    """The argument, else $CAUSAL_ADAPTER_LOSS_GEMM, else CUDA_TRITON_GEMM for the Triton sweep on CUDA, "tf32"
    for the torch loop on CUDA, "fp32" elsewhere; a ValueError names the choices."""
    default = "fp32"
    if device_type == "cuda":
        default = CUDA_TRITON_GEMM if backend == "triton" else "tf32"
    value = gemm_precision or os.environ.get(GEMM_ENV) or default
    if value not in GEMM_PRECISIONS:
        source = "gemm_precision" if gemm_precision else GEMM_ENV
        raise ValueError(f"{source} must be one of {GEMM_PRECISIONS}, got {value!r}")
    return value


def resolve_backend(backend: str | None, dt: torch.dtype, device_type: str) -> str:
    """The argument, else $CAUSAL_ADAPTER_LOSS_BACKEND, else "triton" for float32 on CUDA when Triton imports,
    else "torch". A ValueError says why an asked-for Triton sweep cannot run."""
    source = "backend" if backend else BACKEND_ENV
    value = backend or os.environ.get(BACKEND_ENV)
    if value is None:
        return "triton" if device_type == "cuda" and dt == torch.float32 and _triton_sweep() is not None else "torch"
    if value not in BACKENDS:
        raise ValueError(f"{source} must be one of {BACKENDS}, got {value!r}")
    if value == "triton":
        if _triton_sweep() is None:
            raise ValueError(f"{source}='triton' needs the triton package (pip install triton)")
        if dt != torch.float32:
            raise ValueError(f"{source}='triton' computes in float32; float64 activations take backend='torch'")
        if device_type != "cuda" and not _triton_sweep().INTERPRETED:
            raise ValueError(f"{source}='triton' runs on CUDA tensors (got {device_type}); Triton's interpreter "
                             "runs it on CPU when TRITON_INTERPRET=1 is set before the first use (tests)")
    return value


def _triton_sweep():
    """modeling.ovr_triton, imported on first use (so that TRITON_INTERPRET set by a test applies), or None
    without Triton."""
    from . import ovr_triton  # lazy: Triton is optional, and its interpreter is chosen at import

    return ovr_triton if ovr_triton.available() else None


def use_compiled(compile: bool | None, dt: torch.dtype, n: int, V: int, device_type: str) -> bool:
    """compile=None (auto): float32 blocks of a large problem on CUDA, unless the environment
    says otherwise. Not automatic on CPU: there the kernel is 2.5x faster than the eager ops
    on the elementwise part, but end to end (GEMMs are ~90% of the time) the gain measured
    here stayed inside the machine's noise (-11% .. +12%) while the first compile costs ~35 s."""
    if dt != torch.float32:  # the polynomial atan is float32-accurate only; float64 stays eager
        return False
    env = os.environ.get(COMPILE_ENV)
    if compile is None and env in ("0", "1"):
        compile = env == "1"
    if compile is None:
        compile = device_type == "cuda" and n * V >= COMPILE_MIN_ELEMENTS
    return bool(compile) and not _compile_error


def _round_tf32(x: Tensor) -> Tensor:
    """float32 -> the nearest float32 with TF32's 10-bit mantissa (ties away from zero, as cvt.rna)."""
    return ((x.view(torch.int32) + 0x1000) & -0x2000).view(torch.float32)


def _gemm_operand(x: Tensor, gemm: str) -> Tensor:
    """A block GEMM's operand as the chosen precision reads it: bf16-rounded ("bf16"), TF32-rounded
    ("tf32" off CUDA: the same numbers TF32 tensor cores read; on CUDA the hardware rounds), else x.
    The product then accumulates in float32, as TF32 / bf16 tensor-core GEMMs do."""
    if gemm == "bf16":
        return x.to(torch.bfloat16).to(x.dtype)
    if gemm == "tf32" and x.device.type != "cuda":
        return _round_tf32(x)
    return x


@contextlib.contextmanager
def _tf32_matmuls(on: bool):
    """TF32 GEMMs on CUDA inside the block (restored after)."""
    if not on:
        yield
        return
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


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


def _override_correction(lu, su, W, b, thr, y, idx, rows, floor, dt) -> Tensor:
    """Sum over rows of [loss terms of columns idx with `rows`] - [same with base W rows].

    Plain autograd on [n, R] tensors (O(n R C)): gradients reach `rows`, loc_U, scale_Up,
    b_cls and thresholds; the base rows are detached (the fused pass zeroes W's grad there).
    """
    lu, su = lu.to(dt), su.to(dt)
    off = _column_offset(b, thr, idx, dt)
    is_target = y[:, None] == idx[None, :]

    def columns_loss(Wr: Tensor) -> Tensor:
        z = lu @ Wr.T + off
        s = torch.clamp_min(su @ Wr.abs().T, floor)
        log_p, log_1mp = ovr_log_probs(z, s)
        return -torch.where(is_target, log_p, log_1mp).sum()

    return columns_loss(rows.to(dt)) - columns_loss(W[idx].detach().to(dt))


def fused_ovr_loss(
    loc_U: Tensor,
    scale_Up: Tensor,
    W: Tensor,
    b_cls: Tensor | None,
    thresholds: Tensor | float,
    labels: Tensor,
    *,
    row_override: RowOverride | None = None,
    scale_floor: float = DEFAULT_SCALE_FLOOR,
    ignore_index: int = IGNORE_INDEX,
    vocab_chunk: int | None = None,
    token_chunk: int | None = None,
    memory_budget_mb: float | None = None,
    recompute: bool = False,
    compile: bool | None = None,
    gemm_precision: str | None = None,
    backend: str | None = None,
) -> Tensor:
    """Same value and gradients as `reference_ovr_loss`, never materialising [N, V].

    loc_U, scale_Up: [N, C] (leading dims are flattened); W: [V, C], any float dtype
    (e.g. bf16), trained only if W.requires_grad; b_cls: [V] or None; thresholds: 0-dim or
    [V] tensor (or a float), trained if it requires grad; labels: [N].
    row_override=(indices [R], rows [R, C]): rows[j] replaces W[indices[j]] (unique indices);
    gradients go to rows, never to W at those indices.
    vocab_chunk / token_chunk: block shape (default: from memory_budget_mb, which bounds the
    block working memory, default DEFAULT_MEMORY_BUDGET_MB). recompute=True: the forward
    computes the loss only and the backward makes a second sweep (slower, nothing stored).
    compile: run the elementwise part of each block as one torch.compile'd kernel (about 2.5x
    faster than the eager ops on that part; needs a C++ compiler on CPU, Triton on GPU;
    compiled once per process, cached on disk; falls back to eager with a warning).
    None (default): on CUDA for float32 when N x V >= COMPILE_MIN_ELEMENTS, never on CPU;
    the environment variable CAUSAL_ADAPTER_COMPILE_LOSS=0/1 overrides the default.
    gemm_precision: the block GEMMs of a float32 loss, one of GEMM_PRECISIONS: "fp32" (true float32),
    "tf32" (TF32 tensor cores on CUDA; elsewhere emulated by rounding the operands: the accuracy, not the
    speed), "bf16" (bf16 operands, float32 accumulation; in the torch loop emulated: the accuracy cost only).
    None: $CAUSAL_ADAPTER_LOSS_GEMM, else CUDA_TRITON_GEMM for the Triton sweep on CUDA, "tf32" for the
    torch loop on CUDA, "fp32" elsewhere (docs/mixed_precision.md has the measurements).
    backend: "triton" (modeling/ovr_triton.py: on-chip tiles, two launches per [2048, 2048] super-block;
    vocab_chunk / token_chunk / compile do not apply, memory_budget_mb bounds its scratch) or "torch";
    None: $CAUSAL_ADAPTER_LOSS_BACKEND, else "triton" for float32 on CUDA when Triton imports.
    Computes in float32 (float64 for float64 activations, always exact GEMMs and the torch loop). Returns a
    0-dim tensor on the device, with no host sync beyond one per sweep (none in the Triton sweep).
    """
    lu, su, y = _flatten_rows(loc_U, scale_Up, labels, ignore_index)
    dt = _compute_dtype(lu, su)
    thr = _as_threshold(thresholds, dt, lu.device)
    n, C = lu.shape
    V = W.shape[0]
    want_grads = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (lu, su, W, b_cls, thr)
    )
    device_type = lu.device.type
    backend = resolve_backend(backend, dt, device_type)
    esize = torch.finfo(dt).bits // 8
    w_temps = 1 + (W.dtype != dt) + 3 * bool(want_grads and W.requires_grad)
    on_gpu = device_type == "cuda" and backend == "torch"
    T, Vc = chunk_sizes(n, V, C, esize, w_temps, vocab_chunk, token_chunk,
                        memory_budget_mb or (CUDA_MEMORY_BUDGET_MB if on_gpu else None),
                        CUDA_MAX_TOKEN_CHUNK if on_gpu else MAX_TOKEN_CHUNK)
    idx = None if row_override is None else row_override[0].to(lu.device)
    plan = _Plan(dt, float(scale_floor), T, Vc, recompute or not want_grads, idx,
                 backend == "torch" and use_compiled(compile, dt, n, V, device_type),
                 resolve_gemm_precision(gemm_precision, backend, device_type), backend, memory_budget_mb)
    loss = _FusedOvR.apply(lu, su, W, b_cls, thr, y, plan)
    if row_override is not None:
        corr = _override_correction(lu, su, W, b_cls, thr, y, idx, row_override[1], scale_floor, dt)
        loss = loss + corr / max(1, n)
    return loss
