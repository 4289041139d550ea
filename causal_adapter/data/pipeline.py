"""Datasets pipeline for number-aware training (SPEC sections 1 and 6).

* `load_text_dataset`: local jsonl / json / csv / tsv / parquet / txt files through
  `datasets.load_dataset` (map-style or streaming), with errors that name the file and line.
* `tokenize_dataset`: rows -> features ``input_ids``, ``numeric_values``, ``labels``,
  ``label_values`` with a `NumberTokenizer`. A ``text`` column (loss on every token),
  ``prompt`` + ``completion`` columns (loss on the completion only) or TRL's conversations
  (``messages``, or conversational prompt/completion: rendered with the chat template, loss on the
  assistant turns; `data.conversations`).
* `NumericCollator`: pads the four features (and builds ``attention_mask``) on either side.
* The offline numeric corpora live in `causal_adapter.data.corpora`.

Conventions (fixed; the model is written against them):

* ``labels`` are aligned with ``input_ids`` (the transformers convention: the MODEL shifts).
  ``labels[i] = input_ids[i]`` except -100 at prompt positions and padding.
* ``label_values[i] = numeric_values[i]`` where ``labels[i] != -100``, else 0.0.
* Padding: ``input_ids`` with the pad id (the tokenizer's pad token, falling back to EOS),
  ``numeric_values`` 0.0, ``attention_mask`` 0, ``labels`` -100, ``label_values`` 0.0.
* Truncation to ``max_length`` keeps the LEFT part (the first ``max_length`` tokens). A number
  is one position (``<NUM>`` and its value together), so truncation never separates them. When
  the prompt alone fills ``max_length`` the row keeps no completion token and so carries no loss.
  The number of truncated rows is logged as a warning.

"""
from __future__ import annotations

import glob
import json
import logging
import os
from typing import Any, Mapping, Sequence

from ..config import IGNORE_INDEX
from ..numbers import NUMBER_RE, NumberTokenizer, to_list
from .conversations import CONVERSATION_FORMATS, check_chat_template, detect_format, encode_conversations

__all__ = [
    "IGNORE_INDEX",
    "NumericCollator",
    "number_layout",
    "load_text_dataset",
    "tokenize_dataset",
]

FEATURE_COLUMNS = ("input_ids", "numeric_values", "labels", "label_values")
#: a column the tokenising map adds (was the row cut at max_length?), counted for the warning, then removed
TRUNCATED_COLUMN = "__truncated__"
logger = logging.getLogger(__name__)

# --------------------------------------------------------------------------- loading
_EXT_TYPES = {
    ".jsonl": "json", ".json": "json", ".ndjson": "json",
    ".csv": "csv", ".tsv": "csv",
    ".parquet": "parquet", ".pq": "parquet",
    ".txt": "text",
}


def _file_list(data_files) -> list[str]:
    if isinstance(data_files, (str, os.PathLike)):
        return [os.fspath(data_files)]
    if isinstance(data_files, Mapping):
        out = []
        for v in data_files.values():
            out.extend(_file_list(v))
        return out
    if isinstance(data_files, (list, tuple)):
        out = []
        for v in data_files:
            out.extend(_file_list(v))
        return out
    raise ValueError(f"data_files must be a path, a list of paths or a dict split -> paths, got {data_files!r:.200}")


def _infer_type(path: str) -> str:
    name = path.lower()
    for comp in (".gz", ".bz2", ".xz", ".zst", ".zip"):
        if name.endswith(comp):
            name = name[: -len(comp)]
    ext = os.path.splitext(name)[1]
    if ext not in _EXT_TYPES:
        raise ValueError(
            f"cannot infer the file type of {path!r} from its extension {ext!r}; pass file_type= one of "
            "'json', 'csv', 'parquet', 'text' (known extensions: " + ", ".join(sorted(_EXT_TYPES)) + ")"
        )
    return _EXT_TYPES[ext]


