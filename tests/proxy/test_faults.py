"""Faults: what the client gets and what the record says when the upstream, the client or the
bytes misbehave, and that the proxy keeps serving while it happens.

Upstream faults use scripted raw-socket upstreams (`fakeupstream.py`) for byte-level control and
the simulator's `X-Sim-Fault` switches for each server style. Client faults use raw sockets or
httpx. Parser robustness is property-based (hypothesis). Every server listens on 127.0.0.1 port
0; nothing sleeps to measure: the fake upstreams wait on gates, the tests poll with deadlines.
SECURITY.md names these tests next to the guarantees they back.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import signal
import socket
import subprocess
import sys
import threading
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fakeupstream import Conn, FakeUpstream, Req
from mlxproxy.capture import read_capture
from mlxproxy.config import build_config
from mlxproxy.core import meter as meter_module
from mlxproxy.core.meter import RequestMeter
from mlxproxy.core.openai import inject_include_usage, is_injected_usage_chunk, parse_request
from mlxproxy.core.record import OUTCOMES, Record
from mlxproxy.core.sse import SSEDecoder, SSEEvent
from mlxproxy.core.strip import UsageStripper
from mlxproxy.proxy.app import ProxyApp, create_app
from mlxproxy.proxy.capture_writer import CaptureWriter
from mlxproxy.runner import ServerThread
from support import closed_port, read_fixture
from support import wait_for as _wait_for

OK_BODY = read_fixture("wire/01_openai_reference_include_usage.sse")
STREAM_REQ = {
    "model": "m",
    "stream": True,
    "messages": [{"role": "user", "content": "hi"}],
    "stream_options": {"include_usage": True},
}
SSE_CHUNKED = [("content-type", "text/event-stream"), ("transfer-encoding", "chunked")]
EVENT_A = b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'
FINISH = b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'


# -- rig ------------------------------------------------------------------------------------


class Rig:
    """A proxy in front of one fake upstream whose behaviour is chosen per request by the
    request's `model`: `handlers[model]`. Model `healthy` is always a gated good stream (one
    event, wait for `gate`, the rest), so a test can keep a healthy stream in flight while a
    fault happens next to it."""

    def __init__(self, server: ServerThread, app: ProxyApp, upstream: FakeUpstream, gate: threading.Event) -> None:
        self.server = server
        self.url = server.url
        self.app = app
        self.upstream = upstream
        self.gate = gate

    def in_loop(self, fn):
        """Run `fn()` on the proxy's event loop thread and return its result."""

        async def call():
            return fn()

        assert self.server.loop is not None
        return asyncio.run_coroutine_threadsafe(call(), self.server.loop).result(10)

    def tasks(self) -> int:
        """Tasks alive on the proxy's event loop (uvicorn's own included)."""
        return self.in_loop(lambda: len(asyncio.all_tasks()))

    def busy_upstream_connections(self) -> int:
        """Upstream responses the proxy opened and has not closed yet (each holds a connection)."""
        return self.in_loop(lambda: sum(up.open_responses for up in self.app.pool.upstreams))

    def settled(self, tasks_before: int) -> bool:
        """Nothing of a finished request is left: no request in flight, no busy upstream
        connection, no task beyond the baseline."""
        return wait_for(
            lambda: not self.app.in_flight and self.busy_upstream_connections() == 0 and self.tasks() <= tasks_before
        )

    def records(self, n: int, timeout_s: float = 10.0) -> list[Record]:
        """The first `n` finished records, once there are that many."""
        assert wait_for(lambda: len(self.app.recent.records) >= n, timeout_s), (
            f"expected {n} records, have {len(self.app.recent.records)}"
        )
        return list(self.app.recent.records)[:n]

    def record(self, rid: str) -> Record:
        """The record of request `rid` (the `x-mlxproxy-request-id` header), once finished."""

        def find() -> Record | None:
            return next((r for r in list(self.app.recent.records) if r.id == rid), None)

        assert wait_for(lambda: find() is not None), f"no record for {rid}"
        rec = find()
        assert rec is not None
        return rec

    def only_record(self, model: str) -> Record:
        """The one finished record for `model` (a fault request has no request-id header
        when it broke before the response started... it always has one here)."""
        assert wait_for(lambda: any(r.model == model for r in self.app.recent.records)), f"no record for {model}"
        (rec,) = [r for r in self.app.recent.records if r.model == model]
        return rec

    @contextlib.contextmanager
    def healthy_stream_alongside(self) -> Iterator[None]:
        """A good stream in flight for the whole block; afterwards it must finish byte-exact and
        `ok`, and a fresh request must succeed too: the fault next to it took nothing down."""
        self.gate.clear()
        with (
            httpx.Client(timeout=30) as c,
            c.stream("POST", self.url + "/v1/chat/completions", json={**STREAM_REQ, "model": "healthy"}) as r,
        ):
            it = r.iter_raw()
            got = next(it)
            yield
            self.gate.set()
            got += b"".join(it)
            rid = r.headers["x-mlxproxy-request-id"]
        assert got == OK_BODY
        assert wait_for(lambda: any(x.id == rid and x.outcome == "ok" for x in self.app.recent.records))
        self.healthy_request()

    def healthy_request(self) -> None:
        r = httpx.post(self.url + "/v1/chat/completions", json={**STREAM_REQ, "model": "healthy-now"}, timeout=30)
        assert r.status_code == 200 and r.content == OK_BODY

    @contextlib.contextmanager
    def request_in_background(self, body: dict) -> Iterator:
        """POST `body` on a thread for the duration of the block; yields a function that
        returns its response (after the block)."""
        box: list = []
        th = threading.Thread(
            target=lambda: box.append(httpx.post(self.url + "/v1/chat/completions", json=body, timeout=30))
        )
        th.start()
        assert wait_for(lambda: len(self.app.in_flight) >= 1), "the background request never arrived"
        yield lambda: box[0]
        th.join(30)
        assert box, "the background request did not finish"


def wait_for(pred, timeout_s: float = 10.0) -> bool:
    return _wait_for(pred, timeout_s)


def ok_events(body: bytes) -> list[bytes]:
    return [e + b"\n\n" for e in body.split(b"\n\n") if e]


async def healthy_handler(req: Req, conn: Conn, gate: threading.Event | None) -> None:
    events = ok_events(OK_BODY)
    await conn.head(200, SSE_CHUNKED)
    await conn.chunk(events[0])
    if gate is not None:
        await conn.wait_gate(gate, 30)
    for e in events[1:]:
        await conn.chunk(e)
    await conn.end_chunked()


@contextlib.contextmanager
def rig(handlers: dict, *, extra_upstreams: list[dict] | None = None, **cfg) -> Iterator[Rig]:
    gate = threading.Event()

    async def dispatch(req: Req, conn: Conn) -> None:
        try:
            model = orjson.loads(req.body).get("model")
        except (orjson.JSONDecodeError, AttributeError):
            model = None
        if model == "healthy":
            await healthy_handler(req, conn, gate)
        elif model == "healthy-now":
            await healthy_handler(req, conn, None)
        else:
            await handlers[model if model in handlers else None](req, conn)

    with FakeUpstream(dispatch) as up:
        raw = {
            "upstreams": [*(extra_upstreams or []), {"name": "default", "url": up.url}],
            "default_upstream": "default",
        }
        config = build_config(raw, log_requests=False, **cfg)
        app = create_app(config)
        try:
            with ServerThread(app, server_header=False, date_header=False) as srv:
                yield Rig(srv, app, up, gate)
        finally:
            gate.set()
        assert not up.errors, up.errors


