"""How the fused OvR loss's blocks run (`ovr_fused`): the sweep's backend ("torch" or "triton", `resolve_backend`), the
precision of its block GEMMs (`resolve_gemm_precision`, `_gemm_operand`, `_tf32_matmuls`), and the elementwise
block kernel compiled with torch.compile (`use_compiled`, `_run_compiled_kernel`: once per process, cached on disk,
eager from the first failure on). Each choice reads its argument, else an environment variable, else a default
measured per device."""
from __future__ import annotations

import contextlib
import logging
import math
import os
import warnings

import torch
from torch import Tensor

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
# on CPU for tests) or "torch" (the chunked loop of `ovr_fused`: CPU, float64, or CUDA without Triton).
BACKENDS = ("torch", "triton")
BACKEND_ENV = "CAUSAL_ADAPTER_LOSS_BACKEND"

logger = logging.getLogger("causal_adapter.modeling.ovr_loss")  # the fused loss's logger, by its public module


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
