"""A lean HTTP/1.1 client for the load generator (`mlxproxy.load.run.client.MeasuringClient`).

Raw asyncio: one `asyncio.Protocol` per connection and a small keep-alive pool. Each socket
read is stamped once, on arrival, and its body bytes go straight to the request's `Sink`
(the meter) from the protocol callback: no stream buffer, no task wake-up per read. The
response is parsed by httptools (llhttp) when it is importable and by h11 otherwise
(`mlxproxy.edge.httpparse`, shared with the proxy's upstream transport); this module parses
nothing itself.

Why not the proxy's upstream transport (`mlxproxy.proxy.transport`): the load package may not
import the proxy, and the two read differently: the proxy hands each read to a relay task that
forwards it, the generator meters each read in the protocol callback, with no task wake-up
per read; it left aiohttp first because a load generator spends most of its CPU per request in
the client library (benchmarks/README.md, "raw transport"), and the generator must not be what
limits a run. The errors are the project's own, as in `mlxproxy.proxy.upstream`:
`UpstreamError` subclasses before the status line arrived, `UpstreamBodyError` after.
"""

from __future__ import annotations

import asyncio
import base64
import time
from typing import Protocol
from urllib.parse import unquote, urlsplit

from mlxproxy.edge.dial import POOL_IDLE_S, ClientProtocol, Dialer, framing
from mlxproxy.edge.httpparse import H11Parser as _H11Parser
from mlxproxy.edge.httpparse import HttptoolsParser as _HttptoolsParser
from mlxproxy.edge.httpparse import failure_reason as _reason
from mlxproxy.errors import (
    ConfigError,
    UpstreamBodyError,
    UpstreamBodyTimeout,
    UpstreamError,
    UpstreamTimeout,
    UpstreamUnreachable,
)

__all__ = ["RawPool", "Sink"]


class Sink(Protocol):
    """Where a response goes, called from the connection's protocol as bytes arrive (the
    names are `mlxproxy.core.meter.RequestMeter`'s, so a meter is a sink as it is)."""

    def response_started(self, t: float, status: int, content_type: str | None) -> None: ...

    def feed(self, data: bytes, t: float) -> None: ...


now = time.perf_counter


