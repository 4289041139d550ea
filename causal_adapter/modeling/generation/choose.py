"""Step 3 of a decoding step, choose a token: the heads on each row's last hidden state z, and the mode's choice
(SPEC section 4).

* ``softmax``: logits = loc_S (= the base model's logits at initialisation); greedy, or sampling with temperature /
  top-k / top-p (transformers' logits warpers). value = loc_Y.
* ``deterministic``: token = argmax_k P_k, P_k = P(S_k > C_k) the OvR probability (`scoring.OvRScorer`, exact with
  pruning); value = loc_Y.
* ``causal``: an individual u = loc_U + scale_U' tan(pi (eps - 1/2)), eps ~ U(0,1)^C, then the noiseless action:
  token = argmax_k (W_cls u + b_cls - C)_k (`ActionHead.decision_scores`), value = the value head's own
  Cauchy(loc_Y, scale_Y) at the quantile the same u gives it (`ActionHead.individual_value`, as the horizon's paths):
  repeated draws spread as the head's raw interval (SPEC 4, amended).

Every value written is the value head's location mapped to the value (`value_transform.ValueMap.to_value`: itself,
or exp of it for a head on log y); one that is not finite, or outside a log head's bounds, is not written
(`Choice.writable`: the row ends there, `record.faults`).

Random protocol (so a run can be reproduced): a group's draws come from its generator, one ``torch.rand((n, C))``
(causal) or one ``torch.multinomial`` over [n, V] (softmax sampling) per step, n = the group's slots when its rows
were all given at once (`Group.fixed_slots`: a row's draws never depend on the rows beside it), else its rows present.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from ..cauchy import cauchy_icdf
from ..series_ar import mixed_locations
from .place import place_number
from .prepare import Group, Settings


@dataclass
class Choice:
    """One step of n rows, on the heads' device: token, value (before rounding), P_k of the token, loc_Y, scale_Y,
    the rows whose <NUM> comes next (`place_number`), whether each value can be written (`ValueMap.writable`: finite
    and within a log head's bounds), and the causal mode's eps [n, C] (None otherwise)."""

    tok: Tensor
    val: Tensor
    prob: Tensor
    loc_Y: Tensor
    scale_Y: Tensor
    pending: Tensor
    writable: Tensor
    eps: Tensor | None = None


@dataclass
class Heads:
    """The heads on n rows' last hidden states (their adapter active): loc_U, scale_U' [n, C], loc_Y, scale_Y [n]."""

    loc_U: Tensor
    scale_Up: Tensor
    loc_Y: Tensor
    scale_Y: Tensor


def heads(model, g: Group, z: Tensor, recent: Tensor | None = None, log: Tensor | None = None,
          ars: list | None = None) -> Heads:
    """The abduction and the value head on z [n, H]; recent [n, W] the numbers the value head reads (its first
    K); log [n] bool a "series" head's rows on log y (`record.Row.log`); ars [n] each row's series' own AR
    (`record.Row.ar`), mixed into loc_Y (`series_ar.mixed_locations`)."""
    loc_U, scale_U = model.abduction(z)
    scale_Up = model.action.noisy_scale(scale_U)
    window = recent
    if recent is not None:
        recent = recent[:, :g.settings.recent_k].to(g.vdtype)
    log = None if log is None or not model.action.value_map.series else log.to(loc_U.device)
    loc_Y, scale_Y = model.action.regression(loc_U, scale_Up, recent, log)
    if ars is not None and window is not None:
        loc_Y = mixed_locations(loc_Y, window, model.action.value_map.log if log is None else log, ars)
    return Heads(loc_U, scale_Up, loc_Y, scale_Y)


def reads_vocabulary_product(g: Group) -> bool:
    """Whether the group's choice starts from W_cls loc_U (softmax, deterministic): rows of several adapters can then
    share that product (W_cls is the base's lm_head, shared)."""
    return g.opts.mode != "causal"


def approximate_product(g: Group) -> bool:
    """Whether the group's W_cls loc_U is the bfloat16 one (`OvRScorer.approx_vocab`: the deterministic mode where a
    bf16 product is cheap; its argmax stays that of the float32 product)."""
    return g.opts.mode == "deterministic" and g.settings.scorer.approximate


def choose(model, g: Group, z: Tensor, *, prev: Tensor, pending: Tensor, recent: Tensor | None = None,
           steps: Tensor | None = None, slots: Tensor | None = None, shared_eps: Tensor | None = None,
           history: Callable[[], Tensor] | None = None, done: Heads | None = None,
           vocab: Tensor | None = None, floored: Tensor | None = None, log: Tensor | None = None,
           forced: Tensor | None = None, ars: list | None = None) -> Choice:
    """The group's rows: z [n, H] (its adapter active, unless `done` holds its heads and the mode reads W_cls loc_U:
    then only the group's scorer is read). prev / pending [n] (`place_number`); recent [n, K] the numbers the value
    head reads; steps [n] tokens each row wrote (for min_new_tokens); slots [n] the rows' draw slots; shared_eps
    [n, C] (shared_individual); history() [n, L] the rows' tokens (for warpers that read them); vocab [n, V] W_cls
    loc_U computed with other groups' rows (one pass over W_cls for a step; the bf16 one where
    `approximate_product(g)`); floored [n] bool: rows whose series never goes below 0 (`record.Row.floored`): the
    value they write is floored there; log [n] bool: a "series" head's rows on log y (`record.Row.log`); forced [n]
    the token a row must write (a horizon lane's <NUM>: its value is the mode's, its draws as any row's), -1 where it
    chooses (None: every row chooses); ars [n] the rows' series' own ARs (`heads`)."""
    s = g.settings
    h = done if done is not None else heads(model, g, z, recent, log, ars)
    early = None
    if s.opts.min_new_tokens and s.eos and steps is not None:
        early = (steps < s.opts.min_new_tokens).to(s.hdev)  # eos ids cannot be chosen yet (as transformers)
    eps = None
    given = None if forced is None else forced.to(s.hdev) >= 0
    everyone = given is not None and bool(given.all())  # no token to choose: the vocabulary is not read
    if s.opts.mode == "causal":
        eps = shared_eps if s.opts.shared_individual else _eps(g, z.shape[0], slots)
        if everyone:
            tok, prob, val = forced, None, model.action.individual_value(h.loc_Y, h.scale_Y, eps, h.scale_Up)
        else:
            tok, val, prob = _choose_causal(model, s, h, eps, early)
    elif everyone:
        tok, prob, val = forced, None, h.loc_Y
    else:
        tok, val, prob = _choose_by_scores(g, h.loc_U, h.scale_Up, h.loc_Y, early, slots, history, vocab)
    if not everyone:
        tok, prob, pending = place_number(s, tok, prob, h.loc_U, h.scale_Up, prev, pending)
    if given is not None:
        tok = torch.where(given, forced.to(tok.device), tok)
        p_given = s.scorer.row_probability(tok, s.scorer.row_locations(h.loc_U, tok), h.scale_Up)
        prob = p_given if prob is None else torch.where(given, p_given, prob)
        pending = pending & ~given
    vm = s.value_map.rows(log)  # a "series" head: each row on its own scale
    value = vm.to_value(val)
    if floored is not None:
        value = torch.where(floored.to(value.device) & (value < 0), torch.zeros_like(value), value)
    writable = vm.writable(val)
    if given is not None:  # a lane's value is written where to_value puts it (a log head's clamped), if finite
        writable = torch.where(given, torch.isfinite(value), writable)
    return Choice(tok, value, prob, h.loc_Y, h.scale_Y, pending, writable, eps)


def draw_eps(n: int, C: int, dtype: torch.dtype, device, gen) -> Tensor:
    eps = torch.rand((n, C), generator=gen, dtype=dtype, device=device)
    tiny = torch.finfo(dtype).eps  # never exactly 0 or 1: u stays finite (as sample_cauchy)
    return eps.clamp(tiny, 1.0 - tiny)


def _eps(g: Group, n: int, slots: Tensor | None) -> Tensor:
    s = g.settings
    if g.fixed_slots and n != g.slots:
        return draw_eps(g.slots, s.C, s.hdtype, s.hdev, g.gen)[slots]
    return draw_eps(n, s.C, s.hdtype, s.hdev, g.gen)


def _mask_eos(scores: Tensor, s: Settings, early: Tensor | None) -> None:
    if early is not None and bool(early.any()):
        rows = early.nonzero().squeeze(1)
        scores[rows.unsqueeze(1), s.eos_t.unsqueeze(0)] = -math.inf  # as MinNewTokensLengthLogitsProcessor


def _choose_causal(model, s: Settings, h: Heads, eps: Tensor, early: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """causal mode: an individual u [n, C] drawn from eps, then the noiseless action on u: its token, and its value
    in the head's own Cauchy (on the head's scale)."""
    scorer = s.scorer
    u = cauchy_icdf(eps, h.loc_U, h.scale_Up).to(s.hdtype)
    decision = model.action.decision_scores(u, scorer.W_cls)
    _mask_eos(decision, s, early)
    tok = decision.argmax(-1)
    prob = scorer.row_probability(tok, scorer.row_locations(h.loc_U, tok), h.scale_Up)
    return tok, model.action.individual_value(h.loc_Y, h.scale_Y, eps, h.scale_Up), prob


def _choose_by_scores(g: Group, loc_U: Tensor, scale_Up: Tensor, loc_Y: Tensor, early: Tensor | None,
                      slots: Tensor | None, history, vocab: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """deterministic mode (argmax of the OvR P_k) and softmax mode (greedy or sampled from loc_S [n, V])."""
    s = g.settings
    scorer = s.scorer
    approx = approximate_product(g)
    if vocab is None:
        loc_S = scorer.approx_loc_scores(loc_U) if approx else scorer.loc_scores(loc_U)
    else:  # as OvRScorer.(approx_)loc_scores, from W_cls loc_U computed for several groups at once
        loc_S = scorer.action.override_num_column(vocab + scorer.action.b_cls, loc_U)
    _mask_eos(loc_S, s, early)
    if s.opts.mode == "deterministic":
        tok, prob = scorer.ovr_argmax(loc_S, scale_Up, loc_U if approx else None)
        return tok, loc_Y, prob
    scores = loc_S
    if s.warpers is not None and len(s.warpers):
        scores = s.warpers(history().to(s.hdev) if s.reads_history and history is not None else None, scores)
    if s.opts.do_sample:
        probs = torch.softmax(scores, -1)
        n = probs.shape[0]
        if g.fixed_slots and n != g.slots:  # every slot draws (one exponential per entry): the live rows' own draws
            full = probs.new_full((g.slots, probs.shape[1]), 1.0 / probs.shape[1])
            full[slots] = probs
            tok = torch.multinomial(full, 1, generator=g.gen).squeeze(1)[slots]
        else:
            tok = torch.multinomial(probs, 1, generator=g.gen).squeeze(1)
    else:
        tok = scores.argmax(-1)
    prob = scorer.row_probability(tok, loc_S.gather(1, tok.unsqueeze(1)).squeeze(1), scale_Up)
    return tok, loc_Y, prob
