"""Attacks from issue 21, replayed against both server stacks: `plain` (asyncio + h11, what
`pip install mlxproxy` gives) and `fast` (uvloop + httptools, the `fast` extras).

Each test runs the proxy in-process on 127.0.0.1, port 0, in front of a scripted upstream
(tests/fakeupstream.py), speaks raw bytes where the attack needs them, and is bounded in
time by socket timeouts. SECURITY.md names these tests next to the guarantees they back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from fakeupstream import Conn, FakeUpstream, Req
from mlxproxy.config import build_config
from mlxproxy.edge.limits import MAX_FIELD_CHARS, bounded_field
from mlxproxy.edge.runner import ServerThread, stack_settings
from mlxproxy.proxy.app import ProxyApp, create_app
from support import read_fixture, wait_for

STACKS = ["plain", "fast"]
OK_BODY = read_fixture("wire/01_openai_reference_include_usage.sse")
STREAM_REQ = {
    "model": "m",
    "stream": True,
    "messages": [{"role": "user", "content": "hi"}],
    "stream_options": {"include_usage": True},
}


@pytest.fixture(params=STACKS)
def stack(request: pytest.FixtureRequest) -> str:
    if request.param == "fast":
        pytest.importorskip("uvloop")  # the [test] extra installs both where they exist
        pytest.importorskip("httptools")
    return request.param


async def ok_stream(req: Req, conn: Conn) -> None:
    await conn.head(200, [("content-type", "text/event-stream"), ("transfer-encoding", "chunked")])
    for e in [e + b"\n\n" for e in OK_BODY.split(b"\n\n") if e]:
        await conn.chunk(e)
    await conn.end_chunked()


async def json_answer(req: Req, conn: Conn) -> None:
    body = orjson.dumps({"path": req.path, "n": len(req.body)})
    await conn.send(
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )


@contextlib.contextmanager
def proxy(stack: str, handler=json_answer, **cfg) -> Iterator[tuple[ServerThread, ProxyApp, FakeUpstream]]:
    cfg.setdefault("log_requests", False)
    with FakeUpstream(handler) as up:
        app = create_app(build_config(upstream_url=up.url, **cfg))
        with ServerThread(app, stack=stack) as srv:
            yield srv, app, up


class Listener:
    """A loopback port that counts every connection made to it (a host the proxy must never reach)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.sock.settimeout(0.05)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                c, _ = self.sock.accept()
            except (TimeoutError, OSError):
                continue
            self.accepted += 1
            c.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.sock.close()


