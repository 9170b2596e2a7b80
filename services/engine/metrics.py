"""The built-in engine's /metrics: SGLang's names and types (python/sglang/srt/metrics/collector.py),
so a dashboard built for SGLang servers reads the built-in engine too.

Gauges and counters come from the scheduler's snapshot and stats at scrape time; the three
request latency histograms (`RequestLatency`) are observed by the scheduler as each request
finishes, with SGLang's default buckets. Every sample carries SGLang's labels (model_name,
engine_type, tp_rank, pp_rank) and asyncrl's (run, service="engine", instance), and the process_*
metrics come with them.
"""

from __future__ import annotations

import collections
import socket
import time
import weakref
from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from services.common.promexport import Buckets, LabelledProcessCollector, histogram_family
from services.engine.request import Request

TTFT_BUCKETS_S = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
E2E_BUCKETS_S = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600, 1200, 1800, 2400)
QUEUE_BUCKETS_S = (0.0, 0.1, 0.2, 0.5, 1, 2, 3, 4, 5, 10, 15, 20, 30, 40, 50, 60, 70, 80, 90, 100, 200, 300, 400,
                   500, 600, 700, 800, 900, 1000, 1200, 1400, 1600, 1800, 2000, 2500, 3000)  # fmt: skip
"""SGLang's default buckets (seconds) for time to first token, end-to-end latency and queue time."""

HISTOGRAMS = {
    "time_to_first_token_seconds": "Histogram of time to first token in seconds.",
    "e2e_request_latency_seconds": "Histogram of End-to-end request latency in seconds",
    "queue_time_seconds": "Histogram of queueing time in seconds.",
}
GAUGES = {
    "num_running_reqs": "The number of running requests.",
    "num_queue_reqs": "The number of requests in the waiting queue.",
    "num_paused_reqs": "The number of paused requests by async weight sync.",
    "num_used_tokens": "The number of used tokens.",
    "max_total_num_tokens": "Maximum total number of tokens in the KV cache pool.",
    "token_usage": "The token usage.",
    "cache_hit_rate": "The prefix cache hit rate.",
    "gen_throughput": "The generation throughput (token/s).",
    "weight_load_duration_seconds": "Seconds the last weight update held the model (generation stopped).",
}
COUNTERS = {
    "prompt_tokens_total": "Number of prefill tokens processed.",
    "generation_tokens_total": "Number of generation tokens processed.",
    "cached_tokens_total": "Number of cached prompt tokens.",
    "num_requests_total": "Number of requests processed.",
    "num_aborted_requests_total": "Number of requests aborted.",
    "num_retracted_requests_total": "Total number of retracted requests.",
}


class RequestLatency:
    """SGLang's request latency histograms, observed once per finished request (the scheduler
    thread). Times are a request's wall-clock stamps: created (received), admitted (first given a
    KV slot: its queue time ends), first token, finished."""

    def __init__(self) -> None:
        self.time_to_first_token_seconds = Buckets(TTFT_BUCKETS_S)
        self.e2e_request_latency_seconds = Buckets(E2E_BUCKETS_S)
        self.queue_time_seconds = Buckets(QUEUE_BUCKETS_S)

    def observe(self, req: Request) -> None:
        """A request that never reached a slot (aborted while waiting, max_new_tokens 0) counts in
        end-to-end latency only, one that produced no token not in time to first token."""
        self.e2e_request_latency_seconds.observe(max(0.0, req.finished_at - req.created_at))
        if req.admitted_at:
            self.queue_time_seconds.observe(max(0.0, req.admitted_at - req.created_at))
        if req.first_token_at:
            self.time_to_first_token_seconds.observe(max(0.0, req.first_token_at - req.created_at))


class EngineMetrics:
    """One engine's registry: its sglang:* families and process_*, every sample labelled.
    `server`: an EngineServer (its scheduler, served_model_name and port)."""

    def __init__(self, server: Any, run: str, instance: str):
        self.server = server
        asyncrl = {"run": run, "service": "engine", "instance": instance}
        self.labels = {"model_name": server.served_model_name, "engine_type": "unified", "tp_rank": "0",
                       "pp_rank": "0", **asyncrl}  # fmt: skip
        self.registry = CollectorRegistry()
        self.registry.register(self)
        self.registry.register(LabelledProcessCollector(asyncrl))

    def collect(self) -> Iterable[Metric]:
        sched = self.server.scheduler
        snap, st = sched.snapshot(), sched.stats
        values = {**snap, "cache_hit_rate": st.cache_hit_rate, "gen_throughput": st.gen_throughput,
                  "weight_load_duration_seconds": st.weight_load_duration_s,
                  **{name: getattr(st, name) for name in COUNTERS}}  # fmt: skip
        names, label_values = list(self.labels), list(self.labels.values())
        for family, docs in ((GaugeMetricFamily, GAUGES), (CounterMetricFamily, COUNTERS)):
            for name, doc in docs.items():
                fam = family(f"sglang:{name}", doc, labels=names)
                fam.add_metric(label_values, float(values[name]))
                yield fam
        for name, doc in HISTOGRAMS.items():
            yield histogram_family(f"sglang:{name}", doc, self.labels, getattr(st.latency, name))

    def text(self) -> str:
        return generate_latest(self.registry).decode()


_BY_SERVER: weakref.WeakKeyDictionary[Any, EngineMetrics] = weakref.WeakKeyDictionary()


def engine_metrics(server: Any, run: str | None = None, instance: str | None = None) -> EngineMetrics:
    """The server's metrics, made on the first call: `run` (default "") and `instance` (default
    <host name>:<port>) label every sample; the engine's main passes --run-id and --instance-id."""
    if (m := _BY_SERVER.get(server)) is None:
        m = _BY_SERVER[server] = EngineMetrics(server, run or "", instance or f"{socket.gethostname()}:{server.port}")
    return m


class EngineStats:
    """The engine's counters since it started, and its generation throughput over the last 10 s."""

    def __init__(self) -> None:
        for name in COUNTERS:  # prompt_tokens_total, ..., num_retracted_requests_total: the table names them all
            setattr(self, name, 0)
        self.weight_load_duration_s = 0.0
        """The last weight update's time under the model lock (generation stopped)."""
        self.weight_stage_duration_s = 0.0
        """The last staging's time (generation going on)."""
        self.num_staged_swaps_total = 0
        self.num_forgotten_pauses_ended_total = 0
        self.latency = RequestLatency()
        """SGLang's time-to-first-token, end-to-end and queue time histograms, per finished request."""
        self._recent: collections.deque[tuple[float, int]] = collections.deque()

    def record_generated(self, n: int) -> None:
        now = time.monotonic()
        self.generation_tokens_total += n
        self._recent.append((now, n))
        while self._recent and now - self._recent[0][0] > 10.0:
            self._recent.popleft()

    @property
    def gen_throughput(self) -> float:
        if len(self._recent) < 2:
            return 0.0
        span = self._recent[-1][0] - self._recent[0][0]
        return sum(n for _, n in self._recent) / span if span > 0 else 0.0

    @property
    def cache_hit_rate(self) -> float:
        return self.cached_tokens_total / self.prompt_tokens_total if self.prompt_tokens_total else 0.0
