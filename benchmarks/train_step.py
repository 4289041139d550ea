"""How fast is a training step? Against a plain peft LoRA fine-tune (default), packed against padded rows
(``--packing``), 2 DDP processes against 1 (``--ddp``). docs/benchmarks.md has the figures.

    python benchmarks/train_step.py --layers 24 --steps 3      # the 0.5B shape: causal adapter vs plain LoRA CE
    python benchmarks/train_step.py --device cuda --dtype bf16  # the same on a GPU: 24 layers, 8 x 1,024 tokens
    python benchmarks/train_step.py --packing [--corpus sunspots]  # packed rows vs padded batches, same rows
    python benchmarks/train_step.py --ddp [--lora --tiny-hidden-size 256 --tiny-layers 4]  # 2 gloo processes vs 1

Default (CPU): the Qwen2.5-0.5B shape (hidden 896, 14 / 2 heads, intermediate 4864, vocab 151,936, tied; random
weights, float32) with --layers of its 24 layers, batch --batch x --seq, every position labelled. One step =
forward + loss + backward + AdamW step + zero_grad, as `training.loop` does it; modes: ``frozen`` (frozen backbone,
the heads and the fused OvR loss train), ``causal_lora`` (the same with LoRA r=8 on q/k/v/o/gate/up/down),
``plain_lora`` (peft's `get_peft_model`, same LoRA, the base's own cross-entropy). Round robin, the fastest of
--steps after --warmup. RESULT: tokens/s and the ratios to plain LoRA.

``--device cuda`` (or ``--dtype bf16``): each mode in its own process (`device_main`): the base in bf16 under
``Accelerator(mixed_precision="bf16")``, the adapter in float32; modes (``--modes``) ``plain_lora``,
``plain_lora_liger`` (after Liger's `apply_liger_kernel_to_qwen2()`, ``--liger-kernels``), ``causal_lora``,
``frozen``, plain LoRA again last (the faster of its runs is the baseline); s/step, the peak of
``max_memory_allocated``, ratios to plain LoRA. ``--loss-gemm`` / ``--loss-backend`` set the causal modes'
``CAUSAL_ADAPTER_LOSS_GEMM`` / ``_BACKEND``. ``--device cpu --dtype bf16 --layers 1 --batch 1 --seq 16`` is a
smoke test of that path (Liger needs ``TRITON_INTERPRET=1``).

``--packing``: one epoch of --rows rows of the mixed-length ``chat`` corpus (or ``--corpus sunspots``: windows of
4-64 years), CausalModel + LoRA r=8 with the value head reading 32 recent numbers, trained padded (batches of
--batch rows padded to their longest: `NumericCollator`) and packed (best-fit-decreasing into rows of
--max-length tokens, --packed-batch a batch: `PackedCollator`, what ``train --packing`` does). Both epochs carry
the same labelled tokens and summed loss (checked before timing). Timed --repeats times per mode, round robin;
tokens per CPU second of this process (one thread: on a shared machine wall seconds measure the waiting).
RESULT: ``packed_vs_padded`` (CPU seconds) and ``packed_vs_padded_wall``.

``--ddp``: the product's `causal-adapter train` on the embedded tiny base, once as 1 process and once as 2 DDP
processes over gloo (`accelerate launch` of examples/accelerate_configs/cpu_ddp.yaml), OMP_NUM_THREADS=1 each;
``label_tokens_per_s`` from metrics.jsonl (median over the --log-every windows, the first dropped) per process.
RESULT: ``per_process_ratio`` (1.0: perfect scaling) and ``speedup_2proc``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from common import best_time, build_base, free_port, machine_line


def lora_settings(r: int):
    from causal_adapter import LoraSettings

    return LoraSettings(r=r, alpha=2 * r, dropout=0.0)


def make_step(mode: str, layers: int, r: int, ids: torch.Tensor, base=None, accelerator=None):
    """(model, step function, trainable parameter count) for one mode; a step is one optimizer update.
    `base`: the model to wrap (default: a fresh CPU one); `accelerator`: prepares model and optimizer and
    runs the backward (its mixed precision)."""
    base = build_base(layers) if base is None else base
    labels = ids.clone()
    if mode in ("frozen", "causal_lora"):
        from causal_adapter import CausalAdapterConfig, get_causal_model

        cfg = CausalAdapterConfig(num_token_id=151_665, lora=lora_settings(r) if mode == "causal_lora" else None)
        model = get_causal_model(base, cfg)
        model.train()
        params = [p for _, p in model.trainable_parameters()]
        assert model.backbone_needs_grad() == (mode == "causal_lora")

        def loss_fn():
            return model(ids, labels=labels).loss
    else:
        from peft import LoraConfig, get_peft_model

        s = lora_settings(r)
        model = get_peft_model(base, LoraConfig(r=s.r, lora_alpha=s.alpha, lora_dropout=s.dropout,
                                                target_modules=list(s.target_modules)))
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]

        def loss_fn():
            return model(input_ids=ids, labels=labels).loss
    # (the loss functions read `model` when called: after accelerator.prepare below, its prepared form)
    opt = torch.optim.AdamW(params, lr=1e-4)
    if accelerator is not None:  # single process: the same model, its forward under accelerate's autocast
        model, opt = accelerator.prepare(model, opt)

    def step():
        loss = loss_fn()
        if accelerator is not None:
            accelerator.backward(loss)
        else:
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    n_train = sum(p.numel() for p in params)
    return model, step, n_train


# --------------------------------------------------------------------------- GPU: one process per mode
DEVICE_MODES = ("plain_lora", "plain_lora_liger", "causal_lora", "frozen")
GIB = 2**30


LIGER_KERNELS = ("rope", "rms_norm", "swiglu", "fused_linear_cross_entropy")  # apply_liger_kernel_to_qwen2's defaults


def liger_patch(kernels: list[str]) -> str:
    """Liger's Qwen2 patch (liger-kernel 0.8.5: module-level, before the model is built) with the given kernels
    on (default: its defaults, all four); what it replaced."""
    from liger_kernel.transformers import apply_liger_kernel_to_qwen2

    apply_liger_kernel_to_qwen2(**{k: k in kernels for k in LIGER_KERNELS})
    from transformers.models.qwen2 import modeling_qwen2 as mq

    return (f"RMSNorm={mq.Qwen2RMSNorm.__name__} MLP={mq.Qwen2MLP.__name__} "
            f"forward={mq.Qwen2ForCausalLM.forward.__module__}.{mq.Qwen2ForCausalLM.forward.__name__}")


def loss_defaults(device) -> str:
    """The backend and GEMM precision the causal modes' fused loss resolves to here."""
    from causal_adapter.modeling import loss

    if not hasattr(loss, "resolve_backend"):
        return f"gemm={loss.resolve_gemm_precision(None)}"
    backend = loss.resolve_backend(None, torch.float32, device.type)
    return f"backend={backend} gemm={loss.resolve_gemm_precision(None, backend, device.type)}"