def read_all(url: str, body: dict, **kw) -> tuple[int, bytes, BaseException | None, httpx.Headers]:
    """POST and read the whole body; return the error instead of raising when the body breaks."""
    with (
        httpx.Client(timeout=kw.pop("timeout", 30)) as c,
        c.stream("POST", url + "/v1/chat/completions", json=body, **kw) as r,
    ):
        got = b""
        try:
            for part in r.iter_raw():
                got += part
        except httpx.HTTPError as exc:
            return r.status_code, got, exc, r.headers
        return r.status_code, got, None, r.headers


# -- upstream faults --------------------------------------------------------------------------


def test_connection_refused_gives_openai_502_and_others_keep_streaming() -> None:
    dead = {"name": "dead", "url": f"http://127.0.0.1:{closed_port()}", "models": ["dead"]}
    with rig({}, extra_upstreams=[dead]) as t, t.healthy_stream_alongside():
        r = httpx.post(t.url + "/v1/chat/completions", json={**STREAM_REQ, "model": "dead"})
        assert r.status_code == 502 and r.headers["content-type"] == "application/json"
        err = r.json()["error"]
        assert err["code"] == "upstream_unreachable" and err["type"] == "proxy_error" and "dead" in err["message"]
        rec = t.record(r.headers["x-mlxproxy-request-id"])
        assert (rec.outcome, rec.status, rec.upstream) == ("upstream_unreachable", None, "dead")


async def reset_at_once(req: Req, conn: Conn) -> None:
    conn.reset()


def test_reset_before_headers_gives_502() -> None:
    with rig({"reset": reset_at_once}) as t, t.healthy_stream_alongside():
        r = httpx.post(t.url + "/v1/chat/completions", json={**STREAM_REQ, "model": "reset"})
        assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_unreachable"
        rec = t.record(r.headers["x-mlxproxy-request-id"])
        assert rec.outcome == "upstream_unreachable" and rec.status is None


@pytest.mark.parametrize("http10", [False, True], ids=["chunked", "http10"])
def test_reset_mid_stream_breaks_the_client_body_too(http10: bool) -> None:
    async def handler(req: Req, conn: Conn) -> None:
        if http10:
            await conn.head(200, [("content-type", "text/event-stream")], version="1.0")
            await conn.send(EVENT_A)
        else:
            await conn.head(200, SSE_CHUNKED)
            await conn.chunk(EVENT_A)
        await conn.wait_gate(t.gate, 30)  # until the client has the first event
        conn.reset()

    with rig({"m": handler}) as t:
        with httpx.Client(timeout=30) as c, c.stream("POST", t.url + "/v1/chat/completions", json=STREAM_REQ) as r:
            it = r.iter_raw()
            first = next(it)
            t.gate.set()
            with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
                b"".join(it)
            assert r.status_code == 200 and first == EVENT_A
            rid = r.headers["x-mlxproxy-request-id"]
        rec = t.record(rid)
        assert rec.outcome == "truncated" and rec.generated_events == 1
        assert rec.error is not None and "ended abnormally" in rec.error
        with t.healthy_stream_alongside():
            pass


def test_truncated_chunked_body_reaches_the_client_truncated() -> None:
    async def handler(req: Req, conn: Conn) -> None:
        await conn.head(200, SSE_CHUNKED)
        await conn.chunk(EVENT_A)
        await conn.send(b"400\r\n" + FINISH)  # announces 1024 bytes, sends fewer, then closes
        conn.writer.close()

    with rig({"m": handler}) as t, t.healthy_stream_alongside():
        status, got, exc, headers = read_all(t.url, STREAM_REQ)
        assert status == 200 and got.startswith(EVENT_A) and isinstance(exc, httpx.RemoteProtocolError)
        assert got in (EVENT_A, EVENT_A + FINISH)
        rec = t.record(headers["x-mlxproxy-request-id"])
        assert rec.outcome in ("truncated", "ok_no_done") and rec.error is not None


@pytest.mark.parametrize("finish", [True, False], ids=["finish-no-done", "no-finish"])
@pytest.mark.parametrize("http10", [False, True], ids=["chunked", "http10-close"])
def test_body_ending_without_done_is_forwarded_as_a_clean_end(http10: bool, finish: bool) -> None:
    body = EVENT_A + (FINISH if finish else b"")

    async def handler(req: Req, conn: Conn) -> None:
        if http10:  # mlx_lm.server: HTTP/1.0, the body ends at connection close
            await conn.head(200, [("content-type", "text/event-stream")], version="1.0")
            await conn.send(body)
            conn.writer.close()
        else:
            await conn.head(200, SSE_CHUNKED)
            await conn.chunk(body)
            await conn.end_chunked()

    with rig({"m": handler}) as t, t.healthy_stream_alongside():
        status, got, exc, headers = read_all(t.url, STREAM_REQ)
        assert (status, got, exc) == (200, body, None)
        rec = t.record(headers["x-mlxproxy-request-id"])
        assert rec.outcome == ("ok_no_done" if finish else "truncated") and rec.error is None


def test_garbage_bytes_and_invalid_json_are_forwarded_unchanged() -> None:
    body = (
        b"\x00\xff\xfe garbage without structure\n\n"
        + EVENT_A
        + b"data: {not json\n\n"
        + b"data: \xff\xfe\xfd\n\n"
        + b"data: [1, 2\r\n\r\n"
        + b"event: x\nid: \x00\nretry: 99999999999999999999999999\n\n"
        + FINISH
        + b"data: [DONE]\n\n"
    )

    async def handler(req: Req, conn: Conn) -> None:
        await conn.head(200, SSE_CHUNKED)
        for i in range(0, len(body), 7):  # odd splits on the wire
            await conn.chunk(body[i : i + 7])
        await conn.end_chunked()

    with rig({"m": handler}) as t, t.healthy_stream_alongside():
        status, got, exc, headers = read_all(t.url, STREAM_REQ)
        assert (status, got, exc) == (200, body, None)
        rec = t.record(headers["x-mlxproxy-request-id"])
        assert rec.outcome == "protocol_error" and rec.generated_events == 1 and rec.finish_reason == "stop"


def test_500_with_an_html_body_passes_through() -> None:
    html = (
        b"<!DOCTYPE html><html><head><title>500 Internal Server Error</title></head><body><h1>Oops</h1></body></html>\n"
    )

    async def handler(req: Req, conn: Conn) -> None:
        await conn.head(500, [("content-type", "text/html; charset=utf-8"), ("content-length", str(len(html)))])
        await conn.send(html)

    with rig({"m": handler}) as t, t.healthy_stream_alongside():
        r = httpx.post(t.url + "/v1/chat/completions", json=STREAM_REQ)
        assert r.status_code == 500 and r.content == html and r.headers["content-type"].startswith("text/html")
        rec = t.record(r.headers["x-mlxproxy-request-id"])
        assert rec.outcome == "http_error" and rec.status == 500 and rec.error is not None and "Oops" in rec.error


