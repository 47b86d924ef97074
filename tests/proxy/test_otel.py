"""proxy/otel.py: a request through the proxy in front of the simulator yields the OpenTelemetry
GenAI metrics and one span with the conventions' names, whose values are the record's own: the
current names (semantic-conventions-genai v0.1.0) by default, the old ones (v1.41.0) with
`semconv="old"`, both with `"dup"`; a failing upstream yields `error.type`; the OTLP/HTTP exporters
deliver both signals as protobuf to a loopback receiver. Skips, saying why, without the [otel] extra."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import yaml

pytest.importorskip("opentelemetry.sdk", reason="the [otel] extra is not installed (pip install -e '.[otel]')")
pytest.importorskip("opentelemetry.proto", reason="the [otel] extra is not installed (pip install -e '.[otel]')")

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import HistogramDataPoint, InMemoryMetricReader, NumberDataPoint
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from mlxproxy.config import build_config
from mlxproxy.core.record import Record
from mlxproxy.edge.runner import ServerThread
from mlxproxy.proxy.app import ProxyApp, create_app
from mlxproxy.proxy.cli import OTEL_SEMCONV
from mlxproxy.proxy.otel import SEMCONV, OtelObserver, otlp_providers
from mlxproxy.sim.app import create_app as create_sim
from otlpreceiver import otlp_attrs, receiver
from support import REPO, closed_port, last_record, wait_for

RID = "x-mlxproxy-request-id"

#: the metric names of each set (besides mlxproxy.request.anomalies, in every set)
CURRENT = {
    "gen_ai.client.inference.duration",
    "gen_ai.client.inference.time_to_first_chunk",
    "gen_ai.client.inference.time_per_output_chunk",
    "gen_ai.client.inference.usage.input_tokens",
    "gen_ai.client.inference.usage.output_tokens",
    "gen_ai.client.inference.usage.cache_read.input_tokens",
    "gen_ai.client.inference.usage.reasoning.output_tokens",
    "gen_ai.client.inference.operation.input_tokens",
    "gen_ai.client.inference.operation.output_tokens",
}
OLD = {
    "gen_ai.client.operation.duration",
    "gen_ai.server.time_to_first_token",
    "gen_ai.server.time_per_output_token",
    "gen_ai.client.token.usage",
    "mlxproxy.usage.cache_read.input_tokens",
    "mlxproxy.usage.reasoning.output_tokens",
}


class Otel:
    """An observer on in-memory providers, and what they hold."""

    def __init__(self, upstream_url: str, semconv: str = "current", per_chunk: bool = True) -> None:
        self.reader = InMemoryMetricReader()
        self.spans = InMemorySpanExporter()
        self.meters = MeterProvider(metric_readers=[self.reader])
        self.tracers = TracerProvider()
        self.tracers.add_span_processor(SimpleSpanProcessor(self.spans))
        self.observer = OtelObserver(
            {"default": upstream_url}, self.meters, self.tracers, semconv=semconv, per_chunk=per_chunk
        )

    def names(self) -> set[str]:
        data = self.reader.get_metrics_data()
        if data is None:
            return set()
        return {m.name for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}

    def points(self, name: str) -> list[Any]:
        data = self.reader.get_metrics_data()
        if data is None:  # nothing recorded at all
            return []
        return [
            p
            for rm in data.resource_metrics
            for sm in rm.scope_metrics
            for m in sm.metrics
            if m.name == name
            for p in m.data.data_points
        ]

    def finished(self) -> list[ReadableSpan]:
        return list(self.spans.get_finished_spans())


@contextlib.contextmanager
def proxied(upstream_url: str, semconv: str = "current") -> Iterator[tuple[str, ProxyApp, Otel]]:
    otel = Otel(upstream_url, semconv)
    app = create_app(build_config(None, upstream_url=upstream_url, log_requests=False), observers=[otel.observer])
    with ServerThread(app) as srv:
        yield srv.url, app, otel


def one(points: list[Any], **attrs: object) -> Any:
    found = [p for p in points if all(p.attributes.get(k) == v for k, v in attrs.items())]
    assert len(found) == 1, (attrs, [dict(p.attributes) for p in points])
    return found[0]


def chat(url: str, messages: list[dict[str, str]], **extra: object) -> httpx.Response:
    body = {"model": "m", "stream": True, "max_tokens": 12, "messages": messages, **extra}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=30)


def conversation(semconv: str) -> tuple[list[Record], Otel, dict[str, object]]:
    """Two streamed turns of one conversation through the proxy to a reasoning simulated server
    with a prompt cache; the records, what the observer recorded, and the metrics' common attributes."""
    with ServerThread(create_sim("mlx-lm", speed=20, prompt_cache=True)) as sim:
        port = int(sim.url.rsplit(":", 1)[1])
        with proxied(sim.url, semconv) as (url, app, otel):
            first = [{"role": "user", "content": "tell me about the sea " * 40}]
            r1 = chat(url, first)
            assert r1.status_code == 200
            rec1 = last_record(app, r1.headers[RID])
            second = [*first, {"role": "assistant", "content": "It is wet."}, {"role": "user", "content": "More."}]
            r2 = chat(url, second)
            rec2 = last_record(app, r2.headers[RID])
            assert wait_for(lambda: len(otel.finished()) == 2)
    records = [rec1, rec2]
    assert all(r.outcome == "ok" and r.prompt_tokens and r.n_out and r.ttft_s for r in records)
    assert rec2.cached_tokens, "the simulator's prompt cache should report cached tokens on turn 2"
    assert sum(reasoning_of(r) for r in records) > 0, "mlx-lm's profile reasons"
    common = {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "openai",
        "gen_ai.request.model": "m",
        "server.address": "127.0.0.1",
        "server.port": port,
    }
    spans = {s.attributes["mlxproxy.request.id"]: s for s in otel.finished() if s.attributes}
    assert set(spans) == {rec1.id, rec2.id}
    for rec in records:
        check_span(spans[rec.id], rec, common)
    assert spans[rec2.id].attributes["gen_ai.usage.cache_read.input_tokens"] == rec2.cached_tokens
    return records, otel, common