def child_main(args) -> dict:
    """One mode in this process: build, prepare, warm up, time; a dict for the parent (JSON)."""
    from accelerate import Accelerator

    mode, device = args.child, torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    info = ""
    if mode == "plain_lora_liger":
        info = liger_patch(args.liger_kernels.split(","))
    elif mode in ("causal_lora", "frozen"):
        info = loss_defaults(device)
    accelerator = Accelerator(mixed_precision="bf16" if args.dtype == "bf16" else "no", cpu=device.type == "cpu")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 151_000, (args.batch, args.seq), generator=g).to(device)
    cuda = device.type == "cuda"
    t0 = time.perf_counter()
    base = build_base(args.layers, device=device, dtype=dtype)
    weights = torch.cuda.memory_allocated(device) if cuda else 0
    _, step, n_train = make_step(mode.replace("_liger", ""), args.layers, args.lora_r, ids, base, accelerator)
    build_s = time.perf_counter() - t0
    losses = []
    best, times = best_time(lambda: losses.append(step()), device, warmup=args.warmup, repeats=args.steps)
    res = dict(mode=mode, s=best, times=[round(t, 4) for t in times], loss=losses[-1], n_train=n_train,
               build_s=round(build_s, 1), info=info)
    if cuda:
        res.update(peak_gib=torch.cuda.max_memory_allocated(device) / GIB,
                   reserved_gib=torch.cuda.max_memory_reserved(device) / GIB, weights_gib=weights / GIB)
    return res


