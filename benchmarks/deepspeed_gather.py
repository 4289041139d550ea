"""What gathering W_cls (lm_head's weight) and the heads costs under DeepSpeed ZeRO-3, in the product's setup
(`training.engines.prepare`: the heads' parameters and W_cls registered as external parameters of the
CausalModel, so DeepSpeed all-gathers them for its forward and again for its backward).

    python benchmarks/deepspeed_gather.py                       # H=128, 2 layers, Qwen's vocabulary (151,936)
    python benchmarks/deepspeed_gather.py --hidden-size 256 --layers 4 --vocab 32768

Launches itself with `accelerate launch` of a ZeRO-3 config (examples/accelerate_configs/deepspeed_zero3.yaml's
settings, fp32, every parameter partitioned: stage3_param_persistence_threshold 0; DS_ACCELERATOR=cpu; 2 gloo
processes, OMP_NUM_THREADS=1 each). In the same run it times
(medians over --repeats, after a warm-up): one training step of the prepared engine (forward, backward, the
ZeRO-3 optimizer step, batch --batch x --seq tokens per process), and one all-gather + re-partition of the
external parameters alone (``deepspeed.zero.GatheredParameters`` over the same tensors), which a step pays
twice (forward and backward). Ends with ONE line ``RESULT key=value ...``: gather_share = 2 x gather / step.
A tiny hidden size with Qwen's full vocabulary is the worst case (W_cls is most of the model); at a real
shape the layers' own all-gathers dominate. CPU figures: a GPU's collectives cost another share.
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


def launch(args) -> int:
    with tempfile.TemporaryDirectory() as tmp, socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        # ZeRO-3 in fp32 with every parameter partitioned (DeepSpeed keeps those under 1e5 elements whole by
        # default: the heads at this hidden size; at a real one they are partitioned)
        (Path(tmp) / "zero3.json").write_text(json.dumps({
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
            "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto"}))
        config = Path(tmp) / "zero3_cpu.yaml"
        config.write_text(f"distributed_type: DEEPSPEED\nnum_machines: 1\nnum_processes: 2\nuse_cpu: false\n"
                          f"deepspeed_config:\n  deepspeed_config_file: {tmp}/zero3.json\n  zero3_init_flag: false\n")
        env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), "--main_process_port",
               str(port), __file__, *sys.argv[1:]]
        sock.close()
        return subprocess.run(cmd, env=env).returncode


def timed(fn, repeats: int) -> float:
    """Median seconds of fn() over `repeats` calls, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def worker(args) -> None:
    import torch
    from deepspeed.runtime.zero import GatheredParameters

    from causal_adapter import CausalAdapterConfig, get_causal_model
    from causal_adapter.saving.assets import build_tiny_qwen
    from causal_adapter.training import engines
    from causal_adapter.training.config import TrainConfig
    from causal_adapter.training.deepspeed_engine import head_parameters

    config = TrainConfig(per_device_train_batch_size=args.batch, max_grad_norm=1.0, mixed_precision="no")
    accelerator = engines.make_accelerator(config)
    torch.manual_seed(0)
    base = build_tiny_qwen("qwen2", hidden_size=args.hidden_size, num_layers=args.layers, vocab_size=args.vocab)
    num_id = args.vocab - 1
    model = get_causal_model(base, CausalAdapterConfig(num_token_id=num_id))
    optimizer = torch.optim.AdamW([p for _, p in model.trainable_parameters()], lr=1e-4)
    engine, _ = engines.prepare(accelerator, model, optimizer, config)
    g = torch.Generator().manual_seed(accelerator.process_index)
    ids = torch.randint(0, num_id, (args.batch, args.seq), generator=g)
    ids[:, args.seq // 2] = num_id
    values = torch.zeros(args.batch, args.seq)
    values[:, args.seq // 2] = 3.5
    batch = dict(input_ids=ids, numeric_values=values, labels=ids.clone())

    def step():
        engines.backward(accelerator, engine, engine(**batch).loss, sync=True)

    def gather():
        with GatheredParameters(head_parameters(model)):
            pass

    t_step, t_gather = timed(step, args.repeats), timed(gather, args.repeats)
    numel = sum(p.ds_numel for p in head_parameters(model))
    if accelerator.is_main_process:
        print(f"RESULT zero3_step_ms={t_step * 1e3:.2f} gather_ms={t_gather * 1e3:.2f} "
              f"gather_share={2 * t_gather / t_step:.3f} gathered_params={numel} hidden={args.hidden_size} "
              f"layers={args.layers} vocab={args.vocab} tokens_per_process={args.batch * args.seq} "
              f"processes={accelerator.num_processes}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden-size", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    if "LOCAL_RANK" in os.environ:
        worker(args)
    else:
        sys.exit(launch(args))


if __name__ == "__main__":
    main()
