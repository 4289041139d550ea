"""Console entry point: `causal-adapter <command> --help`."""
from __future__ import annotations

import argparse
import sys

import torch

DEFAULT_TEXT = "In 1749 the yearly sunspot number was 80.9; in 1750 it was 83.4, and the price was 99.9 yuan."


def load_base(base: str | None, arch: str, dtype: str):
    """A local Qwen directory / hub name (loaded offline if cached), or the embedded tiny default."""
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}[dtype]
    if base is None:
        from .assets import build_tiny_qwen, load_qwen_tokenizer

        return build_tiny_qwen(arch, dtype=torch_dtype), load_qwen_tokenizer()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(base, dtype=torch_dtype), AutoTokenizer.from_pretrained(base)


def cmd_verify(args: argparse.Namespace) -> int:
    from .config import CausalAdapterConfig
    from .model import get_causal_model
    from .verify import verify_initialization

    base, tokenizer = load_base(args.base, args.arch, args.dtype)
    model = get_causal_model(base, CausalAdapterConfig(), tokenizer=tokenizer)
    model.print_trainable_parameters()
    ids = tokenizer(args.text, return_tensors="pt")["input_ids"]
    report = verify_initialization(model, base, ids)
    print(report)
    tol = 1e-4 if args.dtype != "bfloat16" else 5e-2
    ok = report["feature_diff"] == 0.0 and report["logits_rel_diff"] <= tol and report["greedy_agreement"] == 1.0
    print("initialization check:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="causal-adapter", description="Causal adapters for Qwen checkpoints.")
    sub = ap.add_subparsers(dest="command", required=True)
    v = sub.add_parser("verify", help="check that a fresh adapter reproduces its base model (seed 001's report)")
    v.add_argument("--base", default=None, help="local Qwen directory or cached hub name (default: embedded tiny Qwen)")
    v.add_argument("--arch", default="qwen2", choices=["qwen2", "qwen3"], help="architecture of the embedded default")
    v.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float64"])
    v.add_argument("--text", default=DEFAULT_TEXT, help="text to compare on")
    v.set_defaults(func=cmd_verify)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
