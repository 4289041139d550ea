"""Text generation with the causal heads (SPEC section 4), on the backbone's KV cache.

    generate(model, "prompt with 3 numbers", tokenizer=tok, mode="deterministic")
    model.generate(input_ids=..., numeric_values=..., attention_mask=..., mode="causal", seed=0)

Modes (the token and, when the token is ``<NUM>``, its value):

* ``softmax``: logits = loc_S (= the base model's logits at initialisation); greedy, or sampling
  with temperature / top-k / top-p (transformers' logits warpers). value = loc_Y.
* ``deterministic`` (default): token = argmax_k P_k, P_k = P(S_k > C_k) the OvR probability;
  value = loc_Y.
* ``causal``: sample an individual u = loc_U + scale_U' * tan(pi (eps - 1/2)), eps ~ U(0,1)^C,
  then act without noise: token = argmax_k (W_cls u + b_cls - C)_k (ties -> lowest index, but a
  sampled u practically never ties, unlike P with scale 0), value = w_reg . u + b_reg.
  ``shared_individual=True`` draws eps once per sequence and keeps it for every step (one
  individual acting consistently); otherwise eps is fresh at every step. Random protocol
  (documented so a run can be reproduced): the first draw is ``torch.rand((B, C))`` from the
  generator, then one more such draw per step when eps is not shared.

Per step the backbone sees only the new position (``inputs_embeds`` = token embedding +
phi(value), so a generated number is fed back), with the 2-D attention mask and
``position_ids = cumsum(mask) - 1`` exactly as transformers' own ``generate`` builds them;
the heads run on the last position only. Sequences that emit an eos id or complete a stop
string stop; afterwards they are padded with ``pad_token_id`` / value 0 (the backbone keeps
being fed the pad token, as transformers does, so batching never changes a row's output).

The deterministic mode's argmax over the OvR probabilities (exact, pruned) is `scoring.OvRScorer`.
"""
from __future__ import annotations

import inspect
import math
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from .cauchy import cauchy_icdf
from .families import check_no_vision_inputs
from .heads import full_precision
from .intervals import interval
from .scoring import OvRScorer

MODES = ("softmax", "deterministic", "causal")


@dataclass
class GenerationOutput:
    """Result of `generate`. B batch, S prompt length (padded), T generated steps.

    sequences: [B, S+T] prompt + generated ids (pad after a row finished).
    numeric_values: [B, S+T] values aligned with `sequences` (non-zero only at <NUM>).
    attention_mask: [B, S+T] prompt mask, 1 for generated tokens, 0 for the padding after a
        row finished (ready for a continuation).
    new_tokens, new_values: [B, T] the generated part.
    lengths: [B] generated tokens per row (eos / the token completing a stop string included).
    finished: [B] bool, True when the row stopped on eos or a stop string.
    token_probs: [B, T] OvR probability P_k of each chosen token (0 after the row finished).
    numbers: per row, one dict per generated <NUM>: position (index in new_tokens), index (in
        sequences), value (what was emitted and fed back: rounded to `config.value_decimals`
        when the adapter has them), exact (the value before rounding), text (as rendered), loc /
        scale (loc_Y, scale_Y of that step), interval_50 / interval_90 (the central intervals the adapter
        reports: calibrated when it has a calibration map, as `CausalModel.value_interval`) and
        raw_interval_50 / raw_interval_90 (the raw Cauchy ones).
    texts: decoded generated text per row (numbers rendered), when a tokenizer was available.
    eps: [B, T, C] the uniforms of causal mode (with return_eps=True); with
        shared_individual=True every step of a row holds the same eps.
    """

    sequences: Tensor
    numeric_values: Tensor
    attention_mask: Tensor
    new_tokens: Tensor
    new_values: Tensor
    lengths: Tensor
    finished: Tensor
    token_probs: Tensor
    numbers: list[list[dict[str, Any]]] = field(default_factory=list)
    texts: list[str] | None = None
    eps: Tensor | None = None
    mode: str = "deterministic"


# ----------------------------------------------------------------------------- tokenizer glue
def _number_tokenizer(tokenizer, num_token_id: int):
    """A NumberTokenizer for `tokenizer` (a HF tokenizer or already a NumberTokenizer)."""
    if tokenizer is None:
        return None
    from .numbers import NumberTokenizer

    if isinstance(tokenizer, NumberTokenizer):
        if tokenizer.num_token_id != num_token_id:
            raise ValueError(
                f"the NumberTokenizer uses num_token_id={tokenizer.num_token_id} but the model's <NUM> id is "
                f"{num_token_id}"
            )
        return tokenizer
    return NumberTokenizer(tokenizer, num_token_id)


