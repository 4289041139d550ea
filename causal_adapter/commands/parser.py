"""What every command shares: the parser class (short errors, no abbreviations), the base-model, data and
adapter flags, and the checks made before any work (a base that cannot load, outputs a run would replace)."""
from __future__ import annotations

import argparse
import contextlib
import difflib
import os
import re
import shutil
from pathlib import Path

from ..data.conversations import read_chat_template
from ..saving.assets import DTYPES, load_base
from ..saving.hub import check_base, truthy  # noqa: F401 - the checks every command shares

CLI_DTYPES = sorted(DTYPES)  # --dtype of every command (train: TrainConfig.dtype, the same names)
DEBUG_ENV = "CAUSAL_ADAPTER_DEBUG"
DEBUG_HELP = f"show the full traceback of an error (also: {DEBUG_ENV}=1)"
USER_ERRORS = (OSError, ValueError, ImportError, LookupError, FloatingPointError)


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


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's "(default: X)" after a flag's help, except where the help already says what the default
    means or the default is None (no "(default: None)")."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or "(default" in (action.help or ""):
            return action.help or ""
        return super()._get_help_string(action)


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
    p.add_argument("--dtype", "--torch-dtype", dest="dtype", default="float32", choices=CLI_DTYPES)
    add_debug_argument(p)


def add_column_arguments(p: argparse.ArgumentParser) -> None:
    """The data-column flags of every command that reads data files (as `causal-adapter train`)."""
    p.add_argument("--text-column", default="text", help="column of full texts (loss on every token)")
    p.add_argument("--prompt-column", default="prompt", help="prompt column (no loss)")
    p.add_argument("--completion-column", default="completion", help="completion column (loss)")


def add_chat_arguments(p: argparse.ArgumentParser, messages_column: bool = True) -> None:
    """The conversation flags (the same names as `causal-adapter train`'s): how a ``messages`` row is rendered."""
    if messages_column:
        p.add_argument("--messages-column", default="messages",
                       help="column of conversations (lists of {role, content} messages), rendered with the chat template")
    p.add_argument("--enable-thinking", action="store_true",
                   help="render conversations with thinking on (Qwen3's switch; default off: the template's empty "
                        "think block, the reply after it)")
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a jinja chat-template file, for a base whose tokenizer has none (default: the tokenizer's)")


def chat_template_from_args(args: argparse.Namespace) -> str | None:
    """The text of --chat-template FILE (None without the flag); a missing or empty file is a CLIError."""
    if args.chat_template is None:
        return None
    try:
        return read_chat_template(args.chat_template)
    except ValueError as e:
        raise CLIError(str(e)) from None


# ---------------------------------------------------------------------------- checks before any work
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
def base_kwargs(args: argparse.Namespace) -> dict:
    return dict(arch=args.arch, dtype=args.dtype, hidden_size=args.tiny_hidden_size, num_layers=args.tiny_layers)


def tiny_base_hint(error: Exception, args: argparse.Namespace) -> Exception:
    """An adapter/base mismatch on the embedded tiny base: say which tiny-base flag fixes it."""
    m = re.search(r"was made for (hidden_size|model_type)=(\S+?),", str(error))
    if args.base is not None or not m:
        return error
    flag = "--tiny-hidden-size " + m.group(2) if m.group(1) == "hidden_size" else "--tiny-arch " + m.group(2).strip("'")
    return CLIError(f"{error}: pass {flag} (and the --tiny-layers it was trained with), or --base with its base model")


def adapter_argument(args: argparse.Namespace, command: str) -> str:
    """The adapter directory given once, as the positional argument or as --adapter."""
    if (args.adapter is None) == (args.adapter_flag is None):
        raise CLIError(f"give the adapter directory once: causal-adapter {command} DIR (or --adapter DIR)")
    return args.adapter or args.adapter_flag


def add_adapter_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("adapter", nargs="?", default=None,
                   help="adapter directory (causal_adapter_config.json + causal_adapter_model.safetensors); or --adapter DIR")
    p.add_argument("--adapter", dest="adapter_flag", metavar="DIR", default=None, help="the same, as a flag")


def load_base_from_args(args: argparse.Namespace):
    """(base model, tokenizer) named by the base-model flags, after check_base."""
    check_base(args.base)
    return load_base(args.base, **base_kwargs(args))