def exchange(port: int, data: bytes, *, timeout_s: float = 5.0) -> bytes:
    """Send raw bytes, read until the server closes (or the timeout); the bytes received."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
        with contextlib.suppress(OSError):
            s.sendall(data)
        return read_all(s)


def read_all(s: socket.socket) -> bytes:
    out = b""
    while True:
        try:
            part = s.recv(65536)
        except (TimeoutError, OSError):
            return out
        if not part:
            return out
        out += part


def parse_responses(data: bytes) -> list[tuple[int, dict[str, str], bytes]]:
    """Content-Length-delimited HTTP/1.1 responses in `data`."""
    out = []
    while data:
        head, _, rest = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ")[1])
        headers = {k.lower(): v.strip() for k, v in (x.split(":", 1) for x in lines[1:] if ":" in x)}
        n = int(headers.get("content-length", len(rest)))
        out.append((status, headers, rest[:n]))
        data = rest[n:]
    return out


def assert_openai_error(status: int, headers: dict[str, str], body: bytes, want_status: int | tuple[int, ...]) -> dict:
    assert status in ((want_status,) if isinstance(want_status, int) else want_status), (status, body)
    assert headers.get("content-type", "").startswith("application/json"), headers
    err = orjson.loads(body)["error"]
    assert set(err) == {"message", "type", "code", "param"} and err["message"] and err["code"], err
    return err


def _fast_installed() -> bool:
    try:
        import httptools  # noqa: F401
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


linux_only = pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads RSS from /proc")


# -- the stack switch ---------------------------------------------------------------------------


def test_stack_switch_picks_loop_and_parser(monkeypatch: pytest.MonkeyPatch, stack: str) -> None:
    monkeypatch.delenv("MLXPROXY_STACK", raising=False)  # unset: the fastest installed
    assert stack_settings(None) == (("uvloop", "httptools") if _fast_installed() else ("asyncio", "h11"))
    monkeypatch.setenv("MLXPROXY_STACK", stack)
    want = ("asyncio", "h11") if stack == "plain" else ("uvloop", "httptools")
    assert stack_settings(None) == want
    monkeypatch.setenv("MLXPROXY_STACK", "turbo")
    with pytest.raises(ValueError, match="MLXPROXY_STACK must be one of plain, fast"):
        stack_settings(None)
    monkeypatch.delenv("MLXPROXY_STACK")
    with proxy(stack) as (srv, _app, _up):
        if stack == "plain":
            from uvicorn.protocols.http.h11_impl import H11Protocol as base
        else:
            from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
        assert issubclass(srv.config.http_protocol_class, base)
        assert srv.loop is not None and (type(srv.loop).__module__.startswith("uvloop")) == (stack == "fast")


# -- 1. only the configured upstream is ever contacted ---------------------------------------------


def test_non_origin_form_targets_are_refused_before_any_connection(stack: str) -> None:
    """Every request target that is not a path is answered 400 (OpenAI-shaped JSON) and
    reaches neither the upstream nor any other host, with or without a proxy key."""
    elsewhere = Listener()
    try:
        with proxy(stack) as (srv, app, up):
            p = elsewhere.port
            targets = [
                f"*@127.0.0.1:{p}/v1/models",
                f"@127.0.0.1:{p}/v1/models",
                "*",
                "*.x/y",
                "x",
                f"http://127.0.0.1:{p}/v1/models",
                f"127.0.0.1:{p}",
                f"*@127.0.0.1:{p}",
                "v1/models",
                f"\\\\127.0.0.1:{p}/v1/models",
                f"?@127.0.0.1:{p}/",
            ]
            for method, target in [("POST", t) for t in targets] + [("OPTIONS", "*"), ("CONNECT", f"127.0.0.1:{p}")]:
                req = f"{method} {target} HTTP/1.1\r\nHost: 127.0.0.1:{p}\r\nContent-Length: 2\r\n\r\n{{}}".encode()
                got = parse_responses(exchange(srv.port, req))
                assert len(got) == 1, (target, got)
                err = assert_openai_error(*got[0], 400)
                assert err["code"] in ("invalid_request_target", "invalid_request"), (target, err)
                assert got[0][1].get("connection") == "close"
            assert up.requests == [] and app.requests_seen == 0
            # a path that merely looks like a host still goes to the configured upstream only
            r = httpx.post(srv.url + f"//127.0.0.1:{p}/v1/models", json={})
            assert r.status_code == 200 and r.json()["path"] == f"//127.0.0.1:{p}/v1/models"
        assert elsewhere.accepted == 0
    finally:
        elsewhere.close()


# -- 2. bounded everything a client controls --------------------------------------------------------


def test_huge_model_names_keep_metrics_small_and_other_streams_flowing(stack: str) -> None:
    """Three requests with 1 MiB model names: /metrics stays under 1 MB, records and log
    lines carry a bounded name, and a stream in flight meanwhile never waits 50 ms more
    than its upstream's 10 ms pace. A loaded machine only lengthens gaps, so the pace is
    judged on the best of up to three attempts (every other check holds in each)."""
    worst = []
    for _ in range(3):
        worst.append(_huge_model_names_attempt(stack))
        if worst[-1] < 0.06:
            break
    assert min(worst) < 0.06, worst


def _huge_model_names_attempt(stack: str) -> float:
    """One attempt; returns the paced stream's longest gap."""
    events = 150
    go = threading.Event()

    async def handler(req: Req, conn: Conn) -> None:
        if b'"paced"' not in req.body:
            await json_answer(req, conn)
            return
        await conn.head(200, [("content-type", "text/event-stream"), ("transfer-encoding", "chunked")])
        for i in range(events):
            await conn.chunk(b'data: {"choices":[{"index":0,"delta":{"content":"x"}}]}\n\n')
            if i == 10:
                go.set()
            await asyncio.sleep(0.01)  # the upstream's pace, not a measurement
        await conn.chunk(b"data: [DONE]\n\n")
        await conn.end_chunked()

    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(self.format(record))

    keep = Keep()
    logging.getLogger("mlxproxy").addHandler(keep)
    old_level = logging.getLogger("mlxproxy").level
    logging.getLogger("mlxproxy").setLevel(logging.INFO)
    try:
        with proxy(stack, handler, log_requests=True) as (srv, app, up):
            arrivals: list[float] = []

            def paced() -> None:
                body = {"model": "paced", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
                with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=30) as r:
                    for _ in r.iter_raw():
                        arrivals.append(time.perf_counter())

            t = threading.Thread(target=paced)
            t.start()
            assert go.wait(10)
            with httpx.Client(timeout=30) as c:
                for i in range(3):
                    name = f"{i}\x1b[31m\nFAKE LOG LINE " + "m" * (1 << 20)
                    r = c.post(
                        srv.url + "/v1/chat/completions",
                        content=orjson.dumps({"model": name, "messages": []}),
                        headers={"content-type": "application/json"},
                    )
                    assert r.status_code == 200
                metrics = c.get(srv.url + "/metrics").content
            t.join(30)
            assert len(metrics) < 1_000_000
            gaps = [b - a for a, b in zip(arrivals[5:], arrivals[6:])]
            assert len(gaps) > 50
            longest = max(gaps)
            assert wait_for(lambda: len(app.recent.records) == 4)
            models = [r.model for r in app.recent.records]
            for m in models:
                assert m is not None and len(m) <= MAX_FIELD_CHARS and m.isprintable()
            assert len(set(models)) == 4  # distinct long names stay distinct
    finally:
        logging.getLogger("mlxproxy").removeHandler(keep)
        logging.getLogger("mlxproxy").setLevel(old_level)
    assert len(lines) == 4
    for line in lines:  # one request, one line; no terminal escapes
        assert "\n" not in line and "\x1b" not in line and len(line) < 2000, line[:300]
    assert not any(line.startswith("FAKE LOG LINE") for line in lines)
    return longest


