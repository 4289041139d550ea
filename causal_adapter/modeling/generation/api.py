"""The entry points, both on the step loop (`loop.StepLoop`): `generate` (one batch, its rows as given, each with
its adapter) and `generate_batched` (many text prompts, `batch_size` rows running at a time: a row that finishes
leaves and the next prompt joins at the next step)."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from ...numbers import pad_batch
from .loop import StepLoop
from .options import decoding_options, new_token_budget
from .output import GenerationOutput, row_output, rows_output
from .prepare import Group, make_generator, number_tokenizer, prepare, resolve_inputs, text_prompts_tokenizer
from .record import Row
from .stream import number_text_streamer, put, step_tensors

# generate's decoding arguments that a GenerationConfig may also set (explicit ones win)
_GIVEN = ("max_new_tokens", "max_length", "min_new_tokens", "eos_token_id", "pad_token_id", "stop_strings",
          "do_sample", "temperature", "top_k", "top_p", "repetition_penalty")


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
    mode: "softmax" | "deterministic" (default) | "causal" (see `choose`).
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
        heads, number layout and LoRA while the backbone runs once for the whole batch; a row gets what its adapter
        gives it in a batch of its own. None: the active adapter for every row.
    """
    opts = decoding_options(mode, generation_config, kwargs, logits_processor, shared_individual, return_eps, dict(
        max_new_tokens=max_new_tokens, max_length=max_length, min_new_tokens=min_new_tokens,
        eos_token_id=eos_token_id, pad_token_id=pad_token_id, stop_strings=stop_strings, do_sample=do_sample,
        temperature=temperature, top_k=top_k, top_p=top_p, repetition_penalty=repetition_penalty))
    ntok = number_tokenizer(tokenizer, model.num_token_id)
    if opts.stop_strings and ntok is None:
        raise ValueError("stop_strings need tokenizer=...")
    input_ids, numeric_values, attention_mask = resolve_inputs(
        model, inputs, input_ids, numeric_values, attention_mask, ntok)
    B, S = input_ids.shape
    names = _adapter_names(model, adapter_names, B)
    if streamer is not None and len(set(names)) > 1:
        raise ValueError("a streamer shows one row: give adapter_names with one adapter, or use callback")
    T = new_token_budget(opts.max_new_tokens, opts.max_length, S)
    make_generator(seed, generator, "cpu")  # refuses both
    groups: dict[str | None, Group] = {}
    rows = []
    for b, name in enumerate(names):
        g = groups.get(name)
        if g is None:  # one generator per adapter's rows (seed: each seeded alike), as a batch of that adapter alone
            g = groups[name] = Group(name, opts, ntok, make_generator(seed, generator, model.device), fixed_slots=True,
                                     values_dtype=numeric_values.dtype, ovr_pruning=ovr_pruning,
                                     cache_abs_weight=cache_abs_weight)
        real = attention_mask[b].bool()
        rows.append(Row(input_ids[b][real].tolist(), numeric_values[b][real].tolist(), g, T,
                        tuple(opts.stop_strings), slot=g.slots))
        g.slots += 1
    loop = StepLoop(model)
    active, was_training = getattr(model, "active_adapter", None), model.training
    streamer = number_text_streamer(streamer, model.num_token_id)
    if streamer is not None:
        put(streamer, input_ids, numeric_values)
    model.eval()
    try:
        if T == 0:
            _prepare_all(model, loop, groups.values())
        else:
            loop.add(rows, batch=(input_ids, numeric_values, attention_mask))
            t = 0
            while loop.busy:
                loop.step()
                if streamer is not None or callback is not None:
                    tok, val = step_tensors(rows, t, rows[0].group.settings.pad_id, input_ids.device)
                    if streamer is not None:
                        put(streamer, tok, val)
                    if callback is not None:
                        callback(t, tok, val)
                t += 1
    finally:
        model.train(was_training)
        if streamer is not None:
            streamer.end()
        if active is not None and getattr(model, "active_adapter", None) != active:
            model.set_adapter(active)
    return rows_output(rows, input_ids, numeric_values, attention_mask, calibration_of=_calibration(model), ntok=ntok)


