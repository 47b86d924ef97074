"""The requests in flight are held in one place (`proxy/inflight.py`), and every request
yields one record, even when finishing it fails."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from prometheus_client import CollectorRegistry

import mlxproxy.proxy.app as app_module
from fakeupstream import FakeUpstream, sse_response
from mlxproxy.config import build_config
from mlxproxy.core.meter import RequestMeter
from mlxproxy.core.openai import parse_request
from mlxproxy.proxy.inflight import InFlight
from mlxproxy.proxy.metrics import ProxyMetrics
from mlxproxy.proxy.relay import Flow
from mlxproxy.proxy.upstream import UpstreamPool
from support import last_record, proxy, read_fixture

CHAT = b'{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}'


def test_one_registry_feeds_the_upstream_count_the_gauge_and_the_live_view() -> None:
    upstream = UpstreamPool(build_config(upstream_url="http://127.0.0.1:9")).default
    registry = CollectorRegistry()
    live = InFlight(ProxyMetrics(registry))
    info, _ = parse_request("POST", "/v1/chat/completions", CHAT)
    flows = []
    for i in range(2):
        concurrency = upstream.admit()
        meter = RequestMeter(
            info, request_id=f"r{i}", upstream=upstream.name, t_start=float(i), started_at=0.0, concurrency=concurrency
        )
        flows.append(Flow(upstream, meter, [], None))
        live.enter(flows[-1], "m")

    def gauge() -> float | None:
        return registry.get_sample_value("mlxproxy_requests_in_flight", {"upstream": upstream.name, "model": "m"})

    assert (len(live), upstream.in_flight, gauge()) == (2, 2, 2.0)
    snaps = live.snapshots(5.0)
    assert [(s.id, s.concurrency, s.age_s) for s in snaps] == [("r0", 1, 5.0), ("r1", 2, 4.0)]
    live.leave(flows[0])
    live.leave(flows[0])  # a second leave (the request's outer `finally`) changes nothing
    assert (len(live), upstream.in_flight, gauge()) == (1, 1, 1.0)
    assert [s.id for s in live.snapshots(6.0)] == ["r1"]
    live.leave(flows[1])
    assert (len(live), upstream.in_flight, gauge()) == (0, 0, 0.0)


def test_a_request_whose_finishing_fails_still_yields_one_record(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object, **kwargs: object) -> Iterator[None]:
        yield  # (fails in its second step, as a bug in the checks after `meter.finish` would)
        raise RuntimeError("a bug in the checks")

    monkeypatch.setattr(app_module, "finish_steps", broken)
    body = read_fixture("wire/01_openai_reference_include_usage.sse")
    with FakeUpstream(sse_response(body)) as up, proxy(up.url) as (url, app):
        asks = {"model": "m", "stream": True, "stream_options": {"include_usage": True}, "messages": []}
        r = httpx.post(url + "/v1/chat/completions", json=asks)
        assert r.status_code == 200 and r.content == body  # the client got the whole stream
        rec = last_record(app, r.headers["x-mlxproxy-request-id"])
        assert (len(app.in_flight), app.pool.default.in_flight) == (0, 0)
    assert (rec.outcome, rec.error) == ("protocol_error", "metering failed: RuntimeError")
    assert (rec.model, rec.endpoint, rec.stream) == ("m", "chat_completions", True)
    assert rec.duration_s is not None and rec.duration_s > 0
