"""Adapter file size vs the base checkpoint size (goal: <= 1% for a frozen-backbone adapter).

    python benchmarks/adapter_size.py            # Qwen2.5-0.5B shape, built and saved for real
    python benchmarks/adapter_size.py --quick    # a 2-layer model at the 0.5B width (seconds)

The base is a random model at the Qwen2.5-0.5B shape (hidden 896, 24 layers, 14/2 heads,
intermediate 4864, vocab 151,936, tied), saved with `save_pretrained` in bf16 (the dtype
Qwen ships) and fp32. The Qwen2.5-7B head shape (hidden 3584, vocab 152,064, untied) is built
with 1 layer: its adapter is saved for real and compared with the full 28-layer bf16
checkpoint size computed from the parameter count (7.6 B parameters do not fit in RAM here).
"""
from __future__ import annotations

import argparse
import os
import tempfile

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from causal_adapter import CausalAdapterConfig, LoraSettings, get_causal_model


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


def qwen_config(hidden, layers, heads, kv_heads, inter, vocab, tie):
    return Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv_heads, tie_word_embeddings=tie)


def param_count(cfg: Qwen2Config) -> int:
    H, I, V, L = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_hidden_layers
    kv = cfg.num_key_value_heads * (H // cfg.num_attention_heads)
    layer = H * H + H + 2 * (H * kv + kv) + H * H + 3 * H * I + 2 * H
    return V * H * (1 if cfg.tie_word_embeddings else 2) + L * layer + H


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2 layers instead of 24 for the 0.5B shape")
    args = ap.parse_args()
    torch.manual_seed(0)
    layers = 2 if args.quick else 24
    cfg = qwen_config(896, layers, 14, 2, 4864, 151_936, True)
    result = {}
    with tempfile.TemporaryDirectory() as tmp:
        base = Qwen2ForCausalLM(cfg).eval()
        base.save_pretrained(f"{tmp}/base32")
        base.to(torch.bfloat16).save_pretrained(f"{tmp}/base16")
        base_fp32, base_bf16 = dir_bytes(f"{tmp}/base32"), dir_bytes(f"{tmp}/base16")
        base.to(torch.float32)
        rows = []
        for name, lora in (("frozen", None), ("lora_r8", LoraSettings(r=8))):
            model = get_causal_model(base, CausalAdapterConfig(num_token_id=151_665, lora=lora))
            model.save_pretrained(f"{tmp}/{name}")
            size = dir_bytes(f"{tmp}/{name}")
            rows.append((f"0.5B {name}", size, base_bf16, base_fp32))
            result[f"size_05b_{name}_mb"] = round(size / 2**20, 3)
            result[f"ratio_05b_{name}_vs_bf16"] = round(size / base_bf16, 5)
            result[f"ratio_05b_{name}_vs_fp32"] = round(size / base_fp32, 5)
            if lora is not None:
                from peft.tuners.tuners_utils import BaseTunerLayer

                for m in base.modules():  # take LoRA back out for the next variant
                    if isinstance(m, BaseTunerLayer):
                        m.delete_adapter("default")
        del base, model
        cfg7 = qwen_config(3584, 1, 28, 4, 18944, 152_064, False)
        base7 = Qwen2ForCausalLM(cfg7).eval()
        model7 = get_causal_model(base7, CausalAdapterConfig(num_token_id=151_665))
        model7.save_pretrained(f"{tmp}/a7")
        size7 = dir_bytes(f"{tmp}/a7")
        full7 = qwen_config(3584, 28, 28, 4, 18944, 152_064, False)
        bf16_7b = 2 * param_count(full7)
        rows.append(("7B-head frozen", size7, bf16_7b, 2 * bf16_7b))
        result["size_7b_frozen_mb"] = round(size7 / 2**20, 3)
        result["ratio_7b_frozen_vs_bf16"] = round(size7 / bf16_7b, 5)
    print(f"{'variant':<18}{'adapter MiB':>12}{'base bf16 MiB':>15}{'base fp32 MiB':>15}{'ratio bf16':>12}")
    for name, size, b16, b32 in rows:
        print(f"{name:<18}{size / 2**20:>12.2f}{b16 / 2**20:>15.1f}{b32 / 2**20:>15.1f}{size / b16:>12.4%}")
    if args.quick:
        print("(--quick: the 0.5B base has 2 of its 24 layers, so its sizes and ratios are not the real 0.5B figures)")
    print("RESULT " + " ".join(f"{k}={v}" for k, v in result.items()))


if __name__ == "__main__":
    main()
