"""The dynamic batcher: a bounded set of accepted requests and ONE worker thread, the only one that touches the
model (and the tokenizer).

    batcher = Batcher(engine.run, max_batch_size=32, max_queue=256, batch_wait_s=0.005)
    batcher.start(); batcher.submit(job)   # QueueFull when max_queue requests are already accepted
    ...; batcher.close()                   # finishes what was accepted, then the worker stops

A tick: the worker waits for a first job, then `batch_wait_s` more for others to arrive (less once
`max_batch_size` rows wait), takes every job waiting, groups them by `Job.key` (jobs whose rows can run in one
`generate` call: the same decoding settings, any adapters of the base) in the order of each group's first arrival, caps a
group at `max_batch_size` rows, and hands the groups to the runner one after the other. Jobs arriving during a
tick wait for the next one. An exception from the runner fails that group's jobs only (500); the worker goes on.

A job holds its slot from `submit` until the runner finished it or its client went away (`cancel`: the slot is
freed at once; the runner drops the job's rows and stops a batch early when all of its rows are gone).

Jobs talk to the asyncio side through `Job.emit` (thread-safe: `loop.call_soon_threadsafe` into the job's
asyncio queue); events are ``("start",)``, ``("delta", index, text)``, ``("row", index, result)``,
``("done", results)`` and ``("error", RequestError)``.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

log = logging.getLogger("causal_adapter.serving")
_ids = itertools.count()


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
    """One accepted request. `kind` tells the runner what it is ("generate", "predict" or "call"); `key` which
    jobs may share a batch (None: none, it runs alone); `rows` how many batch rows it takes; `spec` the rest."""

    kind: str
    spec: Any
    key: Any = None
    rows: int = 1
    stream: bool = False
    loop: asyncio.AbstractEventLoop | None = None
    events: asyncio.Queue | None = None
    cancelled: bool = False
    finished: bool = False
    id: int = field(default_factory=lambda: next(_ids))

    def __post_init__(self):
        if self.key is None:
            self.key = ("alone", self.id)

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


class Batcher:
    def __init__(self, runner: Callable[[list[Job]], None], *, max_batch_size: int = 32, max_queue: int = 256,
                 batch_wait_s: float = 0.005):
        if max_batch_size < 1 or max_queue < 1 or batch_wait_s < 0:
            raise ValueError("max_batch_size and max_queue must be >= 1, batch_wait_s >= 0")
        self.runner, self.max_batch_size, self.max_queue, self.batch_wait_s = \
            runner, max_batch_size, max_queue, batch_wait_s
        self._lock = threading.Condition()
        self._waiting: list[Job] = []
        self._active: set[Job] = set()  # accepted, not finished nor cancelled: the slots taken
        self._running = 0
        self._batches = self._served = 0  # groups run, jobs in them (their ratio: how much batching happens)
        self._closing = False
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ the asyncio side
    def submit(self, job: Job) -> Job:
        with self._lock:
            if self._closing:
                raise QueueFull("the server is shutting down")
            if len(self._active) >= self.max_queue:
                raise QueueFull(f"{len(self._active)} requests are queued or running (--max-queue {self.max_queue})")
            self._active.add(job)
            self._waiting.append(job)
            self._lock.notify_all()
        return job

    def cancel(self, job: Job) -> None:
        """The client went away: drop the job's output and free its slot now."""
        with self._lock:
            job.cancelled = True
            self._active.discard(job)
            if job in self._waiting:
                self._waiting.remove(job)

    def stats(self) -> dict:
        with self._lock:
            return {"waiting": len(self._waiting), "running": self._running, "accepted": len(self._active),
                    "max_queue": self.max_queue, "max_batch_size": self.max_batch_size, "batches": self._batches,
                    "requests": self._served}

    # ------------------------------------------------------------------ life cycle
    def start(self) -> None:
        self._thread = threading.Thread(target=self._work, name="causal-adapter-worker", daemon=True)
        self._thread.start()

    def close(self, timeout: float | None = None) -> None:
        """Refuse new jobs, let the worker finish every accepted one, then stop it."""
        with self._lock:
            self._closing = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    # ------------------------------------------------------------------ the worker
    def _take(self) -> list[Job] | None:
        """The jobs of one tick (None: closing and nothing left)."""
        with self._lock:
            while not self._waiting:
                if self._closing:
                    return None
                self._lock.wait()
            deadline = time.monotonic() + self.batch_wait_s
            while not self._closing and sum(j.rows for j in self._waiting) < self.max_batch_size:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._lock.wait(left)
            jobs, self._waiting = self._waiting, []
            return jobs

    def groups(self, jobs: list[Job]) -> list[list[Job]]:
        """Jobs of equal keys together (in the order of each key's first job), at most max_batch_size rows per
        group (a job larger than that alone)."""
        by_key: OrderedDict[Any, list[list[Job]]] = OrderedDict()
        for job in jobs:
            chunks = by_key.setdefault(job.key, [[]])
            if chunks[-1] and sum(j.rows for j in chunks[-1]) + job.rows > self.max_batch_size:
                chunks.append([])
            chunks[-1].append(job)
        return [chunk for chunks in by_key.values() for chunk in chunks]

    def _work(self) -> None:
        while True:
            jobs = self._take()
            if jobs is None:
                return
            for group in self.groups(jobs):
                group = [j for j in group if not j.cancelled]
                if not group:
                    continue
                with self._lock:
                    self._running += len(group)
                    self._batches += 1
                    self._served += len(group)
                try:
                    self.runner(group)
                except Exception as e:  # noqa: BLE001 - one group's failure fails that group only
                    log.exception("a batch of %d request(s) failed", len(group))
                    for job in group:
                        if not job.finished:
                            job.fail(RequestError(500, f"internal error while serving this request: "
                                                       f"{type(e).__name__}: {e}", type="server_error"))
                finally:
                    with self._lock:
                        self._running -= len(group)
                        for job in group:
                            if not job.finished and not job.cancelled:
                                job.fail(RequestError(500, "internal error: the request ended without a result",
                                                      type="server_error"))
                            self._active.discard(job)
