"""The server's requests and responses in OpenAI's shapes (docs/serving.md).

Requests are pydantic models, strict (``"max_tokens": "5"`` is refused, as OpenAI refuses it) and closed (an
unknown field is refused by name, as OpenAI does). The fields OpenAI defines and this server cannot honour
(penalties, ``logit_bias``, ``best_of``, ``suffix``, tools; chat's ``logprobs``) are accepted only at their
neutral value; completions honour ``logprobs`` and ``echo`` (`serving.logprobs`). Ours, besides OpenAI's: ``mode``
(the decoding mode), ``levels`` (the interval levels of every value) and vLLM's ``ignore_eos`` /
``chat_template_kwargs``.

Responses are plain dicts built here: `completion_body`, `chat_body`, their streaming chunks, `model_card`,
`error_body`. Every choice carries ``values``: one object per number it wrote (`value_entry`).
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

#: max_tokens when a request gives none: `causal-adapter generate`'s --max-new-tokens default
DEFAULT_MAX_TOKENS = 32
DEFAULT_LEVELS = (0.5, 0.9)
MAX_N = 16
#: completions' ``logprobs``: the most alternatives per token (vLLM's default --max-logprobs)
MAX_LOGPROBS = 20
#: OpenAI fields /v1/completions honours (chat keeps them neutral)
_COMPLETION_FIELDS = ("logprobs", "echo")

# OpenAI fields accepted only at the value that changes nothing here
_NEUTRAL = {"presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0), "logit_bias": (None, {}),
            "logprobs": (None, False), "top_logprobs": (None, 0), "best_of": (None, 1), "echo": (None, False),
            "suffix": (None, ""), "tools": (None, []), "tool_choice": (None, "none"),
            "response_format": (None, {"type": "text"}), "parallel_tool_calls": (None, False, True)}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class GenerationRequest(_Strict):
    """What completions and chat completions share."""

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    user: str | None = None
    mode: Literal["softmax", "deterministic", "causal"] | None = None
    levels: list[float] | None = Field(None, min_length=1)
    ignore_eos: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    @field_validator(*_NEUTRAL, mode="after", check_fields=False)
    @classmethod
    def _neutral(cls, value, info):
        neutral = _NEUTRAL[info.field_name]
        if value not in neutral:
            raise ValueError(f"not supported by this server (accepted: {neutral[-1]!r}, or leave it out)")
        return value

    @field_validator("stop", mode="after")
    @classmethod
    def _stops(cls, value):
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("give up to 4 non-empty strings")
        return value

    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


class CompletionRequest(GenerationRequest):
    """A text, a list of texts, or token ids (a list, or a list of lists: OpenAI's and vLLM's, what lm-eval's
    local-completions sends). ``logprobs`` (up to `MAX_LOGPROBS` alternatives per token) and ``echo`` (the prompt in
    front of the text; with ``max_tokens`` 0 only the prompt, and its logprobs) as `serving.logprobs` answers them."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0)  # 0: with echo only (app.py)
    logprobs: int | None = Field(None, ge=0)
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None

    @field_validator(*(f for f in _NEUTRAL if f not in _COMPLETION_FIELDS), mode="after", check_fields=False)
    @classmethod
    def _neutral(cls, value, info):  # replaces GenerationRequest's: logprobs and echo are honoured here
        return GenerationRequest._neutral.__func__(cls, value, info)

    @field_validator("logprobs", mode="after")
    @classmethod
    def _logprobs_limit(cls, value):
        if value is not None and value > MAX_LOGPROBS:
            raise ValueError(f"at most {MAX_LOGPROBS} alternatives per token (the server's limit)")
        return value


class ChatCompletionRequest(GenerationRequest):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    chat_template_kwargs: dict[str, bool] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None


class PredictRequest(_Strict):
    """``prompts`` (texts ending where the number starts) or ``messages`` (one conversation, or a list of them:
    read where the reply's first number stands, as `causal-adapter predict` reads a messages row)."""

    model: str = Field(min_length=1)
    prompts: str | list[str] | None = None
    messages: list[dict[str, Any]] | list[list[dict[str, Any]]] | None = None
    levels: list[float] | None = Field(None, min_length=1)
    chat_template_kwargs: dict[str, bool] | None = None
    user: str | None = None
    # a horizon (`CausalModel.predict_horizon`): H values per row, intervals from `paths` sample paths; per row the
    # H - 1 texts before values 2..H (or null: the model writes them); the paths' seed
    horizon: int | None = None
    paths: int | None = None
    continuations: list[list[str] | None] | None = None
    seed: int | None = None

    @model_validator(mode="after")
    def _one_source(self):
        if (self.prompts is None) == (self.messages is None):
            raise ValueError("give the rows one way: prompts (a list of texts) or messages (conversations)")
        return self


