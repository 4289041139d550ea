"""Peak host memory of a training step with and without activation (gradient) checkpointing, on CPU.

    python benchmarks/memory.py                    # Qwen2.5-0.5B shape, 6 of 24 layers, batch 2 x 512
    python benchmarks/memory.py --layers 24        # the full depth (slower)
    python benchmarks/memory.py --vocab 16384      # the same backbone, a cheaper loss (CPU minutes)

Each variant runs in its OWN process (a fresh interpreter: no allocator state shared), builds the
model (random weights, float32), resets the peak (``echo 5 > /proc/self/clear_refs``: the build's
transients are not the step's), runs one warm-up step and ``--steps`` timed steps, and reports
``VmHWM`` (peak resident set) from /proc/self/status. A step is forward + loss + backward + AdamW step + zero_grad, as
`causal_adapter.training.loop` does it. Variants:

* ``frozen``: frozen backbone, fixed d: the backbone runs under no_grad (no activations kept);
  checkpointing changes nothing there, this is the floor.
* ``lora`` / ``lora_ckpt``: LoRA (r=8, q/k/v/o/gate/up/down) without / with
  `CausalModel.gradient_checkpointing_enable()` (transformers' non-reentrant default).
* ``direction`` / ``direction_ckpt``: frozen backbone with a learnable d (the backbone's
  activations are kept for d's gradient) without / with checkpointing.

Figures: ``peak`` = the whole process's VmHWM during the timed steps (weights included);
``step`` = that peak minus the resident set of the built model (what training adds: activations,
gradients, AdamW state, the loss's buffers). The host allocator keeps freed memory, so only peaks
are compared, never the resident set between steps. Ends with ONE line ``RESULT key=value ...`` with the
ratios checkpointed / plain.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

VARIANTS = ("frozen", "lora", "lora_ckpt", "direction", "direction_ckpt")


def status_kib(field: str) -> int:
    """A ``kB`` field of /proc/self/status (VmHWM: peak resident set, VmRSS: current)."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status (Linux only)")


def reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


def child(args) -> dict:
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
    cmd = [sys.executable, os.path.abspath(__file__), "--child", variant, "--layers", str(args.layers),
           "--batch", str(args.batch), "--vocab", str(args.vocab), "--seq", str(args.seq),
           "--steps", str(args.steps), "--threads", str(args.threads)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
    return json.loads([line for line in out.splitlines() if line.startswith("{")][-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
        print(json.dumps(child(args)))
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


if __name__ == "__main__":
    raise SystemExit(main())
