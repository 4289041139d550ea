"""`causal-adapter predict ADAPTER --data-file F [--output P.jsonl|P.csv] [--levels 0.5 0.9]`: the value
after every row's prompt, with its intervals, to a file (docs/predict.md).

Rows are read as `causal-adapter eval` reads them (jsonl / json / csv / tsv / parquet, the
``--prompt-column`` or, without one, the ``--text-column``). A row with a completion is predicted
where the evaluation scores it: the prompt followed by the completion's text before its first
number (the corpora write ``"1979:"`` + ``" 155.4"``: the value is read after ``"1979: "``). A row of
``--messages-column`` (a conversation) is rendered with the chat template: after its generation prompt,
or, when it ends with the assistant's reply, where that reply's first number stands
(`data.conversations.inference_prompt`). A bad row (no string, an empty prompt, bad messages, longer than
the model's context) gets one line on stderr and is skipped; the ``row`` column (the row's index in the
input, from 0) keeps the output joinable.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from pathlib import Path
from typing import Any, Sequence

import torch

from ..data.conversations import check_chat_template, inference_prompt
from ..data.pipeline import load_text_dataset
from ..modeling.adaptive import DEFAULT_GAMMA, adaptive_interval
from ..modeling.families import text_config
from ..modeling.horizon import (DEFAULT_PATHS, MAX_HORIZON, check_continuations, check_horizon, check_paths,
                                step_intervals)
from ..modeling.prediction import check_levels, level_name, prediction_columns
from ..numbers import NumberTokenizer, find_numbers
from ..saving.artifacts import atomic_write_file
from ..model import CausalModel
from .parser import (
    CLIError,
    adapter_argument,
    add_adapter_arguments,
    add_base_arguments,
    add_chat_arguments,
    add_column_arguments,
    chat_template_from_args,
    load_base_from_args,
    tiny_base_hint,
)

OUTPUT_FORMATS = (".jsonl", ".csv")


def output_format(output: str | None) -> str:
    """"jsonl" or "csv" from the --output file's extension (None: jsonl on stdout)."""
    if output is None:
        return "jsonl"
    suffix = Path(output).suffix.lower()
    if suffix not in OUTPUT_FORMATS:
        raise ValueError(f"--output {output!r}: give a .jsonl or .csv file name (or no --output: jsonl on stdout)")
    return suffix[1:]


def _lead(completion: Any) -> str:
    """The completion's text before its first number ("" without a completion or a number)."""
    if not isinstance(completion, str):
        return ""
    numbers = find_numbers(completion)
    return completion[:numbers[0].start] if numbers else ""


def row_prompts(dataset, prompt_column: str = "prompt", text_column: str = "text",
                completion_column: str | None = "completion", max_tokens: int | None = None, ntok=None, *,
                messages_column: str = "messages", tokenizer=None, chat_template: str | None = None,
                enable_thinking: bool = False, to_first_number: bool = True
                ) -> tuple[list[int], list[str], list[str]]:
    """(row indices, prompts, one message per bad row) of a loaded dataset.

    A row whose `messages_column` holds a conversation is rendered with the chat template
    (`conversations.inference_prompt`: the generation prompt; after a final assistant reply, with
    `to_first_number` its text before its first number, else the whole reply to continue); any other row uses
    the prompt column (with `completion_column`, the completion's text before its first number) or the text
    column. `tokenizer` (default: `ntok`'s) renders; a missing chat template is an error before any row."""
    cols = list(dataset.column_names)
    column = prompt_column if prompt_column in cols else text_column if text_column in cols else None
    chats = dataset[messages_column] if messages_column in cols else None
    if column is None and chats is None:
        names = " or ".join(repr(c) for c in dict.fromkeys((messages_column, prompt_column, text_column)))
        raise ValueError(f"the data has no {names} column; columns present: {cols} (name yours with "
                         "--messages-column / --prompt-column" + (" / --text-column)" if text_column != prompt_column
                                                                  else ")"))
    if chats is not None and any(m is not None for m in chats):
        tokenizer = tokenizer if tokenizer is not None else getattr(ntok, "tokenizer", None)
        check_chat_template(tokenizer, chat_template, enable_thinking)
    texts = dataset[column] if column is not None else [None] * len(dataset)
    completions = (dataset[completion_column] if column == prompt_column and completion_column is not None
                   and completion_column in cols else None)
    tools = dataset["tools"] if chats is not None and "tools" in cols else None
    rows, prompts, bad = [], [], []
    for i, text in enumerate(texts):
        if chats is not None and chats[i] is not None:
            try:
                prompt = inference_prompt(tokenizer, chats[i], to_first_number=to_first_number,
                                          enable_thinking=enable_thinking, chat_template=chat_template,
                                          tools=None if tools is None else tools[i], row=i, column=messages_column)
            except ValueError as e:
                bad.append(f"{e}: skipped")
                continue
        elif column is None:
            bad.append(f"row {i}: column {messages_column!r} is null: skipped")
            continue
        elif not isinstance(text, str) or not text:
            what = "is null" if text is None else "is empty" if text == "" else f"is not a string ({text!r:.40})"
            bad.append(f"row {i}: column {column!r} {what}: skipped")
            continue
        else:
            prompt = text + (_lead(completions[i]) if completions is not None else "")
        if max_tokens is not None and ntok is not None:
            n = len(ntok.encode_batch([prompt], return_offsets=False)[0].input_ids)
            if n > max_tokens:
                bad.append(f"row {i}: the prompt has {n} tokens, more than the model's {max_tokens} positions: skipped")
                continue
        rows.append(i)
        prompts.append(prompt)
    return rows, prompts, bad


