"""Limits on what a client controls before the app sees a request, on both server stacks.

uvicorn's two HTTP/1.1 protocols differ: h11 (the plain install) bounds a request head at a
buffer size but accepts `HTTP/9.9`, LF-only line ends and a request with both
Content-Length and Transfer-Encoding; httptools (the fast extras) bounds nothing. Neither
closes a connection that never completes a request head. `protocol_class(http, limits)`
returns a small subclass of either that, identically on both stacks:

- refuses a request head over `max_bytes` (431) as soon as that many bytes arrived
  unfinished, so a slow or endless head costs at most `max_bytes` plus one socket read;
- refuses more than `max_count` header lines (431);
- closes a connection whose request head is not complete `timeout_s` after the connection
  opened or after its first byte arrived (408 when part of a head came, else silently);
  an idle keep-alive connection is left to uvicorn's keep-alive timeout;
- refuses ambiguous framing and anything but origin-form: both Content-Length and
  Transfer-Encoding, an HTTP version other than 1.0/1.1, bare LF line ends, folded header
  lines (httptools refuses them; h11 would join them), and a request
  target not starting with `/` (so `*@host/x`, `http://host/x` or `*` never reach the app);
- answers every such refusal, and every request the parser rejects, with an OpenAI-shaped
  JSON error and `Connection: close`, then closes the connection.

Also here: `bounded_field`, which makes a client-sent name (the request's `model`) safe as
a Prometheus label value and a log field.
"""

from __future__ import annotations

import asyncio
import hashlib
import weakref
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import orjson

__all__ = ["HeadLimits", "protocol_class", "error_response", "bounded_field", "MAX_FIELD_CHARS", "origin_form"]

MAX_FIELD_CHARS = 128  # the longest model name kept as it is in labels, records and log lines
_KEEP_CHARS = 100  # a longer one keeps this prefix, then "~" and 12 hex digits of its SHA-256


@dataclass(frozen=True)
class HeadLimits:
    """Bounds on a request head (config keys `max_request_header_bytes`,
    `max_request_headers`, `request_header_timeout_s`; 0 = no timeout)."""

    max_bytes: int = 64 * 1024
    max_count: int = 100
    timeout_s: float = 10.0


def bounded_field(value: str) -> str:
    """`value` as it is when it is short and printable; otherwise control and other
    unprintable characters escaped (`\\x1b`, `\\n`, `\\u2028`) and, past `MAX_FIELD_CHARS`,
    cut to a prefix plus a hash, so distinct long names stay distinct. The result is at most
    `MAX_FIELD_CHARS` characters and fits on one line."""
    if len(value) <= MAX_FIELD_CHARS and value.isprintable():
        return value
    text = "".join(
        c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in value[: _KEEP_CHARS * 4]
    )
    if len(value) <= MAX_FIELD_CHARS and len(text) <= MAX_FIELD_CHARS:
        return text
    digest = hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()[:12]
    return f"{text[:_KEEP_CHARS]}~{digest}"


def origin_form(target: bytes) -> bool:
    """True for a request target the proxy forwards: an absolute path (`/...`)."""
    return target[:1] == b"/"


