"""How much memory does training or serving take? Three questions, one subcommand each (docs/memory.md):

    python benchmarks/memory.py [checkpointing] --layers 6 --seq 512 --variants lora lora_ckpt   # peak of a step
    python benchmarks/memory.py adapters [--n 1 2 4 8] [--layers 4]   # N adapters on one base vs N models
    python benchmarks/memory.py plan [--gpus 8 --seq 4096 --shapes Qwen2.5-72B]   # per GPU at 7B-235B

``checkpointing`` (the default): peak host memory (VmHWM) of a training step with and without gradient
checkpointing, on CPU, at the Qwen2.5-0.5B shape (--layers of its 24 layers, random weights, float32), each
variant in its own process (the peak reset after the build: ``echo 5 > /proc/self/clear_refs``), one warm-up
step and --steps timed steps (forward + loss + backward + AdamW step + zero_grad). Variants: ``frozen`` (the
backbone under no_grad: the floor), ``lora`` / ``lora_ckpt`` (LoRA r=8 on the seven projections, without / with
`gradient_checkpointing_enable()`), ``direction`` / ``direction_ckpt`` (a learnable d: the backbone's
activations kept). ``peak`` = the process's VmHWM during the steps; ``step`` = that minus the resident set of
the built model. RESULT: the peaks and the ratios checkpointed / plain.

``adapters``: LoRA r=8 adapters (plus the heads), each distinct, saved once, then loaded back: ``shared`` =
`from_pretrained(base, A1)` + `load_adapter(Ai, name_i)`; ``separate`` = one `from_pretrained(own base, Ai)` per
adapter. Each (variant, N) in a process of its own: peak resident memory (ru_maxrss) minus the resident memory
after its imports, and the bytes of the distinct tensors. RESULT: MiB per variant and N, separate / shared.

``plan``: per-GPU memory of a training run at Qwen2.5-7B / 32B / 72B and Qwen3-235B-A22B shapes under DDP, FSDP
(heads replicated), ZeRO-3 and QLoRA, frozen and with LoRA. Parameters COUNTED from the real transformers model
built on the meta device and wrapped by `get_causal_model` (FSDP shards per parameter as FSDP2 cuts them; the
4-bit set: exact `nn.Linear` modules but lm_head); gradients, AdamW, ZeRO-3's partitions, QLoRA's NF4 bytes and
the gathered transients by stated rules; activations ESTIMATED by a per-layer formula (`activation_bytes`).
Every rule: docs/memory.md, "Planning a large run"; tests/test_memory_plan.py checks the counting.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

NUM_TOKEN_ID = 151_665  # len(Qwen2.5 / Qwen3 tokenizer): the first reserved embedding row, what `<NUM>` takes


# ============================================================================= checkpointing: the peak of a step
VARIANTS = ("frozen", "lora", "lora_ckpt", "direction", "direction_ckpt")


def status_kib(name: str) -> int:
    """A ``kB`` field of /proc/self/status (VmHWM: peak resident set, VmRSS: current)."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(name + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{name} not in /proc/self/status (Linux only)")


def reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


def step_child(args) -> dict:
    """Build one variant, step it, and return its figures (runs in its own process)."""
    from causal_adapter import CausalAdapterConfig, LoraSettings, get_causal_model
    from common import build_base

    torch.set_num_threads(args.threads)
    v = args.variant
    lora = LoraSettings(r=8, alpha=16) if v.startswith("lora") else None
    model = get_causal_model(build_base(args.layers, vocab_size=args.vocab), CausalAdapterConfig(
        num_token_id=args.vocab - 1, lora=lora, learnable_direction=v.startswith("direction")))
    if v.endswith("_ckpt"):
        model.gradient_checkpointing_enable()
    model.train()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab - 1, (args.batch, args.seq), generator=g)
    opt = torch.optim.AdamW([p for _, p in model.trainable_parameters()], lr=1e-4)

    def step() -> float:
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    rss_before = status_kib("VmRSS")  # the model built: weights, libraries
    reset = reset_peak()  # the build's transients are not the training step's
    times = []
    for _ in range(1 + args.steps):  # the first (warm-up) step allocates AdamW's state: it counts, it is not timed
        t = time.perf_counter()
        loss = step()
        times.append(time.perf_counter() - t)
    peak = status_kib("VmHWM")
    return {"variant": v, "peak_kib": peak, "rss_before_kib": rss_before, "step_kib": peak - rss_before,
            "peak_reset": reset, "sec_per_step": min(times[1:]), "loss": loss,
            "checkpointing": model.is_gradient_checkpointing}


