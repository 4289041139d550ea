"""Training throughput per process: 2 CPU processes (DDP over gloo through `accelerate launch` with
examples/accelerate_configs/cpu_ddp.yaml) against 1 process, on the same tiny model and data, running the
product's `causal-adapter train` (`python -m causal_adapter train`).

    python benchmarks/ddp_throughput.py                       # the embedded tiny base, 30 steps, batch 4 / process
    python benchmarks/ddp_throughput.py --tiny-hidden-size 256 --tiny-layers 4 --steps 40

Each run logs `label_tokens_per_s` every `--log-every` steps (metrics.jsonl: labelled tokens summed over the
processes / the window's seconds averaged over the processes). Per process = that / the number of processes.
The first window (warm-up) is dropped; the figure is the median of the others. Every process runs with
OMP_NUM_THREADS=1, so 2 processes use 2 cores where 1 process uses 1: a ratio (2-process per-process
throughput / 1-process throughput) of 1.0 is perfect scaling, below 1.0 is what DDP's gradient all-reduce,
the padding of the epoch to a multiple of the processes, and a shared CPU cost. Ends with ONE line
``RESULT key=value ...``.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CPU_DDP = REPO / "examples" / "accelerate_configs" / "cpu_ddp.yaml"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(processes: int, out: Path, args) -> dict:
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--log-every", type=int, default=5)
    ap.add_argument("--batch", type=int, default=4, help="per process (the 2-process run sees 2x the examples)")
    ap.add_argument("--dataset", default="sunspots")
    ap.add_argument("--tiny-hidden-size", type=int, default=64)
    ap.add_argument("--tiny-layers", type=int, default=2)
    ap.add_argument("--lora", action="store_true")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        one = run(1, Path(tmp) / "p1", args)
        two = run(2, Path(tmp) / "p2", args)
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


if __name__ == "__main__":
    raise SystemExit(main())
