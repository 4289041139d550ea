"""`GET /metrics`: the server's figures in Prometheus' text format (prometheus-client), under vLLM's names with the
prefix ``causal_adapter:`` (a dashboard made for vLLM reads them with the prefix replaced). One registry per app, so
two servers in one process never share a figure.

    causal_adapter:num_requests_waiting          gauge      requests accepted, none of their rows in the batch yet
    causal_adapter:num_requests_running          gauge      requests with rows in the batch
    causal_adapter:num_rows_running              gauge      rows in the batch (what one backbone pass holds)
    causal_adapter:time_to_first_token_seconds   histogram  from a request's arrival to its first token
    causal_adapter:inter_token_latency_seconds   histogram  between two tokens of a row
    causal_adapter:generation_tokens_total       counter    tokens generated
    causal_adapter:prompt_tokens_total           counter    prompt tokens of the generation requests
    causal_adapter:prefix_cache_hits_total       counter    prompt tokens read from the prefix cache (not recomputed)
    causal_adapter:request_success_total        counter    generation requests by finished_reason (stop, length,
                                                            abort: the client went away)
    causal_adapter:http_requests_total           counter    HTTP requests by route and status code
"""
from __future__ import annotations

from typing import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

PREFIX = "causal_adapter:"
# seconds: vLLM's buckets for TTFT and ITL
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)


class Metrics:
    """The figures of one server; `watch` gives the gauges their readers (read at each scrape)."""

    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.waiting = Gauge(PREFIX + "num_requests_waiting", "Requests accepted whose rows have not joined the "
                             "batch yet (the queue depth).", registry=r)
        self.running = Gauge(PREFIX + "num_requests_running", "Requests with rows in the running batch.", registry=r)
        self.rows = Gauge(PREFIX + "num_rows_running", "Rows in the running batch.", registry=r)
        self._ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token in seconds (from the "
                               "request's arrival).", buckets=TTFT_BUCKETS, registry=r)
        self._itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between two tokens of a row in seconds.",
                              buckets=ITL_BUCKETS, registry=r)
        self._tokens = Counter(PREFIX + "generation_tokens", "Generated tokens.", registry=r)
        self._prompt = Counter(PREFIX + "prompt_tokens", "Prompt tokens of generation requests.", registry=r)
        self._hits = Counter(PREFIX + "prefix_cache_hits", "Prompt tokens read from the prefix cache.", registry=r)
        self._success = Counter(PREFIX + "request_success", "Finished generation requests by finish reason.",
                                ["finished_reason"], registry=r)
        self._http = Counter(PREFIX + "http_requests", "HTTP requests by route and status code.",
                             ["route", "status"], registry=r)

    def watch(self, waiting: Callable[[], int], running: Callable[[], int], rows: Callable[[], int],
              prefix_hits: Callable[[], int]) -> None:
        self.waiting.set_function(waiting)
        self.running.set_function(running)
        self.rows.set_function(rows)
        self._hit_reader, self._hits_seen = prefix_hits, 0

    def ttft(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def itl(self, seconds: float) -> None:
        self._itl.observe(seconds)

    def tokens(self, n: int) -> None:
        if n:
            self._tokens.inc(n)

    def prompt_tokens(self, n: int) -> None:
        self._prompt.inc(n)

    def finished(self, reason: str) -> None:
        self._success.labels(finished_reason=reason).inc()

    def http(self, route: str, status: int) -> None:
        self._http.labels(route=route, status=str(status)).inc()

    def render(self) -> tuple[bytes, str]:
        reader = getattr(self, "_hit_reader", None)
        if reader is not None:  # the prefix cache counts its hits; the counter follows it
            now = reader()
            if now > self._hits_seen:
                self._hits.inc(now - self._hits_seen)
                self._hits_seen = now
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
