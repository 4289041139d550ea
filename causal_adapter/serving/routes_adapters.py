"""vLLM's runtime adapter loading (only with ``--runtime-adapter-root DIR``; without it a 403):
``POST /v1/load_lora_adapter`` (``{"lora_name", "lora_path"}``, the path inside that root) and
``POST /v1/unload_lora_adapter`` (``{"lora_name"}``; its running rows finish first). The model is changed on the
worker's thread (a "call" job), between decoding steps."""
from __future__ import annotations

import logging
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse

from ..model.adapters import check_adapter_name
from . import schemas
from .engine import CallSpec, Engine
from .jobs import Jobs
from .registry import runtime_path
from .scheduler import Job, RequestError

log = logging.getLogger("causal_adapter.serving")
RUNTIME_FLAG = "--runtime-adapter-root DIR"


def register(app: FastAPI, engine: Engine, jobs: Jobs, runtime_root: str | None) -> None:
    """The load and unload routes on `app`; each answers 403 when `runtime_root` is None."""
    registry = engine.registry

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

        await jobs.result(jobs.submit(Job("call", CallSpec(load))), request)
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

        await jobs.result(jobs.submit(Job("call", CallSpec(unload, drain=name))), request)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