def run_mode(mode: str, args) -> dict:
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    if mode in ("causal_lora", "frozen"):
        for flag, var in ((args.loss_gemm, "CAUSAL_ADAPTER_LOSS_GEMM"), (args.loss_backend, "CAUSAL_ADAPTER_LOSS_BACKEND")):
            if flag:
                env[var] = flag
    cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, "--device", args.device, "--dtype", args.dtype,
           "--layers", str(args.layers), "--batch", str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--lora-r", str(args.lora_r), "--threads", str(args.threads),
           "--liger-kernels", args.liger_kernels]
    t0 = time.perf_counter()
    try:
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.mode_timeout)
    except subprocess.TimeoutExpired:
        return dict(mode=mode, error=f"timed out after {args.mode_timeout} s")
    wall = time.perf_counter() - t0
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        err = [line for line in out.stderr.strip().splitlines() if line.strip()] or ["killed"]
        oom = any("out of memory" in line.lower() for line in err)
        return dict(mode=mode, error="out of memory" if oom else err[-1][:200])
    res = json.loads(lines[-1])
    res["wall_s"] = wall
    return res


def device_main(args) -> int:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    tokens = args.batch * args.seq
    modes = list(args.modes or DEVICE_MODES)
    if args.repeat_baseline and "plain_lora" in modes:
        modes.append("plain_lora")
    print(f"training step on {device.type}, --dtype {args.dtype}: Qwen2.5-0.5B shape, {args.layers} layers, batch "
          f"{args.batch} x {args.seq} = {tokens} tokens, LoRA r={args.lora_r}, AdamW; fastest of {args.steps} steps "
          f"after {args.warmup} warm-ups; one process per mode", flush=True)
    print(machine_line(device), flush=True)
    runs = []
    for mode in modes:
        r = run_mode(mode, args)
        runs.append(r)
        if "error" in r:
            print(f"  {mode}: FAILED ({r['error']})", flush=True)
            continue
        mem = f", peak {r['peak_gib']:.2f} GiB (weights {r['weights_gib']:.2f})" if "peak_gib" in r else ""
        print(f"  {mode}: {r['s']:.4f} s/step{mem}, loss {r['loss']:.4g}, trainable {r['n_train']:,d}, "
              f"build {r['build_s']} s, process {r['wall_s']:.0f} s; steps {r['times']}"
              + (f"; {r['info']}" if r['info'] else ""), flush=True)
    ok = {}
    for r in runs:  # the faster of plain LoRA's two runs is the baseline; each other mode has one
        if "error" not in r and (r["mode"] not in ok or r["s"] < ok[r["mode"]]["s"]):
            ok[r["mode"]] = r
    base = ok.get("plain_lora")
    plain = [r["s"] for r in runs if r["mode"] == "plain_lora" and "error" not in r]
    result = {"device": device.type, "dtype": args.dtype, "layers": args.layers, "tokens_per_step": tokens}
    hdr = f"{'mode':>17} {'s/step':>8} {'tokens/s':>10} {'x plain LoRA':>13} {'peak GiB':>9} {'mem x plain':>12}"
    print("\n" + hdr + "\n" + "-" * len(hdr))
    for mode in dict.fromkeys(modes):
        r = ok.get(mode)
        if r is None:
            print(f"{mode:>17}   failed: {next(x['error'] for x in runs if x['mode'] == mode)}")
            result[f"{mode}"] = "failed"
            continue
        speed = base["s"] / r["s"] if base else float("nan")
        peak = r.get("peak_gib")
        mem_ratio = peak / base["peak_gib"] if base and peak is not None else float("nan")
        print(f"{mode:>17} {r['s']:>8.4f} {tokens / r['s']:>10.0f} {speed:>13.3f} "
              f"{'-' if peak is None else f'{peak:.2f}':>9} {mem_ratio:>12.3f}")
        result[f"{mode}_s"] = round(r["s"], 4)
        if peak is not None:
            result[f"{mode}_peak_gib"] = round(peak, 2)
        if mode != "plain_lora" and base:
            result[f"{mode}_vs_plain"] = round(speed, 3)
            if peak is not None:
                result[f"{mode}_mem_vs_plain"] = round(mem_ratio, 3)
    if len(plain) > 1:
        print(f"plain LoRA, first / last run: {plain[0]:.4f} / {plain[-1]:.4f} s/step (the faster is the baseline)")
        result["plain_lora_spread"] = round(max(plain) / min(plain), 3)
    print("the GPU targets: causal_lora >= 0.95x plain LoRA's speed at <= 0.55x its peak memory; frozen >= 2x")
    print("RESULT " + " ".join(f"{k}={v}" for k, v in result.items()))
    return 0


