"""Console entry point: `causal-adapter <command> --help`.

    demo      the main job on the embedded default: train, evaluate, save, reload, generate, plot
    train     fine-tune an adapter (also: accelerate launch -m causal_adapter.train ...)
    eval      evaluate a saved adapter on a corpus split or files, with the baselines
    generate  text in, text with numbers (and intervals) out
    predict   the value after every row of data files, with calibrated intervals, to jsonl / csv
    verify    the initialization report for a base model
    data      write an offline corpus as jsonl files

A user error (a missing file, a bad flag value, an incompatible adapter, an unreachable hub)
ends in one or two lines and a non-zero exit status; --debug (or CAUSAL_ADAPTER_DEBUG=1)
shows the full traceback instead.
"""
from __future__ import annotations

import argparse
import contextlib
import difflib
import os
import re
import shutil
import sys
import threading
from pathlib import Path

from .assets import DTYPES, load_base

DEFAULT_TEXT = "In 1749 the yearly sunspot number was 80.9; in 1750 it was 83.4, and the price was 99.9 yuan."
_CLI_DTYPES = sorted(set(DTYPES) - {"float16"})  # --dtype of demo / eval / generate / verify
DEBUG_ENV = "CAUSAL_ADAPTER_DEBUG"
DEBUG_HELP = f"show the full traceback of an error (also: {DEBUG_ENV}=1)"
HUB_TIMEOUT_S = 10.0
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
_USER_ERRORS = (OSError, ValueError, ImportError, LookupError, FloatingPointError)
_CHECKED_BASES: set[str] = set()


class CLIError(Exception):
    """A user error whose message already names the problem and the fix (printed without a traceback)."""


# ---------------------------------------------------------------------------- parsers
class ShortErrorsMixin:
    """argparse errors in two lines (the problem, a suggestion / where to look) instead of the whole
    usage; abbreviated flags are refused (allow_abbrev=False)."""

    def error(self, message: str):  # noqa: D401 - argparse API
        hint = ""
        m = re.match(r"unrecognized arguments: (.*)", message)
        if m:
            options = [s for a in self._actions for s in a.option_strings if s.startswith("--")]
            for arg in (a.split("=", 1)[0] for a in m.group(1).split() if a.startswith("--")):
                close = sorted(o for o in options if o.startswith(arg)) or difflib.get_close_matches(arg, options, 1)
                if close:  # an abbreviation (refused) or a typo
                    hint = f"did you mean {' or '.join(close[:3])}? "
                    break
        self.exit(2, f"{self.prog}: error: {message}\n{hint}(see: {self.prog} --help)\n")


class CliParser(ShortErrorsMixin, argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)


def add_debug_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP)


def add_base_arguments(p: argparse.ArgumentParser) -> None:
    """The base-model flags every command shares (the same names as `causal-adapter train`'s)."""
    p.add_argument("--base", "--base-model", dest="base", default=None,
                   help="local Qwen directory or cached hub name (default: the embedded tiny Qwen, offline)")
    p.add_argument("--tiny-arch", "--arch", dest="arch", default="qwen2", choices=["qwen2", "qwen3"],
                   help="architecture of the embedded tiny base")
    p.add_argument("--tiny-hidden-size", type=int, default=64, help="hidden size of the embedded tiny base")
    p.add_argument("--tiny-layers", type=int, default=2, help="layers of the embedded tiny base")
    p.add_argument("--dtype", "--torch-dtype", dest="dtype", default="float32", choices=_CLI_DTYPES)
    add_debug_argument(p)


def add_column_arguments(p: argparse.ArgumentParser) -> None:
    """The data-column flags of every command that reads data files (as `causal-adapter train`)."""
    p.add_argument("--text-column", default="text", help="column of full texts (loss on every token)")
    p.add_argument("--prompt-column", default="prompt", help="prompt column (no loss)")
    p.add_argument("--completion-column", default="completion", help="completion column (loss)")