class LoadLoraAdapterRequest(BaseModel):
    """vLLM's fields (other vLLM fields are ignored, so scripts written for vLLM work unchanged)."""

    model_config = ConfigDict(strict=True, extra="ignore")
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    load_inplace: bool = False


class UnloadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None


# ----------------------------------------------------------------------------- responses
def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def model_card(name: str, created: int, root: str, parent: str | None, max_model_len: int | None,
               value_decimals: int | None = None) -> dict:
    """OpenAI's model object, with vLLM's root / parent / max_model_len and the adapter's ``value_decimals`` (the
    decimals its data writes values with, as generated values are written; null: 6 significant digits)."""
    return {"id": name, "object": "model", "created": created, "owned_by": "causal_adapter", "root": root,
            "parent": parent, "max_model_len": max_model_len, "value_decimals": value_decimals}


def value_entry(number: dict, intervals: dict[str, tuple[float, float]], raw: dict[str, tuple[float, float]]) -> dict:
    """One generated number as `causal-adapter generate --output` writes it: ``text``, ``value`` (as written and
    fed back), ``loc`` / ``scale`` (loc_Y, scale_Y), ``p_num`` (P(<NUM>) at the step that wrote it), ``lower_<L>`` /
    ``upper_<L>`` per level (the adapter's calibrated interval) and ``raw_lower_<L>`` / ``raw_upper_<L>`` (raw
    Cauchy); L as `prediction.level_name`."""
    out = {"text": number["text"], "value": number["value"], "loc": number["loc"], "scale": number["scale"],
           "p_num": number["p_num"]}
    for prefix, table in (("", intervals), ("raw_", raw)):
        for name, (lo, hi) in table.items():
            out[f"{prefix}lower_{name}"], out[f"{prefix}upper_{name}"] = lo, hi
    return out


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_body(rid: str, created: int, model: str, choices: list[dict], use: dict) -> dict:
    """choices: dicts with index, text, finish_reason, values (and stop_reason: why a row ended early, as vLLM's
    field: a sentence when its value or its hidden state was not finite, else null)."""
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": c["index"], "text": c["text"], "logprobs": c.get("logprobs"),
                         "finish_reason": c["finish_reason"], "stop_reason": c.get("stop_reason"),
                         "values": c["values"]} for c in choices],
            "usage": use}


def chat_body(rid: str, created: int, model: str, choices: list[dict], use: dict) -> dict:
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": c["index"], "message": {"role": "assistant", "content": c["text"]},
                         "logprobs": None, "finish_reason": c["finish_reason"], "stop_reason": c.get("stop_reason"),
                         "values": c["values"]}
                        for c in choices],
            "usage": use}


def completion_chunk(rid: str, created: int, model: str, index: int, text: str, finish_reason: str | None = None,
                     values: list | None = None, stop_reason: str | None = None) -> dict:
    return _chunk(rid, created, model, "text_completion", {"index": index, "text": text}, finish_reason, values,
                  stop_reason)


def chat_chunk(rid: str, created: int, model: str, index: int, delta: dict, finish_reason: str | None = None,
               values: list | None = None, stop_reason: str | None = None) -> dict:
    return _chunk(rid, created, model, "chat.completion.chunk", {"index": index, "delta": delta}, finish_reason,
                  values, stop_reason)


def _chunk(rid: str, created: int, model: str, obj: str, choice: dict, finish_reason: str | None,
           values: list | None, stop_reason: str | None = None) -> dict:
    """One streamed choice (`values` and `stop_reason` on its last chunk only)."""
    choice = {**choice, "logprobs": None, "finish_reason": finish_reason}
    if values is not None:
        choice["values"] = values
        choice["stop_reason"] = stop_reason
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}


def usage_chunk(rid: str, created: int, model: str, obj: str, use: dict) -> dict:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": use}
