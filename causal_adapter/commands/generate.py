"""`causal-adapter generate`: text in, text with numbers (and their intervals) out."""
from __future__ import annotations

import argparse
import sys

from ..modeling.generation import MODES
from ..saving.model import CausalModel, get_causal_model
from .parser import CLIError, add_base_arguments, load_base_from_args, tiny_base_hint


def add_parser(sub, **fmt) -> None:
    p = sub.add_parser("generate", help="generate text with numbers from a prompt", **fmt)
    p.add_argument("prompt", nargs="*", help="prompt(s); read from a pipe on stdin when none is given")
    add_base_arguments(p)
    p.add_argument("--adapter", default=None, help="adapter directory (default: a fresh adapter = the base model)")
    p.add_argument("--mode", default="deterministic", choices=list(MODES))
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--do-sample", action="store_true", help="softmax mode: sample instead of greedy")
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--shared-individual", action="store_true", help="causal mode: one sampled U per sequence")
    p.set_defaults(func=run)


def read_prompts(args: argparse.Namespace) -> list[str]:
    if args.prompt:
        return args.prompt
    if sys.stdin is None or sys.stdin.isatty():
        raise CLIError('no prompt: give it as an argument (causal-adapter generate "The price was") '
                       "or pipe it in (echo 'The price was' | causal-adapter generate)")
    text = sys.stdin.read()
    if not text.strip():
        raise CLIError("no prompt: stdin was empty; give the prompt as an argument or pipe a non-empty text in")
    return [text]


def print_numbers(prompts: list[str], out) -> None:
    for prompt, text, numbers in zip(prompts, out.texts, out.numbers):
        print(prompt + text)
        for n in numbers:
            lo50, hi50 = n["interval_50"]
            lo90, hi90 = n["interval_90"]
            print(f"  <NUM> {n['text']}: loc_Y={n['loc']:.4g} scale_Y={n['scale']:.3g} "
                  f"50% [{lo50:.4g}, {hi50:.4g}] 90% [{lo90:.4g}, {hi90:.4g}]")


def run(args: argparse.Namespace) -> int:
    prompts = read_prompts(args)
    base, tokenizer = load_base_from_args(args)
    if args.adapter:
        try:
            model = CausalModel.from_pretrained(base, args.adapter, tokenizer=tokenizer)
        except ValueError as e:
            raise tiny_base_hint(e, args) from e
    else:
        model = get_causal_model(base, tokenizer=tokenizer)
    model.eval()
    out = model.generate(prompts, tokenizer=tokenizer, mode=args.mode, max_new_tokens=args.max_new_tokens,
                         seed=args.seed, do_sample=args.do_sample or None, temperature=args.temperature,
                         top_k=args.top_k, top_p=args.top_p, shared_individual=args.shared_individual)
    print_numbers(prompts, out)
    return 0
