"""The log-probability of every token of a text under a causal adapter (docs/evaluate.md): ONE function,
`sequence_logprobs`, behind both lm-evaluation-harness's model (`integrations.lm_eval_harness`) and the server's
``logprobs`` / ``echo`` (`serving.engine`), so the two cannot drift.

Token t of a sequence is scored from the outputs at position t - 1:

* a text token k: ``log p_k`` of the token distribution. ``mode="softmax"``: ``p = softmax(loc_S)``, so that at
  initialisation (loc_S = the base model's logits) it is the base model's log-likelihood, to float rounding.
  ``mode="ovr"``: the One-vs-Rest probabilities normalised over the vocabulary, ``p_k = P_k / sum_j P_j`` with
  ``P_k = P(S_k > C_k)``: OvR probabilities do not sum to one (each is its own yes/no question), so their logs would
  not be a likelihood; normalised they are a distribution whose ranking is the OvR decision's (argmax P_k, what
  deterministic decoding writes), so multiple choice and perplexity mean what they mean for any model.
* a number (the ``<NUM>`` token with the value v written as the text w): ``log p_<NUM> + log P(v rounds to w)``, the
  second term the value head's Cauchy probability of the interval of half a written unit either side of w
  (`written_half_unit`): ``P(lo < y < hi) = F(T(hi)) - F(T(lo))``, F the Cauchy(loc_Y, scale_Y) CDF on the head's
  scale, T the value map (identity, or log y: an interval reaching 0 or below keeps only its positive part). A
  probability, not a density: a multiple-choice task over numbers compares probabilities.

Top alternatives (`top_k`): the k most probable tokens at each position; where ``<NUM>`` is one of them it stands for
its most probable written value, the value head's point value written by `numbers.format_number` (its ``text``), with
log-probability ``log p_<NUM> + log P(y rounds to that text)``. A token is *greedy* when no alternative of the
position is more probable than it (for a number: ``<NUM>`` is the argmax token and its written interval is at least
as probable as the point value's).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import Tensor

from ..numbers import NumberTokenizer, format_number, parse_number
from .cauchy import ovr_log_probs
from .heads import full_precision

MODES = ("softmax", "ovr")
#: positions whose [V] scores are materialised at a time (float64: 8 V bytes each)
SCORE_CHUNK = 32


def written_half_unit(text: str) -> float:
    """Half a unit in the last written place of a number's text: ``"42"`` 0.5, ``"3.14"`` 0.005, ``"1,234"`` 0.5,
    ``"1.5e3"`` 50, ``".5"`` 0.05. The value as written stands for every value that rounds to it."""
    s = text.strip().replace(",", "").lstrip("+-\u2212")
    mantissa, _, exponent = s.lower().partition("e")
    decimals = len(mantissa.split(".", 1)[1]) if "." in mantissa else 0
    return 0.5 * 10.0 ** ((int(exponent) if exponent else 0) - decimals)


def interval_log_probability(loc_Y: Tensor, scale_Y: Tensor, value: Tensor, half: Tensor, value_map) -> Tensor:
    """log P(value - half < y < value + half) for y with T(y) ~ Cauchy(loc_Y, scale_Y), elementwise, float64.

    F(b) - F(a) = (atan((b - loc)/s) - atan((a - loc)/s)) / pi = atan2(s (b - a), s^2 + (b - loc)(a - loc)) / pi:
    no cancellation in the tails (both ends far on one side), b - a computed directly. Under a log map an interval
    reaching 0 keeps (0, hi): F(log hi); one wholly at or below 0 has probability 0 (log: -inf)."""
    dt = torch.float64
    loc, s = loc_Y.to(dt), scale_Y.to(dt)
    v, h = value.to(dt), half.to(dt)
    lo, hi = v - h, v + h
    if value_map is not None and value_map.log:
        b = torch.log(hi.clamp_min(torch.finfo(dt).tiny))
        open_left = lo <= 0
        a = torch.log(torch.where(open_left, hi, lo).clamp_min(torch.finfo(dt).tiny))
        width = torch.where(open_left, torch.ones_like(b), torch.log1p(2 * h / torch.where(open_left, hi, lo)))
        p = torch.where(open_left, torch.atan2(s, loc - b), torch.atan2(s * width, s * s + (b - loc) * (a - loc)))
        p = torch.where(hi <= 0, torch.zeros_like(p), p)
    else:
        p = torch.atan2(s * (hi - lo), s * s + (hi - loc) * (lo - loc))
    return torch.log(p) - math.log(math.pi)


@dataclass
class SequenceLogprobs:
    """What `sequence_logprobs` returns for one sequence, T = the scored tokens (positions start..n-1).

    logprobs: [T] float64, log p(token t | tokens < t), the number term included (module docstring).
    greedy: [T] bool, whether token t is the most probable choice at its position.
    top_ids: [T, k] the k most probable token ids (k = top_k; num_token_id for a number).
    top_logprobs: [T, k] float64, their log-probabilities (a number's: at its point value's written text).
    top_texts: per position, the k alternatives' texts for numbers (`format_number` of the point value), None for a
        text token (its text is the tokenizer's).
    """

    logprobs: Tensor
    greedy: Tensor
    top_ids: Tensor
    top_logprobs: Tensor
    top_texts: list[list[str | None]] = field(default_factory=list)


def _token_log_probs(model, loc_S: Tensor, scale_S: Tensor, mode: str) -> Tensor:
    """[P, V] -> [P, V] float64 log p of the token distribution of `mode`."""
    loc_S = loc_S.to(torch.float64)
    if mode == "softmax":
        return torch.log_softmax(loc_S, dim=-1)
    log_p, _ = ovr_log_probs(loc_S - model.action.threshold_scores().to(loc_S), scale_S.to(torch.float64))
    return log_p - torch.logsumexp(log_p, dim=-1, keepdim=True)


@torch.no_grad()
def sequence_logprobs(model, input_ids: Sequence[Sequence[int]], numeric_values: Sequence[Sequence[float]],
                      number_texts: Sequence[Sequence[str | None]] | None = None, *,
                      starts: Sequence[int] | None = None,
                      mode: str = "softmax", top_k: int = 0) -> list[SequenceLogprobs]:
    """Per-token log-probabilities of whole sequences under a `CausalModel` (module docstring).

    input_ids, numeric_values: per sequence, its n ids and values (the number-aware encoding: `<NUM>` and its value).
    number_texts: per sequence, the written text at each `<NUM>` (None elsewhere); default: `format_number` of the
        value. The text decides the rounding interval (`written_half_unit`).
    starts: per sequence, the first position scored (default 1: every token after the first); tokens start..n-1
        are scored, each from the outputs of the position before it (the model reads tokens 0..n-2).
    mode: "softmax" (log_softmax of loc_S) or "ovr" (the normalised OvR probabilities).
    top_k: how many alternatives to return per position (0: none).

    The sequences are right padded into one batch (attention mask; a sequence's scores do not depend on the others).
    Returns one `SequenceLogprobs` per sequence.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    rows = [list(map(int, ids)) for ids in input_ids]
    if not rows:
        return []
    vals = [list(map(float, v)) for v in numeric_values]
    texts = [list(t) for t in number_texts] if number_texts is not None else [[None] * len(r) for r in rows]
    starts = list(starts) if starts is not None else [1] * len(rows)
    num = model.num_token_id
    for i, (r, v, t, s) in enumerate(zip(rows, vals, texts, starts)):
        if len(v) != len(r) or len(t) != len(r):
            raise ValueError(f"sequence {i}: {len(r)} ids but {len(v)} values and {len(t)} number texts")
        if not 1 <= s < len(r):
            raise ValueError(f"sequence {i}: start {s} outside 1..{len(r) - 1} (the first token has no context; "
                             "at least one token is scored)")
    # the model reads every token but the last (whose outputs would score the token after the sequence)
    width = max(len(r) for r in rows) - 1
    pad = 0
    device = model.input_device
    ids = torch.tensor([r[:-1] + [pad] * (width - len(r) + 1) for r in rows], device=device)
    values = torch.tensor([v[:-1] + [0.0] * (width - len(v) + 1) for v in vals], dtype=torch.float32, device=device)
    mask = torch.tensor([[1] * (len(r) - 1) + [0] * (width - len(r) + 1) for r in rows], device=device)
    out = model(ids, values, attention_mask=mask if width * len(rows) != int(mask.sum()) else None)
    results = []
    with full_precision(out.loc_U.device):
        for b, r in enumerate(rows):
            pos = torch.arange(starts[b] - 1, len(r) - 1, device=out.loc_U.device)  # the outputs that score t = pos + 1
            target = torch.tensor(r[starts[b]:], device=out.loc_U.device)
            loc_U = out.loc_U[b, pos]
            scale_Up = model.action.noisy_scale(out.scale_U[b, pos])
            loc_Y, scale_Y = out.loc_Y[b, pos].to(torch.float64), out.scale_Y[b, pos].to(torch.float64)
            on_log = None if out.value_log is None else out.value_log[b, pos.to(out.value_log.device)]
            vm = model.value_map.rows(on_log)  # a "series" head: the row's own scale
            lp_tok, greedy_tok, top_lp, top_id = [], [], [], []
            for c in range(0, len(pos), SCORE_CHUNK):
                sl = slice(c, c + SCORE_CHUNK)
                loc_S, scale_S = model.action.scores(loc_U[sl], scale_Up[sl], model.W_cls)
                logp = _token_log_probs(model, loc_S, scale_S, mode)
                lp_tok.append(logp.gather(-1, target[sl, None]).squeeze(-1))
                greedy_tok.append(logp.argmax(-1) == target[sl])
                if top_k:
                    lp, tid = logp.topk(min(top_k, logp.shape[-1]), dim=-1)
                    top_lp.append(lp)
                    top_id.append(tid)
                else:  # the <NUM> log-probability, for the greedy check of a number
                    top_lp.append(logp[:, num:num + 1])
                    top_id.append(torch.full_like(target[sl, None], num))
            lp_tok, greedy = torch.cat(lp_tok), torch.cat(greedy_tok)
            top_lp, top_id = torch.cat(top_lp), torch.cat(top_id)
            # the number term: at each target <NUM>, P(the value rounds to its written text)
            is_num = target == num
            point = vm.to_value(loc_Y)  # the most probable value (the median: T is increasing)
            point_texts = [format_number(float(x)) for x in point.tolist()]
            point_lp = interval_log_probability(
                loc_Y, scale_Y, torch.tensor([parse_number(t) or 0.0 for t in point_texts], dtype=torch.float64,
                                             device=loc_Y.device),
                torch.tensor([written_half_unit(t) for t in point_texts], dtype=torch.float64, device=loc_Y.device), vm)
            if bool(is_num.any()):
                k = is_num.nonzero().squeeze(-1)
                tv = [vals[b][starts[b] + int(j)] for j in k.tolist()]
                tt = [texts[b][starts[b] + int(j)] or format_number(v) for j, v in zip(k.tolist(), tv)]
                term = interval_log_probability(
                    loc_Y[k], scale_Y[k], torch.tensor(tv, dtype=torch.float64, device=loc_Y.device),
                    torch.tensor([written_half_unit(t) for t in tt], dtype=torch.float64, device=loc_Y.device), vm)
                lp_tok = lp_tok.clone()
                lp_tok[k] = lp_tok[k] + term
                # a number is greedy when <NUM> is the argmax token and its interval beats the point value's text
                greedy = greedy.clone()
                greedy[k] = greedy[k] & (term >= point_lp[k])
            num_col = top_id == num
            top_lp = torch.where(num_col, top_lp + point_lp[:, None], top_lp)
            if top_k:
                top_texts = [[point_texts[t] if bool(num_col[t, j]) else None for j in range(top_id.shape[1])]
                             for t in range(top_id.shape[0])]
            else:
                top_lp, top_id, top_texts = top_lp[:, :0], top_id[:, :0], [[] for _ in range(len(pos))]
            results.append(SequenceLogprobs(lp_tok.cpu(), greedy.cpu(), top_id.cpu(), top_lp.cpu(), top_texts))
    return results


def encode_with_texts(ntok: NumberTokenizer, text: str) -> tuple[list[int], list[float], list[str | None]]:
    """(ids, values, the written text of each number) of `text`: what `sequence_logprobs` takes."""
    e = ntok.encode_batch([text], return_offsets=False)[0]
    return list(e.input_ids), list(e.numeric_values), list(e.number_texts)
