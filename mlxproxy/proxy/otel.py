"""OpenTelemetry export (the optional `[otel]` extra): per finished record, OTLP metrics and one
span named and attributed by the OpenTelemetry GenAI semantic conventions (the names, and the
versions they follow: docs/METRICS.md, "OpenTelemetry export"). `semconv` picks the metric names:
`current` (the default: semantic-conventions-genai v0.1.0, `gen_ai.client.inference.*`), `old`
(semantic-conventions v1.41.0, what mlxproxy exported before: `gen_ai.client.operation.duration`,
`gen_ai.server.time_to_first_token`, `gen_ai.client.token.usage`, ...) or `dup` (both, while
dashboards move over, as OpenTelemetry's own `OTEL_SEMCONV_STABILITY_OPT_IN=<domain>/dup` does).

Importing this module imports the OpenTelemetry SDK and its OTLP/HTTP exporter: `mlxproxy serve
--otlp-endpoint` imports it only when asked, and says which pip command installs the extra when
it is missing.
The observer runs where the other observers run, after a request's last byte was forwarded;
recording is in memory, the export runs on the SDK's own threads (a batch of spans, a periodic
metric export), never on the event loop.

No prompt or response text, and no error message (it may quote the prompt), is ever put in a
span or an attribute.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.metrics import Counter, Histogram, Meter, MeterProvider
from opentelemetry.sdk.metrics import AlwaysOffExemplarFilter
from opentelemetry.sdk.metrics import MeterProvider as SdkMeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider as SdkTracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import SpanKind, Status, StatusCode, TracerProvider
from opentelemetry.util.types import AttributeValue

import mlxproxy
from mlxproxy.capture import Exchange
from mlxproxy.core.openai import Endpoint
from mlxproxy.core.record import OK_OUTCOMES, Record

__all__ = [
    "OPERATION_NAMES",
    "PROVIDER_NAMES",
    "SEMCONV",
    "OtelObserver",
    "Server",
    "error_type",
    "otlp_providers",
    "signal_url",
]

#: `gen_ai.operation.name` per endpoint; the endpoints not listed (models, other) are no GenAI
#: operation and yield neither metrics nor a span
OPERATION_NAMES: Mapping[Endpoint, str] = {
    "chat_completions": "chat",
    "completions": "text_completion",
    "messages": "chat",
    "responses": "chat",
    "ollama_chat": "chat",
    "ollama_generate": "text_completion",
    "lmstudio_chat": "chat",
    "embeddings": "embeddings",
}

#: `gen_ai.provider.name`: the API's flavour (the conventions' "telemetry format flavor"), not who
#: made the model; the native APIs have no well-known value, so their own names (a custom value,
#: which the conventions allow); every other endpoint is OpenAI's flavour
PROVIDER_NAMES: Mapping[Endpoint, str] = {
    "messages": "anthropic",
    "ollama_chat": "ollama",
    "ollama_generate": "ollama",
    "lmstudio_chat": "lm_studio",
}

#: the metric-name sets `serve --otel-semconv` chooses from (the first is the default)
SEMCONV = ("current", "old", "dup")

#: `gen_ai.token.modality` of the usage counters: the servers' usage does not break input down by
#: modality (a prompt may hold images), so input is `unknown`, as the conventions say for that case;
#: what these servers generate is text
INPUT_MODALITY = "unknown"
OUTPUT_MODALITY = "text"

#: the bucket boundaries the conventions advise (seconds; tokens); the current client inference
#: metrics (duration, time to first chunk, time per output chunk) all advise DURATION_BUCKETS
DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864)


@dataclass(frozen=True)
class Server:
    """An upstream's `server.address` and `server.port`."""

    address: str
    port: int


def server_of(url: str) -> Server:
    """The host and port of an upstream URL (the scheme's default port when it names none)."""
    parts = urlsplit(url)
    port = parts.port if parts.port is not None else (443 if parts.scheme == "https" else 80)
    return Server(parts.hostname or "", port)


def error_type(record: Record) -> str | None:
    """`error.type` of a failed request: the upstream's HTTP status for an HTTP error (`500`), else
    the outcome (`upstream_timeout`, `context_limit`, ...); None when the request succeeded."""
    if record.outcome in OK_OUTCOMES:
        return None
    if record.outcome == "http_error" and record.status is not None:
        return str(record.status)
    return record.outcome