# ---------------------------------------------------------------------------- checks before any work
def _truthy(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def check_base(base: str | None, flag: str = "--base") -> None:
    """Fail fast, in one line, on a base model that cannot load: a missing folder, a folder that
    is not a checkpoint, a hub name that is neither cached nor reachable (no 50 s of retries)."""
    if base is None or base in _CHECKED_BASES:
        return
    what = f"{flag} {base!r}"
    fix = "give the folder of a saved Qwen checkpoint (config.json + *.safetensors) or a hub name such as Qwen/Qwen2.5-0.5B"
    path = Path(base).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise CLIError(f"{what} is a folder without config.json, not a model checkpoint: {fix}")
        return
    if path.exists():
        raise CLIError(f"{what} is a file, not a model folder: {fix}")
    if base.startswith((".", "/", "~")) or not _HUB_ID.fullmatch(base):  # a path, not a hub id
        raise CLIError(f"{what}: no such folder: {fix}")
    _check_hub(base, what)
    _CHECKED_BASES.add(base)  # a hub name is looked up once per process


def _check_hub(name: str, what: str) -> None:
    try:
        from huggingface_hub import try_to_load_from_cache

        if isinstance(try_to_load_from_cache(name, "config.json"), str):
            return
    except Exception:  # noqa: BLE001 - an invalid repo id: the lookup below names the problem
        pass
    if _truthy("HF_HUB_OFFLINE") or _truthy("TRANSFORMERS_OFFLINE"):
        raise CLIError(f"{what} is not a local folder nor in the hub cache, and HF_HUB_OFFLINE is set: "
                       f"download it once with network (hf download {name}) or give a local folder")
    result: dict = {}

    def probe() -> None:
        try:
            from huggingface_hub import HfApi

            HfApi().model_info(name, timeout=HUB_TIMEOUT_S / 2)
        except Exception as e:  # noqa: BLE001 - classified below
            result["error"] = e

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(HUB_TIMEOUT_S)
    err = result.get("error")
    if thread.is_alive():
        err = TimeoutError(f"no answer within {HUB_TIMEOUT_S:.0f} s")
    if err is None:
        return
    kind = type(err).__name__
    if kind == "GatedRepoError":
        raise CLIError(f"{what} is a gated model: accept its licence on huggingface.co and log in (hf auth login)")
    if kind in ("RepositoryNotFoundError", "HFValidationError"):
        raise CLIError(f"{what}: no such model on the Hugging Face hub (or a private one: log in with "
                       f"hf auth login) and no such local folder: check the name or give the folder of a downloaded checkpoint")
    raise CLIError(f"{what} is not a local folder nor in the hub cache, and the hub cannot be reached "
                   f"({kind}): connect to the network, or give the folder of a downloaded checkpoint")


def existing_outputs(out_dir: str | os.PathLike, names: tuple[str, ...]) -> list[str]:
    """The entries of `names` (globs) present in `out_dir`: the outputs a new run would replace."""
    out = Path(out_dir)
    if not out.is_dir():
        return []
    return sorted({p.name for pattern in names for p in out.glob(pattern)})


def refuse_overwrite(out_dir: str | os.PathLike, found: list[str], extra: str = "") -> None:
    if found:
        shown = ", ".join(found[:4]) + (", ..." if len(found) > 4 else "")
        raise CLIError(f"{str(out_dir)!r} already holds the outputs of a previous run ({shown}): pass --overwrite "
                       f"to replace them{extra}, or choose another --output-dir")


@contextlib.contextmanager
def remove_if_left_empty(path: str | os.PathLike):
    """A folder created by a command that then failed before writing any file is removed again."""
    path = Path(path)
    existed = path.exists()
    try:
        yield
    except BaseException:
        if not existed and path.is_dir() and not any(p.is_file() for p in path.rglob("*")):
            shutil.rmtree(path, ignore_errors=True)
        raise


# ---------------------------------------------------------------------------- loading
def _base_kwargs(args: argparse.Namespace) -> dict:
    return dict(arch=args.arch, dtype=args.dtype, hidden_size=args.tiny_hidden_size, num_layers=args.tiny_layers)


def tiny_base_hint(error: Exception, args: argparse.Namespace) -> Exception:
    """An adapter/base mismatch on the embedded tiny base: say which tiny-base flag fixes it."""
    m = re.search(r"was made for (hidden_size|model_type)=(\S+?),", str(error))
    if args.base is not None or not m:
        return error
    flag = "--tiny-hidden-size " + m.group(2) if m.group(1) == "hidden_size" else "--tiny-arch " + m.group(2).strip("'")
    return CLIError(f"{error}: pass {flag} (and the --tiny-layers it was trained with), or --base with its base model")


# ---------------------------------------------------------------------------- commands
def cmd_verify(args: argparse.Namespace) -> int:
    from .config import CausalAdapterConfig
    from .model import get_causal_model
    from .verify import verify_initialization

    check_base(args.base)
    base, tokenizer = load_base(args.base, **_base_kwargs(args))
    model = get_causal_model(base, CausalAdapterConfig(), tokenizer=tokenizer)
    model.print_trainable_parameters()
    ids = tokenizer(args.text, return_tensors="pt")["input_ids"]
    report = verify_initialization(model, base, ids)
    print(report)
    tol = 1e-4 if args.dtype != "bfloat16" else 5e-2
    ok = report["feature_diff"] == 0.0 and report["logits_rel_diff"] <= tol and report["greedy_agreement"] == 1.0
    print("initialization check:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


def _read_prompts(args: argparse.Namespace) -> list[str]:
    if args.prompt:
        return args.prompt
    if sys.stdin is None or sys.stdin.isatty():
        raise CLIError('no prompt: give it as an argument (causal-adapter generate "The price was") '
                       "or pipe it in (echo 'The price was' | causal-adapter generate)")
    text = sys.stdin.read()
    if not text.strip():
        raise CLIError("no prompt: stdin was empty; give the prompt as an argument or pipe a non-empty text in")
    return [text]


def cmd_generate(args: argparse.Namespace) -> int:
    from .model import CausalModel, get_causal_model

    prompts = _read_prompts(args)
    check_base(args.base)
    base, tokenizer = load_base(args.base, **_base_kwargs(args))
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
    for prompt, text, numbers in zip(prompts, out.texts, out.numbers):
        print(prompt + text)
        for n in numbers:
            lo50, hi50 = n["interval_50"]
            lo90, hi90 = n["interval_90"]
            print(f"  <NUM> {n['text']}: loc_Y={n['loc']:.4g} scale_Y={n['scale']:.3g} "
                  f"50% [{lo50:.4g}, {hi50:.4g}] 90% [{lo90:.4g}, {hi90:.4g}]")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from .evaluate import evaluate_adapter

    args.adapter = _adapter_argument(args, "eval")
    check_base(args.base)
    try:
        table = evaluate_adapter(args.adapter, base=args.base, arch=args.arch, dtype=args.dtype, corpus=args.corpus,
                                 split=args.split, data_files=args.data_file, batch_size=args.batch_size,
                                 output=args.output, tiny_hidden_size=args.tiny_hidden_size,
                                 tiny_layers=args.tiny_layers, text_column=args.text_column,
                                 prompt_column=args.prompt_column, completion_column=args.completion_column)
    except ValueError as e:
        raise tiny_base_hint(e, args) from e
    print(table)
    return 0


def _adapter_argument(args: argparse.Namespace, command: str) -> str:
    if (args.adapter is None) == (args.adapter_flag is None):
        raise CLIError(f"give the adapter directory once: causal-adapter {command} DIR (or --adapter DIR)")
    return args.adapter or args.adapter_flag


def cmd_predict(args: argparse.Namespace) -> int:
    from .model import CausalModel
    from .predict_command import output_format, predict_files
    from .prediction import check_levels

    adapter = _adapter_argument(args, "predict")
    output_format(args.output)
    check_levels(args.levels)
    if args.batch_size < 1:
        raise CLIError(f"--batch-size must be a positive integer, got {args.batch_size}")
    check_base(args.base)
    base, tokenizer = load_base(args.base, **_base_kwargs(args))
    try:
        model = CausalModel.from_pretrained(base, adapter, tokenizer=tokenizer)
    except ValueError as e:
        raise tiny_base_hint(e, args) from e
    counts = predict_files(model, tokenizer, args.data_file, output=args.output, levels=args.levels,
                           batch_size=args.batch_size, prompt_column=args.prompt_column,
                           text_column=args.text_column, completion_column=args.completion_column)
    where = args.output or "stdout"
    print(f"predict: {counts['written']} of {counts['rows']} rows written to {where}"
          + (f" ({counts['skipped']} skipped, see above)" if counts["skipped"] else ""), file=sys.stderr)
    return 0


DEMO_OUTPUTS = ("demo_metrics.md", "demo_metrics.json", "train")


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    check_base(args.base)
    if not args.overwrite:
        refuse_overwrite(args.output_dir, existing_outputs(args.output_dir, DEMO_OUTPUTS))
    with remove_if_left_empty(args.output_dir):
        return run_demo(output_dir=args.output_dir, steps=args.steps, base=args.base, arch=args.arch, seed=args.seed,
                        batch_size=args.batch_size, learning_rate=args.learning_rate, lora=args.lora,
                        dtype=args.dtype, tiny_hidden_size=args.tiny_hidden_size, tiny_layers=args.tiny_layers)


def build_parser() -> argparse.ArgumentParser:
    ap = CliParser(prog="causal-adapter", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_debug_argument(ap)
    sub = ap.add_subparsers(dest="command", required=True, parser_class=CliParser)
    ap.commands = sub.choices  # name -> subparser: an unknown flag is reported by its command's parser
    fmt = {"formatter_class": argparse.ArgumentDefaultsHelpFormatter}

    p = sub.add_parser("demo", help="train, evaluate, save, reload and generate on the embedded default", **fmt)
    add_base_arguments(p)
    p.add_argument("--output-dir", default="causal_adapter_demo")
    p.add_argument("--overwrite", action="store_true", help="replace the outputs of a previous run in --output-dir")
    p.add_argument("--steps", "--max-steps", dest="steps", type=int, default=200, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--learning-rate", type=float, default=1e-2)
    p.add_argument("--lora", action="store_true", help="LoRA on the backbone instead of a frozen backbone")
    p.add_argument("--seed", type=int, default=42)
    p.set_defaults(func=cmd_demo)

    # train / data own their flags: main() hands them the rest of the command line
    sub.add_parser("train", add_help=False, help="fine-tune an adapter (flags: causal-adapter train --help)")

    p = sub.add_parser("eval", help="evaluate a saved adapter against the constant and persistence baselines", **fmt)
    p.add_argument("adapter", nargs="?", default=None,
                   help="adapter directory (causal_adapter_config.json + causal_adapter_model.safetensors); or --adapter DIR")
    p.add_argument("--adapter", dest="adapter_flag", metavar="DIR", default=None, help="the same, as a flag")
    add_base_arguments(p)
    p.add_argument("--corpus", default="sunspots", help="built-in corpus (ignored with --data-file)")
    p.add_argument("--split", default="test", choices=["train", "validation", "test"])
    p.add_argument("--data-file", nargs="+", default=None, help="jsonl/csv/parquet files with prompt/completion or text")
    add_column_arguments(p)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--output", default=None, help="also write the table (.md) / metrics (.json) here")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("generate", help="generate text with numbers from a prompt", **fmt)
    p.add_argument("prompt", nargs="*", help="prompt(s); read from a pipe on stdin when none is given")
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

    p = sub.add_parser("predict", help="the value after every row of data files, with calibrated intervals", **fmt)
    p.add_argument("adapter", nargs="?", default=None, help="adapter directory; or --adapter DIR")
    p.add_argument("--adapter", dest="adapter_flag", metavar="DIR", default=None, help="the same, as a flag")
    add_base_arguments(p)
    p.add_argument("--data-file", nargs="+", required=True,
                   help="jsonl/csv/parquet files with a prompt (+ optional completion) or a text column")
    add_column_arguments(p)
    p.add_argument("--output", default=None, help="P.jsonl or P.csv (written atomically); default: jsonl on stdout")
    p.add_argument("--levels", nargs="+", type=float, default=[0.5, 0.9],
                   help="interval levels: columns lower_<100*level> / upper_<100*level>")
    p.add_argument("--batch-size", type=int, default=16)
    p.set_defaults(func=cmd_predict)

    p = sub.add_parser("verify", help="check that a fresh adapter reproduces its base model", **fmt)
    add_base_arguments(p)
    p.add_argument("--text", default=DEFAULT_TEXT, help="text to compare on")
    p.set_defaults(func=cmd_verify)

    sub.add_parser("data", add_help=False, help="write an offline corpus as jsonl (flags: causal-adapter data --help)")
    return ap


def _dispatch(argv: list[str]) -> int:
    if argv[:1] == ["train"]:
        from .train import main as train_main

        return train_main(argv[1:])
    if argv[:1] == ["data"]:
        from .corpora import main as corpora_main

        return corpora_main(argv[1:], prog="causal-adapter data")
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
    if not isinstance(e, (CLIError, *_USER_ERRORS)):
        msg += f"\n(unexpected {type(e).__name__}: rerun with --debug for the traceback)"
    return msg


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    debug = "--debug" in argv or _truthy(DEBUG_ENV)
    argv = [a for a in argv if a != "--debug"]
    command = next((a for a in argv if not a.startswith("-")), "")
    try:
        return _dispatch(argv)
    except KeyboardInterrupt:
        if debug:
            raise
        print("\ninterrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - the CLI's one place for errors
        if debug:
            raise
        prog = "causal-adapter" + (f" {command}" if command in ("demo", "train", "eval", "generate", "predict",
                                                                 "verify", "data") else "")
        print(f"{prog}: error: {error_message(e)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    from causal_adapter.cli import main as _main  # the package's module: one CLIError class, not __main__'s

    sys.exit(_main())
