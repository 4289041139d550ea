"""What the worker thread runs (`Engine.run`, the batcher's runner): a group of generation requests as one
`generate` call per batch of rows, a predict request, an adapter load or unload. Only the worker calls it, so
the model and the tokenizer are never used from two threads.

Generation (completions and chat): every request of a group has the same decoding settings (`Decoding`, the
group key), whatever its adapter: rows of different adapters share a batch and the backbone's pass
(`generate(..., adapter_names=...)`, peft's mixed batch; an adapter whose LoRA peft cannot mix, LoRA on
`target_parameters`, gets batches of its own). Its prompts (chat: rendered with the chat template and its generation prompt, as
`causal-adapter generate --messages`) are encoded number-aware, checked against the context, repeated `n`
times, sorted by length and run `max_batch_size` rows at a time, left padded, as `generate_batched` runs
them (greedy rows give what the prompt gives alone). Rows of different ``max_tokens`` share a batch: it runs
to the largest, each row is cut to its own (a row's first k tokens do not depend on the later ones). A stop
string ends the row (generate's ``stop_strings``) and the text is cut before it (OpenAI); ``finish_reason`` is
"stop" (eos or a stop string) or "length". Each row's ``values``: its numbers (before the cut) with the active
adapter's intervals at the requested levels (`CausalModel.value_interval`).

Streaming rows are decoded as they grow (`NumberStreamer`'s incremental decoding); a delta is sent when it
can no longer be the start of a stop string, and the row's last event carries the rest, so the deltas join to
exactly the non-streamed text. A batch whose rows all lost their client stops at the next step.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from ..data.conversations import inference_prompt
from ..modeling.families import text_config
from ..modeling.generation import NumberStreamer, default_eos_ids, generate
from ..modeling.intervals import interval
from ..modeling.prediction import level_name, predict_values
from ..numbers import NumberTokenizer, pad_batch
from .batcher import Job, RequestError
from .registry import Registry
from .schemas import value_entry

log = logging.getLogger("causal_adapter.serving")
#: rows per forward of /v1/predict: `causal-adapter predict`'s --batch-size default, so its rows are the same
PREDICT_BATCH_SIZE = 16


@dataclass(frozen=True)
class Decoding:
    """How tokens are chosen: the part of a request that decides which requests share a batch."""

    mode: str = "deterministic"
    do_sample: bool = False
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def generate_kwargs(self) -> dict:
        kw: dict[str, Any] = {"mode": self.mode, "stop_strings": list(self.stop) or None, "seed": self.seed}
        if self.mode == "softmax":
            kw.update(do_sample=self.do_sample, temperature=self.temperature, top_p=self.top_p)
        if self.ignore_eos:
            kw["eos_token_id"] = []
        return kw


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


@dataclass
class PredictSpec:
    adapter: str
    prompts: list[str] | None = None
    conversations: list[list[dict]] | None = None
    levels: tuple[float, ...] = (0.5, 0.9)
    enable_thinking: bool | None = None


@dataclass
class CallSpec:
    """Run fn(model) on the worker (adapter loading / unloading): no concurrent model mutation."""

    fn: Callable[[Any], Any]


@dataclass(eq=False)
class _Row:
    job: Job
    adapter: str
    index: int  # the choice's index: prompt i, copy j -> i * n + j
    ids: list[int]
    values: list[float]
    max_tokens: int
    stream: "_Stream | None" = None
    result: dict | None = None


class _RowText(NumberStreamer):
    """One row's generated text as `generate` decodes it (numbers rendered, a prompt-final number respected),
    grown token by token; prints nothing."""

    def __init__(self, ntok: NumberTokenizer, prompt_ids: Sequence[int], prompt_values: Sequence[float]):
        super().__init__(ntok, ntok.num_token_id, skip_prompt=True)
        self.put(torch.tensor(list(prompt_ids)), torch.tensor(list(prompt_values), dtype=torch.float64))

    def add(self, ids: Sequence[int], values: Sequence[float]) -> str:
        """The text so far (up to the last whole character)."""
        self.put(torch.tensor(list(ids)), torch.tensor(list(values), dtype=torch.float64))
        return self.text

    def final(self, ids: Sequence[int], values: Sequence[float]) -> str:
        """The text of every token (a trailing partial character shown as generate shows it)."""
        self.add(ids, values)
        self.end()
        return self.text

    def complete(self) -> bool:
        """Whether the tokens so far end on a whole character (`text` holds all of them)."""
        return not self._decoded().endswith("\ufffd")

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        pass


def first_stop(text: str, stops: Sequence[str]) -> int | None:
    """Where the first stop string starts in `text` (None: none)."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