def _check_files(files: list[str]) -> list[str]:
    """Local files exist (glob patterns are expanded); return the concrete paths."""
    out = []
    for f in files:
        if "://" in f:  # remote / fsspec URL: left to datasets
            out.append(f)
            continue
        if any(c in f for c in "*?["):
            hits = sorted(glob.glob(f))
            if not hits:
                raise FileNotFoundError(f"no file matches the pattern {f!r}")
            out.extend(hits)
        elif not os.path.isfile(f):
            raise FileNotFoundError(f"data file not found: {f!r} (cwd {os.getcwd()!r})")
        else:
            out.append(f)
    return out


def _open_text(path: str):
    if path.endswith(".gz"):
        import gzip
        return gzip.open(path, "rt", encoding="utf-8")
    if path.endswith(".bz2"):
        import bz2
        return bz2.open(path, "rt", encoding="utf-8")
    if path.endswith(".xz"):
        import lzma
        return lzma.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def _locate_json_error(paths: Sequence[str]) -> ValueError | None:
    """The first line of a JSON-lines file that is not a JSON object, as a ValueError naming
    the file and the line (None when every line parses: the error was something else).
    When no file holds a single row, that is the error (datasets reports it as a bare StopIteration)."""
    empty = []
    for path in paths:
        if "://" in path:
            continue
        rows = 0
        try:
            with _open_text(path) as fh:
                first = fh.read(1)
                while first and first.isspace():
                    first = fh.read(1)
                if first == "[":  # a JSON array file, not JSON lines
                    fh.seek(0)
                    try:
                        rows = len(json.load(fh))
                    except json.JSONDecodeError as e:
                        return ValueError(f"{path}: line {e.lineno}: not valid JSON ({e.msg})")
                    if not rows:
                        empty.append(path)
                    continue
                fh.seek(0)
                for lineno, line in enumerate(fh, 1):
                    if not line.strip():
                        continue
                    try:
                        obj = json.loads(line)
                    except json.JSONDecodeError as e:
                        return ValueError(f"{path}: line {lineno}: not valid JSON ({e.msg}): {line.strip()[:120]!r}")
                    if not isinstance(obj, dict):
                        return ValueError(
                            f"{path}: line {lineno}: expected a JSON object per line, got {type(obj).__name__}: "
                            f"{line.strip()[:120]!r}"
                        )
                    rows += 1
                if not rows:
                    empty.append(path)
        except UnicodeDecodeError as e:
            return ValueError(f"{path}: not UTF-8 text ({e})")
    if empty and len(empty) == len(paths):
        return ValueError(f"{', '.join(empty)}: the file is empty (no JSON rows): nothing to load")
    return None


def _load_error(file_type: str, paths: Sequence[str], exc: BaseException) -> Exception:
    if file_type == "json":
        located = _locate_json_error(paths)
        if located is not None:
            return located
    cause = exc.__cause__ or exc
    return ValueError(f"could not load {list(paths)} as {file_type}: {type(cause).__name__}: {cause}")


def _guarded_json_stream(paths: list[str], load_kwargs: dict):
    """Generator behind the streaming JSON dataset: datasets' own json reader, file by file,
    with a parse error turned into a ValueError naming the file and line."""
    import datasets

    for path in paths:
        inner = datasets.load_dataset("json", data_files=path, split="train", streaming=True, **load_kwargs)
        try:
            yield from inner
        except Exception as e:  # noqa: BLE001 - re-raised with the file and line
            raise _load_error("json", [path], e) from e


