"""A request's job seen from its route: handed to the scheduler's queue (a 503 when the queue is full), its events
awaited while watching the client, which may go away first (the job is then cancelled, its rows dropped)."""
from __future__ import annotations

import asyncio

from fastapi import Request

from .responses import RETRY_AFTER_S
from .scheduler import Job, QueueFull, RequestError, Scheduler


class Jobs:
    """The routes' side of `worker`: `submit`, `next_event`, `result`, `cancel`."""

    def __init__(self, worker: Scheduler):
        self.worker = worker

    def submit(self, job: Job) -> Job:
        try:
            return self.worker.submit(job.attach(asyncio.get_running_loop()))
        except QueueFull as e:
            raise RequestError(503, f"the server is busy: {e}; retry after {RETRY_AFTER_S} s", "server_overloaded",
                               code="queue_full") from None

    async def next_event(self, job: Job, request: Request):
        """The job's next event, or None when the client went away first (the job is then cancelled)."""
        get = asyncio.ensure_future(job.events.get())
        gone = asyncio.ensure_future(_disconnected(request))
        done, _ = await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
        if get in done:
            gone.cancel()
            return get.result()
        get.cancel()
        self.worker.cancel(job)
        return None

    async def result(self, job: Job, request: Request):
        """The job's result (None: the client went away); a RequestError when it failed."""
        while True:
            event = await self.next_event(job, request)
            if event is None or event[0] == "done":
                return None if event is None else event[1]
            if event[0] == "error":
                raise event[1]

    def cancel(self, job: Job) -> None:
        """Frees the job's slot and drops its rows (its client went away)."""
        self.worker.cancel(job)


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body has been read: receive() only reports the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
