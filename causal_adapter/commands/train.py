"""`causal-adapter train`: fine-tune an adapter (also under `accelerate launch -m causal_adapter train`).
Every flag is a `TrainConfig` field (transformers' HfArgumentParser), plus --config FILE, --overwrite, --debug."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any, Sequence

from accelerate import PartialState
from transformers import HfArgumentParser

from ..training.checkpoints import CHECKPOINT_PREFIX, list_checkpoints
from ..training.config import TrainConfig
from ..training.loop import ADAPTER_SUBDIR, FINAL_METRICS, METRICS_LOG, PLOT_NAME, train
from ..training.metrics import format_metrics_table
from .parser import (
    DEBUG_HELP,
    CliParser,
    DefaultsHelpFormatter,
    ShortErrorsMixin,
    check_base,
    existing_outputs,
    refuse_overwrite,
    remove_if_left_empty,
)


def add_parser(sub, **fmt) -> None:
    # `train` owns its flags: main() hands it the rest of the command line
    sub.add_parser("train", add_help=False, help="fine-tune an adapter (flags: causal-adapter train --help)")


def build_arg_parser(prog: str = "causal-adapter train"):
    """`transformers.HfArgumentParser` over `TrainConfig`: one flag per field (dashes or underscores,
    ``--no-x`` for booleans, no abbreviations), plus ``--config FILE``, ``--overwrite`` and ``--debug``."""
    class TrainArgumentParser(ShortErrorsMixin, HfArgumentParser):
        pass

    ap = TrainArgumentParser(TrainConfig, prog=prog, allow_abbrev=False, formatter_class=DefaultsHelpFormatter,
                             description="Fine-tune a causal adapter on a Qwen checkpoint (works under "
                                         "`accelerate launch`). Every flag is a TrainConfig field.")
    for action in ap._actions:  # --help and errors show the dashed spelling first, as the other commands
        action.option_strings.sort(key=lambda s: ("_" in s, s not in ("--base", "--dtype")))
    for f in dataclasses.fields(TrainConfig):
        if f.default is False:  # HfArgumentParser adds --no-x only to the booleans that default to True
            ap.add_argument("--no-" + f.name.replace("_", "-"), dest=f.name, action="store_false",
                            help=argparse.SUPPRESS)
    ap.add_argument("--config", metavar="FILE", default=None,
                    help="json or yaml file of TrainConfig fields; flags on the command line override it")
    ap.add_argument("--overwrite", action="store_true",
                    help="replace the outputs of a previous run in --output-dir instead of refusing")
    ap.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    return ap


def read_config_file(path: str | os.PathLike, parser=None) -> dict[str, Any]:
    """The TrainConfig fields of a json / yaml file (keys with underscores or dashes); errors name
    the file and the problem."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--config {str(path)!r}: no such file")
    text = p.read_text(encoding="utf-8")
    if p.suffix.lower() in (".yaml", ".yml"):
        import yaml  # PyYAML (a transformers dependency): only a yaml --config needs it

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f"line {mark.line + 1}: " if mark is not None else ""
            raise ValueError(f"--config {str(path)!r}: {where}not valid YAML ({getattr(e, 'problem', e)})") from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--config {str(path)!r}: line {e.lineno}: not valid JSON ({e.msg})") from None
    if not isinstance(data, dict):
        raise ValueError(f"--config {str(path)!r} must hold a mapping of TrainConfig fields, got {type(data).__name__}")
    data = {str(k).replace("-", "_"): v for k, v in data.items()}
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    allowed = set(fields) | ({a.dest for a in parser._actions} - {"help", "config"} if parser is not None else set())
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise ValueError(f"--config {str(path)!r}: unknown keys {unknown}; the keys are TrainConfig field names "
                         "(causal-adapter train --help)")
    for k, v in data.items():
        if k in fields and isinstance(v, str) and "list" in str(fields[k].type):
            data[k] = [v]
    return data


def parse_train_args(argv: Sequence[str] | None = None, prog: str = "causal-adapter train"):
    """(TrainConfig, namespace of the other flags) from a command line, through HfArgumentParser;
    ``--config FILE`` supplies the defaults. A bad value raises ValueError; a bad flag exits (2)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = build_arg_parser(prog)
    pre = CliParser(prog=ap.prog, add_help=False)
    pre.add_argument("--config", default=None)
    known, _ = pre.parse_known_args(argv)
    if known.config:
        ap.set_defaults(**read_config_file(known.config, ap))
    config, extras, rest = ap.parse_args_into_dataclasses(argv, return_remaining_strings=True,
                                                          look_for_args_file=False)
    if rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    return config, extras


def config_from_args(args) -> TrainConfig:
    return TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})


#: what a training run writes into its output directory (a new run refuses to replace them without --overwrite)
RUN_OUTPUTS = (ADAPTER_SUBDIR, METRICS_LOG, FINAL_METRICS, PLOT_NAME, CHECKPOINT_PREFIX + "*")


def main(argv: list[str] | None = None, prog: str = "causal-adapter train") -> int:
    """``causal-adapter train ...`` / ``python -m causal_adapter.commands.train ...``: train, print the
    validation table, return 0. Refuses (before any work) a base model that cannot load and an
    output directory that holds a previous run (unless --overwrite or --resume-from-checkpoint)."""
    try:
        config, extras = parse_train_args(argv, prog)
    except ValueError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    check_base(config.base_model, "--base")
    if config.tokenizer:
        check_base(config.tokenizer, "--tokenizer")
    if config.resume_from_checkpoint is None:
        if not extras.overwrite:
            refuse_overwrite(config.output_dir, existing_outputs(config.output_dir, RUN_OUTPUTS),
                             extra=", --resume-from-checkpoint latest to continue them")
        elif int(os.environ.get("RANK", "0") or 0) == 0:
            for old in list_checkpoints(config.output_dir):  # a stale checkpoint-N would pass for the newest
                shutil.rmtree(old, ignore_errors=True)
    with remove_if_left_empty(config.output_dir):
        result = train(None, config)
    if PartialState().is_main_process:
        if result.eval_metrics is not None:
            print(format_metrics_table(result.eval_metrics))
        print(f"steps: {result.global_step}  processes: {result.num_processes}  adapter: {result.adapter_dir}")
        print(f"log: {result.log_path}" + (f"  plot: {result.plot_path}" if result.plot_path else ""))
    # under `accelerate launch`: close the process group, as accelerate's end_training() does (a gloo group that
    # torch still holds lives on to the end of the process: saving/process_groups.py)
    PartialState().destroy_process_group()
    return 0
