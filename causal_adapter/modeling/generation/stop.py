"""Step 6 of a decoding step, stop: a row ends after an eos id, after the token that completes one of its stop
strings in its new text, at its own max_new_tokens, when its caller cancels it (a client gone), or on a fault (its
hidden state or its value not finite: `stop_on_fault`, with a `stop_reason`); a horizon's lane after its
`max_values` values, or when it writes `max_text` tokens without one (`count_value`); it then leaves the batch
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
    cancelled, or a lane's values all written) after it wrote `tok` with `value`."""
    if row.max_values is not None:
        count_value(row, tok)
    if tok in eos:
        row.finished = True
    elif row.text is not None:
        text = row.text.add(tok, value)
        if row.stop_strings and any(s in text for s in row.stop_strings):
            row.finished = True
    if row.finished or row.cancelled or len(row.tokens) >= row.max_new_tokens:
        row.done = True


def count_value(row: Row, tok: int) -> None:
    """A lane's last token: one of its values (a forced one the head wrote, or a <NUM> after `value_after`) is noted
    in `value_steps`; the lane is done at `max_values` values, and ends (`stop_reason`) after `max_text` tokens of
    its own text without one (given tokens count none)."""
    i = len(row.tokens) - 1
    if row.forced is not None and i < len(row.forced):
        is_value = row.forced[i][1] is None
        if not is_value:
            return
    else:
        seq = row.ids + row.tokens
        is_value = (tok == row.group.settings.num_id and row.value_after is not None
                    and tuple(seq[-3:-1]) == row.value_after)
    if is_value:
        row.value_steps.append(i)
        if len(row.value_steps) >= row.max_values:
            row.done = True
    elif row.max_text is not None and i - (row.value_steps[-1] if row.value_steps else -1) > row.max_text:
        row.stop_reason = f"wrote no value within {row.max_text} tokens after value {len(row.value_steps)}"
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
