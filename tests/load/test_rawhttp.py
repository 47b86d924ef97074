"""The load generator's raw HTTP/1.1 transport (mlxproxy.load.run.rawhttp), with each parser it can
use (httptools, and h11 where httptools is missing): bodies byte-exact whatever the framing
and however the bytes are split, broken framings as body errors, keep-alive reuse only
after a clean, complete response, and the simulator's wire styles metered as the proxy's
own client meters them, on both stacks."""

from __future__ import annotations

import asyncio
import errno
import gc
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fakeupstream import Conn, FakeUpstream, Req
from mlxproxy.edge import dial, httpparse
from mlxproxy.edge.runner import run_async
from mlxproxy.errors import UpstreamBodyError, UpstreamUnreachable
from mlxproxy.load.run import rawhttp
from mlxproxy.load.run.client import MeasuringClient, PreparedRequest

PARSERS = ["h11"] + (["httptools"] if httpparse.httptools is not None else [])
_CLASSES = {"h11": httpparse.H11Parser, "httptools": httpparse.HttptoolsParser}


@pytest.fixture(params=PARSERS)
def parser(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setattr(dial, "parser_class", lambda: _CLASSES[request.param])  # (each pool's choice)
    return str(request.param)


class Collect:
    def __init__(self) -> None:
        self.status: int | None = None
        self.ctype: str | None = None
        self.reads: list[tuple[bytes, float]] = []

    def response_started(self, t: float, status: int, content_type: str | None) -> None:
        self.status, self.ctype = status, content_type

    def feed(self, data: bytes, t: float) -> None:
        self.reads.append((data, t))

    @property
    def body(self) -> bytes:
        return b"".join(d for d, _ in self.reads)


# -- the parser path alone, driven with scripted reads (no sockets) ----------------------


class _Transport:
    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.aborted = False

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def abort(self) -> None:
        self.aborted = True


def _conn(loop: asyncio.AbstractEventLoop) -> tuple[rawhttp._Conn, _Transport]:
    pool = rawhttp.RawPool("http://127.0.0.1:1", read_timeout_s=0)
    pool.loop = loop
    conn = rawhttp._Conn(pool)
    tr = _Transport()
    conn.connection_made(tr)  # type: ignore[arg-type]
    return conn, tr


def _chunked(parts: list[bytes]) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts if p) + b"0\r\n\r\n"


def _split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in zip(points, points[1:])]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    parts=st.lists(st.binary(min_size=0, max_size=40), max_size=8),
    framing=st.sampled_from(["chunked", "length", "close"]),
    cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=12),
)
def test_any_framing_split_anywhere_gives_the_body_byte_exact(
    parser: str, parts: list[bytes], framing: str, cuts: list[int]
) -> None:
    """Whatever the framing and wherever the reads split the bytes (inside a chunk-size
    line, between CR and LF, in the head), the sink gets exactly the body, one timestamp
    per read, and the response completes; keep-alive only for a self-delimited body."""
    body = b"".join(parts)
    if framing == "chunked":
        head, payload = (
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n",
            _chunked(parts),
        )
    elif framing == "length":
        head, payload = (
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: %d\r\n\r\n" % len(body),
            body,
        )
    else:
        head, payload = b"HTTP/1.0 200 OK\r\ncontent-type: text/event-stream\r\n\r\n", body
    loop = asyncio.new_event_loop()
    try:
        conn, tr = _conn(loop)
        sink = Collect()
        done = conn.start(sink, b"POST", b"POST / HTTP/1.1\r\n\r\n")
        reads = _split(head + payload, cuts)
        for data in reads:
            conn.data_received(data)
        if framing == "close":
            assert not done.done()  # only the close can end such a body
            conn.connection_lost(None)
        assert done.done() and done.exception() is None
        assert done.result() is (framing != "close")
        assert sink.status == 200 and sink.ctype == "text/event-stream" and sink.body == body
        # one timestamp per read: a read's pieces share its stamp, no stamp is invented
        stamps = [t for _, t in sink.reads]
        assert stamps == sorted(stamps) and len(set(stamps)) <= len(reads)
        assert not conn.tainted and not tr.aborted
    finally:
        loop.close()


