"""Limits on what a client controls before the app sees a request, on both server stacks.

uvicorn's two HTTP/1.1 protocols differ: h11 (the plain install) bounds a request head at a
buffer size but accepts `HTTP/9.9`, LF-only line ends and a request with both
Content-Length and Transfer-Encoding; httptools (the fast extras) bounds nothing. Neither
closes a connection that never completes a request head. `_compat_uvicorn.protocol_class(http,
limits)` returns a small subclass of either that, identically on both stacks (what is checked and
answered is here, in `HeadGuard` and `framing_problem`; how it hooks into uvicorn's classes is
there, the one module that knows their internals):

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
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from mlxproxy.errors import error_body

__all__ = [
    "HeadLimits",
    "HeadGuard",
    "Deadlines",
    "framing_problem",
    "error_response",
    "bounded_field",
    "MAX_FIELD_CHARS",
    "origin_form",
    "drop_transport_cycle",
]

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
    body = error_body(message, code, "invalid_request_error")
    phrase = HTTPStatus(status).phrase
    head = (
        f"HTTP/1.1 {status} {phrase}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


def framing_problem(
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


class Deadlines:
    """The head timeout without a timer per connection: connections waiting for a request
    head, each with its deadline, checked by one timer every quarter of the timeout (so a
    connection is closed between 1 and 1.25 times the timeout after it began waiting)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.waiting: dict[HeadGuard, float] = {}
        self._handle: asyncio.TimerHandle | None = None

    def add(self, proto: HeadGuard) -> None:
        loop = proto.loop
        self.waiting[proto] = loop.time() + self.timeout_s
        if self._handle is None:
            self._handle = loop.call_later(self.timeout_s / 4, self._sweep, loop)

    def discard(self, proto: HeadGuard) -> None:
        self.waiting.pop(proto, None)

    def _sweep(self, loop: asyncio.AbstractEventLoop) -> None:
        self._handle = None
        now = loop.time()
        for proto in [p for p, deadline in self.waiting.items() if deadline <= now]:
            del self.waiting[proto]
            proto._head_timed_out()
        if self.waiting:
            self._handle = loop.call_later(self.timeout_s / 4, self._sweep, loop)


class HeadGuard:
    """What both protocol subclasses share: byte counting, the head timer, refusals."""

    limits: HeadLimits
    transport: asyncio.Transport
    loop: asyncio.AbstractEventLoop
    _deadlines: Deadlines | None = None  # one per server (protocol class)

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
            if self._deadlines is not None:  # (always, when a timer was armed)
                self._deadlines.discard(self)

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
            if self._drop_app_answer():
                self.transport.write(error_response(status, message, code))
            self.transport.close()  # a response under way is cut, never followed by an error

    def _drop_app_answer(self) -> bool:
        """Stop the app's answer to the current request, if any, reaching the client; False when
        a response is already under way (the server's protocol class says how: `_compat_uvicorn`)."""
        raise NotImplementedError

    def _refuse_malformed(self) -> None:
        if self._refusal is not None:
            self._refuse(*self._refusal)
        elif self._head_too_large():
            self._refuse_too_large()
        else:
            self._refuse(400, "malformed HTTP request", "invalid_request")


def drop_transport_cycle(transport: Any) -> None:
    """Clear the bound method an asyncio selector socket transport keeps on itself
    (`_read_ready_cb`) once its connection is lost. Before Python 3.12 that is a reference cycle
    per closed connection (python/cpython#100348, fixed in 3.12 by clearing it on close), so
    each closed connection's transport and socket waited for a full collection of the cyclic
    GC. uvloop's transports have no such attribute: nothing to do there."""
    if getattr(transport, "_read_ready_cb", None) is not None:
        transport._read_ready_cb = None
