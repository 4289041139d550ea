"""One adapter predicts and generates the same on a GPU as on the CPU (was benchmarks/gpu_inference.py; its
figures: docs/mixed_precision.md, "On a GPU"). Needs CUDA: skipped without it.

A toy adapter (`causal-adapter train` on sunspots, 8 steps, the embedded base at hidden 32, 1 layer) is read
three ways: the CPU in float32 (how `causal-adapter predict` runs; the reference), the GPU in float32 and the GPU
with the base loaded in bfloat16 (`from_pretrained(..., device_map="cuda", torch_dtype=torch.bfloat16)`).
`predict_values` on the test prompts and greedy `generate` on the first 8: float32 on the GPU gives the CPU's
values (to float32 summation order) and texts (the same words; each written number within 1e-3 value scales: a
summation order can move a last printed digit); the bf16 base gives finite values with ordered intervals and a
test MAE within 1.25x of the CPU's (the default head reads the recent values, which bf16 does not round)."""
from __future__ import annotations

import math

import pytest
import torch

from causal_adapter.commands.main import main
from causal_adapter.number_grammar import find_numbers

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (a GPU against the CPU)")

TINY = ["--tiny-hidden-size", "32", "--tiny-layers", "1"]


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_inference")
    assert main(["train", "--dataset", "sunspots", "--max-steps", "8", "--eval-steps", "0", "--output-dir",
                 str(out), "--no-plot", "--no-progress", "--cpu", *TINY]) == 0
    return out / "adapter"


def read(adapter, prompts, targets, device, dtype) -> dict:
    from causal_adapter.model import CausalModel
    from causal_adapter.saving.assets import load_base

    base, tokenizer = load_base(None, "qwen2", "float32", 32, 1)
    model = CausalModel.from_pretrained(base, adapter, tokenizer=tokenizer, torch_dtype=dtype,
                                        device_map=None if device == "cpu" else device).eval()
    rows = model.predict_values(prompts, tokenizer=tokenizer)
    loc = torch.tensor([r["value"] for r in rows], dtype=torch.float64)
    texts = list(model.generate(prompts[:8], tokenizer=tokenizer, max_new_tokens=8).texts)
    return {"loc": loc, "mae": float((loc - torch.tensor(targets, dtype=torch.float64)).abs().mean()),
            "texts": texts, "value_scale": float(model.action.head_scale), "rows": rows}


def words(text: str) -> str:
    """`text` with each number replaced by "#"."""
    out, at = [], 0
    for n in find_numbers(text):
        out += [text[at:n.start], "#"]
        at = n.end
    return "".join(out) + text[at:]


def test_gpu_predicts_and_generates_as_the_cpu(adapter):
    from causal_adapter.data.corpora import build_corpus

    test = build_corpus("sunspots")["test"]
    prompts, targets = list(test["prompt"]), list(test["target"])
    cpu = read(adapter, prompts, targets, "cpu", None)
    gpu = read(adapter, prompts, targets, "cuda", None)
    bf16 = read(adapter, prompts, targets, "cuda", torch.bfloat16)

    assert float((gpu["loc"] - cpu["loc"]).abs().max()) / cpu["value_scale"] < 1e-4
    for a, b in zip(gpu["texts"], cpu["texts"], strict=True):
        assert words(a) == words(b), (a, b)
        for x, y in zip(find_numbers(a), find_numbers(b)):
            assert abs(x.value - y.value) <= 1e-3 * cpu["value_scale"], (a, b)
    assert torch.isfinite(bf16["loc"]).all()
    for r in bf16["rows"]:
        if r.get("lower_90") is not None:
            assert r["lower_90"] <= r["value"] <= r["upper_90"] and math.isfinite(r["upper_90"])
    assert bf16["mae"] <= 1.25 * cpu["mae"]
