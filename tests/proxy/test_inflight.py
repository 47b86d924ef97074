"""The requests in flight are held in one place (`proxy/inflight.py`), and every request
yields one record, even when finishing it fails, queued for the finisher in the loop turn of its
last byte."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client import CollectorRegistry

import mlxproxy.proxy.app as app_module
from fakeupstream import Conn, FakeUpstream, Req, sse_response
from mlxproxy.config import build_config
from mlxproxy.core.meter import RequestMeter
from mlxproxy.core.openai import parse_request
from mlxproxy.edge.runner import ServerThread
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


def _json_response(body: bytes):  # type: ignore[no-untyped-def]
    async def handler(req: Req, conn: Conn) -> None:
        await conn.head(200, [("content-type", "application/json"), ("content-length", str(len(body)))])
        await conn.send(body)

    return handler


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "non-stream"])
def test_a_record_is_queued_for_finishing_in_the_loop_turn_of_its_last_byte(stack: str, stream: bool) -> None:
    """Between a response's last byte and its record being queued for the finisher, nothing
    waits for a turn of the event loop: on the standard loop each turn costs the next request
    time (closing the upstream response as an awaited task, under `asyncio.shield`, took three)."""
    if stream:
        body = read_fixture("wire/01_openai_reference_include_usage.sse")
        handler = sse_response(body)
    else:
        body = b'{"choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}]}'
        handler = _json_response(body)
    turn = {"passed": True}
    queued_after_a_turn: list[bool] = []

    async def served(scope, receive, send):  # type: ignore[no-untyped-def]
        async def sending(message):  # type: ignore[no-untyped-def]
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                turn["passed"] = False  # until the loop's next turn
                asyncio.get_running_loop().call_soon(turn.__setitem__, "passed", True)

        await app(scope, receive, sending if scope["type"] == "http" else send)

    with FakeUpstream(handler) as up:
        app = app_module.create_app(build_config(upstream_url=up.url, log_requests=False))
        submit = app.finisher.submit

        def recording_submit(*args: object) -> None:
            queued_after_a_turn.append(turn["passed"])
            submit(*args)  # type: ignore[arg-type]

        app.finisher.submit = recording_submit  # type: ignore[method-assign]
        with ServerThread(served, server_header=False, date_header=False) as srv:
            asks = {"model": "m", "stream": stream, "stream_options": {"include_usage": True}, "messages": []}
            r = httpx.post(srv.url + "/v1/chat/completions", json=asks if stream else {"model": "m", "messages": []})
            assert r.status_code == 200 and r.content == body
            assert last_record(app, r.headers["x-mlxproxy-request-id"]).outcome == "ok"
    assert queued_after_a_turn == [False]