def reasoning_of(r: Record) -> int:
    return r.reasoning_tokens_reported or r.reasoning_tokens_counted or 0


def test_a_streamed_conversation_yields_the_current_genai_metrics_and_one_span_per_request() -> None:
    records, otel, common = conversation("current")
    assert otel.names() - {"mlxproxy.request.anomalies"} == CURRENT
    modality_in = {**common, "gen_ai.token.modality": "unknown"}
    modality_out = {**common, "gen_ai.token.modality": "text"}
    inp = one(otel.points("gen_ai.client.inference.usage.input_tokens"), **modality_in)
    assert isinstance(inp, NumberDataPoint) and inp.value == sum(r.prompt_tokens or 0 for r in records)
    out = one(otel.points("gen_ai.client.inference.usage.output_tokens"), **modality_out)
    assert out.value == sum(r.n_out or 0 for r in records)
    cache = one(otel.points("gen_ai.client.inference.usage.cache_read.input_tokens"), **modality_in)
    assert cache.value == sum(r.cached_tokens or 0 for r in records)
    reasoning = one(otel.points("gen_ai.client.inference.usage.reasoning.output_tokens"), **modality_out)
    assert reasoning.value == sum(reasoning_of(r) for r in records)
    op_in = one(otel.points("gen_ai.client.inference.operation.input_tokens"), **common)
    assert isinstance(op_in, HistogramDataPoint)
    assert (op_in.count, op_in.sum) == (2, sum(r.prompt_tokens or 0 for r in records))
    assert (op_in.min, op_in.max) == (
        min(r.prompt_tokens or 0 for r in records),
        max(r.prompt_tokens or 0 for r in records),
    )
    op_out = one(otel.points("gen_ai.client.inference.operation.output_tokens"), **common)
    assert (op_out.count, op_out.sum) == (2, sum(r.n_out or 0 for r in records))
    first = one(otel.points("gen_ai.client.inference.time_to_first_chunk"), **common)
    assert first.count == 2 and first.sum == pytest.approx(sum(r.ttft_s or 0 for r in records), rel=1e-9)
    assert first.min == pytest.approx(min(r.ttft_s or 0 for r in records), rel=1e-9)
    # one point per chunk after the first: the gaps between the record's generated events
    gaps = [g for r in records for g in r.event_gaps_s()]
    assert len(gaps) == sum(len(r.event_offsets_s) - 1 for r in records) > 10
    per_chunk = one(otel.points("gen_ai.client.inference.time_per_output_chunk"), **common)
    assert per_chunk.count == len(gaps) and per_chunk.sum == pytest.approx(sum(gaps), rel=1e-9)
    assert per_chunk.max == pytest.approx(max(gaps), rel=1e-9)
    duration = one(otel.points("gen_ai.client.inference.duration"), **common)
    assert duration.count == 2 and duration.sum == pytest.approx(sum(r.duration_s or 0 for r in records), rel=1e-9)
    assert "error.type" not in duration.attributes


