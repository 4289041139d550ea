"""How fast is a training step against a plain peft LoRA fine-tune? docs/benchmarks.md has the figures.

    python benchmarks/train_step.py --layers 24 --steps 3      # the 0.5B shape: causal adapter vs plain LoRA CE
    python benchmarks/train_step.py --device cuda --dtype bf16  # the same on a GPU: 24 layers, 8 x 1,024 tokens

Default (CPU): the Qwen2.5-0.5B shape (random weights, float32) with --layers of its 24 layers, batch --batch x
--seq, every position labelled. One step = forward + loss + backward + AdamW step + zero_grad; modes ``frozen``
(the heads and the fused OvR loss train), ``causal_lora`` (the same with LoRA r=8 on the seven projections),
``plain_lora`` (peft's same LoRA, the base's own cross-entropy); round robin, the fastest of --steps. RESULT:
tokens/s and the ratios to plain LoRA. ``--device cuda`` (or ``--dtype bf16``): each mode in its own process, a
bf16 base under accelerate's bf16 mixed precision, plain LoRA with and without Liger's Qwen2 patch and again last;
s/step, peak memory, ratios to plain LoRA (``--device cpu --dtype bf16 --layers 1 --batch 1 --seq 16``: a smoke
test of that path). Packed against padded rows and 2 DDP processes against 1 were measured by ``--packing`` /
``--ddp`` up to commit 1c2f799: docs/design-notes/benchmarks.md.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from common import best_time, build_base, machine_line


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
        for flag, var in ((args.loss_gemm, "GEMM"), (args.loss_backend, "BACKEND")):
            if flag:
                env[f"CAUSAL_ADAPTER_LOSS_{var}"] = flag
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (Qwen2.5-0.5B has 24; default 4 on "
                                                              "the CPU path, 24 with --device cuda)")
    ap.add_argument("--batch", type=int, default=None, help="default 2 (CPU path), 8 (--device cuda)")
    ap.add_argument("--seq", type=int, default=None, help="default 128 (CPU path), 1024 (--device cuda)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per mode (the fastest is reported; "
                                                             "default 3, 5 with --device cuda)")
    ap.add_argument("--warmup", type=int, default=None, help="default 1, 2 with --device cuda")
    ap.add_argument("--lora-r", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
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
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
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
