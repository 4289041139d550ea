"""Tile and super-block shapes of the Triton OvR sweep (modeling/ovr_triton.py) on a GPU: forward + backward of
`fused_ovr_loss(backend="triton")` at the 0.5B head (V = 151,936, C = 896, W bf16, b_cls trained), per variant
of `ovr_triton.Blocks`, with the extra memory against the limit (the gradients + 32 MiB).

    python benchmarks/ovr_blocks.py                                   # the defaults and a few neighbours
    python benchmarks/ovr_blocks.py --variants '{"BK": 128}' '{"rows": 1024}'

Each variant goes through $CAUSAL_ADAPTER_OVR_BLOCKS (JSON over the defaults). Best of 5 after 2 warm-ups,
synchronised; ends with one line RESULT key=value ... (ms and MiB per variant, the best under the limit).
Measured on an H200 (docs/mixed_precision.md): the defaults 45-54 ms, BK=128 58 ms, stages=4 59 ms.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import time

import torch

NEIGHBOURS = ['{}', '{"BK": 128}', '{"stages": 4}', '{"BV": 128, "warps": 8}', '{"rows": 1024}',
              '{"scratch_bytes": 16777216}']


def inputs(n: int, V: int, C: int, device: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    loc_U = (torch.randn(n, C, generator=g) * 5).to(device).requires_grad_()
    scale_Up = (torch.rand(n, C, generator=g) * 10 + 5).to(device).requires_grad_()
    W = (torch.randn(V, C, generator=g) * 0.03).to(device, torch.bfloat16)
    b_cls = (torch.randn(V, generator=g) * 0.5).to(device).requires_grad_()
    labels = torch.randint(0, V, (n,), generator=g).to(device)
    return loc_U, scale_Up, W, b_cls, torch.tensor(100.0, device=device), labels


def measure(args, repeats: int = 5) -> tuple[float, float]:
    """(best ms, extra MiB above the allocation before the call, the returned gradients included)."""
    from causal_adapter.modeling.loss import fused_ovr_loss

    trained = [t for t in args if isinstance(t, torch.Tensor) and t.requires_grad]

    def step():
        for t in trained:
            t.grad = None
        fused_ovr_loss(*args, backend="triton").backward()

    for _ in range(2):
        step()
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        step()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    for t in trained:
        t.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return best * 1e3, (torch.cuda.max_memory_allocated() - base) / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", nargs="*", default=NEIGHBOURS, help="JSON objects of Blocks fields")
    ap.add_argument("--rows", type=int, default=8192, help="N")
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--hidden", type=int, default=896)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("ovr_blocks.py times the Triton sweep on a GPU (no CUDA device here)")
    from causal_adapter.modeling import ovr_triton

    n, V, C = args.rows, args.vocab, args.hidden
    tensors = inputs(n, V, C, "cuda")
    limit = (2 * n * C * 4 + V * 4) / 2**20 + 32
    print(f"{torch.cuda.get_device_name()}: N={n} V={V} C={C}; defaults {dataclasses.asdict(ovr_triton.DEFAULT_BLOCKS)}")
    result, best = {}, None
    for i, text in enumerate(args.variants):
        os.environ[ovr_triton.BLOCKS_ENV] = text
        try:
            ms, mib = measure(tensors)
        except Exception as e:  # a shape that does not fit (shared memory) is reported, not fatal
            print(f"{text:40s} failed: {type(e).__name__}: {str(e).splitlines()[0]}")
            result[f"v{i}"] = "failed"
            continue
        ok = mib <= limit
        print(f"{text:40s} {ms:8.2f} ms  extra {mib:7.1f} MiB  {'ok' if ok else 'OVER'} (limit {limit:.1f})")
        result[f"v{i}_ms"], result[f"v{i}_mib"] = round(ms, 2), round(mib, 1)
        if ok and (best is None or ms < best[1]):
            best = (i, ms)
    os.environ.pop(ovr_triton.BLOCKS_ENV, None)
    if best is not None:
        print(f"best under the limit: {args.variants[best[0]]} ({best[1]:.2f} ms)")
        result["best"] = f"v{best[0]}"
    print("RESULT " + " ".join(f"{k}={v}" for k, v in result.items()))


if __name__ == "__main__":
    main()