@pytest.mark.parametrize(
    "wire, why",
    [
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n3\r\nab", "truncated chunk"),
        (b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nhello", "short content-length"),
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\nhello\r\n", "bad chunk size"),
    ],
)
def test_broken_framing_is_a_body_error(parser: str, wire: bytes, why: str) -> None:
    loop = asyncio.new_event_loop()
    try:
        conn, tr = _conn(loop)
        sink = Collect()
        done = conn.start(sink, b"POST", b"")
        conn.data_received(wire)
        if not done.done():
            conn.connection_lost(None)
        exc = done.exception()
        assert isinstance(exc, UpstreamBodyError) and "abnormally" in str(exc) and "\n" not in str(exc), why
        assert sink.status == 200
    finally:
        loop.close()


def test_a_close_before_the_head_is_unreachable_and_a_reset_mid_body_is_abnormal(parser: str) -> None:
    loop = asyncio.new_event_loop()
    try:
        conn, _ = _conn(loop)
        done = conn.start(Collect(), b"POST", b"")
        conn.data_received(b"HTTP/1.1 2")
        conn.connection_lost(None)
        assert isinstance(done.exception(), UpstreamUnreachable)
        conn, _ = _conn(loop)
        done = conn.start(Collect(), b"POST", b"")
        conn.data_received(b"HTTP/1.0 200 OK\r\n\r\npartial")
        conn.connection_lost(ConnectionResetError("reset by peer"))  # not a clean close: not the body's end
        assert isinstance(done.exception(), UpstreamBodyError) and "ConnectionResetError" in str(done.exception())
    finally:
        loop.close()


def test_bytes_after_a_complete_response_taint_the_connection(parser: str) -> None:
    """More body than announced (or a second response) is never parsed as the next
    request's answer: the connection is marked and the pool will not hand it out."""
    loop = asyncio.new_event_loop()
    try:
        conn, _ = _conn(loop)
        done = conn.start(Collect(), b"POST", b"")
        conn.data_received(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nokEXTRA")
        assert done.result() is True and conn.tainted
        conn, _ = _conn(loop)
        done = conn.start(Collect(), b"POST", b"")
        conn.data_received(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        assert done.result() is True and not conn.tainted
        conn.finish()
        conn.data_received(b"HTTP/1.1 200 OK\r\n")  # while idle
        assert conn.tainted
    finally:
        loop.close()


# -- through sockets: the fake upstream, keep-alive policy ------------------------------


def test_keep_alive_only_after_a_clean_complete_response(parser: str) -> None:
    """A connection is reused after a complete keep-alive response; one that said
    `Connection: close`, or sent more than it announced, is not."""
    peers: list[tuple[str, object]] = []

    async def handler(req: Req, conn: Conn) -> None:
        peers.append((req.path, conn.writer.get_extra_info("peername")))
        if req.path == "/close":
            await conn.send(b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\nok")
            conn.writer.close()
        elif req.path == "/extra":
            await conn.send(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nokEXTRA")
        else:
            await conn.send(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")

    async def main() -> list[bytes]:
        pool = rawhttp.RawPool(up.url, read_timeout_s=10)
        out = []
        try:
            for path in ("/a", "/b", "/close", "/c", "/extra", "/d"):
                sink = Collect()
                await pool.request("GET", path.encode(), [], b"", sink)
                out.append(sink.body)
        finally:
            await pool.aclose()
        return out

    with FakeUpstream(handler) as up:
        bodies = run_async(main())
    assert bodies == [b"ok"] * 6
    by = dict(peers)
    assert by["/a"] == by["/b"] == by["/close"]  # reused while clean
    assert by["/c"] != by["/close"]  # the server said close
    assert by["/d"] != by["/extra"]  # bytes beyond the response: never reused


def test_a_finished_response_leaves_no_cyclic_garbage(parser: str) -> None:
    """Reference counting alone frees what a finished request used: a long run keeps its
    records alive (and frozen out of the collector's passes), so anything that only the
    cyclic collector could free would pile up for the whole run and be walked at its end
    (httptools' parser held its owner's bound callbacks: 10 objects per request)."""

    async def handler(req: Req, conn: Conn) -> None:
        await conn.send(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")

    async def main() -> int:
        pool = rawhttp.RawPool(up.url, read_timeout_s=10)
        try:
            await pool.request("GET", b"/warm", [], b"", Collect())  # the connection itself is long-lived
            gc.collect()
            gc.set_debug(gc.DEBUG_SAVEALL)
            try:
                for i in range(50):
                    await pool.request("GET", b"/r%d" % i, [], b"", Collect())
                gc.collect()
                return len(gc.garbage)
            finally:
                gc.set_debug(0)
                gc.garbage.clear()
        finally:
            await pool.aclose()

    with FakeUpstream(handler) as up:
        garbage = run_async(main())
    assert garbage < 50  # none per request (the loop's own bookkeeping may leave a few)


async def _refusal(pool: rawhttp.RawPool) -> str:
    """The message of the `UpstreamUnreachable` one request through `pool` raises ("" if none)."""
    try:
        await pool.request("GET", b"/", [], b"", Collect())
    except UpstreamUnreachable as exc:
        return str(exc)
    finally:
        await pool.aclose()
    return ""


def test_running_out_of_open_files_is_the_generators_limit_not_the_servers(monkeypatch: pytest.MonkeyPatch) -> None:
    """EMFILE on connect is this process's limit: the record says so, and does not call the
    server unreachable."""

    async def main() -> str:
        loop = asyncio.get_running_loop()

        async def no_fd(*a: object, **k: object) -> None:
            raise OSError(errno.EMFILE, "Too many open files")

        monkeypatch.setattr(loop, "create_connection", no_fd)
        return await _refusal(rawhttp.RawPool("http://127.0.0.1:9", read_timeout_s=10))

    msg = run_async(main())
    assert msg.startswith("the load generator ran out of open files (0 connections open to 'target'")
    assert "ulimit -n" in msg and "is unreachable" not in msg


def test_a_target_named_after_its_address_is_named_once_in_messages() -> None:
    """An unnamed target is named after its host:port: its messages say the address once
    (`upstream http://127.0.0.1:P is unreachable`), a named one says both."""
    import socket

    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    def refusal(name: str) -> str:
        return run_async(_refusal(rawhttp.RawPool(f"http://127.0.0.1:{port}", name=name, read_timeout_s=10)))

    unnamed = refusal(f"127.0.0.1:{port}")
    assert unnamed.startswith(f"upstream http://127.0.0.1:{port} is unreachable: "), unnamed
    named = refusal("gone")
    assert named.startswith(f"upstream 'gone' at http://127.0.0.1:{port} is unreachable: "), named


def test_the_cli_raises_its_open_files_limit(tmp_path: Path) -> None:
    """macOS starts processes with 256 open files: every command raises its soft limit to the
    hard one first (checked in a child started with a soft limit of 256)."""
    resource = pytest.importorskip("resource")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= 256:
        pytest.skip(f"the hard limit here is {hard}: nothing to raise it to")
    code = (
        "import resource, sys\n"
        "from mlxproxy.cli import main\n"
        "import mlxproxy.edge.runner as r\n"
        "seen = []\n"
        "real = r.raise_open_files_limit\n"
        "r.raise_open_files_limit = lambda: seen.append(real())\n"
        "try:\n"
        "    main(['report', '--help'])\n"
        "finally:\n"
        "    print('LIMITS', seen, resource.getrlimit(resource.RLIMIT_NOFILE)[0], file=sys.stderr)\n"
    )
    p = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard)),
    )
    line = [x for x in p.stderr.splitlines() if x.startswith("LIMITS")][-1]
    assert line.startswith("LIMITS [(256, ")
    assert int(line.split()[-1]) > 256


def test_a_connection_closed_before_the_write_is_never_written_to(parser: str) -> None:
    """An idle connection whose transport is already closing (the server's close not yet seen)
    is not reused; a new connection closed before the request could be written is one
    `UpstreamUnreachable`, not uvloop's RuntimeError out of the run (it ended a load worker at
    8,000 req/s)."""

    async def handler(req: Req, conn: Conn) -> None:
        await conn.send(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")

    async def main() -> tuple[bytes, str]:
        pool = rawhttp.RawPool(up.url, read_timeout_s=10)
        try:
            await pool.request("GET", b"/a", [], b"", Collect())
            assert len(pool.idle) == 1
            pool.idle[0].transport.close()  # closing; connection_lost comes on a later turn
            again = Collect()
            await pool.request("GET", b"/b", [], b"", again)
            connect = pool._connect

            async def closed_at_once() -> rawhttp._Conn:
                conn = await connect()
                conn.transport.abort()
                await asyncio.sleep(0.01)  # connection_lost has run: the transport is closed
                return conn

            pool._connect = closed_at_once  # type: ignore[method-assign]
            pool.idle.clear()
            try:
                await pool.request("GET", b"/c", [], b"", Collect())
            except UpstreamUnreachable as exc:
                return again.body, str(exc)
            return again.body, "sent"
        finally:
            await pool.aclose()

    with FakeUpstream(handler) as up:
        body, error = run_async(main())
    assert body == b"ok"
    assert "closed the connection before the request was sent" in error


def test_an_invalid_url_is_a_one_line_record_not_an_exception() -> None:
    async def main():
        async with MeasuringClient("http://127.0.0.1:80800") as c:
            return await c.send(PreparedRequest("POST", "/v1/chat/completions", b"{}"))

    rec = asyncio.run(main())
    assert rec.outcome == "upstream_unreachable" and "invalid URL" in (rec.error or "") and "\n" not in rec.error


# -- the simulator, on both stacks --------------------------------------------------------


def _stacks() -> list[str]:
    from mlxproxy.edge.runner import stack_settings

    out = ["plain"]
    try:
        stack_settings("fast")
        out.append("fast")
    except ValueError:
        pass
    return out


@pytest.mark.parametrize("stack", _stacks())
def test_simulator_wire_styles_metered_as_the_reference_client_meters_them(parser: str, stack: str) -> None:
    """Each wire style of the simulator, streaming and not, served on `stack` and read on
    `stack`'s loop: the record says what the meter says of the same answer fetched by
    httpx (events, tokens, finish), and nothing fails."""
    import httpx

    from mlxproxy.core.analyze import finish_checked
    from mlxproxy.core.detect import Thresholds
    from mlxproxy.core.meter import RequestMeter
    from mlxproxy.core.openai import parse_request
    from mlxproxy.edge.runner import ServerThread
    from mlxproxy.sim.app import create_app

    def body(stream: bool) -> bytes:
        obj = {"model": "m", "stream": stream, "max_tokens": 12, "messages": [{"role": "user", "content": "hi"}]}
        if stream:
            obj["stream_options"] = {"include_usage": True}
        return orjson.dumps(obj)

    def reference(url: str, data: bytes):
        r = httpx.post(url + "/v1/chat/completions", content=data, headers={"content-type": "application/json"})
        info, _ = parse_request("POST", "/v1/chat/completions", data)
        m = RequestMeter(info, request_id="ref", upstream="ref", t_start=0.0, started_at=0.0)
        m.response_started(0.001, r.status_code, r.headers.get("content-type"))
        m.feed(r.content, 0.002)
        return finish_checked(m, 0.003, Thresholds())

    def key(rec):
        return (
            rec.status,
            rec.outcome,
            rec.generated_events,
            rec.completion_tokens,
            rec.finish_reason,
            rec.usage_reports,
        )

    for profile in ("healthy", "mlx-lm", "vllm-mlx", "mlx-openai-server"):
        with ServerThread(create_app(profile, speed=50), stack=stack) as sim:

            async def main():
                async with MeasuringClient(sim.url, tag_replay=False) as c:
                    return [
                        await c.send(PreparedRequest("POST", "/v1/chat/completions", body(s)))
                        for s in (True, False, True)
                    ]

            recs = run_async(main(), stack)
            want = [reference(sim.url, body(s)) for s in (True, False, True)]
        for got, ref in zip(recs, want):
            assert got.outcome in ("ok", "ok_no_done"), (profile, got.error)
            assert key(got) == key(ref), (profile, key(got), key(ref))
            assert abs(got.bytes_out - ref.bytes_out) <= 16  # ids and `created` may differ in length, nothing else


def test_the_parser_follows_the_stack(monkeypatch: pytest.MonkeyPatch) -> None:
    """httptools where installed, h11 on the plain stack (what a platform without the wheels
    gets), so `MLXPROXY_STACK=plain` runs the whole client as such a platform would."""
    pytest.importorskip("httptools")
    monkeypatch.setenv("MLXPROXY_STACK", "plain")
    assert rawhttp.RawPool("http://127.0.0.1:1").parser_class is rawhttp._H11Parser
    monkeypatch.delenv("MLXPROXY_STACK")
    assert rawhttp.RawPool("http://127.0.0.1:1").parser_class is rawhttp._HttptoolsParser
