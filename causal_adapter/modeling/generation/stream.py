"""Step 6 of generation, the text as it grows: the decode of generated ids (`decode_text`: numbers rendered, a
prompt-final number respected), `RowText` (one row's text grown token by token in O(T)), `streamable` (how much of
it a stream may send while a stop string could still begin), and `NumberStreamer` (transformers' streamer protocol,
numbers rendered)."""
from __future__ import annotations

import inspect
import sys
from typing import Sequence

import torch
from torch import Tensor

from ...numbers import format_number
from .prepare import number_tokenizer


def decode_text(ntok, ids: Sequence[int], values: Sequence[float], prev_id: int | None = None,
                prev_value: float = 0.0) -> str:
    """Text of generated ids. When the prompt ends with <NUM> (prev_id), the continuation is decoded after it and the
    prompt's number cut off, so whatever NumberTokenizer puts between two adjacent numbers (they must stay two numbers)
    is part of the new text."""
    ids, values = list(ids), list(values)
    if prev_id is not None and prev_id == ntok.num_token_id and ids:
        head = ntok.decode([prev_id], [prev_value], skip_special_tokens=True)
        full = ntok.decode([prev_id] + ids, [prev_value] + values, skip_special_tokens=True)
        if full.startswith(head):
            return full[len(head):]
    return ntok.decode(ids, values, skip_special_tokens=True)


def decode_continuation(ntok, ids: Tensor, values: Tensor, prev_id: int | None = None, prev_value: float = 0.0) -> str:
    """`decode_text` of tensors (the decode of GenerationOutput.texts)."""
    return decode_text(ntok, ids.tolist(), values.tolist(), prev_id, prev_value)


def format_value(value: float) -> str:
    return format_number(value)


class RowText:
    """One row's generated text, grown token by token as `decode_text` decodes it whole. Decoded in segments of up to
    SEGMENT tokens: each is decoded again at every step, and once its text ends on a whole character it is kept and
    the next one is decoded after its last token (as after a prompt), so T tokens cost O(T).

    `text`: the text so far (a trailing partial multi-byte character shows as U+FFFD, as in the final decode)."""

    SEGMENT = 32

    def __init__(self, ntok, prev_id: int | None = None, prev_value: float = 0.0):
        self.ntok, self.prev = ntok, (prev_id, prev_value)
        self.settled, self.ids, self.values, self.text = "", [], [], ""

    def add(self, token: int, value: float) -> str:
        self.ids.append(token)
        self.values.append(value)
        segment = decode_text(self.ntok, self.ids, self.values, *self.prev)
        self.text = self.settled + segment
        if len(self.ids) >= self.SEGMENT and not segment.endswith("\ufffd"):
            self.settled, self.prev, self.ids, self.values = self.text, (token, value), [], []
        return self.text