# --------------------------------------------------------------------------- --packing
NUM_TOKEN_ID = 151_665  # Qwen2.5's first reserved row


def packing_model(layers: int, recent: int, seed: int = 0):
    from causal_adapter import CausalAdapterConfig, LoraSettings, get_causal_model

    base = build_base(layers, seed, attn_implementation="sdpa")
    model = get_causal_model(base, CausalAdapterConfig(num_token_id=NUM_TOKEN_ID, recent_values=recent,
                                                       lora=LoraSettings(r=8, alpha=16, dropout=0.0)))
    model.action.set_head_units(50.0, 40.0)
    with torch.no_grad():  # a value head that reads its recent numbers (the fits set w_recent in a real run)
        model.action.w_recent.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(seed))
    return model.train()


def corpus_rows(name: str, n: int, seed: int):
    """`n` tokenised training rows of the corpus, drawn at random (seed), and a description of the corpus."""
    import datasets

    from causal_adapter.data.corpora import build_corpus
    from causal_adapter.data.pipeline import tokenize_dataset
    from causal_adapter.numbers import NumberTokenizer
    from causal_adapter.saving.assets import load_qwen_tokenizer

    ntok = NumberTokenizer(load_qwen_tokenizer(), NUM_TOKEN_ID)
    if name == "chat":  # multi-turn chats about the bundled series: one to three question/answer turns
        raw = build_corpus("chat")["train"]
        what = "chat (bundled conversations, assistant turns carry the loss)"
    else:  # prompt/completion rows of sunspots histories of 4 to 64 years, mixed
        raw = datasets.concatenate_datasets([build_corpus("sunspots", window=w)["train"] for w in (4, 8, 16, 32, 64)])
        what = "sunspots windows 4/8/16/32/64 (prompt/completion)"
    raw = raw.shuffle(seed=seed).select(range(min(n, len(raw))))
    rows = tokenize_dataset(raw, ntok, add_eos_token=True)
    return rows.select_columns(["input_ids", "numeric_values", "labels", "label_values"]), ntok.pad_token_id, what


def batches_of(rows, collator, batch: int, order):
    """The epoch's batches: rows taken in `order`, `batch` at a time, collated."""
    from causal_adapter.training.data import rows_at

    return [collator(rows_at(rows, order[i:i + batch])) for i in range(0, len(order), batch)]


def epoch_losses(model, batches) -> tuple[float, float, int]:
    """(sum of L_cls x labelled tokens, sum of L_reg x <NUM> labels, labelled tokens) over `batches`, no grad:
    the epoch's total token loss and regression loss, whatever the batching."""
    cls, reg, tokens = 0.0, 0.0, 0
    with torch.no_grad():
        for b in batches:
            out = model(**b)
            n = int((b["labels"][:, 1:] != -100).sum())
            m = int((b["labels"][:, 1:] == NUM_TOKEN_ID).sum())
            cls += float(out.loss_cls) * n
            reg += float(out.loss_reg) * max(1, m)
            tokens += n
    return cls, reg, tokens