def test_bounded_field() -> None:
    assert bounded_field("mlx-community/Qwen3-4B-4bit") == "mlx-community/Qwen3-4B-4bit"
    assert bounded_field("a\x1b[2Jb\nc\u2028") == "a\\x1b[2Jb\\nc\\u2028"
    long_a, long_b = "q" * 1000 + "a", "q" * 1000 + "b"
    assert len(bounded_field(long_a)) <= MAX_FIELD_CHARS and bounded_field(long_a) != bounded_field(long_b)
    assert bounded_field(long_a) == bounded_field(long_a) and bounded_field(long_a).startswith("q" * 100 + "~")
    assert len(bounded_field("\x00" * 100)) <= MAX_FIELD_CHARS and bounded_field("\x00" * 100).isprintable()


def test_a_long_model_name_on_a_stream_is_measured_normally(stack: str) -> None:
    """A 300-character model name is a valid request: the tokenizer lookup must not turn it
    into a protocol_error (it once made a too-long file name of it)."""
    with proxy(stack, ok_stream) as (srv, app, up):
        r = httpx.post(srv.url + "/v1/chat/completions", json={**STREAM_REQ, "model": "org/" + "n" * 300})
        assert r.status_code == 200 and r.content == OK_BODY
        assert wait_for(lambda: len(app.recent.records) == 1)
        rec = app.recent.records[0]
        assert rec.outcome == "ok" and rec.error is None, (rec.outcome, rec.error)


