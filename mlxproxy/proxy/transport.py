"""The proxy's upstream transport: raw asyncio HTTP/1.1, one `asyncio.Protocol` per connection
and a keep-alive pool per upstream.

Why not a client library: aiohttp, the client before this module, cost 0.31 M instructions per
request and ~21 k per streamed event more than this transport's first sketch, on the floor's
stack (`benchmarks/floor.py`; benchmarks/README.md, "a lean upstream transport") — about a
third of what the whole proxy executed per small request. The response is parsed by the
server edge's parsers (`mlxproxy.edge.httpparse`: httptools' llhttp, h11's on the plain stack),
which the load generator's client uses too; this module parses nothing itself. http:// and
https:// (the standard library's default TLS context, certificates verified) both go here:
there is no second transport.

`Pool.open()` sends a request and returns the `Conn` once status and headers arrived; its
`read()` hands out the body as it arrives, de-chunked. Errors are the project's own
(`mlxproxy.errors`): `UpstreamError` subclasses before the response head, `UpstreamBodyError`
(or `UpstreamBodyTimeout`) after. A connection is reused only after a response read to its
announced end with keep-alive, and never after anything unexpected: a byte while idle or
beyond the announced body, a parse error, a timeout, a read the proxy did not finish.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from urllib.parse import urlsplit

from mlxproxy.edge.dial import POOL_IDLE_S, ClientProtocol, Dialer, framing
from mlxproxy.edge.httpparse import H11Parser, HttptoolsParser, failure_reason
from mlxproxy.edge.limits import drop_transport_cycle
from mlxproxy.errors import (
    UpstreamBodyError,
    UpstreamBodyTimeout,
    UpstreamError,
    UpstreamTimeout,
    UpstreamUnreachable,
)

__all__ = ["Conn", "Pool", "POOL_IDLE_S", "MAX_IDLE", "HIGH_WATER"]

#: idle connections kept per upstream at most (a burst's others are closed when given back);
#: connections in use are not limited (as aiohttp's `limit=0` before: the server, not the
#: proxy, decides how many requests it takes at once)
MAX_IDLE = 256
#: body bytes buffered, not yet read by the relay, above which the socket is not read (the
#: upstream then waits for a slow client instead of filling the proxy's memory)
HIGH_WATER = 1 << 18
#: methods for which an empty body goes without a Content-Length (as aiohttp sent them)
_NO_LENGTH = frozenset({b"GET", b"HEAD", b"OPTIONS", b"TRACE", b"CONNECT"})


class Conn(ClientProtocol):
    """One upstream connection, serving one request at a time; while it serves one, its
    response's head (`status`, `headers`) and its body (`read`)."""

    def __init__(self, pool: Pool) -> None:
        super().__init__()
        self.pool = pool
        self.loop = pool.loop
        self.parser: HttptoolsParser | H11Parser | None = None
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.close_delimited = False  # (read by the parser: a body that ends with the close)
        self.content_type: str | None = None
        self.head_only = False
        self.head: asyncio.Future[None] | None = None  # done when the head arrived (or failed)
        self.buf: list[bytes] = []
        self.buffered = 0
        self.paused = False
        self.waiter: asyncio.Future[None] | None = None
        self.complete = False  # the response ended as announced
        self.keep_alive = False
        # what `read` (or `Pool.open`) raises once the buffer is empty: kept as class and text and
        # raised anew each time, so no raised exception's traceback (whose frames hold this
        # connection) is kept here: that would be a reference cycle per failed request
        self.error: tuple[type[UpstreamError | UpstreamBodyError], str] | None = None
        self.idle_since = 0.0
        self.deadline = 0.0  # the read timeout's: the last read plus `read_s`
        self.armed_for = 0.0

    # -- asyncio.Protocol --------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        parser = self.parser
        if parser is None or self.complete:
            # an extra response, more body than announced, anything while idle: never reused
            self.tainted = True
            if parser is None:
                self.abort()
            return
        if self.timer is not None:
            self.deadline = self.loop.time() + self.pool.read_timeout_s  # the timer follows lazily
        self.parse(parser, data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        drop_transport_cycle(self.transport)
        self.transport = None
        self.stop_timer()
        pool = self.pool
        if self.parser is None:  # idle (or already given up): out of the pool
            pool.forget(self)
            return
        if self.complete or self.error is not None:
            self.wake()
            return
        if exc is not None:
            reason = failure_reason(exc)
            if self.head is not None and not self.head.done():  # reset before any answer
                pool.refused(reason)  # (as a refused connect: evidence for /healthz)
            self.fail(reason)
            return
        self.parse_eof(self.parser)  # a body delimited by the close ends cleanly here
        self.wake()

    def pause_writing(self) -> None:  # (a large request body: the transport buffers it)
        pass

    def resume_writing(self) -> None:
        pass

    # -- what the parser tells the connection ------------------------------------------

    def response_head(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.content_type, self.close_delimited = framing(headers)
        self.status = status
        self.headers = headers
        head = self.head
        if head is not None and not head.done():
            head.set_result(None)
        if self.head_only:  # an answer to HEAD has no body, whatever its headers announce
            self.response_complete(False)

    def response_body(self, data: bytes) -> None:
        self.buf.append(data)
        self.buffered += len(data)
        if self.buffered > HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        waiter = self.waiter  # (`wake`, inline: this runs once per read)
        if waiter is not None:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def response_complete(self, keep_alive: bool) -> None:
        self.complete = True
        self.keep_alive = keep_alive and not self.close_delimited and not self.head_only
        self.stop_timer()
        self.wake()

    # -- the body, for the relay ---------------------------------------------------------

    async def read(self) -> bytes:
        """The next part of the body as it arrived; b"" at its clean end. Raises
        `UpstreamBodyTimeout` after `read_s` of silence and `UpstreamBodyError` when the body
        broke (reset, truncated, bad framing)."""
        while True:
            buf = self.buf
            if buf:
                chunk = buf[0] if len(buf) == 1 else b"".join(buf)
                buf.clear()
                self.buffered = 0
                if self.paused:
                    self.resume()
                return chunk
            if self.error is not None:
                raise self.error[0](self.error[1])
            if self.complete:
                return b""
            self.waiter = waiter = self.loop.create_future()
            await waiter

    def resume(self) -> None:
        """Read the socket again after a pause; the read timeout, dropped while the proxy
        did not read (the silence was its own), counts again from now."""
        self.paused = False
        if self.transport is not None:
            self.transport.resume_reading()
        read_s = self.pool.read_timeout_s
        if self.timer is not None:
            self.deadline = self.loop.time() + read_s
        elif read_s and not self.complete and self.error is None:
            self.arm(read_s)

    def wake(self) -> None:
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)

    # -- failures and the read timeout -------------------------------------------------

    def fail(self, reason: str) -> None:
        """The exchange broke (`reason`): the waiting side gets the project's error and the
        connection is closed, never reused."""
        head = self.head
        if head is not None and not head.done():
            self.error = (UpstreamUnreachable, f"upstream '{self.pool.name}' failed before responding: {reason}")
            head.set_result(None)
        elif self.error is None:
            self.error = (UpstreamBodyError, f"upstream body ended abnormally: {reason}")
        self.wake()
        self.abort()

    def arm(self, read_s: float) -> None:
        self.deadline = self.armed_for = self.loop.time() + read_s
        self.timer = self.loop.call_at(self.deadline, self._timer_fired)

    def _timer_fired(self) -> None:
        if self.paused:  # not reading because the client is slow: no silence to count
            self.timer = None
            return
        if self.deadline != self.armed_for:  # a read since it was set: not due yet
            self.armed_for = self.deadline
            self.timer = self.loop.call_at(self.deadline, self._timer_fired)
            return
        self.timer = None
        pool, head = self.pool, self.head
        if head is not None and not head.done():
            self.error = (
                UpstreamTimeout,
                f"upstream '{pool.name}' did not answer within the timeout ({pool.read_timeout_s:g} s read timeout)",
            )
            head.set_result(None)
        elif self.error is None:
            self.error = (UpstreamBodyTimeout, f"upstream '{pool.name}' went silent for longer than the read timeout")
        self.wake()
        self.abort()

    def abort(self) -> None:
        self.tainted = True
        super().abort()

    # -- the request's life ------------------------------------------------------------

    def start(self, data: bytes, head_only: bool) -> None:
        self.head_only = head_only
        self.status = 0
        self.complete = self.keep_alive = False
        self.transport.write(data)  # type: ignore[union-attr]
        # the rest after the write, while the upstream reads the request (no answer can reach
        # `data_received` before this returns to the loop): a parser's set-up is ~7 us on the
        # plain stack (h11), all of it added to the time to first token when done before
        self.parser = self.pool.parser_class(self, b"HEAD" if head_only else b"GET")
        self.head = self.loop.create_future()
        read_s = self.pool.read_timeout_s
        if read_s:
            self.arm(read_s)

    def release(self) -> None:
        """The relay is done with the response: back to the pool when it was read to its
        announced end with keep-alive and nothing unexpected happened, else closed."""
        self.stop_timer()
        parser = self.parser
        reusable = self.complete and self.keep_alive and not self.tainted and self.error is None
        if parser is not None:
            parser.release()
        self.parser = None
        self.head = self.waiter = None
        self.buf = []
        self.buffered = 0
        self.headers = []
        if reusable and not self.closed and not self.paused:
            self.pool.give_back(self)
        else:
            self.abort()
            self.pool.forget(self)


class Pool(Dialer[Conn]):
    """Connections to one upstream (`scheme://host:port/prefix`)."""

    def __init__(
        self,
        name: str,
        base: str,
        *,
        connect_s: float | None,
        read_s: float | None,
        on_unreachable: Callable[[str], None] | None = None,
    ) -> None:
        super().__init__(connect_timeout_s=connect_s, read_timeout_s=read_s)
        self.name = name
        self.base = base
        self.who = f"upstream '{name}' at {base}"
        parts = urlsplit(base)
        self.tls = parts.scheme == "https"
        self.invalid: str | None = None
        try:
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError("only http:// and https:// URLs with a host are supported")
            self.host = parts.hostname
            default = 443 if self.tls else 80
            self.port = parts.port or default
            host = self.host.encode("ascii") if self.host.isascii() else self.host.encode("idna")
            if b":" in host:  # IPv6
                host = b"[" + host + b"]"
            self.host_header = host if self.port == default else host + b":%d" % self.port
        except (ValueError, UnicodeError) as exc:
            self.host, self.port, self.host_header = "", 0, b""
            self.invalid = str(exc) or type(exc).__name__
        self.prefix = parts.path.encode("latin-1")
        self.on_unreachable = on_unreachable
        self._sweeper: asyncio.TimerHandle | None = None

    def request_bytes(self, method: str, target: bytes, headers: list[tuple[bytes, bytes]], body: bytes) -> bytes:
        """The request as it goes on the wire: Host first, the headers as given, Content-Length
        last (when there is a body, or for a method that carries one), as aiohttp wrote them."""
        m = method.encode("latin-1")
        parts = [m, b" ", self.prefix, target, b" HTTP/1.1\r\nHost: ", self.host_header, b"\r\n"]
        for k, v in headers:
            parts += (k, b": ", v, b"\r\n")
        if body or m not in _NO_LENGTH:
            parts += (b"Content-Length: ", b"%d" % len(body), b"\r\n")
        parts += (b"\r\n", body)
        return b"".join(parts)

    async def open(self, method: str, target: bytes, headers: list[tuple[bytes, bytes]], body: bytes) -> Conn:
        """Send the request; return its connection once status and headers arrived."""
        if self.invalid is not None:
            raise UpstreamUnreachable(f"upstream '{self.name}' has an invalid URL {self.base}: {self.invalid}")
        data = self.request_bytes(method, target, headers, body)
        conn = self.take() or await self.connect()
        try:
            conn.start(data, method == "HEAD")
        except RuntimeError:  # (uvloop raises it for a write on a closed transport)
            conn.release()
            raise UpstreamUnreachable(
                f"upstream '{self.name}' at {self.base} closed the connection before the request was sent"
            ) from None
        try:
            await conn.head  # type: ignore[misc]
        except BaseException:  # cancelled (the client left): the server sees the close
            conn.release()
            raise
        error = conn.error
        if error is not None and not conn.status:
            conn.release()
            raise error[0](error[1])
        return conn

    def take(self) -> Conn | None:
        idle = self.idle
        if not idle:
            return None
        limit = self.loop.time() - POOL_IDLE_S
        while idle:
            conn = idle.pop()
            if not (conn.closed or conn.tainted or conn.idle_since <= limit or conn.transport is None):
                if not conn.transport.is_closing():
                    return conn
            conn.abort()
            self.open_conns.discard(conn)
        return None

    async def connect(self) -> Conn:
        self.loop = asyncio.get_running_loop()  # (`Conn` takes it from here)
        return await self.dial(Conn(self))

    def out_of_files(self) -> str:
        return (
            f"{self.who} is unreachable: the proxy ran out of open files ({len(self.open_conns)} upstream "
            "connections open; see `ulimit -n`)"
        )

    def refused(self, reason: str) -> None:
        if self.on_unreachable is not None:  # evidence for /healthz
            self.on_unreachable(reason)

    def give_back(self, conn: Conn) -> None:
        idle = self.idle
        if len(idle) >= MAX_IDLE:
            conn.transport.close()  # type: ignore[union-attr]  # a whole response: an orderly close
            self.open_conns.discard(conn)
            return
        conn.idle_since = self.loop.time()
        idle.append(conn)
        if self._sweeper is None:
            self._sweeper = self.loop.call_later(POOL_IDLE_S, self._sweep)

    def _sweep(self) -> None:
        """Close the connections idle for `POOL_IDLE_S` (the server would close them soon)."""
        self._sweeper = None
        limit = self.loop.time() - POOL_IDLE_S + 0.001
        keep = []
        for conn in self.idle:
            if conn.idle_since <= limit or conn.closed or conn.tainted:
                conn.abort()
                self.open_conns.discard(conn)
            else:
                keep.append(conn)
        self.idle[:] = keep
        if keep:
            self._sweeper = self.loop.call_at(min(c.idle_since for c in keep) + POOL_IDLE_S, self._sweep)

    def forget(self, conn: Conn) -> None:
        """`conn` closed (or was given up): out of the pool."""
        self.open_conns.discard(conn)
        if conn in self.idle:
            self.idle.remove(conn)

    async def aclose(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for conn in list(self.open_conns):
            conn.abort()
        self.open_conns.clear()
        self.idle.clear()
