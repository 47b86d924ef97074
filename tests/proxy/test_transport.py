"""proxy/transport.py, the proxy's raw asyncio upstream transport, at its edges: bodies framed by
Content-Length, chunked encoding and the connection's close, each split across reads; an
upstream that cuts a body or goes silent; which connections are reused (never one that saw an
error, a timeout or an extra byte) and how many are kept idle; the request's bytes against
aiohttp's, the client it replaced. Against a scripted upstream on a real loopback socket
(`fakeupstream.FakeUpstream`), on both response parsers."""

from __future__ import annotations

import asyncio
import shutil
import ssl
import subprocess
import threading
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

from fakeupstream import Conn, FakeUpstream, Handler, Req
from mlxproxy.edge import dial, httpparse
from mlxproxy.errors import UpstreamBodyError, UpstreamBodyTimeout, UpstreamTimeout, UpstreamUnreachable
from mlxproxy.proxy import transport
from support import closed_port

PARSERS = ["h11"] + (["httptools"] if httpparse.httptools is not None else [])
T = TypeVar("T")


@pytest.fixture(params=PARSERS)
def parser(request: pytest.FixtureRequest) -> Iterator[str]:
    yield request.param


def run(parser: str, handler: Handler, body: Callable[[transport.Pool, FakeUpstream], Awaitable[T]], **kw: float) -> T:
    """`body(pool, upstream)` in a fresh event loop, against `handler`, on `parser`'s parser."""
    with FakeUpstream(handler) as up:

        async def main() -> T:
            pool = transport.Pool("up", up.url, connect_s=kw.get("connect_s", 5.0), read_s=kw.get("read_s", 10.0))
            pool.parser_class = httpparse.HttptoolsParser if parser == "httptools" else httpparse.H11Parser
            try:
                return await body(pool, up)
            finally:
                await pool.aclose()

        result = asyncio.run(main())
        assert up.errors == []
        return result


async def fetch(pool: transport.Pool, method: str = "POST", body: bytes = b"{}") -> tuple[int, bytes, transport.Conn]:
    conn = await pool.open(method, b"/v1/x", [(b"content-type", b"application/json")], body)
    parts = []
    while chunk := await conn.read():
        parts.append(chunk)
    conn.release()
    return conn.status, b"".join(parts), conn


def peer_of(c: Conn) -> int:
    return int(c.writer.get_extra_info("peername")[1])


async def pieces(c: Conn, data: bytes, cuts: list[int]) -> None:
    """`data` written in pieces cut at `cuts`, each its own read at the proxy."""
    last = 0
    for cut in [*cuts, len(data)]:
        await c.send(data[last:cut])
        last = cut
        await asyncio.sleep(0.01)  # (so the pieces arrive as separate reads; nothing is timed)


BODY = b'data: {"a": 1}\n\n' * 20


def test_content_length_and_chunked_bodies_arrive_whole_and_the_connection_is_reused(parser: str) -> None:
    ports: list[int] = []

    async def handler(req: Req, c: Conn) -> None:
        ports.append(peer_of(c))
        if req.path.endswith("x") and len(ports) % 2:  # chunked, cut inside sizes, data and CRLFs
            wire = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in (BODY[:7], BODY[7:100], BODY[100:])) + b"0\r\n\r\n"
            head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
            await pieces(c, head + wire, [20, len(head) + 1, len(head) + 5, len(head) + 60, len(wire) + len(head) - 3])
        else:
            head = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(BODY)
            await pieces(c, head + BODY, [5, len(head), len(head) + 33])

    async def body(pool: transport.Pool, up: FakeUpstream) -> list[tuple[int, bytes]]:
        return [(s, b) for s, b, _ in [await fetch(pool) for _ in range(4)]]

    assert run(parser, handler, body) == [(200, BODY)] * 4
    assert len(set(ports)) == 1, ports  # one connection, kept alive through both framings


def test_informational_responses_before_the_answer_are_skipped(parser: str) -> None:
    """A client's `Expect: 100-continue` is forwarded, so a server may answer 100 Continue (or
    103 Early Hints) first: the answer is the response after them."""

    async def handler(req: Req, c: Conn) -> None:
        await pieces(
            c,
            b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n"
            b"HTTP/1.1 201 Created\r\ncontent-length: 2\r\n\r\nok",
            [10, 30],
        )

    async def body(pool: transport.Pool, up: FakeUpstream) -> tuple[int, list[tuple[bytes, bytes]], bytes, int]:
        conn = await pool.open("POST", b"/v1/x", [], b"{}")
        status, headers, got = conn.status, list(conn.headers), await conn.read()
        assert await conn.read() == b""
        conn.release()
        again = await fetch(pool)
        assert again[:2] == (201, b"ok")
        return status, headers, got, len(pool.open_conns)

    # the answer's own status and headers; the connection kept for the next request
    assert run(parser, handler, body) == (201, [(b"content-length", b"2")], b"ok", 1)


