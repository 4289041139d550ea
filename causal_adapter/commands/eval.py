"""`causal-adapter eval`: a saved adapter on a corpus split or data files, beside the baselines."""
from __future__ import annotations

import argparse

from ..data.corpora import CORPORA, SPLITS
from ..training.evaluate import evaluate_adapter
from .parser import (
    adapter_argument,
    add_adapter_arguments,
    add_base_arguments,
    add_chat_arguments,
    add_column_arguments,
    chat_template_from_args,
    check_base,
    tiny_base_hint,
)


def add_parser(sub, **fmt) -> None:
    p = sub.add_parser("eval", help="evaluate a saved adapter against the constant and persistence baselines", **fmt)
    add_adapter_arguments(p)
    add_base_arguments(p)
    p.add_argument("--dataset", "--corpus", dest="dataset", default="sunspots", choices=list(CORPORA),
                   help="built-in corpus, as train's --dataset (ignored with --data-file; --corpus: the old spelling)")
    p.add_argument("--split", default="test", choices=list(SPLITS))
    p.add_argument("--data-file", nargs="+", default=None, help="jsonl/csv/parquet files with prompt/completion, text or messages (conversations)")
    add_column_arguments(p)
    add_chat_arguments(p)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--output", default=None, help="also write the table (.md) / metrics (.json) here")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    adapter = adapter_argument(args, "eval")
    check_base(args.base)
    chat_template_from_args(args)  # a missing or empty --chat-template file fails before any work
    try:
        table = evaluate_adapter(adapter, base=args.base, arch=args.arch, dtype=args.dtype, corpus=args.dataset,
                                 split=args.split, data_files=args.data_file, batch_size=args.batch_size,
                                 output=args.output, tiny_hidden_size=args.tiny_hidden_size,
                                 tiny_layers=args.tiny_layers, text_column=args.text_column,
                                 prompt_column=args.prompt_column, completion_column=args.completion_column,
                                 messages_column=args.messages_column, chat_template=args.chat_template,
                                 enable_thinking=args.enable_thinking)
    except ValueError as e:
        raise tiny_base_hint(e, args) from e
    print(table)
    return 0
