"""``POST /v1/completions`` (a prompt: a text, a list of texts, token ids) and ``POST /v1/chat/completions``
(messages, rendered with the chat template and its generation prompt): OpenAI's fields plus ``mode`` and
``levels``, answered in one body or as server-sent events (``stream``).

Decoding: ``mode`` picks it (``softmax`` | ``deterministic`` | ``causal``). Without a mode, a request that
samples (``temperature`` > 0, or ``top_p`` < 1 without a temperature) samples the softmax (OpenAI's meaning),
any other (no temperature, or 0) is ``deterministic``: exactly `causal-adapter generate`'s default text.
``temperature`` / ``top_p`` that sample in mode deterministic or causal are refused (400). ``seed`` seeds
sampling (softmax sampling and causal mode; ignored when greedy); a seeded request draws from a generator of its
own, so the same request gives the same text whatever else runs beside it. ``max_tokens`` defaults to 32
(`causal-adapter generate`'s). ``n`` up to 16 choices per prompt. Every choice has ``values``."""
from __future__ import annotations

import json
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from . import schemas
from .engine import Decoding, GenerateSpec
from .jobs import Jobs
from .registry import Registry
from .responses import JSON
from .routes_predict import request_levels
from .scheduler import Job, RequestError


def _decoding(body: schemas.GenerationRequest) -> Decoding:
    """The Decoding of a request (module docstring); `seed` kept only where something is drawn."""
    t, p = body.temperature, body.top_p
    sampling = t > 0 if t is not None else (p is not None and p < 1)
    mode = body.mode or ("softmax" if sampling else "deterministic")
    if sampling and mode != "softmax":
        param = "temperature" if t is not None else "top_p"
        raise RequestError(400, f"{param} samples from the softmax: it applies to mode 'softmax' (or no mode), "
                                f"not mode {mode!r}; leave it out (or 0)", param=param)
    random = sampling or mode == "causal"
    return Decoding(mode=mode, do_sample=sampling,
                    temperature=t if sampling and t is not None else None,
                    top_p=p if sampling and p is not None and p < 1 else None,
                    seed=body.seed if random else None, stop=body.stop_strings(), ignore_eos=body.ignore_eos)


def _check_logprobs(body: schemas.CompletionRequest) -> None:
    """What completions' logprobs / echo cannot be combined with (docs/serving.md)."""
    if body.max_tokens == 0 and not body.echo:
        raise RequestError(400, "max_tokens: 0 generates nothing; it is only accepted with echo (the prompt's "
                                "logprobs); give max_tokens >= 1", param="max_tokens")
    if body.stream and (body.echo or body.logprobs is not None):
        what = "echo" if body.echo else "logprobs"
        raise RequestError(400, f"{what} is not supported with stream: send the request with stream false (the whole "
                                "answer, its logprobs included, in one body)", param=what)


