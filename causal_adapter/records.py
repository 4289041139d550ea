"""Which numbers of a completion are its values and which are the labels between them.

A forecasting file writes a completion as records: ``" 33.2; 2016-08: 32.9; 2016-09: 30.4"``, a value, then a label
holding numbers of its own (``2016``, ``08``), then the next value. Every number becomes a ``<NUM>`` target, but
only the values are what the row predicts: the labels are known before (a horizon is given them as its
``continuations``), and counted among the values they would pull the value head's fit towards years and months and
let their near-exact predictions narrow the calibrated intervals (measured: the 50% interval of a forecasting
file's first value covered 0.21 of the test values where the labels were counted).

The rule reads token ids only: value 1 is the completion's first number; every later number written after the same
two tokens as value 1 (``": "`` of ``"2016-07: 33.2"``; the labels' numbers follow other tokens) is the next value
while the records keep their shape (as many numbers between two values). A completion where the rule finds fewer
than two values (a single value, a list, a sentence with numbers of several kinds) keeps every number a value.
"""
from __future__ import annotations

from bisect import bisect_left, bisect_right
from typing import Sequence

import torch
from torch import Tensor

from .config import IGNORE_INDEX

#: tokens before a number that say which kind it is (``":"``, ``" "`` of ``"2016-07: 33.2"``)
CONTEXT_TOKENS = 2


def record_values(ids: Sequence[int], nums: Sequence[int]) -> list[int] | None:
    """The positions of the values among `nums` (the positions of a completion's numbers in `ids`, ascending) when
    they come in records (module docstring), else None."""
    if len(nums) < 2 or nums[0] < CONTEXT_TOKENS:
        return None
    context = list(ids[nums[0] - CONTEXT_TOKENS:nums[0]])
    at = [nums[0]]
    between = None
    for j in nums[1:]:
        if list(ids[j - CONTEXT_TOKENS:j]) != context:
            continue  # a number of the labels ("2016", "08")
        count = bisect_left(nums, j) - bisect_right(nums, at[-1])  # the label's numbers between two values
        if between is not None and count != between:
            break  # the records change shape: the values read so far
        between = count
        at.append(j)
    return at if len(at) >= 2 else None


def labelled_spans(labels: Sequence[int], ignore_index: int = IGNORE_INDEX) -> list[tuple[int, int]]:
    """The maximal runs [start, end) of positions whose label is not `ignore_index` (a completion; several in a
    packed or multi-turn row)."""
    spans, start = [], None
    for i, lab in enumerate(labels):
        if lab != ignore_index and start is None:
            start = i
        elif lab == ignore_index and start is not None:
            spans.append((start, i))
            start = None
    if start is not None:
        spans.append((start, len(labels)))
    return spans


def value_label_mask(ids: Sequence[int], labels: Sequence[int], num_token_id: int,
                     ignore_index: int = IGNORE_INDEX) -> list[bool]:
    """[T] True at each position whose label is a ``<NUM>`` that is one of its completion's values: every labelled
    ``<NUM>`` except the labels' numbers between the first and the last value of a completion written as records
    (`record_values`). Aligned with `ids` / `labels` (the shift to next-token targets is the caller's)."""
    mask = [lab == num_token_id for lab in labels]
    for start, end in labelled_spans(labels, ignore_index):
        nums = [i for i in range(start, end) if ids[i] == num_token_id]
        values = record_values(ids, nums)
        if values is None:
            continue
        kept = set(values)
        for i in nums:
            if values[0] < i < values[-1] and i not in kept:
                mask[i] = False
    return mask


def value_targets(input_ids: Tensor, labels: Tensor, num_token_id: int) -> Tensor:
    """[B, T] bool: `value_label_mask` of each row of a batch (on the labels' device). Rows with fewer than three
    labelled ``<NUM>`` (no label between two values) are every labelled ``<NUM>``, without the per-token pass."""
    is_num = labels == num_token_id
    mask = is_num.clone()
    for b in (is_num.sum(-1) >= 3).nonzero().flatten().tolist():
        row = value_label_mask(input_ids[b].tolist(), labels[b].tolist(), num_token_id)
        mask[b] = torch.tensor(row, dtype=torch.bool, device=labels.device)
    return mask