def load_text_dataset(
    data_files,
    file_type: str | None = None,
    streaming: bool = False,
    split: str | None = "train",
    string_columns: Sequence[str] = ("text", "prompt", "completion"),
    **load_kwargs,
):
    """Load local files with `datasets.load_dataset` (no hub access; works with
    ``HF_DATASETS_OFFLINE=1``).

    data_files: a path, a glob, a list of them, or a dict split -> paths (as in datasets).
    file_type: "json" (also .jsonl), "csv" (.tsv -> tab separated), "parquet", "text";
        None infers it from the extension of the first file.
    streaming: True returns an `IterableDataset` that reads the files lazily (files bigger
        than memory); a JSON error then surfaces during iteration, also naming file and line.
    split: the split to return ("train" for plain file lists); None returns the DatasetDict.
    string_columns: CSV/TSV columns read as text as written (``12.5`` stays the string "12.5",
        a leading space is kept), whatever pandas would infer.

    Errors: a missing file -> FileNotFoundError naming it; a jsonl line that is not JSON ->
    ValueError naming the file and the line number; other parse errors -> ValueError naming
    the files and the cause.
    """
    import datasets

    files = _check_files(_file_list(data_files))
    if not files:
        raise ValueError("data_files is empty")
    if file_type is None:
        file_type = _infer_type(files[0])
    if file_type == "jsonl":
        file_type = "json"
    if file_type not in ("json", "csv", "parquet", "text"):
        raise ValueError(f"file_type must be 'json', 'csv', 'parquet' or 'text', got {file_type!r}")
    if file_type == "csv" and "sep" not in load_kwargs and "delimiter" not in load_kwargs:
        if all(f.lower().removesuffix(".gz").endswith(".tsv") for f in files):
            load_kwargs["sep"] = "\t"
    if file_type == "csv" and "converters" not in load_kwargs:
        load_kwargs["converters"] = {c: str for c in string_columns}

    if isinstance(data_files, Mapping):
        spec = {k: _check_files(_file_list(v)) for k, v in data_files.items()}
    else:
        spec = files

    if streaming and file_type == "json":
        # datasets' streaming json reader raises pyarrow errors that name neither the file nor
        # the line: wrap it (one shard per file, so split_dataset_by_node still shards by file).
        def make(paths):
            return datasets.IterableDataset.from_generator(
                _guarded_json_stream, gen_kwargs={"paths": list(paths), "load_kwargs": dict(load_kwargs)}
            )

        if isinstance(spec, dict):
            dd = datasets.IterableDatasetDict({k: make(v) for k, v in spec.items()})
            if split is None:
                return dd
            if split not in dd:
                raise ValueError(f"split {split!r} not in data_files splits {list(dd)}")
            return dd[split]
        if split not in (None, "train"):
            raise ValueError(f"split {split!r} not found: a plain file list is loaded as the 'train' split")
        ds = make(spec)
        return datasets.IterableDatasetDict({"train": ds}) if split is None else ds

    import logging

    json_log = logging.getLogger("datasets.packaged_modules.json.json")
    level = json_log.level
    json_log.setLevel(logging.CRITICAL)  # its "Failed to load JSON" log repeats what the ValueError below says
    try:
        return datasets.load_dataset(file_type, data_files=spec, split=split, streaming=streaming, **load_kwargs)
    except (FileNotFoundError, ImportError):
        raise
    except Exception as e:  # noqa: BLE001 - datasets/pyarrow errors do not name file and line
        raise _load_error(file_type, files, e) from e
    finally:
        json_log.setLevel(level)


# --------------------------------------------------------------------------- tokenising
def _column_names(dataset) -> list[str]:
    names = getattr(dataset, "column_names", None)
    if names is not None:
        return list(names)
    # streaming dataset with unknown features: look at the first row
    first = next(iter(dataset.take(1) if hasattr(dataset, "take") else dataset), None)
    if first is None:
        return []
    return list(first)


def _check_str(values, column: str, indices, allow_empty: bool = True) -> None:
    for v, i in zip(values, indices):
        if not isinstance(v, str):
            if v is None:
                raise ValueError(f"row {i}: column {column!r} is null (None); every row needs a string")
            raise ValueError(
                f"row {i}: column {column!r} must be a string, got {type(v).__name__} {v!r:.80} "
                "(write it as text: a JSON string in jsonl, e.g. \" 12.5\"; a CSV column is read as text when "
                "it is the --text-column / --prompt-column / --completion-column)"
            )


