"""The numbers the value head reads: the k most recent numbers of the text at each position (`recent_values`), and
where packed rows begin, so that a row reads only its own (`packed_row_starts`)."""
from __future__ import annotations

import math

import torch
from torch import Tensor


def recent_values(input_ids: Tensor, numeric_values: Tensor | None, num_token_id: int, k: int,
                  before: Tensor | None = None, row_starts: Tensor | None = None) -> Tensor:
    """The values of the k most recent <NUM> tokens at or before each position: [B, S] -> [B, S, k], index 0
    the most recent; NaN where the text so far holds fewer than k numbers. `before` [B, k] (same order, NaN =
    none): the numbers of a prefix that is not among `input_ids` (a cached prompt during generation).
    `row_starts` [B, S] bool: True where a packed row begins (`packed_row_starts`); a position then sees only
    the numbers of its own row, from that start on (and `before` only before the first start). None: one row."""
    B, S = input_ids.shape
    dev = input_ids.device
    dt = numeric_values.dtype if numeric_values is not None and numeric_values.is_floating_point() else torch.float32
    if before is None:
        before = torch.full((B, k), math.nan, dtype=dt, device=dev)
    is_num = input_ids == num_token_id
    # every row's numbers in order, oldest first: the prefix's k, then those of input_ids
    values = torch.full((B, k + S), math.nan, dtype=dt, device=dev)
    values[:, :k] = before.to(device=dev, dtype=dt).flip(-1)
    count = k + is_num.long().cumsum(-1)  # numbers at or before each position, the prefix's included
    if numeric_values is not None:
        slot = torch.where(is_num, count - 1, torch.zeros_like(count))
        values.scatter_(1, slot, torch.where(is_num, numeric_values.to(dt), values.gather(1, slot)))
    idx = count.unsqueeze(-1) - 1 - torch.arange(k, device=dev)  # [B, S, k]
    recent = values.gather(1, idx.reshape(B, -1)).reshape(B, S, k)
    if row_starts is None:
        return recent
    # numbers before the current row: the count just before its start, carried forward (counts never decrease)
    before_row = torch.where(row_starts, count - is_num.long(), torch.zeros_like(count)).cummax(-1).values
    own = torch.arange(k, device=dev) < (count - before_row).unsqueeze(-1)  # [B, S, k]: the slot is this row's
    return torch.where(own, recent, torch.full_like(recent, math.nan))


def packed_row_starts(position_ids: Tensor) -> Tensor:
    """[B, S] or [1, S] position ids -> [..., S] bool, True where a packed row begins: where the position does not
    follow the previous one by 1 (transformers' rule for the packed attention mask, `find_packed_sequence_indices`:
    the value head forgets the numbers where attention does). An unpacked row (0, 1, 2, ...) has no start."""
    first = position_ids[..., :1] - 1
    return torch.diff(position_ids, prepend=first, dim=-1) != 1