@linux_only
def test_100_mib_of_request_headers_is_refused_early_with_memory_flat(stack: str) -> None:
    """Four clients each try to send a 100 MiB request head: each gets 431 after about
    max_request_header_bytes, and the server's memory stays flat."""
    chunk = b"a" * 65536
    with proxy(stack) as (srv, app, up):
        httpx.get(srv.url + "/healthz")  # warm up
        before = rss_bytes()
        answers: list[bytes] = []
        sent: list[int] = []

        def attack() -> None:
            n = 0
            with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as s:
                s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: ")
                try:
                    while n < 100 << 20:
                        s.sendall(chunk)
                        n += len(chunk)
                except OSError:  # the server answered and closed
                    pass
                sent.append(n)
                answers.append(read_all(s))

        threads = [threading.Thread(target=attack) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        grown = rss_bytes() - before
    assert len(sent) == 4 and max(sent) < 32 << 20, sent  # refused long before 100 MiB
    assert grown < 40 << 20, grown
    assert up.requests == []
    for a in answers:
        if a:  # a reset may overtake the answer; when it arrives it is the 431 JSON
            assert_openai_error(*parse_responses(a)[0], 431)
    assert any(answers)


def test_too_many_header_lines_get_431(stack: str) -> None:
    with proxy(stack, max_request_headers=20) as (srv, app, up):
        head = "".join(f"X-H{i}: v\r\n" for i in range(25))
        got = parse_responses(exchange(srv.port, f"GET /v1/models HTTP/1.1\r\nHost: x\r\n{head}\r\n".encode()))
        err = assert_openai_error(*got[0], 431)
        assert "max_request_headers" in err["message"]
        ok = "".join(f"X-H{i}: v\r\n" for i in range(10))
        got = parse_responses(
            exchange(srv.port, f"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{ok}\r\n".encode())
        )
        assert got[0][0] == 200
        assert len(up.requests) == 1


def test_idle_and_unfinished_connections_are_closed_after_the_header_timeout(stack: str) -> None:
    """Connections that send nothing, or half a request head, are closed once
    request_header_timeout_s has passed (408 when part of a head came); others are served."""
    with proxy(stack, request_header_timeout_s=0.5) as (srv, app, up):
        t0 = time.monotonic()
        idle = [socket.create_connection(("127.0.0.1", srv.port), timeout=5) for _ in range(40)]
        half = [socket.create_connection(("127.0.0.1", srv.port), timeout=5) for _ in range(40)]
        for s in half:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        idle_answers = [read_all(s) for s in idle]
        half_answers = [read_all(s) for s in half]
        elapsed = time.monotonic() - t0
        for s in idle + half:
            s.close()
        assert elapsed < 4.0, elapsed  # closed by the server, not by the 5 s client timeout
        assert idle_answers == [b""] * 40
        for a in half_answers:
            err = assert_openai_error(*parse_responses(a)[0], 408)
            assert "request_header_timeout_s" in err["message"]
        assert httpx.get(srv.url + "/v1/models").status_code == 200
        assert len(up.requests) == 1


@pytest.mark.parametrize("case", ["half_head", "crlf_trickle", "pipelined_half_head"])
def test_a_kept_alive_connection_gets_the_header_timeout_for_its_next_request(stack: str, case: str) -> None:
    """After a served request on a kept-alive connection, the next request's head has the same
    deadline: half a head (answered 408), a trickle of bare line ends (which never begin a
    request), or half a head sent in the same write as the first request: each connection is
    closed within the timeout's bound, never held open (the last two may be closed silently
    or with an OpenAI-shaped 400/408, depending on the stack)."""
    first = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
    half = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Slow: "
    with proxy(stack, request_header_timeout_s=0.5) as (srv, app, up):
        with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as s:
            t0 = time.monotonic()
            s.sendall(first + half if case == "pipelined_half_head" else first)
            got = b""
            while b"\r\n\r\n" not in got:  # the first answer's head (its body is a few bytes more)
                part = s.recv(65536)
                assert part, got
                got += part
            if case == "half_head":
                s.sendall(half)
            elif case == "crlf_trickle":
                s.settimeout(0.2)
                with contextlib.suppress(OSError):
                    while time.monotonic() - t0 < 4.0:
                        s.sendall(b"\r\n")
                        part = s.recv(65536)  # (times out while the connection is open)
                        if not part:
                            break
                        got += part
                s.settimeout(5)
            got += read_all(s)
            elapsed = time.monotonic() - t0
        answers = parse_responses(got)
        assert answers[0][0] == 200
        assert elapsed < 4.0, elapsed  # closed by the server, well before the client gave up
        if case == "half_head":
            assert len(answers) == 2, answers
            err = assert_openai_error(*answers[1], 408)
            assert "request_header_timeout_s" in err["message"]
        else:
            assert len(answers) <= 2, answers
            for answer in answers[1:]:
                assert_openai_error(*answer, (400, 408))


# -- 3. one request, one response -----------------------------------------------------------------


SMUGGLING = [
    # both framings: the plain stack once answered the request hidden in the body
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 48\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"0\r\n\r\nGET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n"
    b"0\r\n\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 40\r\n\r\n{}",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: xchunked\r\n\r\n0\r\n\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked, identity\r\n\r\n0\r\n\r\n",
    b"GET /v1/models HTTP/9.9\r\nHost: x\r\n\r\n",
    b"GET /v1/models HTTP/1.1\nHost: x\n\n",
    b"GET /v1/models HTTP/1.1\r\nHost: x\nX-A: b\r\n\r\n",
    b"GET /v1/models HTTP/1.1\r\nHost: x\r\n X-Folded: y\r\n\r\n",
    b"GARBAGE\r\n\r\n",
    b"GET /v1/models HTTP/1.1\r\nBad Header Line\r\n\r\n",
    b"GET /v1/models HTTP/1.1\r\nHost: x\x00y\r\n\r\n",
]


@pytest.mark.parametrize("attack", range(len(SMUGGLING)))
def test_ambiguous_or_malformed_requests_are_refused_and_the_connection_closed(stack: str, attack: int) -> None:
    """A request with both Content-Length and Transfer-Encoding, duplicate lengths, an
    unknown coding, a foreign HTTP version, bare LF line ends, a folded or broken header:
    one OpenAI-shaped 400, the connection closed, nothing forwarded."""
    with proxy(stack) as (srv, app, up):
        data = SMUGGLING[attack] + b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"  # a second request after it
        got = parse_responses(exchange(srv.port, data))
        assert len(got) == 1, got  # never a second answer on that connection
        assert_openai_error(*got[0], 400)
        assert got[0][1].get("connection") == "close"
        assert up.requests == [] and app.requests_seen == 0


def test_each_client_gets_its_own_answer_when_the_upstream_sends_extra_bytes(stack: str) -> None:
    """An upstream that sends a whole extra response (or more body than it announced)
    after its answer: the proxy never hands those bytes to the next request."""
    sent_extra = threading.Event()

    async def handler(req: Req, conn: Conn) -> None:
        mine = orjson.loads(req.body)["mark"].encode()
        extra = mine + b"-STALE"
        if b"long" in mine:  # more body than Content-Length says, in the same write
            await conn.send(
                b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(mine), mine)
                + b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(extra), extra)
            )
        else:  # a whole extra response a moment later, on the idle connection
            await conn.send(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(mine), mine))
            await asyncio.sleep(0.02)
            await conn.send(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(extra), extra))
        sent_extra.set()

    with proxy(stack, handler) as (srv, app, up), httpx.Client(timeout=10) as c:
        for i in range(8):
            mark = f"req{i}" + ("long" if i % 2 else "")
            sent_extra.clear()
            r = c.post(srv.url + "/v1/x", json={"mark": mark})
            assert r.status_code == 200 and r.content == mark.encode(), (i, r.status_code, r.content)
            assert sent_extra.wait(5)