def test_upstream_that_stalls_mid_stream_hits_the_read_timeout() -> None:
    async def handler(req: Req, conn: Conn) -> None:
        await conn.head(200, SSE_CHUNKED)
        await conn.chunk(EVENT_A)
        await conn.wait_peer_close(30)  # silent until the proxy gives up

    with rig({"m": handler}, timeouts={"read_s": 0.5}) as t:
        t0 = time.monotonic()
        status, got, exc, headers = read_all(t.url, STREAM_REQ)
        waited = time.monotonic() - t0
        assert status == 200 and got == EVENT_A and isinstance(exc, httpx.RemoteProtocolError)
        assert 0.4 <= waited < 20
        rec = t.record(headers["x-mlxproxy-request-id"])
        assert rec.outcome == "upstream_timeout" and rec.generated_events == 1 and "read timeout" in (rec.error or "")
        with t.healthy_stream_alongside():
            pass


def test_upstream_that_accepts_and_never_answers_gives_504() -> None:
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # the kernel completes the handshake; nobody ever reads or answers
    try:
        mute = {"name": "mute", "url": f"http://127.0.0.1:{silent.getsockname()[1]}", "models": ["mute"]}
        with rig({}, extra_upstreams=[mute], timeouts={"read_s": 0.5}) as t:
            t0 = time.monotonic()
            with t.request_in_background({**STREAM_REQ, "model": "mute"}) as result:
                t.healthy_request()  # served while the other one waits
            r = result()
            assert 0.4 <= time.monotonic() - t0 < 20
            assert r.status_code == 504 and r.json()["error"]["code"] == "upstream_timeout"
            rec = t.record(r.headers["x-mlxproxy-request-id"])
            assert rec.outcome == "upstream_timeout" and rec.status is None
    finally:
        silent.close()


FIFTY_MB = 50 * 1024 * 1024


@pytest.mark.parametrize("kind", ["stream", "stream-usage-injected", "non-stream", "endless-event-usage-injected"])
def test_a_50_mb_line_without_newline_is_forwarded_in_bounded_memory(kind: str) -> None:
    """50 MiB in one line (or, `endless-event`, in 1 KiB `data:` lines that never end their
    event): forwarded byte for byte, while the proxy holds only bounded buffers."""
    block = b"x" * (1024 * 1024)
    head = b"data: " if kind != "non-stream" else b'{"choices": "'
    if kind.startswith("endless-event"):
        block = (b"data: " + b"y" * 1017 + b"\n") * 1024
        head = EVENT_A + b"data: a\n"
    ctype = "application/json" if kind == "non-stream" else "text/event-stream"

    async def handler(req: Req, conn: Conn) -> None:
        await conn.head(200, [("content-type", ctype), ("transfer-encoding", "chunked")])
        await conn.chunk(head)
        for _ in range(FIFTY_MB // len(block)):
            await conn.chunk(block)
        await conn.end_chunked()

    body = {**STREAM_REQ, "stream": kind != "non-stream"}
    if kind.endswith("usage-injected"):
        del body["stream_options"]
    with rig({"m": handler}) as t:
        gc.collect()
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            with httpx.Client(timeout=60) as c, c.stream("POST", t.url + "/v1/chat/completions", json=body) as r:
                n = 0
                first = b""
                for part in r.iter_raw():
                    if len(first) < 16:
                        first += part[:16]
                    n += len(part)
                rid = r.headers["x-mlxproxy-request-id"]
            peak = tracemalloc.get_traced_memory()[1] - base
        finally:
            tracemalloc.stop()
        assert n == len(head) + FIFTY_MB and first[: len(head)][:16] == head[:16]
        rec = t.record(rid)
        # a stream line over the decoder's bound is a protocol error; a non-stream body over
        # the meter's parse bound is not judged (meter.MAX_BUFFERED_BODY_BYTES)
        assert rec.outcome == ("ok" if kind == "non-stream" else "protocol_error") and rec.bytes_out == n
        # the whole process (proxy, upstream and client threads) never held the body: a few
        # bounded buffers (SSE line bound 4 MiB, non-stream parse bound 16 MiB) at most
        assert peak < 40 * 1024 * 1024, f"peak traced memory {peak / 2**20:.1f} MiB"
        print(f"{kind}: peak {peak / 2**20:.1f} MiB")
        with t.healthy_stream_alongside():
            pass


# -- the simulator's fault switches, per server style ---------------------------------------------


@contextlib.contextmanager
def proxied_sim(profile: str, **cfg) -> Iterator[tuple[str, ProxyApp]]:
    from mlxproxy.sim.app import create_app as create_sim

    with ServerThread(create_sim(profile, speed=50.0)) as sim:
        app = create_app(build_config(upstream_url=sim.url, log_requests=False, **cfg))
        with ServerThread(app, server_header=False, date_header=False) as srv:
            yield srv.url, app


SIM_CASES = [
    # profile, X-Sim-Fault, status the client gets, how its body ends, outcome of the record
    ("healthy", "http-error=500", 500, "complete", "http_error"),
    ("mlx-lm", "http-error=404", 404, "complete", "http_error"),
    ("healthy", "reset-before-headers", 502, "proxy-error", "upstream_unreachable"),
    ("healthy", "reset-mid-stream@3", 200, "broken", "truncated"),
    ("healthy", "malformed@3", 200, "done", "protocol_error"),
    ("healthy", "stream-error@3", 200, "complete", "stream_error"),
    ("mlx-openai-server", "stream-error@3", 200, "done", "stream_error"),  # error, then finish "stop" and [DONE]
    ("vllm-mlx", "stream-error@3", 200, "done", "truncated"),  # [DONE] with no finish_reason
    ("mlx-vlm", "stream-error@3", 200, "complete", "stream_error"),  # {"error": "str"}, no [DONE]
    ("mlx-lm", "stream-error@3", 200, "broken", "truncated"),  # the connection just closes
    ("healthy", "stall=1.5@3", 200, "broken", "upstream_timeout"),  # read_s 0.5 below
]


@pytest.mark.parametrize("profile,fault,status,ending,outcome", SIM_CASES, ids=[f"{c[0]}:{c[1]}" for c in SIM_CASES])
def test_simulator_faults_through_the_proxy(profile: str, fault: str, status: int, ending: str, outcome: str) -> None:
    body = {
        "model": "m",
        "stream": True,
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "hello there"}],
        "stream_options": {"include_usage": True},
    }
    with proxied_sim(profile, timeouts={"read_s": 0.5}) as (url, app):
        other: list[tuple] = []
        healthy = threading.Thread(target=lambda: other.append(read_all(url, body)))
        healthy.start()  # a healthy stream at the same time
        got_status, got, exc, headers = read_all(url, body, headers={"x-sim-fault": fault})
        healthy.join(30)
        assert got_status == status
        if ending == "broken":
            assert exc is not None and got  # the client sees the body break, after what was sent
        else:
            assert exc is None
        if ending == "done":
            assert got.endswith(b"data: [DONE]\n\n")
        if ending == "proxy-error":
            assert orjson.loads(got)["error"]["code"] == "upstream_unreachable"
        rid = headers["x-mlxproxy-request-id"]
        assert wait_for(lambda: any(r.id == rid for r in app.recent.records))
        rec = next(r for r in app.recent.records if r.id == rid)
        assert rec.outcome == outcome, (rec.outcome, rec.error)
        ((o_status, o_body, o_exc, _),) = other
        assert (o_status, o_exc) == (200, None) and o_body.endswith(b"data: [DONE]\n\n")