def train_epoch(model, batches, optimizer, params) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds) for one epoch of optimizer steps (one batch each), as
    `training.loop._optimizer_step`."""
    t, c = time.perf_counter(), time.process_time()
    for b in batches:
        out = model(**b)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - t, time.process_time() - c


def packing_main(args) -> int:
    from causal_adapter.data.packing import PackedCollator, pack_dataset
    from causal_adapter.data.pipeline import NumericCollator

    torch.set_num_threads(args.threads)

    rows, pad_id, what = corpus_rows(args.corpus, args.rows, args.seed)
    lengths = sorted(len(ids) for ids in rows["input_ids"])
    real_tokens = sum(lengths)
    packed_rows = pack_dataset(rows, args.max_length)
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(args.seed)).tolist()
    modes = {
        "padded": batches_of(rows, NumericCollator(pad_id), args.batch, order),
        "packed": batches_of(packed_rows, PackedCollator(pad_id), args.packed_batch, list(range(len(packed_rows)))),
    }
    slots = {m: sum(b["input_ids"].numel() for b in bs) for m, bs in modes.items()}
    print(f"corpus: {what}; {len(rows)} rows, tokens per row min {lengths[0]} / median "
          f"{statistics.median(lengths):g} / max {lengths[-1]} (mean {real_tokens / len(rows):.1f}); "
          f"{real_tokens} real tokens")
    for m, bs in modes.items():
        print(f"{m:7s} {len(bs)} steps, {slots[m]} token positions computed ({slots[m] / real_tokens:.2f}x the real "
              f"tokens), up to {max(b['input_ids'].numel() for b in bs)} per step")

    model = packing_model(args.layers, args.recent_values, args.seed)
    params = [p for _, p in model.trainable_parameters()]
    # equal loss per token: the same tokens carry the same loss, packed or padded (same weights)
    losses = {m: epoch_losses(model, bs) for m, bs in modes.items()}
    (cls_a, reg_a, n_a), (cls_b, reg_b, n_b) = losses["padded"], losses["packed"]
    cls_rel, reg_rel = abs(cls_a - cls_b) / abs(cls_a), abs(reg_a - reg_b) / max(abs(reg_a), 1e-30)
    print(f"labelled tokens padded {n_a} / packed {n_b}; epoch token loss relative difference {cls_rel:.1e}, "
          f"regression loss {reg_rel:.1e}")
    if n_a != n_b or cls_rel > 1e-4 or reg_rel > 1e-4:
        raise SystemExit("packed and padded epochs do not carry the same loss: the comparison is void")

    optimizer = torch.optim.AdamW(params, lr=1e-4)
    for bs in modes.values():  # warm-up: one step each (allocator, kernels)
        train_epoch(model, bs[:1], optimizer, params)
    times = {m: [] for m in modes}
    for _ in range(args.repeats):  # round robin: a burst of load from other processes hits both modes alike
        for m, bs in modes.items():
            times[m].append(train_epoch(model, bs, optimizer, params))
    # the fastest epoch of each mode, in wall seconds and in this process's CPU seconds (on a machine shared with
    # other jobs the CPU seconds count the work, not the waiting; with --threads 1 they are not inflated by spinning)
    wall = {m: min(w for w, _ in ts) for m, ts in times.items()}
    cpu = {m: min(c for _, c in ts) for m, ts in times.items()}
    for m, ts in times.items():
        print(f"{m:7s} {wall[m]:7.2f} s/epoch  {real_tokens / wall[m]:8.1f} tokens/s  CPU {cpu[m]:7.2f} s/epoch  "
              f"{real_tokens / cpu[m]:8.1f} tokens/CPU-s  (epochs wall/CPU: "
              f"{', '.join(f'{w:.1f}/{c:.1f}' for w, c in ts)})")
    ratio, ratio_wall = cpu["padded"] / cpu["packed"], wall["padded"] / wall["packed"]
    print(f"packed / padded tokens per second: {ratio:.2f}x (CPU seconds), {ratio_wall:.2f}x (wall)")
    assert math.isfinite(ratio)
    print("RESULT " + " ".join([
        f"corpus={args.corpus}", f"rows={len(rows)}", f"layers={args.layers}", f"threads={args.threads}",
        f"len_min={lengths[0]}", f"len_median={statistics.median(lengths):g}", f"len_max={lengths[-1]}",
        f"padded_positions_per_token={slots['padded'] / real_tokens:.3f}",
        f"packed_positions_per_token={slots['packed'] / real_tokens:.3f}",
        f"padded_tok_cpu_s={real_tokens / cpu['padded']:.1f}", f"packed_tok_cpu_s={real_tokens / cpu['packed']:.1f}",
        f"packed_vs_padded={ratio:.3f}", f"packed_vs_padded_wall={ratio_wall:.3f}",
    ]))
    return 0


# --------------------------------------------------------------------------- --ddp
REPO = Path(__file__).resolve().parents[1]
CPU_DDP = REPO / "examples" / "accelerate_configs" / "cpu_ddp.yaml"


def ddp_run(processes: int, out: Path, args) -> dict:
    train = ["-m", "causal_adapter", "train", "--output-dir", str(out), "--max-steps", str(args.steps),
             "--logging-steps", str(args.log_every), "--eval-steps", "0", "--save-steps", "0",
             "--per-device-train-batch-size", str(args.batch), "--dataset", args.dataset,
             "--tiny-hidden-size", str(args.tiny_hidden_size), "--tiny-layers", str(args.tiny_layers),
             "--plot", "false", "--progress", "false", "--expected-num-processes", str(processes), "--seed", "0"]
    if args.lora:
        train.append("--lora")
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": str(REPO)}
    if processes == 1:
        cmd = [sys.executable, *train]
    else:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CPU_DDP), "--num_processes",
               str(processes), "--main_process_port", str(free_port()), *train]
    t = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        raise SystemExit(proc.stdout[-2000:] + proc.stderr[-4000:])
    final = json.loads((out / "final_metrics.json").read_text())
    if final["num_processes"] != processes:
        raise SystemExit(f"asked for {processes} processes, the run had {final['num_processes']}")
    windows = [r["label_tokens_per_s"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
               if r.get("split") == "train" and r.get("label_tokens_per_s")]
    kept = windows[1:] or windows
    total = statistics.median(kept)
    return {"processes": processes, "tokens_per_s": total, "per_process": total / processes, "windows": windows,
            "wall_s": wall}


def ddp_main(args) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        one = ddp_run(1, Path(tmp) / "p1", args)
        two = ddp_run(2, Path(tmp) / "p2", args)
    print(f"tiny Qwen2 (hidden {args.tiny_hidden_size}, {args.tiny_layers} layers), {'LoRA' if args.lora else 'frozen base'}, "
          f"{args.dataset}, batch {args.batch} per process, {args.steps} steps, OMP_NUM_THREADS=1 per process")
    for r in (one, two):
        print(f"{r['processes']} process(es): {r['tokens_per_s']:8.1f} labelled tokens/s in all, "
              f"{r['per_process']:8.1f} per process; windows {[round(w) for w in r['windows']]}; wall {r['wall_s']:.0f} s")
    ratio = two["per_process"] / one["per_process"]
    print(f"per-process throughput, 2 processes / 1 process: {ratio:.2f}")
    print(f"RESULT tokens_per_s_1proc={one['per_process']:.1f} tokens_per_s_per_proc_2proc={two['per_process']:.1f} "
          f"per_process_ratio={ratio:.3f} speedup_2proc={two['tokens_per_s'] / one['tokens_per_s']:.3f}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--packing", action="store_true", help="packed rows against padded batches (see above)")
    ap.add_argument("--ddp", action="store_true", help="2 DDP processes against 1 (see above)")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (Qwen2.5-0.5B has 24; default 4 on "
                                                              "the CPU path and --packing, 24 with --device cuda)")
    ap.add_argument("--batch", type=int, default=None, help="default 2 (CPU path), 8 (--device cuda; --packing: rows "
                                                             "per padded batch), 4 (--ddp: per process)")
    ap.add_argument("--seq", type=int, default=None, help="default 128 (CPU path), 1024 (--device cuda)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per mode (the fastest is reported; "
                                                             "default 3, 5 with --device cuda; --ddp: 30 steps a run)")
    ap.add_argument("--warmup", type=int, default=None, help="default 1, 2 with --device cuda")
    ap.add_argument("--lora-r", type=int, default=8)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default 2; --packing 1)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"),
                    help="bf16: a bf16 base under accelerate's bf16 mixed precision (see above)")
    ap.add_argument("--modes", nargs="*", default=None, help=f"device path: any of {' '.join(DEVICE_MODES)}")
    ap.add_argument("--no-repeat-baseline", dest="repeat_baseline", action="store_false",
                    help="device path: do not run plain LoRA again after the other modes")
    ap.add_argument("--loss-gemm", default=None, help="device path: CAUSAL_ADAPTER_LOSS_GEMM for the causal modes")
    ap.add_argument("--loss-backend", default=None, help="device path: CAUSAL_ADAPTER_LOSS_BACKEND for them")
    ap.add_argument("--liger-kernels", default=",".join(LIGER_KERNELS),
                    help="device path: the kernels Liger's Qwen2 patch turns on (comma-separated; default all four)")
    ap.add_argument("--mode-timeout", type=int, default=300, help="device path: seconds per mode's process")
    ap.add_argument("--corpus", choices=["chat", "sunspots"], default="chat", help="--packing: the rows")
    ap.add_argument("--rows", type=int, default=16, help="--packing: training rows drawn from the corpus")
    ap.add_argument("--max-length", type=int, default=512, help="--packing: tokens per packed row")
    ap.add_argument("--packed-batch", type=int, default=4, help="--packing: packed rows per batch")
    ap.add_argument("--recent-values", type=int, default=32, help="--packing")
    ap.add_argument("--repeats", type=int, default=3, help="--packing: timed epochs per mode (the fastest)")
    ap.add_argument("--seed", type=int, default=0, help="--packing")
    ap.add_argument("--log-every", type=int, default=5, help="--ddp")
    ap.add_argument("--dataset", default="sunspots", help="--ddp")
    ap.add_argument("--tiny-hidden-size", type=int, default=64, help="--ddp")
    ap.add_argument("--tiny-layers", type=int, default=2, help="--ddp")
    ap.add_argument("--lora", action="store_true", help="--ddp: train LoRA too")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.threads is None:
        args.threads = 1 if args.packing else 2
    if args.packing:
        args.layers, args.batch = args.layers or 4, args.batch or 8
        return packing_main(args)
    if args.ddp:
        args.steps, args.batch = args.steps or 30, args.batch or 4
        return ddp_main(args)
    gpu = args.device == "cuda" or args.dtype == "bf16" or args.child
    for name, cpu_default, gpu_default in (("layers", 4, 24), ("batch", 2, 8), ("seq", 128, 1024), ("steps", 3, 5),
                                           ("warmup", 1, 2)):
        if getattr(args, name) is None:
            setattr(args, name, gpu_default if args.device == "cuda" else cpu_default)
    if args.child:
        print(json.dumps(child_main(args)))
        return 0
    if gpu:
        return device_main(args)
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 151_000, (args.batch, args.seq), generator=g)
    tokens = args.batch * args.seq
    print(f"Qwen2.5-0.5B shape with {args.layers} layer(s); batch {args.batch} x {args.seq} = {tokens} tokens/step; "
          f"{torch.get_num_threads()} threads; fastest of {args.steps} steps after {args.warmup} warm-up "
          "(the minimum is the least disturbed by other processes on a shared machine)")
    modes = ("frozen", "causal_lora", "plain_lora")
    steps, n_train = {}, {}
    for mode in modes:  # all three live at once (3 x 2 GB at 24 layers) so that they can be interleaved
        _, steps[mode], n_train[mode] = make_step(mode, args.layers, args.lora_r, ids)
        for _ in range(args.warmup):
            steps[mode]()
    times = {m: [] for m in modes}
    losses = {}
    for _ in range(args.steps):  # round robin: a burst of load from other processes hits every mode alike
        for mode in modes:
            t = time.perf_counter()
            losses[mode] = steps[mode]()
            times[mode].append(time.perf_counter() - t)
    result = {}
    for mode in modes:
        sec = min(times[mode])
        result[mode] = tokens / sec
        print(f"{mode:12s} {sec:7.3f} s/step  {tokens / sec:9.1f} tokens/s  trainable {n_train[mode]:,d}  "
              f"loss {losses[mode]:.4g}  (median {statistics.median(times[mode]):.2f} s; "
              f"steps: {', '.join(f'{t:.2f}' for t in times[mode])})")
    print(f"frozen / plain LoRA: {result['frozen'] / result['plain_lora']:.2f}x   "
          f"causal LoRA / plain LoRA: {result['causal_lora'] / result['plain_lora']:.2f}x")
    print("RESULT " + " ".join([
        f"layers={args.layers}", f"tokens_per_step={tokens}",
        f"frozen_tok_s={result['frozen']:.1f}", f"causal_lora_tok_s={result['causal_lora']:.1f}",
        f"plain_lora_tok_s={result['plain_lora']:.1f}",
        f"frozen_vs_plain={result['frozen'] / result['plain_lora']:.3f}",
        f"causal_lora_vs_plain={result['causal_lora'] / result['plain_lora']:.3f}",
    ]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
