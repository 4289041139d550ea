"""Step 4 of a decoding step, place a number: the number layout of training (`CausalAdapterConfig.number_prefix_id`,
set by `train()`). The value head is fitted only at the tokens that precede a training number (Qwen's ``" "`` of
``": 1033.57"``), so a ``<NUM>`` chosen after any other token (a prompt ending ``":"``) is written as that prefix
first, and the ``<NUM>`` follows at the next step, its value read at the prefix's position as in training."""
from __future__ import annotations

import torch
from torch import Tensor

from .prepare import Settings


def place_number(s: Settings, tok: Tensor, prob: Tensor, loc_U: Tensor, scale_Up: Tensor, prev: Tensor,
                 pending: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """tok, prob [n]: the choice and its P_k; prev [n] the previous token of each row; pending [n] the rows whose
    number was announced by its prefix at the previous step. Returns the tokens [n], their P_k [n] and the rows whose
    ``<NUM>`` comes next [n]. No layout (`prefix_id` None): the choice as it is."""
    if s.prefix_id is None:
        return tok, prob, torch.zeros_like(pending)
    num = s.num_id
    tok = torch.where(pending, num, tok)
    wrap = (tok == num) & ~pending & ~torch.isin(prev, s.contexts)
    tok = torch.where(wrap, s.prefix_id, tok)
    changed = pending | wrap
    if bool(changed.any()):
        p = s.scorer.row_probability(tok, s.scorer.row_locations(loc_U, tok), scale_Up)
        prob = torch.where(changed, p.to(prob.dtype), prob)
    return tok, prob, wrap