def flat_horizon(records: Sequence[dict], columns: Sequence[str]) -> tuple[list[dict], list[str]]:
    """csv rows of horizon records: the list ``horizon`` flattened into ``h<step>_value``, ``h<step>_lower_50``, ...
    columns (step by step, in the list's key order)."""
    if "horizon" not in columns:
        return list(records), list(columns)
    keys = [k for k in records[0]["horizon"][0] if k != "step"] if records else []
    steps = len(records[0]["horizon"]) if records else 0
    flat_cols = [c for c in columns if c != "horizon"] + [f"h{h}_{k}" for h in range(1, steps + 1) for k in keys]
    rows = []
    for r in records:
        row = {c: r[c] for c in columns if c != "horizon"}
        for s in r["horizon"]:
            row.update({f"h{s['step']}_{k}": s[k] for k in keys})
        rows.append(row)
    return rows, flat_cols


def write_predictions(records: Sequence[dict], columns: Sequence[str], output: str | None) -> None:
    """jsonl (stdout when `output` is None) or csv, written atomically (a horizon's list flattened: `flat_horizon`)."""
    fmt = output_format(output)

    def write(fh) -> None:
        if fmt == "csv":
            rows, cols = flat_horizon(records, columns)
            writer = csv.DictWriter(fh, fieldnames=cols, lineterminator="\n")
            writer.writeheader()
            writer.writerows(rows)
        else:
            for r in records:
                fh.write(json.dumps({k: r[k] for k in columns}) + "\n")

    if output is None:
        write(sys.stdout)
        sys.stdout.flush()
    else:
        atomic_write_file(output, write)


def row_targets(dataset, column: str, rows: Sequence[int]) -> list[float]:
    """The float target of each of `rows` from `column` (nan where a row has none: no update)."""
    if column not in dataset.column_names:
        raise ValueError(f"--targets-column {column!r} is not a column of the data; columns present: "
                         f"{list(dataset.column_names)}")
    values = dataset[column]
    out = []
    for i in rows:
        try:
            out.append(float(values[i]) if values[i] not in (None, "") else math.nan)
        except (TypeError, ValueError):
            raise ValueError(f"row {i}: --targets-column {column!r} holds {values[i]!r:.40}, not a number") from None
    return out


def adapt_intervals(model, records: list[dict], targets: Sequence[float], levels: Sequence[float],
                    gamma: float = DEFAULT_GAMMA) -> None:
    """Replace each record's ``lower_<L>`` / ``upper_<L>`` by the adaptive conformal interval
    (`modeling.adaptive`): the records are the rows in file order, and row t's interval uses only the
    targets of the rows before it. Adds ``target``."""
    # the intervals adapt on the head's scale (log y for a log head; a "series" head's rows each their own), then
    # map to the value
    vm = model.value_map.rows(torch.tensor([r.get("transform") == "log" for r in records]))
    loc = vm.to_head(torch.tensor([r["value"] for r in records], dtype=torch.float64))
    scale = [r["scale"] for r in records]
    calibration = model.causal_config.value_calibration
    heads_targets = vm.to_head(torch.tensor(list(targets), dtype=torch.float64))
    for q in levels:
        lo, hi = adaptive_interval(heads_targets, loc, scale, q, calibration, gamma=gamma)
        lo, hi = vm.to_value(lo), vm.to_value(hi)
        n = level_name(q)
        for r, a, b in zip(records, lo.tolist(), hi.tolist()):
            r[f"lower_{n}"], r[f"upper_{n}"] = a, b
    for r, y in zip(records, targets):
        r["target"] = y


