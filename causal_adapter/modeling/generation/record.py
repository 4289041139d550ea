"""Step 5 of a decoding step, record: what each row wrote (`Row`: its token, the value fed back and the exact one,
P_k, loc_Y / scale_Y), the value rounded as the data writes values (`written_values`), and the value head's window of
recent numbers (`recent_window`, `push_recent`)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..series import prompt_support
from .prepare import Group
from .stream import RowText


@dataclass(eq=False)
class Row:
    """One sequence of a running batch: its prompt (ids and values, no padding), its `group` (adapter and decoding
    options), its own limits, and what it wrote so far. `tag`: the caller's handle (the server's request and choice).
    `keep_text`: keep `text` (its decoded text, grown by `RowText`) even without stop strings (a stream reads it)."""

    ids: list[int]
    values: list[float]
    group: Group
    max_new_tokens: int
    stop_strings: tuple[str, ...] = ()
    tag: Any = None
    keep_text: bool = False
    # written by the step loop
    tokens: list[int] = field(default_factory=list)
    fed_values: list[float] = field(default_factory=list)  # what was written and fed back (rounded)
    exact: list[float] = field(default_factory=list)  # before rounding
    probs: list[float] = field(default_factory=list)
    loc_Y: list[float] = field(default_factory=list)
    scale_Y: list[float] = field(default_factory=list)
    eps: list[Tensor] | None = None  # causal mode with return_eps: [C] per step
    text: RowText | None = None
    slot: int = 0  # its row of the group's draws
    finished: bool = False  # stopped on an eos id or a stop string
    done: bool = False  # written its last token (finished, max_new_tokens) or cancelled
    cancelled: bool = False
    reused_tokens: int = 0  # prompt tokens read from the prefix cache
    stop_reason: str | None = None  # why a row ended before its end (`stop.stop_on_fault`); None: it did not
    # its series never goes below 0: no value it writes does; its series' width factor (its intervals'); None: read
    # from its prompt when it joins (`series.prompt_support`)
    floored: bool | None = None
    series_scale: float = 1.0
    log: bool = False  # a "series" head tells it on log y (a positive series: `series.prompt_support`)
    ar: dict | None = None  # its series' own AR, mixed into the values it writes (`series_ar`)
    # a horizon's lane (`modeling.horizon`): the tokens it writes, each (id, value), value None where the value head
    # writes it (one of its values); `max_values`: it ends after that many values; `value_after`: a <NUM> it writes
    # after these two tokens is one of its values (its own text between them, at most `max_text` tokens)
    forced: list[tuple[int, float | None]] | None = None
    max_values: int | None = None
    value_after: tuple[int, int] | None = None
    max_text: int | None = None
    value_steps: list[int] = field(default_factory=list)  # where (in tokens) its values are
    lane: int = 0  # its place among the rows of one fork (`StepLoop.add(fork=True)`): lanes > 0 take no row of max_rows

    def forced_next(self) -> tuple[int, float | None] | None:
        """The (id, value) it must write next, or None (it chooses)."""
        if self.forced is None or len(self.tokens) >= len(self.forced):
            return None
        return self.forced[len(self.tokens)]


def read_series(row: Row) -> None:
    """A row's series, read from its prompt as it joins: its series' own AR and, unless set (`Row.floored` not None,
    a horizon's lanes), its floor, its width factor and, for a "series" head, whether it is on log y
    (`series.prompt_support`)."""
    s = row.group.settings
    floored, scale, positive, row.ar = prompt_support(row.ids, row.values, s.num_id, s.value_series,
                                                      max(s.recent_k, 1))
    if row.floored is None:
        row.floored, row.series_scale = floored, scale
        row.log = positive and s.value_map.series


def forced_tokens(rows: list[Row], device) -> Tensor:
    """[n] the token each row must write next (`Row.forced`), -1 where it chooses."""
    return torch.tensor([-1 if f is None else f[0] for f in (r.forced_next() for r in rows)], device=device)


def counted_rows(rows: list[Row]) -> int:
    """The rows that take a row of a batch's max_rows: a fork's lanes take one (lane 0's)."""
    return sum(r.lane == 0 for r in rows)


#: `faults` codes: the row's hidden state is not finite; the <NUM> it chose has no finite value
FAULT_HIDDEN, FAULT_VALUE = 1, 2


def written_values(g: Group, tok: Tensor, val: Tensor) -> tuple[Tensor, Tensor]:
    """(exact, written) values [n] in the group's value dtype: 0 where the token is not <NUM>; written = rounded to
    the adapter's `value_decimals` (shown and fed back as the data writes values; the exact one is kept)."""
    s = g.settings
    vdtype = g.vdtype
    exact = torch.where(tok == s.num_id, val.to(vdtype), torch.zeros((), dtype=vdtype, device=val.device))
    return exact, exact if s.decimals is None else torch.round(exact, decimals=s.decimals)


def faults(z: Tensor, tok: Tensor, fed: Tensor, writable: Tensor, num_id: int) -> Tensor:
    """[n] 0 where a row can go on, else why not (`FAULT_HIDDEN`: its hidden state z [n, H] is not finite;
    `FAULT_VALUE`: it chose <NUM> and the value head cannot write its value: not `writable` [n] (`ValueMap.writable`)
    or, once written and fed back as fed [n], not finite)."""
    hidden = ~torch.isfinite(z).all(-1).to(tok.device)
    value = (tok == num_id) & ~(writable & torch.isfinite(fed))
    return torch.where(hidden, FAULT_HIDDEN, torch.where(value, FAULT_VALUE, 0))


def write_given(rows: list[Row], known: list[int], z: Tensor, tok: Tensor, fed: Tensor, host: Tensor,
            pending: Tensor) -> None:
    """The rows (at batch indices `known`) write the token and value given them (a lane's continuation,
    `Row.forced`) into the step's tok / fed / pending [B] and host [6, B] (`StepLoop._decide`): no head is read; a
    hidden state z [B, H] that is not finite still ends a row (`faults`)."""
    hdev, given = tok.device, [r.forced_next() for r in rows]
    at, t = torch.tensor(known, device=hdev), torch.tensor([f[0] for f in given], dtype=torch.long, device=hdev)
    v = torch.tensor([f[1] for f in given], dtype=fed.dtype, device=hdev)
    hidden = ~torch.isfinite(z[at.to(z.device)]).all(-1).to(hdev)
    pad = torch.tensor([r.group.settings.pad_id for r in rows], device=hdev)
    tok[at], fed[at], pending[at] = torch.where(hidden, pad, t), torch.where(hidden, 0.0, v), False
    nan = torch.full_like(v, math.nan, dtype=torch.float64)
    host[:, at] = torch.stack([v.double(), v.double(), nan, nan, nan, hidden.double() * FAULT_HIDDEN])


def given_run(rows: list[Row]) -> int:
    """How many tokens every row is given next, values and all (`Row.forced`: a lane's continuation), after the
    step's own: they go through the backbone with it in one pass, as a prompt does (0: none, or a row reads its
    text: a stop string, a stream)."""
    k = None
    for r in rows:
        at, n = len(r.tokens), 0
        if r.done or r.forced is None or r.text is not None:
            return 0
        while at + n < min(len(r.forced), r.max_new_tokens - 1) and r.forced[at + n][1] is not None:
            n += 1
        k = n if k is None else min(k, n)
        if not k:
            return 0
    return k or 0


def with_given_run(rows: list[Row], tok: Tensor, fed: Tensor, recent: Tensor | None, num_id: int
                   ) -> tuple[Tensor, Tensor, Tensor | None]:
    """A step's tokens and values fed back, tok / fed [B], with the k tokens every row is given next (`given_run`)
    recorded (nothing read from the heads: P_k, loc_Y, scale_Y NaN; a given token ends nothing) and appended: [B, 1 + k]
    ([B] when k = 0); and the value head's window `recent` [B, K] after them."""
    k = given_run(rows)
    if not k:
        return tok, fed, recent
    toks, vals = [], []
    for r in rows:
        run = r.forced[len(r.tokens):len(r.tokens) + k]
        for t, v in run:
            append_step(r, t, v, v, math.nan, math.nan, math.nan, None)
        toks.append([t for t, _ in run])
        vals.append([v for _, v in run])
    more = torch.tensor(toks, dtype=torch.long, device=tok.device)
    more_fed = torch.tensor(vals, dtype=fed.dtype, device=fed.device)
    for j in range(k):
        recent = None if recent is None else push_recent(recent, more[:, j], more_fed[:, j], num_id)
    return torch.cat([tok.unsqueeze(1), more], 1), torch.cat([fed.unsqueeze(1), more_fed], 1), recent


def recent_window(ids: list[int], values: list[float], num_id: int, k: int) -> list[float]:
    """The k most recent numbers of a sequence, most recent first, NaN where it holds fewer (`recent_numbers.recent_values`
    at its last position)."""
    nums = [v for t, v in zip(ids, values) if t == num_id][-k:][::-1] if k else []
    return nums + [math.nan] * (k - len(nums))


def push_recent(recent: Tensor, tok: Tensor, val: Tensor, num_id: int) -> Tensor:
    """The window [B, k] after each row wrote tok [B] with value val [B]: a <NUM> pushes its value in front."""
    if recent.shape[1] == 0:
        return recent
    shifted = torch.cat([val.to(recent.dtype).unsqueeze(1), recent[:, :-1]], 1)
    return torch.where((tok == num_id).unsqueeze(1), shifted, recent)


def append_step(row: Row, tok: int, fed: float, exact: float, prob: float, loc_Y: float, scale_Y: float,
                eps: Tensor | None) -> None:
    row.tokens.append(tok)
    row.fed_values.append(fed)
    row.exact.append(exact)
    row.probs.append(prob)
    row.loc_Y.append(loc_Y)
    row.scale_Y.append(scale_Y)
    if eps is not None:
        if row.eps is None:
            row.eps = []
        row.eps.append(eps)
