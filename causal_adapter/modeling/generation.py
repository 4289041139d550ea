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

Number layout (`CausalAdapterConfig.number_prefix_id`, set by `train()`): a ``<NUM>`` chosen right after
a token that never preceded a training number is written as that prefix (Qwen's ``" "``) first, then the
``<NUM>``, whose value is read at the prefix's position, where the value head was fitted (`_place_number`).

The deterministic mode's argmax over the OvR probabilities (exact, pruned) is `scoring.OvRScorer`.

`generate` runs as named steps: `_options` (arguments checked) -> `_adapter_groups` (the rows of each adapter
with `adapter_names`; one group otherwise) -> per group `_prepare` (ids, devices, scorer, warpers: a `_Run`) and
`_allocate` (the output buffers: a `_Trace`) -> `_generate_loop` (per step one backbone pass for the whole batch,
then per group `_choose` and `_record` with its adapter's heads) -> `_output` per group (`_join_outputs`).

Several adapters in one batch (`adapter_names`, as peft's `generate(..., adapter_names=...)`): the backbone is
shared, so its pass runs once for all rows (a LoRA adapter's rows through peft's mixed-batch LoRA layers); the
embedding's phi, the heads and the decoding state are each row's adapter's.
"""
from __future__ import annotations

import contextlib
import inspect
import math
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from .._compat import cache_kwargs, output_cache
from ..numbers import NumberTokenizer, format_number, pad_batch
from .cauchy import cauchy_icdf
from .families import check_no_vision_inputs
from .heads import full_precision, recent_values
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

    def row(self, b: int) -> "GenerationOutput":
        """Row `b` alone, as generating its prompt by itself returns it: the prompt's left padding and the
        steps after the row finished cut off (`numbers[..]["index"]` counted in the unpadded sequence)."""
        S = self.sequences.shape[1] - self.new_tokens.shape[1]
        pad = S - int(self.attention_mask[b, :S].sum())
        n = int(self.lengths[b])
        numbers = [{**d, "index": d["index"] - pad} for d in self.numbers[b]] if self.numbers else []
        return GenerationOutput(
            sequences=self.sequences[b:b + 1, pad:S + n], numeric_values=self.numeric_values[b:b + 1, pad:S + n],
            attention_mask=self.attention_mask[b:b + 1, pad:S + n], new_tokens=self.new_tokens[b:b + 1, :n],
            new_values=self.new_values[b:b + 1, :n], lengths=self.lengths[b:b + 1], finished=self.finished[b:b + 1],
            token_probs=self.token_probs[b:b + 1, :n], numbers=[numbers],
            texts=None if self.texts is None else [self.texts[b]],
            eps=None if self.eps is None else self.eps[b:b + 1, :n], mode=self.mode)


# ----------------------------------------------------------------------------- tokenizer glue
def _number_tokenizer(tokenizer, num_token_id: int):
    """A NumberTokenizer for `tokenizer` (a HF tokenizer or already a NumberTokenizer)."""
    if tokenizer is None:
        return None

    if isinstance(tokenizer, NumberTokenizer):
        if tokenizer.num_token_id != num_token_id:
            raise ValueError(
                f"the NumberTokenizer uses num_token_id={tokenizer.num_token_id} but the model's <NUM> id is "
                f"{num_token_id}"
            )
        return tokenizer
    return NumberTokenizer(tokenizer, num_token_id)


def text_prompts_tokenizer(model, prompts: Sequence[str], tokenizer, caller: str):
    """The NumberTokenizer for a list of text prompts, each checked to be a non-empty string (`caller` names the
    function in the errors)."""
    for i, p in enumerate(prompts):
        if not isinstance(p, str) or not p:
            raise ValueError(f"prompt {i} must be a non-empty string, got {p!r:.80}")
    if tokenizer is None:
        raise ValueError(f"{caller} needs tokenizer=... (a Qwen tokenizer or a NumberTokenizer)")
    return _number_tokenizer(tokenizer, model.num_token_id)


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


def default_eos_ids(model, eos_token_id: int | Sequence[int] | None = None) -> list[int]:
    """The eos ids `generate` stops on: `eos_token_id` when given, else the backbone's generation_config's, else
    its config's ([] = none)."""
    gc = getattr(model.backbone, "generation_config", None)
    if eos_token_id is None:
        eos_token_id = getattr(gc, "eos_token_id", None)
        if eos_token_id is None:
            eos_token_id = getattr(model.backbone.config, "eos_token_id", None)
    if eos_token_id is None or eos_token_id is False:
        return []
    if isinstance(eos_token_id, int):
        return [eos_token_id]
    return [int(e) for e in eos_token_id]


def _default_ids(model, eos_token_id, pad_token_id, ntok):
    gc = getattr(model.backbone, "generation_config", None)
    eos = default_eos_ids(model, eos_token_id)
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
    adapter_names: Sequence[str] | None = None,
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
    adapter_names: one loaded adapter name per row (peft's mixed batch): each row generates with its own adapter's
        heads, number layout and LoRA while the backbone runs once for the whole batch (`_adapter_groups`); a row
        gets what its adapter gives it in a batch of its own. None: the active adapter for every row.
    """
    opts = _options(mode, generation_config, kwargs, logits_processor, shared_individual, return_eps, dict(
        max_new_tokens=max_new_tokens, max_length=max_length, min_new_tokens=min_new_tokens,
        eos_token_id=eos_token_id, pad_token_id=pad_token_id, stop_strings=stop_strings, do_sample=do_sample,
        temperature=temperature, top_k=top_k, top_p=top_p, repetition_penalty=repetition_penalty))
    ntok = _number_tokenizer(tokenizer, model.num_token_id)
    if opts.stop_strings and ntok is None:
        raise ValueError("stop_strings need tokenizer=...")
    input_ids, numeric_values, attention_mask = _resolve_inputs(
        model, inputs, input_ids, numeric_values, attention_mask, ntok)
    groups = _adapter_groups(model, adapter_names, input_ids)
    if streamer is not None and len(groups) > 1:
        raise ValueError("a streamer shows one row: give adapter_names with one adapter, or use callback")
    active = getattr(model, "active_adapter", None)
    try:
        for g in groups:
            _use_adapter(model, g)
            ids, mask = g.take(input_ids), g.take(attention_mask)
            g.run = _prepare(model, opts, ntok, ids, seed, generator, ovr_pruning, cache_abs_weight)
            for w in g.run.warpers or ():
                if isinstance(w, _NumExemptRepetitionPenalty):  # it penalises each row's own tokens, never its padding
                    w.prompt = _own_tokens(ids, mask).to(g.run.hdev)
            g.trace = _allocate(g.run, ids, g.take(numeric_values))
        streamer = _number_text_streamer(streamer, groups[0].run.num_id)
        if streamer is not None:
            _put(streamer, input_ids, numeric_values)
        with _lora_rows(model, groups, input_ids.shape[0]):
            _generate_loop(model, groups, input_ids, numeric_values, attention_mask, streamer, callback)
        outs = []
        for g in groups:
            _use_adapter(model, g)
            outs.append(_output(g.run, g.trace, g.take(input_ids), g.take(numeric_values), g.take(attention_mask),
                                model.causal_config.value_calibration))
    finally:
        if active is not None and getattr(model, "active_adapter", None) != active:
            model.set_adapter(active)
    return outs[0] if len(groups) == 1 else _join_outputs(groups, outs)


def generate_batched(model, prompts: str | Sequence[str], *, tokenizer, batch_size: int = 16,
                     progress: Callable[[int], Any] | None = None, seed: int | None = None,
                     generator: torch.Generator | None = None, adapter_names: Sequence[str] | None = None,
                     **kwargs) -> list[GenerationOutput]:
    """`generate` for many text prompts, `batch_size` at a time: one `GenerationOutput` per prompt (batch of
    one, `GenerationOutput.row`), in the order of `prompts`.

    The prompts are encoded once and sorted by token count, so each batch pads (on the left) as little as
    possible; a row's output does not depend on its batch: greedy softmax and deterministic mode give each
    prompt what `generate` gives it alone (position ids count from each row's first token, the padding is
    masked, the repetition penalty reads a row's own tokens: `tests/test_chat_inference.py`; the values agree to float
    rounding, see docs/cli.md). Sampling (softmax with do_sample, causal mode) draws from one generator
    (`seed` / `generator`) batch after batch, so its draws depend on how the prompts are batched.

    progress: called with the number of prompts done after each batch (a progress bar's update).
    adapter_names: one loaded adapter per prompt (`generate`'s mixed batches: prompts of different adapters share
        a batch and the backbone's pass); None: the active adapter.
    kwargs: `generate`'s decoding arguments (mode, max_new_tokens, eos_token_id, stop_strings, ...);
    max_length (it would depend on the padded length) and streamer (one row at a time) are refused.
    """
    if isinstance(prompts, str):
        prompts = [prompts]
    prompts = list(prompts)
    if adapter_names is not None and len(adapter_names) != len(prompts):
        raise ValueError(f"adapter_names has {len(adapter_names)} names for {len(prompts)} prompts: give one per prompt")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    for name, why in (("max_length", "it would count the padding of a batch: give max_new_tokens"),
                      ("streamer", "a streamer shows one row: call generate() on that prompt"),
                      ("input_ids", "give text prompts"), ("inputs", "give text prompts")):
        if kwargs.get(name) is not None:
            raise ValueError(f"generate_batched() does not take {name}: {why}")
    ntok = text_prompts_tokenizer(model, prompts, tokenizer, "generate_batched")
    encs = ntok.encode_batch(prompts, return_offsets=False)
    for i, e in enumerate(encs):
        if not e.input_ids:
            raise ValueError(f"prompt {i} encodes to no token")
    order = sorted(range(len(prompts)), key=lambda i: len(encs[i].input_ids))  # stable: ties keep input order
    gen = _make_generator(seed, generator, model.device)
    out: list[GenerationOutput | None] = [None] * len(prompts)
    for start in range(0, len(order), batch_size):
        rows = order[start:start + batch_size]
        enc = pad_batch([encs[i].input_ids for i in rows], [encs[i].numeric_values for i in rows],
                        ntok.pad_token_id, padding_side="left")
        names = None if adapter_names is None else [adapter_names[i] for i in rows]
        batch = generate(model, enc, tokenizer=ntok, generator=gen, adapter_names=names, **kwargs)
        for b, i in enumerate(rows):
            out[i] = batch.row(b)
        if progress is not None:
            progress(len(rows))
    return out  # type: ignore[return-value]


@dataclass
class _Options:
    """`generate`'s decoding arguments, merged with a GenerationConfig and checked (`_options`)."""

    mode: str
    max_new_tokens: int | None
    max_length: int | None
    min_new_tokens: int
    eos_token_id: int | Sequence[int] | None
    pad_token_id: int | None
    stop_strings: list[str]
    do_sample: bool
    temperature: float | None
    top_k: int | None
    top_p: float | None
    repetition_penalty: float | None
    logits_processor: Any
    shared_individual: bool
    return_eps: bool


def _options(mode: str, generation_config, kwargs: dict, logits_processor, shared_individual: bool,
             return_eps: bool, given: dict) -> _Options:
    """Step 1: the arguments `mode` can honour, with a GenerationConfig's fields under the explicit ones."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    hf = _hf_generate_args(mode, generation_config, kwargs, given)
    temperature, top_k, top_p, do_sample = hf["temperature"], hf["top_k"], hf["top_p"], hf["do_sample"]
    sampling_args = any(x is not None for x in (temperature, top_k, top_p)) or logits_processor is not None
    if mode != "softmax" and (do_sample or sampling_args):
        raise ValueError(f"do_sample / temperature / top_k / top_p / logits_processor apply to mode='softmax', "
                         f"not mode={mode!r}")
    if mode != "causal" and (shared_individual or return_eps):
        raise ValueError("shared_individual / return_eps apply to mode='causal'")
    if do_sample is None:
        do_sample = mode == "softmax" and any(x is not None for x in (temperature, top_k, top_p))
    stop_strings = hf["stop_strings"]
    if isinstance(stop_strings, str):
        stop_strings = [stop_strings]
    return _Options(
        mode=mode, max_new_tokens=hf["max_new_tokens"], max_length=hf["max_length"],
        min_new_tokens=hf["min_new_tokens"] or 0, eos_token_id=hf["eos_token_id"], pad_token_id=hf["pad_token_id"],
        stop_strings=[s for s in (stop_strings or []) if s], do_sample=do_sample, temperature=temperature,
        top_k=top_k, top_p=top_p, repetition_penalty=hf["repetition_penalty"], logits_processor=logits_processor,
        shared_individual=shared_individual, return_eps=return_eps)


@dataclass
class _Run:
    """What stays fixed during one `generate` call (`_prepare`). B batch, S prompt length, T step budget,
    C causal size; `device` is the embedding's (the sequences live there), `hdev` / `hdtype` the heads'."""

    opts: _Options
    ntok: Any
    eos: list[int]
    eos_t: Tensor  # [len(eos)] on `device`
    pad_id: int
    num_id: int
    device: torch.device
    hdev: torch.device
    hdtype: torch.dtype
    gen: torch.Generator | None
    scorer: OvRScorer
    warpers: Any  # a LogitsProcessorList (softmax mode) or None
    decimals: int | None
    B: int
    S: int
    T: int
    C: int
    prefix_id: int | None = None  # the number layout of training (`_place_number`)
    contexts: Tensor | None = None  # [n] ids that precede a number in training, on the heads' device


def _prepare(model, opts: _Options, ntok, input_ids: Tensor, seed, generator, ovr_pruning: bool,
             cache_abs_weight: bool) -> _Run:
    """Step 2: eos / pad ids, devices, the random generator, the OvR scorer, sizes and logits warpers."""
    eos, pad_id = _default_ids(model, opts.eos_token_id, opts.pad_token_id, ntok)
    device, hdev = input_ids.device, model.device  # the embedding's, the heads'
    gen = _make_generator(seed, generator, hdev)  # draws (eps, multinomial) are made with the heads
    scorer = OvRScorer(model, ovr_pruning=ovr_pruning, cache_abs_weight=cache_abs_weight)
    B, S = input_ids.shape
    cfg = model.causal_config
    T = _new_token_budget(opts.max_new_tokens, opts.max_length, S)
    return _Run(opts=opts, ntok=ntok, eos=eos, eos_t=torch.tensor(eos, dtype=torch.long, device=device),
                pad_id=pad_id, num_id=model.num_token_id, device=device, hdev=hdev, hdtype=scorer.dtype, gen=gen,
                scorer=scorer, warpers=_warpers(opts, model.num_token_id), decimals=model.causal_config.value_decimals,
                B=B, S=S, T=T, C=model.abduction.loc.weight.shape[0], prefix_id=cfg.number_prefix_id,
                contexts=None if cfg.number_prefix_id is None else torch.tensor(cfg.number_contexts, device=hdev))


def _own_tokens(input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """[B, S] the prompt with its left padding replaced by the row's first token: the same set of tokens as the
    row alone, what the repetition penalty reads (transformers passes the pad ids, penalising the pad token in
    the padded rows of a batch only), so batching never changes a row's output."""
    first = input_ids.gather(1, (attention_mask == 0).sum(1, keepdim=True).clamp_max(input_ids.shape[1] - 1))
    return torch.where(attention_mask.bool(), input_ids, first)


def _warpers(opts: _Options, num_id: int):
    """softmax mode's logits processors (transformers' warpers, then the repetition penalty first), or None."""
    warpers = None
    if opts.mode == "softmax" and opts.do_sample:
        from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

        warpers = LogitsProcessorList(list(opts.logits_processor or []))
        if opts.temperature is not None and opts.temperature != 1.0:
            warpers.append(TemperatureLogitsWarper(opts.temperature))
        if opts.top_k is not None and opts.top_k != 0:
            warpers.append(TopKLogitsWarper(top_k=opts.top_k))
        if opts.top_p is not None and opts.top_p < 1.0:
            warpers.append(TopPLogitsWarper(top_p=opts.top_p))
    elif opts.logits_processor is not None:
        from transformers import LogitsProcessorList

        warpers = LogitsProcessorList(list(opts.logits_processor))
    penalty = opts.repetition_penalty
    if opts.mode == "softmax" and penalty is not None and penalty != 1.0:
        from transformers import LogitsProcessorList

        warpers = LogitsProcessorList([_NumExemptRepetitionPenalty(penalty, num_id)] + list(warpers or []))
    return warpers


@dataclass
class _Trace:
    """What generation writes, step t at column S + t of sequences / values and t of the rest (`_allocate`).

    sequences, values: [B, S+T] prompt + generated ids / values (values in `vdtype`: the prompt's
    dtype promoted with the heads'); token_probs, loc_Y, scale_Y: [B, T] in the heads' dtype;
    exact: [B, T] generated values before rounding; eps: [B, T, C] (return_eps) or None;
    finished: [B] bool; lengths: [B] generated tokens per row; steps: steps taken.
    """

    sequences: Tensor
    values: Tensor
    vdtype: torch.dtype
    token_probs: Tensor
    loc_Y: Tensor
    scale_Y: Tensor
    exact: Tensor
    eps: Tensor | None
    finished: Tensor
    lengths: Tensor
    steps: int = 0


def _allocate(run: _Run, input_ids: Tensor, numeric_values: Tensor) -> _Trace:
    """Step 3: the output buffers, the prompt [B, S] copied in and T pad / zero columns after it."""
    B, T, device, hdtype = run.B, run.T, run.device, run.hdtype
    vdtype = torch.promote_types(numeric_values.dtype, hdtype)
    return _Trace(
        sequences=torch.cat([input_ids, torch.full((B, T), run.pad_id, dtype=torch.long, device=device)], 1),
        values=torch.cat([numeric_values.to(vdtype), torch.zeros(B, T, dtype=vdtype, device=device)], 1),
        vdtype=vdtype,
        token_probs=torch.zeros(B, T, dtype=hdtype, device=device),
        loc_Y=torch.zeros(B, T, dtype=hdtype, device=device),
        scale_Y=torch.zeros(B, T, dtype=hdtype, device=device),
        exact=torch.zeros(B, T, dtype=vdtype, device=device),
        eps=torch.zeros(B, T, run.C, dtype=hdtype, device=device) if run.opts.return_eps else None,
        finished=torch.zeros(B, dtype=torch.bool, device=device),
        lengths=torch.zeros(B, dtype=torch.long, device=device))


@dataclass
class _Group:
    """The rows of a batch that one adapter generates: every row (`adapter` None: the model as it is) or, with
    `adapter_names`, those of one adapter. Its own `_Run` and `_Trace`; the step state of `_decode_steps`."""

    adapter: str | None
    rows: Tensor | None  # [B_g] indices into the batch; None = every row
    run: _Run | None = None
    trace: _Trace | None = None
    shared_eps: Tensor | None = None
    prev: Tensor | None = None
    pending: Tensor | None = None

    def take(self, t: Tensor) -> Tensor:
        return t if self.rows is None else t[self.rows.to(t.device)]


def _adapter_groups(model, adapter_names: Sequence[str] | None, input_ids: Tensor) -> list[_Group]:
    """One `_Group` per adapter named in `adapter_names` (in order of first appearance); one of every row when
    None or when every row names the same adapter."""
    if adapter_names is None:
        return [_Group(None, None)]
    B = input_ids.shape[0]
    names = list(adapter_names)
    if len(names) != B or not all(isinstance(n, str) for n in names):
        raise ValueError(f"adapter_names must be {B} adapter names (one per row), got {adapter_names!r}")
    loaded = list(getattr(model, "adapter_names", ()))
    unknown = sorted(set(names) - set(loaded))
    if unknown:
        raise ValueError(f"adapter_names {unknown} are not loaded; loaded: {loaded}")
    order = list(dict.fromkeys(names))
    if len(order) == 1:
        return [_Group(order[0], None)]
    return [_Group(a, torch.tensor([i for i, n in enumerate(names) if n == a], device=input_ids.device))
            for a in order]


def _use_adapter(model, g: _Group) -> None:
    if g.adapter is not None and model.active_adapter != g.adapter:
        model.set_adapter(g.adapter)


@contextlib.contextmanager
def _lora_rows(model, groups: list[_Group], B: int):
    """With several groups: every peft LoRA layer of the backbone runs each row's own adapter (peft's mixed batch:
    the `adapter_names` argument of its layers, "__base__" for an adapter without LoRA), for the whole call."""
    from_rows = len(groups) > 1 and _has_lora_layers(model)
    if not from_rows:
        yield
        return
    from peft.tuners.tuners_utils import BaseTunerLayer

    names = ["__base__"] * B
    for g in groups:
        for i in g.rows.tolist():
            names[i] = g.adapter

    def pass_names(module, args, kwargs):
        return args, {**kwargs, "adapter_names": names}

    hooks = [m.register_forward_pre_hook(pass_names, with_kwargs=True)
             for m in model.backbone.modules() if isinstance(m, BaseTunerLayer)]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


def _has_lora_layers(model) -> bool:
    if "peft" not in sys.modules:
        return False
    from peft.tuners.tuners_utils import BaseTunerLayer

    return any(isinstance(m, BaseTunerLayer) for m in model.backbone.modules())


def _join_outputs(groups: list[_Group], outs: list[GenerationOutput]) -> GenerationOutput:
    """The groups' outputs as one batch, rows back in the batch's order (the groups took the same steps)."""
    order = torch.cat([g.rows for g in groups]).argsort()

    def cat(name: str) -> Tensor | None:
        parts = [getattr(o, name) for o in outs]
        return None if parts[0] is None else torch.cat([p.to(order.device) for p in parts])[order]

    numbers = [row for o in outs for row in o.numbers]
    texts = None if outs[0].texts is None else [t for o in outs for t in o.texts]
    at = order.tolist()
    return GenerationOutput(
        sequences=cat("sequences"), numeric_values=cat("numeric_values"), attention_mask=cat("attention_mask"),
        new_tokens=cat("new_tokens"), new_values=cat("new_values"), lengths=cat("lengths"),
        finished=cat("finished"), token_probs=cat("token_probs"), numbers=[numbers[i] for i in at],
        texts=None if texts is None else [texts[i] for i in at], eps=cat("eps"), mode=outs[0].mode)


def _generate_loop(model, groups: list[_Group], input_ids: Tensor, numeric_values: Tensor,
                   attention_mask: Tensor, streamer, callback) -> None:
    """Step 4: the decoding loop in eval mode (the model's training mode is restored, the streamer ended)."""
    was_training = model.training
    model.eval()
    try:
        if groups[0].run.T > 0:
            _decode_steps(model, groups, input_ids, numeric_values, attention_mask, streamer, callback)
    finally:
        model.train(was_training)
        if streamer is not None:
            streamer.end()


def _embed(model, groups: list[_Group], ids: Tensor, values: Tensor) -> Tensor:
    """inputs_embeds [B, s, H] of `ids` / `values` [B, s], each group's rows with its adapter's phi. The groups are
    taken last to first: a step's heads run first to last, so each switch of adapter is made once, not twice."""
    if len(groups) == 1:
        _use_adapter(model, groups[0])
        return model.embed(ids, values)
    embeds = None
    for g in reversed(groups):
        _use_adapter(model, g)
        e = model.embed(g.take(ids), g.take(values))
        if embeds is None:
            embeds = e.new_empty(ids.shape + e.shape[-1:])
        embeds[g.rows.to(e.device)] = e
    return embeds


def _decode_steps(model, groups: list[_Group], input_ids: Tensor, numeric_values: Tensor,
                  attention_mask: Tensor, streamer, callback) -> None:
    """The prompt [B, S] through the backbone (it creates its cache: key/value, plus conv / recurrent states
    in hybrid models), then one position per step: each group chooses and records with its adapter's heads, the
    tokens and values of the whole batch are fed back together."""
    mask = attention_mask
    position_ids = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    out = model.decoder(inputs_embeds=_embed(model, groups, input_ids, numeric_values), attention_mask=mask,
                        position_ids=position_ids, use_cache=True)
    cache = output_cache(out)
    last_pos = position_ids[:, -1:]
    B, T = input_ids.shape[0], groups[0].run.T
    for g in groups:
        run = g.run
        if run.opts.mode == "causal" and run.opts.shared_individual:
            g.shared_eps = _draw_eps(run.B, run.C, run.hdtype, run.hdev, run.gen)
        g.prev = g.take(input_ids)[:, -1].to(run.hdev)  # the token before the next one (`_place_number`)
        g.pending = torch.zeros(run.B, dtype=torch.bool, device=run.hdev)  # rows whose number comes at this step
    for t in range(T):
        z = out.last_hidden_state[:, -1]
        tok = val = None
        for g in groups:
            _use_adapter(model, g)
            with full_precision(z.device):  # the heads as in forward, whatever autocast is active
                chosen = _choose(model, g.run, g.trace, t, g.take(z), g.shared_eps, g.prev, g.pending)
            g.pending = chosen[-1]
            g_tok, g_val = _record(g.run, g.trace, t, *chosen[:-1])
            g.prev = g_tok.to(g.run.hdev)
            if g.rows is None:
                tok, val = g_tok, g_val
                continue
            if tok is None:
                tok, val = g_tok.new_empty(B), g_val.new_empty(B)
            tok[g.rows], val[g.rows] = g_tok, g_val
        if streamer is not None:
            _put(streamer, tok, val)
        if callback is not None:
            callback(t, tok, val)
        if t == T - 1 or all(bool(g.trace.finished.all()) for g in groups):
            break
        mask = torch.cat([mask, mask.new_ones(B, 1)], 1)
        last_pos = last_pos + 1
        out = model.decoder(inputs_embeds=_embed(model, groups, tok.unsqueeze(1), val.unsqueeze(1)),
                            attention_mask=mask, position_ids=last_pos, use_cache=True,
                            **cache_kwargs(model.decoder, cache))


def _choose(model, run: _Run, trace: _Trace, t: int, z: Tensor, shared_eps: Tensor | None, prev: Tensor,
            pending: Tensor):
    """The heads on the last position z [B, H]: (token [B], value [B], P_k of the token [B], loc_Y [B],
    scale_Y [B], pending [B]), on the heads' device, chosen as `run.opts.mode` says (module docstring) and
    placed as training wrote numbers (`_place_number`; `prev` [B] the previous token, `pending` [B] the rows
    whose number was announced by its prefix at the previous step)."""
    loc_U, scale_U = model.abduction(z)
    scale_Up = model.action.noisy_scale(scale_U)
    recent = _recent(model, run, trace, t)
    loc_Y, scale_Y = model.action.regression(loc_U, scale_Up, recent)
    if run.opts.mode == "causal":
        tok, val, prob = _choose_causal(model, run, trace, t, loc_U, scale_Up, shared_eps, recent)
    else:
        tok, val, prob = _choose_by_scores(run, trace, t, loc_U, scale_Up, loc_Y)
    tok, prob, pending = _place_number(run, tok, prob, loc_U, scale_Up, prev, pending)
    return tok, val, prob, loc_Y, scale_Y, pending


def _recent(model, run: _Run, trace: _Trace, t: int) -> Tensor | None:
    """[B, K] the K most recent numbers of the prompt and the text generated so far (the value head reads them
    when the adapter's `recent_values` K > 0), else None."""
    k = model.action.recent_values
    if not k:
        return None
    n = run.S + t  # the prompt and the t tokens written before this step
    return recent_values(trace.sequences[:, :n].to(run.hdev), trace.values[:, :n].to(run.hdev), run.num_id, k)[:, -1]


def _place_number(run: _Run, tok: Tensor, prob: Tensor, loc_U: Tensor, scale_Up: Tensor, prev: Tensor,
                  pending: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The number layout of training (`CausalAdapterConfig.number_prefix_id`): the value head is fitted only
    at the tokens that precede a training number (Qwen's ``" "`` of ``": 1033.57"``), so a ``<NUM>`` chosen
    after any other token (a prompt ending ``":"``) is written as the prefix first, and the ``<NUM>`` follows
    at the next step, its value read at the prefix's position as in training. Returns the tokens [B], their
    P_k [B] and the rows whose ``<NUM>`` comes next [B]. No layout (None): the choice as it is."""
    if run.prefix_id is None:
        return tok, prob, torch.zeros_like(pending)
    num = run.num_id
    tok = torch.where(pending, num, tok)
    wrap = (tok == num) & ~pending & ~torch.isin(prev, run.contexts)
    tok = torch.where(wrap, run.prefix_id, tok)
    changed = pending | wrap
    if bool(changed.any()):
        p = run.scorer.row_probability(tok, run.scorer.row_locations(loc_U, tok), scale_Up)
        prob = torch.where(changed, p.to(prob.dtype), prob)
    return tok, prob, wrap


def _choose_causal(model, run: _Run, trace: _Trace, t: int, loc_U: Tensor, scale_Up: Tensor,
                   shared_eps: Tensor | None, recent: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """causal mode: an individual u [B, C] drawn from eps, then the noiseless action on u."""
    scorer = run.scorer
    eps = shared_eps if run.opts.shared_individual else _draw_eps(run.B, run.C, run.hdtype, run.hdev, run.gen)
    u = cauchy_icdf(eps, loc_U, scale_Up).to(run.hdtype)
    decision, y = model.action.decision_scores(u, scorer.W_cls, recent)
    if t < run.opts.min_new_tokens and run.eos:
        decision[:, run.eos_t.to(run.hdev)] = -math.inf
    tok = decision.argmax(-1)
    prob = scorer.row_probability(tok, scorer.row_locations(loc_U, tok), scale_Up)
    if trace.eps is not None:
        trace.eps[:, t] = eps
    return tok, y, prob


def _choose_by_scores(run: _Run, trace: _Trace, t: int, loc_U: Tensor, scale_Up: Tensor,
                      loc_Y: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """deterministic mode (argmax of the OvR P_k) and softmax mode (greedy or sampled from loc_S [B, V])."""
    scorer = run.scorer
    loc_S = scorer.loc_scores(loc_U)
    if t < run.opts.min_new_tokens and run.eos:
        loc_S[:, run.eos_t.to(run.hdev)] = -math.inf  # as transformers' MinNewTokensLengthLogitsProcessor
    if run.opts.mode == "deterministic":
        tok, prob = scorer.ovr_argmax(loc_S, scale_Up)
        return tok, loc_Y, prob
    scores = loc_S
    if run.warpers is not None and len(run.warpers):
        scores = run.warpers(trace.sequences[:, :run.S + t].to(run.hdev), scores)
    if run.opts.do_sample:
        probs = torch.softmax(scores, -1)
        tok = torch.multinomial(probs, 1, generator=run.gen).squeeze(1)
    else:
        tok = scores.argmax(-1)
    prob = scorer.row_probability(tok, loc_S.gather(1, tok.unsqueeze(1)).squeeze(1), scale_Up)
    return tok, loc_Y, prob


def _record(run: _Run, trace: _Trace, t: int, tok: Tensor, val: Tensor, prob: Tensor, loc_Y: Tensor,
            scale_Y: Tensor) -> tuple[Tensor, Tensor]:
    """Write step t into the trace (pad / value 0 for finished rows, values rounded to `decimals`), mark rows
    that emitted eos or completed a stop string finished; returns the token [B] and value [B] fed back."""
    device, vdtype, S = run.device, trace.vdtype, run.S
    tok, val, prob = tok.to(device), val.to(device), prob.to(device)  # back with the sequences
    tok = torch.where(trace.finished, run.pad_id, tok)
    val = torch.where(tok == run.num_id, val.to(vdtype), torch.zeros((), dtype=vdtype, device=device))
    trace.exact[:, t] = val
    if run.decimals is not None:  # shown and fed back as the data writes values; the exact one is kept
        val = torch.round(val, decimals=run.decimals)
    live = ~trace.finished
    trace.sequences[:, S + t] = tok
    trace.values[:, S + t] = val
    trace.token_probs[:, t] = torch.where(live, prob.to(run.hdtype), 0)
    trace.loc_Y[:, t] = loc_Y
    trace.scale_Y[:, t] = scale_Y
    trace.lengths += live.long()
    trace.steps = t + 1
    if run.eos:
        trace.finished = trace.finished | (live & torch.isin(tok, run.eos_t))
    if run.opts.stop_strings:
        trace.finished = trace.finished | _hit_stop(run.ntok, trace.sequences, trace.values, S, trace.steps,
                                                    trace.lengths, live & ~trace.finished, run.opts.stop_strings)
    return tok, val


def _output(run: _Run, trace: _Trace, input_ids: Tensor, numeric_values: Tensor, attention_mask: Tensor,
            calibration: dict | None) -> GenerationOutput:
    """Step 5: the trace cut to the steps taken, the attention mask extended, numbers and texts."""
    S, steps, lengths = run.S, trace.steps, trace.lengths
    sequences, values = trace.sequences[:, :S + steps], trace.values[:, :S + steps]
    gen_mask = torch.arange(steps, device=run.device).unsqueeze(0) < lengths.unsqueeze(1)
    full_mask = torch.cat([attention_mask, gen_mask.long()], 1)
    new_tokens, new_values = sequences[:, S:], values[:, S:]
    numbers = _numbers(new_tokens, new_values, trace.loc_Y[:, :steps], trace.scale_Y[:, :steps], gen_mask,
                       run.num_id, S, trace.exact[:, :steps], calibration)
    texts = None
    if run.ntok is not None:
        texts = [_decode(run.ntok, new_tokens[b, :int(lengths[b])], new_values[b, :int(lengths[b])],
                              int(input_ids[b, -1]), float(numeric_values[b, -1])) for b in range(run.B)]
    return GenerationOutput(
        sequences=sequences, numeric_values=values, attention_mask=full_mask, new_tokens=new_tokens,
        new_values=new_values, lengths=lengths, finished=trace.finished, token_probs=trace.token_probs[:, :steps],
        numbers=numbers, texts=texts, eps=None if trace.eps is None else trace.eps[:, :steps], mode=run.opts.mode,
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
    token, so a repeated <NUM> is not a repeated word (its values differ); and a left-padded row's padding is
    not read as its tokens (`prompt`)."""

    def __init__(self, penalty: float, num_token_id: int):
        from transformers import RepetitionPenaltyLogitsProcessor

        self.inner = RepetitionPenaltyLogitsProcessor(penalty)
        self.k = num_token_id
        self.prompt: Tensor | None = None  # [B, S] the prompt without its padding (`_own_tokens`), set by generate

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        if self.prompt is not None:
            input_ids = torch.cat([self.prompt, input_ids[:, self.prompt.shape[1]:]], 1)
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