def _ns(epoch_s: float) -> int:
    return int(round(epoch_s * 1e9))


class OtelObserver:
    """Records each finished record's GenAI metrics and span on the providers it is given.

    `upstreams` maps an upstream's name to its URL (for `server.address`/`server.port`).
    `close()` shuts down the providers it owns (`own_providers`: those `otlp_providers` built),
    which flushes what is queued; providers passed in by a caller are the caller's to close."""

    name = "otel"

    def __init__(
        self,
        upstreams: Mapping[str, str],
        meter_provider: MeterProvider,
        tracer_provider: TracerProvider,
        *,
        own_providers: bool = False,
        semconv: str = SEMCONV[0],
        per_chunk: bool = False,
    ) -> None:
        if semconv not in SEMCONV:
            raise ValueError(f"semconv must be one of {', '.join(SEMCONV)}, not {semconv!r}")
        self.semconv = semconv
        self.servers = {name: server_of(url) for name, url in upstreams.items()}
        self._providers = (meter_provider, tracer_provider) if own_providers else None
        version = mlxproxy.__version__
        meter = meter_provider.get_meter("mlxproxy", version)
        self.tracer = tracer_provider.get_tracer("mlxproxy", version)
        self.old = _OldInstruments(meter) if semconv in ("old", "dup") else None
        self.current = _CurrentInstruments(meter, per_chunk) if semconv in ("current", "dup") else None
        self.anomalies = meter.create_counter(
            "mlxproxy.request.anomalies",
            unit="{request}",
            description="Requests with each anomaly (attribute mlxproxy.anomaly; docs/METRICS.md).",
        )

    def on_record(self, record: Record, exchange: Exchange | None = None) -> None:
        operation = OPERATION_NAMES.get(record.endpoint)
        if operation is None:
            return
        common = self._common_attributes(record, operation)
        err = error_type(record)
        with_error = dict(common)
        if err is not None:
            with_error["error.type"] = err
        if self.current is not None:
            self.current.record(record, common, with_error)
        if self.old is not None:
            self.old.record(record, common, with_error, err)
        for anomaly in record.anomalies:
            self.anomalies.add(1, {**common, "mlxproxy.anomaly": anomaly})
        self._span(record, operation, common, err)

    def _common_attributes(self, record: Record, operation: str) -> dict[str, AttributeValue]:
        attrs: dict[str, AttributeValue] = {
            "gen_ai.operation.name": operation,
            "gen_ai.provider.name": PROVIDER_NAMES.get(record.endpoint, "openai"),
        }
        if record.model:
            attrs["gen_ai.request.model"] = record.model
        server = self.servers.get(record.upstream)
        if server is not None and server.address:
            attrs["server.address"] = server.address
            attrs["server.port"] = server.port
        return attrs

    def _span(self, record: Record, operation: str, common: dict[str, AttributeValue], err: str | None) -> None:
        attrs = dict(common)
        attrs.update(_span_attributes(record))
        if self.old is None and not record.stream:
            # current conventions: "Recommended if the request was a streaming request"
            attrs.pop("gen_ai.response.time_to_first_chunk", None)
        if err is not None:
            attrs["error.type"] = err
        start = _ns(record.started_at)
        end = _ns(record.started_at + (record.duration_s or 0.0))
        name = f"{operation} {record.model}" if record.model else operation
        # a root span: the proxy does not join the client's trace (no traceparent is read)
        span = self.tracer.start_span(name, context=Context(), kind=SpanKind.CLIENT, attributes=attrs, start_time=start)
        if err is not None:
            span.set_status(Status(StatusCode.ERROR, err))
        span.end(end_time=end)

    def close(self) -> None:
        if self._providers is None:
            return
        meters, tracers = self._providers
        self._providers = None
        for provider in (tracers, meters):
            shutdown = getattr(provider, "shutdown", None)
            if shutdown is not None:
                shutdown()  # flushes what is queued (bounded by the exporters' timeouts)