class _Stream:
    """The deltas of one streamed row: text that can no longer turn into a stop string. The text is decoded in
    segments of up to SEGMENT tokens (each decoded again at every step; a finished segment's text is kept and the
    next one decoded after its last token, as `generate` decodes after a prompt), so a long row costs O(T)."""

    SEGMENT = 32

    def __init__(self, row: _Row, ntok: NumberTokenizer, eos: set[int], stops: tuple[str, ...]):
        self.row, self.ntok, self.eos, self.stops = row, ntok, eos, stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.settled, self.segment, self.length = "", _RowText(ntok, row.ids, row.values), 0
        self.sent_text, self.steps, self.open = "", 0, True

    def step(self, token: int, value: float) -> None:
        if not self.open:
            return
        self.steps += 1
        if token in self.eos:
            self.open = False
            return
        full = self.settled + self.segment.add([token], [value])
        self.length += 1
        if self.length >= self.SEGMENT and self.segment.complete():
            self.settled, self.segment, self.length = full, _RowText(self.ntok, [token], [value]), 0
        cut = first_stop(full, self.stops)
        if cut is not None or self.steps >= self.row.max_tokens:
            self.open = False
        safe = cut if cut is not None else len(full) - self.hold
        if safe > len(self.sent_text):
            self.row.job.emit("delta", self.row.index, full[len(self.sent_text):safe])
            self.sent_text = full[:safe]


class _Abandoned(Exception):
    """Every row of a batch lost its client: stop generating."""


