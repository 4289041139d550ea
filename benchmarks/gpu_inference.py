"""Inference on a GPU against the CPU, same adapter (needs CUDA; run where an accelerator is lent).

    python benchmarks/gpu_inference.py --corpus sunspots --steps 100

Trains `train`'s defaults for ``--steps`` on the GPU accelerate picks (or loads ``--adapter DIR``), then
reads the test prompts three ways: the CPU in float32 (how `causal-adapter predict` runs; the baseline),
the GPU in float32 and the GPU with the base in bfloat16 (`from_pretrained(..., device_map="cuda",
torch_dtype=torch.bfloat16)`). Per variant: `predict_values` (loc_Y, the 90% interval) and greedy
`generate` on the first prompts. Last line: ``RESULT gpu_fp32_max_rel=... gpu_bf16_max_rel=...
gpu_fp32_text_equal=k/n gpu_bf16_text_equal=k/n gpu_bf16_mae_ratio=...`` (max |loc_Y - CPU's| /
CPU's value_scale; texts equal to the CPU's; test MAE of the bf16 base / the CPU's).
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from common import train_run


def read(adapter: Path, prompts: list[str], targets: list[float], device: str, dtype, n_generate: int) -> dict:
    """predict_values and greedy generate of one variant."""
    from causal_adapter.saving.assets import load_base
    from causal_adapter.model import CausalModel

    base, tokenizer = load_base(None, "qwen2", "float32", 64, 2)
    model = CausalModel.from_pretrained(base, adapter, tokenizer=tokenizer, torch_dtype=dtype,
                                        device_map=None if device == "cpu" else device).eval()
    rows = model.predict_values(prompts, tokenizer=tokenizer)
    loc = torch.tensor([r["value"] for r in rows], dtype=torch.float64)
    out = model.generate(prompts[:n_generate], tokenizer=tokenizer, max_new_tokens=8)
    return {"loc": loc, "mae": float((loc - torch.tensor(targets, dtype=torch.float64)).abs().mean()),
            "texts": list(out.texts), "value_scale": float(model.action.value_scale),
            "upper_90": [r.get("upper_90") for r in rows]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--corpus", default="sunspots")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--adapter", default=None, help="an adapter trained on --corpus (default: train one)")
    parser.add_argument("--generate", type=int, default=8, help="prompts to generate from")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_inference.py needs CUDA (torch.cuda.is_available() is False)")
    from causal_adapter.data.corpora import build_corpus

    test = build_corpus(args.corpus)["test"]
    prompts, targets = list(test["prompt"]), list(test["target"])
    with tempfile.TemporaryDirectory() as tmp:
        adapter = Path(args.adapter) if args.adapter else train_run("no", args.steps, Path(tmp) / "run", args.corpus,
                                                                     "cuda")["adapter"]
        ref = read(adapter, prompts, targets, "cpu", None, args.generate)
        res = {"fp32": read(adapter, prompts, targets, "cuda", None, args.generate),
               "bf16": read(adapter, prompts, targets, "cuda", torch.bfloat16, args.generate)}
    print(f"{torch.cuda.get_device_name()}: {args.corpus}, {len(prompts)} test prompts; CPU float32 MAE {ref['mae']:.4g}")
    result = {}
    for name, r in res.items():
        rel = float((r["loc"] - ref["loc"]).abs().max()) / ref["value_scale"]
        same = sum(a == b for a, b in zip(r["texts"], ref["texts"]))
        print(f"  GPU {name}: MAE {r['mae']:.4g}, max |loc_Y - CPU| / value_scale {rel:.2e}, greedy texts equal "
              f"{same}/{len(ref['texts'])}; first: {prompts[0][-40:]!r} -> {r['texts'][0]!r} (CPU {ref['texts'][0]!r})")
        result.update({f"gpu_{name}_max_rel": f"{rel:.3g}", f"gpu_{name}_text_equal": f"{same}/{len(ref['texts'])}",
                       f"gpu_{name}_mae_ratio": f"{r['mae'] / ref['mae']:.4g}"})
    print("RESULT " + " ".join(f"{k}={v}" for k, v in result.items()))


if __name__ == "__main__":
    main()