def test_old_semconv_keeps_the_v1_41_names_for_dashboards_built_on_them() -> None:
    records, otel, common = conversation("old")
    assert otel.names() == OLD
    usage = otel.points("gen_ai.client.token.usage")
    inp = one(usage, **common, **{"gen_ai.token.type": "input"})
    out = one(usage, **common, **{"gen_ai.token.type": "output"})
    assert (inp.count, inp.sum) == (2, sum(r.prompt_tokens or 0 for r in records))
    assert (out.count, out.sum) == (2, sum(r.n_out or 0 for r in records))
    ttft = one(otel.points("gen_ai.server.time_to_first_token"), **common)
    assert isinstance(ttft, HistogramDataPoint)
    assert ttft.count == 2 and ttft.sum == pytest.approx(sum(r.ttft_s or 0 for r in records), rel=1e-9)
    tpot = one(otel.points("gen_ai.server.time_per_output_token"), **common)
    assert tpot.sum == pytest.approx(sum(r.tpot_s or 0 for r in records), rel=1e-9)
    duration = one(otel.points("gen_ai.client.operation.duration"), **common)
    assert duration.count == 2 and duration.sum == pytest.approx(sum(r.duration_s or 0 for r in records), rel=1e-9)
    cache = one(otel.points("mlxproxy.usage.cache_read.input_tokens"), **common)
    assert isinstance(cache, NumberDataPoint) and cache.value == sum(r.cached_tokens or 0 for r in records)
    assert one(otel.points("mlxproxy.usage.reasoning.output_tokens"), **common).value == sum(
        reasoning_of(r) for r in records
    )


def test_dup_semconv_exports_both_name_sets_with_the_same_figures() -> None:
    records, otel, common = conversation("dup")
    assert CURRENT | OLD <= otel.names()
    old = one(otel.points("gen_ai.client.operation.duration"), **common)
    new = one(otel.points("gen_ai.client.inference.duration"), **common)
    assert (old.count, old.sum) == (new.count, new.sum) == (2, pytest.approx(sum(r.duration_s or 0 for r in records)))


def test_the_semconv_choices_agree_and_a_wrong_one_is_refused() -> None:
    assert tuple(OTEL_SEMCONV) == SEMCONV and SEMCONV[0] == "current"
    with pytest.raises(ValueError, match="current, old, dup"):
        Otel("http://127.0.0.1:1", "v2")


def record_of(endpoint: str, **kw: Any) -> Record:
    base: dict[str, Any] = {
        "id": "r1",
        "started_at": 1_700_000_000.0,
        "upstream": "default",
        "model": "m",
        "endpoint": endpoint,
        "stream": False,
        "status": 200,
        "outcome": "ok",
        "duration_s": 0.25,
    }
    return Record(**{**base, **kw})