@dataclass(frozen=True)
class _Metric:
    """One instrument of a name set: a histogram when it has `buckets`, else a counter."""

    semconv: str  # "current" or "old"
    key: str  # the observer's own name for it
    name: str
    unit: str
    description: str
    buckets: tuple[float, ...] | None = None


_TOKENS = "{token}"

#: every instrument of both name sets. current: semantic-conventions-genai v0.1.0
#: (docs/gen-ai/client-inference.md, gen-ai-token-metrics.md, client-embeddings.md); old:
#: semantic-conventions v1.41.0 (docs/gen-ai/gen-ai-metrics.md) and mlxproxy's counters beside it
METRICS = (
    _Metric("current", "duration", "gen_ai.client.inference.duration", "s",
            "GenAI client inference operation duration.", DURATION_BUCKETS),
    _Metric("current", "first_chunk", "gen_ai.client.inference.time_to_first_chunk", "s",
            "Time to receive the first chunk, from the request to the first chunk of the response stream.",
            DURATION_BUCKETS),
    _Metric("current", "per_chunk", "gen_ai.client.inference.time_per_output_chunk", "s",
            "Time per output chunk, recorded for each chunk after the first: from the previous chunk to this one.",
            DURATION_BUCKETS),
    _Metric("current", "input_tokens", "gen_ai.client.inference.usage.input_tokens", _TOKENS,
            "The number of input (prompt) tokens used, including cached tokens."),
    _Metric("current", "output_tokens", "gen_ai.client.inference.usage.output_tokens", _TOKENS,
            "The number of output (completion) tokens used, including reasoning tokens."),
    _Metric("current", "cache_read", "gen_ai.client.inference.usage.cache_read.input_tokens", _TOKENS,
            "The number of input tokens served from a provider-managed cache."),
    _Metric("current", "reasoning", "gen_ai.client.inference.usage.reasoning.output_tokens", _TOKENS,
            "The number of output tokens used for reasoning."),
    _Metric("current", "op_input", "gen_ai.client.inference.operation.input_tokens", _TOKENS,
            "The number of input (prompt) tokens used per inference operation.", TOKEN_BUCKETS),
    _Metric("current", "op_output", "gen_ai.client.inference.operation.output_tokens", _TOKENS,
            "The number of output (completion) tokens used per inference operation.", TOKEN_BUCKETS),
    _Metric("current", "embeddings_duration", "gen_ai.client.embeddings.duration", "s",
            "GenAI client embeddings operation duration.", DURATION_BUCKETS),
    _Metric("current", "embeddings_input", "gen_ai.client.embeddings.operation.input_tokens", _TOKENS,
            "The number of input tokens used per embeddings operation.", TOKEN_BUCKETS),
    _Metric("old", "duration", "gen_ai.client.operation.duration", "s",
            "GenAI operation duration.", DURATION_BUCKETS),
    _Metric("old", "ttft", "gen_ai.server.time_to_first_token", "s",
            "Time to generate first token for successful responses.", TTFT_BUCKETS),
    _Metric("old", "tpot", "gen_ai.server.time_per_output_token", "s",
            "Time per output token generated after the first token for successful responses.", TPOT_BUCKETS),
    _Metric("old", "tokens", "gen_ai.client.token.usage", _TOKENS,
            "Number of input and output tokens used.", TOKEN_BUCKETS),
    _Metric("old", "cache_read", "mlxproxy.usage.cache_read.input_tokens", _TOKENS,
            "Input tokens the server reported served from its prompt cache (usage cached_tokens)."),
    _Metric("old", "reasoning", "mlxproxy.usage.reasoning.output_tokens", _TOKENS,
            "Output tokens spent reasoning (reported by the server, else counted in the stream)."),
)  # fmt: skip


class _Instruments:
    """The instruments of one name set, created on `meter`, by their `_Metric.key`."""

    def __init__(self, meter: Meter, semconv: str, skip: Iterable[str] = ()) -> None:
        self.h: dict[str, Histogram] = {}
        self.c: dict[str, Counter] = {}
        for m in METRICS:
            if m.semconv != semconv or m.key in skip:
                continue
            if m.buckets is None:
                self.c[m.key] = meter.create_counter(m.name, unit=m.unit, description=m.description)
            else:
                self.h[m.key] = meter.create_histogram(
                    m.name, unit=m.unit, description=m.description, explicit_bucket_boundaries_advisory=m.buckets
                )