@pytest.mark.parametrize("injected", [False, True], ids=["passthrough", "usage-injected"])
@pytest.mark.parametrize("where", ["meter", "decoder"])
def test_a_metering_failure_never_breaks_the_stream(
    where: str, injected: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug that makes the meter raise mid-stream: the stream is still forwarded whole
    (stripping the injected usage event stops with the metering), the record says
    `protocol_error`, and the proxy goes on serving."""
    target, name = (RequestMeter, "feed_items") if where == "meter" else (SSEDecoder, "feed")
    real = getattr(target, name)
    calls = [0]
    first_fed = threading.Event()

    def breaks_on_the_second_call(self, *args):
        calls[0] += 1
        first_fed.set()
        if calls[0] == 2:
            raise ValueError("a metering bug")
        return real(self, *args)

    async def per_event(req: Req, conn: Conn) -> None:
        await conn.head(200, SSE_CHUNKED)
        first, *rest = ok_events(OK_BODY)
        await conn.chunk(first)
        await conn.wait_gate(first_fed, 30)  # the rest arrives in a later read, so there is a second call
        for e in rest:
            await conn.chunk(e)
        await conn.end_chunked()

    usage = [e for e in ok_events(OK_BODY) if b'"choices":[]' in e][0]
    body = {**STREAM_REQ}
    if injected:
        del body["stream_options"]
    with rig({"m": per_event}) as t:
        monkeypatch.setattr(target, name, breaks_on_the_second_call)
        status, got, exc, headers = read_all(t.url, body)
        monkeypatch.setattr(target, name, real)
        assert (status, exc) == (200, None) and got in (OK_BODY, OK_BODY.replace(usage, b""))
        rec = t.record(headers["x-mlxproxy-request-id"])
        assert rec.outcome == "protocol_error" and rec.error == "metering failed: ValueError"
        with t.healthy_stream_alongside():
            pass


@pytest.mark.parametrize("injected", [False, True], ids=["passthrough", "usage-injected"])
def test_the_client_has_each_event_before_the_meter_parses_it(injected: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Forward first, meter after, also where the proxy strips the usage event it injected
    (only the SSE framing is read first there): the meter's parse of the first event waits,
    blocking the proxy's loop, until the client says it has that event. A proxy that metered
    first would never let the event out and the wait would run out."""
    real = RequestMeter.feed_items
    client_has_it = threading.Event()
    waits: list[bool] = []

    def after_the_client(self, items, t):
        if not waits and any(isinstance(i, SSEEvent) for i in items):
            waits.append(client_has_it.wait(10))
        return real(self, items, t)

    async def per_event(req: Req, conn: Conn) -> None:
        await conn.head(200, SSE_CHUNKED)
        for e in ok_events(OK_BODY):
            await conn.chunk(e)
        await conn.end_chunked()

    body = {**STREAM_REQ}
    if injected:
        del body["stream_options"]
    with rig({"m": per_event}) as t:
        monkeypatch.setattr(RequestMeter, "feed_items", after_the_client)
        with httpx.Client(timeout=30) as c, c.stream("POST", t.url + "/v1/chat/completions", json=body) as r:
            lines = []
            for line in r.iter_lines():
                if line.startswith("data: "):
                    client_has_it.set()
                lines.append(line)
            rid = r.headers["x-mlxproxy-request-id"]
        assert waits == [True]  # the client had the event while the meter had not parsed it yet
        assert [x for x in lines if x][-1] == "data: [DONE]"
        rec = t.record(rid)
        assert (rec.outcome, rec.generated_events, rec.completion_tokens_reported) == ("ok", 2, 2)  # "Hello", " world"


def test_a_comment_with_thousands_of_digits_is_forwarded_whole() -> None:
    """The real trigger of a meter bug (int() of 5000 digits): the bytes still pass."""
    body = b": keepalive " + b"1" * 5000 + b"/2\n\n" + EVENT_A + FINISH + b"data: [DONE]\n\n"

    async def handler(req: Req, conn: Conn) -> None:
        await conn.head(200, SSE_CHUNKED)
        await conn.chunk(body)
        await conn.end_chunked()

    with rig({"m": handler}) as t, t.healthy_stream_alongside():
        status, got, exc, headers = read_all(t.url, STREAM_REQ)
        assert (status, got, exc) == (200, body, None)
        assert t.record(headers["x-mlxproxy-request-id"]).outcome in ("ok", "protocol_error")


# -- client faults ----------------------------------------------------------------------------


def raw_post(
    rig_url: str,
    body: bytes,
    *,
    path: str = "/v1/chat/completions",
    method: str = "POST",
    headers: dict[str, str] | None = None,
    rcvbuf: int | None = None,
) -> socket.socket:
    """Send one request on a raw socket (so the test decides when to read and when to go)."""
    port = int(rig_url.rsplit(":", 1)[1])
    s = socket.socket()
    if rcvbuf is not None:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.connect(("127.0.0.1", port))
    head = {
        "host": "127.0.0.1",
        "content-type": "application/json",
        "content-length": str(len(body)),
        **(headers or {}),
    }
    s.sendall(
        f"{method} {path} HTTP/1.1\r\n".encode()
        + b"".join(f"{k}: {v}\r\n".encode() for k, v in head.items())
        + b"\r\n"
        + body
    )
    return s


def warmed(t: Rig) -> int:
    """Serve one request so everything created lazily exists; the loop's task count then."""
    t.healthy_request()
    assert t.settled(10**9)
    return t.tasks()


@pytest.mark.parametrize("when", ["before-headers", "during-prefill-keepalives", "mid-stream"])
def test_client_disconnect_cancels_the_upstream_request_and_leaks_nothing(when: str) -> None:
    """The client goes while the upstream is silent in a long prefill (no headers yet), while
    it sends only `: keepalive` progress, or mid-stream: each time the proxy closes the
    upstream connection, records `client_disconnect`, and leaves no task or connection."""
    closed: list[bool] = []
    received: list[bool] = []

    async def upstream(req: Req, conn: Conn) -> None:
        received.append(True)
        if when != "before-headers":
            await conn.head(200, SSE_CHUNKED)
            await conn.chunk(b": keepalive 1/100\n\n" if when == "during-prefill-keepalives" else EVENT_A)
        closed.append(await conn.wait_peer_close(30))

    body = orjson.dumps(STREAM_REQ)
    with rig({"m": upstream}) as t:
        tasks_before = warmed(t)
        for i in range(5):
            s = raw_post(t.url, body)
            if when == "before-headers":  # the upstream has the request and is "prefilling"
                assert wait_for(lambda: len(t.app.in_flight) == 1 and len(received) == i + 1)  # noqa: B023
            else:  # the client has the headers and the first event (or keepalive)
                got = b""
                while b"\r\n\r\n" not in got or not (b"keepalive" in got or b"data:" in got):
                    part = s.recv(65536)
                    assert part, got
                    got += part
                assert got.startswith(b"HTTP/1.1 200")
            s.close()
            assert wait_for(lambda: len(closed) == i + 1) and all(closed), "the upstream request was not cancelled"  # noqa: B023
            assert wait_for(lambda: not t.app.in_flight)  # so that the next in_flight == 1 is the next request
        recs = t.records(6)[1:]
        assert {r.outcome for r in recs} == {"client_disconnect"}
        if when == "before-headers":
            assert all(r.status is None and r.headers_s is None for r in recs)
        elif when == "during-prefill-keepalives":
            assert all(r.ttft_s is None and r.prefill_progress == (1, 100) for r in recs)
        else:
            assert all(r.generated_events == 1 for r in recs)
        assert t.settled(tasks_before), (t.app.in_flight, t.busy_upstream_connections(), t.tasks(), tasks_before)
        with t.healthy_stream_alongside():
            pass


def test_client_leaving_after_done_is_not_a_disconnect() -> None:
    """The OpenAI SDK closes its connection at `data: [DONE]`; an HTTP/1.0 upstream closes
    its socket a moment later. The stream was complete: the record says `ok`."""
    body = EVENT_A + FINISH + b"data: [DONE]\n\n"
    client_done = threading.Event()

    async def mlx_lm_like(req: Req, conn: Conn) -> None:
        await conn.head(200, [("content-type", "text/event-stream")], version="1.0")
        await conn.send(body)
        await conn.wait_gate(client_done, 30)
        conn.writer.close()

    with rig({"m": mlx_lm_like}) as t:
        try:
            with httpx.Client(timeout=30) as c, c.stream("POST", t.url + "/v1/chat/completions", json=STREAM_REQ) as r:
                got = b""
                for part in r.iter_raw():
                    got += part
                    if got.endswith(b"data: [DONE]\n\n"):
                        break  # and close, as the SDK does
                rid = r.headers["x-mlxproxy-request-id"]
            assert got == body
        finally:
            client_done.set()
        rec = t.record(rid)
        assert rec.outcome == "ok" and rec.error is None


def test_client_leaving_after_an_error_event_keeps_the_servers_error() -> None:
    """The OpenAI SDK raises at an in-stream error event and closes its connection; mlx-vlm
    sends ``{"error": ...}`` with no [DONE]. Whether the proxy sees the client leave before
    the upstream's end is a race: either way the record says what the server said."""
    error_event = b'data: {"error": "Generation ended with an incomplete tool call."}\n\n'
    body = EVENT_A + error_event
    client_done = threading.Event()

    async def held_open(req: Req, conn: Conn) -> None:
        await conn.head(200, SSE_CHUNKED)
        await conn.chunk(body)
        await conn.wait_gate(client_done, 30)  # the end comes only after the client has left
        await conn.end_chunked()

    with rig({"m": held_open}) as t:
        try:
            with httpx.Client(timeout=30) as c, c.stream("POST", t.url + "/v1/chat/completions", json=STREAM_REQ) as r:
                got = b""
                for part in r.iter_raw():
                    got += part
                    if got.endswith(error_event):
                        break  # and close, as the SDK does
                rid = r.headers["x-mlxproxy-request-id"]
            assert got == body
            rec = t.record(rid)
        finally:
            client_done.set()
        assert rec.outcome == "stream_error", rec
        assert rec.error == "Generation ended with an incomplete tool call."
        assert "stream_error" in rec.anomalies


def test_slow_reading_client_pushes_back_on_the_upstream_with_bounded_buffers() -> None:
    """A client that stops reading stops the upstream too (TCP back-pressure through the
    proxy), with only socket buffers and a bounded amount in the proxy in between; when it
    reads again it gets every byte."""
    total = 64 * 1024 * 1024
    # keep-alive comments: as many bytes as tokens would be, without metering tokens (the
    # meter compares each content event with the whole answer so far, quadratic in length)
    block = (b": " + b"x" * 1022 + b"\n\n") * 64
    sent = [0]

    async def firehose(req: Req, conn: Conn) -> None:
        await conn.head(200, SSE_CHUNKED)
        while sent[0] < total:
            await conn.chunk(block)  # waits (drain) whenever the proxy stops reading
            sent[0] += len(block)
        await conn.chunk(FINISH + b"data: [DONE]\n\n")
        await conn.end_chunked()

    with rig({"m": firehose}) as t:
        gc.collect()
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            s = raw_post(t.url, orjson.dumps(STREAM_REQ), rcvbuf=64 * 1024)
            first = s.recv(4096)  # then stop reading, as a client stuck in its own work does
            assert first.startswith(b"HTTP/1.1 200")
            last, still = -1, 0
            deadline = time.monotonic() + 30
            while still < 50 and time.monotonic() < deadline:  # until the upstream has been blocked for a while
                still = still + 1 if sent[0] == last else 0
                last = sent[0]
                time.sleep(0.01)
            held = tracemalloc.get_traced_memory()[0] - base
        finally:
            tracemalloc.stop()
        blocked_at = sent[0]
        assert still >= 50, "the upstream never stopped sending"
        # socket buffers on two loopback hops are all that fills up; the proxy holds little
        assert blocked_at < 48 * 1024 * 1024, f"upstream got {blocked_at / 2**20:.0f} MiB ahead of a stalled client"
        assert held < 16 * 1024 * 1024, f"{held / 2**20:.1f} MiB held while the client stalled"
        n = len(first)
        s.settimeout(30)
        tail = b""
        while True:
            data = s.recv(1 << 20)
            if not data:
                break
            n += len(data)
            tail = (tail + data)[-64:]
            if tail.endswith(b"0\r\n\r\n"):
                break
        s.close()
        (rec,) = t.records(1)
        assert rec.outcome == "ok" and rec.bytes_out == sent[0] + len(FINISH) + len(b"data: [DONE]\n\n")
        print(
            f"slow reader: upstream blocked at {blocked_at / 2**20:.1f} MiB, proxy process held {held / 2**20:.1f} MiB"
        )


def test_malformed_request_bodies_are_forwarded_unchanged() -> None:
    """The proxy does not judge request bodies: the upstream does, and its answer passes."""

    async def strict(req: Req, conn: Conn) -> None:
        err = orjson.dumps(
            {"error": {"message": f"bad body of {len(req.body)} bytes", "type": "invalid_request_error"}}
        )
        await conn.head(400, [("content-type", "application/json"), ("content-length", str(len(err)))])
        await conn.send(err)

    bodies = [
        b"{not json",
        b"\xff\xfe\x00",
        b"[1, 2, 3]",
        b'{"model": 5, "stream": "yes", "messages": "x", "stream_options": 7}',
        b'{"stream": true, "messages": [',
        b"",
        b'"just a string"',
        b"{" * 10000,
    ]
    with rig({None: strict}) as t, t.healthy_stream_alongside():
        for body in bodies:
            r = httpx.post(t.url + "/v1/chat/completions", content=body, headers={"content-type": "application/json"})
            assert r.status_code == 400 and r.json()["error"]["message"] == f"bad body of {len(body)} bytes"
            assert t.upstream.requests[-1].body == body
            rec = t.record(r.headers["x-mlxproxy-request-id"])
            assert rec.outcome == "http_error" and rec.status == 400


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked-upload"])
def test_huge_request_body_gets_413_with_a_clear_message(declared: bool) -> None:
    limit = 1024 * 1024
    with (
        rig({"m": lambda req, conn: healthy_handler(req, conn, None)}, max_request_body_bytes=limit) as t,
        t.healthy_stream_alongside(),
    ):
        n_upstream = len(t.upstream.requests)
        big = b'{"model": "m", "messages": [{"role": "user", "content": "' + b"x" * (8 * limit) + b'"}]}'
        content = big if declared else iter([big[i : i + 65536] for i in range(0, len(big), 65536)])
        r = httpx.post(t.url + "/v1/chat/completions", content=content, headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.headers["content-type"] == "application/json"
        err = r.json()["error"]
        assert err["code"] == "request_too_large" and err["type"] == "invalid_request_error"
        assert "max_request_body_bytes" in err["message"] and str(limit) in err["message"]
        assert len(t.upstream.requests) == n_upstream  # nothing was forwarded
        ok = (
            b'{"model": "m", "stream": true, "stream_options": {"include_usage": true}, "x": "'
            + b"y" * (limit - 200)
            + b'"}'
        )
        r = httpx.post(t.url + "/v1/chat/completions", content=ok, headers={"content-type": "application/json"})
        assert r.status_code == 200 and t.upstream.requests[-1].body == ok  # just under the limit goes through


def test_wrong_methods_and_unknown_paths() -> None:
    """Every path but the proxy's own is forwarded with its method; the upstream's answer
    (404, 405, ...) passes unchanged. The proxy's own routes answer GET/HEAD only."""

    async def picky(req: Req, conn: Conn) -> None:
        if req.path.startswith("/v1/chat/completions") and req.method == "POST":
            await healthy_handler(req, conn, None)
            return
        status, body = (405, b"Method Not Allowed") if req.path.startswith("/v1/chat") else (404, b"Not Found")
        await conn.head(status, [("content-type", "application/json"), ("content-length", str(len(body)))])
        await conn.send(body)  # mlx_lm.server's plain-text 404 under a JSON content type

    with rig({None: picky}) as t, t.healthy_stream_alongside():
        for method, path, status in [
            ("GET", "/v1/chat/completions", 405),
            ("DELETE", "/v1/chat/completions", 405),
            ("PUT", "/v1/nope", 404),
            ("GET", "/nope/../x?y=1", 404),
            ("PATCH", "/v2", 404),
        ]:
            r = httpx.request(method, t.url + path)
            assert r.status_code == status and r.content in (b"Not Found", b"Method Not Allowed")
            assert t.upstream.requests[-1].method == method
            rec = t.record(r.headers["x-mlxproxy-request-id"])
            assert rec.outcome == "http_error" and rec.method == method
        for method in ["POST", "PUT", "DELETE", "OPTIONS"]:
            for route in ["/metrics", "/healthz", "/streams", "/", "/ui/app.js"]:
                r = httpx.request(method, t.url + route)
                assert r.status_code == 405 and r.headers["allow"] == "GET, HEAD"
                assert r.json()["error"]["code"] == "method_not_allowed"
        assert httpx.head(t.url + "/healthz").status_code == 200


# -- capture durability -------------------------------------------------------------------------


def a_record(i: int) -> Record:
    return Record(
        id=f"r{i}",
        started_at=0.0,
        upstream="u",
        model="m",
        endpoint="chat_completions",
        stream=True,
        status=200,
        outcome="ok",
        t_start_mono=float(i),
    )


class FlakyDisk:
    """A capture file on a disk that fills up: while `full`, each write stores half of what
    it is given and then fails with ENOSPC, as a real full disk can."""

    def __init__(self, real) -> None:
        self.real = real
        self.full = False

    def write(self, data) -> int:
        if self.full:
            self.real.write(bytes(data[: max(1, len(data) // 2)]))
            raise OSError(28, "No space left on device")
        return self.real.write(data)

    def fileno(self) -> int:
        return self.real.fileno()

    def close(self) -> None:
        self.real.close()


def test_capture_on_a_full_disk_counts_reports_once_and_keeps_whole_lines(tmp_path: Path, caplog) -> None:
    errors: list[int] = []
    w = CaptureWriter(tmp_path / "c.jsonl", on_error=lambda: errors.append(1))
    disk = w._file = FlakyDisk(w._file)
    for i in range(30):
        disk.full = 10 <= i < 20  # full for a while, then space comes back
        w.on_record(a_record(i), None)
        w.flush()
    w.close()
    assert (w.written, w.write_errors, len(errors)) == (20, 10, 10)
    assert sum("capture to" in r.getMessage() for r in caplog.records) == 1
    assert [c.record.id for c in read_capture(tmp_path / "c.jsonl")] == [f"r{i}" for i in [*range(10), *range(20, 30)]]


def test_capture_reopened_after_a_crash_cuts_off_the_torn_line(tmp_path: Path, caplog) -> None:
    p = tmp_path / "c.jsonl"
    w = CaptureWriter(p)
    for i in range(3):
        w.on_record(a_record(i), None)
    w.close()
    whole = p.read_bytes()
    p.write_bytes(whole + whole.splitlines(keepends=True)[0][:50])  # killed while writing a fourth line
    warnings: list[str] = []
    assert len(read_capture(p, warn=warnings.append)) == 3 and "torn last line" in warnings[0]
    w = CaptureWriter(p)  # a restarted proxy appends to the same file
    w.on_record(a_record(3), None)
    w.close()
    assert [c.record.id for c in read_capture(p)] == ["r0", "r1", "r2", "r3"]
    assert any("torn line" in r.getMessage() for r in caplog.records)


def test_unwritable_capture_path_never_stops_the_proxy(tmp_path: Path, caplog) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the capture's directory should be")
    with rig({"m": lambda req, conn: healthy_handler(req, conn, None)}, capture=str(blocker / "cap.jsonl")) as t:
        for _ in range(3):
            r = httpx.post(t.url + "/v1/chat/completions", json=STREAM_REQ)
            assert r.status_code == 200 and r.content == OK_BODY
        assert wait_for(lambda: t.app.registry.get_sample_value("mlxproxy_capture_errors_total") == 3)
    assert sum("capture to" in r.getMessage() for r in caplog.records) == 1


def test_a_stuck_capture_disk_never_slows_streams(tmp_path: Path) -> None:
    """The capture's disk hangs (a stalled network mount): streams keep flowing, records
    that do not fit the capture queue are dropped and counted, and the rest are written
    once the disk comes back."""
    stuck = threading.Event()
    with rig(
        {"m": lambda req, conn: healthy_handler(req, conn, None)},
        capture=str(tmp_path / "c.jsonl"),
        capture_queue_size=4,
    ) as t:
        assert t.app.capture is not None
        real_write = t.app.capture._file.write
        t.app.capture._file.write = lambda data: (stuck.wait(30), real_write(data))[1]
        for _ in range(20):
            r = httpx.post(t.url + "/v1/chat/completions", json=STREAM_REQ, timeout=10)
            assert r.status_code == 200 and r.content == OK_BODY
        assert len(t.records(20)) == 20
        dropped = t.app.registry.get_sample_value("mlxproxy_capture_dropped_total")
        assert dropped is not None and 20 - 4 - 1 <= dropped < 20  # the queue, plus the one stuck in write
        stuck.set()
        assert wait_for(lambda: t.app.capture is not None and t.app.capture.written == 20 - dropped)


def start_proxy_process(upstream_url: str, *args: str, **popen) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlxproxy", "serve", "--upstream", upstream_url, "--port", "0", *args],
        stderr=subprocess.PIPE,
        text=True,
        **popen,
    )
    for line in proc.stderr:  # type: ignore[union-attr]
        if "listening on http://127.0.0.1:" in line:
            return proc, "http://127.0.0.1:" + line.split("http://127.0.0.1:")[1].split("/")[0]
    raise AssertionError(f"the proxy did not start (exit {proc.wait(10)})")


def test_disk_full_in_a_real_process_never_blocks_streams(tmp_path: Path) -> None:
    """`mlxproxy serve` with a capture whose file may not grow past 8 KiB (RLIMIT_FSIZE: the
    kernel writes part of a line, then refuses with EFBIG, as on a full disk)."""
    resource = pytest.importorskip("resource")
    cap = tmp_path / "cap.jsonl"

    def limit_file_size() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (8192, 8192))

    with FakeUpstream(lambda req, conn: healthy_handler(req, conn, None)) as up:
        proc, url = start_proxy_process(
            up.url, "--capture", str(cap), "--log-level", "warning", preexec_fn=limit_file_size
        )
        try:
            with httpx.Client(timeout=30) as c:
                for _ in range(30):
                    r = c.post(url + "/v1/chat/completions", json=STREAM_REQ)
                    assert r.status_code == 200 and r.content == OK_BODY
                assert wait_for(lambda: c.get(url + "/healthz").json()["in_flight"] == 0)

                def sample(name: str) -> float:
                    for line in c.get(url + "/metrics").text.splitlines():
                        if line.startswith(name + " "):
                            return float(line.split()[1])
                    return 0.0

                lines = len(read_capture(cap))
                assert wait_for(lambda: sample("mlxproxy_capture_errors_total") + len(read_capture(cap)) == 30)
        finally:
            proc.terminate()
            err = proc.communicate(timeout=10)[1]
    assert 0 < lines < 30 and cap.stat().st_size <= 8192
    assert err.count("capture to") == 1, err
    assert all(c.record.outcome == "ok" for c in read_capture(cap))  # whole lines only: nothing torn


def test_kill_9_under_load_loses_only_queued_records(tmp_path: Path) -> None:
    """Streams complete concurrently while the proxy is killed with SIGKILL: the capture
    holds only whole lines (a torn last one at most, skipped with a warning), no record
    twice, and at least every record whose line was already written before the kill."""
    cap = tmp_path / "cap.jsonl"
    with FakeUpstream(lambda req, conn: healthy_handler(req, conn, None)) as up:
        proc, url = start_proxy_process(up.url, "--capture", str(cap), "--log-level", "error")
        stop = threading.Event()
        completed = [0]

        def client() -> None:
            with httpx.Client(timeout=10) as c:
                while not stop.is_set():
                    try:
                        if c.post(url + "/v1/chat/completions", json=STREAM_REQ).content == OK_BODY:
                            completed[0] += 1
                    except httpx.HTTPError:
                        return  # the proxy is gone

        threads = [threading.Thread(target=client) for _ in range(8)]
        try:
            for th in threads:
                th.start()
            assert wait_for(lambda: cap.exists() and cap.read_bytes().count(b"\n") >= 200, 30)
            seen_before_kill = cap.read_bytes().count(b"\n")
            proc.send_signal(signal.SIGKILL)  # while lines are being written
            proc.wait(10)
        finally:
            stop.set()
            for th in threads:
                th.join(10)
            if proc.poll() is None:
                proc.kill()
    warnings: list[str] = []
    caps = read_capture(cap, warn=warnings.append)
    assert len(caps) >= seen_before_kill and len(caps) <= completed[0] + 8
    assert len({c.record.id for c in caps}) == len(caps) and all(c.record.outcome in OUTCOMES for c in caps)
    assert len(warnings) <= 1


# -- parser robustness (the sans-I/O core) -----------------------------------------------------


# pieces that real streams are made of, so random byte strings reach deep into the parsers
WIRE_PIECES = [
    b"data: ",
    b"data:",
    b"\n",
    b"\r",
    b"\r\n",
    b"\n\n",
    b": keepalive 12/",
    b"34",
    b"[DONE]",
    b"{",
    b"}",
    b'"choices":[',
    b"]",
    b'{"index":0,"delta":{"role":"assistant","content":"a","reasoning":"r","reasoning_content":"r2",'
    b'"tool_calls":[{"index":0,"id":"c","function":{"name":"f","arguments":"{"}}]},"finish_reason":"stop"}',
    b'"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5,"prompt_tokens_details":{"cached_tokens":1}}',
    b",",
    b'"error":{"message":"boom"}',
    b'"error":"x"',
    b'"detail":[{"msg":"m"}]',
    b"\xff\xfe",
    b"\xe2\x98",
    b"id: 1\n",
    b"event: e\n",
    b"retry: 5\n",
    b'"text":"t"',
    b'"timings":{"predicted_per_second":3}',
    b"null",
    b"1e999",
    b"-0",
    b"\x00",
    b"\xef\xbb\xbf",
    b"x" * 70,
]
wire_bytes = st.one_of(
    st.binary(max_size=300),
    st.lists(st.one_of(st.sampled_from(WIRE_PIECES), st.binary(max_size=8)), max_size=40).map(b"".join),
)
cut_points = st.lists(st.integers(min_value=0, max_value=2000), max_size=10)
LINE_BOUND = 64


def cut(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c for c in cuts if 0 < c < len(data)})
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)])]