def test_the_per_chunk_times_only_when_asked() -> None:
    otel = Otel("http://127.0.0.1:8080", per_chunk=False)
    offsets = (0.1, 0.12, 0.15, 0.2)
    otel.observer.on_record(record_of("chat_completions", stream=True, ttft_s=0.1, event_offsets_s=offsets))
    assert "gen_ai.client.inference.time_per_output_chunk" not in otel.names()
    assert one(otel.points("gen_ai.client.inference.time_to_first_chunk")).sum == 0.1
    otel = Otel("http://127.0.0.1:8080", per_chunk=True)
    otel.observer.on_record(record_of("chat_completions", stream=True, ttft_s=0.1, event_offsets_s=offsets))
    point = one(otel.points("gen_ai.client.inference.time_per_output_chunk"))
    assert point.count == 3 and point.sum == pytest.approx(0.1) and point.max == pytest.approx(0.05)


@pytest.mark.parametrize(
    ("endpoint", "operation", "provider"),
    [
        ("ollama_chat", "chat", "ollama"),
        ("ollama_generate", "text_completion", "ollama"),
        ("lmstudio_chat", "chat", "lm_studio"),
        ("messages", "chat", "anthropic"),
        ("chat_completions", "chat", "openai"),
    ],
)
def test_native_requests_are_exported_under_their_api_flavour(endpoint: str, operation: str, provider: str) -> None:
    otel = Otel("http://127.0.0.1:11434")
    otel.observer.on_record(
        record_of(endpoint, stream=True, ttft_s=0.1, prompt_tokens=5, completion_tokens=9, tokens_source="usage")
    )
    point = one(otel.points("gen_ai.client.inference.duration"))
    assert point.attributes["gen_ai.operation.name"] == operation
    assert point.attributes["gen_ai.provider.name"] == provider
    assert one(otel.points("gen_ai.client.inference.usage.output_tokens")).value == 9
    (span,) = otel.finished()
    assert span.name == f"{operation} m"


def test_a_request_not_streamed_has_no_chunk_metrics_and_embeddings_have_their_own() -> None:
    otel = Otel("http://127.0.0.1:8080")
    otel.observer.on_record(record_of("chat_completions", prompt_tokens=7, completion_tokens=3, ttft_s=0.2))
    otel.observer.on_record(record_of("embeddings", prompt_tokens=11))
    names = otel.names()
    assert "gen_ai.client.inference.time_to_first_chunk" not in names
    assert "gen_ai.client.inference.time_per_output_chunk" not in names
    assert one(otel.points("gen_ai.client.inference.duration")).count == 1  # the chat request only
    (emb,) = otel.points("gen_ai.client.embeddings.operation.input_tokens")
    assert emb.sum == 11 and emb.attributes["gen_ai.operation.name"] == "embeddings"
    assert one(otel.points("gen_ai.client.embeddings.duration")).sum == 0.25
    spans = otel.finished()
    assert all("gen_ai.response.time_to_first_chunk" not in (s.attributes or {}) for s in spans)


def check_span(span: ReadableSpan, rec: Record, common: dict[str, object]) -> None:
    attrs = dict(span.attributes or {})
    assert span.name == "chat m" and span.kind is SpanKind.CLIENT and span.parent is None
    assert span.start_time == round(rec.started_at * 1e9)
    assert span.end_time == round((rec.started_at + (rec.duration_s or 0)) * 1e9)
    assert span.end_time is not None and span.start_time is not None and span.end_time > span.start_time
    assert {k: attrs[k] for k in common} == common
    assert attrs["gen_ai.usage.input_tokens"] == rec.prompt_tokens
    assert attrs["gen_ai.usage.output_tokens"] == rec.n_out
    assert attrs["gen_ai.response.finish_reasons"] == (rec.finish_reason,)
    assert attrs["gen_ai.request.max_tokens"] == 12 and attrs["gen_ai.request.stream"] is True
    assert attrs["mlxproxy.completion_tokens"] == rec.completion_tokens
    assert attrs["mlxproxy.tokens_source"] == rec.tokens_source
    assert attrs["mlxproxy.decode_tps"] == rec.decode_tps and attrs["mlxproxy.ttft_s"] == rec.ttft_s
    assert attrs["http.response.status_code"] == 200 and "error.type" not in attrs
    assert span.status.status_code is StatusCode.UNSET
    # never a prompt or a response: no attribute holds text the conversation had
    assert not any(isinstance(v, str) and ("sea" in v or "wet" in v) for v in attrs.values())


