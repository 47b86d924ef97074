"""The benchmark's load generator: raw asyncio HTTP/1.1 keep-alive client, own process.

Cheap on purpose (the client must never be the bottleneck): one `asyncio.Protocol` per
connection, no HTTP library, every body read is stamped in `data_received` before any
parsing, chunked framing and SSE events are found with `bytes.find`. A content event's
`"ts"` (written by benchmarks/upstream.py from the shared monotonic clock) gives its
one-way delay upstream -> client.

Driven by the harness over stdin/stdout, one JSON job per line in, one JSON result per
line out (see `run_job`). Every job is bounded in requests and in time.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import sys
import time

now = time.perf_counter


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def request_bytes(host: str, port: int, path: str, body: bytes, auth: str | None = None) -> bytes:
    """The request, byte for byte the same for every target (an API key, when given, is sent
    to all of them: LiteLLM insists on one, the others just forward or ignore it)."""
    key = f"Authorization: Bearer {auth}\r\n" if auth else ""
    return (
        f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Accept: */*\r\n{key}Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


def chat_body(stream: bool, tokens: int, shape: str = "small") -> bytes:
    """The request body: "small" (one short user message) or "agent" (50 messages, 10 tools:
    `bodies.py`)."""
    if shape != "small":
        import bodies

        return bodies.chat_body(stream, tokens, shape)
    obj = {"model": "bench", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": tokens}
    if stream:
        obj["stream"] = True
    return json.dumps(obj, separators=(",", ":")).encode()


class Window:
    """Where events are recorded: only those stamped inside [t0, t1]."""

    __slots__ = ("t0", "t1", "events", "gaps", "lat")

    def __init__(self, t0: float, t1: float) -> None:
        self.t0, self.t1 = t0, t1
        self.events = 0
        self.gaps: list[float] = []
        self.lat: list[float] = []


class Response:
    __slots__ = ("status", "t_sent", "t_first", "t_end", "tokens", "done", "closed", "body_len")

    def __init__(self, t_sent: float) -> None:
        self.status = 0
        self.t_sent = t_sent
        self.t_first: float | None = None  # first content event
        self.t_end: float | None = None
        self.tokens = 0
        self.done = False  # saw data: [DONE]
        self.closed = False  # the server asked to close the connection
        self.body_len = 0


class Conn(asyncio.Protocol):
    """One keep-alive connection; `request()` returns a future resolved with a `Response`."""

    def __init__(self, window: Window | None) -> None:
        self.window = window
        self.transport: asyncio.Transport | None = None
        self.fut: asyncio.Future[Response] | None = None
        self.lost = False
        self.resp: Response | None = None

    # -- protocol ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self.fut is not None and not self.fut.done():
            self.fut.set_exception(ConnectionError(f"connection lost: {exc!r}"))

    def request(self, raw: bytes) -> asyncio.Future[Response]:
        assert self.transport is not None
        self.fut = asyncio.get_running_loop().create_future()
        self.head = b""
        self.in_head = True
        self.chunked = False
        self.remaining = 0  # bytes left in the current chunk / content-length body
        self.crlf = 0  # CRLF bytes to skip after a chunk
        self.cbuf = b""  # partial chunk-size line
        self.sbuf = b""  # partial SSE event
        self.last = 0.0  # previous content event of this response
        self.resp = Response(now())
        self.transport.write(raw)
        return self.fut

    def data_received(self, data: bytes) -> None:
        t = now()
        resp = self.resp
        if resp is None or self.fut is None or self.fut.done():
            return
        if self.in_head:
            head = self.head + data
            i = head.find(b"\r\n\r\n")
            if i < 0:
                self.head = head
                return
            self.in_head = False
            lines = head[:i].split(b"\r\n")
            resp.status = int(lines[0].split(b" ", 2)[1])
            length = -1
            for line in lines[1:]:
                k, _, v = line.partition(b":")
                k = k.strip().lower()
                if k == b"transfer-encoding" and b"chunked" in v.lower():
                    self.chunked = True
                elif k == b"content-length":
                    length = int(v)
                elif k == b"connection" and b"close" in v.lower():
                    resp.closed = True
            data = head[i + 4 :]
            if not self.chunked:
                self.remaining = length
                if length == 0:
                    self._finish(t)
                    return
        if self.chunked:
            self._chunked(data, t)
        else:
            self._payload(data, t)
            if self.remaining >= 0:
                self.remaining -= len(data)
                if self.remaining <= 0:
                    self._finish(t)

    def eof_received(self) -> bool | None:
        if (
            self.fut is not None
            and not self.fut.done()
            and self.resp is not None
            and not self.in_head
            and not self.chunked
            and self.remaining < 0
        ):
            self._finish(now())  # body delimited by the connection's end
        return None

    # -- parsing -----------------------------------------------------------------------

    def _chunked(self, data: bytes, t: float) -> None:
        buf = self.cbuf + data if self.cbuf else data
        self.cbuf = b""
        pos, n = 0, len(buf)
        while pos < n:
            if self.remaining:
                take = min(self.remaining, n - pos)
                self._payload(buf[pos : pos + take], t)
                pos += take
                self.remaining -= take
                if not self.remaining:
                    self.crlf = 2
            elif self.crlf:
                skip = min(self.crlf, n - pos)
                pos += skip
                self.crlf -= skip
            else:
                i = buf.find(b"\r\n", pos)
                if i < 0:
                    self.cbuf = buf[pos:]
                    return
                size = int(buf[pos:i].split(b";", 1)[0], 16)
                pos = i + 2
                if size == 0:
                    self._finish(t)
                    return
                self.remaining = size

    def _payload(self, data: bytes, t: float) -> None:
        assert self.resp is not None
        self.resp.body_len += len(data)
        buf = self.sbuf + data if self.sbuf else data
        start = 0
        find = buf.find
        while True:
            i = find(b"\n\n", start)
            if i < 0:
                break
            self._event(buf, start, i, t)
            start = i + 2
        self.sbuf = buf[start:] if start < len(buf) else b""

    def _event(self, buf: bytes, start: int, end: int, t: float) -> None:
        resp = self.resp
        assert resp is not None
        if buf.startswith(b"data: [DONE]", start):
            resp.done = True
            return
        j = buf.find(b'"content":"', start, end)
        if j < 0 or buf[j + 11] == 0x22:  # no content, or content "" (role chunk)
            return
        resp.tokens += 1
        if resp.t_first is None:
            resp.t_first = t
        w = self.window
        if w is not None and w.t0 <= t <= w.t1:
            w.events += 1
            if self.last:
                w.gaps.append(t - self.last)
            k = buf.find(b'"ts":', start, end)
            if k >= 0:
                e = buf.find(b",", k, end)
                try:
                    w.lat.append(t - float(buf[k + 5 : e]))
                except ValueError:
                    pass
        self.last = t

    def _finish(self, t: float) -> None:
        assert self.resp is not None
        self.resp.t_end = t
        if self.fut is not None and not self.fut.done():
            self.fut.set_result(self.resp)


async def connect(host: str, port: int, window: Window | None) -> Conn:
    loop = asyncio.get_running_loop()
    _, conn = await asyncio.wait_for(loop.create_connection(lambda: Conn(window), host, port), 10.0)
    return conn


class Errors:
    def __init__(self) -> None:
        self.count = 0
        self.kinds: dict[str, int] = {}

    def add(self, kind: str, real: bool = True) -> None:
        """`real=False`: not a failure of the server (a stream still running when the job's
        bounded drain time ran out); listed in `kinds`, not counted."""
        if real:
            self.count += 1
        self.kinds[kind] = self.kinds.get(kind, 0) + 1


async def one(
    conn: Conn | None,
    host: str,
    port: int,
    raw: bytes,
    window: Window | None,
    timeout: float,
    errors: Errors,
    expect_tokens: int | None,
    clipped: bool = False,
) -> tuple[Conn | None, Response | None]:
    """One request on `conn` (reconnecting when needed); counts failures in `errors`.
    `clipped`: `timeout` is the job's remaining time, not the request timeout."""
    try:
        if conn is None or conn.lost:
            conn = await connect(host, port, window)
        resp = await asyncio.wait_for(conn.request(raw), timeout)
    except asyncio.TimeoutError:
        errors.add("unfinished_at_job_end" if clipped else "timeout", real=not clipped)
        _close(conn)
        return None, None
    except (OSError, ConnectionError) as exc:
        errors.add(type(exc).__name__)
        _close(conn)
        return None, None
    if resp.status != 200:
        errors.add(f"http_{resp.status}")
    elif expect_tokens is not None and (resp.tokens != expect_tokens or not resp.done):
        errors.add("truncated" if resp.tokens < expect_tokens else "extra_tokens")
    if resp.closed:
        _close(conn)
        conn = None
    return conn, resp


