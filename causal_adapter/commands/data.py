"""`causal-adapter data NAME OUT_DIR`: write an offline corpus as jsonl files (train / validation / test)."""
from __future__ import annotations

from typing import Any, Sequence

from ..data.corpora import ALL_CORPORA, write_corpus_jsonl
from .parser import CliParser, add_debug_argument


def add_parser(sub, **fmt) -> None:
    # `data` owns its flags: main() hands it the rest of the command line
    sub.add_parser("data", add_help=False, help="write an offline corpus as jsonl (flags: causal-adapter data --help)")


def main(argv: Sequence[str] | None = None, prog: str = "causal-adapter data") -> int:
    p = CliParser(prog=prog, description="write an offline numeric corpus as jsonl files")
    p.add_argument("name", choices=ALL_CORPORA)
    p.add_argument("out_dir")
    p.add_argument("--window", type=int, default=None,
                   help="history length (time-series corpora; chat: the longest window, default 48)")
    p.add_argument("--n", type=int, default=None, help="number of examples (arithmetic, units)")
    p.add_argument("--seed", type=int, default=0)
    add_debug_argument(p)
    a = p.parse_args(argv)
    kw: dict[str, Any] = {"seed": a.seed}
    if a.window is not None:
        kw["window"] = a.window
    if a.n is not None:
        if a.name not in ("arithmetic", "units"):
            p.error("--n only applies to the arithmetic and units corpora")
        kw["n"] = a.n
    for split, path in write_corpus_jsonl(a.name, a.out_dir, **kw).items():
        print(f"{split}\t{path}")
    return 0