def _encode(ntok, texts: str | Sequence[str]) -> dict:
    return ntok(texts, padding_side="left", return_tensors="pt")


def _decode(ntok, ids: Tensor, values: Tensor, prev_id: int | None = None, prev_value: float = 0.0) -> str:
    """Text of generated ids. When the prompt ends with <NUM> (prev_id), the continuation is
    decoded after it and the prompt's number cut off, so whatever NumberTokenizer puts between
    two adjacent numbers (they must stay two numbers) is part of the new text."""
    if prev_id is not None and prev_id == ntok.num_token_id and ids.numel():
        head = ntok.decode([prev_id], [prev_value], skip_special_tokens=True)
        full = ntok.decode([prev_id] + ids.tolist(), [prev_value] + values.tolist(), skip_special_tokens=True)
        if full.startswith(head):
            return full[len(head):]
    return ntok.decode(ids.tolist(), values.tolist(), skip_special_tokens=True)


def _format(value: float) -> str:
    from .numbers import format_number

    return format_number(value)


class NumberStreamer:
    """Prints generated text as it comes, numbers rendered (batch size 1, like TextStreamer).

    Protocol (also what `generate` expects from any ``streamer``): ``put(token_ids)`` first with
    the prompt [1, S], then once per step with the new token [1]; ``end()`` at the end. `generate`
    passes ``numeric_values=`` as well to a ``put`` that accepts it. A plain
    ``transformers.TextStreamer`` / ``TextIteratorStreamer`` given to `generate` is driven through a
    NumberStreamer (its tokenizer has no <NUM>): it receives the text with the numbers rendered.
    """

    def __init__(self, tokenizer, num_token_id: int | None = None, skip_prompt: bool = True, file=None):
        self.ntok = _number_tokenizer(tokenizer, num_token_id if num_token_id is not None else len(tokenizer))
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
        return _decode(self.ntok, torch.tensor(self._ids, dtype=torch.long), torch.tensor(self._vals, dtype=torch.float64),
                       *self._prev)

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


# ----------------------------------------------------------------------------- inputs
def _resolve_inputs(model, inputs, input_ids, numeric_values, attention_mask, ntok):
    if isinstance(inputs, (str, list, tuple)) and (isinstance(inputs, str) or all(isinstance(t, str) for t in inputs)):
        if input_ids is not None:
            raise ValueError("give either text prompts or input_ids, not both")
        if ntok is None:
            raise ValueError("text prompts need tokenizer=... (a Qwen tokenizer or a NumberTokenizer)")
        enc = _encode(ntok, [inputs] if isinstance(inputs, str) else list(inputs))
        input_ids, numeric_values, attention_mask = enc["input_ids"], enc["numeric_values"], enc["attention_mask"]
    elif isinstance(inputs, (Tensor, list, tuple)):  # ids: a tensor, or (nested) lists of ints
        if input_ids is not None:
            raise ValueError("input_ids given twice (positionally and as a keyword)")
        input_ids = inputs
    elif hasattr(inputs, "keys") and "input_ids" in inputs:  # a dict / BatchEncoding
        check_no_vision_inputs(inputs)
        input_ids = inputs["input_ids"]
        numeric_values = inputs.get("numeric_values", numeric_values)
        attention_mask = inputs.get("attention_mask", attention_mask)
    elif inputs is not None:
        raise ValueError(f"inputs must be a str, a list of str, a tensor of ids or a dict, got {type(inputs).__name__}")
    if input_ids is None:
        raise ValueError("nothing to generate from: pass a prompt (str / list of str with tokenizer=) or input_ids")
    dev = model.input_device  # the embedding's (lm_head and the heads may sit on another device)
    input_ids = torch.as_tensor(input_ids, device=dev, dtype=torch.long)
    if input_ids.dim() == 1:
        input_ids = input_ids.unsqueeze(0)
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must be [batch, seq] with seq >= 1, got shape {tuple(input_ids.shape)}")
    if numeric_values is None:
        numeric_values = torch.zeros(input_ids.shape, device=dev)
    else:
        numeric_values = torch.as_tensor(numeric_values, device=dev).reshape(input_ids.shape)
        if not numeric_values.is_floating_point():
            numeric_values = numeric_values.float()
    attention_mask = (torch.ones_like(input_ids) if attention_mask is None
                      else torch.as_tensor(attention_mask, device=dev).long().reshape(input_ids.shape))
    if (attention_mask[:, 1:] < attention_mask[:, :-1]).any():
        raise ValueError("generation needs LEFT padding: an attention_mask row goes from 1 back to 0 "
                         "(pad prompts on the left, e.g. number_tokenizer(texts, padding_side='left'))")
    if (attention_mask[:, -1] == 0).any():
        raise ValueError("a prompt is empty (its attention_mask row is all zeros)")
    model.check_inputs(input_ids, numeric_values, None, None)
    return input_ids, numeric_values, attention_mask


