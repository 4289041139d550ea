"""Console entry point: `causal-adapter <command> --help`.

    demo      the main job on the embedded default: train, evaluate, save, reload, generate, plot
    train     fine-tune an adapter (also: accelerate launch -m causal_adapter.train ...)
    eval      evaluate a saved adapter on a corpus split or files, with the baselines
    generate  text in, text with numbers (and intervals) out
    verify    the initialization report for a base model
    data      write an offline corpus as jsonl files
"""
from __future__ import annotations

import argparse
import sys

import torch

DEFAULT_TEXT = "In 1749 the yearly sunspot number was 80.9; in 1750 it was 83.4, and the price was 99.9 yuan."
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def add_base_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base", default=None,
                   help="local Qwen directory or cached hub name (default: the embedded tiny Qwen, offline)")
    p.add_argument("--arch", default="qwen2", choices=["qwen2", "qwen3"], help="architecture of the embedded default")
    p.add_argument("--dtype", default="float32", choices=sorted(_DTYPES))


def load_base(base: str | None, arch: str = "qwen2", dtype: str = "float32"):
    """(model, tokenizer): a local Qwen directory / hub name, or the embedded tiny default."""
    if base is None:
        from .assets import build_tiny_qwen, load_qwen_tokenizer

        return build_tiny_qwen(arch, dtype=_DTYPES[dtype]), load_qwen_tokenizer()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(base, dtype=_DTYPES[dtype]), AutoTokenizer.from_pretrained(base)


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


def cmd_generate(args: argparse.Namespace) -> int:
    from .model import CausalModel, get_causal_model

    base, tokenizer = load_base(args.base, args.arch, args.dtype)
    if args.adapter:
        model = CausalModel.from_pretrained(base, args.adapter, tokenizer=tokenizer)
    else:
        model = get_causal_model(base, tokenizer=tokenizer)
    model.eval()
    prompts = args.prompt or [sys.stdin.read()]
    out = model.generate(prompts, tokenizer=tokenizer, mode=args.mode, max_new_tokens=args.max_new_tokens,
                         seed=args.seed, do_sample=args.do_sample or None, temperature=args.temperature,
                         top_k=args.top_k, top_p=args.top_p, shared_individual=args.shared_individual)
    for prompt, text, numbers in zip(prompts, out.texts, out.numbers):
        print(prompt + text)
        for n in numbers:
            lo50, hi50 = n["interval_50"]
            lo90, hi90 = n["interval_90"]
            print(f"  <NUM> {n['text']}: loc_Y={n['loc']:.4g} scale_Y={n['scale']:.3g} "
                  f"50% [{lo50:.4g}, {hi50:.4g}] 90% [{lo90:.4g}, {hi90:.4g}]")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from .demo import evaluate_adapter

    table = evaluate_adapter(args.adapter, base=args.base, arch=args.arch, dtype=args.dtype, corpus=args.corpus,
                             split=args.split, data_files=args.data_file, batch_size=args.batch_size,
                             output=args.output)
    print(table)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(output_dir=args.output_dir, steps=args.steps, base=args.base, arch=args.arch, seed=args.seed,
                    batch_size=args.batch_size, learning_rate=args.learning_rate, lora=args.lora)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="causal-adapter", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help="train, evaluate, save, reload and generate on the embedded default")
    add_base_arguments(p)
    p.add_argument("--output-dir", default="causal_adapter_demo")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--learning-rate", type=float, default=1e-2)
    p.add_argument("--lora", action="store_true", help="LoRA on the backbone instead of a frozen backbone")
    p.add_argument("--seed", type=int, default=42)
    p.set_defaults(func=cmd_demo)

    # train / data own their flags: main() hands them the rest of the command line
    sub.add_parser("train", add_help=False, help="fine-tune an adapter (flags: causal-adapter train --help)")

    p = sub.add_parser("eval", help="evaluate a saved adapter against the constant and persistence baselines")
    p.add_argument("adapter", help="adapter directory (causal_adapter_config.json + causal_adapter_model.safetensors)")
    add_base_arguments(p)
    p.add_argument("--corpus", default="sunspots", help="built-in corpus (ignored with --data-file)")
    p.add_argument("--split", default="test", choices=["train", "validation", "test"])
    p.add_argument("--data-file", nargs="+", default=None, help="jsonl/csv/parquet files with prompt/completion or text")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--output", default=None, help="also write the table (.md) / metrics (.json) here")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("generate", help="generate text with numbers from a prompt")
    p.add_argument("prompt", nargs="*", help="prompt(s); read from stdin when none is given")
    add_base_arguments(p)
    p.add_argument("--adapter", default=None, help="adapter directory (default: a fresh adapter = the base model)")
    p.add_argument("--mode", default="deterministic", choices=["deterministic", "softmax", "causal"])
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--do-sample", action="store_true", help="softmax mode: sample instead of greedy")
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--shared-individual", action="store_true", help="causal mode: one sampled U per sequence")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("verify", help="check that a fresh adapter reproduces its base model")
    add_base_arguments(p)
    p.add_argument("--text", default=DEFAULT_TEXT, help="text to compare on")
    p.set_defaults(func=cmd_verify)

    sub.add_parser("data", add_help=False, help="write an offline corpus as jsonl (flags: causal-adapter data --help)")
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["train"]:
        from .train import main as train_main

        return train_main(argv[1:])
    if argv[:1] == ["data"]:
        from .corpora import main as corpora_main

        return corpora_main(argv[1:])
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