def run_variant(variant: str, args) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "checkpointing", "--child", variant, "--layers", str(args.layers),
           "--batch", str(args.batch), "--vocab", str(args.vocab), "--seq", str(args.seq),
           "--steps", str(args.steps), "--threads", str(args.threads)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
    return json.loads([line for line in out.splitlines() if line.startswith("{")][-1])


def checkpointing_main(argv) -> int:
    ap = argparse.ArgumentParser(prog="memory.py [checkpointing]", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=6, help="decoder layers (Qwen2.5-0.5B has 24)")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=151_936, help="vocabulary rows (the last one is <NUM>); a "
                    "smaller vocabulary shrinks the loss's time, not the backbone's activations")
    ap.add_argument("--steps", type=int, default=1, help="measured steps after the warm-up")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        args.variant = args.child
        print(json.dumps(step_child(args)))
        return 0
    print(f"Qwen2.5-0.5B shape, {args.layers} layer(s), vocab {args.vocab:,d}, batch {args.batch} x {args.seq}, "
          f"float32 CPU, {args.threads} threads; one process per variant; MiB")
    res = {}
    for v in args.variants:
        r = res[v] = run_variant(v, args)
        print(f"{v:15s} peak {r['peak_kib'] / 1024:8.0f}  step adds {r['step_kib'] / 1024:7.0f}  "
              f"{r['sec_per_step']:6.2f} s/step  loss {r['loss']:.4g}  checkpointing={r['checkpointing']}"
              + ("" if r["peak_reset"] else "  (peak not reset: includes the build)"))
    fields = [f"layers={args.layers}", f"tokens_per_step={args.batch * args.seq}"]
    for v in res:
        fields += [f"{v}_peak_mib={res[v]['peak_kib'] / 1024:.0f}", f"{v}_step_mib={res[v]['step_kib'] / 1024:.0f}"]
    for mode in ("lora", "direction"):
        if mode in res and mode + "_ckpt" in res:
            a, b = res[mode], res[mode + "_ckpt"]
            fields += [f"{mode}_ckpt_vs_plain_peak={b['peak_kib'] / a['peak_kib']:.3f}",
                       f"{mode}_ckpt_vs_plain_step={b['step_kib'] / max(1, a['step_kib']):.3f}",
                       f"{mode}_ckpt_vs_plain_time={b['sec_per_step'] / a['sec_per_step']:.3f}"]
    print("RESULT " + " ".join(fields))
    return 0


# ============================================================================= adapters: N on one base
def make_adapters(directory: Path, n: int, layers: int) -> list[Path]:
    from causal_adapter import CausalAdapterConfig, LoraSettings, get_causal_model
    from common import build_base

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


def adapters_child(variant: str, paths: list[str], layers: int) -> dict:
    __import__("transformers")  # imported before the baseline

    from causal_adapter import CausalModel
    from common import build_base

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


def adapters_main(argv) -> int:
    ap = argparse.ArgumentParser(prog="memory.py adapters", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(adapters_child(args.child[0], args.child[1:], args.layers)))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        paths = [str(p) for p in make_adapters(Path(tmp), max(args.n), args.layers)]
        adapter_mib = sum(f.stat().st_size for f in Path(paths[0]).iterdir()) / 2**20
        print(f"one adapter directory: {adapter_mib:.1f} MiB on disk")
        results = {}
        for n in args.n:
            for variant in ("shared", "separate"):
                out = subprocess.run([sys.executable, __file__, "adapters", "--layers", str(args.layers), "--child", variant,
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
    return 0


# ============================================================================= plan: per-GPU memory at scale
GIB = 1024 ** 3

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


def plan_main(argv) -> int:
    ap = argparse.ArgumentParser(prog="memory.py plan", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
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

SUBCOMMANDS = {"checkpointing": checkpointing_main, "adapters": adapters_main, "plan": plan_main}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    name = argv.pop(0) if argv and argv[0] in SUBCOMMANDS else "checkpointing"
    return SUBCOMMANDS[name](argv)


if __name__ == "__main__":
    raise SystemExit(main())
