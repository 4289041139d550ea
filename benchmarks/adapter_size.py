"""Adapter file size vs the base checkpoint size (goal: <= 1% for a frozen-backbone adapter).

    python benchmarks/adapter_size.py            # Qwen2.5-0.5B shape, built and saved for real
    python benchmarks/adapter_size.py --quick    # a 2-layer model at the 0.5B width (seconds)
    python benchmarks/adapter_size.py --families # one real shape of every supported family (meta device)

The base is a random model at the Qwen2.5-0.5B shape (hidden 896, 24 layers, 14/2 heads,
intermediate 4864, vocab 151,936, tied), saved with `save_pretrained` in bf16 (the dtype
Qwen ships) and fp32. The Qwen2.5-7B head shape (hidden 3584, vocab 152,064, untied) is built
with 1 layer: its adapter is saved for real and compared with the full 28-layer bf16
checkpoint size computed from the parameter count (7.6 B parameters do not fit in RAM here).

`--families` builds one real shape of every family on the meta device (no memory, no weights),
wraps it with `get_causal_model` exactly as a user would, and sums the adapter's tensors
(frozen heads; LoRA r=8 on the family's default targets; LoRA r=8 plus the fused MoE experts
through peft's target_parameters) against the base's bf16 size. It also times one training
step of a small MoE model with and without expert LoRA (what the experts cost in compute).
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


def families_table() -> None:
    """Adapter sizes for one real shape of every family, on the meta device."""
    import transformers

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
    result.update(expert_lora_step_cost())
    print("RESULT " + " ".join(f"{k}={v}" for k, v in result.items()))


def expert_lora_step_cost(steps: int = 5) -> dict:
    """Seconds per training step (forward + backward) of a small Qwen3-MoE, default LoRA vs + expert LoRA."""
    import time

    from causal_adapter.saving.assets import build_tiny_qwen
    from causal_adapter.modeling.families import EXPERT_LORA_PARAMETERS

    out = {}
    ids = torch.randint(0, 1000, (2, 128), generator=torch.Generator().manual_seed(0))
    for name, extra in (("default", []), ("experts", list(EXPERT_LORA_PARAMETERS))):
        base = build_tiny_qwen("qwen3_moe", hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
                               intermediate_size=256, vocab_size=1024, num_experts=32, num_experts_per_tok=4)
        lora = LoraSettings(r=8, target_parameters=extra)
        model = get_causal_model(base, CausalAdapterConfig(num_token_id=1020, lora=lora))
        trainable = sum(p.numel() for _, p in model.trainable_parameters())
        times = []
        for _ in range(steps + 1):
            t0 = time.perf_counter()
            model(ids, labels=ids).loss.backward()
            times.append(time.perf_counter() - t0)
        out[f"moe_step_s_{name}"] = round(min(times[1:]), 4)
        out[f"moe_trainable_{name}"] = trainable
    print(f"small Qwen3-MoE (H 256, 4 layers, 32 experts, top 4, batch 2 x 128): training step "
          f"{out['moe_step_s_default']:.3f} s with default LoRA ({out['moe_trainable_default']:,} trainable), "
          f"{out['moe_step_s_experts']:.3f} s with expert LoRA ({out['moe_trainable_experts']:,} trainable)")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2 layers instead of 24 for the 0.5B shape")
    ap.add_argument("--families", action="store_true", help="one real shape of every supported family")
    args = ap.parse_args()
    if args.families:
        return families_table()
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
