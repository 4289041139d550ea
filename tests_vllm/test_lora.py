"""A LoRA adapter through vLLM's LoRA support: `export-vllm` writes its LoRA as peft's adapter folder (OUT/lora) next
to the linked base, one `vllm serve --enable-lora --lora-modules causal-lora=OUT/lora` serves it, and the requests
naming "causal-lora" write the tokens `causal-adapter generate` writes with the adapter (softmax mode, greedy); the
base's own name runs the heads without the LoRA, and writes other tokens."""
from __future__ import annotations

import json

import pytest
import torch
from conftest import SUNSPOTS, TEXTS, VllmServer, cli
from test_text import MAX_TOKENS, same_text

from causal_adapter.integrations.vllm.folder import HEADS_DIR, LORA_DIR, serve_flags

LORA_NAME = "causal-lora"
PROMPTS = SUNSPOTS + TEXTS


@pytest.fixture(scope="module")
def lora_toy(toy, tmp_path_factory):
    """d/run/adapter: 2 steps of `train --lora` on the toy base, its lora_B then pushed away from 0 (two steps leave
    the LoRA too close to a no-op for the base's name to write other tokens); d/out: `export-vllm` of it."""
    from safetensors.torch import load_file, save_file

    d = tmp_path_factory.mktemp("vllm_lora")
    cli("train", "--base", str(toy / "base"), "--dataset", "sunspots", "--max-steps", "2", "--max-train-samples", "48",
        "--max-eval-samples", "16", "--lora", "--lora-r", "4", "--no-plot", "--no-progress",
        "--output-dir", str(d / "run"))
    peft_file = d / "run" / "adapter" / "adapter_model.safetensors"  # the LoRA's one copy (save_pretrained)
    lora = load_file(str(peft_file))
    g = torch.Generator().manual_seed(0)
    lora = {k: v + 0.05 * torch.randn(v.shape, generator=g) if "lora_B" in k else v for k, v in lora.items()}
    save_file(lora, str(peft_file), metadata={"format": "pt"})
    cli("export-vllm", str(d / "run" / "adapter"), str(d / "out"))
    return d


@pytest.fixture(scope="module")
def server(lora_toy):
    s = VllmServer(lora_toy / "out", serve_flags(lora_toy / "out", LORA_NAME), lora_toy / "vllm_lora.log")
    yield s.wait_ready()
    s.close()


def completions(server, model: str) -> list[str]:
    client = server.client()
    return [client.completions.create(model=model, prompt=p, max_tokens=MAX_TOKENS, temperature=0).choices[0].text
            for p in PROMPTS]


def test_the_export_links_the_base_and_writes_the_lora_alone(toy, lora_toy):
    out = lora_toy / "out"
    assert (out / "model.safetensors").is_symlink()
    assert (out / "model.safetensors").resolve() == (toy / "base" / "model.safetensors").resolve()
    assert sorted(p.name for p in (out / LORA_DIR).iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert sorted(p.name for p in (out / HEADS_DIR).iterdir()) == ["causal_adapter_config.json",
                                                                   "causal_adapter_model.safetensors"]
    from safetensors import safe_open

    with safe_open(str(out / LORA_DIR / "adapter_model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert keys and all(k.startswith("base_model.model.model.layers.") and ("lora_A" in k or "lora_B" in k)
                        for k in keys)  # the LoRA's A and B, no weight of the base
    assert json.loads((out / LORA_DIR / "adapter_config.json").read_text())["r"] == 4
    lora_dir = (out / LORA_DIR).resolve()
    assert serve_flags(out, LORA_NAME) == ["--enable-lora", "--lora-modules", f"{LORA_NAME}={lora_dir}",
                                           "--max-lora-rank", "8"]  # the smallest rank vLLM accepts >= 4


def test_the_lora_module_writes_our_tokens(toy, lora_toy, server):
    got = completions(server, LORA_NAME)
    out = lora_toy / "generate_softmax.jsonl"
    cli("generate", *PROMPTS, "--base", str(toy / "base"), "--adapter", str(lora_toy / "run" / "adapter"),
        "--mode", "softmax", "--max-new-tokens", str(MAX_TOKENS), "--no-progress", "--output", str(out))
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [same_text(g, r) for g, r in zip(got, rows)] == [True] * len(PROMPTS), (got, [r["completion"] for r in rows])
    assert len(set(got)) > 1
    # the base's own name: the same heads on the backbone without the LoRA, other tokens (the LoRA is applied)
    assert [b != g for b, g in zip(completions(server, "causal"), got)] == [True] * len(PROMPTS)
