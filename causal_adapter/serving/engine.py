"""What the worker thread runs: the requests' rows on ONE step loop (`modeling.generation.loop.StepLoop`, the engine of
`generate` and `generate_batched`), predict requests and adapter loading between two steps. Only the worker calls it,
so the model and the tokenizer are never used from two threads.

Generation (completions and chat): a request's prompts (chat: rendered with the chat template and its generation
prompt, as `causal-adapter generate --messages`) are encoded number-aware, checked against the context and repeated
`n` times; each copy is a row of the running batch. Rows are grouped by what decides their tokens (adapter, mode,
sampling, eos; a seeded request is a group of its own, with its own generator: the same request gives the same text
whatever runs beside it); every other setting is the row's own (max_tokens, stop strings). A row joins the batch at
the next step (its prompt prefilled, a prefix shared with an earlier prompt read from the prefix cache) and leaves it
when it finishes; its stream sends each new piece of text that can no longer turn into a stop string, its last event
carries the rest, so the deltas join to exactly the non-streamed text. A stop string ends the row and the text is
cut before it (OpenAI); ``finish_reason`` is "stop" (eos or a stop string) or "length", and "stop" with a
``stop_reason`` sentence (vLLM's field) for a row that ended on a value or a hidden state that is not finite. Each
row's ``values``: its numbers (before the cut) with its adapter's intervals at the requested levels
(`CausalModel.value_interval`).

A horizon (/v1/predict with ``horizon``): its lanes are rows of the same batch (`serving.horizons`), so streams beside
it go on writing while it runs.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..data.conversations import inference_prompt
from ..modeling.families import text_config
from ..modeling.generation.cache import PrefixCache
from ..modeling.generation.loop import StepLoop
from ..modeling.generation.api import batched_options
from ..modeling.generation.output import row_output
from ..modeling.generation.prepare import Group, make_generator
from ..modeling.generation.record import Row
from ..modeling.generation.stream import decode_text, first_stop, streamable
from ..modeling.intervals import interval
from ..modeling.horizon import HorizonRun
from ..modeling.prediction import level_name, predict_values
from ..numbers import NumberTokenizer
from .horizons import Horizons, Lane
from .logprobs import completion_logprobs
from .registry import Registry
from .scheduler import Job, RequestError
from .schemas import value_entry

log = logging.getLogger("causal_adapter.serving")
#: rows per forward of /v1/predict: `causal-adapter predict`'s --batch-size default, so its rows are the same
PREDICT_BATCH_SIZE = 16


@dataclass(frozen=True)
class Decoding:
    """How tokens are chosen: mode, sampling, seed, stop strings, eos."""

    mode: str = "deterministic"
    do_sample: bool = False
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def options(self):
        sampling = self.mode == "softmax" and self.do_sample
        return batched_options(dict(mode=self.mode, eos_token_id=[] if self.ignore_eos else None, do_sample=sampling,
                                    temperature=self.temperature if sampling else None,
                                    top_p=self.top_p if sampling else None))[0]


@dataclass
class GenerateSpec:
    adapter: str
    decoding: Decoding
    prompts: list[str] | None = None  # completions
    conversations: list[list[dict]] | None = None  # chat: one conversation
    max_tokens: int = 32
    n: int = 1
    levels: tuple[float, ...] = (0.5, 0.9)
    enable_thinking: bool | None = None
    # completions' logprobs / echo (`serving.logprobs`): alternatives per token (None: no logprobs), the prompt in
    # front of the text, the prompts as the token ids the client sent (None: texts), the distribution scored
    logprobs: int | None = None
    echo: bool = False
    prompt_token_ids: list[list[int]] | None = None
    logprobs_mode: str = "softmax"


@dataclass
class PredictSpec:
    adapter: str
    prompts: list[str] | None = None
    conversations: list[list[dict]] | None = None
    levels: tuple[float, ...] = (0.5, 0.9)
    enable_thinking: bool | None = None
    horizon: int | None = None  # a horizon (`predict_horizon`): H, its paths, continuations, seed
    paths: int = 100
    continuations: list | None = None
    seed: int | None = 0


@dataclass
class CallSpec:
    """Run fn(model) on the worker between two steps (adapter loading / unloading: no concurrent model mutation);
    `drain`: an adapter whose rows must all have left first (unloading it)."""

    fn: Callable[[Any], Any]
    drain: str | None = None


@dataclass(eq=False)
class Choice:
    """A row's place in its request: the job, the choice's index, what its stream sent, when it wrote last."""

    job: Job
    index: int
    sent: str = ""
    last: float | None = None


@dataclass(eq=False)
class Request:
    """A generation request while its rows run."""

    job: Job
    rows: list[Row]
    prompt_tokens: int
    results: dict = dataclasses.field(default_factory=dict)
    first_token: bool = False


class Engine:
    def __init__(self, model, tokenizer, registry: Registry, *, max_batch_size: int = 32,
                 chat_template: str | None = None, enable_thinking: bool = False, prefix_cache: bool = True,
                 metrics=None):
        self.model, self.tokenizer, self.registry, self.metrics = model, tokenizer, registry, metrics
        self.ntok = NumberTokenizer(tokenizer, model.num_token_id)
        self.max_rows, self.join_running = max_batch_size, True
        self.prefix = PrefixCache() if prefix_cache else None
        self.loop = self._new_loop()
        self.chat_template, self.enable_thinking = chat_template, enable_thinking
        self.context = getattr(text_config(model.backbone), "max_position_embeddings", None)
        self.groups: dict[tuple, Group] = {}  # unseeded groups, by (adapter, decoding without its stops)
        self.requests: dict[Job, Request] = {}
        self.horizons = Horizons(model)  # horizon requests whose lanes run in the batch
        self.deferred: list[Job] = []  # calls waiting for an adapter's rows to leave
        # what /health reports of the work: steps, steps with rows of several adapters, rows, seconds in steps
        self.steps = self.mixed_steps = self.generated_rows = 0
        self.step_s = 0.0

    def stats(self) -> dict:
        loop = self.loop
        return {"steps": self.steps, "mixed_adapter_steps": self.mixed_steps, "generated_rows": self.generated_rows,
                "step_seconds": round(self.step_s, 3), "prefills": loop.prefills, "prefill_tokens": loop.prefill_tokens,
                "prefix_reused_tokens": loop.reused_tokens, "running_rows": len(loop.rows),
                "waiting_rows": loop.waiting_rows, "max_batch_size": self.max_rows,
                "joins_running_batch": loop.fixed_reason is None}

    # ------------------------------------------------------------------ the scheduler's side
    @property
    def busy(self) -> bool:
        return self.loop.busy or bool(self.deferred)

    def running(self) -> int:
        """Requests with a row in the batch."""
        return len({r.tag.job for r in self.loop.rows})

    def waiting_requests(self) -> int:
        """Requests whose rows all wait to join the batch."""
        return len(self.requests) + len(self.horizons) - self.running()

    def accept(self, job: Job) -> None:
        if job.kind == "generate":
            self._start(job)
        elif job.kind == "predict":
            self._predict(job)
        elif job.kind == "call":
            self.deferred.append(job)
            self._calls()
        else:
            raise ValueError(f"unknown job kind {job.kind!r}")

    def fail_running(self) -> list[Job]:
        """After an error inside a step: the requests of the batch (they fail), and a fresh batch."""
        jobs = list(self.requests) + self.horizons.clear()
        self.requests.clear()
        self.loop = self._new_loop()
        return jobs

    def _new_loop(self) -> StepLoop:
        return StepLoop(self.model, max_rows=self.max_rows, prefix_cache=self.prefix, join_running=self.join_running)

    def set_scheduler(self, policy: str) -> None:
        """"step": rows join the running batch at every step; "tick": only an empty one (batch after batch)."""
        self.join_running = self.loop.join_running = policy == "step"

    # ------------------------------------------------------------------ a step
    @torch.no_grad()
    def step(self) -> None:
        self._drop_cancelled()
        t0 = time.perf_counter()
        stepped, finished = self.loop.decide()
        now = time.perf_counter()
        self.steps += bool(stepped)
        self.mixed_steps += len({r.group.adapter for r in stepped}) > 1
        if self.metrics is not None:
            self.metrics.tokens(len(stepped))
        for r in stepped:  # the tokens go out before the backbone's pass for the next step
            self._wrote(r, now)
        for r in finished:
            if isinstance(r.tag, Lane):
                self.horizons.lane_done(r, self.loop)
            else:
                self._finished(r)
        self.loop.feed()
        self._drop_cancelled()  # rows cancelled left at this step: forget their request now (no step may follow)
        self.step_s += time.perf_counter() - t0
        self._calls()

    def _wrote(self, row: Row, now: float) -> None:
        choice: Choice = row.tag
        request = self.requests.get(choice.job)
        if request is None or choice.job.cancelled:
            return
        if self.metrics is not None:
            if not request.first_token:
                self.metrics.ttft(now - choice.job.arrived)
            elif choice.last is not None:
                self.metrics.itl(now - choice.last)
        request.first_token, choice.last = True, now
        if row.text is not None and choice.job.stream and not row.done:
            safe = streamable(row.text.text, row.stop_strings)
            if safe > len(choice.sent):
                choice.job.emit("delta", choice.index, row.text.text[len(choice.sent):safe])
                choice.sent = row.text.text[:safe]

    def _finished(self, row: Row) -> None:
        choice: Choice = row.tag
        request = self.requests.get(choice.job)
        if request is None:
            return
        self.generated_rows += 1
        if row.cancelled or choice.job.cancelled:
            return  # `_drop_cancelled` forgets the request once none of its rows is in the batch
        result = self._row_result(row, request.job.spec.levels)
        request.results[choice.index] = result
        if choice.job.stream:
            text = result["text"]
            if not text.startswith(choice.sent):  # never seen (tests/test_serve.py); the final text is the answer
                log.warning("streamed text %r is not a prefix of the row's text %r", choice.sent[-40:], text[-40:])
            choice.job.emit("row", choice.index, {**result, "delta": text[len(choice.sent):]})
        if len(request.results) == len(request.rows):
            del self.requests[choice.job]
            choices = [request.results[i] for i in sorted(request.results)]
            if self.metrics is not None:
                for c in choices:
                    self.metrics.finished(c["finish_reason"])
            request.job.done({"choices": choices, "prompt_tokens": request.prompt_tokens,
                              "completion_tokens": sum(c["completion_tokens"] for c in choices)})

    def _drop_cancelled(self) -> None:
        """Rows of a request whose client went away leave at the next step; the request is forgotten once none of
        its rows is in the batch (rows still waiting are dropped when their turn comes)."""
        running = set(self.loop.rows)
        self.horizons.drop_cancelled(running)
        for job, request in list(self.requests.items()):
            if not job.cancelled:
                continue
            for r in request.rows:
                r.cancelled = True
            if not any(r in running for r in request.rows):
                del self.requests[job]
                if self.metrics is not None:
                    self.metrics.finished("abort")

    def _calls(self) -> None:
        """Run the calls whose adapter has no row left in the batch."""
        for job in list(self.deferred):
            spec: CallSpec = job.spec
            if spec.drain is not None and self.loop.uses_adapter(spec.drain):
                continue
            self.deferred.remove(job)
            try:
                job.done(spec.fn(self.model))
            except RequestError as e:
                job.fail(e)
            finally:
                self.groups.clear()
                self.loop.forget_adapters()  # its scorers, LoRA layers and cached prefixes were the old adapters'

    # ------------------------------------------------------------------ prompts
    def _check_adapter(self, adapter: str) -> None:
        if adapter not in self.registry or adapter not in self.model.adapter_names:
            raise RequestError(404, f"The model {adapter!r} does not exist (it was unloaded)", param="model",
                               code="model_not_found")

    def _prompts(self, spec, to_first_number: bool) -> tuple[list[str], str]:
        """(texts, the request field they came from)."""
        if spec.conversations is None:
            return list(spec.prompts), "prompt"
        thinking = self.enable_thinking if spec.enable_thinking is None else spec.enable_thinking
        out = []
        for i, messages in enumerate(spec.conversations):
            try:
                out.append(inference_prompt(self.tokenizer, _text_messages(messages, i),
                                            to_first_number=to_first_number, enable_thinking=thinking,
                                            chat_template=self.chat_template, row=i))
            except ValueError as e:
                msg = str(e).removeprefix(f"row {i}: ")
                where = "messages" if len(spec.conversations) == 1 else f"messages[{i}]"
                raise RequestError(400, f"{where}: {msg}", param="messages") from None
        return out, "messages"

    def _encode(self, prompts: list[str], field: str, max_tokens: int) -> list[tuple[list[int], list[float]]]:
        """Each prompt's ids and values (float32, as a batch of them holds them), checked against the context."""
        encs = self.ntok.encode_batch(prompts, return_offsets=False)
        out = []
        for i, e in enumerate(encs):
            where = field if len(prompts) == 1 else f"{field}[{i}]"
            if not e.input_ids:
                raise RequestError(400, f"{where} is empty (it encodes to no token)", param=field)
            if self.context is not None and len(e.input_ids) + max_tokens > self.context:
                extra, fix = (f" plus max_tokens={max_tokens}", " or lower max_tokens") if max_tokens else ("", "")
                raise RequestError(400, f"{where} has {len(e.input_ids)} tokens{extra}: more than the model's context "
                                        f"of {self.context} tokens; shorten it{fix}",
                                   param=field, code="context_length_exceeded")
            out.append((list(e.input_ids), torch.tensor(e.numeric_values, dtype=torch.float32).tolist()))
        return out

    # ------------------------------------------------------------------ generation
    def _group(self, spec: GenerateSpec, rows: int) -> Group:
        d = spec.decoding
        if d.seed is not None:  # its own generator and draws: reproducible whatever runs beside it
            g = Group(spec.adapter, d.options(), self.ntok, make_generator(d.seed, None, self.model.device),
                      fixed_slots=True)
            g.slots = rows
            return g
        key = (spec.adapter, dataclasses.replace(d, stop=()))
        if key not in self.groups:
            self.groups[key] = Group(spec.adapter, d.options(), self.ntok)
        return self.groups[key]

    def _start(self, job: Job) -> None:
        spec: GenerateSpec = job.spec
        try:
            self._check_adapter(spec.adapter)
            if spec.prompt_token_ids is not None:  # token ids (lm-eval's local-completions): their text
                spec.prompts = self._decode_ids(spec.prompt_token_ids)
            prompts, field = self._prompts(spec, to_first_number=False)
            encoded = self._encode(prompts, field, spec.max_tokens)
            if spec.max_tokens == 0:  # echo alone (app.py checks it): the prompts' logprobs, nothing generated
                self._echo_only(job, prompts, encoded)
                return
        except RequestError as e:
            job.fail(e)
            return
        group = self._group(spec, len(encoded) * spec.n)
        rows = [Row(ids, vals, group, spec.max_tokens, spec.decoding.stop, tag=Choice(job, i * spec.n + j),
                    keep_text=job.stream, slot=i * spec.n + j)
                for i, (ids, vals) in enumerate(encoded) for j in range(spec.n)]
        prompt_tokens = sum(len(ids) for ids, _ in encoded)
        self.requests[job] = Request(job, rows, prompt_tokens)
        if self.metrics is not None:
            self.metrics.prompt_tokens(prompt_tokens * spec.n)
        job.emit("start")
        self.loop.add(rows)

    def _row_result(self, row: Row, levels: tuple[float, ...]) -> dict:
        """The row's text cut before a stop string: index, text, finish_reason, values, completion_tokens."""
        calibration = self.model.causal_configs[row.group.adapter].value_calibration  # its adapter's intervals
        one = row_output(row, calibration=calibration, ntok=self.ntok)
        text, numbers, finished = one.texts[0], one.numbers[0], row.finished
        cut = first_stop(text, row.stop_strings)
        if cut is not None:
            numbers = self._numbers_before(row, numbers, cut)
            text, finished = text[:cut], True
        out = {"index": row.tag.index, "text": text,
               "finish_reason": "stop" if finished or row.stop_reason is not None else "length",
               "stop_reason": row.stop_reason,
               "values": _values(numbers, levels, calibration,
                                 row.group.settings.value_map.row(row.floored, row.log)),
               "completion_tokens": len(row.tokens)}
        spec = row.tag.job.spec
        if isinstance(spec, GenerateSpec) and (spec.echo or spec.logprobs is not None):
            i = row.tag.index // spec.n
            prompt = spec.prompts[i] if spec.prompts is not None else None
            if spec.logprobs is not None and prompt is not None:
                out["logprobs"] = self._logprobs(spec, i, row.group.adapter, row.tokens, row.fed_values,
                                                 len(text) if cut is not None else None)
            if spec.echo and prompt is not None:
                out["text"] = prompt + text
        return out

    # ------------------------------------------------------------------ logprobs and echo (completions)
    def _decode_ids(self, rows: list[list[int]]) -> list[str]:
        vocab = len(self.tokenizer)
        for i, ids in enumerate(rows):
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                where = "prompt" if len(rows) == 1 else f"prompt[{i}]"
                raise RequestError(400, f"{where}: token id {bad} is not in the tokenizer's vocabulary "
                                        f"(0..{vocab - 1})", param="prompt")
        return self.tokenizer.batch_decode(rows, clean_up_tokenization_spaces=False)

    def _logprobs(self, spec: GenerateSpec, i: int, adapter: str, tokens, values, text_limit: int | None) -> dict:
        """Prompt i's (with echo) and its generated tokens' logprobs under `adapter` (`serving.logprobs`)."""
        active = self.model.active_adapter
        self.model.set_adapter(adapter)
        try:
            return completion_logprobs(self.model, self.ntok, spec.prompts[i], tokens, values, echo=spec.echo,
                                       top_k=spec.logprobs or 0, mode=spec.logprobs_mode, text_limit=text_limit,
                                       prompt_ids=None if spec.prompt_token_ids is None else spec.prompt_token_ids[i])
        finally:
            self.model.set_adapter(active)

    def _echo_only(self, job: Job, prompts: list[str], encoded) -> None:
        """``echo`` with max_tokens 0: each prompt back with its tokens' logprobs, `n` times."""
        spec: GenerateSpec = job.spec
        choices = []
        for i, prompt in enumerate(prompts):
            lp = (self._logprobs(spec, i, spec.adapter, [], [], None) if spec.logprobs is not None else None)
            for j in range(spec.n):
                choices.append({"index": i * spec.n + j, "text": prompt, "finish_reason": "length", "values": [],
                                "completion_tokens": 0, "logprobs": lp})
        job.emit("start")
        job.done({"choices": choices, "prompt_tokens": sum(len(ids) for ids, _ in encoded), "completion_tokens": 0})

    def _numbers_before(self, row: Row, numbers: list[dict], cut: int) -> list[dict]:
        """The numbers whose text ends before character `cut` of the row's text."""
        keep = []
        for x in numbers:
            t = x["position"] + 1  # the text up to and with the number
            if len(decode_text(self.ntok, row.tokens[:t], row.fed_values[:t], row.ids[-1], row.values[-1])) > cut:
                break
            keep.append(x)
        return keep

    # ------------------------------------------------------------------ prediction
    def _predict(self, job: Job) -> None:
        spec: PredictSpec = job.spec
        if job.cancelled:
            return
        try:
            self._check_adapter(spec.adapter)
            self.model.set_adapter(spec.adapter)
            prompts, field = self._prompts(spec, to_first_number=True)
            self._encode(prompts, field, 0)
            try:
                if spec.horizon is not None:
                    run = HorizonRun(self.model, prompts, self.ntok, spec.horizon, spec.paths, spec.levels,
                                     spec.continuations, spec.seed, PREDICT_BATCH_SIZE, None, adapter=spec.adapter)
                    self.horizons.start(job, run, field, self.loop)
                    return
                rows = predict_values(self.model, prompts, tokenizer=self.ntok, levels=spec.levels,
                                      batch_size=PREDICT_BATCH_SIZE)
            except ValueError as e:
                raise RequestError(400, str(e), param=field) from None
        except RequestError as e:
            job.fail(e)
            return
        job.done(rows)


