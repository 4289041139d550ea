"""Horizon requests (/v1/predict with ``horizon``) on the worker's running batch: step 1 of every prompt is one
forward when the request arrives (`modeling.horizon.HorizonRun`), then each prompt's 1 + N lanes join the step loop
as rows (one prefill, forked; they take one row of max_batch_size), prompt after prompt (the paths' draws in
`predict_horizon`'s order: the same request gives the same answer). Streams beside it go on writing while it runs;
its answer is sent when the last prompt's lanes are done, each step saying how its intervals were made."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..modeling.generation.loop import StepLoop
from ..modeling.generation.record import Row
from ..modeling.horizon import HorizonRun, step_intervals
from .scheduler import Job, RequestError


@dataclass(eq=False)
class Lane:
    """A horizon lane's place (`Row.tag`): its request's job."""

    job: Job


@dataclass(eq=False)
class Horizon:
    """A horizon request while its lanes run: prompt `i`'s lane rows (None: none running), the rows of the prompts
    done; `param`: the request field its prompts came from (an error names it)."""

    job: Job
    run: HorizonRun
    param: str
    i: int = 0
    rows: list[Row] | None = None
    out: list = field(default_factory=list)


class Horizons:
    """The horizon requests of an `Engine`, by job."""

    def __init__(self, model):
        self.model = model
        self.running: dict[Job, Horizon] = {}

    def __len__(self) -> int:
        return len(self.running)

    def clear(self) -> list[Job]:
        """Forget every request (the batch failed); returns their jobs."""
        jobs = list(self.running)
        self.running.clear()
        return jobs

    def start(self, job: Job, run: HorizonRun, param: str, loop: StepLoop) -> None:
        self.running[job] = Horizon(job, run, param)
        self._next_prompt(self.running[job], loop)

    def lane_done(self, row: Row, loop: StepLoop) -> None:
        """A lane finished: once its prompt's lanes all are, the prompt's row, and the next prompt's lanes join."""
        h = self.running.get(row.tag.job)
        if h is None or h.rows is None or row not in h.rows or not all(r.done for r in h.rows):
            return
        self.model.set_adapter(h.job.spec.adapter)  # its value map (the loop switches adapters between groups)
        try:
            h.out.append(h.run.row(h.i, h.rows))
        except (ValueError, FloatingPointError) as e:
            self._fail(h, RequestError(400, str(e), param=h.param))
            return
        h.i, h.rows = h.i + 1, None
        self._next_prompt(h, loop)

    def drop_cancelled(self, running: set) -> None:
        """The lanes of a request whose client went away leave at the next step; it is forgotten once none is in
        the batch."""
        for job, h in list(self.running.items()):
            if job.cancelled:
                for r in h.rows or ():
                    r.cancelled = True
                if not any(r in running for r in h.rows or ()):
                    del self.running[job]

    def _next_prompt(self, h: Horizon, loop: StepLoop) -> None:
        run, spec = h.run, h.job.spec
        self.model.set_adapter(spec.adapter)  # its number layout (the continuations' tokens)
        try:
            while h.i < len(run):
                h.rows = run.lanes(h.i)
                if h.rows is not None:
                    for r in h.rows:
                        r.tag = Lane(h.job)
                    loop.add(h.rows, fork=True)
                    return
                h.out.append(run.row(h.i, None))
                h.i += 1
        except (ValueError, FloatingPointError) as e:
            self._fail(h, RequestError(400, str(e), param=h.param))
            return
        del self.running[h.job]
        kinds = step_intervals(self.model.causal_config, spec.horizon)
        for r in h.out:  # each step says how its intervals were made (the rule predict's stderr note follows)
            for s, kind in zip(r["horizon"], kinds):
                s.update(calibrated=kind == "calibrated", intervals=kind)
        h.job.done(h.out)

    def _fail(self, h: Horizon, e: RequestError) -> None:
        self.running.pop(h.job, None)
        h.job.fail(e)
