"""``POST /v1/predict``: ``{"model", "prompts" | "messages", "levels"}`` -> ``{"data": rows of `predict`}``; with
``"horizon"``, ``"paths"``, ``"continuations"``, ``"seed"``: `predict --horizon`'s rows, each step also
"calibrated" / "intervals" (`horizon.step_intervals`). Also the levels check every route that answers values
shares (`request_levels`)."""
from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import Response

from ..modeling.horizon import DEFAULT_PATHS, check_horizon, check_paths
from ..modeling.prediction import check_levels, prediction_columns
from . import schemas
from .engine import PredictSpec
from .jobs import Jobs
from .registry import Registry
from .scheduler import Job, RequestError

#: the most paths a horizon request may ask for (``serve --max-paths``): 1 + paths rows join the running batch at once
DEFAULT_MAX_PATHS = 1000


def request_levels(levels: list[float] | None) -> tuple[float, ...]:
    """A request's interval levels (the default ones when it names none), checked (400 naming ``levels``)."""
    try:
        return check_levels(levels if levels is not None else schemas.DEFAULT_LEVELS)
    except ValueError as e:
        raise RequestError(400, f"levels: {e}", param="levels") from None


def _horizon(body: schemas.PredictRequest, max_paths: int) -> dict:
    """PredictSpec's horizon fields of a request (empty without `horizon`), checked (400 naming the field). A prompt's
    1 + paths lanes are rows of the running batch (`serving.horizons`): `max_paths` (``serve --max-paths``) bounds
    what one request adds to it."""
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
    if paths > max_paths:
        raise RequestError(400, f"paths: at most {max_paths} on this server (its lanes are rows of the running batch; "
                                f"serve --max-paths), got {paths}", param="paths")
    return {"horizon": body.horizon, "paths": paths, "continuations": body.continuations,
            "seed": 0 if body.seed is None else body.seed}


def register(app: FastAPI, registry: Registry, jobs: Jobs, max_paths: int = DEFAULT_MAX_PATHS) -> None:
    """``POST /v1/predict`` on `app`; a horizon of at most `max_paths` paths."""

    @app.post("/v1/predict")
    async def predict(body: schemas.PredictRequest, request: Request):
        registry.check(body.model)
        levels = request_levels(body.levels)
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
        horizon = _horizon(body, max_paths)
        job = jobs.submit(Job("predict", PredictSpec(body.model, prompts, conversations, levels, thinking, **horizon),
                              rows=len(prompts or conversations)))
        rows = await jobs.result(job, request)
        if rows is None:
            return Response(status_code=499)
        columns = prediction_columns(levels) + (["horizon"] if horizon else [])
        return {"object": "list", "model": body.model, "data": [{k: r[k] for k in columns} for r in rows]}
