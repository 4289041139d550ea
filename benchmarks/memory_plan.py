"""Per-GPU memory of a training run, for planning: Qwen2.5-7B / 32B / 72B and Qwen3-235B-A22B shapes
under DDP, FSDP (full shard, heads replicated), DeepSpeed ZeRO-3 and QLoRA, with and without LoRA.

    python benchmarks/memory_plan.py                              # 8 GPUs, micro-batch 1 x 4096 tokens
    python benchmarks/memory_plan.py --gpus 16 --seq 8192 --shapes Qwen2.5-72B
    python benchmarks/memory_plan.py --no-checkpointing           # activations without checkpointing

What is COUNTED and what is ESTIMATED
* Counted: every parameter. The real transformers model (`Qwen2ForCausalLM` / `Qwen3MoeForCausalLM`)
  is built on the meta device (shapes and dtypes, no storage) from the config numbers below, wrapped
  by `get_causal_model` (heads, and LoRA through peft), and each figure is a sum over
  `named_parameters()`: numel x the element size of the dtype the parameter has (bf16 base, fp32
  heads and LoRA), split into frozen base / LoRA / heads. Which parameters FSDP leaves replicated
  is read from `FSDP_IGNORED_MODULES`; FSDP shards are counted per parameter as FSDP2 cuts them
  (dim 0 padded to a multiple of N); the root unit (embedding, final norm, lm_head, held whole
  from forward to backward) and the largest decoder layer are counted from the modules.
* Rules applied to the counted numbers (stated, not measured): gradients = trainable parameters in
  their dtype (DDP: one more copy in the reducer's buckets, `gradient_as_bucket_view=False`);
  AdamW = fp32 m and v (8 bytes per trainable parameter); DeepSpeed ZeRO-3 in bf16 = 2 bytes per
  parameter, 2 per gradient and 12 per trainable parameter for the fp32 master + m + v, all divided by
  N (the ZeRO paper's accounting; DeepSpeed casts the whole model, heads included, to bf16);
  QLoRA = the product's recipe (`bnb_config("4bit")`: NF4 with double quantisation, lm_head
  skipped, then peft's `prepare_model_for_kbit_training`, which casts every parameter that is not
  4-bit to fp32): the weight of each module whose type is exactly `nn.Linear` in the backbone, but
  lm_head (what transformers' `replace_with_bnb_linear` replaces), takes ceil(n/2) bytes + one
  uint8 absmax per 64 values + one fp32 absmax per 256 blocks; everything else fp32.
* "gathered" (transient full parameters): FSDP = the root unit (bf16) + 2 decoder layers (the one
  computing and the one prefetched, in bf16, FSDP's mixed-precision param dtype); ZeRO-3 = lm_head's
  weight (W_cls, which the heads read outside lm_head's forward: gathered) + 2 decoder layers;
  QLoRA = one dequantised bf16 copy of the largest 4-bit weight; DDP = 0. The sizes are counted;
  that 2 layers are live at once is an assumption (DeepSpeed's `stage3_max_live_parameters`
  and FSDP's prefetch decide it).
* Activations are ESTIMATED (meta tensors have no memory, and no step runs here), by a formula per
  decoder layer per token, bf16, SDPA/flash attention (no s x s scores kept):
      dense:  2 bytes x (4h + 2q + 2kv + 4I)                   h hidden, q = heads x head_dim,
      MoE:    2 bytes x (4h + 2q + 2kv + k(h + 4I_e)) + 4E      kv = kv_heads x head_dim, I_e expert size,
                                                               k experts per token, E experts (fp32 router)
  (the saved inputs of the two RMSNorms, of q/k/v, SDPA's q, k, v and output, the MLP's gate, up,
  silu(gate) and product), + LoRA's r-wide intermediates (2r bytes per adapted module, counted).
  With gradient checkpointing (the default here; `--no-checkpointing`) a layer keeps only its input
  (2h bytes) and one layer is recomputed at a time. A frozen backbone runs under no_grad and keeps
  none. The heads: z in bf16 and fp32, loc_U and scale_U in fp32 = (6h + 8C) bytes per token, plus
  the fused OvR loss's working budget (`DEFAULT_MEMORY_BUDGET_MB`). Not included: the CUDA context
  and allocator fragmentation (typically 1-3 GiB), communication buffers of FSDP / DeepSpeed.

Ends with ONE line ``RESULT key=value ...``.
"""
from __future__ import annotations

import argparse
import math
import os
import re
from dataclasses import dataclass, field

import torch
from torch import nn

