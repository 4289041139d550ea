"""Console entry point: `causal-adapter <command> --help` (also `python -m causal_adapter <command>`).

    demo      the main job on the embedded default: train, evaluate, save, reload, generate, plot
    train     fine-tune an adapter (also: accelerate launch -m causal_adapter train ...)
    eval      evaluate a saved adapter on a corpus split or files, with the baselines
    generate  text in, text with numbers (and intervals) out
    predict   the value after every row of data files, with calibrated intervals, to jsonl / csv
    verify    the initialization report for a base model
    data      write an offline corpus as jsonl files
    serve     adapters on one base behind an OpenAI-compatible HTTP server (pip install "causal_adapter[serve]")
    export-vllm  a model folder `vllm serve` loads (pip install "causal_adapter[vllm]")
    lm-eval   lm-evaluation-harness with --model causal_adapter (pip install "causal_adapter[eval]")

A user error (a missing file, a bad flag value, an incompatible adapter, an unreachable hub)
ends in one or two lines and a non-zero exit status; --debug (or CAUSAL_ADAPTER_DEBUG=1)
shows the full traceback instead.
"""
from __future__ import annotations

import argparse
import sys

from ..saving.process_groups import exit_without_teardown, kept_gloo_groups
from . import data, demo, export_vllm, generate, harness, predict, serve, train, verify
from . import eval as eval_command  # not the builtin
from .parser import DEBUG_ENV, USER_ERRORS, CLIError, CliParser, DefaultsHelpFormatter, add_debug_argument, truthy

#: command name -> its module (add_parser(subparsers, **fmt); run(args), or main(argv) when it owns its flags)
COMMANDS = {"demo": demo, "train": train, "eval": eval_command, "generate": generate, "predict": predict, "verify": verify,
            "data": data, "serve": serve, "export-vllm": export_vllm, "lm-eval": harness}
OWN_FLAGS = ("train", "data", "lm-eval")  # handed the rest of the command line: their parsers own --help


def build_parser() -> argparse.ArgumentParser:
    ap = CliParser(prog="causal-adapter", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_debug_argument(ap)
    sub = ap.add_subparsers(dest="command", required=True, parser_class=CliParser)
    ap.commands = sub.choices  # name -> subparser: an unknown flag is reported by its command's parser
    for module in COMMANDS.values():
        module.add_parser(sub, formatter_class=DefaultsHelpFormatter)
    return ap


def dispatch(argv: list[str]) -> int:
    if argv[:1] and argv[0] in OWN_FLAGS:
        return COMMANDS[argv[0]].main(argv[1:], prog=f"causal-adapter {argv[0]}")
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if rest:
        parser.commands[args.command].error(f"unrecognized arguments: {' '.join(rest)}")
    return args.func(args)


def error_message(e: BaseException) -> str:
    """One or two lines for an error: its message; for an unexpected kind, where the traceback is."""
    msg = str(e).strip() or type(e).__name__
    if isinstance(e, OSError) and e.strerror and e.filename:  # not "[Errno 2] ..."
        msg = f"{e.strerror}: {e.filename}"
    lines = msg.splitlines()
    msg = lines[0] + (" ..." if len(lines) > 1 else "")
    if not isinstance(e, (CLIError, *USER_ERRORS)):
        msg += f"\n(unexpected {type(e).__name__}: rerun with --debug for the traceback)"
    return msg


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    debug = "--debug" in argv or truthy(DEBUG_ENV)
    argv = [a for a in argv if a != "--debug"]
    command = next((a for a in argv if not a.startswith("-")), "")
    try:
        return dispatch(argv)
    except KeyboardInterrupt:
        if debug:
            raise
        print("\ninterrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - the CLI's one place for errors
        if debug:
            raise
        prog = "causal-adapter" + (f" {command}" if command in COMMANDS else "")
        print(f"{prog}: error: {error_message(e)}", file=sys.stderr)
        return 1


def run_and_exit() -> None:
    """The console script and `python -m causal_adapter`: `main()`, then the process's exit. After a run that kept
    a gloo group (a CPU launch: saving/process_groups.py) the process ends without interpreter teardown, whose C++
    static destructors now and then raced the group's threads (SIGABRT after all the work was done)."""
    code = main()
    if kept_gloo_groups():
        exit_without_teardown(code)  # stdout and stderr flushed; train() closed its files and trackers
    sys.exit(code)


if __name__ == "__main__":
    from causal_adapter.commands.main import run_and_exit as _run  # the package's module: one CLIError class

    _run()