@torch.no_grad()
def generate_batched(model, prompts: str | Sequence[str], *, tokenizer, batch_size: int = 16,
                     progress: Callable[[int], Any] | None = None, seed: int | None = None,
                     generator: torch.Generator | None = None, adapter_names: Sequence[str] | None = None,
                     **kwargs) -> list[GenerationOutput]:
    """`generate` for many text prompts, at most `batch_size` rows at a time: one `GenerationOutput` per prompt (as
    `GenerationOutput.row` gives it), in the order of `prompts`.

    The prompts are encoded once and join the running batch shortest first (left padded); a row that finishes leaves
    it at once and the next prompt joins at the next step (continuous batching, `loop.StepLoop`). A row's output does
    not depend on the rows beside it: greedy softmax and deterministic mode give each prompt what `generate` gives it
    alone (position ids count from each row's first token, the padding is masked, the repetition penalty reads a
    row's own tokens: `tests/test_chat_inference.py`; the values agree to float rounding, see docs/cli.md). Sampling
    (softmax with do_sample, causal mode) draws from one generator for the rows running, so its draws depend on how
    the prompts share the batch.

    progress: called with the number of prompts finished, each time some finish (a progress bar's update).
    adapter_names: one loaded adapter per prompt (prompts of different adapters share the batch and the backbone's
        pass); None: the active adapter.
    kwargs: `generate`'s decoding arguments (mode, max_new_tokens, eos_token_id, stop_strings, ...);
    max_length (it would depend on the padding), streamer and callback (one batch's steps) are refused.
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
                      ("callback", "its steps are one batch's: call generate() on those prompts"),
                      ("input_ids", "give text prompts"), ("inputs", "give text prompts")):
        if kwargs.get(name) is not None:
            raise ValueError(f"generate_batched() does not take {name}: {why}")
    ntok = text_prompts_tokenizer(model, prompts, tokenizer, "generate_batched")
    opts, speed = batched_options(kwargs)
    encs = ntok.encode_batch(prompts, return_offsets=False)
    for i, e in enumerate(encs):
        if not e.input_ids:
            raise ValueError(f"prompt {i} encodes to no token")
    prompt_rows = [(list(e.input_ids), torch.tensor(e.numeric_values, dtype=torch.float32).tolist()) for e in encs]
    check_prompts(model, prompt_rows)
    gen = make_generator(seed, generator, model.device)
    names = _adapter_names(model, adapter_names, len(prompts))
    groups = {a: Group(a, opts, ntok, gen, values_dtype=torch.float32, **speed) for a in dict.fromkeys(names)}
    T = new_token_budget(opts.max_new_tokens, None, 0)
    order = sorted(range(len(prompts)), key=lambda i: len(encs[i].input_ids))  # stable: ties keep input order
    rows = [Row(*prompt_rows[i], groups[names[i]], T, tuple(opts.stop_strings), tag=i) for i in order]
    out: list[GenerationOutput | None] = [None] * len(prompts)
    loop = StepLoop(model, max_rows=batch_size)
    active, was_training = getattr(model, "active_adapter", None), model.training
    calibration = _calibration(model)
    model.eval()
    def collect(done: list[Row]) -> None:
        for r in done:
            out[r.tag] = row_output(r, calibration=calibration(r), ntok=ntok)
        if done and progress is not None:
            progress(len(done))

    try:
        if T == 0:
            _prepare_all(model, loop, groups.values())
            collect(rows)
        else:
            loop.add(rows)
            while loop.busy:
                collect(loop.step()[1])
    finally:
        model.train(was_training)
        if active is not None and getattr(model, "active_adapter", None) != active:
            model.set_adapter(active)
    return out  # type: ignore[return-value]


def batched_options(kwargs: dict):
    """(DecodingOptions, the deterministic mode's speed options) of `generate`-style keyword arguments."""
    kw = dict(kwargs)
    mode = kw.pop("mode", "deterministic")
    special = {k: kw.pop(k, None) for k in ("generation_config", "logits_processor")}
    shared, return_eps = bool(kw.pop("shared_individual", False)), bool(kw.pop("return_eps", False))
    speed = {k: kw.pop(k) for k in ("ovr_pruning", "cache_abs_weight") if k in kw}
    given = {k: kw.pop(k, None) for k in _GIVEN}
    opts = decoding_options(mode, special["generation_config"], kw, special["logits_processor"], shared, return_eps,
                            given)
    return opts, speed


def check_prompts(model, prompt_rows: list[tuple[list[int], list[float]]], chunk: int = 256) -> None:
    """`CausalModel.check_inputs` on encoded prompts (ids in the vocabulary, finite values), a chunk at a time."""
    for i in range(0, len(prompt_rows), chunk):
        part = prompt_rows[i:i + chunk]
        enc = pad_batch([ids for ids, _ in part], [v for _, v in part], 0)
        model.check_inputs(enc["input_ids"], enc["numeric_values"], None, None)


def _adapter_names(model, adapter_names: Sequence[str] | None, B: int) -> list[str | None]:
    """One adapter name per row (None everywhere: the model as it is), checked against the loaded ones."""
    if adapter_names is None:
        return [None] * B
    names = list(adapter_names)
    if len(names) != B or not all(isinstance(n, str) for n in names):
        raise ValueError(f"adapter_names must be {B} adapter names (one per row), got {adapter_names!r}")
    loaded = list(getattr(model, "adapter_names", ()))
    unknown = sorted(set(names) - set(loaded))
    if unknown:
        raise ValueError(f"adapter_names {unknown} are not loaded; loaded: {loaded}")
    return names


def _calibration(model):
    """row -> the calibration map of its adapter (its intervals are its own adapter's)."""
    active = model.causal_config.value_calibration

    def of(row: Row) -> dict | None:
        a = row.group.adapter
        return active if a is None else model.causal_configs[a].value_calibration
    return of


def _prepare_all(model, loop: StepLoop, groups) -> None:
    for g in groups:
        if g.settings is None:
            loop._use_adapter(g.adapter)
            g.settings = prepare(model, g, loop.scorers)
