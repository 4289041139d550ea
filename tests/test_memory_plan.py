"""benchmarks/memory.py plan counts per-GPU memory from a model built on the meta device: its counts must
be the real model's (built on CPU with storage, independently summed), and its FSDP shard must be 1/N."""
import importlib.util
import math
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from causal_adapter import CausalAdapterConfig, LoraSettings, get_causal_model
from causal_adapter.saving.fsdp import fsdp_ignored_modules

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "memory.py"
# tied (as Qwen2.5-0.5B): the embedding and lm_head are one parameter, which must be counted once
SMALL = dict(model_type="qwen2", hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=1003, tie_word_embeddings=True)
N = 3  # does not divide the row counts: FSDP pads


def _load_bench():
    spec = importlib.util.spec_from_file_location("memory_bench", BENCH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the file executes
    spec.loader.exec_module(mod)
    return mod


def _real_model(r):
    kw = dict(SMALL)
    cfg = AutoConfig.for_model(kw.pop("model_type"), **kw)
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)  # real storage, on CPU
    lora = LoraSettings(r=r, alpha=2 * r) if r else None
    return get_causal_model(base, CausalAdapterConfig(num_token_id=1002, lora=lora))


def test_counts_equal_the_real_model_and_fsdp_shards_are_one_nth():
    mp = _load_bench()
    for r in (None, 4):
        meta_model, cfg = mp.build(SMALL, r, num_token_id=1002)
        assert next(meta_model.parameters()).device.type == "meta"
        c = mp.count(meta_model, [N])
        real = _real_model(r)
        params = list(real.parameters())  # each parameter once (the tied weight too)
        assert c.total_numel == sum(p.numel() for p in params)
        assert c.base_bytes + c.lora_bytes + c.heads_bytes == sum(p.numel() * p.element_size() for p in params)
        assert c.trainable_numel == sum(p.numel() for p in params if p.requires_grad)
        heads = {id(p) for m in fsdp_ignored_modules(real) for p in m.parameters()}
        assert c.heads_numel == sum(p.numel() for p in params if id(p) in heads)
        assert c.lora_numel == sum(p.numel() for n, p in real.named_parameters() if "lora_" in n)
        assert (c.lora_numel > 0) == bool(r)
        base_params = [p for p in params if id(p) not in heads and not p.requires_grad]
        assert c.base_bytes == sum(p.numel() * p.element_size() for p in base_params)

        # FSDP: one rank holds 1/N of the frozen base, up to the padding of dim 0 (< one row per parameter)
        shard = c.fsdp_base_shard_bytes[N]
        pad = sum((math.ceil(p.shape[0] / N) * N - p.shape[0]) * (p.numel() // p.shape[0]) * p.element_size()
                  for p in base_params)
        assert c.base_bytes / N <= shard <= c.base_bytes / N + pad / N
        assert shard < c.base_bytes / N + sum(p[0].numel() * p.element_size() for p in base_params)

        act = mp.activation_bytes(cfg, c, 256, bool(r), True, r or 0)["total"]
        rows = {e: mp.per_gpu(c, e, 1 if e == "QLoRA" else N, act) for e in mp.ENGINES}
        trainable_head_bytes = sum(p.numel() * p.element_size() for p in params if id(p) in heads and p.requires_grad)
        assert rows["DDP"]["base"] + rows["DDP"]["adapter"] == c.base_bytes + c.heads_bytes + c.lora_bytes
        assert rows["FSDP"]["base"] == shard + (c.heads_bytes - trainable_head_bytes)
        # the heads are replicated under FSDP (whole on every rank), LoRA is sharded
        assert rows["FSDP"]["adapter"] == trainable_head_bytes + 4 * c.fsdp_lora_shard_numel.get(N, 0)
        assert rows["FSDP"]["adapter"] < rows["DDP"]["adapter"] or not r
        # trainable parameters are fp32 (heads, LoRA on a bf16 base): their grads as large, AdamW's m and v twice
        assert all(p.dtype == torch.float32 for p in params if p.requires_grad)
        for e in ("DDP", "FSDP", "QLoRA"):
            grads = rows[e]["adapter"] * (2 if e == "DDP" else 1)  # DDP: + the reducer's bucket copy
            assert (rows[e]["grads"], rows[e]["optim"]) == (grads, 2 * rows[e]["adapter"]), e
        # ZeRO-3 partitions everything: 2 + 2 + 12 bytes per trainable, 2 per frozen parameter, over N
        z = rows["ZeRO-3"]
        assert z["base"] + z["adapter"] + z["grads"] + z["optim"] == _approx_sum(
            2 * (c.total_numel - c.trainable_numel) / N, 16 * c.trainable_numel / N)
        for row in rows.values():
            assert row["total"] == sum(v for k, v in row.items() if k not in ("total", "heads_replicated"))


def _approx_sum(*parts):
    """Sum of the ideal parts; the script rounds each of its four ZeRO-3 figures up (< 1 byte each)."""
    import pytest

    return pytest.approx(sum(parts), abs=4)