def tokenize_dataset(
    dataset,
    number_tokenizer: NumberTokenizer,
    text_column: str = "text",
    prompt_column: str = "prompt",
    completion_column: str = "completion",
    max_length: int | None = None,
    add_eos_token: bool = False,
    batch_size: int = 1000,
    prompt_loss: str = "none",
    *,
    messages_column: str = "messages",
    chat_template: str | None = None,
    enable_thinking: bool = False,
    assistant_only_loss: bool = True,
    rows_name: str = "rows",
):
    """Map rows to the features ``input_ids``, ``numeric_values``, ``labels``, ``label_values``.

    The format is detected from the columns as TRL does (`conversations.detect_format`):
    * ``messages_column`` (lists of ``{"role", "content"}`` messages) and conversational ``prompt`` +
      ``completion`` (both lists of messages): rendered with the chat template (`chat_template` text, else
      the tokenizer's; `enable_thinking` is Qwen3's switch) and labelled on the assistant turns only (every
      assistant turn of a ``messages`` row, the completion's of a prompt/completion row), each with its
      end-of-turn mark (no EOS is appended). ``assistant_only_loss=False`` labels the other text tokens too.
      System, user and tool numbers are ``<NUM>`` inputs with their values but never labelled.
    * string ``prompt`` + ``completion`` (loss on the completion only; the two are encoded separately and
      concatenated, exactly what the model sees when the prompt is given and the completion generated)
      take precedence over ``text`` (loss everywhere).
      ``prompt_loss="text"``: the prompt's text tokens get labels too (the token loss learns the
      data's layout, e.g. the separator after a number, which completions that end with their number
      never show); the prompt's numbers keep -100, so the value regression learns from completions only.
      ``add_eos_token`` appends the tokenizer's EOS (with a label) to every completion / text.
    The columns read are removed; other columns (``target``, ``previous``, ...) are kept.
    ``max_length`` truncates keeping the first ``max_length`` tokens; how many rows were cut is logged as a
    warning (`rows_name` names them; a stream reports per batch). A bad row (no assistant turn, an unknown
    role, a template that fails on it) raises a ValueError naming it; nothing is written then.
    Works on `Dataset`, `IterableDataset` (streaming) and `DatasetDict`s of them.
    """
    import datasets

    if isinstance(dataset, (datasets.DatasetDict, datasets.IterableDatasetDict)):
        return type(dataset)({
            k: tokenize_dataset(v, number_tokenizer, text_column, prompt_column, completion_column,
                                max_length, add_eos_token, batch_size, prompt_loss, messages_column=messages_column,
                                chat_template=chat_template, enable_thinking=enable_thinking,
                                assistant_only_loss=assistant_only_loss, rows_name=f"{k} {rows_name}")
            for k, v in dataset.items()
        })
    _check_tokenize_args(number_tokenizer, max_length, prompt_loss)
    mode, used = _data_format(dataset, text_column, prompt_column, completion_column, messages_column)
    ntok = number_tokenizer
    chat, extra = None, () if prompt_loss == "none" else (prompt_loss,)
    if mode in CONVERSATION_FORMATS:  # the template is checked once here, not on row 0 inside the map
        template = check_chat_template(ntok.tokenizer, chat_template, enable_thinking)
        chat = dict(train_all=not assistant_only_loss, enable_thinking=enable_thinking, chat_template=chat_template)
        extra = (_fingerprint(template), enable_thinking, not assistant_only_loss)
    eos = _eos_id(ntok) if add_eos_token and chat is None else None  # a template ends its turns itself
    streaming = isinstance(dataset, datasets.IterableDataset)

    def fn(batch, indices):
        out = _tokenize_batch(batch, indices, ntok, used, eos, max_length, prompt_loss, chat)
        if streaming:  # a stream is never seen whole: each batch reports its own cut rows
            _report_truncated(sum(out.pop(TRUNCATED_COLUMN)), len(indices), max_length, f"{rows_name} of a batch")
        return out

    kwargs: dict[str, Any] = dict(batched=True, batch_size=batch_size, with_indices=True, remove_columns=used,
                                  features=_mapped_features(dataset, used, with_truncated=not streaming))
    if streaming:
        return dataset.map(fn, **kwargs)
    kwargs["desc"] = "number-aware tokenisation"
    # datasets would fingerprint `fn` by pickling its closure, i.e. the whole tokenizer
    # (seconds per call): give it a cheap, deterministic fingerprint instead.
    kwargs["new_fingerprint"] = _fingerprint(
        dataset._fingerprint, _tokenizer_digest(ntok), mode, used, max_length, eos, batch_size, *extra)
    out = dataset.map(fn, **kwargs)
    if TRUNCATED_COLUMN not in out.column_names:  # no rows: datasets ran nothing, so added no column
        return out
    _report_truncated(sum(out[TRUNCATED_COLUMN]), len(out), max_length, rows_name)
    return out.remove_columns(TRUNCATED_COLUMN)


