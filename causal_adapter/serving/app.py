"""The HTTP app (`create_app`): OpenAI's routes for causal adapters, the API key, OpenAI-shaped errors.

    GET  /                             open: the playground page (static/playground.html; --no-ui: 404)
    GET  /health                       open (no key): {"status": "ok", "adapters": [...], queue and batch figures}
    GET  /metrics                      open: Prometheus text format (queue depth, running rows, TTFT / ITL, ...)
    GET  /v1/models, /v1/models/{id}   the adapters, by name (OpenAI's model list; each with its value_decimals)
    POST /v1/completions               prompt (a text or a list), OpenAI's fields + mode, levels
    POST /v1/chat/completions          messages, rendered with the chat template and its generation prompt
    POST /v1/predict                   {"model", "prompts" | "messages", "levels"} -> {"data": rows of `predict`};
                                       with "horizon", "paths", "continuations", "seed": `predict --horizon`'s rows,
                                       each step also "calibrated" / "intervals" (`horizon.step_intervals`)
    POST /v1/load_lora_adapter         vLLM's {"lora_name", "lora_path"} (with --runtime-adapter-root only)
    POST /v1/unload_lora_adapter       vLLM's {"lora_name"}

Decoding: ``mode`` picks it (``softmax`` | ``deterministic`` | ``causal``). Without a mode, a request that
samples (``temperature`` > 0, or ``top_p`` < 1 without a temperature) samples the softmax (OpenAI's meaning),
any other (no temperature, or 0) is ``deterministic``: exactly `causal-adapter generate`'s default text.
``temperature`` / ``top_p`` that sample in mode deterministic or causal are refused (400). ``seed`` seeds
sampling (softmax sampling and causal mode; ignored when greedy); a seeded request draws from a generator of its
own, so the same request gives the same text whatever else runs beside it. ``max_tokens`` defaults to 32
(`causal-adapter generate`'s). ``n`` up to 16 choices per prompt. Every choice has ``values``.

``GET /metrics`` (open, as /health): Prometheus' text format (`metrics.Metrics`).

Errors are OpenAI's ``{"error": {"message", "type", "param", "code"}}``: 400 for a bad body (malformed JSON, a
wrong type, an unknown field, a prompt over the context), 401 without the key, 403 for runtime loading that is
off or reads outside its root, 404 for an unknown model, 503 with Retry-After when the queue is full.
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from importlib.resources import files
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..model.adapters import check_adapter_name
from ..modeling.horizon import DEFAULT_PATHS, check_horizon, check_paths
from ..modeling.prediction import check_levels, prediction_columns
from . import schemas
from .engine import CallSpec, Decoding, Engine, GenerateSpec, PredictSpec
from .metrics import Metrics
from .registry import runtime_path
from .scheduler import Job, QueueFull, RequestError, Scheduler

log = logging.getLogger("causal_adapter.serving")
RETRY_AFTER_S = 1
RUNTIME_FLAG = "--runtime-adapter-root DIR"


class JSON(JSONResponse):
    """JSON as `causal-adapter predict` / `generate --output` write it: an interval the adapter's calibration cannot
    bound (too few calibration rows for the level) is ``-Infinity`` / ``Infinity``, which Python's json (the
    OpenAI client's) reads back as a float; strict JSON has no such number."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def error_response(e: RequestError, headers: dict | None = None) -> JSON:
    return JSON(schemas.error_body(e.message, e.type, e.param, e.code), status_code=e.status, headers=headers)


class APIKeyMiddleware:
    """Every /v1 route needs ``Authorization: Bearer KEY`` (checked before the body is read); /health stays open.
    The whole key is compared, in constant time (`key_matches`): a prefix of it, or a bare ``Bearer``, is a 401."""

    def __init__(self, app, api_key: str):
        self.app, self.key = app, api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            auth = dict(scope.get("headers") or []).get(b"authorization", b"")
            scheme, _, token = auth.partition(b" ")
            if scheme.lower() != b"bearer" or not key_matches(token.strip(), self.key):
                what = "no API key given" if not auth else "the API key is wrong"
                response = error_response(RequestError(
                    401, f"{what}: send the server's key as 'Authorization: Bearer KEY' (the OpenAI client's api_key)",
                    code="invalid_api_key"))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def key_matches(token: bytes, key: bytes) -> bool:
    """Whether `token` is exactly `key`, in time that tells nothing of either: both are hashed first, so the compare
    runs on two equal-length digests (hmac.compare_digest alone returns at once on a length mismatch)."""
    return bool(key) and hmac.compare_digest(hashlib.sha256(token).digest(), hashlib.sha256(key).digest())