GIB = 1024 ** 3
NUM_TOKEN_ID = 151_665  # len(Qwen2.5 / Qwen3 tokenizer): the first reserved embedding row, what `<NUM>` takes

# Config numbers, from each checkpoint's config.json on the hub (huggingface.co/Qwen/<name>/blob/main/config.json):
SHAPES: dict[str, dict] = {
    "Qwen2.5-7B": dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152_064, tie_word_embeddings=False),
    "Qwen2.5-32B": dict(model_type="qwen2", hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
                        num_attention_heads=40, num_key_value_heads=8, vocab_size=152_064, tie_word_embeddings=False),
    "Qwen2.5-72B": dict(model_type="qwen2", hidden_size=8192, intermediate_size=29568, num_hidden_layers=80,
                        num_attention_heads=64, num_key_value_heads=8, vocab_size=152_064, tie_word_embeddings=False),
    "Qwen3-235B-A22B": dict(model_type="qwen3_moe", hidden_size=4096, intermediate_size=12288,
                            moe_intermediate_size=1536, num_experts=128, num_experts_per_tok=8,
                            decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=94,
                            num_attention_heads=64, num_key_value_heads=4, head_dim=128, vocab_size=151_936,
                            tie_word_embeddings=False),
}
ENGINES = ("DDP", "FSDP", "ZeRO-3", "QLoRA")