async def generation(jobs: Jobs, request: Request, body, spec: GenerateSpec, n_prompts: int, chat: bool) -> Response:
    """A generate job's answer: OpenAI's completion (chat: chat completion) body, or its stream of events."""
    job = jobs.submit(Job("generate", spec, rows=n_prompts * spec.n, stream=body.stream))
    first = await jobs.next_event(job, request)
    if first is None:
        return Response(status_code=499)
    if first[0] == "error":
        raise first[1]
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    created, model = int(time.time()), body.model
    if not body.stream:
        out = await jobs.result(job, request)
        if out is None:
            return Response(status_code=499)
        use = schemas.usage(out["prompt_tokens"], out["completion_tokens"])
        make = schemas.chat_body if chat else schemas.completion_body
        return JSON(make(rid, created, model, out["choices"], use))
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return StreamingResponse(_sse(jobs, job, rid, created, model, chat, include_usage, n_prompts * spec.n),
                             media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _sse(jobs: Jobs, job: Job, rid: str, created: int, model: str, chat: bool, include_usage: bool,
               n_choices: int):
    """OpenAI's server-sent events: (chat: a role chunk per choice,) text deltas, per choice a last chunk with
    the rest of its text, its finish_reason and its values, (the usage,) ``data: [DONE]``."""
    def data(obj: dict) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    def chunk(index: int, text: str, finish_reason: str | None = None, values: list | None = None,
              stop_reason: str | None = None) -> str:
        if chat:
            delta = {"content": text} if text or finish_reason is None else {}
            return data(schemas.chat_chunk(rid, created, model, index, delta, finish_reason, values, stop_reason))
        return data(schemas.completion_chunk(rid, created, model, index, text, finish_reason, values, stop_reason))

    ended = False
    try:
        if chat:
            for i in range(n_choices):
                yield data(schemas.chat_chunk(rid, created, model, i, {"role": "assistant", "content": ""}))
        while not ended:
            event = await job.events.get()
            if event[0] == "delta":
                yield chunk(event[1], event[2])
            elif event[0] == "row":
                r = event[2]
                yield chunk(event[1], r["delta"], r["finish_reason"], r["values"], r.get("stop_reason"))
            elif event[0] == "done":
                ended = True
                if include_usage:
                    use = schemas.usage(event[1]["prompt_tokens"], event[1]["completion_tokens"])
                    obj = "chat.completion.chunk" if chat else "text_completion"
                    yield data(schemas.usage_chunk(rid, created, model, obj, use))
                yield "data: [DONE]\n\n"
            elif event[0] == "error":
                ended, e = True, event[1]
                yield data(schemas.error_body(e.message, e.type, e.param, e.code))
                yield "data: [DONE]\n\n"
    finally:
        if not ended:  # the client went away mid-stream: free its slot, drop its rows
            jobs.cancel(job)


def register(app: FastAPI, registry: Registry, jobs: Jobs) -> None:
    """``POST /v1/completions`` and ``POST /v1/chat/completions`` on `app`."""

    @app.post("/v1/completions")
    async def completions(body: schemas.CompletionRequest, request: Request):
        registry.check(body.model)
        token_ids = isinstance(body.prompt, list) and bool(body.prompt) and not isinstance(body.prompt[0], str)
        if token_ids:  # token ids: one prompt (a list of ints) or several (a list of lists)
            prompts = [body.prompt] if isinstance(body.prompt[0], int) else list(body.prompt)
        else:
            prompts = [body.prompt] if isinstance(body.prompt, str) else list(body.prompt)
        if not prompts:
            raise RequestError(400, "prompt: give a text or a non-empty list of texts", param="prompt")
        single = isinstance(body.prompt, str) or (token_ids and isinstance(body.prompt[0], int))
        for i, p in enumerate(prompts):
            if not p:
                raise RequestError(400, f"prompt{'' if single else f'[{i}]'} is empty", param="prompt")
        _check_logprobs(body)
        decoding = _decoding(body)
        max_tokens = schemas.DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
        spec = GenerateSpec(body.model, decoding, prompts=None if token_ids else prompts, max_tokens=max_tokens,
                            n=body.n, levels=request_levels(body.levels), logprobs=body.logprobs,
                            echo=bool(body.echo), prompt_token_ids=prompts if token_ids else None,
                            logprobs_mode="ovr" if body.mode in ("deterministic", "causal") else "softmax")
        return await generation(jobs, request, body, spec, len(prompts), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: schemas.ChatCompletionRequest, request: Request):
        registry.check(body.model)
        if body.max_tokens is not None and body.max_completion_tokens is not None:
            raise RequestError(400, "give max_tokens or max_completion_tokens, not both", param="max_tokens")
        decoding = _decoding(body)
        kwargs = body.chat_template_kwargs or {}
        if set(kwargs) - {"enable_thinking"}:
            raise RequestError(400, f"chat_template_kwargs: only enable_thinking is supported, got {sorted(kwargs)}",
                               param="chat_template_kwargs")
        spec = GenerateSpec(body.model, decoding, conversations=[body.messages], n=body.n,
                            levels=request_levels(body.levels),
                            max_tokens=body.max_tokens or body.max_completion_tokens or schemas.DEFAULT_MAX_TOKENS,
                            enable_thinking=kwargs.get("enable_thinking"))
        return await generation(jobs, request, body, spec, 1, chat=True)
