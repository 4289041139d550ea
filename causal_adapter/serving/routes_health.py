"""The open routes that watch the server (no API key): ``GET /health`` (the adapters, queue and batch figures) and
``GET /metrics`` (Prometheus' text format, `metrics.Metrics`)."""
from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import Response

from .engine import Engine
from .metrics import Metrics
from .scheduler import Scheduler


def register(app: FastAPI, engine: Engine, worker: Scheduler, metrics: Metrics) -> None:
    """``GET /health`` and ``GET /metrics`` on `app`."""
    registry = engine.registry

    @app.get("/health")
    async def health():
        return {"status": "ok", "adapters": registry.names(), **worker.stats(), **engine.stats()}

    @app.get("/metrics")
    async def prometheus_metrics():
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)
