"""``GET /v1/models`` and ``GET /v1/models/{id}``: the adapters served, by name (OpenAI's model list; each card with
its value_decimals)."""
from __future__ import annotations

from fastapi import FastAPI

from . import schemas
from .registry import Registry


def register(app: FastAPI, registry: Registry) -> None:
    """The model list and one model's card on `app`."""

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
