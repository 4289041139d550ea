"""Step 6 of a decoding step, stop: a row ends after an eos id, after the token that completes one of its stop
strings in its new text, at its own max_new_tokens, or when its caller cancels it (a client gone); it then leaves the
batch (`loop.StepLoop`)."""
from __future__ import annotations

from .record import Row
from .stream import RowText


def start_text(row: Row, ntok) -> None:
    """Give the row its growing text when it has stop strings or a stream reads it (decoded after its last prompt
    token, as the final text is)."""
    if (row.stop_strings or row.keep_text) and ntok is not None and row.text is None:
        row.text = RowText(ntok, row.ids[-1], row.values[-1])


def stop_after(row: Row, tok: int, value: float, eos: frozenset) -> None:
    """Mark `row` finished (an eos id, a stop string completed) and done (finished, at its max_new_tokens, or
    cancelled) after it wrote `tok` with `value`."""
    if tok in eos:
        row.finished = True
    elif row.text is not None:
        text = row.text.add(tok, value)
        if row.stop_strings and any(s in text for s in row.stop_strings):
            row.finished = True
    if row.finished or row.cancelled or len(row.tokens) >= row.max_new_tokens:
        row.done = True
