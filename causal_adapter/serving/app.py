"""The HTTP app (`create_app`): builds the app (its scheduler, metrics, middlewares, error handlers) and registers
each resource's routes, every one in a module of its own (`routes_*.py`). OpenAI's routes for causal adapters:

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

Decoding (``mode``, ``temperature``, ``seed``, ...): `routes_completions`. ``GET /metrics`` (open, as /health):
Prometheus' text format (`metrics.Metrics`).

Errors are OpenAI's ``{"error": {"message", "type", "param", "code"}}``: 400 for a bad body (malformed JSON, a
wrong type, an unknown field, a prompt over the context), 401 without the key, 403 for runtime loading that is
off or reads outside its root, 404 for an unknown model, 503 with Retry-After when the queue is full.
"""
from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

from fastapi import FastAPI

from . import routes_adapters, routes_completions, routes_health, routes_models, routes_playground, routes_predict
from .engine import Engine
from .jobs import Jobs
from .metrics import Metrics
from .middleware import ROUTES, APIKeyMiddleware, MetricsMiddleware, key_matches
from .responses import JSON, RETRY_AFTER_S, add_error_handlers, error_response
from .routes_adapters import RUNTIME_FLAG
from .routes_playground import PAGE_HEADERS, playground_page
from .scheduler import Scheduler

# the names this module held before its routes moved out, kept importable from here
__all__ = ["create_app", "JSON", "error_response", "RETRY_AFTER_S", "RUNTIME_FLAG", "APIKeyMiddleware",
           "MetricsMiddleware", "key_matches", "ROUTES", "PAGE_HEADERS", "playground_page"]


def create_app(engine: Engine, *, api_key: str | None = None, runtime_root: str | None = None,
               max_queue: int = 256, batch_wait_s: float = 0.005, scheduler: str = "step",
               worker_thread: bool = True, ui: bool = True, max_paths: int = routes_predict.DEFAULT_MAX_PATHS
               ) -> FastAPI:
    """The app serving `engine`'s adapters; its scheduler's worker starts (in a thread of its own; worker_thread=False:
    the caller runs `app.state.scheduler.run()` in a thread of its choice) and stops with the app (lifespan).
    ui: serve the playground page at ``GET /`` (`playground_page`). max_paths: the most paths of a horizon request
    (`routes_predict`)."""
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
    add_error_handlers(app)

    jobs = Jobs(worker)
    if ui:
        routes_playground.register(app)
    routes_health.register(app, engine, worker, metrics)
    routes_models.register(app, registry)
    routes_completions.register(app, registry, jobs)
    routes_predict.register(app, registry, jobs, max_paths)
    routes_adapters.register(app, engine, jobs, runtime_root)
    return app