def held_by_decoder(dec: SSEDecoder) -> tuple[int, int]:
    """(bytes of partial line held, characters of event data held)."""
    return len(dec._buf), sum(map(len, dec._data))  # characters: at most one per byte received


def decode_all(parts: list[bytes], bound: int = LINE_BOUND) -> list:
    dec = SSEDecoder(bound)
    out = []
    for p in parts:
        out.extend(dec.feed(p))
        line, data = held_by_decoder(dec)
        assert line <= bound and data <= bound
    return out + dec.close()


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(wire_bytes, cut_points)
def test_decoder_any_bytes_any_split_never_raises_stays_bounded_and_agrees(data: bytes, cuts: list[int]) -> None:
    assert decode_all(cut(data, cuts)) == decode_all([data])


def test_decoder_drops_an_over_long_line_or_event_with_the_rest_of_its_event() -> None:
    long = b"z" * 100
    body = (
        b"data: a\n"
        + long
        + b"\ndata: b\n\n"  # a long line inside an event: the whole event goes
        + b"data: c\n\n"
        + b"data: 0123456789\n" * 10
        + b"\n"  # an event over the bound in many short lines
        + b"id: 1\n"
        + b"junk\n" * 20
        + b"\n"  # ... or in lines that are not data
        + b"data: d\n\n"
    )
    for parts in [[body], [body[i : i + 1] for i in range(len(body))], cut(body, [5, 9, 50, 101, 130, 200])]:
        out = decode_all(parts)
        assert [type(x).__name__ for x in out] == [
            "SSEProtocolError",
            "SSEEvent",
            "SSEProtocolError",
            "SSEProtocolError",
            "SSEEvent",
        ]
        assert [x.data for x in out if isinstance(x, SSEEvent)] == ["c", "d"]
    assert decode_all([b"\xef\xbb\xbf\n"]) == []  # a BOM alone is a blank line (it raised IndexError)
    digits = b"retry: " + b"9" * 5000 + b"\ndata: e\n\n"  # int() refuses this many digits
    (event,) = decode_all([digits], bound=10_000)
    assert event.data == "e" and event.retry is None