def _default_ids(model, eos_token_id, pad_token_id, ntok):
    gc = getattr(model.backbone, "generation_config", None)
    if eos_token_id is None:
        eos_token_id = getattr(gc, "eos_token_id", None)
        if eos_token_id is None:
            eos_token_id = getattr(model.backbone.config, "eos_token_id", None)
    if eos_token_id is None or eos_token_id is False:
        eos = []
    elif isinstance(eos_token_id, int):
        eos = [eos_token_id]
    else:
        eos = [int(e) for e in eos_token_id]
    if pad_token_id is None:
        for cand in (getattr(ntok, "pad_token_id", None), getattr(gc, "pad_token_id", None),
                     getattr(model.backbone.config, "pad_token_id", None), eos[0] if eos else None):
            if cand is not None:
                pad_token_id = int(cand)
                break
        else:
            pad_token_id = 0
    return eos, int(pad_token_id)


def _make_generator(seed, generator, device):
    if generator is not None and seed is not None:
        raise ValueError("give seed or generator, not both")
    if seed is not None:
        return torch.Generator(device=device).manual_seed(int(seed))
    return generator


def _put(streamer, ids: Tensor, values: Tensor) -> None:
    try:
        accepts = "numeric_values" in inspect.signature(streamer.put).parameters
    except (TypeError, ValueError):
        accepts = False
    if accepts:
        streamer.put(ids.cpu(), numeric_values=values.cpu())
    else:
        streamer.put(ids.cpu())


