"""A Prometheus histogram that takes a batch of values in one call, and a gauge of counts, on public API only.

A stream's inter-token gaps (hundreds per request) and the per-chunk proxy overhead are added to
their histograms all at once when the record is finished. prometheus_client's `Histogram` has
only `observe(value)` (a bucket scan and two locked adds per value), so `BatchHistogram` keeps
its own counts and hands them to the registry as a custom collector (`describe`/`collect`,
prometheus_client's documented interface for that), sample for sample what a `Histogram` of the
same name, labels and buckets that observed the same values one by one would expose: the same
bucket counts, the same `_count`, the very same float in `_sum` (added in the same order), and a
`_created` series unless PROMETHEUS_DISABLE_CREATED_SERIES says otherwise
(tests/core/test_fastpaths.py compares the two). `CountGauge` is the same for a `Gauge` of
counts moved by one (the requests in flight: two changes per request).
"""

from __future__ import annotations

import math
import os
import threading
import time
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.utils import floatToGoString

__all__ = ["BatchHistogram", "HistogramSeries", "CountGauge"]

#: a bound as prometheus_client writes it in `le` (its own function, typed here)
_go_float: Callable[[float], str] = floatToGoString
# as prometheus_client reads it for its own metrics (documented there)
_SORTED_BATCH = 16  # `observe_all` sorts a batch of at least this many values
_CREATED = os.environ.get("PROMETHEUS_DISABLE_CREATED_SERIES", "False").lower() != "true"


class HistogramSeries:
    """One labelled series of a `BatchHistogram`: `observe(value)` and `observe_all(values)`."""

    __slots__ = ("_bounds", "_counts", "_sum", "_created", "_lock")

    def __init__(self, bounds: list[float]) -> None:
        self._bounds = bounds
        self._counts = [0.0] * len(bounds)  # per bucket, not cumulative
        self._sum = 0.0
        self._created = time.time()
        self._lock = threading.Lock()  # records may be finished on a worker thread

    def observe(self, value: float) -> None:
        """`observe_all((value,))`, without the loop (most histograms take one value per record)."""
        with self._lock:
            self._sum += value
            if value <= math.inf:  # false only for NaN
                self._counts[bisect_left(self._bounds, value)] += 1.0

    def observe_all(self, values: Sequence[float]) -> None:
        """Add every value, in order: each counts in the first bucket whose bound is >= it
        (NaN in none, as `Histogram.observe`), and the sum grows by each in turn."""
        bounds, counts = self._bounds, self._counts
        with self._lock:
            s = self._sum
            for v in values:
                s += v
            if len(values) >= _SORTED_BATCH and s == s:  # (a NaN among the values makes the sum NaN)
                # a stream's gaps and chunk overheads, hundreds a record: sorted once (in C), then
                # each bucket takes the values up to its bound, one bisection per bucket instead
                # of one per value; the same counts (a value up to bound i is in a bucket <= i)
                ordered = sorted(values)
                below = 0
                for i, bound in enumerate(bounds):
                    upto = bisect_right(ordered, bound)
                    if upto != below:
                        counts[i] += upto - below
                        below = upto
            else:
                for v in values:
                    if v <= math.inf:  # false only for NaN
                        counts[bisect_left(bounds, v)] += 1.0
            self._sum = s

    def snapshot(self) -> tuple[list[float], float, float]:
        """(cumulative bucket counts, sum, creation time), taken together."""
        with self._lock:
            counts, total = list(self._counts), self._sum
        acc, cumulative = 0.0, []
        for c in counts:
            acc += c
            cumulative.append(acc)
        return cumulative, total, self._created


class _Family:
    """What the custom collectors here share: the family's name, help and label names, and the
    key of one series (its label values, checked against the names)."""

    def __init__(self, name: str, documentation: str, labelnames: Iterable[str]) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)

    def _key(self, values: tuple[str, ...]) -> tuple[str, ...]:
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name} takes {len(self.labelnames)} label values, got {len(values)}")
        return tuple(str(v) for v in values)