@pytest.mark.parametrize("read_s", [0, 1800])
def test_a_connection_that_got_part_of_an_extra_response_while_idle_is_not_reused(stack: str, read_s: int) -> None:
    """The start of an extra response arrives while the connection sits idle in the pool, its
    rest only with the next request on that connection: reusing the connection would hand that
    request a broken answer (the rest of the stale response first). The next request must go
    to another connection and get its own answer, with a read timeout (whose timer the stray
    bytes arm) and without one (read_s 0)."""
    rest: dict[object, bytes] = {}  # per upstream connection (its writer): what it still owes of a stale response
    sent_extra = threading.Event()

    async def handler(req: Req, conn: Conn) -> None:
        mine = orjson.loads(req.body)["mark"].encode()
        stale = b"%s-STALE" % mine
        await conn.send(
            rest.pop(conn.writer, b"") + b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(mine), mine)
        )
        await asyncio.sleep(0.02)
        await conn.send(b"HTTP/1.1 200 OK\r\ncontent-len")  # half a head, while idle
        rest[conn.writer] = b"gth: %d\r\n\r\n%s" % (len(stale), stale)
        sent_extra.set()

    with proxy(stack, handler, timeouts={"read_s": read_s}) as (srv, app, up), httpx.Client(timeout=10) as c:
        for i in range(6):
            sent_extra.clear()
            r = c.post(srv.url + "/v1/x", json={"mark": f"req{i}"})
            assert r.status_code == 200 and r.content == f"req{i}".encode(), (i, r.status_code, r.content)
            assert sent_extra.wait(5)
            # the half head is in the proxy's socket before this request is sent, so the proxy
            # has read it before it answers: the next request finds the connection marked
            assert c.get(srv.url + "/healthz").status_code == 200


def test_a_stale_pooled_connection_never_becomes_a_504(stack: str) -> None:
    """After a large Content-Length answer and an idle pause longer than read_s, the next
    request gets its own answer (aiohttp, the upstream client before proxy/transport.py, could
    leave the read timer of the old response armed, which failed the next request on that
    connection at once)."""
    big = b"b" * (2 << 20)

    async def handler(req: Req, conn: Conn) -> None:
        body = big if req.path == "/big" else b"small:" + req.body
        await conn.send(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(body) + body)

    with proxy(stack, handler, timeouts={"read_s": 0.3}) as (srv, app, up), httpx.Client(timeout=10) as c:
        for i in range(3):
            r = c.get(srv.url + "/big")
            assert r.status_code == 200 and r.content == big
            time.sleep(0.5)  # idle longer than read_s (waiting for the timer, not measuring)
            r = c.post(srv.url + "/small", content=f"{i}".encode())
            assert r.status_code == 200 and r.content == f"small:{i}".encode(), (i, r.status_code, r.text[:200])