class _Conn(ClientProtocol):
    """One upstream connection; serves one request at a time."""

    def __init__(self, pool: RawPool) -> None:
        self.pool = pool
        super().__init__()
        self.parser: _HttptoolsParser | _H11Parser | None = None
        self.sink: Sink | None = None
        self.done: asyncio.Future[bool] | None = None  # result: reusable after this response
        self.t = 0.0  # when the read being parsed arrived
        self.last_read = 0.0
        self.headed = False
        self.head_only = False
        self.close_delimited = False
        self.idle_since = 0.0

    # -- asyncio.Protocol --------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        t = self.t = now()
        parser = self.parser
        if parser is None or self.done is None or self.done.done():
            self.tainted = True  # an extra response, or more body than announced: never reused
            return
        self.last_read = t
        self.parse(parser, data)  # (a sink that raised fails the request; the loop never sees it)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.stop_timer()
        parser, done = self.parser, self.done
        if parser is None or done is None or done.done():
            return
        if exc is not None:
            self.fail(_reason(exc))
            return
        self.t = now()
        self.parse_eof(parser)

    # -- what the parser (httptools or h11) tells the connection ----------------------

    def response_head(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        ctype, self.close_delimited = framing(headers)
        self.headed = True
        self.sink.response_started(self.t, status, ctype)  # type: ignore[union-attr]
        if self.head_only:  # an answer to HEAD has no body, whatever its headers announce
            self.response_complete(False)

    def response_body(self, data: bytes) -> None:
        self.sink.feed(data, self.t)  # type: ignore[union-attr]

    def response_complete(self, keep_alive: bool) -> None:
        self.stop_timer()
        if self.done is not None and not self.done.done():
            self.done.set_result(keep_alive and not self.close_delimited)

    def closing(self) -> bool:
        """The transport is closed or closing (the server's close not yet seen as connection_lost)."""
        return self.transport is None or self.transport.is_closing()

    # -- request lifecycle -------------------------------------------------------------

    def start(self, sink: Sink, method: bytes, data: bytes) -> asyncio.Future[bool]:
        self.sink = sink
        self.parser = self.pool.parser_class(self, method)
        self.headed = self.close_delimited = False
        self.head_only = method == b"HEAD"
        self.done = done = self.pool.loop.create_future()
        self.last_read = now()
        timeout = self.pool.read_timeout_s
        if timeout:
            self.timer = self.pool.loop.call_later(timeout, self._check_timeout)
        self.transport.write(data)  # type: ignore[union-attr]
        return done

    def _check_timeout(self) -> None:
        self.timer = None
        if self.done is None or self.done.done():
            return
        timeout = self.pool.read_timeout_s
        left = self.last_read + timeout - now()
        if left > 0.0005:  # bytes came since the timer was set: wait for what is left
            self.timer = self.pool.loop.call_later(left, self._check_timeout)
            return
        pool = self.pool
        if self.headed:
            err: Exception = UpstreamBodyTimeout(
                f"{pool.who} went silent for longer than the read timeout ({timeout:g} s)"
            )
        else:
            err = UpstreamTimeout(f"{pool.who} did not answer within the timeout ({timeout:g} s)")
        self.done.set_exception(err)
        self.abort()

    def fail(self, reason: str) -> None:
        self.stop_timer()
        done = self.done
        if done is not None and not done.done():
            pool = self.pool
            if self.headed:
                done.set_exception(UpstreamBodyError(f"upstream body ended abnormally: {reason}"))
            else:
                done.set_exception(UpstreamUnreachable(f"{pool.who} failed before responding: {reason}"))
        self.abort()

    def finish(self) -> None:
        """Back to idle: the request's sink and parser are let go."""
        self.sink = None
        if self.parser is not None:
            self.parser.release()
        self.parser = None
        self.done = None


class RawPool(Dialer["_Conn"]):
    """Connections to one base URL. `request()` sends one request and feeds the response to
    a `Sink` as it arrives; it returns once the response is complete. With
    `reuse_connections=False` every request opens its own connection and closes it after."""

    def __init__(
        self,
        base_url: str,
        *,
        name: str = "target",
        connect_timeout_s: float | None = 10.0,
        read_timeout_s: float | None = 1800.0,
        reuse_connections: bool = True,
        max_connections: int | None = None,
    ) -> None:
        super().__init__(connect_timeout_s=connect_timeout_s, read_timeout_s=read_timeout_s)
        parts = urlsplit(base_url.rstrip("/"))
        self.name = name
        netloc = parts.netloc.rsplit("@", 1)[-1]
        self.base = f"{parts.scheme}://{netloc}{parts.path}"
        self.prefix = parts.path
        self.tls = parts.scheme == "https"
        self.host = parts.hostname or ""
        # a URL that cannot be connected to fails each request (one line each), as a refused one does
        self.invalid: str | None = None
        try:
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError("only http:// and https:// URLs with a host are supported")
            self.port = parts.port or (443 if self.tls else 80)
            self.host_header = netloc.encode("idna")
        except (ValueError, UnicodeError) as exc:
            self.port, self.host_header, self.invalid = 0, b"", str(exc) or type(exc).__name__
        self.auth_header: bytes | None = None
        if "@" in parts.netloc:  # credentials in the URL become Basic auth, never part of what is shown
            try:
                user_pass = f"{unquote(parts.username or '')}:{unquote(parts.password or '')}".encode("latin-1")
            except UnicodeEncodeError:
                raise ConfigError(
                    f"upstream '{name}': the URL's user:password holds characters an HTTP header "
                    "cannot carry (only latin-1)"
                ) from None
            self.auth_header = b"Basic " + base64.b64encode(user_pass)
        # how messages name it: a target named after its own address is named once
        self.who = (
            f"upstream {self.base}"
            if name in (netloc, f"{self.host}:{self.port}")
            else f"upstream '{name}' at {self.base}"
        )
        self.reuse = reuse_connections
        # at most this many requests (so connections) at once; the others wait here, inside the
        # load generator, and the wait counts in their latency (None: no cap)
        self.max_connections = max_connections
        self._slots: asyncio.Semaphore | None = None
        self.queued = 0  # requests waiting for a connection now

    def target(self, path: str) -> bytes:
        """The request target for `path` (this URL's path prefix, then `path` as written)."""
        if not path.startswith("/"):
            raise ValueError("only an origin-form request target (/path) is forwarded")
        out = (self.prefix + path).encode("latin-1")
        if any(c in out for c in b" \r\n\0\t"):
            raise ValueError("the request target holds a space, line break or NUL")
        return out

    async def _connect(self) -> _Conn:
        return await self.dial(_Conn(self))

    def out_of_files(self) -> str:
        return (
            f"the load generator ran out of open files ({len(self.open_conns)} connections open to "
            f"'{self.name}'; see `ulimit -n`): this request was never sent"
        )

    async def _acquire(self) -> _Conn:
        if self.reuse:
            idle = self.idle
            limit = now() - POOL_IDLE_S
            while idle:
                conn = idle.pop()
                if not conn.closed and not conn.tainted and conn.idle_since > limit and not conn.closing():
                    return conn
                self._drop(conn)
        return await self._connect()

    def _drop(self, conn: _Conn, *, graceful: bool = False) -> None:
        if graceful and conn.transport is not None:  # a complete response: an orderly close
            conn.closed = True
            conn.transport.close()
        else:
            conn.abort()
        self.open_conns.discard(conn)

    def _release(self, conn: _Conn, reusable: bool) -> None:
        conn.finish()
        if reusable and self.reuse and not conn.closed and not conn.tainted:
            conn.idle_since = now()
            self.idle.append(conn)
        else:
            self._drop(conn, graceful=not conn.tainted)

    async def request(
        self, method: str, target: bytes, headers: list[tuple[bytes, bytes]], body: bytes, sink: Sink
    ) -> None:
        """Send one request (`headers` without Host and Content-Length: both are set here)
        and feed the response to `sink`. Raises `UpstreamError` when no response started,
        `UpstreamBodyError` (or `UpstreamBodyTimeout`) when it broke after."""
        self.loop = asyncio.get_running_loop()
        m = method.encode("latin-1")
        if not m.isalpha():
            raise UpstreamError(f"cannot send the method {method[:20]!r}")
        parts = [m, b" ", target, b" HTTP/1.1\r\nHost: ", self.host_header, b"\r\n"]
        for k, v in headers:
            parts += (k, b": ", v, b"\r\n")
        if body or m in (b"POST", b"PUT", b"PATCH"):
            parts += (b"Content-Length: ", str(len(body)).encode(), b"\r\n")
        if not self.reuse:
            parts.append(b"Connection: close\r\n")
        parts += (b"\r\n", body)
        data = b"".join(parts)
        if self.invalid is not None:
            raise UpstreamUnreachable(f"upstream '{self.name}' has an invalid URL {self.base}: {self.invalid}")
        if self.max_connections is None:
            return await self._send(m, data, sink)
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.max_connections)
        self.queued += 1
        try:
            await self._slots.acquire()
        finally:
            self.queued -= 1
        try:
            await self._send(m, data, sink)
        finally:
            self._slots.release()

    async def _send(self, m: bytes, data: bytes, sink: Sink) -> None:
        conn = await self._acquire()
        try:
            if conn.closed or conn.closing():  # a new connection the server closed at once
                raise RuntimeError("closed")
            done = conn.start(sink, m, data)
        except RuntimeError:  # (uvloop raises it for a write on a closed transport)
            conn.stop_timer()
            conn.finish()
            self._drop(conn)
            raise UpstreamUnreachable(f"{self.who} closed the connection before the request was sent") from None
        try:
            reusable = await done
        except BaseException:
            conn.finish()
            self._drop(conn)  # failed, timed out or cancelled: the server sees the close
            raise
        self._release(conn, reusable and m != b"HEAD")

    async def aclose(self) -> None:
        for conn in list(self.open_conns):
            self._drop(conn)
        self.idle.clear()