def _report_truncated(count: int, total: int, max_length: int | None, rows_name: str) -> None:
    """The warning that `count` of `total` rows were cut at `max_length` (none when no row was)."""
    if count:
        logger.warning("%d of %d %s were longer than max_length=%d tokens and were truncated (their first %d "
                       "tokens kept; a number is one token, never cut)", count, total, rows_name, max_length,
                       max_length)


def _data_format(dataset, text_column: str, prompt_column: str, completion_column: str, messages_column: str
                 ) -> tuple[str, list[str]]:
    """(format, the columns `tokenize_dataset` reads and removes): "messages", "conversational_pc", "pc" or
    "text" (`conversations.detect_format`, TRL's detection: the first row tells conversational prompts)."""
    cols = _column_names(dataset)
    if messages_column not in cols and not (prompt_column in cols and completion_column in cols):
        return _text_columns(cols, text_column, prompt_column, completion_column, messages_column)
    first = None
    if messages_column not in cols:
        first = next(iter(dataset.take(1) if hasattr(dataset, "take") else dataset), None)
    mode = detect_format(cols, first, messages_column=messages_column, prompt_column=prompt_column,
                         completion_column=completion_column, text_column=text_column)
    return mode, [messages_column] if mode == "messages" else [prompt_column, completion_column]


def _check_tokenize_args(number_tokenizer, max_length, prompt_loss) -> None:
    if not isinstance(number_tokenizer, NumberTokenizer):
        raise ValueError(f"number_tokenizer must be a NumberTokenizer, got {type(number_tokenizer).__name__}")
    if max_length is not None and (isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1):
        raise ValueError(f"max_length must be a positive int or None, got {max_length!r}")
    if prompt_loss not in ("none", "text"):
        raise ValueError(f"prompt_loss must be 'none' or 'text', got {prompt_loss!r}")


def _text_columns(cols: list[str], text_column: str, prompt_column: str, completion_column: str,
                  messages_column: str = "messages") -> tuple[str, list[str]]:
    """("pc", [prompt, completion]) or ("text", [text]): the columns `tokenize_dataset` reads (and removes)."""
    if prompt_column in cols and completion_column in cols:
        return "pc", [prompt_column, completion_column]
    if prompt_column in cols or completion_column in cols:
        missing = completion_column if prompt_column in cols else prompt_column
        raise ValueError(f"dataset has a {(prompt_column if prompt_column in cols else completion_column)!r} "
                         f"column but no {missing!r} column; columns present: {cols}")
    if text_column in cols:
        return "text", [text_column]
    raise ValueError(
        f"dataset has neither a {text_column!r} column nor {prompt_column!r} + {completion_column!r} "
        f"columns nor a {messages_column!r} column; columns present: {cols} (name yours with --text-column / "
        "--prompt-column / --completion-column / --messages-column, or text_column= / ... in Python)"
    )


def _eos_id(ntok: NumberTokenizer) -> int:
    eos = getattr(ntok.tokenizer, "eos_token_id", None)
    if eos is None:
        raise ValueError("add_eos_token=True but the tokenizer has no eos_token_id")
    return eos