class BatchHistogram(_Family):
    """A histogram family registered on `registry` as a custom collector; `labels(*values)`
    returns (and keeps) the series for those label values."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Iterable[str],
        *,
        buckets: Sequence[float],
        registry: CollectorRegistry,
    ) -> None:
        bounds = [float(b) for b in buckets]
        if bounds != sorted(bounds) or not bounds:
            raise ValueError("buckets must be given in increasing order")
        if bounds[-1] != math.inf:
            bounds.append(math.inf)
        _Family.__init__(self, name, documentation, labelnames)
        self._bounds = bounds
        self._les = [_go_float(b) for b in bounds]
        self._series: dict[tuple[str, ...], HistogramSeries] = {}
        self._lock = threading.Lock()
        registry.register(self)

    def labels(self, *values: str) -> HistogramSeries:
        key = self._key(values)
        series = self._series.get(key)
        if series is None:
            with self._lock:
                series = self._series.setdefault(key, HistogramSeries(self._bounds))
        return series

    def describe(self) -> list[Metric]:
        return [Metric(self.name, self.documentation, "histogram")]

    def collect(self) -> list[Metric]:
        metric = Metric(self.name, self.documentation, "histogram")
        with self._lock:
            series = list(self._series.items())
        for key, one in series:
            labels = dict(zip(self.labelnames, key))
            cumulative, total, created = one.snapshot()
            for le, count in zip(self._les, cumulative):
                metric.add_sample(self.name + "_bucket", {**labels, "le": le}, count)
            metric.add_sample(self.name + "_count", labels, cumulative[-1])
            if self._bounds[0] >= 0:  # (as prometheus_client: no sum when a bucket is negative)
                metric.add_sample(self.name + "_sum", labels, total)
            if _CREATED:
                metric.add_sample(self.name + "_created", labels, created)
        return [metric]


class _Count:
    """One labelled series of a `CountGauge`."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0

    def inc(self) -> None:
        self.value += 1

    def dec(self) -> None:
        self.value -= 1


class CountGauge(_Family):
    """A gauge family of whole counts moved by one (the requests in flight), registered on
    `registry` as a custom collector: sample for sample what a prometheus_client `Gauge` of the
    same name and labels would expose (a series from its first `labels` call on, in that order,
    its value a float). Each `inc`/`dec` is one addition, where a `Gauge`'s takes a lock and checks
    that it may be changed (`ProxyMetrics.request_started` and `request_ended` of one request:
    14.1 k -> 3.8 k instructions, callgrind). Changed on the event loop only."""

    def __init__(
        self, name: str, documentation: str, labelnames: Iterable[str], *, registry: CollectorRegistry
    ) -> None:
        _Family.__init__(self, name, documentation, labelnames)
        self._series: dict[tuple[str, ...], _Count] = {}
        registry.register(self)

    def labels(self, *values: str) -> _Count:
        key = self._key(values)
        series = self._series.get(key)
        if series is None:
            series = self._series[key] = _Count()
        return series

    def describe(self) -> list[Metric]:
        return [Metric(self.name, self.documentation, "gauge")]

    def collect(self) -> list[Metric]:
        metric = Metric(self.name, self.documentation, "gauge")
        for key, one in list(self._series.items()):
            metric.add_sample(self.name, dict(zip(self.labelnames, key)), float(one.value))
        return [metric]


class Observes(Protocol):
    """A histogram's child (`HistogramSeries`, or a prometheus_client `Histogram`'s)."""

    def observe(self, amount: float, /) -> None: ...


def observe_all(child: Observes, values: Sequence[float]) -> None:
    """`child.observe(v)` for every value, in order: in one call where the child is a
    `HistogramSeries`, one by one for any other (a prometheus_client `Histogram`'s child)."""
    if isinstance(child, HistogramSeries):
        child.observe_all(values)
    else:
        for v in values:
            child.observe(v)
