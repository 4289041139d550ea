"""`causal-adapter verify`: the initialization report of a fresh adapter on a base model."""
from __future__ import annotations

import argparse

from ..config import CausalAdapterConfig
from ..modeling.verify import verify_initialization
from ..model import get_causal_model
from .parser import add_base_arguments, load_base_from_args

DEFAULT_TEXT = "In 1749 the yearly sunspot number was 80.9; in 1750 it was 83.4, and the price was 99.9 yuan."


def add_parser(sub, **fmt) -> None:
    p = sub.add_parser("verify", help="check that a fresh adapter reproduces its base model", **fmt)
    add_base_arguments(p)
    p.add_argument("--text", default=DEFAULT_TEXT, help="text to compare on")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    base, tokenizer = load_base_from_args(args)
    model = get_causal_model(base, CausalAdapterConfig(), tokenizer=tokenizer)
    model.print_trainable_parameters()
    ids = tokenizer(args.text, return_tensors="pt")["input_ids"]
    report = verify_initialization(model, base, ids)
    print(report)
    tol = 1e-4 if args.dtype != "bfloat16" else 5e-2
    ok = report["feature_diff"] == 0.0 and report["logits_rel_diff"] <= tol and report["greedy_agreement"] == 1.0
    print("initialization check:", "PASS" if ok else "FAIL")
    return 0 if ok else 1