def test_idle_upstream_connections_are_dropped_before_a_server_would_close_them(
    stack: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pooled upstream connection idle longer than POOL_IDLE_S (4 s, below the 5 s
    keep-alive of uvicorn-based servers) is not used again; one idle for less is."""
    import mlxproxy.proxy.transport as transport_module

    assert transport_module.POOL_IDLE_S < 5
    monkeypatch.setattr(transport_module, "POOL_IDLE_S", 0.3)
    peers: list[int] = []

    async def handler(req: Req, conn: Conn) -> None:
        peers.append(conn.writer.get_extra_info("peername")[1])
        await json_answer(req, conn)

    with proxy(stack, handler) as (srv, app, up), httpx.Client(timeout=10) as c:
        for _ in range(2):
            assert c.get(srv.url + "/v1/models").status_code == 200
        time.sleep(0.6)  # idle past POOL_IDLE_S (waiting for it, not measuring)
        assert c.get(srv.url + "/v1/models").status_code == 200
    assert peers[0] == peers[1] and peers[2] != peers[1], peers


# -- 5. errors in the promised shape ------------------------------------------------------------------


def test_every_error_the_proxy_makes_is_openai_shaped(stack: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from support import closed_port

    monkeypatch.setenv("MLXPROXY_TEST_KEY", "pk-test-key-1234")
    with proxy(stack, max_request_body_bytes=10) as (srv, app, up), httpx.Client(timeout=10) as c:
        r = c.post(srv.url + "/v1/chat/completions", content=b"x" * 100)
        assert_openai_error(r.status_code, dict(r.headers), r.content, 413)
        r = c.post(srv.url + "/metrics")
        assert_openai_error(r.status_code, dict(r.headers), r.content, 405)

        def boom(*a, **k):
            raise RuntimeError("secret-detail\nwith a second line")

        monkeypatch.setattr(app, "_forward", boom)
        r = c.post(srv.url + "/v1/chat/completions", content=b"{}")
        err = assert_openai_error(r.status_code, dict(r.headers), r.content, 500)
        assert err["code"] == "internal_error" and "secret-detail" not in err["message"]
        assert len(r.headers["x-mlxproxy-request-id"]) == 16  # the request had a record id
    with FakeUpstream(json_answer) as up:
        cfg = build_config(upstream_url=up.url, log_requests=False, proxy_api_key_env="MLXPROXY_TEST_KEY")
        with ServerThread(create_app(cfg), stack=stack) as srv:
            r = httpx.get(srv.url + "/v1/models")
            assert_openai_error(r.status_code, dict(r.headers), r.content, 401)
    cfg = build_config(upstream_url=f"http://127.0.0.1:{closed_port()}", log_requests=False)
    with ServerThread(create_app(cfg), stack=stack) as srv:
        r = httpx.post(srv.url + "/v1/chat/completions", json=STREAM_REQ)
        assert_openai_error(r.status_code, dict(r.headers), r.content, 502)
        assert r.headers["x-mlxproxy-request-id"]

    async def silent(req: Req, conn: Conn) -> None:
        await conn.wait_peer_close(5)

    with proxy(stack, silent, timeouts={"read_s": 0.2}) as (srv, app, up):
        r = httpx.post(srv.url + "/v1/chat/completions", json=STREAM_REQ, timeout=10)
        assert_openai_error(r.status_code, dict(r.headers), r.content, 504)
        assert r.headers["x-mlxproxy-request-id"]


def test_finishing_a_huge_stream_record_does_not_stall_other_streams(stack: str) -> None:
    """The record of a stream with 300,000 events is finished off the event loop: a paced
    stream in flight meanwhile keeps its pace (gaps under 100 ms; finishing such a record
    on the loop stalled it for longer, in every attempt). A loaded machine only lengthens
    gaps, so the best of up to three attempts is judged."""
    worst = []
    for _ in range(3):
        worst.append(_stall_while_finishing_a_huge_record(stack))
        if worst[-1] < 0.1:
            break
    assert min(worst) < 0.1, worst


def _stall_while_finishing_a_huge_record(stack: str) -> float:
    """The longest gap of a paced stream while the proxy finishes a 300,000-event record."""
    n_chunks, per_chunk = 150, 2000
    recorded = threading.Event()
    event = b'data: {"choices":[{"index":0,"delta":{"content":"x"}}]}\n\n'
    end = b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n'

    async def handler(req: Req, conn: Conn) -> None:
        await conn.head(200, [("content-type", "text/event-stream"), ("transfer-encoding", "chunked")])
        if b'"paced"' in req.body:
            after = 0
            while after < 10:
                await conn.chunk(event)
                await asyncio.sleep(0.01)  # the upstream's pace, not a measurement
                after += recorded.is_set()
        else:
            for _ in range(n_chunks):
                await conn.chunk(event * per_chunk)
        await conn.chunk(end)
        await conn.end_chunked()

    with proxy(stack, handler) as (srv, app, up):
        arrivals: list[float] = []

        def paced() -> None:
            body = {"model": "paced", "stream": True, "messages": []}
            with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=60) as r:
                for _ in r.iter_raw():
                    arrivals.append(time.perf_counter())

        t = threading.Thread(target=paced)
        t.start()
        assert wait_for(lambda: len(arrivals) > 5, 10)
        with httpx.stream(
            "POST", srv.url + "/v1/chat/completions", json={"model": "big", "stream": True}, timeout=60
        ) as r:
            size = sum(len(part) for part in r.iter_raw())
        t_end = time.perf_counter()
        assert size == len(event) * n_chunks * per_chunk + len(end)
        assert wait_for(lambda: any(r.model == "big" for r in app.recent.records), 30)
        recorded.set()
        t.join(30)
        big = next(r for r in app.recent.records if r.model == "big")
        assert big.outcome == "ok" and big.generated_events == n_chunks * per_chunk
        assert (
            app.registry.get_sample_value(
                "mlxproxy_inter_token_latency_seconds_count", {"upstream": "default", "model": "big"}
            )
            == n_chunks * per_chunk - 1
        )
        # while the big stream flows, this one process (upstream, proxy, both clients)
        # shares one GIL; from the moment its end reached the client, the proxy is
        # finishing its record: that phase is what must not stall the paced stream
        gaps = [b - a for a, b in zip(arrivals, arrivals[1:]) if b > t_end]
        assert len(gaps) >= 10
        return max(gaps)


# -- 4. config and files ------------------------------------------------------------------------------


def test_a_billion_laughs_config_is_refused_in_under_a_second(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from mlxproxy.cli import main

    lines = ["port:", '  - &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for prev, name in zip("abcdefgh", "bcdefghi"):
        lines.append(f"  - &{name} [" + ",".join([f"*{prev}"] * 9) + "]")
    p = tmp_path / "lol.yaml"
    p.write_text("\n".join(lines) + "\n")
    assert p.stat().st_size < 500
    t0 = time.monotonic()
    res = CliRunner().invoke(main, ["serve", "--config", str(p)])
    elapsed = time.monotonic() - t0
    assert res.exit_code == 2 and elapsed < 1.0, (res.exit_code, elapsed)
    assert res.output.count("\n") == 1 and "YAML aliases" in res.output and len(res.output) < 300
    # aliases that stay small are fine
    from mlxproxy.config import load_config

    p.write_text(
        "upstreams:\n  - &u {name: a, url: 'http://127.0.0.1:1', models: &m [x, y]}\n"
        "  - {name: b, url: 'http://127.0.0.1:2', models: *m}\n"
    )
    assert load_config(p).upstreams[1].models == ("x", "y")


def test_an_upstream_key_an_http_header_cannot_carry_refuses_to_start(monkeypatch: pytest.MonkeyPatch) -> None:
    from mlxproxy.errors import ConfigError

    for value in ["ключ", "sk-1\r\nX-Injected: 1"]:
        monkeypatch.setenv("MLXPROXY_UPSTREAM_KEY", value)
        cfg = build_config(
            {"upstreams": [{"name": "a", "url": "http://127.0.0.1:1", "api_key_env": "MLXPROXY_UPSTREAM_KEY"}]}
        )
        with pytest.raises(ConfigError, match="upstream 'a'") as ei:
            create_app(cfg)
        assert "\n" not in str(ei.value) and value not in str(ei.value)


def test_capture_refuses_files_it_did_not_write(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """--capture never appends to (or cuts) a file that is not a capture, never follows a
    symlink, says what is wrong in one line, and tightens a capture readable by others."""
    from click.testing import CliRunner

    from mlxproxy.cli import main
    from mlxproxy.errors import ConfigError
    from mlxproxy.proxy.capture_writer import CaptureWriter

    notes = tmp_path / "notes.txt"
    for content in [b"my notes\nlast line without newline", b"no newline at all", b'{"some": "json"}\n']:
        notes.write_bytes(content)
        with pytest.raises(ConfigError, match="not an mlxproxy capture"):
            CaptureWriter(notes)
        assert notes.read_bytes() == content  # untouched
    real = tmp_path / "real.jsonl"
    w = CaptureWriter(real)
    w.close()
    link = tmp_path / "link.jsonl"
    link.symlink_to(real)
    with pytest.raises(ConfigError, match="is a symlink"):
        CaptureWriter(link)
    link2 = tmp_path / "link2.jsonl"
    link2.symlink_to(notes)
    with pytest.raises(ConfigError, match="is a symlink"):
        CaptureWriter(link2)
    with caplog.at_level(logging.ERROR, logger="mlxproxy"):  # unwritable: reported once, the proxy runs on
        CaptureWriter(notes / "sub" / "c.jsonl").close()
    assert any("notes.txt' is a file, not a directory" in r.getMessage() for r in caplog.records)
    with pytest.raises(ConfigError, match="not a regular file"):
        CaptureWriter(tmp_path)
    res = CliRunner().invoke(main, ["serve", "--upstream", "http://127.0.0.1:9", "--capture", str(notes)])
    assert res.exit_code == 2 and res.output.count("\n") == 1 and "not an mlxproxy capture" in res.output
    assert notes.read_bytes() == b'{"some": "json"}\n'
    # an existing capture with loose permissions is set to owner-only, with a warning
    real.write_bytes(b'{"id":"x","v":1}\n')
    real.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="mlxproxy"):
        CaptureWriter(real).close()
    assert real.stat().st_mode & 0o777 == 0o600
    assert any("readable by others" in r.getMessage() for r in caplog.records)


@linux_only
def test_capture_queue_memory_stays_bounded_with_a_stuck_disk(tmp_path: Path) -> None:
    """With the disk stuck, 200 requests with 1 MiB prompts hold at most
    capture_queue_bytes in the queue (plus the line being written); the rest are dropped
    and counted."""
    from mlxproxy.capture import Exchange
    from mlxproxy.core.record import Record
    from mlxproxy.proxy.capture_writer import CaptureWriter

    stuck = threading.Event()
    w = CaptureWriter(tmp_path / "c.jsonl", queue_bytes=8 << 20)
    real_write = w._write_line
    w._write_line = lambda line: (stuck.wait(30), real_write(line))[1]  # type: ignore[method-assign]
    before = rss_bytes()
    for i in range(200):
        body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": f"{i}" + "p" * (1 << 20)}]})
        rec = Record(
            id=f"r{i}",
            started_at=0.0,
            upstream="u",
            model="m",
            endpoint="chat_completions",
            stream=True,
            status=200,
            outcome="ok",
        )
        w.on_record(rec, Exchange(body, [(b"content-type", b"application/json")]))
        del body
    grown = rss_bytes() - before
    assert w.queued_bytes <= 8 << 20 + (2 << 20)
    assert 180 <= w.dropped < 200, w.dropped
    assert grown < 40 << 20, grown  # was 200+ MiB with a queue bounded only by records
    stuck.set()
    w.close()
    assert w.written == 200 - w.dropped and w.queued_bytes == 0


def test_serve_refuses_an_unknown_stack_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    from mlxproxy.cli import main

    monkeypatch.setenv("MLXPROXY_STACK", "turbo")
    res = CliRunner().invoke(main, ["serve", "--port", "0", "--upstream", "http://127.0.0.1:9"])
    assert (
        res.exit_code == 2 and res.output.count("\n") == 1 and "MLXPROXY_STACK must be one of plain, fast" in res.output
    )


def test_mlxproxy_serve_applies_the_configured_limits_on_each_stack(stack: str, tmp_path: Path) -> None:
    """The real `mlxproxy serve` process, on the stack MLXPROXY_STACK names, enforces the
    config's head limits and refuses a foreign target."""
    import subprocess
    import sys

    cfg = tmp_path / "c.yaml"
    cfg.write_text("max_request_header_bytes: 2048\nrequest_header_timeout_s: 0.3\n")
    with FakeUpstream(json_answer) as up:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mlxproxy",
                "serve",
                "--config",
                str(cfg),
                "--upstream",
                up.url,
                "--port",
                "0",
                "--log-level",
                "warning",
            ],
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "MLXPROXY_STACK": stack},
        )
        try:
            port = 0
            for line in proc.stderr:  # type: ignore[union-attr]
                if "listening on http://127.0.0.1:" in line:
                    port = int(line.split("http://127.0.0.1:")[1].split("/")[0])
                    break
            assert port
            big = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-A: " + b"a" * 4096 + b"\r\n\r\n"
            assert_openai_error(*parse_responses(exchange(port, big))[0], 431)
            assert exchange(port, b"") == b""  # an idle connection is closed by the server
            got = parse_responses(exchange(port, f"GET http://127.0.0.1:{up.port}/v1/models HTTP/1.1\r\n\r\n".encode()))
            assert_openai_error(*got[0], 400)
            ok = parse_responses(exchange(port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"))
            assert ok[0][0] == 200 and len(up.requests) == 1
        finally:
            proc.terminate()
            proc.wait(10)


def test_streams_stays_quick_with_a_million_event_record_in_the_recent_list(stack: str) -> None:
    """/streams shows records without their timeline, so a 10^6-event record in the recent
    list costs it no more than any other (copying its offsets took 0.8-1.5 s of the loop)."""
    from mlxproxy.core.record import Record

    with proxy(stack) as (srv, app, up), httpx.Client(timeout=30) as c:
        small = Record(
            id="a",
            started_at=1.0,
            upstream="default",
            model="m",
            endpoint="chat_completions",
            stream=True,
            status=200,
            outcome="ok",
            event_offsets_s=(0.1, 0.2),
        )
        app.recent.on_record(small)
        plain = c.get(srv.url + "/streams").json()["recent"]
        assert plain == [small.to_dict()]  # the same document as before
        app.recent.on_record(
            Record(
                id="b",
                started_at=2.0,
                upstream="default",
                model="m",
                endpoint="chat_completions",
                stream=True,
                status=200,
                outcome="ok",
                event_offsets_s=tuple(i * 1e-3 for i in range(1_000_000)),
            )
        )
        t0 = time.perf_counter()
        got = c.get(srv.url + "/streams").json()["recent"]
        assert time.perf_counter() - t0 < 0.5
        assert [r["id"] for r in got] == ["b", "a"] and "event_offsets_s" not in got[0]
