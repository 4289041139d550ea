"""Step 6 of a decoding step, stop: a row ends after an eos id, after the token that completes one of its stop
strings in its new text, at its own max_new_tokens, when its caller cancels it (a client gone), or on a fault (its
hidden state or its value not finite: `stop_on_fault`, with a `stop_reason`); it then leaves the batch
(`loop.StepLoop`)."""
from __future__ import annotations

import math

from .record import FAULT_HIDDEN, Row
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


def stop_on_fault(row: Row, fault: int, loc_Y: float, scale_Y: float) -> None:
    """End `row` before the step it could not take (`record.faults`), saying why in `row.stop_reason`."""
    step = len(row.tokens) + 1
    if fault == FAULT_HIDDEN:
        row.stop_reason = (f"stopped at step {step}: the backbone's hidden state is not finite (NaN or inf), so no "
                           "token can be chosen")
    else:
        vm = row.group.settings.value_map
        where = "not finite"
        if vm.log and vm.bounds is not None and math.isfinite(loc_Y):
            lo, hi = (math.exp(b) for b in vm.bounds)
            where = (f"exp({loc_Y:.6g}) on log y, outside the values it writes, [{lo:.4g}, {hi:.4g}] (its training "
                     "values' range widened by its width)")
        row.stop_reason = (f"stopped at step {step}: the value head cannot write the number chosen here: its "
                           f"location (loc_Y={loc_Y:.6g}, scale_Y={scale_Y:.6g}) is {where}: a position it was not "
                           "fitted at")
    row.done = True
