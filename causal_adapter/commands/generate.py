"""`causal-adapter generate`: text in, text with numbers (and their intervals) out (docs/cli.md).

Prompts come from the command line (or a pipe on stdin), from ``--messages JSON`` (a conversation, rendered
with the chat template and its generation prompt) or from ``--input-file F`` (rows with a ``prompt`` or a
``messages`` column). Generation is batched (`modeling.generation.generate_batched`: ``--batch-size`` prompts
of similar length at a time, left padded; each row's output as if generated alone). Output: the text and each
number's intervals for people; with ``--input-file`` or ``--output``, one json row per prompt
(``row``, ``completion``, ``values``, ``finished``).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ..data.conversations import check_chat_template, inference_prompt
from ..data.pipeline import load_text_dataset
from ..modeling.generation import MODES, GenerationOutput, generate_batched
from ..saving.artifacts import atomic_write_file
from ..model import CausalModel, get_causal_model
from .parser import (
    CLIError,
    add_base_arguments,
    add_chat_arguments,
    chat_template_from_args,
    load_base_from_args,
    tiny_base_hint,
)
from .predict import row_prompts


def add_parser(sub, **fmt) -> None:
    p = sub.add_parser("generate", help="generate text with numbers from prompts, conversations or a file", **fmt)
    p.add_argument("prompt", nargs="*", help="prompt(s); read from a pipe on stdin when none is given")
    p.add_argument("--messages", action="append", default=None, metavar="JSON",
                   help='a conversation as JSON, e.g. \'[{"role": "user", "content": "..."}]\', rendered with the chat '
                        "template and its generation prompt (ending with the assistant's reply: that reply is "
                        "continued); repeat the flag for several conversations")
    p.add_argument("--input-file", nargs="+", default=None, metavar="F",
                   help="jsonl/json/parquet/csv files whose rows have a prompt or a messages column; writes one json "
                        "row per input row (row, completion, values, finished)")
    p.add_argument("--prompt-column", default="prompt", help="--input-file: column of text prompts")
    add_chat_arguments(p)
    p.add_argument("--output", default=None, metavar="O.jsonl",
                   help="write the json rows here (atomically); default: stdout (jsonl with --input-file, else text)")
    add_base_arguments(p)
    p.add_argument("--adapter", default=None, help="adapter directory (default: a fresh adapter = the base model)")
    p.add_argument("--mode", default="deterministic", choices=list(MODES))
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=16, help="prompts generated together (left padded)")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar (drawn on stderr for several prompts, or for one when stderr is a terminal)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--do-sample", action="store_true", help="softmax mode: sample instead of greedy")
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--shared-individual", action="store_true", help="causal mode: one sampled U per sequence")
    p.set_defaults(func=run)


def read_prompts(args: argparse.Namespace) -> list[str]:
    if args.prompt:
        return args.prompt
    if sys.stdin is None or sys.stdin.isatty():
        raise CLIError('no prompt: give it as an argument (causal-adapter generate "The price was"), '
                       "pipe it in (echo 'The price was' | causal-adapter generate), or use --messages JSON / "
                       "--input-file F")
    text = sys.stdin.read()
    if not text.strip():
        raise CLIError("no prompt: stdin was empty; give the prompt as an argument or pipe a non-empty text in")
    return [text]


def parse_messages(texts: list[str]) -> list[Any]:
    """The --messages values as JSON (a CLIError names a malformed one)."""
    out = []
    for k, text in enumerate(texts):
        try:
            out.append(json.loads(text))
        except json.JSONDecodeError as e:
            which = "--messages" if len(texts) == 1 else f"--messages #{k + 1}"
            raise CLIError(f"{which} is not valid JSON ({e.msg} at character {e.pos}): give a JSON list of "
                           "messages, e.g. '[{\"role\": \"user\", \"content\": \"How tall is it?\"}]'") from None
    return out


def conversation_prompts(tokenizer, conversations: list[Any], chat_template: str | None,
                         enable_thinking: bool) -> list[str]:
    """The prompts of --messages conversations (a bad one is an error naming it: no output is written)."""
    check_chat_template(tokenizer, chat_template, enable_thinking)
    prompts = []
    for k, messages in enumerate(conversations):
        try:
            prompts.append(inference_prompt(tokenizer, messages, enable_thinking=enable_thinking,
                                            chat_template=chat_template, row=k, column="messages"))
        except ValueError as e:  # "row k: ..." -> "--messages: ..."
            which = "--messages" if len(conversations) == 1 else f"--messages #{k + 1}"
            raise CLIError(f"{which}: {str(e).removeprefix(f'row {k}: ')}") from None
    return prompts


def output_row(row: int, out: GenerationOutput) -> dict:
    """One json row: ``row`` (the input's index), ``completion`` (the generated text, numbers rendered),
    ``values`` (per generated number: ``text``, ``value`` as written, ``loc`` / ``scale`` (loc_Y, scale_Y),
    ``p_num`` (P(<NUM>) at that step), ``lower_50`` ... ``upper_90`` (the adapter's intervals, as `predict` names
    them) and ``raw_lower_50`` ... (raw Cauchy)), ``finished`` (stopped on eos rather than at --max-new-tokens),
    and ``stop_reason`` where the row ended early (its value or hidden state not finite: `GenerationOutput`)."""
    values = []
    for n in out.numbers[0]:
        v = {"text": n["text"], "value": n["value"], "loc": n["loc"], "scale": n["scale"], "p_num": n["p_num"]}
        for prefix in ("", "raw_"):
            for level in (50, 90):
                v[f"{prefix}lower_{level}"], v[f"{prefix}upper_{level}"] = n[f"{prefix}interval_{level}"]
        values.append(v)
    record = {"row": row, "completion": out.texts[0], "values": values, "finished": bool(out.finished[0])}
    if out.stop_reasons and out.stop_reasons[0] is not None:
        record["stop_reason"] = out.stop_reasons[0]
    return record


def print_numbers(prompts: list[str], outs: list[GenerationOutput]) -> None:
    for prompt, out in zip(prompts, outs):
        print(prompt + out.texts[0])
        if out.stop_reasons and out.stop_reasons[0] is not None:
            print(f"  ({out.stop_reasons[0]})")
        for n in out.numbers[0]:
            lo50, hi50 = n["interval_50"]
            lo90, hi90 = n["interval_90"]
            print(f"  <NUM> {n['text']}: loc_Y={n['loc']:.4g} scale_Y={n['scale']:.3g} "
                  f"50% [{lo50:.4g}, {hi50:.4g}] 90% [{lo90:.4g}, {hi90:.4g}]")


def write_rows(records: list[dict], output: str | None) -> None:
    def write(fh) -> None:
        for r in records:
            fh.write(json.dumps(r) + "\n")

    if output is None:
        write(sys.stdout)
        sys.stdout.flush()
    else:
        atomic_write_file(output, write)


def _check_args(args: argparse.Namespace) -> None:
    sources = [name for name, given in (("prompts", bool(args.prompt)), ("--messages", bool(args.messages)),
                                        ("--input-file", bool(args.input_file))) if given]
    if len(sources) > 1:
        raise CLIError(f"give the prompts one way: {' or '.join(sources)}, not both")
    if args.output is not None and Path(args.output).suffix.lower() != ".jsonl":
        raise CLIError(f"--output {args.output!r}: give a .jsonl file name (or no --output: stdout)")
    if args.batch_size < 1:
        raise CLIError(f"--batch-size must be a positive integer, got {args.batch_size}")
    if args.max_new_tokens < 0:
        raise CLIError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    if (args.enable_thinking or args.chat_template) and not (args.messages or args.input_file):
        raise CLIError("--enable-thinking / --chat-template render conversations: give them with --messages JSON "
                       "or --input-file F (rows with a messages column)")


def run(args: argparse.Namespace) -> int:
    _check_args(args)
    chat_template = chat_template_from_args(args)
    conversations = parse_messages(args.messages) if args.messages else None
    prompts = read_prompts(args) if not (conversations or args.input_file) else None
    base, tokenizer = load_base_from_args(args)
    rows, bad, total = None, [], None
    if conversations is not None:
        prompts = conversation_prompts(tokenizer, conversations, chat_template, args.enable_thinking)
    elif args.input_file:
        dataset = load_text_dataset(list(args.input_file), string_columns=(args.prompt_column,))
        rows, prompts, bad = row_prompts(dataset, args.prompt_column, args.prompt_column, None,
                                         messages_column=args.messages_column, tokenizer=tokenizer,
                                         chat_template=chat_template, enable_thinking=args.enable_thinking,
                                         to_first_number=False)
        total = len(dataset)
        for line in bad:
            print(line, file=sys.stderr)
        if not prompts:
            raise ValueError(f"no row of {list(args.input_file)} has a prompt to generate from "
                             f"({len(bad)} bad rows, see above)")
    if args.adapter:
        try:
            model = CausalModel.from_pretrained(base, args.adapter, tokenizer=tokenizer)
        except ValueError as e:
            raise tiny_base_hint(e, args) from e
    else:
        model = get_causal_model(base, tokenizer=tokenizer)
    model.eval()
    outs = generate_all(model, tokenizer, prompts, args)
    if args.input_file or args.output:
        write_rows([output_row(i, o) for i, o in zip(rows if rows is not None else range(len(outs)), outs)],
                   args.output)
        if args.input_file:
            print(f"generate: {len(outs)} of {total} rows written to {args.output or 'stdout'}"
                  + (f" ({len(bad)} skipped, see above)" if bad else ""), file=sys.stderr)
    else:
        print_numbers(prompts, outs)
    return 0


def show_progress(n_prompts: int, no_progress: bool, stream=None) -> bool:
    """Whether to draw the progress bar: never with --no-progress; for several prompts; for one only on a terminal
    (a bar that counts to one is noise in a `2>&1` pipeline, where it would come before the answer)."""
    stream = sys.stderr if stream is None else stream
    return not no_progress and (n_prompts > 1 or bool(getattr(stream, "isatty", lambda: False)()))


def generate_all(model, tokenizer, prompts: list[str], args: argparse.Namespace) -> list[GenerationOutput]:
    """`generate_batched` under a progress bar (stderr: `show_progress`)."""
    from tqdm.auto import tqdm

    disable = not show_progress(len(prompts), args.no_progress)
    with tqdm(total=len(prompts), desc="generate", unit="row", disable=disable, file=sys.stderr) as bar:
        return generate_batched(model, prompts, tokenizer=tokenizer, batch_size=args.batch_size, progress=bar.update,
                                mode=args.mode, max_new_tokens=args.max_new_tokens, seed=args.seed,
                                do_sample=args.do_sample or None, temperature=args.temperature, top_k=args.top_k,
                                top_p=args.top_p, shared_individual=args.shared_individual)
