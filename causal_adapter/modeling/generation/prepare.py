"""Step 2 of generation, what stays fixed: the inputs of `generate` checked and put on the model's device
(`resolve_inputs`), the tokenizer glue, and a `Group` of rows decided together (one adapter, one set of decoding
options, one random generator) with its `Settings` (eos / pad ids, devices, the OvR scorer, logits warpers, the
number layout), built by `prepare` while the group's adapter is active."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import Tensor

from ...numbers import NumberTokenizer
from ..families import check_no_vision_inputs
from ..scoring import OvRScorer
from ..value_transform import ValueMap
from .options import DecodingOptions


# ----------------------------------------------------------------------------- tokenizer glue
def number_tokenizer(tokenizer, num_token_id: int):
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
    return number_tokenizer(tokenizer, model.num_token_id)


def resolve_inputs(model, inputs, input_ids, numeric_values, attention_mask, ntok):
    """(input_ids, numeric_values, attention_mask) [B, S] on the embedding's device, checked (left padding)."""
    if isinstance(inputs, (str, list, tuple)) and (isinstance(inputs, str) or all(isinstance(t, str) for t in inputs)):
        if input_ids is not None:
            raise ValueError("give either text prompts or input_ids, not both")
        if ntok is None:
            raise ValueError("text prompts need tokenizer=... (a Qwen tokenizer or a NumberTokenizer)")
        enc = ntok([inputs] if isinstance(inputs, str) else list(inputs), padding_side="left", return_tensors="pt")
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


def default_ids(model, eos_token_id, pad_token_id, ntok) -> tuple[list[int], int]:
    """(eos ids, pad id): pad = the tokenizer's, else the generation config's / config's, else the first eos."""
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


def make_generator(seed, generator, device):
    if generator is not None and seed is not None:
        raise ValueError("give seed or generator, not both")
    if seed is not None:
        return torch.Generator(device=device).manual_seed(int(seed))
    return generator


# ----------------------------------------------------------------------------- groups of rows
@dataclass
class Settings:
    """What stays fixed while a group generates (`prepare`). `device` is the embedding's (inputs go there),
    `hdev` / `hdtype` the heads'; C the causal size."""

    opts: DecodingOptions
    eos: list[int]
    eos_set: frozenset
    eos_t: Tensor  # [len(eos)] on hdev
    pad_id: int
    num_id: int
    device: torch.device
    hdev: torch.device
    hdtype: torch.dtype
    scorer: OvRScorer
    warpers: Any  # a LogitsProcessorList (softmax mode) or None
    reads_history: bool  # a warper reads the rows' tokens (the repetition penalty, a processor of the caller's)
    decimals: int | None
    C: int
    recent_k: int  # numbers the value head reads (0: none)
    value_map: ValueMap = ValueMap()  # the scale of the value head's Cauchy: the value written is to_value(loc_Y)
    prefix_id: int | None = None  # the number layout of training (`place.place_number`)
    contexts: Tensor | None = None  # [n] ids that precede a number in training, on hdev
    value_series: dict | None = None  # the adapter's series and their supports (`modeling.series`, `Row.floored`)


@dataclass(eq=False)
class Group:
    """Rows decided together: one adapter (None: the model as it is), one `DecodingOptions`, one random generator.

    fixed_slots: the group's rows are all given when it is made (`generate`, a seeded request): each draw covers
    every slot (rows that left included), so a row's draws never depend on the others; otherwise draws are made
    for the rows present. values_dtype: the prompts' values' dtype (promoted with the heads' for what is written)."""

    adapter: str | None
    opts: DecodingOptions
    ntok: Any
    gen: torch.Generator | None = None
    fixed_slots: bool = False
    values_dtype: torch.dtype = torch.float32
    ovr_pruning: bool = True
    cache_abs_weight: bool = False
    settings: Settings | None = None
    slots: int = 0
    shared_eps: Tensor | None = field(default=None, repr=False)  # [slots, C] (fixed slots, shared_individual)

    @property
    def vdtype(self) -> torch.dtype:
        return torch.promote_types(self.values_dtype, self.settings.hdtype if self.settings else torch.float32)


def prepare(model, g: Group, scorers: dict | None = None) -> Settings:
    """The group's Settings, built with its adapter active (the caller activates it); `scorers` caches one OvRScorer
    per adapter and speed options (its row norms are computed once)."""
    opts = g.opts
    eos, pad_id = default_ids(model, opts.eos_token_id, opts.pad_token_id, g.ntok)
    hdev = model.device  # the heads' (draws, eps and multinomial, are made with the heads)
    key = (g.adapter, id(model.action), g.ovr_pruning, g.cache_abs_weight)
    scorer = None if scorers is None else scorers.get(key)
    if scorer is None:
        scorer = OvRScorer(model, ovr_pruning=g.ovr_pruning, cache_abs_weight=g.cache_abs_weight)
        if scorers is not None:
            scorers[key] = scorer
    cfg = model.causal_config
    warpers = _warpers(opts, model.num_token_id)
    return Settings(
        opts=opts, eos=eos, eos_set=frozenset(eos), eos_t=torch.tensor(eos, dtype=torch.long, device=hdev),
        pad_id=pad_id, num_id=model.num_token_id, device=model.input_device, hdev=hdev, hdtype=scorer.dtype,
        scorer=scorer, warpers=warpers, reads_history=_reads_history(warpers), decimals=cfg.value_decimals,
        C=model.abduction.loc.weight.shape[0], recent_k=int(model.action.recent_window or 0),
        value_map=model.action.value_map, prefix_id=cfg.number_prefix_id,
        contexts=None if cfg.number_prefix_id is None else torch.tensor(cfg.number_contexts, device=hdev),
        value_series=getattr(cfg, "value_series", None))


def _warpers(opts: DecodingOptions, num_id: int):
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

        warpers = LogitsProcessorList([NumExemptRepetitionPenalty(penalty, num_id)] + list(warpers or []))
    return warpers


def _reads_history(warpers) -> bool:
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    return any(not isinstance(w, (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)) for w in warpers or ())


class NumExemptRepetitionPenalty:
    """transformers' RepetitionPenaltyLogitsProcessor, except for <NUM>: every number shares that one token, so a
    repeated <NUM> is not a repeated word (its values differ). The step loop gives it each row's own tokens (padded
    with the row's first token, never with a pad id that the row did not write: `loop.history`)."""

    pads_with_first_token = True

    def __init__(self, penalty: float, num_token_id: int):
        from transformers import RepetitionPenaltyLogitsProcessor

        self.inner = RepetitionPenaltyLogitsProcessor(penalty)
        self.k = num_token_id

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        keep = scores[:, self.k].clone()
        scores = self.inner(input_ids, scores)
        scores[:, self.k] = keep
        return scores
