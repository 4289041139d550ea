"""`causal-adapter demo`: the main job on the embedded default (train, evaluate, save, reload, generate, plot)."""
from __future__ import annotations

import argparse

from ..training.demo import run_demo
from .parser import add_base_arguments, check_base, existing_outputs, refuse_overwrite, remove_if_left_empty

DEMO_OUTPUTS = ("demo_metrics.md", "demo_metrics.json", "train")


def add_parser(sub, **fmt) -> None:
    p = sub.add_parser("demo", help="train, evaluate, save, reload and generate on the embedded default", **fmt)
    add_base_arguments(p)
    p.add_argument("--output-dir", default="causal_adapter_demo")
    p.add_argument("--overwrite", action="store_true", help="replace the outputs of a previous run in --output-dir")
    p.add_argument("--steps", "--max-steps", dest="steps", type=int, default=200, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--learning-rate", type=float, default=1e-2)
    p.add_argument("--lora", action="store_true", help="LoRA on the backbone instead of a frozen backbone")
    p.add_argument("--seed", type=int, default=42)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    check_base(args.base)
    if not args.overwrite:
        refuse_overwrite(args.output_dir, existing_outputs(args.output_dir, DEMO_OUTPUTS))
    with remove_if_left_empty(args.output_dir):
        return run_demo(output_dir=args.output_dir, steps=args.steps, base=args.base, arch=args.arch, seed=args.seed,
                        batch_size=args.batch_size, learning_rate=args.learning_rate, lora=args.lora,
                        dtype=args.dtype, tiny_hidden_size=args.tiny_hidden_size, tiny_layers=args.tiny_layers)
