"""The scheduler: a bounded set of accepted requests and ONE worker thread, the only one that touches the model (and
the tokenizer); the worker runs the engine's step loop.

    scheduler = Scheduler(engine, max_queue=256, batch_wait_s=0.005, policy="step")
    scheduler.start(); scheduler.submit(job)   # QueueFull when max_queue requests are already accepted
    ...; scheduler.close()                     # finishes what was accepted, then the worker stops
    (or scheduler.run() in a thread of the caller's: the worker in that thread, until close())

Policies (`--scheduler`):

* ``step`` (default; continuous batching): at every decoding step the worker hands every job that arrived to the
  engine; a generation's rows join the running batch at the next step (up to --max-batch-size rows; beyond, they
  wait their turn), and a row that finishes leaves at once. An idle worker waits for a first job, then
  `batch_wait_s` for others (one prefill for the requests that arrive together).
* ``tick`` (the earlier scheduling, kept to compare with): jobs that arrive while a batch runs wait for it to
  end; then, after `batch_wait_s`, every waiting job forms the next batch.

A job holds its slot from `submit` until the engine finished it or its client went away (`cancel`: the slot is freed
at once; its rows leave the batch at the next step). An exception in a step fails the requests whose rows were in the
batch (500); the worker goes on with a fresh batch.

Jobs talk to the asyncio side through `Job.emit` (thread-safe: `loop.call_soon_threadsafe` into the job's asyncio
queue); events are ``("start",)``, ``("delta", index, text)``, ``("row", index, result)``, ``("done", results)`` and
``("error", RequestError)``.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("causal_adapter.serving")
_ids = itertools.count()
POLICIES = ("step", "tick")


class QueueFull(Exception):
    """max_queue requests are accepted and not finished: the server answers 503 with Retry-After."""


class RequestError(Exception):
    """An error of one request, in OpenAI's fields: HTTP status, message, type, param, code."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code


@dataclass(eq=False)
class Job:
    """One accepted request. `kind` tells the engine what it is ("generate", "predict" or "call"); `rows` how many
    batch rows it takes; `spec` the rest; `arrived` when it was submitted (time.perf_counter: TTFT counts from it)."""

    kind: str
    spec: Any
    rows: int = 1
    stream: bool = False
    loop: asyncio.AbstractEventLoop | None = None
    events: asyncio.Queue | None = None
    cancelled: bool = False
    finished: bool = False
    arrived: float = 0.0
    id: int = field(default_factory=lambda: next(_ids))

    def attach(self, loop: asyncio.AbstractEventLoop) -> "Job":
        self.loop, self.events = loop, asyncio.Queue()
        return self

    def emit(self, *event) -> None:
        """Send an event to the request's handler (from any thread; dropped once the client is gone)."""
        if self.cancelled or self.loop is None:
            return
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is closed: nobody is listening
            pass

    def fail(self, error: RequestError) -> None:
        self.finished = True
        self.emit("error", error)

    def done(self, results: Any) -> None:
        self.finished = True
        self.emit("done", results)


class Scheduler:
    """`engine`: accepts jobs (`accept`), runs steps (`step`, `busy`), fails what it holds (`fail_running`).
    run_by_caller: the owner runs the worker with `run()` (else `start()` gives it a thread)."""

    def __init__(self, engine, *, max_queue: int = 256, batch_wait_s: float = 0.005, policy: str = "step",
                 run_by_caller: bool = False):
        if max_queue < 1 or batch_wait_s < 0 or policy not in POLICIES:
            raise ValueError(f"max_queue must be >= 1, batch_wait_s >= 0, policy one of {POLICIES}")
        self.engine, self.max_queue, self.batch_wait_s, self.policy = engine, max_queue, batch_wait_s, policy
        self._lock = threading.Condition()
        self._waiting: list[Job] = []
        self._active: set[Job] = set()  # accepted, not finished nor cancelled: the slots taken
        self._ticks = self._served = 0  # times the worker took new jobs, jobs taken
        self._closing = False
        self._thread: threading.Thread | None = None
        self._started = run_by_caller  # the owner calls run() in a thread of its own (close waits for it to end)
        self._stopped = threading.Event()

    # ------------------------------------------------------------------ the asyncio side
    def submit(self, job: Job) -> Job:
        with self._lock:
            if self._closing:
                raise QueueFull("the server is shutting down")
            if len(self._active) >= self.max_queue:
                raise QueueFull(f"{len(self._active)} requests are queued or running (--max-queue {self.max_queue})")
            job.arrived = time.perf_counter()
            self._active.add(job)
            self._waiting.append(job)
            self._lock.notify_all()
        return job

    def cancel(self, job: Job) -> None:
        """The client went away: drop the job's output and free its slot now (its rows leave at the next step)."""
        with self._lock:
            job.cancelled = True
            self._active.discard(job)
            if job in self._waiting:
                self._waiting.remove(job)

    def stats(self) -> dict:
        with self._lock:
            return {"waiting": len(self._waiting) + self.engine.waiting_requests(), "running": self.engine.running(),
                    "accepted": len(self._active), "max_queue": self.max_queue, "scheduler": self.policy,
                    "batches": self._ticks, "requests": self._served}

    # ------------------------------------------------------------------ life cycle
    def start(self) -> None:
        """Run the worker in a thread of its own."""
        self._thread = threading.Thread(target=self.run, name="causal-adapter-worker", daemon=True)
        self._thread.start()

    def run(self) -> None:
        """Run the worker in the calling thread until `close` (`causal-adapter serve` runs it in the main thread:
        torch's steps run there about 5% faster than in another thread on CPU, measured)."""
        try:
            self._work()
        finally:
            self._stopped.set()

    def close(self, timeout: float | None = None) -> None:
        """Refuse new jobs, let the worker finish every accepted one, then stop it."""
        with self._lock:
            self._closing = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
        elif self._started:
            self._stopped.wait(timeout)

    # ------------------------------------------------------------------ the worker
    def _take(self) -> list[Job] | None:
        """The jobs to hand to the engine before its next step (None: closing and nothing left)."""
        with self._lock:
            if self.engine.busy:
                if self.policy == "tick":
                    return []  # a batch runs: new jobs wait for it to end
                jobs, self._waiting = self._waiting, []
                return jobs
            while not self._waiting:
                if self._closing:
                    return None
                self._lock.wait()
            deadline = time.monotonic() + self.batch_wait_s
            while not self._closing and sum(j.rows for j in self._waiting) < self.engine.max_rows:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._lock.wait(left)
            jobs, self._waiting = self._waiting, []
            return jobs

    def _work(self) -> None:
        while True:
            jobs = self._take()
            if jobs is None:
                return
            jobs = [j for j in jobs if not j.cancelled]
            if jobs:
                with self._lock:
                    self._ticks += 1
                    self._served += len(jobs)
            for job in jobs:
                self._guarded([job], self.engine.accept, job)
            if self.engine.busy:
                self._guarded(None, self.engine.step)
            with self._lock:
                self._active = {j for j in self._active if not j.finished}

    def _guarded(self, jobs: list[Job] | None, fn, *args) -> None:
        """fn(*args); an exception fails `jobs` (None: every job the engine holds) with a 500, and the worker goes on."""
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - one batch's failure fails that batch only
            log.exception("serving failed: %s", e)
            error = RequestError(500, f"internal error while serving this request: {type(e).__name__}: {e}",
                                 type="server_error")
            for job in jobs if jobs is not None else self.engine.fail_running():
                if not job.finished:
                    job.fail(error)
