"""The Prometheus export of a process: typed metrics, the labels every sample carries, process metrics.

A service's `metric_values()` dict (Miles's names where Miles has one: `rollout/fully_async/queue_size`)
becomes one family per key, named by `prom_name` (`asyncrl_rollout_fully_async_queue_size`), with
the key as its HELP text. A key ending in `_total`, or listed in the service's `counters`, is a
counter (exposed as `<name>_total`); every other key is a gauge. Distributions are histograms
(`Buckets`), observed where they happen. Every sample, process_* included, carries `run`,
`service` and `instance`; docs/metrics.md lists every name.

A scraping Prometheus adds its own `instance` (the target's address) and, unless the scrape
config says `honor_labels: true`, renames ours to `exported_instance`; the dashboards select on `run`.
"""

from __future__ import annotations

import bisect
import re
import threading
from collections.abc import Callable, Iterable, Sequence
from itertools import accumulate

from prometheus_client import ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

_PROM_BAD = re.compile(r"[^a-zA-Z0-9_]")

LATENCY_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
"""Seconds, for asyncrl's own durations (a weight-sync pause, a training step, a buffer get):
milliseconds on the tiny CPU model to minutes on a large one."""


def prom_name(name: str) -> str:
    """Miles metric names carry '/' (rollout/fully_async/queue_size); Prometheus does not."""
    return "asyncrl_" + _PROM_BAD.sub("_", name).strip("_")


class Buckets:
    """A histogram's counts: cumulative per upper bound, sum and count. Thread-safe (the engine
    observes on its scheduler thread while /metrics reads on the event loop)."""

    def __init__(self, bounds: Sequence[float]):
        if list(bounds) != sorted(set(bounds)):
            raise ValueError(f"histogram bounds must be strictly increasing: {list(bounds)}")
        self.bounds = tuple(float(b) for b in bounds)
        self._counts = [0] * (len(self.bounds) + 1)  # the last one: above every bound (+Inf)
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        i = bisect.bisect_left(self.bounds, value)  # the first bound >= value: Prometheus's `le`
        with self._lock:
            self._counts[i] += 1
            self._sum += value

    def snapshot(self) -> tuple[list[tuple[str, float]], float, int]:
        """([(le, cumulative count)] ending with +Inf, sum, count)."""
        with self._lock:
            counts, total = list(self._counts), self._sum
        les = (*(repr(b) for b in self.bounds), "+Inf")
        return [(le, float(n)) for le, n in zip(les, accumulate(counts), strict=True)], total, sum(counts)


def histogram_family(name: str, doc: str, labels: dict[str, str], buckets: Buckets) -> HistogramMetricFamily:
    fam = HistogramMetricFamily(name, doc, labels=list(labels))
    counts, total, _ = buckets.snapshot()
    fam.add_metric(list(labels.values()), buckets=counts, sum_value=total)
    return fam


class LabelledProcessCollector:
    """prometheus_client's process_* metrics (CPU seconds, memory, open fds, start time) with our labels."""

    def __init__(self, labels: dict[str, str]):
        self._labels = labels
        self._process = ProcessCollector(registry=None)

    def collect(self) -> Iterable[Metric]:
        """The process families, every sample with our labels added (a sample's own labels win)."""
        for fam in self._process.collect():
            out = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            out.samples = [s._replace(labels={**self._labels, **s.labels}) for s in fam.samples]
            yield out


class ServiceCollector:
    """A service's metric_values() as typed families, plus its histograms, all labelled."""

    def __init__(
        self,
        values: Callable[[], dict[str, float]],
        labels: dict[str, str],
        counters: Iterable[str] = (),
        histograms: dict[str, tuple[str, Sequence[float]]] | None = None,
    ):
        """histograms: key -> (help, upper bounds); observe them with `observe(key, value)`."""
        self._values = values
        self._labels = labels
        self._counters = frozenset(counters)
        self.histograms = {key: (doc, Buckets(bounds)) for key, (doc, bounds) in (histograms or {}).items()}

    def observe(self, key: str, value: float) -> None:
        self.histograms[key][1].observe(value)

    def collect(self) -> Iterable[Metric]:
        names, values = list(self._labels), list(self._labels.values())
        for key, value in sorted(self._values().items()):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            kind = CounterMetricFamily if key.endswith("_total") or key in self._counters else GaugeMetricFamily
            fam = kind(prom_name(key), key, labels=names)
            fam.add_metric(values, float(value))
            yield fam
        for key, (doc, buckets) in sorted(self.histograms.items()):
            yield histogram_family(prom_name(key), doc, self._labels, buckets)