def test_anomalies_are_counted_and_named_on_the_span() -> None:
    with ServerThread(create_sim("phantom-usage", speed=20)) as sim, proxied(sim.url) as (url, app, otel):
        r = chat(url, [{"role": "user", "content": "hi"}], max_tokens=24)
        rec = last_record(app, r.headers[RID])
        assert wait_for(lambda: len(otel.finished()) == 1)
    assert rec.anomalies, "phantom-usage reports usage the stream contradicts"
    points = otel.points("mlxproxy.request.anomalies")
    assert {p.attributes["mlxproxy.anomaly"]: p.value for p in points} == dict.fromkeys(rec.anomalies, 1)
    (span,) = otel.finished()
    assert span.attributes is not None and span.attributes["mlxproxy.anomalies"] == rec.anomalies


@pytest.mark.parametrize("semconv", ["current", "old"])
def test_an_unreachable_upstream_gives_error_type_and_an_error_span(semconv: str) -> None:
    dead = f"http://127.0.0.1:{closed_port()}"
    with proxied(dead, semconv) as (url, app, otel):
        r = chat(url, [{"role": "user", "content": "hi"}])
        assert r.status_code == 502
        rec = last_record(app, r.headers.get(RID))
        assert wait_for(lambda: len(otel.finished()) == 1)
    assert rec.outcome == "upstream_unreachable"
    err = {"error.type": "upstream_unreachable"}
    if semconv == "old":
        duration = one(otel.points("gen_ai.client.operation.duration"), **err)
        assert otel.points("gen_ai.server.time_to_first_token") == []  # for successful responses only
    else:
        duration = one(otel.points("gen_ai.client.inference.duration"), **err)
        assert otel.points("gen_ai.client.inference.time_to_first_chunk") == []  # no chunk came
        # usage is recorded for failed operations too: 0, modality unknown
        (inp,) = otel.points("gen_ai.client.inference.usage.input_tokens")
        assert inp.value == 0 and inp.attributes["gen_ai.token.modality"] == "unknown"
        assert "error.type" not in inp.attributes  # not an attribute of the usage counters
        assert one(otel.points("gen_ai.client.inference.operation.output_tokens"), **err).sum == 0
    assert duration.attributes["server.port"] == int(dead.rsplit(":", 1)[1]) and duration.count == 1
    (span,) = otel.finished()
    assert span.status.status_code is StatusCode.ERROR
    assert span.attributes is not None and span.attributes["error.type"] == "upstream_unreachable"


def test_an_http_error_from_the_upstream_is_its_status_code() -> None:
    with ServerThread(create_sim("healthy")) as sim, proxied(sim.url) as (url, app, otel):
        r = httpx.post(url + "/v1/chat/completions", json={"model": "m", "messages": "not a list"}, timeout=30)
        assert r.status_code >= 400
        rec = last_record(app, r.headers.get(RID))
        assert wait_for(lambda: len(otel.finished()) == 1)
    assert rec.outcome == "http_error"
    (span,) = otel.finished()
    assert span.attributes is not None and span.attributes["error.type"] == str(r.status_code)
    one(otel.points("gen_ai.client.inference.duration"), **{"error.type": str(r.status_code)})


