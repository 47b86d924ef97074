"""Prometheus metrics (the contract in docs/METRICS.md), created on a registry passed in.

Everything per request is observed once, when its record is finished, from cached label
children; the forwarding loop does no Prometheus work. Label values stay bounded: the
model label falls back to `other` past `max_model_labels` distinct names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from mlxproxy import __version__
from mlxproxy.core.detect import ANOMALY_KINDS
from mlxproxy.core.openai import GENERATION_ENDPOINTS
from mlxproxy.core.prefix import CAUSES
from mlxproxy.core.record import OK_OUTCOMES, Record
from mlxproxy.proxy.histograms import BatchHistogram, CountGauge, observe_all

__all__ = ["METRICS", "Metric", "ProxyMetrics", "concurrency_bucket", "observe_all"]

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1200, 1800, 3600)
GAP_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2, 5, 10, 30, 60)
TPS_BUCKETS = (1, 2, 5, 10, 15, 20, 30, 40, 50, 60, 80, 100, 150, 200, 300, 500, 1000, 2000, 5000, 10000, 50000)
PREFILL_BUCKETS = (10, 25, 50, 100, 250, 500, 1000, 2000, 4000, 8000, 16000, 32000, 64000, 128000)
OVERHEAD_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5)
LENGTH_BUCKETS = (16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


def concurrency_bucket(n: int) -> str:
    """The bounded `concurrency` label: 1, 2, 3-4, 5-8, 9-16, 17+."""
    if n <= 1:
        return "1"
    if n == 2:
        return "2"
    if n <= 4:
        return "3-4"
    if n <= 8:
        return "5-8"
    if n <= 16:
        return "9-16"
    return "17+"


UP_MODEL = ("upstream", "model")


@dataclass(frozen=True, slots=True)
class Metric:
    """One metric family, declared once: its key on `ProxyMetrics.families`, its type, name
    (the exposition adds `_total` to counters), help text, unit, labels and buckets."""

    key: str
    kind: type[Counter] | type[Gauge] | type[Histogram] | type[BatchHistogram] | type[CountGauge]
    name: str
    help: str
    unit: str = ""
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()

    def create(self, registry: CollectorRegistry) -> Any:
        """The family on `registry` (a histogram with its buckets)."""
        make: Any = self.kind
        if self.buckets:
            return make(self.name, self.help, self.labels, buckets=self.buckets, registry=registry)
        return make(self.name, self.help, self.labels, registry=registry)


C, G, B = Counter, Gauge, BatchHistogram
#: every metric the proxy exports (docs/METRICS.md lists the same; tests/proxy/test_metrics_table.py
#: keeps the two in step). B: a histogram observed when a record is finished (`BatchHistogram`: the
#: exposition of prometheus_client's `Histogram`, with one lock and a bisection per value instead of
#: a lock per bucket scanned and two more, and a batch of values per call). The requests in flight
#: are a `CountGauge` (a `Gauge`'s exposition, an addition per change: two per request)
METRICS: tuple[Metric, ...] = (
    Metric("requests", C, "mlxproxy_requests", "Finished requests by outcome.", "requests",
           (*UP_MODEL, "endpoint", "stream", "code", "outcome")),
    Metric("in_flight", CountGauge, "mlxproxy_requests_in_flight", "Requests in flight.", "requests", UP_MODEL),
    Metric("duration", B, "mlxproxy_request_duration_seconds",
           "Whole request: client request in to response body fully sent.", "seconds",
           (*UP_MODEL, "endpoint", "stream"), LATENCY_BUCKETS),
    Metric("ttfb", B, "mlxproxy_time_to_first_byte_seconds",
           "Time to the first response body byte (may be a keep-alive comment).", "seconds",
           (*UP_MODEL, "endpoint"), LATENCY_BUCKETS),
    Metric("ttft", B, "mlxproxy_time_to_first_token_seconds",
           "Time to the first generated token (reasoning included).", "seconds", (*UP_MODEL, "endpoint"),
           LATENCY_BUCKETS),
    Metric("ttfc", B, "mlxproxy_time_to_first_content_seconds", "Time to the first answer or tool-call token.",
           "seconds", (*UP_MODEL, "endpoint"), LATENCY_BUCKETS),
    Metric("itl", B, "mlxproxy_inter_token_latency_seconds", "Gaps between consecutive generated events.",
           "seconds", UP_MODEL, GAP_BUCKETS),
    Metric("tpot", B, "mlxproxy_time_per_output_token_seconds",
           "Per request: (last token - first token) / (tokens - 1).", "seconds", UP_MODEL, GAP_BUCKETS),
    Metric("tps", B, "mlxproxy_output_tokens_per_second",
           "Per request output tokens/s; kind=wall|decode; concurrency at start.", "tokens/s",
           (*UP_MODEL, "kind", "concurrency"), TPS_BUCKETS),
    Metric("prefill", B, "mlxproxy_prefill_tokens_per_second", "(prompt - cached tokens) / TTFT.", "tokens/s",
           UP_MODEL, PREFILL_BUCKETS),
    Metric("prompt_len", B, "mlxproxy_prompt_length_tokens", "Prompt tokens per request (reported by the server).",
           "tokens", UP_MODEL, LENGTH_BUCKETS),
    Metric("gen_len", B, "mlxproxy_generation_length_tokens", "Output tokens per request (reported, else counted).",
           "tokens", UP_MODEL, LENGTH_BUCKETS),
    Metric("tokens", C, "mlxproxy_tokens", "Tokens by type and by who counted them.", "tokens",
           (*UP_MODEL, "type", "source")),
    Metric("usage_reports", C, "mlxproxy_usage_reports", "Streams/responses with and without a usage report.",
           "responses", (*UP_MODEL, "present")),
    Metric("anomalies", C, "mlxproxy_anomalies", "Truth-check anomalies by kind.", "requests", (*UP_MODEL, "kind")),
    Metric("tool_calls", C, "mlxproxy_tool_calls", "Structured tool calls on requests that offered tools, by outcome.",
           "calls", (*UP_MODEL, "outcome")),
    Metric("prompt_cache", C, "mlxproxy_prompt_tokens",
           "Prompt tokens the server served from its cache (reused) or prefilled (recomputed), when it reports "
           "cached_tokens.", "tokens", (*UP_MODEL, "cache")),
    Metric("prefill_wasted", C, "mlxproxy_prefill_wasted_seconds", "TTFT lost to prefix_cache_miss (estimate).",
           "seconds", UP_MODEL),
    Metric("reprefill_lost", C, "mlxproxy_reprefill_lost_seconds",
           "Prefill seconds conversations lost to re-prefills, by cause (reprefill_lost_s; estimate).", "seconds",
           (*UP_MODEL, "cause")),
    Metric("overhead", B, "mlxproxy_proxy_overhead_seconds", "Time the proxy itself adds, by phase.", "seconds",
           ("phase",), OVERHEAD_BUCKETS),
    Metric("observer_errors", C, "mlxproxy_observer_errors",
           "Observers that raised on a record (forwarding was not affected).", "errors", ("observer",)),
    Metric("capture_dropped", C, "mlxproxy_capture_dropped",
           "Records not written to the capture because its queue was full.", "records"),
    Metric("capture_errors", C, "mlxproxy_capture_errors",
           "Capture lines that could not be written (disk full, read-only path).", "lines"),
    Metric("build_info", G, "mlxproxy_build_info", "Always 1; the version label says which build.", "",
           ("version",)),
)  # fmt: skip


class ProxyMetrics:
    """The proxy's metric families (`METRICS`, by key in `families`) and the observer that fills
    them from records."""

    name = "metrics"

    def __init__(self, registry: CollectorRegistry, *, max_model_labels: int = 20) -> None:
        self.registry = registry
        self.max_model_labels = max_model_labels
        self._models: set[str] = set()
        self._children: dict[tuple[Any, ...], Any] = {}
        self._by_labels: dict[tuple[str, str, str, str], _Series] = {}
        self._in_flight: dict[tuple[str, str], Any] = {}  # (upstream, model) -> its in-flight child
        self.families: dict[str, Any] = {m.key: m.create(registry) for m in METRICS}
        f = self.families
        self.observer_errors, self.capture_dropped, self.capture_errors = (
            f["observer_errors"], f["capture_dropped"], f["capture_errors"],
        )  # fmt: skip
        f["build_info"].labels(__version__).set(1)
        self._overhead_request = f["overhead"].labels("request")
        self._overhead_chunk = f["overhead"].labels("chunk")

    def model_label(self, model: str | None) -> str:
        """A bounded label value for a request's model name."""
        if not model:
            return "unknown"
        if model in self._models:
            return model
        if len(self._models) < self.max_model_labels:
            self._models.add(model)
            return model
        return "other"

    def _child(self, metric: Any, *labels: str) -> Any:
        key = (id(metric), *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def request_started(self, upstream: str, model: str) -> None:
        child = self._in_flight.get((upstream, model))
        if child is None:  # a new upstream/model pair: start its anomaly counters at 0, so that
            f = self.families
            for kind in ANOMALY_KINDS:  # rate()/increase() see the first anomaly of each kind
                self._child(f["anomalies"], upstream, model, kind)
            for cache in ("reused", "recomputed"):
                self._child(f["prompt_cache"], upstream, model, cache)
            self._child(f["prefill_wasted"], upstream, model)
            for cause in CAUSES:
                self._child(f["reprefill_lost"], upstream, model, cause)
            child = self._in_flight[(upstream, model)] = self._child(f["in_flight"], upstream, model)
        child.inc()

    def request_ended(self, upstream: str, model: str) -> None:
        child = self._in_flight.get((upstream, model))
        if child is None:  # (never started here: as a gauge would, it goes below 0)
            child = self._child(self.families["in_flight"], upstream, model)
        child.dec()

    def observe_overhead(self, request_s: float | None, chunk_s: list[float]) -> None:
        if request_s is not None:
            self._overhead_request.observe(request_s)
        observe_all(self._overhead_chunk, chunk_s)

    def close(self) -> None:
        pass

    def _series(self, up: str, model: str, ep: str, stream: str) -> _Series:
        """The children one request's record feeds, looked up once per label set (and then kept)."""
        key = (up, model, ep, stream)
        series = self._by_labels.get(key)
        if series is None:
            series = self._by_labels[key] = _Series(self, up, model, ep, stream)
        return series

    def on_record(self, r: Record, exchange: object = None) -> None:
        up, model = r.upstream, self.model_label(r.model)
        ep = r.endpoint
        s = self._series(up, model, ep, "true" if r.stream else "false")
        outcome_key = (r.status, r.outcome)
        requests = s.requests.get(outcome_key)
        if requests is None:
            status = str(r.status) if r.status is not None else "none"
            requests = s.requests[outcome_key] = s.child("requests", ep, s.stream, status, r.outcome)
        requests.inc()
        if r.duration_s is not None:
            (s.duration or s.make("duration")).observe(r.duration_s)
        if r.anomalies or r.prefill_wasted_s or r.reprefill_cause is not None or r.tool_calls:
            self._rare(r, s)
        if r.prompt_tokens is not None and r.cached_tokens is not None:
            reused = min(r.cached_tokens, r.prompt_tokens)
            (s.reused or s.make("reused")).inc(reused)
            (s.recomputed or s.make("recomputed")).inc(r.prompt_tokens - reused)
        if ep not in GENERATION_ENDPOINTS:
            return
        if r.ttfb_s is not None:
            (s.ttfb or s.make("ttfb")).observe(r.ttfb_s)
        if r.status is not None and r.status < 400:
            if r.usage_reports:
                (s.usage_present or s.make("usage_present")).inc()
            else:
                (s.usage_absent or s.make("usage_absent")).inc()
        tokens = s.tokens
        for typ, source, value in (
            ("prompt", "reported", r.prompt_tokens),
            ("cached_prompt", "reported", r.cached_tokens),
            ("completion", "reported", r.completion_tokens_reported),
            ("reasoning", "reported", r.reasoning_tokens_reported),
            ("completion", "counted", r.completion_tokens_counted),
            ("reasoning", "counted", r.reasoning_tokens_counted),
        ):
            if value:
                child = tokens.get((typ, source))
                if child is None:
                    child = tokens[(typ, source)] = s.child("tokens", typ, source)
                child.inc(value)
        if r.outcome not in OK_OUTCOMES:  # failed requests never enter latency statistics
            return
        if r.ttft_s is not None:
            (s.ttft or s.make("ttft")).observe(r.ttft_s)
        if r.ttfc_s is not None:
            (s.ttfc or s.make("ttfc")).observe(r.ttfc_s)
        if r.event_offsets_s:
            observe_all(s.itl or s.make("itl"), r.event_gaps_s())
        if r.tpot_s is not None:
            (s.tpot or s.make("tpot")).observe(r.tpot_s)
        if r.wall_tps is not None or r.decode_tps is not None:
            conc = concurrency_bucket(r.concurrency)
            if r.wall_tps is not None:
                s.tps("wall", conc).observe(r.wall_tps)
            if r.decode_tps is not None:
                s.tps("decode", conc).observe(r.decode_tps)
        if r.prefill_tps is not None and r.prefill_tps > 0:  # a rate is never negative (records of older versions)
            (s.prefill or s.make("prefill")).observe(r.prefill_tps)
        if r.prompt_tokens is not None:
            (s.prompt_len or s.make("prompt_len")).observe(r.prompt_tokens)
        n_out = r.n_out
        if n_out is not None:
            (s.gen_len or s.make("gen_len")).observe(n_out)

    def _rare(self, r: Record, s: _Series) -> None:
        """What most records have none of: anomalies, lost prefill, tool calls."""
        f, c, up, model = self.families, self._child, s.up, s.model
        for kind in r.anomalies:
            c(f["anomalies"], up, model, kind).inc()
        if r.prefill_wasted_s:
            c(f["prefill_wasted"], up, model).inc(r.prefill_wasted_s)
        if r.reprefill_cause is not None and r.reprefill_lost_s:
            c(f["reprefill_lost"], up, model, r.reprefill_cause).inc(r.reprefill_lost_s)
        if r.tool_calls_valid is not None and r.tool_calls:
            if r.tool_calls_valid:
                c(f["tool_calls"], up, model, "valid").inc(r.tool_calls_valid)
            if r.tool_calls > r.tool_calls_valid:
                c(f["tool_calls"], up, model, "invalid").inc(r.tool_calls - r.tool_calls_valid)


#: `_Series` attribute -> (family key, label values after upstream and model: "ep" and "stream" are the
#: series' own, any other is itself)
_SERIES_CHILDREN: dict[str, tuple[str, tuple[str, ...]]] = {
    "duration": ("duration", ("ep", "stream")),
    "ttfb": ("ttfb", ("ep",)),
    "ttft": ("ttft", ("ep",)),
    "ttfc": ("ttfc", ("ep",)),
    "itl": ("itl", ()),
    "tpot": ("tpot", ()),
    "prefill": ("prefill", ()),
    "prompt_len": ("prompt_len", ()),
    "gen_len": ("gen_len", ()),
    "usage_present": ("usage_reports", ("true",)),
    "usage_absent": ("usage_reports", ("false",)),
    "reused": ("prompt_cache", ("reused",)),
    "recomputed": ("prompt_cache", ("recomputed",)),
}


class _Series:
    """The label children of one (upstream, model, endpoint, stream): what `on_record` feeds,
    found once (`ProxyMetrics._child`, so a child is the same object whichever way it was reached)
    instead of a tuple key built and looked up per metric and request."""

    __slots__ = (
        "owner", "up", "model", "ep", "stream", "requests", "tokens", "_tps", "duration", "ttfb", "ttft", "ttfc",
        "itl", "tpot", "prefill", "prompt_len", "gen_len", "usage_present", "usage_absent", "reused", "recomputed",
    )  # fmt: skip

    def __init__(self, owner: ProxyMetrics, up: str, model: str, ep: str, stream: str) -> None:
        self.owner, self.up, self.model, self.ep, self.stream = owner, up, model, ep, stream
        self.requests: dict[tuple[int | None, str], Any] = {}
        self.tokens: dict[tuple[str, str], Any] = {}
        self._tps: dict[tuple[str, str], Any] = {}
        # each child made when first observed (`make`): a series nobody observed is not exported
        self.duration = self.ttfb = self.ttft = self.ttfc = self.itl = self.tpot = self.prefill = None
        self.prompt_len = self.gen_len = self.usage_present = self.usage_absent = None
        self.reused = self.recomputed = None

    def make(self, attr: str) -> Any:
        """The child kept in `attr` (None until now), made."""
        family, labels = _SERIES_CHILDREN[attr]
        child = self.child(family, *(getattr(self, x) if x in ("ep", "stream") else x for x in labels))
        setattr(self, attr, child)
        return child

    def child(self, key: str, *labels: str) -> Any:
        """The child of family `key` for this series' upstream and model and `labels`."""
        owner = self.owner
        return owner._child(owner.families[key], self.up, self.model, *labels)

    def tps(self, kind: str, conc: str) -> Any:
        child = self._tps.get((kind, conc))
        if child is None:
            child = self._tps[(kind, conc)] = self.child("tps", kind, conc)
        return child