# ----------------------------------------------------------------------------- generate
@torch.no_grad()
def generate(
    model,
    inputs: str | Sequence[str] | Tensor | dict | None = None,
    *,
    input_ids: Tensor | None = None,
    numeric_values: Tensor | None = None,
    attention_mask: Tensor | None = None,
    tokenizer=None,
    mode: str = "deterministic",
    max_new_tokens: int | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int | None = None,
    stop_strings: str | Sequence[str] | None = None,
    do_sample: bool | None = None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    logits_processor=None,
    seed: int | None = None,
    generator: torch.Generator | None = None,
    shared_individual: bool = False,
    return_eps: bool = False,
    streamer=None,
    callback: Callable[[int, Tensor, Tensor], Any] | None = None,
    ovr_pruning: bool = True,
    cache_abs_weight: bool = False,
    generation_config=None,
    max_length: int | None = None,
    min_new_tokens: int | None = None,
    repetition_penalty: float | None = None,
    **kwargs,
) -> GenerationOutput:
    """Generate up to `max_new_tokens` tokens per prompt with the causal model (KV cached).

    inputs: a str or list of str (needs `tokenizer`; prompts are left padded), a tensor of
        input_ids, or a dict with input_ids / numeric_values / attention_mask. The same three
        can be given as keywords (attention_mask must be LEFT padded).
    tokenizer: a Qwen tokenizer or a NumberTokenizer; gives `texts` and enables stop_strings.
    mode: "softmax" | "deterministic" (default) | "causal" (see the module docstring).
    eos_token_id: int or list (None = the backbone's generation_config; [] = no eos).
    pad_token_id: None = tokenizer's pad, else generation_config / config pad, else eos.
    stop_strings: a row stops after the token that completes one of them in its new text.
    do_sample, temperature, top_k, top_p, logits_processor: softmax mode only (transformers'
        warpers; do_sample=None samples iff temperature/top_k/top_p is given).
    seed / generator: randomness of softmax sampling and of causal mode (None = global RNG).
    shared_individual: causal mode: one eps per sequence for the whole generation.
    return_eps: causal mode: return the eps used ([B, T, C]).
    streamer: TextStreamer-like (put / end); callback(step, token_ids [B], values [B]).
    ovr_pruning, cache_abs_weight: speed options of the deterministic mode (exact either way).
    generation_config: a transformers GenerationConfig; its set fields that apply to `mode` are used
        (explicit arguments win; sampling fields are ignored outside softmax mode; others are refused).
    max_new_tokens (default 32) / max_length (prompt + new, as transformers; max_new_tokens wins),
    min_new_tokens (eos ids cannot be chosen before), repetition_penalty (softmax mode; transformers'
    processor, <NUM> exempt: repeated numbers are different values). Any other transformers argument
    is refused with the list of what each mode accepts (`accepted_generate_kwargs`).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    hf = _hf_generate_args(mode, generation_config, kwargs, dict(
        max_new_tokens=max_new_tokens, max_length=max_length, min_new_tokens=min_new_tokens,
        eos_token_id=eos_token_id, pad_token_id=pad_token_id, stop_strings=stop_strings, do_sample=do_sample,
        temperature=temperature, top_k=top_k, top_p=top_p, repetition_penalty=repetition_penalty))
    max_new_tokens, max_length, min_new_tokens = hf["max_new_tokens"], hf["max_length"], hf["min_new_tokens"] or 0
    eos_token_id, pad_token_id, stop_strings = hf["eos_token_id"], hf["pad_token_id"], hf["stop_strings"]
    do_sample, temperature, top_k, top_p = hf["do_sample"], hf["temperature"], hf["top_k"], hf["top_p"]
    repetition_penalty = hf["repetition_penalty"]
    sampling_args = any(x is not None for x in (temperature, top_k, top_p)) or logits_processor is not None
    if mode != "softmax" and (do_sample or sampling_args):
        raise ValueError(f"do_sample / temperature / top_k / top_p / logits_processor apply to mode='softmax', "
                         f"not mode={mode!r}")
    if mode != "causal" and (shared_individual or return_eps):
        raise ValueError("shared_individual / return_eps apply to mode='causal'")
    if do_sample is None:
        do_sample = mode == "softmax" and any(x is not None for x in (temperature, top_k, top_p))
    if isinstance(stop_strings, str):
        stop_strings = [stop_strings]
    stop_strings = [s for s in (stop_strings or []) if s]

    ntok = _number_tokenizer(tokenizer, model.num_token_id)
    if stop_strings and ntok is None:
        raise ValueError("stop_strings need tokenizer=...")
    input_ids, numeric_values, attention_mask = _resolve_inputs(
        model, inputs, input_ids, numeric_values, attention_mask, ntok)
    eos, pad_id = _default_ids(model, eos_token_id, pad_token_id, ntok)
    device, hdev = input_ids.device, model.device  # the embedding's, the heads'
    gen = _make_generator(seed, generator, hdev)  # draws (eps, multinomial) are made with the heads
    scorer = OvRScorer(model, ovr_pruning=ovr_pruning, cache_abs_weight=cache_abs_weight)
    hdtype = scorer.dtype
    B, S = input_ids.shape
    T = _new_token_budget(max_new_tokens, max_length, S)
    C = model.abduction.loc.weight.shape[0]
    num_id = model.num_token_id

    warpers = None
    if mode == "softmax" and do_sample:
        from transformers import (LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper,
                                  TopPLogitsWarper)

        warpers = LogitsProcessorList(list(logits_processor or []))
        if temperature is not None and temperature != 1.0:
            warpers.append(TemperatureLogitsWarper(temperature))
        if top_k is not None and top_k != 0:
            warpers.append(TopKLogitsWarper(top_k=top_k))
        if top_p is not None and top_p < 1.0:
            warpers.append(TopPLogitsWarper(top_p=top_p))
    elif logits_processor is not None:
        from transformers import LogitsProcessorList

        warpers = LogitsProcessorList(list(logits_processor))
    if mode == "softmax" and repetition_penalty is not None and repetition_penalty != 1.0:
        from transformers import LogitsProcessorList

        warpers = LogitsProcessorList([_NumExemptRepetitionPenalty(repetition_penalty, num_id)] + list(warpers or []))

    sequences = torch.cat([input_ids, torch.full((B, T), pad_id, dtype=torch.long, device=device)], 1)
    vdtype = torch.promote_types(numeric_values.dtype, hdtype)
    values = torch.cat([numeric_values.to(vdtype), torch.zeros(B, T, dtype=vdtype, device=device)], 1)
    token_probs = torch.zeros(B, T, dtype=hdtype, device=device)
    loc_Y_all = torch.zeros(B, T, dtype=hdtype, device=device)
    scale_Y_all = torch.zeros(B, T, dtype=hdtype, device=device)
    exact_all = torch.zeros(B, T, dtype=vdtype, device=device)  # generated values before rounding
    decimals = model.config.value_decimals
    eps_all = torch.zeros(B, T, C, dtype=hdtype, device=device) if return_eps else None
    finished = torch.zeros(B, dtype=torch.bool, device=device)
    lengths = torch.zeros(B, dtype=torch.long, device=device)
    eos_t = torch.tensor(eos, dtype=torch.long, device=device)

    streamer = _number_text_streamer(streamer, num_id)
    if streamer is not None:
        _put(streamer, input_ids, numeric_values)

    was_training = model.training
    model.eval()
    try:
        steps = 0
        shared_eps = None
        if T > 0:
            mask = attention_mask
            position_ids = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
            # the backbone creates its own cache: key/value, plus conv/recurrent states in hybrid models
            out = model.decoder(inputs_embeds=model.embed(input_ids, numeric_values), attention_mask=mask,
                                position_ids=position_ids, use_cache=True)
            cache = out.past_key_values
            last_pos = position_ids[:, -1:]
            if mode == "causal" and shared_individual:
                shared_eps = _draw_eps(B, C, hdtype, hdev, gen)
        for t in range(T):
            z = out.last_hidden_state[:, -1]
            with full_precision(z.device):  # the heads as in forward, whatever autocast is active
                loc_U, scale_U = model.abduction(z)
                scale_Up = model.action.noisy_scale(scale_U)
                loc_Y, scale_Y = model.action.regression(loc_U, scale_Up)
                if mode == "causal":
                    eps = shared_eps if shared_individual else _draw_eps(B, C, hdtype, hdev, gen)
                    u = cauchy_icdf(eps, loc_U, scale_Up).to(hdtype)
                    decision, y = model.action.decision_scores(u, scorer.W_cls)
                    if t < min_new_tokens and eos:
                        decision[:, eos_t.to(hdev)] = -math.inf
                    tok = decision.argmax(-1)
                    val = y
                    prob = scorer.row_probability(tok, scorer.row_locations(loc_U, tok), scale_Up)
                    if eps_all is not None:
                        eps_all[:, t] = eps
                else:
                    loc_S = scorer.loc_scores(loc_U)
                    if t < min_new_tokens and eos:
                        loc_S[:, eos_t.to(hdev)] = -math.inf  # as transformers' MinNewTokensLengthLogitsProcessor
                    val = loc_Y
                    if mode == "deterministic":
                        tok, prob = scorer.ovr_argmax(loc_S, scale_Up)
                    else:
                        scores = loc_S
                        if warpers is not None and len(warpers):
                            scores = warpers(sequences[:, :S + t].to(hdev), scores)
                        if do_sample:
                            probs = torch.softmax(scores, -1)
                            tok = torch.multinomial(probs, 1, generator=gen).squeeze(1)
                        else:
                            tok = scores.argmax(-1)
                        prob = scorer.row_probability(tok, loc_S.gather(1, tok.unsqueeze(1)).squeeze(1), scale_Up)
            tok, val, prob = tok.to(device), val.to(device), prob.to(device)  # back with the sequences
            tok = torch.where(finished, pad_id, tok)
            val = torch.where(tok == num_id, val.to(vdtype), torch.zeros((), dtype=vdtype, device=device))
            exact_all[:, t] = val
            if decimals is not None:  # shown and fed back as the data writes values; the exact one is kept
                val = torch.round(val, decimals=decimals)
            live = ~finished
            sequences[:, S + t] = tok
            values[:, S + t] = val
            token_probs[:, t] = torch.where(live, prob.to(hdtype), 0)
            loc_Y_all[:, t] = loc_Y
            scale_Y_all[:, t] = scale_Y
            lengths += live.long()
            steps = t + 1
            if eos:
                finished = finished | (live & torch.isin(tok, eos_t))
            if stop_strings:
                finished = finished | _hit_stop(ntok, sequences, values, S, steps, lengths, live & ~finished,
                                                 stop_strings)
            if streamer is not None:
                _put(streamer, tok, val)
            if callback is not None:
                callback(t, tok, val)
            if t == T - 1 or bool(finished.all()):
                break
            mask = torch.cat([mask, mask.new_ones(B, 1)], 1)
            last_pos = last_pos + 1
            out = model.decoder(inputs_embeds=model.embed(tok.unsqueeze(1), val.unsqueeze(1)), attention_mask=mask,
                                position_ids=last_pos, past_key_values=cache, use_cache=True)
    finally:
        model.train(was_training)
        if streamer is not None:
            streamer.end()

    sequences, values = sequences[:, :S + steps], values[:, :S + steps]
    gen_mask = torch.arange(steps, device=device).unsqueeze(0) < lengths.unsqueeze(1)
    full_mask = torch.cat([attention_mask, gen_mask.long()], 1)
    new_tokens, new_values = sequences[:, S:], values[:, S:]
    numbers = _numbers(new_tokens, new_values, loc_Y_all[:, :steps], scale_Y_all[:, :steps], gen_mask, num_id, S,
                       exact_all[:, :steps], model.config.value_calibration)
    texts = None
    if ntok is not None:
        texts = [_decode(ntok, new_tokens[b, :int(lengths[b])], new_values[b, :int(lengths[b])],
                         int(input_ids[b, -1]), float(numeric_values[b, -1])) for b in range(B)]
    return GenerationOutput(
        sequences=sequences, numeric_values=values, attention_mask=full_mask, new_tokens=new_tokens,
        new_values=new_values, lengths=lengths, finished=finished, token_probs=token_probs[:, :steps],
        numbers=numbers, texts=texts, eps=None if eps_all is None else eps_all[:, :steps], mode=mode,
    )


# ----------------------------------------------------------------------------- transformers' generate arguments
_ALL_MODES_ARGS = ("max_new_tokens", "max_length", "min_new_tokens", "eos_token_id", "pad_token_id", "stop_strings",
                   "generation_config", "streamer", "callback", "tokenizer", "seed", "generator")
_MODE_ARGS = {
    "softmax": ("do_sample", "temperature", "top_k", "top_p", "repetition_penalty", "logits_processor"),
    "deterministic": ("ovr_pruning", "cache_abs_weight"),
    "causal": ("shared_individual", "return_eps"),
}
# transformers arguments with the value that changes nothing here (accepted at that value)
_NEUTRAL = {"num_beams": 1, "num_return_sequences": 1, "use_cache": True, "num_beam_groups": 1,
            "return_dict_in_generate": True}
# GenerationConfig fields that never change what is generated
_IGNORED_CONFIG = {"bos_token_id", "decoder_start_token_id", "transformers_version", "_from_model_config",
                   "output_scores", "output_logits", "output_attentions", "output_hidden_states", "cache_implementation"}
_SAMPLING = ("do_sample", "temperature", "top_k", "top_p", "repetition_penalty")


def accepted_generate_kwargs(mode: str) -> tuple[str, ...]:
    """The transformers-style arguments `generate` accepts in `mode` (besides the inputs)."""
    return _ALL_MODES_ARGS + _MODE_ARGS[mode]


def _hf_generate_args(mode: str, generation_config, extra: dict, given: dict) -> dict:
    """Merge a GenerationConfig under the explicit arguments; refuse what `mode` cannot honour."""
    unknown = {k: v for k, v in extra.items() if not (k in _NEUTRAL and v == _NEUTRAL[k])}
    if unknown:
        raise ValueError(f"generate() does not support {sorted(unknown)} in mode={mode!r}; it accepts "
                         f"{list(accepted_generate_kwargs(mode))}; softmax mode also "
                         f"{list(_MODE_ARGS['softmax'])}, causal mode also {list(_MODE_ARGS['causal'])}")
    out = dict(given)
    if generation_config is not None:
        if not hasattr(generation_config, "to_diff_dict"):
            raise ValueError(f"generation_config must be a transformers GenerationConfig, got "
                             f"{type(generation_config).__name__}")
        refused = []
        for k, v in generation_config.to_diff_dict().items():
            if k in _IGNORED_CONFIG or v is None or (k in _NEUTRAL and v == _NEUTRAL[k]):
                continue
            if k in _SAMPLING and mode != "softmax":
                continue  # the mode decides how a token is chosen (documented)
            if k not in out:
                refused.append(k)
            elif out[k] is None:
                out[k] = v
        if refused:
            raise ValueError(f"generation_config sets {sorted(refused)}, which generate() does not support in "
                             f"mode={mode!r}; it accepts {list(accepted_generate_kwargs(mode))}")
    if mode != "softmax" and out["repetition_penalty"] not in (None, 1.0):
        raise ValueError(f"repetition_penalty applies to mode='softmax' (logits), not mode={mode!r}; mode={mode!r} "
                         f"accepts {list(accepted_generate_kwargs(mode))}")
    for name in ("max_new_tokens", "max_length", "min_new_tokens"):
        v = out[name]
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise ValueError(f"{name} must be a non-negative int, got {v!r}")
    rp = out["repetition_penalty"]
    if rp is not None and not (isinstance(rp, (int, float)) and rp > 0):
        raise ValueError(f"repetition_penalty must be a positive float, got {rp!r}")
    return out


def _new_token_budget(max_new_tokens: int | None, max_length: int | None, prompt_length: int) -> int:
    if max_new_tokens is not None:
        return max_new_tokens
    if max_length is not None:
        if max_length <= prompt_length:
            raise ValueError(f"max_length={max_length} leaves no room after the prompt ({prompt_length} tokens, "
                             "padding included); use max_new_tokens")
        return max_length - prompt_length
    return 32


class _NumExemptRepetitionPenalty:
    """transformers' RepetitionPenaltyLogitsProcessor, except for <NUM>: every number shares that one
    token, so a repeated <NUM> is not a repeated word (its values differ)."""

    def __init__(self, penalty: float, num_token_id: int):
        from transformers import RepetitionPenaltyLogitsProcessor

        self.inner = RepetitionPenaltyLogitsProcessor(penalty)
        self.k = num_token_id

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        keep = scores[:, self.k].clone()
        scores = self.inner(input_ids, scores)
        scores[:, self.k] = keep
        return scores


def _number_text_streamer(streamer, num_token_id: int):
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


def _draw_eps(B: int, C: int, dtype: torch.dtype, device, gen) -> Tensor:
    eps = torch.rand((B, C), generator=gen, dtype=dtype, device=device)
    tiny = torch.finfo(dtype).eps  # never exactly 0 or 1: u stays finite (as sample_cauchy)
    return eps.clamp(tiny, 1.0 - tiny)


def _hit_stop(ntok, sequences, values, S, steps, lengths, rows, stop_strings) -> Tensor:
    hit = torch.zeros_like(rows)
    for b in rows.nonzero().flatten().tolist():
        n = int(lengths[b])
        text = _decode(ntok, sequences[b, S:S + n], values[b, S:S + n], int(sequences[b, S - 1]), float(values[b, S - 1]))
        if any(s in text for s in stop_strings):
            hit[b] = True
    return hit


def _numbers(new_tokens, new_values, loc_Y, scale_Y, gen_mask, num_id, S, exact,
             calibration: dict | None = None) -> list[list[dict[str, Any]]]:
    """Per row, one dict per generated <NUM>; interval_50 / interval_90 are the adapter's reported
    intervals (calibrated with `calibration`, as `CausalModel.value_interval`), raw_interval_* the raw Cauchy ones."""
    is_num = (new_tokens == num_id) & gen_mask
    out: list[list[dict[str, Any]]] = [[] for _ in range(new_tokens.shape[0])]
    for b, t in is_num.nonzero().tolist():
        loc, scale = float(loc_Y[b, t]), float(scale_Y[b, t])
        v = float(new_values[b, t])
        row = {"position": t, "index": S + t, "value": v, "text": _format(v) if math.isfinite(v) else str(v),
               "loc": loc, "scale": scale, "exact": float(exact[b, t])}
        for q in (0.5, 0.9):
            for prefix, cal in (("", calibration), ("raw_", None)):
                lo, hi = interval(torch.tensor(loc, dtype=torch.float64), torch.tensor(scale, dtype=torch.float64), q, cal)
                row[f"{prefix}interval_{round(100 * q)}"] = (float(lo), float(hi))
        out[b].append(row)
    return out
