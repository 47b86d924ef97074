"""What the package's two raw HTTP/1.1 clients share besides their parsers (`edge/httpparse.py`):
opening a connection (TLS with the standard library's default context, certificates checked)
the part of a connection that is not either client's own logic (`ClientProtocol`), and reading a
response head's framing. The proxy's upstream transport (`proxy/transport.py`)
and the load generator's client (`load/run/rawhttp.py`) both use them; each maps the errors to
its own messages.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import ssl
from typing import Generic, TypeVar

from mlxproxy.edge.httpparse import H11Parser, HttptoolsParser, ParseFailure, failure_reason, parser_class
from mlxproxy.errors import UpstreamTimeout, UpstreamUnreachable

__all__ = ["POOL_IDLE_S", "ClientProtocol", "Dialer", "framing"]

# An idle pooled connection is dropped after this long, by both clients: below the 5 s keep-alive
# of uvicorn (vLLM, vllm-mlx) and llama.cpp, so no request goes out on a connection the server is
# closing at that moment.
POOL_IDLE_S = 4.0


class ClientProtocol(asyncio.Protocol):
    """What a connection of either client is besides its own logic: its transport, its one
    read timer, feeding its response parser (`parse`, `parse_eof`: a failure goes to `fail`,
    bytes beyond the response taint it), and closing it at once (`abort`: `closed`, never
    used again)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.closed = False
        self.tainted = False  # anything unexpected (bytes beyond the response, ...): never reused

    def fail(self, reason: str) -> None:
        """The exchange broke: the client's own (its request gets the error, the connection closes)."""
        raise NotImplementedError

    def parse(self, parser: HttptoolsParser | H11Parser, data: bytes) -> None:
        try:
            parser.feed(data)
        except ParseFailure as exc:
            self.fail(str(exc))
        except Exception as exc:  # a callback that raised: the request fails, the loop never sees it
            self.fail(failure_reason(exc))
        else:
            if parser.extra:
                self.tainted = True

    def parse_eof(self, parser: HttptoolsParser | H11Parser) -> None:
        """The server closed: a body delimited by the close ends cleanly, any other is cut."""
        try:
            parser.eof()
        except ParseFailure as exc:
            self.fail(str(exc))
        except Exception as exc:
            self.fail(failure_reason(exc))

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def eof_received(self) -> bool | None:
        return None  # the transport closes; connection_lost ends the response

    def stop_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()


@functools.lru_cache(maxsize=1)
def _tls() -> ssl.SSLContext:
    return ssl.create_default_context()


C = TypeVar("C", bound=ClientProtocol)


class Dialer(Generic[C]):
    """A client's connections to one server: where it is (`host`, `port`, `tls`, set by the
    client), how messages name it (`who`), the timeouts, the response parser, the connections
    open and those idle. `dial` opens one more."""

    host: str
    port: int
    tls: bool
    who: str

    def __init__(self, *, connect_timeout_s: float | None, read_timeout_s: float | None) -> None:
        self.connect_timeout_s = connect_timeout_s or None
        self.read_timeout_s = read_timeout_s or 0.0
        self.parser_class = parser_class()
        self.idle: list[C] = []
        self.open_conns: set[C] = set()
        self.loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]  # (the first dial's)

    def out_of_files(self) -> str:
        """The message when this process ran out of open files (not the server's doing)."""
        return f"{self.who} is unreachable: this process ran out of open files ({len(self.open_conns)} open)"

    def refused(self, reason: str) -> None:
        """Told of every failure to connect but running out of files (`reason`)."""

    async def dial(self, conn: C) -> C:
        """Connect `conn` (over TLS, checked against `host`, when `tls`) and count it open.
        Raises `UpstreamTimeout` after the connect timeout and `UpstreamUnreachable` when it
        cannot connect."""
        self.loop = loop = asyncio.get_running_loop()
        kwargs: dict[str, object] = {"ssl": _tls(), "server_hostname": self.host} if self.tls else {}
        fut = loop.create_connection(lambda: conn, self.host, self.port, **kwargs)  # type: ignore[call-overload]
        timeout_s = self.connect_timeout_s
        try:
            if timeout_s:
                await asyncio.wait_for(fut, timeout_s)
            else:
                await fut
        except asyncio.TimeoutError:
            raise UpstreamTimeout(f"{self.who} did not accept a connection within {timeout_s:g} s") from None
        except (OSError, ValueError) as exc:  # (ssl.SSLError is an OSError)
            if getattr(exc, "errno", None) in (errno.EMFILE, errno.ENFILE):
                raise UpstreamUnreachable(self.out_of_files()) from None
            reason = failure_reason(exc)
            self.refused(reason)
            raise UpstreamUnreachable(f"{self.who} is unreachable: {reason}") from None
        self.open_conns.add(conn)
        return conn


def framing(headers: list[tuple[bytes, bytes]]) -> tuple[str | None, bool]:
    """A response head's content type (None: none) and whether its body is delimited by the
    connection's close (neither Content-Length nor chunked Transfer-Encoding)."""
    ctype = None
    length = chunked = False
    for k, v in headers:
        lk = k.lower()
        if lk == b"content-type":
            ctype = v.decode("latin-1")
        elif lk == b"content-length":
            length = True
        elif lk == b"transfer-encoding" and b"chunked" in v.lower():
            chunked = True
    return ctype, not (length or chunked)