def _values(numbers: list[dict], levels: tuple[float, ...], calibration: dict | None, value_map=None) -> list[dict]:
    """The generated numbers with their intervals per level: calibrated by their adapter's map (as
    `CausalModel.value_interval`) and raw, all numbers at once (float64, elementwise)."""
    if not numbers:
        return []
    loc = torch.tensor([x["loc"] for x in numbers], dtype=torch.float64)
    scale = torch.tensor([x["scale"] for x in numbers], dtype=torch.float64)
    cal = [{} for _ in numbers]
    raw = [{} for _ in numbers]
    for q in levels:
        for tables, cal_map in ((cal, calibration), (raw, None)):
            lo, hi = interval(loc, scale, q, cal_map, value_map)
            for table, a, b in zip(tables, lo.tolist(), hi.tolist()):
                table[level_name(q)] = (a, b)
    return [value_entry(x, c, r) for x, c, r in zip(numbers, cal, raw)]


def _text_messages(messages: Any, i: int) -> Any:
    """OpenAI's content parts (``[{"type": "text", "text": ...}]``) joined into the string the template reads."""
    if not isinstance(messages, list):
        return messages
    out = []
    for k, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            texts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise ValueError(f"row {i}: message {k}: only text content parts are supported "
                                     f"({{\"type\": \"text\", \"text\": ...}}), got {part!r:.60}")
                texts.append(part["text"])
            m = {**m, "content": "".join(texts)}
        out.append(m)
    return out
