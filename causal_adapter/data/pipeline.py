"""Datasets pipeline for number-aware training (SPEC sections 1 and 6).

* `load_text_dataset` (`data.loading`, re-exported here): local jsonl / json / csv / tsv / parquet / txt files
  through `datasets.load_dataset` (map-style or streaming), with errors that name the file and line.
* `tokenize_dataset`: rows -> features ``input_ids``, ``numeric_values``, ``labels``,
  ``label_values`` with a `NumberTokenizer`. A ``text`` column (loss on every token),
  ``prompt`` + ``completion`` columns (loss on the completion only) or TRL's conversations
  (``messages``, or conversational prompt/completion: rendered with the chat template, loss on the
  assistant turns; `data.conversations`).
* `NumericCollator` (`data.collator`, re-exported here): pads the four features (and builds ``attention_mask``) on
  either side.
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

import logging
from typing import Any

from ..config import IGNORE_INDEX
from ..numbers import NUMBER_RE, NumberTokenizer
from .collator import FEATURE_COLUMNS, NumericCollator  # noqa: F401 - importable from here as before
from .loading import load_text_dataset  # noqa: F401 - importable from here as before
from .conversations import CONVERSATION_FORMATS, check_chat_template, detect_format, encode_conversations

__all__ = [
    "IGNORE_INDEX",
    "NumericCollator",
    "number_layout",
    "load_text_dataset",
    "tokenize_dataset",
]

#: a column the tokenising map adds (was the row cut at max_length?), counted for the warning, then removed
TRUNCATED_COLUMN = "__truncated__"
logger = logging.getLogger(__name__)

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
