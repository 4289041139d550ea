"""How large is an adapter against its base checkpoint (goal: <= 1% for a frozen-backbone adapter)?

    python benchmarks/adapter_size.py     # one real shape of every supported family, seconds

Builds one real shape of every family on the meta device (no memory, no weights), wraps it with `get_causal_model`
as a user would, and sums the adapter's tensors (frozen heads; LoRA r=8 on the family's default targets; LoRA r=8
plus the fused MoE experts through peft's target_parameters) against the base's bf16 size (docs/families.md). The
0.5B adapter saved for real, the 7B head shape and the expert LoRA's step time were measured here up to commit
1c2f799 (docs/design-notes/benchmarks.md).
"""
from __future__ import annotations

import argparse

import torch
import transformers

from causal_adapter import CausalAdapterConfig, LoraSettings, get_causal_model


# One real checkpoint shape per family (config.json values). Qwen3.5: transformers' default configs
# (Qwen3_5TextConfig / Qwen3_5MoeTextConfig), whose docstrings name Qwen3.5-27B / Qwen3.5-35B-A3B.
_V, _V35 = 151_936, 248_320
FAMILY_SHAPES = {
    "qwen2": ("Qwen2.5-0.5B", "Qwen2", dict(vocab_size=_V, hidden_size=896, intermediate_size=4864,
                                            num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                                            tie_word_embeddings=True)),
    "qwen3": ("Qwen3-0.6B", "Qwen3", dict(vocab_size=_V, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                          num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                                          tie_word_embeddings=True)),
    "qwen2_moe": ("Qwen1.5-MoE-A2.7B", "Qwen2Moe", dict(
        vocab_size=_V, hidden_size=2048, intermediate_size=5632, num_hidden_layers=24, num_attention_heads=16,
        num_key_value_heads=16, moe_intermediate_size=1408, shared_expert_intermediate_size=5632, num_experts=60,
        num_experts_per_tok=4)),
    "qwen3_moe": ("Qwen3-30B-A3B", "Qwen3Moe", dict(
        vocab_size=_V, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8)),
    "qwen3_next": ("Qwen3-Next-80B-A3B", "Qwen3Next", dict(
        vocab_size=_V, hidden_size=2048, intermediate_size=5120, num_hidden_layers=48, num_attention_heads=16,
        num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
        linear_key_head_dim=128, linear_value_head_dim=128, moe_intermediate_size=512,
        shared_expert_intermediate_size=512, num_experts=512, num_experts_per_tok=10)),
    "qwen3_5": ("Qwen3_5TextConfig()", "Qwen3_5Text", dict(vocab_size=_V35)),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig()", "Qwen3_5MoeText", dict(vocab_size=_V35)),
}


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()

    from causal_adapter.modeling.families import EXPERT_LORA_PARAMETERS, FAMILIES

    print(f"{'family':<12}{'shape':<24}{'params B':>9}{'bf16 GiB':>9}{'frozen MiB':>11}{'%':>8}"
          f"{'LoRA r8 MiB':>12}{'%':>8}{'+experts MiB':>13}{'%':>8}")
    result = {}
    for family, (label, prefix, kw) in FAMILY_SHAPES.items():
        config = getattr(transformers, f"{prefix}Config")(**kw)
        model_cls = getattr(transformers, f"{prefix.removesuffix('Text')}ForCausalLM")
        sizes = []
        moe = FAMILIES[family].moe
        variants = [None, LoraSettings(r=8)] + ([LoraSettings(r=8, target_parameters=list(EXPERT_LORA_PARAMETERS))]
                                               if moe else [])
        for lora in variants:
            with torch.device("meta"):
                base = model_cls(config)
            n_base = sum(p.numel() for p in base.parameters())
            model = get_causal_model(base, CausalAdapterConfig(num_token_id=config.vocab_size - 1, lora=lora))
            sizes.append(sum(t.numel() * t.element_size() for t in model.adapter_state_dict().values()))
        bf16 = 2 * n_base
        cells = "".join(f"{b / 2**20:>{w}.1f}{b / bf16:>8.3%}" for b, w in zip(sizes, (11, 12, 13)))
        print(f"{family:<12}{label:<24}{n_base / 1e9:>9.2f}{bf16 / 2**30:>9.1f}{cells}")
        result[f"{family}_frozen_mb"] = round(sizes[0] / 2**20, 2)
        result[f"{family}_lora_mb"] = round(sizes[1] / 2**20, 2)
        if moe:
            result[f"{family}_lora_experts_mb"] = round(sizes[2] / 2**20, 1)
    print("(tensor bytes in float32; the safetensors file adds a header of a few KiB. LoRA targets: "
          "causal_adapter.modeling.families defaults; '+experts' adds peft target_parameters on the fused experts)")
    print("RESULT " + " ".join(f"{k}={v}" for k, v in result.items()))




if __name__ == "__main__":
    main()