class _CurrentInstruments(_Instruments):
    """The client inference metrics of semantic-conventions-genai v0.1.0. The per-chunk times only
    with `per_chunk`: one histogram point per streamed chunk costs about 12 µs of the event loop's
    CPU each (6 ms for a 500-token answer), where all the rest costs about 0.1 ms a request."""

    def __init__(self, meter: Meter, per_chunk: bool) -> None:
        super().__init__(meter, "current", () if per_chunk else ("per_chunk",))

    def record(self, r: Record, common: dict[str, AttributeValue], with_error: dict[str, AttributeValue]) -> None:
        h, c = self.h, self.c
        if common["gen_ai.operation.name"] == "embeddings":  # no inference: client-embeddings.md
            if r.duration_s is not None:
                h["embeddings_duration"].record(r.duration_s, with_error)
            h["embeddings_input"].record(r.prompt_tokens or 0, with_error)
            return
        if r.duration_s is not None:
            h["duration"].record(r.duration_s, with_error)
        if r.stream and r.ttft_s is not None:  # "reported for streaming calls and not otherwise"
            h["first_chunk"].record(r.ttft_s, common)
            per_chunk = h.get("per_chunk")
            if per_chunk is not None:
                for gap in r.event_gaps_s():
                    per_chunk.record(gap, common)
        # recorded for every inference operation, failed ones included: 0 when no count arrived,
        # under modality `unknown`
        n_in = r.prompt_tokens or 0
        n_out = r.n_out or 0
        c["input_tokens"].add(n_in, {**common, "gen_ai.token.modality": INPUT_MODALITY})
        c["output_tokens"].add(n_out, {**common, "gen_ai.token.modality": OUTPUT_MODALITY if n_out else "unknown"})
        h["op_input"].record(n_in, with_error)
        h["op_output"].record(n_out, with_error)
        if r.cached_tokens is not None:
            c["cache_read"].add(r.cached_tokens, {**common, "gen_ai.token.modality": INPUT_MODALITY})
        reasoning = _reasoning_tokens(r)
        if reasoning is not None:
            c["reasoning"].add(reasoning, {**common, "gen_ai.token.modality": OUTPUT_MODALITY})


class _OldInstruments(_Instruments):
    """The metrics of semantic-conventions v1.41.0, as mlxproxy exported them before the GenAI
    conventions renamed them: `serve --otel-semconv old`."""

    def __init__(self, meter: Meter) -> None:
        super().__init__(meter, "old")

    def record(
        self, r: Record, common: dict[str, AttributeValue], with_error: dict[str, AttributeValue], err: str | None
    ) -> None:
        h, c = self.h, self.c
        if r.duration_s is not None:
            h["duration"].record(r.duration_s, with_error)
        if err is None:  # the server metrics are "for successful responses"
            if r.ttft_s is not None:
                h["ttft"].record(r.ttft_s, common)
            if r.tpot_s is not None:
                h["tpot"].record(r.tpot_s, common)
        if r.prompt_tokens is not None:
            h["tokens"].record(r.prompt_tokens, {**common, "gen_ai.token.type": "input"})
        if r.n_out is not None:
            h["tokens"].record(r.n_out, {**common, "gen_ai.token.type": "output"})
        if r.cached_tokens:
            c["cache_read"].add(r.cached_tokens, common)
        reasoning = _reasoning_tokens(r)
        if reasoning:
            c["reasoning"].add(reasoning, common)


def _reasoning_tokens(record: Record) -> int | None:
    if record.reasoning_tokens_reported is not None:
        return record.reasoning_tokens_reported
    return record.reasoning_tokens_counted