def _tokenize_batch(batch, indices, ntok: NumberTokenizer, used: list[str], eos: int | None,
                    max_length: int | None, prompt_loss: str, chat: dict | None = None) -> dict[str, list[list]]:
    """One batch of rows -> FEATURE_COLUMNS + TRUNCATED_COLUMN, one entry per row. `used`: [prompt, completion],
    [text] or, with `chat` (`encode_conversations`' options), the conversation columns."""
    if chat is not None:
        rows = encode_conversations(ntok, batch, indices, used, **chat)
    else:
        if len(used) == 2:
            prompt_column, completion_column = used
            prompts, comps = batch[prompt_column], batch[completion_column]
            _check_str(prompts, prompt_column, indices)
            _check_str(comps, completion_column, indices)
            encs = ntok.encode_batch(list(prompts) + list(comps), return_offsets=False)
            pe, ce = encs[: len(prompts)], encs[len(prompts):]
        else:
            texts = batch[used[0]]
            _check_str(texts, used[0], indices)
            ce = ntok.encode_batch(list(texts), return_offsets=False)
            pe = [None] * len(ce)
        rows = [_row_features(p, c, eos, ntok.num_token_id, prompt_loss) for p, c in zip(pe, ce)]
    out = {k: [] for k in (*FEATURE_COLUMNS, TRUNCATED_COLUMN)}
    for ids, vals, labels in rows:
        cut = max_length is not None and len(ids) > max_length
        if cut:
            ids, vals, labels = ids[:max_length], vals[:max_length], labels[:max_length]
        out["input_ids"].append(ids)
        out["numeric_values"].append(vals)
        out["labels"].append(labels)
        out["label_values"].append([v if l != IGNORE_INDEX else 0.0 for v, l in zip(vals, labels)])
        out[TRUNCATED_COLUMN].append(cut)
    return out


def _row_features(p, c, eos: int | None, num_token_id: int, prompt_loss: str
                  ) -> tuple[list[int], list[float], list[int]]:
    """(input_ids, numeric_values, labels) of one row from its encoded prompt `p` (None for a text row) and
    completion / text `c`: eos appended to c, prompt labels -100 (or its text tokens with prompt_loss="text")."""
    c_ids, c_vals = list(c.input_ids), list(c.numeric_values)
    if eos is not None:
        c_ids.append(eos)
        c_vals.append(0.0)
    if p is None:
        ids, vals = c_ids, c_vals
        labels = list(c_ids)
    else:
        ids = p.input_ids + c_ids
        vals = p.numeric_values + c_vals
        if prompt_loss == "text":
            prompt_labels = [IGNORE_INDEX if t == num_token_id else t for t in p.input_ids]
        else:
            prompt_labels = [IGNORE_INDEX] * len(p.input_ids)
        labels = prompt_labels + c_ids
    return ids, vals, labels


def _mapped_features(dataset, used: list[str], with_truncated: bool = True):
    """The `datasets.Features` after tokenisation (the kept columns + FEATURE_COLUMNS [+ TRUNCATED_COLUMN]),
    None when unknown."""
    import datasets

    new_feats = {
        "input_ids": datasets.List(datasets.Value("int64")),
        "numeric_values": datasets.List(datasets.Value("float32")),
        "labels": datasets.List(datasets.Value("int64")),
        "label_values": datasets.List(datasets.Value("float32")),
    }
    if with_truncated:
        new_feats[TRUNCATED_COLUMN] = datasets.Value("bool")
    if getattr(dataset, "features", None) is None:
        return None
    kept = {k: v for k, v in dataset.features.items() if k not in used and k not in new_feats}
    return datasets.Features({**kept, **new_feats})


_PIPELINE_VERSION = 2  # 2: the truncated-rows column of the map


def _tokenizer_digest(ntok: NumberTokenizer) -> str:
    """Digest of everything the encoding depends on (cached on the NumberTokenizer)."""
    digest = getattr(ntok, "_data_digest", None)
    if digest is None:
        import hashlib


        h = hashlib.sha256()
        tok = ntok.tokenizer
        backend = getattr(tok, "backend_tokenizer", None)
        if backend is not None:
            h.update(backend.to_str().encode("utf-8"))
        else:
            h.update(repr(sorted(tok.get_vocab().items())).encode("utf-8"))
        h.update(repr((type(tok).__name__, len(tok), ntok.num_token_id, ntok.pad_token_id, NUMBER_RE.pattern,
                       _PIPELINE_VERSION)).encode("utf-8"))
        digest = h.hexdigest()
        ntok._data_digest = digest
    return digest