def _validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """(message, param) of pydantic's errors: the field, what is wrong, the value given."""
    e = errors[0]
    loc = [str(x) for x in e.get("loc", ()) if x != "body"]
    if e.get("type") == "json_invalid":
        why = (e.get("ctx") or {}).get("error", "JSON decode error")
        where = f" at character {loc[0]}" if loc else ""
        return f"the request body is not valid JSON ({why}{where}): send a JSON object", None
    msg = e.get("msg", "invalid value").removeprefix("Value error, ")
    if not loc and e.get("type") in ("model_attributes_type", "dict_type", "model_type", "missing"):
        return "the request body must be a JSON object (sent as Content-Type: application/json)", None
    if not loc:
        return msg, None
    field = loc[0]
    path = field + "".join(f"[{x}]" if x.isdigit() else "" for x in loc[1:])
    if e.get("type") == "missing" or "input" not in e:
        return f"{path}: {msg}", field
    return f"{path}: {msg} (got {json.dumps(e['input'], default=str)[:80]})", field


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


def _levels(levels: list[float] | None) -> tuple[float, ...]:
    try:
        return check_levels(levels if levels is not None else schemas.DEFAULT_LEVELS)
    except ValueError as e:
        raise RequestError(400, f"levels: {e}", param="levels") from None