def row_continuations(dataset, rows: Sequence[int], column: str = "continuations") -> list[list[str] | None] | None:
    """The `column` entry of each of `rows` (None where a row has none; None without the column): the texts before
    values 2..H of a horizon, checked by `modeling.horizon.check_continuations`."""
    if column not in dataset.column_names:
        return None
    values = dataset[column]
    return [values[i] for i in rows]


def horizon_notes(model, horizon: int) -> list[str]:
    """What the adapter's per-step calibration covers for `horizon` (stderr lines; none when it covers it all)."""
    kinds = step_intervals(model.causal_config, horizon)[1:]  # steps 2..H (step 1 is predict's own row)
    if "raw" in kinds:
        return [f"predict: the adapter has no per-step calibration (train it with validation rows whose completion "
                f"holds several values): steps 2..{horizon} give the paths' raw intervals"]
    if "widened" in kinds:
        covered = kinds.index("widened") + 1
        return [f"predict: validation covered steps 1..{covered}; the intervals of steps {covered + 1}..{horizon} are "
                f"step {covered}'s widened by sqrt(step / {covered}) (docs/predict.md, \"A horizon\")"]
    return []


def predict_files(model, tokenizer, data_files: Sequence[str], output: str | None = None,
                  levels: Sequence[float] = (0.5, 0.9), batch_size: int = 16, prompt_column: str = "prompt",
                  text_column: str = "text", completion_column: str = "completion", progress: bool = True,
                  targets_column: str | None = None, gamma: float = DEFAULT_GAMMA, messages_column: str = "messages",
                  chat_template: str | None = None, enable_thinking: bool = False, horizon: int | None = None,
                  paths: int = DEFAULT_PATHS, seed: int = 0) -> dict:
    """Predict every row of `data_files` with `model` and write the rows; returns counts
    {"rows", "written", "skipped"}. Bad rows are reported on stderr, one line each. With `targets_column`
    the rows are taken as ordered (file order) and the intervals adapt online to the targets seen so far
    (`adapt_intervals`, step size `gamma`). Rows with a conversation in `messages_column` are rendered with
    the chat template (`chat_template`: its text; default the tokenizer's) as `row_prompts` says. With `horizon` H:
    each row also gets ``horizon``, its H values with their intervals from `paths` sample paths
    (`CausalModel.predict_horizon`, the paths' draws seeded by `seed`), the row's ``continuations`` column (a list of
    H - 1 texts, or null) giving the text before values 2..H."""
    from tqdm.auto import tqdm

    output_format(output)  # a bad --output fails before any work
    if horizon is not None:
        check_horizon(horizon)
        check_paths(paths)
        if targets_column:
            raise ValueError("--targets-column (adaptive one-step intervals) and --horizon cannot be combined")
    columns = prediction_columns(levels) + (["target"] if targets_column else []) + (["horizon"] if horizon else [])
    dataset = load_text_dataset(list(data_files), string_columns=(text_column, prompt_column, completion_column))
    ntok = NumberTokenizer(tokenizer, model.num_token_id)
    max_tokens = getattr(text_config(model.backbone), "max_position_embeddings", None)
    rows, prompts, bad = row_prompts(dataset, prompt_column, text_column, completion_column, max_tokens, ntok,
                                     messages_column=messages_column, tokenizer=tokenizer, chat_template=chat_template,
                                     enable_thinking=enable_thinking)
    targets = row_targets(dataset, targets_column, rows) if targets_column else None
    for line in bad:
        print(line, file=sys.stderr)
    if not prompts:
        raise ValueError(f"no row of {list(data_files)} could be predicted ({len(bad)} bad rows, see above)")
    conts = None
    if horizon is not None:  # a bad row fails here, before any work
        conts = row_continuations(dataset, rows)
        try:
            check_continuations(conts, prompts, horizon)
        except ValueError as e:
            raise ValueError(_file_row(str(e), rows)) from None
    with tqdm(total=len(prompts), desc="predict", unit="row", disable=not progress, file=sys.stderr) as bar:
        if horizon is None:
            records = model.predict_values(prompts, tokenizer=ntok, levels=levels, batch_size=batch_size,
                                           progress=bar.update)
        else:
            try:
                records = model.predict_horizon(prompts, tokenizer=ntok, horizon=horizon, paths=paths, levels=levels,
                                                continuations=conts, seed=seed, batch_size=batch_size,
                                                progress=bar.update)
            except ValueError as e:  # name the row as the input file numbers it
                raise ValueError(_file_row(str(e), rows)) from None
            for line in horizon_notes(model, horizon):
                print(line, file=sys.stderr)
    for r, i in zip(records, rows):
        r["row"] = i
    if targets is not None:
        adapt_intervals(model, records, targets, check_levels(levels), gamma)
    write_predictions(records, columns, output)
    return {"rows": len(dataset), "written": len(records), "skipped": len(bad)}