def _fingerprint(*parts) -> str:
    import hashlib

    return hashlib.sha256(repr(parts).encode("utf-8")).hexdigest()[:32]


# --------------------------------------------------------------------------- collator
def batch_length(lengths: Sequence[int], pad_to_multiple_of: int | None = None, minimum: int = 0) -> int:
    """The padded length of a batch: its longest row (at least `minimum`), rounded up to a multiple when asked."""
    length = max(minimum, max(lengths))
    return -(-length // pad_to_multiple_of) * pad_to_multiple_of if pad_to_multiple_of else length


def padded_features(b: int, length: int, pad_token_id: int, labels: bool = True) -> dict:
    """[b, length] tensors of padding: input_ids = pad, numeric_values 0.0 (and labels -100, label_values 0.0)."""
    import torch

    out = {"input_ids": torch.full((b, length), pad_token_id, dtype=torch.long),
           "numeric_values": torch.zeros((b, length), dtype=torch.float32)}
    if labels:
        out["labels"] = torch.full((b, length), IGNORE_INDEX, dtype=torch.long)
        out["label_values"] = torch.zeros((b, length), dtype=torch.float32)
    return out


class NumericCollator:
    """Pads a list of feature dicts into tensors (SPEC section 1 padding rules).

    ``NumericCollator(pad_token_id, padding_side="right", max_length=None)``; ``pad_token_id``
    may also be a `NumberTokenizer` (its ``pad_token_id`` is used). Each feature needs
    ``input_ids``; ``numeric_values`` (default 0.0), ``labels`` and ``label_values`` (default:
    ``numeric_values`` where labels != -100) are optional; ``attention_mask`` is built.
    Sequences longer than ``max_length`` keep their first ``max_length`` positions.
    Other keys holding plain numbers (``target``, ``previous``) are stacked into 1-D tensors
    (int64 / float64 / bool); other keys (strings, lists, ...) are dropped.
    Returns ``input_ids``/``attention_mask``/``labels`` (long), ``numeric_values``/``label_values``
    (float32) of shape [B, S].
    """

    def __init__(self, pad_token_id, padding_side: str = "right", max_length: int | None = None,
                 pad_to_multiple_of: int | None = None):
        if hasattr(pad_token_id, "pad_token_id"):
            pad_token_id = pad_token_id.pad_token_id
        if isinstance(pad_token_id, bool) or not isinstance(pad_token_id, int) or pad_token_id < 0:
            raise ValueError(f"pad_token_id must be a non-negative int, got {pad_token_id!r}")
        if padding_side not in ("right", "left"):
            raise ValueError(f"padding_side must be 'right' or 'left', got {padding_side!r}")
        if max_length is not None and (isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1):
            raise ValueError(f"max_length must be a positive int or None, got {max_length!r}")
        if pad_to_multiple_of is not None and (not isinstance(pad_to_multiple_of, int) or pad_to_multiple_of < 1):
            raise ValueError(f"pad_to_multiple_of must be a positive int or None, got {pad_to_multiple_of!r}")
        self.pad_token_id = pad_token_id
        self.padding_side = padding_side
        self.max_length = max_length
        self.pad_to_multiple_of = pad_to_multiple_of

    def __repr__(self) -> str:
        return (f"NumericCollator(pad_token_id={self.pad_token_id}, padding_side={self.padding_side!r}, "
                f"max_length={self.max_length})")

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict:
        import torch

        if not features:
            raise ValueError("NumericCollator got an empty batch")
        rows = []
        has_labels = "labels" in features[0]
        for i, f in enumerate(features):
            if "input_ids" not in f:
                raise ValueError(f"feature {i} has no 'input_ids' (keys: {sorted(f)})")
            if ("labels" in f) != has_labels:
                raise ValueError(f"feature {i}: 'labels' present in some features of the batch but not all")
            ids = to_list(f["input_ids"])
            n = len(ids)
            vals = to_list(f.get("numeric_values")) if f.get("numeric_values") is not None else [0.0] * n
            mask = to_list(f.get("attention_mask")) if f.get("attention_mask") is not None else [1] * n
            labels = to_list(f["labels"]) if has_labels else None
            lvals = to_list(f.get("label_values")) if f.get("label_values") is not None else None
            for name, seq in (("numeric_values", vals), ("attention_mask", mask), ("labels", labels),
                              ("label_values", lvals)):
                if seq is not None and len(seq) != n:
                    raise ValueError(f"feature {i}: {name} has length {len(seq)} but input_ids has {n}")
            if has_labels and lvals is None:
                lvals = [v if l != IGNORE_INDEX else 0.0 for v, l in zip(vals, labels)]
            m = self.max_length
            if m is not None and n > m:
                ids, vals, mask = ids[:m], vals[:m], mask[:m]
                if has_labels:
                    labels, lvals = labels[:m], lvals[:m]
            rows.append((ids, vals, mask, labels, lvals))

        length = batch_length([len(r[0]) for r in rows], self.pad_to_multiple_of)
        out = padded_features(len(rows), length, self.pad_token_id, labels=has_labels)
        out["attention_mask"] = torch.zeros((len(rows), length), dtype=torch.long)
        for i, (ids, vals, mask, labels, lvals) in enumerate(rows):
            k = len(ids)
            if k == 0:
                continue
            sl = slice(0, k) if self.padding_side == "right" else slice(length - k, length)
            out["input_ids"][i, sl] = torch.tensor(ids, dtype=torch.long)
            out["numeric_values"][i, sl] = torch.tensor(vals, dtype=torch.float32)
            out["attention_mask"][i, sl] = torch.tensor(mask, dtype=torch.long)
            if has_labels:
                out["labels"][i, sl] = torch.tensor(labels, dtype=torch.long)
                out["label_values"][i, sl] = torch.tensor(lvals, dtype=torch.float32)
        # plain numeric extras (target, previous, ...) stacked; anything else dropped
        skip = set(FEATURE_COLUMNS) | {"attention_mask"}
        for key in features[0]:
            if key in skip:
                continue
            vals_k = [f.get(key) for f in features]
            if all(isinstance(v, bool) for v in vals_k):
                out[key] = torch.tensor(vals_k, dtype=torch.bool)
            elif all(isinstance(v, int) and not isinstance(v, bool) for v in vals_k):
                out[key] = torch.tensor(vals_k, dtype=torch.long)
            elif all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals_k):
                out[key] = torch.tensor(vals_k, dtype=torch.float64)  # exact (not a model input)
        return out



