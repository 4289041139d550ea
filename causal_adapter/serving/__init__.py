"""Layer 7, serving: several adapters on one base behind an OpenAI-compatible HTTP server (`causal-adapter serve`,
docs/serving.md), above the model and its prediction code.

    schemas   the requests and responses in OpenAI's shapes (pydantic)
    scheduler the bounded queue and the one worker thread that owns the model and runs the step loop
    engine    what the worker runs: requests' rows on the step loop (continuous batching), prediction, adapter loading
    metrics   /metrics in Prometheus' text format
    registry  the adapters by name; the checks of runtime loading
    app       the FastAPI app: routes, the API key, OpenAI-style errors

Needs the ``serve`` extra (``pip install "causal_adapter[serve]"``: FastAPI, uvicorn, prometheus-client); nothing
below this layer imports it.
"""