def first_stop(text: str, stops: Sequence[str]) -> int | None:
    """Where the first stop string starts in `text` (None: none)."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def streamable(text: str, stops: Sequence[str]) -> int:
    """How many characters of a growing `text` a stream may send: up to a stop string; otherwise all but the last
    (longest stop - 1) characters, which could still begin one, and never a partial character."""
    cut = first_stop(text, stops)
    if cut is not None:
        return cut
    whole = len(text.rstrip("\ufffd"))
    return max(0, whole - (max((len(s) for s in stops), default=1) - 1))


class NumberStreamer:
    """Prints generated text as it comes, numbers rendered (batch size 1, like TextStreamer).

    Protocol (also what `generate` expects from any ``streamer``): ``put(token_ids)`` first with
    the prompt [1, S], then once per step with the new token [1]; ``end()`` at the end. `generate`
    passes ``numeric_values=`` as well to a ``put`` that accepts it. A plain
    ``transformers.TextStreamer`` / ``TextIteratorStreamer`` given to `generate` is driven through a
    NumberStreamer (its tokenizer has no <NUM>): it receives the text with the numbers rendered.
    """

    def __init__(self, tokenizer, num_token_id: int | None = None, skip_prompt: bool = True, file=None):
        self.ntok = number_tokenizer(tokenizer, num_token_id if num_token_id is not None else len(tokenizer))
        self.skip_prompt = skip_prompt
        self.file = file
        self._ids: list[int] = []
        self._vals: list[float] = []
        self._printed = 0
        self._prompt_seen = False
        self._prev: tuple[int | None, float] = (None, 0.0)  # last prompt token, when skipped
        self.text = ""

    def put(self, token_ids: Tensor, numeric_values: Tensor | None = None) -> None:
        if token_ids.dim() > 1:
            if token_ids.shape[0] > 1:
                raise ValueError("NumberStreamer only supports batch size 1")
            token_ids = token_ids[0]
            numeric_values = None if numeric_values is None else numeric_values[0]
        values = [0.0] * token_ids.numel() if numeric_values is None else numeric_values.reshape(-1).tolist()
        if not self._prompt_seen:
            self._prompt_seen = True
            if self.skip_prompt:
                ids = token_ids.reshape(-1).tolist()
                if ids:  # a number right after a prompt-final number needs the separator
                    self._prev = (ids[-1], values[-1])
                return
        self._ids += token_ids.reshape(-1).tolist()
        self._vals += values
        text = self._decoded()
        if text.endswith("\ufffd"):  # an incomplete multi-byte character: wait for the next token
            return
        self._emit(text)

    def _decoded(self) -> str:
        return decode_text(self.ntok, self._ids, self._vals, *self._prev)

    def end(self) -> None:
        self._emit(self._decoded() if self._ids else self.text)
        self.on_finalized_text("", stream_end=True)

    def _emit(self, text: str) -> None:
        new = text[self._printed:]
        self._printed = len(text)
        self.text = text
        if new:
            self.on_finalized_text(new, stream_end=False)

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        print(text, end="" if not stream_end else "\n", flush=True, file=self.file or sys.stdout)


def number_text_streamer(streamer, num_token_id: int):
    """A transformers TextStreamer (or TextIteratorStreamer) decodes with its tokenizer, which has no
    <NUM>: every number would be dropped. Drive it through a NumberStreamer instead, whose finished
    text (numbers rendered) goes to the streamer's own `on_finalized_text`."""
    if streamer is None or isinstance(streamer, NumberStreamer) or not (
            hasattr(streamer, "tokenizer") and hasattr(streamer, "on_finalized_text")):
        return streamer
    try:
        if "numeric_values" in inspect.signature(streamer.put).parameters:
            return streamer  # already number-aware
    except (TypeError, ValueError):
        pass
    adapter = NumberStreamer(streamer.tokenizer, num_token_id, skip_prompt=getattr(streamer, "skip_prompt", False))
    adapter.on_finalized_text = streamer.on_finalized_text
    return adapter


def put(streamer, ids: Tensor, values: Tensor) -> None:
    """streamer.put(ids) (with numeric_values= when its put takes them)."""
    try:
        accepts = "numeric_values" in inspect.signature(streamer.put).parameters
    except (TypeError, ValueError):
        accepts = False
    if accepts:
        streamer.put(ids.cpu(), numeric_values=values.cpu())
    else:
        streamer.put(ids.cpu())


def step_tensors(rows, step: int, pad_id: int, device) -> tuple[Tensor, Tensor]:
    """(token [B], value [B]) every row wrote at `step` (pad / 0 for a row that had finished), for a streamer and
    `generate`'s callback."""
    toks = [r.tokens[step] if len(r.tokens) > step else pad_id for r in rows]
    vals = [r.fed_values[step] if len(r.fed_values) > step else 0.0 for r in rows]
    dtype = rows[0].group.vdtype if rows else torch.float32
    return (torch.tensor(toks, dtype=torch.long, device=device), torch.tensor(vals, dtype=dtype, device=device))
