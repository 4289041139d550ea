"""`causal-adapter serve --adapter NAME=DIR [--adapter NAME=DIR ...]`: several adapters on one base behind an
OpenAI-compatible HTTP server (causal_adapter.serving; docs/serving.md). This module parses the flags, loads
the base and the adapters, and runs uvicorn.

FastAPI + uvicorn: a well-kept ASGI stack; pydantic validates the requests (OpenAI's 400s come from it), SSE
streams through StreamingResponse, and uvicorn stops gracefully on SIGTERM / SIGINT (no new connections, the
accepted requests finished, then the app's shutdown stops the worker).

Without --base (and without --tiny-* flags) the base is the one the adapters record (the embedded tiny base
they were trained on, rebuilt offline, or a checkpoint's path / hub name); adapters made for different bases
are refused at startup in one line.
"""
from __future__ import annotations

import argparse
import json
import logging
import socket
import sys

from ..saving.artifacts import CONFIG_NAME, resolve_adapter_dir
from ..saving.assets import DTYPES, TINY_NAME, load_qwen_tokenizer, tiny_qwen_from_name
from .parser import (
    CLIError,
    add_base_arguments,
    add_chat_arguments,
    chat_template_from_args,
    check_base,
    load_base_from_args,
)

INSTALL = 'pip install "causal_adapter[serve]"'
TINY_DEFAULTS = {"arch": "qwen2", "tiny_hidden_size": 64, "tiny_layers": 2}


def add_parser(sub, **fmt) -> None:
    p = sub.add_parser("serve", help="serve adapters on one base over an OpenAI-compatible HTTP API", **fmt)
    p.add_argument("--adapter", action="append", required=True, metavar="NAME=DIR",
                   help="an adapter to serve under NAME (the request's model field); repeat for several, all on "
                        "one base")
    add_base_arguments(p)
    # None: the base the adapters record (TINY_DEFAULTS when they record none)
    p.set_defaults(arch=None, tiny_hidden_size=None, tiny_layers=None)
    for action in p._actions:
        if action.dest == "base":
            action.help = ("local Qwen directory or cached hub name (default: the base the adapters record; the "
                           "--tiny-* flags pick an embedded tiny base instead)")
    add_chat_arguments(p, messages_column=False)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free port, printed)")
    p.add_argument("--api-key", default=None,
                   help="requests to /v1 must send 'Authorization: Bearer KEY' (the OpenAI client's api_key)")
    p.add_argument("--max-batch-size", type=int, default=32,
                   help="rows in the running batch (more wait for a row to finish and take its place)")
    p.add_argument("--scheduler", default="step", choices=["step", "tick"],
                   help="step: requests join the running batch at every decoding step and leave it when they finish "
                        "(continuous batching); tick: requests that arrive while a batch runs wait for it to end (the "
                        "scheduling before 0.2, kept to compare with)")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="recompute every prompt (default: prompts that begin the same way read that beginning's "
                        "cached keys and values)")
    p.add_argument("--max-paths", type=int, default=None,
                   help="the most sample paths a /v1/predict horizon may ask for (default 1000): a prompt's 1 + paths "
                        "lanes join the running batch at once")
    p.add_argument("--max-queue", type=int, default=256,
                   help="requests accepted and not finished; beyond it the server answers 503 with Retry-After")
    p.add_argument("--batch-wait-ms", type=float, default=5.0,
                   help="how long an idle worker waits for more requests to start a batch with the first one")
    p.add_argument("--runtime-adapter-root", default=None, metavar="DIR",
                   help="allow /v1/load_lora_adapter and /v1/unload_lora_adapter, reading adapters under DIR only "
                        "(default: off)")
    p.add_argument("--no-ui", action="store_true",
                   help="do not serve the playground page at / (default: served, no key needed to load it; its "
                        "requests to /v1 send the key typed into it)")
    p.add_argument("--device", default="auto",
                   help="where the model runs: auto (cuda when a GPU is visible, else cpu), cpu, cuda, cuda:1, ...")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (info: one access line per request)")
    p.set_defaults(func=run)


