"""Memory of N adapters on one base (`CausalModel.load_adapter`) against N CausalModels, each with its own base.

    python benchmarks/multi_adapter_memory.py                # N = 1, 2, 4, 8; 4 layers of the Qwen2.5-0.5B shape
    python benchmarks/multi_adapter_memory.py --n 1 4 --layers 2

The adapters are LoRA r=8 (q/k/v/o/gate/up/down, train's recipe) plus the causal heads, each made distinct (its own
seed), saved once with `save_pretrained`, then loaded back: ``shared`` = `CausalModel.from_pretrained(base, A1)` +
`load_adapter(Ai, name_i)`; ``separate`` = one `CausalModel.from_pretrained(own base, Ai)` per adapter (what a user
without multi-adapter support does). Each (variant, N) runs in a process of its own and reports its peak resident
memory (ru_maxrss) minus the process's resident memory after its imports, and the bytes of the model's distinct
tensors. Base: the Qwen2.5-0.5B shape (hidden 896, vocabulary 151,936, tied) with --layers decoder layers, random
weights, float32, on CPU.

Ends with ONE line ``RESULT key=value ...`` (MiB per variant and N, and separate / shared at the largest N).
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

from common import build_base

NUM_TOKEN_ID = 151_665  # Qwen2.5's first reserved row


def make_adapters(directory: Path, n: int, layers: int) -> list[Path]:
    import torch

    from causal_adapter import CausalAdapterConfig, LoraSettings, get_causal_model

    base = build_base(layers)
    paths = []
    for i in range(n):
        model = get_causal_model(base, CausalAdapterConfig(num_token_id=NUM_TOKEN_ID, seed=i, lora=LoraSettings(r=8),
                                                           value_loc=float(i), value_scale=1.0))
        with torch.no_grad():
            for p in model.adapter_state_dict().values():
                if p.is_floating_point():
                    p.add_(0.01 * (i + 1))
        paths.append(model.save_pretrained(directory / f"a{i}"))
        model.unload()  # the next adapter starts from the plain base again
    return paths


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def child(variant: str, paths: list[str], layers: int) -> dict:
    import torch  # noqa: F401  (imports before the baseline)
    import transformers  # noqa: F401

    from causal_adapter import CausalModel

    start = _rss_mib()
    if variant == "shared":
        model = CausalModel.from_pretrained(build_base(layers), paths[0], adapter_name="a0")
        for i, p in enumerate(paths[1:], 1):
            model.load_adapter(p, f"a{i}")
        models = [model]
    else:
        models = [CausalModel.from_pretrained(build_base(layers), p) for p in paths]
    tensors = {t.data_ptr(): t.numel() * t.element_size()
               for m in models for t in list(m.parameters()) + list(m.buffers())}
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return {"peak_mib": peak - start, "tensor_mib": sum(tensors.values()) / 2**20}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], args.child[1:], args.layers)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        paths = [str(p) for p in make_adapters(Path(tmp), max(args.n), args.layers)]
        adapter_mib = sum(f.stat().st_size for f in Path(paths[0]).iterdir()) / 2**20
        print(f"one adapter directory: {adapter_mib:.1f} MiB on disk")
        results = {}
        for n in args.n:
            for variant in ("shared", "separate"):
                out = subprocess.run([sys.executable, __file__, "--layers", str(args.layers), "--child", variant,
                                      *paths[:n]], capture_output=True, text=True, check=True)
                results[variant, n] = json.loads(out.stdout.strip().splitlines()[-1])
                r = results[variant, n]
                print(f"N={n:2d} {variant:8s} peak +{r['peak_mib']:8.1f} MiB   tensors {r['tensor_mib']:8.1f} MiB")
    top = max(args.n)
    per_adapter = ((results["shared", top]["tensor_mib"] - results["shared", 1]["tensor_mib"]) / (top - 1)
                   if top > 1 else float("nan"))
    fields = {f"{v}_{n}_mib": f"{results[v, n]['peak_mib']:.0f}" for v, n in results}
    print("RESULT " + " ".join(f"{k}={v}" for k, v in fields.items())
          + f" added_adapter_tensor_mib={per_adapter:.1f} base_tensor_mib={results['shared', 1]['tensor_mib']:.0f}"
          + f" separate_vs_shared_at_{top}={results['separate', top]['peak_mib'] / results['shared', top]['peak_mib']:.2f}")


if __name__ == "__main__":
    main()