class MetricsMiddleware:
    """Counts every HTTP answer by route and status code (`causal_adapter:http_requests_total`)."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500

        async def watched(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, watched)
        finally:
            self.metrics.http(_route(scope["path"]), status)


def _route(path: str) -> str:
    """The route a path belongs to (a bounded set of labels: unknown paths are "other")."""
    if path.startswith("/v1/models/"):
        return "/v1/models/{name}"
    return path if path in ROUTES else "other"


ROUTES = ("/", "/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions", "/v1/predict",
          "/v1/load_lora_adapter", "/v1/unload_lora_adapter")


def create_app(engine: Engine, *, api_key: str | None = None, runtime_root: str | None = None,
               max_queue: int = 256, batch_wait_s: float = 0.005, scheduler: str = "step",
               worker_thread: bool = True, ui: bool = True) -> FastAPI:
    """The app serving `engine`'s adapters; its scheduler's worker starts (in a thread of its own; worker_thread=False:
    the caller runs `app.state.scheduler.run()` in a thread of its choice) and stops with the app (lifespan).
    ui: serve the playground page at ``GET /`` (`playground_page`)."""
    registry = engine.registry
    worker = Scheduler(engine, max_queue=max_queue, batch_wait_s=batch_wait_s, policy=scheduler,
                       run_by_caller=not worker_thread)
    engine.set_scheduler(scheduler)
    metrics = engine.metrics = Metrics()
    metrics.watch(engine.waiting_requests, engine.running, lambda: len(engine.loop.rows),
                  lambda: engine.prefix.hit_tokens if engine.prefix is not None else 0)

    @asynccontextmanager
    async def lifespan(app):
        if worker_thread:
            worker.start()
        yield
        await asyncio.to_thread(worker.close)  # accepted requests were finished by the server: stop the worker

    app = FastAPI(title="causal_adapter", lifespan=lifespan, default_response_class=JSON)
    app.state.scheduler, app.state.engine = worker, engine
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    app.add_middleware(MetricsMiddleware, metrics=metrics)  # outermost: it sees the 401s too

    # ------------------------------------------------------------------ errors
    @app.exception_handler(RequestError)
    async def _request_error(request: Request, e: RequestError):
        return error_response(e, {"Retry-After": str(RETRY_AFTER_S)} if e.status == 503 else None)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError):
        msg, param = _validation_message(list(e.errors()))
        return error_response(RequestError(400, msg, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return error_response(RequestError(e.status_code, f"{request.method} {request.url.path}: {e.detail}", kind))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception):
        log.exception("unexpected error")
        return error_response(RequestError(500, f"internal error: {type(e).__name__}: {e}", "server_error"))

    # ------------------------------------------------------------------ jobs
    def submit(job: Job) -> Job:
        try:
            return worker.submit(job.attach(asyncio.get_running_loop()))
        except QueueFull as e:
            raise RequestError(503, f"the server is busy: {e}; retry after {RETRY_AFTER_S} s", "server_overloaded",
                               code="queue_full") from None

    async def next_event(job: Job, request: Request):
        """The job's next event, or None when the client went away first (the job is then cancelled)."""
        get = asyncio.ensure_future(job.events.get())
        gone = asyncio.ensure_future(_disconnected(request))
        done, _ = await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
        if get in done:
            gone.cancel()
            return get.result()
        get.cancel()
        worker.cancel(job)
        return None

    async def result(job: Job, request: Request):
        """The job's result (None: the client went away); a RequestError when it failed."""
        while True:
            event = await next_event(job, request)
            if event is None or event[0] == "done":
                return None if event is None else event[1]
            if event[0] == "error":
                raise event[1]

    async def generation(request: Request, body, spec: GenerateSpec, n_prompts: int, chat: bool) -> Response:
        job = submit(Job("generate", spec, rows=n_prompts * spec.n, stream=body.stream))
        first = await next_event(job, request)
        if first is None:
            return Response(status_code=499)
        if first[0] == "error":
            raise first[1]
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created, model = int(time.time()), body.model
        if not body.stream:
            out = await result(job, request)
            if out is None:
                return Response(status_code=499)
            use = schemas.usage(out["prompt_tokens"], out["completion_tokens"])
            make = schemas.chat_body if chat else schemas.completion_body
            return JSON(make(rid, created, model, out["choices"], use))
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_sse(job, rid, created, model, chat, include_usage, n_prompts * spec.n),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def _sse(job: Job, rid: str, created: int, model: str, chat: bool, include_usage: bool, n_choices: int):
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
                worker.cancel(job)

    # ------------------------------------------------------------------ routes
    if ui:
        page = playground_page()

        @app.get("/", include_in_schema=False)
        async def playground():
            return HTMLResponse(page, headers=PAGE_HEADERS)

    @app.get("/health")
    async def health():
        return {"status": "ok", "adapters": registry.names(), **worker.stats(), **engine.stats()}

    @app.get("/metrics")
    async def prometheus_metrics():
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [schemas.model_card(e.name, e.created, e.path, registry.base_name,
                                                              registry.max_model_len, e.value_decimals)
                                           for e in registry.entries()]}

    @app.get("/v1/models/{name}")
    async def model(name: str):
        registry.check(name)
        e = next(e for e in registry.entries() if e.name == name)
        return schemas.model_card(e.name, e.created, e.path, registry.base_name, registry.max_model_len,
                                  e.value_decimals)

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
                            n=body.n, levels=_levels(body.levels), logprobs=body.logprobs, echo=bool(body.echo),
                            prompt_token_ids=prompts if token_ids else None,
                            logprobs_mode="ovr" if body.mode in ("deterministic", "causal") else "softmax")
        return await generation(request, body, spec, len(prompts), chat=False)

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
        spec = GenerateSpec(body.model, decoding, conversations=[body.messages], n=body.n, levels=_levels(body.levels),
                            max_tokens=body.max_tokens or body.max_completion_tokens or schemas.DEFAULT_MAX_TOKENS,
                            enable_thinking=kwargs.get("enable_thinking"))
        return await generation(request, body, spec, 1, chat=True)

    @app.post("/v1/predict")
    async def predict(body: schemas.PredictRequest, request: Request):
        registry.check(body.model)
        levels = _levels(body.levels)
        prompts = conversations = None
        if body.prompts is not None:
            prompts = [body.prompts] if isinstance(body.prompts, str) else list(body.prompts)
            if not prompts:
                raise RequestError(400, "prompts: give a non-empty list of texts", param="prompts")
        else:
            conversations = [body.messages] if body.messages and isinstance(body.messages[0], dict) else body.messages
            if not conversations:
                raise RequestError(400, "messages: give a conversation or a non-empty list of them", param="messages")
        thinking = (body.chat_template_kwargs or {}).get("enable_thinking")
        horizon = _horizon(body)
        job = submit(Job("predict", PredictSpec(body.model, prompts, conversations, levels, thinking, **horizon),
                         rows=len(prompts or conversations)))
        rows = await result(job, request)
        if rows is None:
            return Response(status_code=499)
        columns = prediction_columns(levels) + (["horizon"] if horizon else [])
        return {"object": "list", "model": body.model, "data": [{k: r[k] for k in columns} for r in rows]}

    def _horizon(body: schemas.PredictRequest) -> dict:
        """PredictSpec's horizon fields of a request (empty without `horizon`), checked (400 naming the field)."""
        if body.horizon is None:
            for name in ("paths", "continuations"):
                if getattr(body, name) is not None:
                    raise RequestError(400, f"{name} applies with horizon", param=name)
            return {}
        paths = DEFAULT_PATHS if body.paths is None else body.paths
        for name, check in (("horizon", lambda: check_horizon(body.horizon)), ("paths", lambda: check_paths(paths))):
            try:
                check()
            except ValueError as e:
                raise RequestError(400, str(e), param=name) from None
        return {"horizon": body.horizon, "paths": paths, "continuations": body.continuations,
                "seed": 0 if body.seed is None else body.seed}

    def runtime_check() -> Path:
        if runtime_root is None:
            raise RequestError(403, f"runtime adapter loading is off: start the server with {RUNTIME_FLAG} to load "
                                    "and unload adapters from that directory", type="permission_error",
                               code="runtime_loading_disabled")
        return Path(runtime_root)

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: schemas.LoadLoraAdapterRequest, request: Request):
        root = runtime_check()
        name = body.lora_name
        try:
            check_adapter_name(name)
        except ValueError as e:
            raise RequestError(400, str(e), param="lora_name") from None
        if body.load_inplace:
            raise RequestError(400, "load_inplace is not supported: unload the adapter first", param="load_inplace")
        if name in registry:
            raise RequestError(400, f"The lora adapter {name!r} has already been loaded: unload it first, or pick "
                                    "another name", param="lora_name")
        path = runtime_path(root, body.lora_path)

        def load(model):
            if name in model.adapter_names:
                raise RequestError(400, f"The lora adapter {name!r} has already been loaded", param="lora_name")
            try:
                model.load_adapter(str(path), name, tokenizer=engine.tokenizer, local_files_only=True)
            except (OSError, ValueError) as e:
                raise RequestError(400, f"cannot load {body.lora_path!r}: {e}", param="lora_path") from None
            registry.add(name, path, model.causal_configs[name].value_decimals)
            log.info("loaded adapter %r from %s", name, path)

        await result(submit(Job("call", CallSpec(load))), request)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: schemas.UnloadLoraAdapterRequest, request: Request):
        runtime_check()
        name = body.lora_name
        if name not in registry:
            raise RequestError(404, f"The lora adapter {name!r} cannot be found.", "not_found_error",
                               param="lora_name", code="model_not_found")
        if len(registry.names()) == 1:
            raise RequestError(400, f"{name!r} is the only adapter served: load another before unloading it",
                               param="lora_name")
        registry.remove(name)  # new requests for it: 404 from now on; its rows running finish first

        def unload(model):
            if name in model.adapter_names:
                model.delete_adapter(name)
            log.info("unloaded adapter %r", name)

        await result(submit(Job("call", CallSpec(unload, drain=name))), request)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    return app


#: The page may talk to its own origin only: its script and style are inline, it loads nothing from elsewhere, and the
#: browser refuses any request it would make to another host (the machine may be offline; nothing leaks).
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                               "img-src 'self' data:; connect-src 'self'; base-uri 'none'; form-action 'none'; "
                               "frame-ancestors 'none'",
    "Cache-Control": "no-cache",
    "X-Content-Type-Options": "nosniff",
}


def playground_page() -> str:
    """The playground (``GET /``): one static page, no template: it holds nothing of the server's (the API key is
    typed into it, never written into it), and reads the adapters from ``v1/models`` (relative URLs: it works behind
    a reverse proxy's path prefix)."""
    return files(__package__).joinpath("static", "playground.html").read_text(encoding="utf-8")


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body has been read: receive() only reports the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