def parse_adapters(values: list[str]) -> dict[str, str]:
    """NAME=DIR flags -> {name: dir}, names checked (peft's rules) and given once."""
    from ..model.adapters import check_adapter_name

    out: dict[str, str] = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise CLIError(f"--adapter {value!r}: give NAME=DIR, e.g. --adapter sunspots=runs/sunspots/adapter")
        try:
            check_adapter_name(name)
        except ValueError as e:
            raise CLIError(f"--adapter {value!r}: {e}") from None
        if name in out:
            raise CLIError(f"--adapter {name!r} is given twice: each adapter needs its own name")
        out[name] = path
    return out


def recorded_base(path: str) -> str | None:
    """The base an adapter directory records (None when it cannot be read: loading reports the problem)."""
    try:
        meta = json.loads((resolve_adapter_dir(path) / CONFIG_NAME).read_text())
    except (OSError, ValueError):
        return None
    return meta.get("base_model_name_or_path") or None


def load_serving_base(args: argparse.Namespace, adapters: dict[str, str]):
    """(base model, tokenizer, base name): --base; else the --tiny-* flags; else the base the adapters record."""
    tiny_flags = any(getattr(args, k) is not None for k in TINY_DEFAULTS)
    for k, v in TINY_DEFAULTS.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.base is None and not tiny_flags:
        recorded = {name: recorded_base(path) for name, path in adapters.items()}
        bases = sorted({b for b in recorded.values() if b is not None})
        if len(bases) > 1:
            shown = ", ".join(f"{n}: {b}" for n, b in recorded.items())
            raise CLIError(f"the adapters were made for different bases ({shown}); one server serves adapters of one "
                           "base: start one server per base, or give --base")
        if bases and TINY_NAME.fullmatch(bases[0]):
            return tiny_qwen_from_name(bases[0], DTYPES[args.dtype]), load_qwen_tokenizer(), bases[0]
        if bases:
            try:
                check_base(bases[0], flag="the base the adapters record,")
            except CLIError as e:
                raise CLIError(f"{e} (or give it with --base)") from None
            args.base = bases[0]
    base, tokenizer = load_base_from_args(args)
    return base, tokenizer, args.base or getattr(base, "name_or_path", None)


def listen(host: str, port: int) -> socket.socket:
    """A listening socket (port 0: a free one), so the URL printed is the one served. Its protocol is named
    (IPPROTO_TCP): asyncio sets TCP_NODELAY only on connections whose socket says TCP, and without it Nagle's
    algorithm held a stream's chunks until the client's delayed ACK (about 40 ms) on a reused connection."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise CLIError(f"cannot listen on {host}:{port}: {e.strerror or e}: choose another --port (or --host)") \
            from None
    sock.listen(2048)
    return sock


def serving_device(name: str):
    """--device as a torch.device ("auto": the first GPU when one is visible, else the CPU)."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise CLIError(f"--device {name!r}: give auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CLIError(f"--device {name!r}: no GPU is visible to torch here (torch.cuda.is_available() is False)")
    return device