def _close(conn: Conn | None) -> None:
    if conn is not None and conn.transport is not None:
        conn.transport.close()


# -- jobs --------------------------------------------------------------------------------


async def job_seq(job: dict) -> dict:
    """`n` sequential requests on one connection; latency = request written -> body complete."""
    host, port = job["host"], job["port"]
    stream = bool(job.get("stream"))
    raw = request_bytes(
        host,
        port,
        job.get("path", "/v1/chat/completions"),
        chat_body(stream, job.get("tokens", 8), job.get("shape", "small")),
        job.get("auth"),
    )
    errors = Errors()
    lat: list[float] = []
    ttft: list[float] = []
    conn: Conn | None = None
    deadline = now() + job.get("max_s", 60)
    for _ in range(job["n"]):
        if now() > deadline:
            errors.add("job_deadline")
            break
        conn, resp = await one(
            conn, host, port, raw, None, job.get("timeout", 10), errors, job.get("tokens") if stream else None
        )
        if resp is not None and resp.status == 200 and resp.t_end is not None:
            lat.append(resp.t_end - resp.t_sent)
            if resp.t_first is not None:
                ttft.append(resp.t_first - resp.t_sent)
    _close(conn)
    return {"lat": lat, "ttft": ttft, "errors": errors.count, "error_kinds": errors.kinds}


