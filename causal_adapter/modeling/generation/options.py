"""Step 1 of `generate`, the arguments: transformers' generate arguments merged with a `GenerationConfig` and
checked against what the mode can honour (`decoding_options`); `accepted_generate_kwargs(mode)` lists them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

MODES = ("softmax", "deterministic", "causal")

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


@dataclass
class DecodingOptions:
    """`generate`'s decoding arguments, merged with a GenerationConfig and checked (`decoding_options`)."""

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


def accepted_generate_kwargs(mode: str) -> tuple[str, ...]:
    """The transformers-style arguments `generate` accepts in `mode` (besides the inputs)."""
    return _ALL_MODES_ARGS + _MODE_ARGS[mode]


def decoding_options(mode: str, generation_config, kwargs: dict, logits_processor, shared_individual: bool,
                     return_eps: bool, given: dict) -> DecodingOptions:
    """The arguments `mode` can honour, with a GenerationConfig's fields under the explicit ones (`given`)."""
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
    return DecodingOptions(
        mode=mode, max_new_tokens=hf["max_new_tokens"], max_length=hf["max_length"],
        min_new_tokens=hf["min_new_tokens"] or 0, eos_token_id=hf["eos_token_id"], pad_token_id=hf["pad_token_id"],
        stop_strings=[s for s in (stop_strings or []) if s], do_sample=do_sample, temperature=temperature,
        top_k=top_k, top_p=top_p, repetition_penalty=hf["repetition_penalty"], logits_processor=logits_processor,
        shared_individual=shared_individual, return_eps=return_eps)


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


def new_token_budget(max_new_tokens: int | None, max_length: int | None, prompt_length: int) -> int:
    """Tokens a row may write: max_new_tokens, else max_length minus the (padded) prompt, else 32."""
    if max_new_tokens is not None:
        return max_new_tokens
    if max_length is not None:
        if max_length <= prompt_length:
            raise ValueError(f"max_length={max_length} leaves no room after the prompt ({prompt_length} tokens, "
                             "padding included); use max_new_tokens")
        return max_length - prompt_length
    return 32
