"""`causal-adapter lm-eval ARGS`: EleutherAI's lm-evaluation-harness with ``--model causal_adapter`` registered
(docs/evaluate.md). Every argument is lm-eval's own (``lm-eval --help``); the model's are ``--model_args
base=...,adapter=DIR,mode=softmax|ovr`` (`integrations.lm_eval_harness`). Needs the eval extra:
``pip install "causal_adapter[eval]"``."""
from __future__ import annotations

from typing import Sequence

from ..integrations.lm_eval_harness import main as harness_main


def add_parser(sub, **fmt) -> None:
    # the arguments are lm-eval's: `main` hands them over unparsed (commands/main.py OWN_FLAGS)
    sub.add_parser("lm-eval", help="lm-evaluation-harness with --model causal_adapter (pip install "
                                   "'causal_adapter[eval]'); the arguments are lm-eval's", add_help=False)


def main(argv: Sequence[str], prog: str = "causal-adapter lm-eval") -> int:
    return harness_main(list(argv))
