"""The one-vs-rest (OvR) classification loss over the whole vocabulary (SPEC section 3), the reference formula and
its fused chunked implementation; `modeling.loss` combines it with the regression loss.

Shapes: N token rows (the caller flattens batch x sequence), C causal size, V vocabulary rows.

    loc_S   = loc_U @ W.T + b_cls                          [N, V]
    scale_S = max(scale_Up @ |W|.T, scale_floor)           [N, V]
    P_ik    = 1/2 + atan((loc_S_ik - C_k) / scale_S_ik) / pi
    L_cls   = mean over rows with labels != ignore_index of
              -sum_k [y_ik log P_ik + (1 - y_ik) log(1 - P_ik)],   y = one_hot(labels)

`reference_ovr_loss` is this formula verbatim (it materialises [N, V]); `fused_ovr_loss`
gives the same value and gradients without ever holding more than one [T, Vc] block. This module holds the two
entry points; the chunked sweep is `ovr_fused` (in torch, or in Triton: `ovr_triton`), the choice of its backend,
GEMM precision and compiled kernel `ovr_backends`; their names stay importable from here.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..config import DEFAULT_SCALE_FLOOR, IGNORE_INDEX
from .cauchy import ovr_log_probs
from .ovr_backends import (
    BACKEND_ENV, BACKENDS, COMPILE_ENV, COMPILE_MIN_ELEMENTS, CUDA_TRITON_GEMM, GEMM_ENV, GEMM_PRECISIONS,
    _block_kernel, _compile_error, _compiled_kernels, _gemm_operand, _inductor_options, _run_compiled_kernel,
    _tf32_matmuls, _triton_sweep, resolve_backend, resolve_gemm_precision, use_compiled)
from .ovr_fused import (
    CUDA_MAX_TOKEN_CHUNK, CUDA_MEMORY_BUDGET_MB, DEFAULT_MEMORY_BUDGET_MB, MAX_TOKEN_CHUNK, MAX_VOCAB_CHUNK,
    MIN_VOCAB_CHUNK, _column_offset, _FusedOvR, _ovr_pass, _Plan, chunk_sizes)

# the names this module held before the fused sweep and its backends moved out, kept importable from here
__all__ = ["reference_ovr_loss", "fused_ovr_loss", "RowOverride", "_flatten_rows", "_compute_dtype", "_as_threshold",
           "BACKEND_ENV", "BACKENDS", "COMPILE_ENV", "COMPILE_MIN_ELEMENTS", "CUDA_TRITON_GEMM", "GEMM_ENV",
           "GEMM_PRECISIONS", "_block_kernel", "_compile_error", "_compiled_kernels", "_gemm_operand",
           "_inductor_options", "_run_compiled_kernel", "_tf32_matmuls", "_triton_sweep", "resolve_backend",
           "resolve_gemm_precision", "use_compiled", "CUDA_MAX_TOKEN_CHUNK", "CUDA_MEMORY_BUDGET_MB",
           "DEFAULT_MEMORY_BUDGET_MB", "MAX_TOKEN_CHUNK", "MAX_VOCAB_CHUNK", "MIN_VOCAB_CHUNK", "_column_offset",
           "_FusedOvR", "_ovr_pass", "_Plan", "chunk_sizes"]

RowOverride = tuple[Tensor, Tensor]  # (indices LongTensor [R], rows [R, C])


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


# --------------------------------------------------------------------------- fused (its sweep: `ovr_fused`)
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
