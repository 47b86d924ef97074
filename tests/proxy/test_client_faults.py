"""Client faults (`proxy/app.py`): a client that goes at any moment, reads slowly, or sends a
malformed, huge or misdirected request; nothing leaks and the upstream is released. Raw
sockets or httpx, on 127.0.0.1 port 0; nothing sleeps to measure."""

from __future__ import annotations

import gc
import socket
import threading
import time
import tracemalloc

import httpx
import orjson
import pytest

from fakeupstream import Conn, Req
from faultrig import FINISH, SSE_CHUNKED, STREAM_REQ, Rig, healthy_handler, rig, wait_for
from support import EVENT_A

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
