"""Helpers shared by the GPU benchmarks (`ovr_loss.py --device cuda`, `train_step.py --device cuda`,
`loss_precision.py`): synchronised best-of-k timing, the CUDA allocator's peak above a starting point, the
fused loss's backend / GEMM keywords, and one line naming the machine. Not a benchmark itself.

Every function also runs on CPU (no synchronisation, no allocator statistics: memory is None there), so
the GPU code paths can be smoke-tested on a machine without one.
"""
from __future__ import annotations

import gc
import inspect
import time
from typing import Callable

MIB = 2**20


def synchronize(device) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def best_time(step: Callable[[], object], device, warmup: int = 2, repeats: int = 5,
              before_each: Callable[[], None] | None = None) -> tuple[float, list[float]]:
    """(fastest, all) wall seconds of `step` over `repeats` calls after `warmup` untimed ones, the device
    synchronised before and after each call; `before_each` (e.g. dropping gradients) runs untimed."""
    for _ in range(warmup):
        if before_each:
            before_each()
        step()
    times = []
    for _ in range(repeats):
        if before_each:
            before_each()
        synchronize(device)
        t = time.perf_counter()
        step()
        synchronize(device)
        times.append(time.perf_counter() - t)
    return min(times), times


class PeakMemory:
    """The CUDA allocator's peak above what was allocated at `start()` (bytes; None off CUDA).

    start(): collect garbage, reset the peak statistics and note the current allocation;
    extra(): torch.cuda.max_memory_allocated() since then minus that allocation."""

    def __init__(self, device):
        import torch

        self.cuda = torch.device(device).type == "cuda"
        self.device = device
        self.base = 0

    def start(self) -> None:
        import torch

        gc.collect()
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)

    def extra(self) -> int | None:
        import torch

        if not self.cuda:
            return None
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device) - self.base


def free_device_memory(device) -> None:
    """Drop cached blocks after a variant (and after an out-of-memory error)."""
    import torch

    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def is_oom(e: BaseException) -> bool:
    import torch

    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def ovr_loss_kwargs(backend: str | None, gemm: str | None) -> dict:
    """Keywords of `fused_ovr_loss` for a backend ("torch" / "triton" / None = the library's default) and a
    GEMM precision (None = the default). A RuntimeError when the loss has no `backend` argument yet and
    one other than "torch" is asked for (before the Triton kernel landed, "torch" was the only path)."""
    from causal_adapter.modeling.loss import fused_ovr_loss

    kw: dict = {"gemm_precision": gemm}
    if backend is not None:
        if "backend" in inspect.signature(fused_ovr_loss).parameters:
            kw["backend"] = backend
        elif backend != "torch":
            raise RuntimeError(f"fused_ovr_loss has no backend argument: backend={backend!r} is not available")
    return kw


def triton_status(device) -> str:
    """Why the Triton backend cannot run here, or "" when it can be tried."""
    import torch

    if torch.device(device).type != "cuda":
        return "needs CUDA (the Triton kernel runs on CPU only under TRITON_INTERPRET=1, in the tests)"
    try:
        ovr_loss_kwargs("triton", None)
    except RuntimeError as e:
        return str(e)
    return ""


def machine_line(device) -> str:
    """One line: the device, torch / triton / transformers versions."""
    import torch

    parts = [f"torch {torch.__version__}"]
    for name in ("triton", "transformers", "peft", "accelerate", "liger_kernel", "cut_cross_entropy"):
        try:
            from importlib.metadata import version

            parts.append(f"{name} {version(name.replace('_', '-'))}")
        except Exception:
            parts.append(f"{name} -")
    if torch.device(device).type == "cuda":
        p = torch.cuda.get_device_properties(device)
        dev = f"{p.name} ({p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs)"
    else:
        dev = f"CPU ({torch.get_num_threads()} threads)"
    return f"device: {dev}; " + ", ".join(parts)
