"""Upstream faults (`proxy/upstream.py` and how the proxy relays them): what the client gets and
what the record says when the upstream misbehaves, through scripted raw-socket upstreams and
the simulator's `X-Sim-Fault` switches for each server style; the proxy keeps serving
meanwhile. Every server listens on 127.0.0.1 port 0; nothing sleeps to measure. SECURITY.md
names these tests next to the guarantees they back."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import socket
import threading
import time
import tracemalloc
from collections.abc import Iterator

import httpx
import orjson
import pytest

from fakeupstream import Conn, Req
from faultrig import FINISH, SSE_CHUNKED, STREAM_REQ, read_all, rig, wait_for
from mlxproxy.config import build_config
from mlxproxy.edge.runner import ServerThread
from mlxproxy.proxy.app import ProxyApp, create_app
from support import EVENT_A, closed_port

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


def test_a_stream_longer_than_the_read_timeout_with_shorter_gaps_is_whole() -> None:
    """The read timeout is the silence between reads, not the body's length: events 0.15 s
    apart for 1.2 s against read_s 0.5 (the lazy timer, `proxy.transport.Conn`, is
    due four times and moved on each time), then one silence longer than it."""

    async def handler(req: Req, conn: Conn) -> None:
        await conn.head(200, SSE_CHUNKED)
        for _ in range(8):
            await conn.chunk(EVENT_A)
            await asyncio.sleep(0.15)
        await conn.chunk(FINISH + b"data: [DONE]\n\n")
        await conn.end_chunked()

    async def stalls_late(req: Req, conn: Conn) -> None:
        await conn.head(200, SSE_CHUNKED)
        for _ in range(8):
            await conn.chunk(EVENT_A)
            await asyncio.sleep(0.15)
        await conn.wait_peer_close(30)

    with rig({"m": handler, "late": stalls_late}, timeouts={"read_s": 0.5}) as t:
        status, got, exc, headers = read_all(t.url, STREAM_REQ)
        assert status == 200 and exc is None and got == EVENT_A * 8 + FINISH + b"data: [DONE]\n\n"
        rec = t.record(headers["x-mlxproxy-request-id"])
        assert rec.outcome == "ok" and rec.generated_events == 8
        status, got, exc, headers = read_all(t.url, {**STREAM_REQ, "model": "late"})
        assert got == EVENT_A * 8 and isinstance(exc, httpx.RemoteProtocolError)
        rec = t.record(headers["x-mlxproxy-request-id"])
        assert rec.outcome == "upstream_timeout" and rec.generated_events == 8


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