def run_meter(
    req: tuple[str, str, bytes], resp: tuple[int, str | None], parts: list[bytes], bound: int = LINE_BOUND
) -> Record:
    info, _ = parse_request(*req)
    m = RequestMeter(
        info, request_id="r", upstream="u", t_start=0.0, started_at=0.0, keep_text=True, max_line_bytes=bound
    )
    m.upstream_sent(0.0)
    m.response_started(0.5, *resp)
    for p in parts:
        m.feed(p, 1.0)  # one timestamp for every read: a split must not change any figure
        if m.decoder is not None:
            line, data = held_by_decoder(m.decoder)
            assert line <= bound and data <= bound
        assert len(m._body) <= meter_module.MAX_BUFFERED_BODY_BYTES
    return m.finish(2.0)


REQUESTS = st.sampled_from(
    [
        ("POST", "/v1/chat/completions", b'{"model":"m","stream":true,"max_tokens":2}'),
        ("POST", "/v1/chat/completions", b'{"model":"m"}'),
        ("POST", "/v1/completions", b'{"stream":true}'),
        ("GET", "/v1/models", b""),
        ("POST", "/x", b"not json"),
    ]
)
RESPONSES = st.sampled_from(
    [
        (200, "text/event-stream"),
        (200, "application/json"),
        (500, "text/html"),
        (400, "application/json"),
        (200, None),
        (404, "text/event-stream; charset=utf-8"),
    ]
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(REQUESTS, RESPONSES, wire_bytes, cut_points)
def test_meter_any_bytes_any_split_never_raises_stays_bounded_and_agrees(
    req,
    resp,
    data: bytes,
    cuts: list[int],
) -> None:
    whole = run_meter(req, resp, [data])
    assert run_meter(req, resp, cut(data, cuts)) == whole
    assert whole.bytes_out == len(data)


def test_meter_non_stream_body_buffer_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(meter_module, "MAX_BUFFERED_BODY_BYTES", 100)
    rec = run_meter(
        ("POST", "/v1/chat/completions", b'{"model":"m"}'), (200, "application/json"), [b'{"a": "' + b"x" * 60] * 5
    )
    assert rec.bytes_out == 5 * 67


chunk_texts = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=6)