def error_response(status: int, message: str, code: str) -> bytes:
    """A whole HTTP/1.1 response: OpenAI-shaped JSON error, then the connection closes."""
    body = orjson.dumps({"error": {"message": message, "type": "invalid_request_error", "code": code, "param": None}})
    phrase = HTTPStatus(status).phrase
    head = (
        f"HTTP/1.1 {status} {phrase}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


def _bare_lf(head: bytes) -> bool:
    return head.count(b"\n") != head.count(b"\r\n")


def _folded(head: bytes) -> bool:
    return b"\n " in head or b"\n\t" in head


def _framing_problem(
    headers: Any, version: bytes | str, target: bytes, limits: HeadLimits, read_bytes: int
) -> tuple[int, str, str] | None:
    """The refusal for a complete request head, or None when it may go to the app.
    `read_bytes`: what arrived while the head was awaited, head and all; the head's own size
    is only worked out when that is over the limit (the reads may have carried a body too)."""
    if not origin_form(target):
        return 400, "the request target must be a path starting with '/' (origin-form)", "invalid_request_target"
    if version not in (b"1.1", b"1.0", "1.1", "1.0"):
        return 400, "only HTTP/1.0 and HTTP/1.1 are served", "unsupported_http_version"
    if len(headers) > limits.max_count:
        return (
            431,
            f"the request has more than {limits.max_count} header lines (max_request_headers)",
            "request_headers_too_large",
        )
    if (
        read_bytes > limits.max_bytes
        and len(target) + 16 + sum(len(k) + len(v) + 4 for k, v in headers) > limits.max_bytes
    ):
        return (
            431,
            f"the request head is larger than {limits.max_bytes} bytes (max_request_header_bytes)",
            "request_headers_too_large",
        )
    names = [k.lower() for k, _ in headers]
    if b"content-length" in names and b"transfer-encoding" in names:
        return 400, "a request must not carry both Content-Length and Transfer-Encoding", "ambiguous_framing"
    return None


class _Deadlines:
    """The head timeout without a timer per connection: connections waiting for a request
    head, each with its deadline, checked by one timer every quarter of the timeout (so a
    connection is closed between 1 and 1.25 times the timeout after it began waiting)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.waiting: dict[_HeadGuard, float] = {}
        self._handle: asyncio.TimerHandle | None = None

    def add(self, proto: _HeadGuard) -> None:
        loop = proto.loop
        self.waiting[proto] = loop.time() + self.timeout_s
        if self._handle is None:
            self._handle = loop.call_later(self.timeout_s / 4, self._sweep, loop)

    def discard(self, proto: _HeadGuard) -> None:
        self.waiting.pop(proto, None)

    def _sweep(self, loop: asyncio.AbstractEventLoop) -> None:
        self._handle = None
        now = loop.time()
        for proto in [p for p, deadline in self.waiting.items() if deadline <= now]:
            del self.waiting[proto]
            proto._head_timed_out()
        if self.waiting:
            self._handle = loop.call_later(self.timeout_s / 4, self._sweep, loop)


class _HeadGuard:
    """What both protocol subclasses share: byte counting, the head timer, refusals."""

    limits: HeadLimits
    transport: asyncio.Transport
    loop: asyncio.AbstractEventLoop
    _deadlines: _Deadlines | None = None  # one per server (protocol class)

    def _guard_init(self) -> None:
        self._awaiting_head = True  # no complete request head since the last one ended
        self._head_bytes = 0
        self._head_timer_armed = False
        self._refusal: tuple[int, str, str] | None = None

    def _arm_head_timer(self) -> None:
        if self._deadlines is not None:
            self._deadlines.add(self)
            self._head_timer_armed = True

    def _cancel_head_timer(self) -> None:
        if self._head_timer_armed:
            self._head_timer_armed = False
            self._deadlines.discard(self)  # type: ignore[union-attr]

    def _head_timed_out(self) -> None:
        self._head_timer_armed = False
        if not self._awaiting_head or self.transport.is_closing():
            return
        if self._head_bytes:
            self._refuse(
                408,
                f"the request head did not arrive within {self.limits.timeout_s:g} s (request_header_timeout_s)",
                "request_header_timeout",
            )
        else:
            self.transport.close()

    def _head_pending(self) -> None:
        """A read ended with a request head begun and not complete: bound its size, and start
        its clock (the first byte of a request on a kept-alive connection). A head that
        arrives whole in one read, the usual case, never touches the timer."""
        if self._head_bytes > self.limits.max_bytes:
            self._refuse_too_large()
        elif not self._head_timer_armed and not self.transport.is_closing():
            self._arm_head_timer()

    def _head_complete(self) -> None:
        self._awaiting_head = False
        self._head_bytes = 0
        if self._head_timer_armed:
            self._cancel_head_timer()

    def _head_too_large(self) -> bool:
        return self._awaiting_head and self._head_bytes > self.limits.max_bytes

    def _refuse_too_large(self) -> None:
        self._refuse(
            431,
            f"the request head is larger than {self.limits.max_bytes} bytes (max_request_header_bytes)",
            "request_headers_too_large",
        )

    def _refuse(self, status: int, message: str, code: str) -> None:
        self._cancel_head_timer()
        self._awaiting_head = False
        if not self.transport.is_closing():
            cycle = getattr(self, "cycle", None)
            if cycle is None or cycle.response_complete or not cycle.response_started:
                if cycle is not None and not cycle.response_complete:
                    cycle.disconnected = True  # the app's own answer, if it comes, is dropped
                    cycle.message_event.set()
                self.transport.write(error_response(status, message, code))
            self.transport.close()  # a response under way is cut, never followed by an error

    def _refuse_malformed(self) -> None:
        if self._refusal is not None:
            self._refuse(*self._refusal)
        elif self._head_too_large():
            self._refuse_too_large()
        else:
            self._refuse(400, "malformed HTTP request", "invalid_request")


def _fast_class(limits: HeadLimits) -> type:
    import httptools
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class LimitedHttpToolsProtocol(_HeadGuard, HttpToolsProtocol):  # type: ignore[misc]
        _deadlines = _Deadlines(limits.timeout_s) if limits.timeout_s > 0 else None

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.limits = limits
            self._guard_init()
            self._head_begun = False

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm_head_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_head_timer()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            self._unset_keepalive_if_required()
            if self._awaiting_head:
                self._head_bytes += len(data)
            try:
                self.parser.feed_data(data)
            except httptools.HttpParserUpgrade:
                if self._should_upgrade():
                    self.handle_websocket_upgrade()
                else:
                    self._unsupported_upgrade_warning()
                return
            except httptools.HttpParserError:
                self._refuse_malformed()
                return
            if self._head_begun or (self._awaiting_head and self._head_bytes):
                self._head_pending()  # (bytes while awaiting a head that never begins: CRLFs)

        def on_message_begin(self) -> None:
            HttpToolsProtocol.on_message_begin(self)  # (not super(): this runs per request)
            self._head_begun = True  # the parser saw the first byte of a request

        def send_400_response(self, msg: str) -> None:
            self._refuse_malformed()

        def on_headers_complete(self) -> None:
            problem = _framing_problem(self.headers, self.parser.get_http_version(), self.url, limits, self._head_bytes)
            if problem is not None:
                self._refusal = problem
                raise ValueError(problem[2])
            self._head_begun = False
            self._head_complete()
            HttpToolsProtocol.on_headers_complete(self)

        def on_message_complete(self) -> None:
            self._awaiting_head = True
            HttpToolsProtocol.on_message_complete(self)

    return LimitedHttpToolsProtocol


def drop_transport_cycle(transport: Any) -> None:
    """Clear the bound method an asyncio selector socket transport keeps on itself
    (`_read_ready_cb`) once its connection is lost. Before Python 3.12 that is a reference cycle
    per closed connection (python/cpython#100348, fixed in 3.12 by clearing it on close), so
    each closed connection's transport and socket waited for a full collection of the cyclic
    GC. uvloop's transports have no such attribute: nothing to do there."""
    if getattr(transport, "_read_ready_cb", None) is not None:
        transport._read_ready_cb = None


def _plain_class(limits: HeadLimits) -> type:
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    IDLE, Request, base_next_event = h11.IDLE, h11.Request, h11.Connection.next_event

    class GuardedConnection(h11.Connection):  # type: ignore[misc]
        """h11's server connection with the proxy's checks of each request head. It refers to
        its protocol weakly: a strong reference (as a closure over the protocol would be) makes
        a cycle per client connection, and every closed connection's protocol, transport and
        buffers would then wait for a full collection of the cyclic GC (benchmarks/README.md,
        "Memory over a long run")."""

        def __init__(self, owner: Any) -> None:
            # h11's own bound, a backstop to the exact one in data_received
            super().__init__(h11.SERVER, max_incomplete_event_size=limits.max_bytes)
            self._owner = weakref.ref(owner)

        def next_event(self) -> Any:
            # (h11 calls this several times per request: the checks run only where they apply,
            # and h11's own method is called directly, not through super())
            if self.their_state is IDLE:
                buffered = self.trailing_data[0]
                if buffered:
                    end = _head_end(buffered)
                    if end >= 0 and (_bare_lf(buffered[:end]) or _folded(buffered[:end])):
                        self._tell_owner(
                            (400, "request lines must end in CRLF and headers must not be folded", "invalid_request")
                        )
                        raise h11.RemoteProtocolError("bare LF or obs-fold")
            event = base_next_event(self)
            if type(event) is Request:
                owner = self._owner()
                read_bytes = owner._head_bytes if owner is not None else limits.max_bytes + 1
                problem = _framing_problem(
                    event.headers.raw_items(), event.http_version, event.target, limits, read_bytes
                )
                if problem is not None:
                    self._tell_owner(problem)
                    raise h11.RemoteProtocolError(problem[2])
                if owner is not None:
                    owner._head_complete()
            return event

        def _tell_owner(self, refusal: tuple[int, str, str]) -> None:
            """Hand the protocol the refusal to answer with (h11 then raises its own error)."""
            owner = self._owner()
            if owner is not None:
                owner._refusal = refusal

    class LimitedH11Protocol(_HeadGuard, H11Protocol):  # type: ignore[misc]
        _deadlines = _Deadlines(limits.timeout_s) if limits.timeout_s > 0 else None

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.limits = limits
            self._guard_init()
            self.conn = GuardedConnection(self)

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm_head_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_head_timer()
            super().connection_lost(exc)
            drop_transport_cycle(self.transport)

        def data_received(self, data: bytes) -> None:
            if self.conn.their_state is IDLE:
                self._awaiting_head = True
                self._head_bytes += len(data)
            H11Protocol.data_received(self, data)  # (not super(): this runs per read)
            if self._awaiting_head and self._head_bytes and self.conn.their_state is IDLE:
                self._head_pending()  # (a whole head makes h11 leave IDLE and resets the count)

        def on_response_complete(self) -> None:
            H11Protocol.on_response_complete(self)
            # part of the next request came in the same read as this one (pipelined): it gets
            # the same deadline as a head that arrives on its own
            pending = self.conn.trailing_data[0]
            if pending and self.conn.their_state is IDLE and not self.transport.is_closing():
                self._awaiting_head = True
                self._head_bytes = len(pending)
                self._head_pending()

        def send_400_response(self, msg: str) -> None:
            self._refuse_malformed()

    return LimitedH11Protocol


def _head_end(buf: bytes) -> int:
    """Offset of the blank line that ends a request head (LF or CRLF line ends), or -1."""
    ends = [i for i in (buf.find(b"\n\r\n"), buf.find(b"\n\n")) if i >= 0]
    return min(ends) + 1 if ends else -1


def protocol_class(http: str, limits: HeadLimits | None = None) -> type:
    """The uvicorn protocol class for `http` ("httptools" or "h11") with `limits` applied."""
    limits = limits or HeadLimits()
    if http == "httptools":
        return _fast_class(limits)
    if http == "h11":
        return _plain_class(limits)
    raise ValueError(f"unknown HTTP protocol {http!r}")