def _span_attributes(r: Record) -> dict[str, AttributeValue]:
    """The span's attributes beyond the metrics' own: usage, finish reason, mlxproxy's figures."""
    out: dict[str, AttributeValue] = {
        "gen_ai.request.stream": r.stream,
        "mlxproxy.request.id": r.id,
        "mlxproxy.upstream": r.upstream,
        "mlxproxy.outcome": r.outcome,
        "mlxproxy.concurrency": r.concurrency,
    }
    optional: Iterable[tuple[str, AttributeValue | None]] = (
        ("gen_ai.request.max_tokens", r.max_tokens),
        ("gen_ai.usage.input_tokens", r.prompt_tokens),
        ("gen_ai.usage.output_tokens", r.n_out),
        ("gen_ai.usage.cache_read.input_tokens", r.cached_tokens),
        ("gen_ai.usage.reasoning.output_tokens", _reasoning_tokens(r)),
        ("gen_ai.response.time_to_first_chunk", r.ttft_s),
        ("http.response.status_code", r.status),
        ("mlxproxy.completion_tokens", r.completion_tokens),
        ("mlxproxy.tokens_source", r.tokens_source),
        ("mlxproxy.ttft_s", r.ttft_s),
        ("mlxproxy.tpot_s", r.tpot_s),
        ("mlxproxy.decode_tps", r.decode_tps),
        ("mlxproxy.wall_tps", r.wall_tps),
        ("mlxproxy.prefill_tps", r.prefill_tps),
        ("mlxproxy.conversation.id", r.conversation_id),
        ("mlxproxy.conversation.turn", r.turn),
        ("mlxproxy.cache_hit_ratio", r.cache_hit_ratio),
        ("mlxproxy.reprefill.cause", r.reprefill_cause),
        ("mlxproxy.reprefill.lost_s", r.reprefill_lost_s),
    )
    for key, value in optional:
        if value is not None:
            out[key] = value
    if r.finish_reason is not None:
        out["gen_ai.response.finish_reasons"] = (r.finish_reason,)
    if r.anomalies:
        out["mlxproxy.anomalies"] = tuple(r.anomalies)
    if r.usage_untrusted:
        out["mlxproxy.usage_untrusted"] = True
    return out


def signal_url(endpoint: str, signal: str) -> str:
    """The OTLP/HTTP URL of `signal` ("traces", "metrics") under a base endpoint, the way the
    standard `OTEL_EXPORTER_OTLP_ENDPOINT` is resolved: `http://host:4318` -> `http://host:4318/v1/traces`."""
    return endpoint.rstrip("/") + "/v1/" + signal


def otlp_providers(
    endpoint: str, *, metric_readers: Iterable[MetricReader] = (), span_exporter: SpanExporter | None = None
) -> tuple[SdkMeterProvider, SdkTracerProvider]:
    """A meter provider exporting OTLP/HTTP (protobuf) to `endpoint`'s `/v1/metrics` every
    `OTEL_METRIC_EXPORT_INTERVAL` ms (default 60 s) and a tracer provider batching spans to its
    `/v1/traces`. The resource is `service.name=mlxproxy` unless `OTEL_SERVICE_NAME` or
    `OTEL_RESOURCE_ATTRIBUTES` say otherwise; the exporters also honour the standard
    `OTEL_EXPORTER_OTLP_HEADERS`, `..._TIMEOUT`, `..._COMPRESSION` and `..._CERTIFICATE`.
    `metric_readers` and `span_exporter` replace the OTLP ones (tests)."""
    resource = Resource.create({"service.version": mlxproxy.__version__})
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):  # none in the environment
        resource = resource.merge(Resource({SERVICE_NAME: "mlxproxy"}))
    readers = list(metric_readers) or [
        PeriodicExportingMetricReader(OTLPMetricExporter(endpoint=signal_url(endpoint, "metrics")))
    ]
    # the observer records outside any span, so the SDK's default `trace_based` exemplar filter never
    # samples one, yet checking costs about half of each recording: off, unless the standard
    # OTEL_METRICS_EXEMPLAR_FILTER asks otherwise
    exemplars = None if os.environ.get("OTEL_METRICS_EXEMPLAR_FILTER") else AlwaysOffExemplarFilter()
    meters = SdkMeterProvider(resource=resource, metric_readers=readers, exemplar_filter=exemplars)
    tracers = SdkTracerProvider(resource=resource)
    exporter = span_exporter if span_exporter is not None else OTLPSpanExporter(endpoint=signal_url(endpoint, "traces"))
    tracers.add_span_processor(BatchSpanProcessor(exporter))
    return meters, tracers