def number_layout(dataset, num_token_id: int, tokenizer, max_rows: int = 20000,
                  max_contexts: int = 256) -> tuple[int | None, list[int] | None]:
    """(prefix id, context ids) of the numbers the value head trains on: the tokens just before every
    labelled ``<NUM>`` of the first `max_rows` tokenised rows (features ``input_ids`` / ``labels``).

    The prefix is the most frequent of them when it decodes to whitespace only (Qwen writes the space of
    ``": 1033.57"`` as its own token, so the value is fitted at the space's position); None (no layout rule)
    when numbers mostly follow something else or no row has a labelled number. Contexts: every id seen
    there, most frequent first (at most `max_contexts`). `CausalAdapterConfig.number_prefix_id` says how
    generation and `predict_values` use them.
    """
    from collections import Counter

    counts: Counter = Counter()
    rows = dataset.select(range(min(len(dataset), max_rows))) if hasattr(dataset, "select") else dataset
    for ids, labels in zip(rows["input_ids"], rows["labels"]):
        for i in range(1, len(ids)):
            if labels[i] == num_token_id and ids[i] == num_token_id:
                counts[int(ids[i - 1])] += 1
    if not counts:
        return None, None
    top = counts.most_common(max_contexts)
    prefix = top[0][0]
    text = tokenizer.decode([prefix]) if prefix != num_token_id else ""
    if not text or text.strip():
        return None, None
    return prefix, [t for t, _ in top]
