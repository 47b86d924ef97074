"""Reading an HTTP/1.1 response, for both raw asyncio clients of the package: the proxy's
upstream transport (`mlxproxy.proxy.transport`) and the load generator's
(`mlxproxy.load.run.rawhttp`). httptools' llhttp parser where installed and the stack allows
it, h11's otherwise, one per response; both hand the status, headers and body bytes to the
connection (`Connection`).
"""

from __future__ import annotations

from types import ModuleType
from typing import Protocol

import h11

from mlxproxy.core.text import clip
from mlxproxy.edge.runner import stack_settings

httptools: ModuleType | None
try:
    import httptools
except ImportError:  # pragma: no cover - exercised by forcing the h11 path in tests
    httptools = None

__all__ = ["Connection", "H11Parser", "HttptoolsParser", "ParseFailure", "failure_reason", "parser_class"]


class Connection(Protocol):
    """What a parser tells the connection it reads for (the protocol of a raw client)."""

    close_delimited: bool

    def response_head(self, status: int, headers: list[tuple[bytes, bytes]]) -> None: ...

    def response_body(self, data: bytes) -> None: ...

    def response_complete(self, keep_alive: bool) -> None: ...


def failure_reason(exc: BaseException | None) -> str:
    if exc is None:
        return "the connection closed"
    text = str(exc).strip()
    return f"{type(exc).__name__}: {clip(text.splitlines()[0], 200)}" if text else type(exc).__name__


class ParseFailure(Exception):
    """A parse error raised inside a parser callback (carries the reason out of it)."""


class HttptoolsParser:
    """httptools' llhttp parser, one per response."""

    __slots__ = ("conn", "p", "headers", "started", "completed", "extra", "interim")

    def __init__(self, conn: Connection, method: bytes) -> None:
        assert httptools is not None  # chosen only where it imports (parser_class)
        self.conn = conn
        self.p = httptools.HttpResponseParser(self)
        self.headers: list[tuple[bytes, bytes]] = []
        self.started = False
        self.completed = False
        self.extra = False
        self.interim = False  # in an informational (1xx) response, which is skipped as h11 does

    # httptools callbacks
    def on_message_begin(self) -> None:
        if self.completed:  # a second response on the same read: never trusted, never reused
            self.extra = True

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self.started:  # (an extra response's are never the answer's)
            self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        if self.completed:
            return
        status = self.p.get_status_code()
        if 100 <= status < 200 and status != 101:  # (100 Continue, 103 Early Hints): not the answer
            self.interim = True
            self.headers = []
            return
        self.started = True
        self.conn.response_head(status, self.headers)

    def on_body(self, body: bytes) -> None:
        if not self.completed:
            self.conn.response_body(body)

    def on_message_complete(self) -> None:
        if self.interim:
            self.interim = False
            return
        if not self.completed:
            self.completed = True
            self.conn.response_complete(bool(self.p.should_keep_alive()))

    def feed(self, data: bytes) -> None:
        try:
            self.p.feed_data(data)
        except httptools.HttpParserError as exc:  # type: ignore[union-attr]
            if not self.completed:
                raise ParseFailure(failure_reason(exc)) from None
            self.extra = True

    def release(self) -> None:
        """Let the llhttp parser go: it holds this object's bound callbacks, so the two form a
        reference cycle that only the cyclic collector would free (three objects and five bound
        methods per request, which a long run's full collections then had to walk)."""
        self.p = None

    def eof(self) -> None:
        """The server closed: a body delimited by the close ends here; any other unfinished one is truncated."""
        if self.completed:
            return
        if self.started and self.conn.close_delimited:
            self.completed = True
            self.conn.response_complete(False)
            return
        raise ParseFailure("the connection closed before the response was complete")


#: the request h11 is shown for each method (`H11Parser`), built once: building an event
#: validates its headers, which was half of a parser's set-up (~7 of 14 us, each response)
_SHOWN: dict[bytes, h11.Request] = {}
_SHOWN_METHODS = 16  # (methods are few; any beyond these are built each time)
_END = h11.EndOfMessage()


class H11Parser:
    """h11's state machine, one per response (used when httptools is not importable)."""

    __slots__ = ("conn", "h", "started", "completed", "extra")

    def __init__(self, conn: Connection, method: bytes) -> None:
        self.conn = conn
        self.h = h11.Connection(h11.CLIENT)
        # h11 must see the request to know what answer to expect (HEAD: no body); the bytes
        # it would write are not used, the pool writes its own
        shown = _SHOWN.get(method)
        if shown is None:
            shown = h11.Request(method=method, target=b"/", headers=[(b"host", b"x"), (b"content-length", b"0")])
            if len(_SHOWN) < _SHOWN_METHODS:
                _SHOWN[method] = shown
        self.h.send(shown)
        self.h.send(_END)
        self.started = False
        self.completed = False
        self.extra = False

    def release(self) -> None:
        """(h11's state machine holds no reference back to this object: nothing to break.)"""

    def feed(self, data: bytes) -> None:
        if self.completed:
            self.extra = True
            return
        self.h.receive_data(data)
        self._drain()

    def _drain(self) -> None:
        while not self.completed:
            try:
                ev = self.h.next_event()
            except h11.RemoteProtocolError as exc:
                raise ParseFailure(failure_reason(exc)) from None
            if ev is h11.NEED_DATA or ev is h11.PAUSED:
                return
            if isinstance(ev, h11.InformationalResponse):
                continue
            if isinstance(ev, h11.Response):
                self.started = True
                self.conn.response_head(ev.status_code, list(ev.headers.raw_items()))
            elif isinstance(ev, h11.Data):
                self.conn.response_body(bytes(ev.data))
            elif isinstance(ev, h11.EndOfMessage):
                self.completed = True
                if self.h.trailing_data[0]:
                    self.extra = True
                self.conn.response_complete(self.h.their_state is h11.DONE and self.h.our_state is h11.DONE)
            elif isinstance(ev, h11.ConnectionClosed):
                raise ParseFailure("the connection closed before the response was complete")

    def eof(self) -> None:
        if self.completed:
            return
        self.h.receive_data(b"")
        self._drain()
        if not self.completed:
            raise ParseFailure("the connection closed before the response was complete")


def parser_class() -> type[HttptoolsParser] | type[H11Parser]:
    """The stack's parser (`mlxproxy.edge.runner.stack_settings`): httptools where installed, h11
    with `MLXPROXY_STACK=plain` (what a platform without the wheels gets) or without httptools."""
    try:
        http = stack_settings()[1]
    except ValueError:  # a bad MLXPROXY_STACK: the CLI refuses it before any client exists
        http = "httptools"
    return HttptoolsParser if http == "httptools" and httptools is not None else H11Parser