@st.composite
def valid_openai_streams(draw) -> tuple[bytes, dict]:
    """A valid chat stream in one of the servers' shapes, and what it must measure to."""
    contents = draw(st.lists(chunk_texts, max_size=8))
    reasonings = draw(st.lists(chunk_texts, max_size=4))
    eol = draw(st.sampled_from([b"\n", b"\r\n", b"\r"]))
    space = draw(st.sampled_from([b" ", b""]))
    comments = draw(st.booleans())
    finish = draw(st.sampled_from([None, "stop", "length"]))
    done = draw(st.booleans())
    events = [{"choices": [{"index": 0, "delta": {"role": "assistant"}}]}]
    events += [{"choices": [{"index": 0, "delta": {"reasoning_content": r}}]} for r in reasonings]
    events += [{"choices": [{"index": 0, "delta": {"content": c}}]} for c in contents]
    if finish:
        events.append({"choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
    events.append(
        {
            "choices": [],
            "usage": {
                "prompt_tokens": 3,
                "completion_tokens": len(contents) + len(reasonings),
                "total_tokens": 3 + len(contents) + len(reasonings),
            },
        }
    )
    body = b""
    for ev in events:
        if comments:
            body += b": keepalive" + eol + eol
        body += b"data:" + space + orjson.dumps(ev) + eol + eol
    if done:
        body += b"data: [DONE]" + eol + eol
    outcome = ("ok" if done else "ok_no_done") if finish else "truncated"
    return body, {
        "generated_events": len(contents) + len(reasonings),
        "reasoning_tokens_counted": len(reasonings),
        "finish_reason": finish,
        "outcome": outcome,
        "completion_tokens_reported": len(contents) + len(reasonings),
        "comments": len(events) if comments else 0,
    }


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(valid_openai_streams(), cut_points)
def test_meter_valid_streams_measure_the_same_whole_and_split(stream, cuts: list[int]) -> None:
    body, expected = stream
    req = ("POST", "/v1/chat/completions", b'{"model":"m","stream":true,"stream_options":{"include_usage":true}}')
    whole = run_meter(req, (200, "text/event-stream"), [body], 4096)
    assert run_meter(req, (200, "text/event-stream"), cut(body, cuts), 4096) == whole
    assert run_meter(req, (200, "text/event-stream"), [body[i : i + 1] for i in range(len(body))], 4096) == whole
    assert {k: getattr(whole, k) for k in expected} == expected


USAGE_EVENT = b'data: {"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":2,"total_tokens":3}}'
STRIP_PIECES_LF = [
    EVENT_A,
    USAGE_EVENT + b"\n\n",
    b": keepalive\n\n",
    b"id: 5\n",
    b"retry: 10\n",
    b"event: e\n",
    b"\n",
    b"foo\n",
    b"data: a\n",
    b"data: " + b"y" * 100 + b"\n",
    b"z" * 70,
]
STRIP_PIECES_CR = [b"\r\n", USAGE_EVENT + b"\r\n\r\n", b"data: b\r", b"\r"]


def strip_all(parts: list[bytes]) -> tuple[bytes, int]:
    """The proxy's usage-stripping path (`ProxyApp._forward`) on the core alone."""
    dec, stripper, out = SSEDecoder(LINE_BOUND), UsageStripper(), b""
    for p in parts:
        out += stripper.process(p, dec.feed(p), dec.safe_offset)
        assert len(stripper._buf) <= 2 * LINE_BOUND  # an open event and a partial line are held back, within the bound
    return out + stripper.flush(), stripper.stripped


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from(STRIP_PIECES_LF), max_size=12), cut_points)
def test_usage_stripping_forwards_the_same_bytes_however_the_stream_is_split(
    pieces: list[bytes], cuts: list[int]
) -> None:
    data = b"".join(pieces)
    out, stripped = strip_all([data])
    assert strip_all(cut(data, cuts)) == (out, stripped)
    assert out == data.replace(USAGE_EVENT + b"\n\n", b"", stripped) or stripped == 0 or b"data: a\n" in data


