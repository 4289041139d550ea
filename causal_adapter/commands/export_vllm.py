"""`causal-adapter export-vllm ADAPTER OUT`: the model folder `vllm serve` loads (docs/serve_at_scale.md).

The base checkpoint's files are linked into OUT, never copied; the adapter's heads come in their own file
(OUT/causal_adapter/); config.json names the plugin's class (`pip install "causal_adapter[vllm]"`). A LoRA adapter's
LoRA comes as peft's adapter folder (OUT/lora/), which vLLM's LoRA support serves on the base: the command prints
the flags, and requests name the LoRA module as their model. No vLLM import.
"""
from __future__ import annotations

import argparse
import shlex

from ..integrations.vllm.folder import DECISIONS, TOKENIZER_MODE, export_folder, serve_flags
from .parser import add_debug_argument


def add_parser(sub, **fmt) -> None:
    p = sub.add_parser("export-vllm", help="write a model folder that `vllm serve` loads (the vLLM plugin)", **fmt)
    p.add_argument("adapter", help="the saved adapter's directory")
    p.add_argument("out", help="the folder to write (new or empty)")
    p.add_argument("--base", default=None,
                   help="the base checkpoint's folder (default: the one the adapter records)")
    p.add_argument("--decision", default="softmax", choices=list(DECISIONS),
                   help="how greedy decoding picks a token: argmax loc_S (as generate --mode softmax) or argmax of "
                        "the OvR probability (as generate --mode deterministic)")
    p.add_argument("--overwrite", action="store_true", help="replace what OUT holds")
    add_debug_argument(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    out = export_folder(args.adapter, args.out, base=args.base, decision=args.decision, overwrite=args.overwrite)
    lora = serve_flags(out)
    print(f"wrote {out}: serve it with\n  vllm serve {out} --tokenizer-mode {TOKENIZER_MODE} --dtype float32"
          + "".join(f" {shlex.quote(f)}" for f in lora))
    if lora:
        print(f"  a LoRA adapter: request the model {lora[2].split('=')[0]!r} (the LoRA); the served base name "
              "runs the heads on the base without its LoRA")
    return 0