async def job_load(job: dict) -> dict:
    """`streams` concurrent streams, each one keep-alive connection issuing `tokens`-token
    streaming requests back to back. Starts are spread over `ramp_s`; events are recorded
    in the window [warmup, warmup + window]; no request starts after the window and
    the job waits (bounded) for the ones in flight."""
    host, port = job["host"], job["port"]
    n, tokens = job["streams"], job["tokens"]
    raw = request_bytes(
        host, port, "/v1/chat/completions", chat_body(True, tokens, job.get("shape", "small")), job.get("auth")
    )
    t_begin = now()
    w = Window(t_begin + job["warmup_s"], t_begin + job["warmup_s"] + job["window_s"])
    errors = Errors()
    requests = [0]
    total_events = [0]
    hard_end = w.t1 + job.get("drain_s", 10)

    async def worker(i: int) -> None:
        await asyncio.sleep(job.get("ramp_s", 0) * i / n)
        conn: Conn | None = None
        while now() < w.t1:
            remaining = hard_end - now()
            if remaining <= 0:
                break
            timeout = job.get("timeout", 30)
            conn, resp = await one(
                conn, host, port, raw, w, min(timeout, remaining), errors, tokens, remaining < timeout
            )
            requests[0] += 1
            if resp is not None:
                total_events[0] += resp.tokens
            else:
                await asyncio.sleep(0.05)  # do not spin on a refusing server
        _close(conn)

    cpu0 = _cpu()
    await asyncio.gather(*(worker(i) for i in range(n)))
    t_done = now()
    return {
        "events": w.events,
        "window_s": w.t1 - w.t0,
        "gaps": [round(g, 7) for g in w.gaps],
        "lat": [round(x, 7) for x in w.lat],
        "errors": errors.count,
        "error_kinds": errors.kinds,
        "requests": requests[0],
        "total_events": total_events[0],
        "elapsed_s": t_done - t_begin,
        "client_cpu_s": _cpu() - cpu0,
    }


async def job_churn(job: dict) -> dict:
    """`n` short streaming requests with `concurrency` workers (RSS-growth check)."""
    host, port = job["host"], job["port"]
    tokens = job.get("tokens", 8)
    raw = request_bytes(
        host, port, "/v1/chat/completions", chat_body(True, tokens, job.get("shape", "small")), job.get("auth")
    )
    errors = Errors()
    left = [job["n"]]
    deadline = now() + job.get("max_s", 120)

    async def worker() -> None:
        conn: Conn | None = None
        while left[0] > 0 and now() < deadline:
            left[0] -= 1
            conn, _ = await one(conn, host, port, raw, None, job.get("timeout", 10), errors, tokens)
        _close(conn)

    t0 = now()
    await asyncio.gather(*(worker() for _ in range(job.get("concurrency", 8))))
    if left[0] > 0:
        errors.add("job_deadline")
    return {
        "errors": errors.count,
        "error_kinds": errors.kinds,
        "done": job["n"] - max(left[0], 0),
        "elapsed_s": now() - t0,
    }


JOBS = {"seq": job_seq, "load": job_load, "churn": job_churn}


async def run_job(job: dict) -> dict:
    try:
        return await JOBS[job["kind"]](job)
    except Exception as exc:  # report, never die: the harness decides
        return {"fatal": f"{type(exc).__name__}: {exc}", "errors": 1}


def main() -> None:
    from upstream import run  # same folder; uvloop when installed

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        while True:
            line = await loop.run_in_executor(None, sys.stdin.readline)
            if not line:
                return
            job = json.loads(line)
            if job.get("kind") == "quit":
                return
            result = await run_job(job)
            sys.stdout.write(json.dumps(result) + "\n")
            sys.stdout.flush()

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    run(serve())


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
