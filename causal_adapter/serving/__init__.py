"""Layer 7, serving: several adapters on one base behind an OpenAI-compatible HTTP server (`causal-adapter serve`,
docs/serving.md), above the model and its prediction code.

    schemas   the requests and responses in OpenAI's shapes (pydantic)
    batcher   the bounded queue and the one worker thread that owns the model
    engine    what the worker runs: batched generation, prediction, adapter loading
    registry  the adapters by name; the checks of runtime loading
    app       the FastAPI app: routes, the API key, OpenAI-style errors

Needs the ``serve`` extra (``pip install "causal_adapter[serve]"``: FastAPI and uvicorn); nothing below this
layer imports it.
"""
