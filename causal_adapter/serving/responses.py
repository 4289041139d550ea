"""The server's answers: JSON as `causal-adapter predict` writes it, and OpenAI-shaped errors
(``{"error": {"message", "type", "param", "code"}}``) with the handlers that turn every failure into one: a
`RequestError` as raised, a body pydantic refuses as a 400 naming the field, an unknown route as a 404, anything
else as a 500 (logged)."""
from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from . import schemas
from .scheduler import RequestError

log = logging.getLogger("causal_adapter.serving")
RETRY_AFTER_S = 1


class JSON(JSONResponse):
    """JSON as `causal-adapter predict` / `generate --output` write it: an interval the adapter's calibration cannot
    bound (too few calibration rows for the level) is ``-Infinity`` / ``Infinity``, which Python's json (the
    OpenAI client's) reads back as a float; strict JSON has no such number."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def error_response(e: RequestError, headers: dict | None = None) -> JSON:
    return JSON(schemas.error_body(e.message, e.type, e.param, e.code), status_code=e.status, headers=headers)


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


def add_error_handlers(app: FastAPI) -> None:
    """Every failure of `app` answered as an OpenAI error (the module docstring)."""

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