def test_a_body_delimited_by_the_close_ends_cleanly_and_its_connection_is_not_reused(parser: str) -> None:
    ports: list[int] = []

    async def handler(req: Req, c: Conn) -> None:
        ports.append(peer_of(c))
        await pieces(c, b"HTTP/1.0 200 OK\r\ncontent-type: text/event-stream\r\n\r\n" + BODY, [30, 80])
        c.writer.close()

    async def body(pool: transport.Pool, up: FakeUpstream) -> list[bytes]:
        return [(await fetch(pool))[1] for _ in range(2)]

    assert run(parser, handler, body) == [BODY, BODY]
    assert len(set(ports)) == 2


CUTS = {
    "chunked-unterminated": b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n",
    "chunked-bad-size": b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\nzz\r\n",
    "content-length-short": b"HTTP/1.1 200 OK\r\ncontent-length: 50\r\n\r\nhello",
    "close-delimited-reset": b"HTTP/1.0 200 OK\r\n\r\nhello",
}


@pytest.mark.parametrize("cut", sorted(CUTS))
def test_a_body_the_upstream_cuts_is_an_error_and_the_next_request_gets_a_new_connection(parser: str, cut: str) -> None:
    ports: list[int] = []

    async def handler(req: Req, c: Conn) -> None:
        ports.append(peer_of(c))
        if len(ports) == 1:
            await c.send(CUTS[cut])
            await asyncio.sleep(0.05)  # (the bytes go before the close)
            if cut.endswith("reset"):
                c.reset()
            else:
                c.writer.close()
        else:
            await c.send(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")

    async def body(pool: transport.Pool, up: FakeUpstream) -> tuple[bytes, str, bytes]:
        conn = await pool.open("POST", b"/v1/x", [], b"{}")
        got = b""
        with pytest.raises(UpstreamBodyError) as err:
            while chunk := await conn.read():
                got += chunk
        conn.release()
        return got, str(err.value), (await fetch(pool))[1]

    got, message, after = run(parser, handler, body)
    assert got in (b"", b"hello") and message.startswith("upstream body ended abnormally: ") and after == b"ok"
    assert len(set(ports)) == 2, ports


def test_silence_before_the_head_and_in_the_body_times_out_and_slow_steady_reads_do_not(parser: str) -> None:
    never = threading.Event()
    ports: list[int] = []

    async def handler(req: Req, c: Conn) -> None:
        ports.append(peer_of(c))
        kind = req.path.rsplit("/", 1)[1]
        if kind == "head":  # nothing at all
            await c.wait_gate(never, 3)
        elif kind == "body":
            await c.send(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
            await c.chunk(b"first")
            await c.wait_gate(never, 3)
        else:  # reads 0.1 s apart for 1 s, never silent for the 0.4 s read timeout
            await c.send(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
            for _ in range(10):
                await asyncio.sleep(0.1)
                await c.chunk(b"tick ")
            await c.end_chunked()

    async def body(pool: transport.Pool, up: FakeUpstream) -> tuple[str, str, bytes]:
        with pytest.raises(UpstreamTimeout) as head:
            await pool.open("GET", b"/v1/head", [], b"")
        conn = await pool.open("GET", b"/v1/body", [], b"")
        assert await conn.read() == b"first"
        with pytest.raises(UpstreamBodyTimeout) as silent:
            await conn.read()
        conn.release()
        conn = await pool.open("GET", b"/v1/steady", [], b"")
        got = b""
        while chunk := await conn.read():
            got += chunk
        conn.release()
        never.set()
        return str(head.value), str(silent.value), got

    head, silent, got = run(parser, handler, body, read_s=0.4)
    assert "did not answer within the timeout" in head and "went silent" in silent
    assert got == b"tick " * 10
    assert len(set(ports)) == 3, ports  # neither timed-out connection was used again


def test_bytes_beyond_the_announced_body_retire_the_connection(parser: str) -> None:
    ports: list[int] = []

    async def handler(req: Req, c: Conn) -> None:
        ports.append(peer_of(c))
        await c.send(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nokHTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nstale")

    async def body(pool: transport.Pool, up: FakeUpstream) -> list[bytes]:
        return [(await fetch(pool))[1] for _ in range(3)]

    assert run(parser, handler, body) == [b"ok"] * 3
    assert len(set(ports)) == 3, ports


def test_the_pool_keeps_at_most_max_idle_connections(parser: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transport, "MAX_IDLE", 2)
    arrived, go, closed = threading.Semaphore(0), threading.Event(), threading.Semaphore(0)

    async def handler(req: Req, c: Conn) -> None:
        arrived.release()
        await c.wait_gate(go)
        await c.send(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        if await c.wait_peer_close(1.0):
            closed.release()

    async def body(pool: transport.Pool, up: FakeUpstream) -> tuple[int, int]:
        four = [asyncio.ensure_future(fetch(pool)) for _ in range(4)]  # none waits for another
        loop = asyncio.get_running_loop()
        assert all([await loop.run_in_executor(None, arrived.acquire, True, 5) for _ in range(4)])
        go.set()
        assert [(s, b) for s, b, _ in await asyncio.gather(*four)] == [(200, b"ok")] * 4
        # the two beyond the limit are closed at once, the two kept stay open
        assert all([await loop.run_in_executor(None, closed.acquire, True, 5) for _ in range(2)])
        return len(pool.idle), len(pool.open_conns)

    assert run(parser, handler, body) == (2, 2)


BIG = bytes(range(256)) * 8192  # 2 MiB, far above the high-water mark


async def paused_for(conn: transport.Conn, seconds: float) -> int:
    """Wait (not reading) until the transport stopped reading at the mark, then `seconds` more:
    a pause longer than the read timeout, which is not the upstream's silence. What is buffered."""
    for _ in range(500):
        if conn.paused:
            break
        await asyncio.sleep(0.01)
    assert conn.paused
    await asyncio.sleep(seconds)
    return conn.buffered


def test_a_slow_reader_pauses_the_socket_and_still_gets_every_byte(parser: str) -> None:
    async def handler(req: Req, c: Conn) -> None:
        await c.send(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(BIG) + BIG)

    async def body(pool: transport.Pool, up: FakeUpstream) -> bytes:
        conn = await pool.open("GET", b"/v1/big", [], b"")
        assert await paused_for(conn, 0.6) <= transport.HIGH_WATER + 65536 * 4
        got = []
        while chunk := await conn.read():
            got.append(chunk)
        conn.release()
        return b"".join(got)

    assert run(parser, handler, body, read_s=0.3) == BIG


def test_the_read_timeout_counts_again_after_a_pause(parser: str) -> None:
    never = threading.Event()

    async def handler(req: Req, c: Conn) -> None:
        await c.send(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % (len(BIG) + 1) + BIG)
        await c.wait_gate(never, 5)  # one byte short, and silent

    async def body(pool: transport.Pool, up: FakeUpstream) -> int:
        conn = await pool.open("GET", b"/v1/big", [], b"")
        await paused_for(conn, 0.6)
        got = 0
        with pytest.raises(UpstreamBodyTimeout):
            while chunk := await asyncio.wait_for(conn.read(), 3):  # (a lost timer: TimeoutError)
                got += len(chunk)
        conn.release()
        never.set()
        return got

    assert run(parser, handler, body, read_s=0.3) == len(BIG)


def test_a_request_cancelled_before_the_head_closes_its_connection(parser: str) -> None:
    closed = threading.Event()

    async def handler(req: Req, c: Conn) -> None:
        if await c.wait_peer_close(5):
            closed.set()

    async def body(pool: transport.Pool, up: FakeUpstream) -> bool:
        task = asyncio.ensure_future(pool.open("GET", b"/v1/x", [], b""))
        while not up.requests:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await asyncio.get_running_loop().run_in_executor(None, closed.wait, 5)

    assert run(parser, handler, body)


def test_a_refused_connection_is_unreachable_and_told_to_healthz() -> None:
    seen: list[str] = []

    async def main() -> str:
        pool = transport.Pool(
            "dead", f"http://127.0.0.1:{closed_port()}", connect_s=2, read_s=2, on_unreachable=seen.append
        )
        with pytest.raises(UpstreamUnreachable) as err:
            await pool.open("GET", b"/v1/models", [], b"")
        return str(err.value)

    message = asyncio.run(main())
    assert "upstream 'dead' at http://127.0.0.1:" in message and "is unreachable: " in message and len(seen) == 1


REQUESTS = [
    ("GET", b"", []),
    ("POST", b"", []),
    ("DELETE", b"", []),
    ("HEAD", b"", []),
    ("OPTIONS", b"", []),
    ("PUT", b"", []),
    # (header names as the proxy passes them: lowercase, as both server stacks hand them over)
    ("POST", b'{"a": 1}', [(b"content-type", b"application/json"), (b"x-dup", b"1"), (b"x-dup", b"2")]),
    ("GET", b"abc", [(b"authorization", b"Bearer k")]),
]


def test_the_request_goes_out_as_aiohttp_sent_it() -> None:
    """aiohttp, the client this transport replaced, as the oracle: the same request line,
    Host, headers in order and case, Content-Length (or none) and body."""
    aiohttp = pytest.importorskip("aiohttp")
    yarl = pytest.importorskip("yarl")

    async def handler(req: Req, c: Conn) -> None:
        await c.send(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")

    with FakeUpstream(handler) as up:

        async def main() -> None:
            pool = transport.Pool("up", up.url + "/prefix", connect_s=5, read_s=5)
            async with aiohttp.ClientSession(
                auto_decompress=False,
                cookie_jar=aiohttp.DummyCookieJar(),
                skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
            ) as s:
                for method, data, headers in REQUESTS:
                    target = b"/v1/a%2Fb?q=1&r=%20"
                    r = await s.request(
                        method,
                        yarl.URL(up.url + "/prefix" + target.decode(), encoded=True),
                        headers=[(k.decode(), v.decode()) for k, v in headers],
                        data=data or None,
                        allow_redirects=False,
                    )
                    await r.read()
                    r.release()
                    conn = await pool.open(method, target, headers, data)
                    while await conn.read():
                        pass
                    conn.release()
            await pool.aclose()

        asyncio.run(main())
    theirs, ours = up.requests[0::2], up.requests[1::2]
    assert len(ours) == len(REQUESTS) and ours == theirs


def _self_signed(tmp: Path) -> tuple[str, str]:
    """A certificate for 127.0.0.1 signed by itself (openssl), and its key."""
    cert, key = str(tmp / "cert.pem"), str(tmp / "key.pem")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1"]
        + ["-addext", "subjectAltName=IP:127.0.0.1", "-keyout", key, "-out", cert],
        check=True,
        capture_output=True,
    )
    return cert, key


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_https_upstreams_go_through_the_same_transport_and_their_certificate_is_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cert, key = _self_signed(tmp_path)
    server_tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_tls.load_cert_chain(cert, key)

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while await reader.readuntil(b"\r\n\r\n"):
                writer.write(
                    b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n6\r\n tls!\n\r\n0\r\n\r\n"
                )
        except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
            pass
        finally:
            writer.close()

    async def main() -> tuple[str, list[bytes]]:
        server = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=server_tls)
        url = f"https://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        try:
            untrusted = transport.Pool("tls", url, connect_s=5, read_s=5)
            with pytest.raises(UpstreamUnreachable) as err:  # the default context: not a CA it knows
                await untrusted.open("GET", b"/v1/models", [], b"")
            trusting = ssl.create_default_context(cafile=cert)
            monkeypatch.setattr(dial, "_tls", lambda: trusting)
            pool = transport.Pool("tls", url, connect_s=5, read_s=5)
            bodies = [(await fetch(pool, "GET", b""))[1] for _ in range(2)]
            assert len(pool.open_conns) == 1  # kept alive over TLS too
            await pool.aclose()
            return str(err.value), bodies
        finally:
            server.close()

    message, bodies = asyncio.run(main())
    assert "CERTIFICATE_VERIFY_FAILED" in message and bodies == [b"hello tls!\n"] * 2


def test_the_request_is_written_before_its_response_parser_is_set_up(
    parser: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Setting up a response's parser (h11's: ~7 us per response) happens while the upstream
    reads the request, not before the request goes out, where it added to the time to first
    token; and h11 is shown the request of a method once, not one built for every response."""
    order: list[str] = []
    made = transport.Conn.connection_made

    def recording_made(self: transport.Conn, t: asyncio.BaseTransport) -> None:
        write = t.write  # type: ignore[attr-defined]

        def recording_write(data: bytes) -> None:
            order.append("write")
            write(data)

        t.write = recording_write  # type: ignore[attr-defined]
        made(self, t)

    monkeypatch.setattr(transport.Conn, "connection_made", recording_made)
    built: list[bytes] = []
    request = httpparse.h11.Request

    def counting_request(**kw: object) -> object:
        built.append(kw["method"])  # type: ignore[arg-type]
        return request(**kw)  # type: ignore[arg-type]

    monkeypatch.setattr(httpparse.h11, "Request", counting_request)
    monkeypatch.setattr(httpparse, "_SHOWN", {})

    async def handler(req: Req, c: Conn) -> None:
        await c.send(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")

    async def body(pool: transport.Pool, up: FakeUpstream) -> list[tuple[int, bytes]]:
        set_up = pool.parser_class

        def recording_parser(conn: transport.Conn, method: bytes) -> object:
            order.append("parser")
            return set_up(conn, method)

        pool.parser_class = recording_parser  # type: ignore[assignment]
        return [(s, b) for s, b, _ in [await fetch(pool) for _ in range(3)]]

    assert run(parser, handler, body) == [(200, b"ok")] * 3
    assert order == ["write", "parser"] * 3
    assert built == ([b"GET"] if parser == "h11" else [])