def keep_large_blocks() -> None:
    """glibc's malloc gives the worker thread an arena of its own, whose large blocks (a [32, 151,936] score matrix is
    19 MB) go back to the kernel when freed and are faulted in again at the next step: about 600,000 page faults per
    1,000 tokens on CPU, a quarter of the time (measured; the main thread's arena keeps them). One arena for every
    thread, blocks up to 32 MB from the heap and a heap that is not trimmed below 512 MB keep them, as the main thread
    does. Linux with glibc only (elsewhere: nothing)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        libc = None
    if libc is None or not hasattr(libc, "mallopt"):
        return
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8
    libc.mallopt(M_ARENA_MAX, 1)
    libc.mallopt(M_MMAP_THRESHOLD, 32 << 20)
    libc.mallopt(M_TRIM_THRESHOLD, 512 << 20)


def _check_args(args: argparse.Namespace) -> None:
    args.torch_device = serving_device(args.device)
    for flag, value, low in (("--max-batch-size", args.max_batch_size, 1), ("--max-queue", args.max_queue, 1),
                             ("--port", args.port, 0), ("--batch-wait-ms", args.batch_wait_ms, 0)):
        if value < low:
            raise CLIError(f"{flag} must be >= {low}, got {value}")
    from ..modeling.horizon import MAX_PATHS, MIN_PATHS

    if args.max_paths is not None and not MIN_PATHS <= args.max_paths <= MAX_PATHS:
        raise CLIError(f"--max-paths must be in [{MIN_PATHS}, {MAX_PATHS}], got {args.max_paths}")
    if args.runtime_adapter_root is not None:
        from pathlib import Path

        if not Path(args.runtime_adapter_root).is_dir():
            raise CLIError(f"--runtime-adapter-root {args.runtime_adapter_root!r}: no such directory")


def run(args: argparse.Namespace) -> int:
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn
    except ImportError as e:
        raise CLIError(f"serving needs FastAPI, uvicorn and prometheus-client ({e.name or 'one'} is missing): "
                       f"{INSTALL}") from None
    from ..modeling.families import text_config
    from ..serving.app import create_app
    from ..serving.engine import Engine
    from ..serving.registry import Registry, load_adapters

    _check_args(args)
    keep_large_blocks()  # before any thread starts
    adapters = parse_adapters(args.adapter)
    chat_template = chat_template_from_args(args)
    base, tokenizer, base_name = load_serving_base(args, adapters)
    try:
        model = load_adapters(base, tokenizer, adapters)
    except ValueError as e:
        raise CLIError(str(e).splitlines()[0]) from e
    model.to(args.torch_device)
    registry = Registry(base_name, getattr(text_config(model.backbone), "max_position_embeddings", None))
    for name, path in adapters.items():
        registry.add(name, path, model.causal_configs[name].value_decimals)
    engine = Engine(model, tokenizer, registry, max_batch_size=args.max_batch_size, chat_template=chat_template,
                    enable_thinking=args.enable_thinking, prefix_cache=not args.no_prefix_cache)
    app = create_app(engine, api_key=args.api_key, runtime_root=args.runtime_adapter_root, max_queue=args.max_queue,
                     batch_wait_s=args.batch_wait_ms / 1000, scheduler=args.scheduler, worker_thread=False,
                     ui=not args.no_ui, **({} if args.max_paths is None else {"max_paths": args.max_paths}))
    logger = logging.getLogger("causal_adapter.serving")
    logger.setLevel(args.log_level.upper())
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("causal-adapter serve: %(message)s"))
        logger.addHandler(handler)
    sock = listen(args.host, args.port)
    host, port = sock.getsockname()[:2]
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    page = "" if args.no_ui else f"; playground {url}/"
    print(f"causal-adapter serve: ready on {url} (OpenAI base_url {url}/v1{page}; adapters: {', '.join(adapters)})",
          flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=None))
    serve_in_threads(server, sock, app.state.scheduler)
    return 0


def serve_in_threads(server, sock, scheduler) -> None:
    """uvicorn in a thread, the worker (the model's steps) in the main thread: torch's CPU steps run faster there.
    SIGINT / SIGTERM go to uvicorn's own handler (its graceful shutdown: no new connections, the requests accepted
    finished, then the app's shutdown closes the scheduler, which ends the worker); a second SIGINT forces the exit."""
    import signal
    import threading

    def http() -> None:
        try:
            server.run(sockets=[sock])
        finally:
            scheduler.close()  # uvicorn stopped (or never started): the worker ends once its jobs are done

    previous = {sig: signal.signal(sig, server.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
    thread = threading.Thread(target=http, name="causal-adapter-http")
    thread.start()
    try:
        scheduler.run()
    finally:
        thread.join()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
