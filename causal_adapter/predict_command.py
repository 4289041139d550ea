"""`causal-adapter predict ADAPTER --data-file F [--output P.jsonl|P.csv] [--levels 0.5 0.9]`: the value
after every row's prompt, with its intervals, to a file (docs/predict.md).

Rows are read as `causal-adapter eval` reads them (jsonl / json / csv / tsv / parquet, the
``--prompt-column`` or, without one, the ``--text-column``). A row with a completion is predicted
where the evaluation scores it: the prompt followed by the completion's text before its first
number (the corpora write ``"1979:"`` + ``" 155.4"``: the value is read after ``"1979: "``). A bad
row (no string, an empty prompt, longer than the model's context) gets one line on stderr and is
skipped; the ``row`` column (the row's index in the input, from 0) keeps the output joinable.
"""
from __future__ import annotations

import csv
import json
import sys
from pathlib import Path
from typing import Any, Sequence

from .artifacts import atomic_write_file
from .numbers import find_numbers

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
                completion_column: str = "completion", max_tokens: int | None = None, ntok=None
                ) -> tuple[list[int], list[str], list[str]]:
    """(row indices, prompts, one message per bad row) of a loaded dataset."""
    cols = list(dataset.column_names)
    column = prompt_column if prompt_column in cols else text_column if text_column in cols else None
    if column is None:
        raise ValueError(f"the data has neither a {prompt_column!r} nor a {text_column!r} column; columns present: "
                         f"{cols} (name yours with --prompt-column / --text-column)")
    completions = dataset[completion_column] if column == prompt_column and completion_column in cols else None
    rows, prompts, bad = [], [], []
    for i, text in enumerate(dataset[column]):
        if not isinstance(text, str) or not text:
            what = "is null" if text is None else "is empty" if text == "" else f"is not a string ({text!r:.40})"
            bad.append(f"row {i}: column {column!r} {what}: skipped")
            continue
        prompt = text + (_lead(completions[i]) if completions is not None else "")
        if max_tokens is not None and ntok is not None:
            n = len(ntok.encode_batch([prompt], return_offsets=False)[0].input_ids)
            if n > max_tokens:
                bad.append(f"row {i}: the prompt has {n} tokens, more than the model's {max_tokens} positions: skipped")
                continue
        rows.append(i)
        prompts.append(prompt)
    return rows, prompts, bad


def write_predictions(records: Sequence[dict], columns: Sequence[str], output: str | None) -> None:
    """jsonl (stdout when `output` is None) or csv, written atomically."""
    fmt = output_format(output)

    def write(fh) -> None:
        if fmt == "csv":
            writer = csv.DictWriter(fh, fieldnames=list(columns), lineterminator="\n")
            writer.writeheader()
            writer.writerows(records)
        else:
            for r in records:
                fh.write(json.dumps({k: r[k] for k in columns}) + "\n")

    if output is None:
        write(sys.stdout)
        sys.stdout.flush()
    else:
        atomic_write_file(output, write)


def predict_files(model, tokenizer, data_files: Sequence[str], output: str | None = None,
                  levels: Sequence[float] = (0.5, 0.9), batch_size: int = 16, prompt_column: str = "prompt",
                  text_column: str = "text", completion_column: str = "completion", progress: bool = True) -> dict:
    """Predict every row of `data_files` with `model` and write the rows; returns counts
    {"rows", "written", "skipped"}. Bad rows are reported on stderr, one line each."""
    from tqdm.auto import tqdm

    from .data import load_text_dataset
    from .families import text_config
    from .numbers import NumberTokenizer
    from .prediction import prediction_columns

    output_format(output)  # a bad --output fails before any work
    columns = prediction_columns(levels)
    dataset = load_text_dataset(list(data_files), string_columns=(text_column, prompt_column, completion_column))
    ntok = NumberTokenizer(tokenizer, model.num_token_id)
    max_tokens = getattr(text_config(model.backbone), "max_position_embeddings", None)
    rows, prompts, bad = row_prompts(dataset, prompt_column, text_column, completion_column, max_tokens, ntok)
    for line in bad:
        print(line, file=sys.stderr)
    if not prompts:
        raise ValueError(f"no row of {list(data_files)} could be predicted ({len(bad)} bad rows, see above)")
    with tqdm(total=len(prompts), desc="predict", unit="row", disable=not progress, file=sys.stderr) as bar:
        records = model.predict_values(prompts, tokenizer=ntok, levels=levels, batch_size=batch_size,
                                       progress=bar.update)
    for r, i in zip(records, rows):
        r["row"] = i
    write_predictions(records, columns, output)
    return {"rows": len(dataset), "written": len(records), "skipped": len(bad)}