def test_requests_that_are_no_genai_operation_yield_nothing() -> None:
    with ServerThread(create_sim("healthy")) as sim, proxied(sim.url) as (url, app, otel):
        r = httpx.get(url + "/v1/models", timeout=30)
        assert r.status_code == 200
        assert last_record(app, r.headers.get(RID)).endpoint == "models"
        assert otel.finished() == [] and otel.names() == set()
        r = chat(url, [{"role": "user", "content": "hi"}])  # the next chat request is exported
        last_record(app, r.headers.get(RID))
        assert wait_for(lambda: len(otel.finished()) == 1)
    assert one(otel.points("gen_ai.client.inference.duration")).count == 1


def test_the_otlp_http_exporters_deliver_the_span_and_the_metrics_as_protobuf() -> None:
    with receiver() as collector, ServerThread(create_sim("healthy", speed=20)) as sim:
        meters, tracers = otlp_providers(collector.url)
        observer = OtelObserver({"default": sim.url}, meters, tracers, own_providers=True)
        app = create_app(build_config(None, upstream_url=sim.url, log_requests=False), observers=[observer])
        with ServerThread(app) as srv:
            r = chat(srv.url, [{"role": "user", "content": "hello"}])
            rec = last_record(app, r.headers[RID])
        # the app's shutdown closed the observer: the providers flushed what they held
        assert collector.got["/v1/traces"] and collector.got["/v1/metrics"]
    assert collector.content_types == {"application/x-protobuf"}
    spans = collector.spans()
    (span,) = spans
    resource = otlp_attrs(collector.got["/v1/traces"][0].resource_spans[0].resource.attributes)
    assert resource["service.name"] == "mlxproxy"
    attrs = otlp_attrs(span.attributes)
    assert span.name == "chat m" and span.kind == span.SPAN_KIND_CLIENT
    assert span.start_time_unix_nano == round(rec.started_at * 1e9)
    assert attrs["gen_ai.usage.output_tokens"] == rec.n_out and attrs["gen_ai.response.finish_reasons"] == [
        rec.finish_reason
    ]
    metrics = collector.metrics()
    assert CURRENT - {
        "gen_ai.client.inference.usage.cache_read.input_tokens",  # the healthy profile reports no cache
        "gen_ai.client.inference.usage.reasoning.output_tokens",  # nor reasoning
        "gen_ai.client.inference.time_per_output_chunk",  # only with per_chunk
    } <= set(metrics)
    assert metrics["gen_ai.client.inference.duration"].unit == "s"
    (ttfc,) = metrics["gen_ai.client.inference.time_to_first_chunk"].histogram.data_points
    assert ttfc.count == 1 and ttfc.sum == pytest.approx(rec.ttft_s, rel=1e-9)
    usage_in = metrics["gen_ai.client.inference.usage.input_tokens"]
    assert usage_in.sum.is_monotonic and usage_in.unit == "{token}"
    (inp,) = usage_in.sum.data_points
    (out,) = metrics["gen_ai.client.inference.usage.output_tokens"].sum.data_points
    assert inp.as_int == rec.prompt_tokens and out.as_int == rec.n_out
    assert otlp_attrs(out.attributes)["gen_ai.token.modality"] == "text"


def test_the_collector_config_wires_otlp_in_to_prometheus_out() -> None:
    """deploy/otel-collector.yaml (docs/DASHBOARDS.md): an OTLP/HTTP receiver where `serve
    --otlp-endpoint` sends, a prometheus exporter, and pipelines naming only defined components."""
    cfg = yaml.safe_load((REPO / "deploy" / "otel-collector.yaml").read_text(encoding="utf-8"))
    assert cfg["receivers"]["otlp"]["protocols"]["http"]["endpoint"].endswith(":4318")
    assert cfg["exporters"]["prometheus"]["endpoint"] == "127.0.0.1:8889"
    pipelines = cfg["service"]["pipelines"]
    assert set(pipelines) == {"metrics", "traces"} and pipelines["metrics"]["exporters"] == ["prometheus"]
    for pipeline in pipelines.values():
        for kind in ("receivers", "processors", "exporters"):
            assert set(pipeline.get(kind, [])) <= set(cfg[kind]), (kind, pipeline)
