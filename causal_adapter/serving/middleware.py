"""The middlewares around every route: the API key (`APIKeyMiddleware`, compared in constant time by `key_matches`)
and the count of HTTP answers by route and status code (`MetricsMiddleware`, its labels bounded by `ROUTES`)."""
from __future__ import annotations

import hashlib
import hmac

from .metrics import Metrics
from .responses import error_response
from .scheduler import RequestError


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