class Engine:
    def __init__(self, model, tokenizer, registry: Registry, *, max_batch_size: int = 32,
                 chat_template: str | None = None, enable_thinking: bool = False):
        self.model, self.tokenizer, self.registry = model, tokenizer, registry
        self.ntok = NumberTokenizer(tokenizer, model.num_token_id)
        self.max_batch_size = max_batch_size
        # what /health reports of the work: generate calls, those with rows of several adapters, their rows, the
        # seconds inside generate and the seconds the worker spent on generation jobs (encoding, results included)
        self.generate_calls = self.mixed_calls = self.generated_rows = 0
        self.generate_s = self.generation_jobs_s = 0.0
        self.chat_template, self.enable_thinking = chat_template, enable_thinking
        self.context = getattr(text_config(model.backbone), "max_position_embeddings", None)
        self.eos = set(default_eos_ids(model))  # where generate stops a row (a stream closes there too)

    def stats(self) -> dict:
        return {"generate_calls": self.generate_calls, "mixed_adapter_calls": self.mixed_calls,
                "generated_rows": self.generated_rows, "generate_seconds": round(self.generate_s, 3),
                "generation_jobs_seconds": round(self.generation_jobs_s, 3)}

    # ------------------------------------------------------------------ the runner
    def run(self, jobs: list[Job]) -> None:
        """One group of the batcher (jobs of one key)."""
        kind = jobs[0].kind
        if kind == "generate":
            t0 = time.perf_counter()
            try:
                self._generate(jobs)
            finally:
                self.generation_jobs_s += time.perf_counter() - t0
        elif kind == "predict":
            for job in jobs:
                self._predict(job)
        elif kind == "call":
            for job in jobs:
                try:
                    job.done(job.spec.fn(self.model))
                except RequestError as e:
                    job.fail(e)
        else:
            raise ValueError(f"unknown job kind {kind!r}")

    def _activate(self, adapter: str) -> None:
        if adapter not in self.model.adapter_names:
            raise RequestError(404, f"The model {adapter!r} does not exist (it was unloaded)", param="model",
                               code="model_not_found")
        self.model.set_adapter(adapter)

    # ------------------------------------------------------------------ prompts
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
            out.append((list(e.input_ids), [float(v) for v in e.numeric_values]))
        return out

    # ------------------------------------------------------------------ generation
    def _generate(self, jobs: list[Job]) -> None:
        decoding: Decoding = jobs[0].spec.decoding
        rows: list[_Row] = []
        started: list[tuple[Job, list[_Row], int]] = []
        for job in jobs:
            spec: GenerateSpec = job.spec
            try:
                self._activate(spec.adapter)
                prompts, field = self._prompts(spec, to_first_number=False)
                encoded = self._encode(prompts, field, spec.max_tokens)
            except RequestError as e:
                job.fail(e)
                continue
            job_rows = [_Row(job, spec.adapter, i * spec.n + j, ids, vals, spec.max_tokens)
                        for i, (ids, vals) in enumerate(encoded) for j in range(spec.n)]
            if job.stream:
                for r in job_rows:
                    r.stream = _Stream(r, self.ntok, set() if decoding.ignore_eos else self.eos, decoding.stop)
            job.emit("start")
            rows += job_rows
            started.append((job, job_rows, sum(len(ids) for ids, _ in encoded)))
        rows.sort(key=lambda r: len(r.ids))  # stable: a batch pads little (as generate_batched)
        for part in self._mixable(rows):
            for start in range(0, len(part), self.max_batch_size):
                self._batch(part[start:start + self.max_batch_size], decoding)
        for job, job_rows, prompt_tokens in started:
            if not job.cancelled:
                job.done({"choices": [r.result for r in job_rows], "prompt_tokens": prompt_tokens,
                          "completion_tokens": sum(r.result["completion_tokens"] for r in job_rows)})

    def _mixable(self, rows: list[_Row]) -> list[list[_Row]]:
        """The rows that may share batches (every adapter peft can mix), then one list per adapter it cannot."""
        configs = self.model.causal_configs
        alone = {r.adapter for r in rows if configs[r.adapter].lora is not None and configs[r.adapter].lora.target_parameters}
        parts = [[r for r in rows if r.adapter not in alone]] + [[r for r in rows if r.adapter == a] for a in sorted(alone)]
        return [p for p in parts if p]

    def _batch(self, rows: list[_Row], decoding: Decoding) -> None:
        rows = [r for r in rows if not r.job.cancelled]
        if not rows:
            return
        enc = pad_batch([r.ids for r in rows], [r.values for r in rows], self.ntok.pad_token_id, padding_side="left")
        streams = [(b, r.stream) for b, r in enumerate(rows) if r.stream is not None]

        def callback(step: int, tokens: torch.Tensor, values: torch.Tensor) -> None:
            if all(r.job.cancelled for r in rows):
                raise _Abandoned
            if streams:
                toks, vals = tokens.tolist(), values.tolist()
                for b, s in streams:
                    if not rows[b].job.cancelled:
                        s.step(toks[b], vals[b])

        names = [r.adapter for r in rows]
        self.generate_calls += 1
        self.mixed_calls += len(set(names)) > 1
        self.generated_rows += len(rows)
        t0 = time.perf_counter()
        try:
            out = generate(self.model, enc, tokenizer=self.ntok, callback=callback, adapter_names=names,
                           max_new_tokens=max(r.max_tokens for r in rows), **decoding.generate_kwargs())
        except _Abandoned:
            return
        finally:
            self.generate_s += time.perf_counter() - t0
        configs = self.model.causal_configs
        for b, r in enumerate(rows):
            if r.job.cancelled:
                continue
            calibration = configs[r.adapter].value_calibration  # its intervals: its own adapter's calibration
            r.result = self._row_result(out.row(b), r, decoding.stop, r.job.spec.levels, calibration)
            if r.stream is not None:
                text, sent = r.result["text"], r.stream.sent_text
                if not text.startswith(sent):  # never seen (tests/test_serve.py); the final text is the answer
                    log.warning("streamed text %r is not a prefix of the row's text %r", sent[-40:], text[-40:])
                r.job.emit("row", r.index, {**r.result, "delta": text[len(sent):]})

    def _row_result(self, one, row: _Row, stops: tuple[str, ...], levels: tuple[float, ...],
                    calibration: dict | None) -> dict:
        """The row cut to its own max_tokens and before a stop string: index, text, finish_reason, values,
        completion_tokens."""
        n, k = int(one.lengths[0]), row.max_tokens
        numbers = one.numbers[0]
        if n > k:  # the batch ran longer for another row
            text = _RowText(self.ntok, row.ids, row.values).final(one.new_tokens[0, :k].tolist(),
                                                                  one.new_values[0, :k].tolist())
            numbers = [x for x in numbers if x["position"] < k]
            n, finished = k, False
        else:
            text, finished = one.texts[0], bool(one.finished[0])
        cut = first_stop(text, stops)
        if cut is not None:
            numbers = self._numbers_before(row, one, numbers, cut)
            text, finished = text[:cut], True
        return {"index": row.index, "text": text, "finish_reason": "stop" if finished else "length",
                "values": [_value(x, levels, calibration) for x in numbers], "completion_tokens": n}

    def _numbers_before(self, row: _Row, one, numbers: list[dict], cut: int) -> list[dict]:
        """The numbers whose text ends before character `cut` of the row's text."""
        keep = []
        for x in numbers:
            t = x["position"] + 1  # the text up to and with the number
            end = len(_RowText(self.ntok, row.ids, row.values).final(one.new_tokens[0, :t].tolist(),
                                                                     one.new_values[0, :t].tolist()))
            if end > cut:
                break
            keep.append(x)
        return keep

    # ------------------------------------------------------------------ prediction
    def _predict(self, job: Job) -> None:
        spec: PredictSpec = job.spec
        if job.cancelled:
            return
        try:
            self._activate(spec.adapter)
            prompts, field = self._prompts(spec, to_first_number=True)
            self._encode(prompts, field, 0)
            try:
                rows = predict_values(self.model, prompts, tokenizer=self.ntok, levels=spec.levels,
                                      batch_size=PREDICT_BATCH_SIZE)
            except ValueError as e:
                raise RequestError(400, str(e), param=field) from None
        except RequestError as e:
            job.fail(e)
            return
        job.done(rows)


def _value(number: dict, levels: tuple[float, ...], calibration: dict | None) -> dict:
    """A generated number with its intervals per level: calibrated by its adapter's map (as
    `CausalModel.value_interval`) and raw."""
    loc = torch.tensor(number["loc"], dtype=torch.float64)
    scale = torch.tensor(number["scale"], dtype=torch.float64)
    cal, raw = {}, {}
    for q in levels:
        for table, cal_map in ((cal, calibration), (raw, None)):
            lo, hi = interval(loc, scale, q, cal_map)
            table[level_name(q)] = (float(lo), float(hi))
    return value_entry(number, cal, raw)


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