def build(shape: dict, lora_r: int | None, num_token_id: int = NUM_TOKEN_ID):
    """The CausalModel for `shape` on the meta device: a real transformers model, no storage."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from causal_adapter import CausalAdapterConfig, LoraSettings, get_causal_model

    kw = dict(shape)
    cfg = AutoConfig.for_model(kw.pop("model_type"), **kw)
    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    lora = LoraSettings(r=lora_r, alpha=2 * lora_r) if lora_r else None
    return get_causal_model(base, CausalAdapterConfig(num_token_id=num_token_id, lora=lora)), cfg


def _nbytes(p: torch.Tensor) -> int:
    return p.numel() * p.element_size()


def _shard_numel(p: torch.Tensor, n: int) -> int:
    """Elements of one rank's FSDP2 shard: dim 0 cut in n chunks of ceil(rows / n) (the last padded)."""
    if p.dim() == 0:
        return p.numel()
    return math.ceil(p.shape[0] / n) * (p.numel() // p.shape[0])


def _nf4_bytes(n: int) -> int:
    """bitsandbytes NF4 with double quantisation: 2 values a byte, a uint8 absmax per 64-value block,
    an fp32 absmax per 256 blocks."""
    blocks = math.ceil(n / 64)
    return math.ceil(n / 2) + blocks + 4 * math.ceil(blocks / 256)


@dataclass
class Counted:
    """Figures counted from one wrapped model's parameters (bytes unless *_numel)."""
    total_numel: int = 0
    base_numel: int = 0  # frozen, not a head
    base_bytes: int = 0
    lora_numel: int = 0
    lora_bytes: int = 0
    heads_numel: int = 0  # all head parameters (trainable or not)
    heads_bytes: int = 0
    heads_trainable_numel: int = 0
    heads_frozen_bytes: int = 0
    trainable_numel: int = 0
    trainable_bytes: int = 0
    fsdp_base_shard_bytes: dict = field(default_factory=dict)  # n -> bytes of one rank's frozen shards
    fsdp_lora_shard_numel: dict = field(default_factory=dict)
    root_numel: int = 0  # FSDP root unit: not in a decoder layer, not a head
    lm_head_numel: int = 0
    max_layer_numel: int = 0
    layers: int = 0
    lora_modules_per_layer: int = 0
    qlora_quantized_bytes: int = 0
    qlora_other_numel: int = 0  # frozen, not 4-bit: fp32 after prepare_model_for_kbit_training
    qlora_max_linear_numel: int = 0


def head_prefixes() -> tuple[str, ...]:
    from causal_adapter.saving.fsdp import FSDP_IGNORED_MODULES

    return tuple(FSDP_IGNORED_MODULES.split("|"))


def count(model, gpus: list[int]) -> Counted:
    """Walk the wrapped model's parameters (each once: tied weights are one parameter)."""
    heads = head_prefixes()
    c = Counted()
    inner_lm = model.backbone.get_output_embeddings()
    lm_ids = {id(p) for p in inner_lm.parameters()}
    layer_of: dict[int, int] = {}
    layer_numel: dict[int, int] = {}
    layer_modules = [m for m in model.backbone.modules() if type(m).__name__.endswith("DecoderLayer")]
    c.layers = len(layer_modules)
    for i, m in enumerate(layer_modules):
        for p in m.parameters():
            layer_of[id(p)] = i
        layer_numel[i] = sum(p.numel() for p in m.parameters())
    c.max_layer_numel = max(layer_numel.values(), default=0)
    if layer_modules:
        c.lora_modules_per_layer = sum(1 for n, _ in layer_modules[0].named_modules() if n.endswith("lora_A"))
    # the 4-bit weights: modules whose type is exactly nn.Linear in the backbone, lm_head skipped, not LoRA's
    quantized = {}
    for name, m in model.backbone.named_modules():
        if type(m) is nn.Linear and m is not inner_lm and ".lora_" not in name and not m.weight.requires_grad:
            quantized[id(m.weight)] = m.weight
    seen = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            continue
        seen.add(id(p))
        n, b = p.numel(), _nbytes(p)
        c.total_numel += n
        if p.requires_grad:
            c.trainable_numel += n
            c.trainable_bytes += b
        if name.split(".")[0] in heads:
            c.heads_numel += n
            c.heads_bytes += b
            c.heads_trainable_numel += n if p.requires_grad else 0
            c.heads_frozen_bytes += 0 if p.requires_grad else b
            continue
        if p.requires_grad:  # trainable inside the backbone: LoRA
            c.lora_numel += n
            c.lora_bytes += b
            for g in gpus:
                c.fsdp_lora_shard_numel[g] = c.fsdp_lora_shard_numel.get(g, 0) + _shard_numel(p, g)
        else:
            c.base_numel += n
            c.base_bytes += b
            for g in gpus:
                c.fsdp_base_shard_bytes[g] = c.fsdp_base_shard_bytes.get(g, 0) + _shard_numel(p, g) * p.element_size()
            if id(p) in quantized:
                c.qlora_quantized_bytes += _nf4_bytes(n)
                c.qlora_max_linear_numel = max(c.qlora_max_linear_numel, n)
            else:
                c.qlora_other_numel += n
        if id(p) not in layer_of:
            c.root_numel += n
        if id(p) in lm_ids:
            c.lm_head_numel += n
    return c


def activation_bytes(cfg, c: Counted, tokens: int, lora: bool, checkpointing: bool, lora_r: int) -> dict:
    """ESTIMATED activation bytes of one micro-batch of `tokens` tokens (formula in the module doc)."""
    from causal_adapter.modeling.loss import DEFAULT_MEMORY_BUDGET_MB

    h = cfg.hidden_size
    hd = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    if getattr(cfg, "num_experts", 0):
        k, ie, e = cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.num_experts
        per_tok = 2 * (4 * h + 2 * q + 2 * kv + k * (h + 4 * ie)) + 4 * e
    else:
        per_tok = 2 * (4 * h + 2 * q + 2 * kv + 4 * cfg.intermediate_size)
    per_tok += 2 * lora_r * c.lora_modules_per_layer if lora else 0
    heads = tokens * (6 * h + 8 * h) + DEFAULT_MEMORY_BUDGET_MB * 2 ** 20  # C = H (the default)
    if not lora:
        backbone = 0  # frozen backbone: no_grad, nothing kept
    elif checkpointing:
        backbone = tokens * (2 * h * c.layers + per_tok)
    else:
        backbone = tokens * per_tok * c.layers
    return {"backbone": backbone, "heads": heads, "total": backbone + heads}


def per_gpu(c: Counted, engine: str, n: int, act: int) -> dict:
    """Bytes held by one GPU under `engine` with `n` GPUs (QLoRA: one GPU)."""
    t_heads = c.heads_trainable_numel
    if engine == "DDP":
        row = dict(base=c.base_bytes + c.heads_frozen_bytes, adapter=c.trainable_bytes,
                   grads=2 * c.trainable_bytes, optim=8 * c.trainable_numel, gathered=0)
    elif engine == "FSDP":
        lora_shard = c.fsdp_lora_shard_numel.get(n, 0)
        root_full = 2 * c.root_numel + 2 * 2 * c.max_layer_numel  # bf16 (FSDP mixed precision)
        row = dict(base=c.fsdp_base_shard_bytes[n] + c.heads_frozen_bytes, adapter=4 * lora_shard + 4 * t_heads,
                   grads=4 * lora_shard + 4 * t_heads, optim=8 * (lora_shard + t_heads), gathered=root_full)
    elif engine == "ZeRO-3":
        frozen = c.total_numel - c.trainable_numel
        row = dict(base=math.ceil(2 * frozen / n), adapter=math.ceil(2 * c.trainable_numel / n),
                   grads=math.ceil(2 * c.trainable_numel / n), optim=math.ceil(12 * c.trainable_numel / n),
                   gathered=2 * c.lm_head_numel + 2 * 2 * c.max_layer_numel)
    elif engine == "QLoRA":
        row = dict(base=c.qlora_quantized_bytes + 4 * c.qlora_other_numel + c.heads_frozen_bytes,
                   adapter=c.trainable_bytes, grads=c.trainable_bytes, optim=8 * c.trainable_numel,
                   gathered=2 * c.qlora_max_linear_numel)
    else:
        raise ValueError(engine)
    row["act"] = act
    row["total"] = sum(row.values())
    row["heads_replicated"] = (4 * t_heads * (1 + 1 + 2)) if engine in ("DDP", "FSDP", "QLoRA") else 0
    return row


def plan(name: str, shape: dict, gpus: int, lora_r: int | None, tokens: int, checkpointing: bool) -> dict:
    """Counted figures and per-GPU bytes of every engine for one shape, one adapter setting."""
    model, cfg = build(shape, lora_r)
    c = count(model, [gpus])
    act = activation_bytes(cfg, c, tokens, bool(lora_r), checkpointing, lora_r or 0)
    rows = {e: per_gpu(c, e, 1 if e == "QLoRA" else gpus, act["total"]) for e in ENGINES}
    return {"name": name, "lora": lora_r, "counted": c, "act": act, "rows": rows, "gpus": gpus}


def _g(b: float) -> str:
    return f"{b / GIB:.1f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, default=8, help="N GPUs for DDP / FSDP / ZeRO-3 (QLoRA: one GPU)")
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--lora-r", type=int, default=16)
    ap.add_argument("--no-checkpointing", action="store_true", help="activations without gradient checkpointing")
    ap.add_argument("--gpu-gib", type=float, default=78.0, help="the GPU memory a row is checked against "
                    "(an 80 GB H100 reports 79.6 GiB; about 78 GiB are usable)")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tokens = args.micro_batch * args.seq
    ckpt = not args.no_checkpointing
    print(f"Per-GPU GiB, N = {args.gpus} GPUs (QLoRA: 1 GPU), micro-batch {args.micro_batch} x {args.seq} tokens, "
          f"LoRA r={args.lora_r} on the default targets, gradient checkpointing {'on' if ckpt else 'off'}; "
          f"params/grads/optimizer COUNTED from the meta model, activations ESTIMATED (formula)")
    print("| shape | setting | params (B) | trainable (M) | engine | base | gathered | trainable params | grads | AdamW | "
          f"activations | **total** | fits {args.gpu_gib:.0f} GiB |")
    print("|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---|")
    result = [f"gpus={args.gpus}", f"tokens={tokens}", f"checkpointing={int(ckpt)}"]
    heads_fit = []
    for name in args.shapes:
        for r in (None, args.lora_r):
            p = plan(name, SHAPES[name], args.gpus, r, tokens, ckpt)
            c = p["counted"]
            for e, row in p["rows"].items():
                fits = "yes" if row["total"] <= args.gpu_gib * GIB else "**no**"
                print(f"| {name} | {'LoRA r=%d' % r if r else 'frozen'} | {c.total_numel / 1e9:.2f} | "
                      f"{c.trainable_numel / 1e6:.1f} | {e} | {_g(row['base'])} | {_g(row['gathered'])} | "
                      f"{_g(row['adapter'])} | {_g(row['grads'])} | {_g(row['optim'])} | {_g(row['act'])} | "
                      f"**{_g(row['total'])}** | {fits} |")
                tag = re.sub(r"[^a-z0-9]+", "_", f"{name}_{'lora' if r else 'frozen'}_{e}".lower())
                result.append(f"{tag}_gib={row['total'] / GIB:.1f}")
            if r:
                fsdp = p["rows"]["FSDP"]
                heads_fit.append((name, fsdp["heads_replicated"], fsdp["total"]))
                result.append(f"{re.sub(r'[^a-z0-9]+', '_', name.lower())}_heads_replicated_gib="
                              f"{fsdp['heads_replicated'] / GIB:.2f}")
    print()
    for name, hb, total in heads_fit:
        print(f"{name}: replicated heads (fp32 params + grads + AdamW m, v) = {hb / GIB:.2f} GiB per GPU "
              f"= {100 * hb / total:.1f}% of the FSDP LoRA total ({total / GIB:.1f} GiB)")
    result.append("heads_replicated_fit=" + ("yes" if all(t <= args.gpu_gib * GIB for _, _, t in heads_fit) else "no"))
    print("RESULT " + " ".join(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