def sse_events(data: bytes) -> list[str]:
    dec = SSEDecoder()
    return [e.data for e in dec.feed(data) + dec.close() if isinstance(e, SSEEvent)]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from(STRIP_PIECES_LF + STRIP_PIECES_CR), max_size=12), cut_points)
def test_usage_stripping_gives_the_same_events_with_any_line_ends(pieces: list[bytes], cuts: list[int]) -> None:
    """A CR that ends one read and the LF that starts the next may leave one stray line end
    behind (a blank line: no event); the events the client parses are the same."""
    data = b"".join(pieces)
    out, stripped = strip_all([data])
    out2, stripped2 = strip_all(cut(data, cuts))
    assert stripped2 == stripped and sse_events(out2) == sse_events(out)


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(["model", "stream", "stream_options", "messages", "prompt", "max_tokens", "x"]),
        json_values,
        max_size=6,
    ),
    st.sampled_from([b"", b" ", b"\n"]),
)
def test_request_parsing_and_usage_injection_never_raise(obj: dict, trailer: bytes) -> None:
    body = orjson.dumps(obj) + trailer
    info, parsed = parse_request("POST", "/v1/chat/completions", body)
    assert parsed == obj and info.json_body
    injected = orjson.loads(inject_include_usage(body, obj))
    assert injected["stream_options"]["include_usage"] is True
    assert {k: v for k, v in injected.items() if k != "stream_options"} == {
        k: v for k, v in obj.items() if k != "stream_options"
    }


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_request_parsing_never_raises_on_any_bytes(body: bytes) -> None:
    info, parsed = parse_request("POST", "/v1/chat/completions", body)
    assert parsed is None or isinstance(parsed, dict)
    assert is_injected_usage_chunk(body.decode("utf-8", "replace")) in (True, False)


@pytest.mark.parametrize("where", ["comment", "error"])
def test_meter_survives_thousands_of_digits(where: str) -> None:
    digits = b"1" * 5000
    if where == "comment":
        rec = run_meter(
            ("POST", "/v1/chat/completions", b'{"stream":true}'),
            (200, "text/event-stream"),
            [b": keepalive " + digits + b"/2\n\n"],
            10_000,
        )
    else:
        rec = run_meter(
            ("POST", "/v1/chat/completions", b"{}"),
            (400, "application/json"),
            [b'{"error":"' + digits + b' tokens exceeds max context window of 8"}'],
            10_000,
        )
    assert rec is not None