def _file_row(message: str, rows: Sequence[int]) -> str:
    """"row i: ..." of `predict_horizon` (i among the predicted prompts) -> the row's index in the input file."""
    if message.startswith("row "):
        head, _, rest = message.partition(":")
        try:
            return f"row {rows[int(head[4:])]}:{rest}"
        except (ValueError, IndexError):
            return message
    return message


# ---------------------------------------------------------------------------- the command
def add_parser(sub, **fmt) -> None:
    p = sub.add_parser("predict", help="the value after every row of data files, with calibrated intervals", **fmt)
    add_adapter_arguments(p)
    add_base_arguments(p)
    p.add_argument("--data-file", nargs="+", required=True,
                   help="jsonl/csv/parquet files with a prompt (+ optional completion), a text or a messages column")
    add_column_arguments(p)
    add_chat_arguments(p)
    p.add_argument("--output", default=None, help="P.jsonl or P.csv (written atomically); default: jsonl on stdout")
    p.add_argument("--levels", nargs="+", type=float, default=[0.5, 0.9],
                   help="interval levels: columns lower_<100*level> / upper_<100*level>")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--targets-column", default=None,
                   help="ordered data: the column of the true values; rows are taken in file order and each row's "
                        "lower_/upper_ interval adapts to the earlier rows' targets (adaptive conformal inference); "
                        "adds a target column")
    p.add_argument("--horizon", type=int, default=None,
                   help=f"forecast H values per row (1..{MAX_HORIZON}): each row gains 'horizon', H objects "
                        "{step, value, lower_50, upper_50, ...}; a row's 'continuations' column (H - 1 texts: the "
                        "known labels before values 2..H) is written between the values, else the model writes it")
    p.add_argument("--paths", type=int, default=DEFAULT_PATHS,
                   help="with --horizon: causal-sampling paths per row that give the intervals (>= 20)")
    p.add_argument("--seed", type=int, default=0, help="with --horizon: the seed of the paths' draws")
    p.add_argument("--aci-gamma", type=float, default=DEFAULT_GAMMA,
                   help=f"step size of the adaptive intervals with --targets-column (default {DEFAULT_GAMMA})")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    adapter = adapter_argument(args, "predict")
    output_format(args.output)
    check_levels(args.levels)
    chat_template = chat_template_from_args(args)
    if args.batch_size < 1:
        raise CLIError(f"--batch-size must be a positive integer, got {args.batch_size}")
    if args.horizon is not None:
        try:
            check_horizon(args.horizon)
            check_paths(args.paths)
        except ValueError as e:
            raise CLIError(f"--horizon / --paths: {e}") from None
        if args.targets_column:
            raise CLIError("--targets-column (adaptive one-step intervals) and --horizon cannot be combined")
    base, tokenizer = load_base_from_args(args)
    try:
        model = CausalModel.from_pretrained(base, adapter, tokenizer=tokenizer)
    except ValueError as e:
        raise tiny_base_hint(e, args) from e
    counts = predict_files(model, tokenizer, args.data_file, output=args.output, levels=args.levels,
                           batch_size=args.batch_size, prompt_column=args.prompt_column,
                           text_column=args.text_column, completion_column=args.completion_column,
                           targets_column=args.targets_column, gamma=args.aci_gamma,
                           messages_column=args.messages_column, chat_template=chat_template,
                           enable_thinking=args.enable_thinking, horizon=args.horizon, paths=args.paths,
                           seed=args.seed)
    where = args.output or "stdout"
    print(f"predict: {counts['written']} of {counts['rows']} rows written to {where}"
          + (f" ({counts['skipped']} skipped, see above)" if counts["skipped"] else ""), file=sys.stderr)
    return 0
