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
import errno
import hashlib
import logging
import os
import socket
import time
from collections.abc import Callable
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
    "Descriptors",
    "Acceptor",
    "open_files_limit",
    "open_descriptors",
]

log = logging.getLogger("mlxproxy.edge")

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
    """What both protocol subclasses share: byte counting, the head timer, refusals, and the
    connection's place among the server's open connections (`Descriptors`)."""

    limits: HeadLimits
    transport: asyncio.Transport
    loop: asyncio.AbstractEventLoop
    client: tuple[str, int] | None
    _deadlines: Deadlines | None = None  # one per server (protocol class)
    _descriptors: Descriptors | None = None  # one per server (protocol class)

    def _guard_init(self) -> None:
        self._awaiting_head = True  # no complete request head since the last one ended
        self._head_bytes = 0
        self._head_timer_armed = False
        self._refusal: tuple[int, str, str] | None = None
        self._idle_since = 0.0  # when it last began to wait for a request (shedding order)
        self._fresh = True  # nothing read yet: its first read may well be a whole request
        self._host = ""

    def _guard_connected(self) -> None:
        """The connection is open (after the server's own `connection_made`)."""
        self._arm_head_timer()
        if self._descriptors is not None:
            self._idle_since = self.loop.time()
            self._host = self.client[0] if self.client else ""
            self._descriptors.add(self)

    def _guard_lost(self) -> None:
        self._cancel_head_timer()
        if self._descriptors is not None:
            self._descriptors.discard(self)

    def _sheddable(self) -> bool:
        """True while the connection waits for a request head (none begun, or one unfinished)
        and no response is under way: what it would lose by being closed is only what it sent
        of a head (the server's protocol class says how to tell: `_compat_uvicorn`)."""
        raise NotImplementedError

    def _shed(self) -> None:
        """Closed to keep descriptors for other clients: silently, like a head timeout with
        nothing received (`abort`, so the descriptor is released on the loop's next turn)."""
        self._cancel_head_timer()
        self._awaiting_head = False
        self.transport.abort()

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


#: what `Descriptors.room` answers: accept, wait for the connections just shed to close (the loop's
#: next turn), or pause accepting for a while (nothing can be shed)
ACCEPT, WAIT, PAUSE = "accept", "wait", "pause"
PAUSE_S = 0.02
CLOSING_S = 0.1  # the longest the acceptor waits for the connections it shed to close
FRESH_S = 0.5  # a connection not read from yet is not shed this soon after it opened
LOG_EVERY_S = 60.0


def open_files_limit() -> int:
    """This process's soft limit on open files (where the platform has one; else 1 << 20)."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, ValueError, OSError):
        return 1 << 20
    return soft if soft != resource.RLIM_INFINITY and soft > 0 else 1 << 20


def _fd_folder() -> str | None:
    for folder in ("/proc/self/fd", "/dev/fd"):
        try:
            os.listdir(folder)
        except OSError:
            continue
        return folder
    return None


_FD_FOLDER = _fd_folder()


def open_descriptors(limit: int | None = None) -> int | None:
    """How many descriptors this process has open (Linux /proc, macOS /dev/fd), or None. Listing
    them takes one descriptor: when none is left, that is the answer (`limit`)."""
    if _FD_FOLDER is None:
        return None
    try:
        return len(os.listdir(_FD_FOLDER)) - 1  # (less the one that lists them)
    except OSError as exc:
        return limit if exc.errno in (errno.EMFILE, errno.ENFILE) else None


class Descriptors:
    """A server's client connections against the process's open-files limit, held the way
    nginx holds its connection limit (SECURITY.md, "Holding at the open-files limit"):

    - a reserve of descriptors is kept free for new clients and the upstream connection each
      request needs: `reserve` = limit / 8, at least 16 and at most 256;
    - when fewer than `reserve` are free, the connections that have sent the least are closed,
      silently, until twice the reserve is free: only connections waiting for a request head
      (an unfinished head, a kept-alive connection between requests, or nothing read yet and open
      for `FRESH_S`; never one with a request or response under way): first those that were read
      from and still have no whole head (a new connection's first read is usually a whole
      request), then those of client addresses holding more than their `share`, then the ones
      that began waiting longest ago;
    - with nothing to close and the descriptors nearly gone, accepting pauses for `PAUSE_S`
      (the clients wait in the listen queue) instead of failing in `accept()`;
    - the shedding is logged when it starts (at most once a minute, with the count since the
      last report), never per connection.

    The open descriptors are counted (`open_descriptors`) only when the client connections
    could have used up the room left at the last count (each with an upstream connection), so
    a server far from its limit never counts them."""

    def __init__(self, limit: int | None = None) -> None:
        self.limit = limit if limit is not None else open_files_limit()
        self.reserve = min(256, max(16, self.limit // 8))
        self.share = max(8, (self.limit - self.reserve) // 4)
        self.conns: dict[HeadGuard, None] = {}  # the open client connections
        self.by_host: dict[str, int] = {}
        self.next_check = 0  # count the descriptors when this many client connections are open
        self.accepting = 0  # accepted by the `Acceptor`, not yet open connections here
        self.shed_total = 0
        self._closing: set[HeadGuard] = set()  # shed, not yet closed
        self._closing_since = 0.0
        self._reported = 0
        self._logged_at = -LOG_EVERY_S

    def add(self, proto: HeadGuard) -> None:
        self.conns[proto] = None
        self.by_host[proto._host] = self.by_host.get(proto._host, 0) + 1

    def discard(self, proto: HeadGuard) -> None:
        if self.conns.pop(proto, 0) is None:
            left = self.by_host[proto._host] - 1
            if left:
                self.by_host[proto._host] = left
            else:
                del self.by_host[proto._host]
        self._closing.discard(proto)

    def room(self) -> str:
        """Whether the acceptor may take one more connection now (`ACCEPT`, `WAIT`, `PAUSE`)."""
        if self._closing:
            if time.monotonic() - self._closing_since < CLOSING_S:
                return WAIT  # their descriptors are released on the loop's next turn
            self._closing.clear()  # (should never be needed: never wait on them for long)
        n = len(self.conns) + self.accepting
        used = open_descriptors(self.limit)
        if used is None:
            used = 32 + 2 * n  # (no way to count them: the process's own plus two per client)
        free = self.limit - used
        if free >= self.reserve:
            self.next_check = n + max(1, (free - self.reserve) // 2)
            return ACCEPT
        if self._shed(min(2 * self.reserve, 2 * self.reserve - free), used):
            return WAIT
        self.next_check = n + 1
        return ACCEPT if free > self.reserve // 4 else PAUSE

    def _shed(self, want: int, used: int) -> int:
        waiting = [p for p in self.conns if p._sheddable() and not p.transport.is_closing()]
        if not waiting:
            return 0
        # a connection not read from yet is left alone for FRESH_S: its first read, one turn of
        # the loop away, is usually a whole request (on a loaded loop, several turns)
        now = waiting[0].loop.time()
        waiting = [p for p in waiting if not p._fresh or now - p._idle_since >= FRESH_S]
        if not waiting:
            return 0
        share = self.share
        by_host = self.by_host
        waiting.sort(key=lambda p: (p._fresh, by_host.get(p._host, 0) <= share, p._idle_since))
        self._closing_since = time.monotonic()
        for proto in waiting[:want]:
            self._closing.add(proto)
            proto._shed()
        shed = min(want, len(waiting))
        self.shed_total += shed
        self.report(used)
        return shed

    def report(self, used: int | None = None) -> None:
        """Log that the server is at its open-files limit: once when it starts, then at most once
        a minute while it lasts, never per connection."""
        now = time.monotonic()
        if now - self._logged_at < LOG_EVERY_S:
            return
        self._logged_at = now
        count = "" if used is None else f"{used} of "
        log.warning(
            "mlxproxy: at the open-files limit (%s%d descriptors open): closing the connections that "
            "have sent least (unfinished request heads, longest idle first) to keep room for new "
            "clients; %d closed so far. Raise the limit (ulimit -n) if this is normal load.",
            count,
            self.limit,
            self.shed_total,
        )


class Acceptor:
    """Accepts a listening socket's connections itself, asking `Descriptors.room` before each
    one, so the server never runs out of descriptors in `accept()` (where asyncio logs an error
    and stops accepting for a second, and libuv closes every connection still queued). Each
    accepted socket goes to `loop.connect_accepted_socket(factory, sock)`. It quacks like the
    `asyncio.Server` a server keeps (`close`, `wait_closed`)."""

    BATCH = 128  # connections accepted per wakeup at most (then the loop's other work)

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        sock: socket.socket,
        factory: Callable[[], asyncio.BaseProtocol],
        descriptors: Descriptors | None,
    ) -> None:
        self.loop, self.sock, self.factory, self.descriptors = loop, sock, factory, descriptors
        sock.setblocking(False)
        self._fd = sock.fileno()
        self._resume: asyncio.TimerHandle | None = None
        self._closed = False
        self._tasks: set[asyncio.Task[None]] = set()
        loop.add_reader(self._fd, self._accept)

    def _accept(self) -> None:
        d = self.descriptors
        for _ in range(self.BATCH):
            if d is not None and len(d.conns) + d.accepting >= d.next_check:
                verdict = d.room()
                if verdict == WAIT:
                    return  # (the listening socket is still readable: called again next turn)
                if verdict == PAUSE:
                    self._pause()
                    return
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue
            except OSError as exc:
                if exc.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    raise
                # (descriptors taken by something else than client connections since the last count)
                if d is not None:
                    d.next_check = 0
                    if d.room() == WAIT:
                        return
                    d.report()
                self._pause()
                return
            conn.setblocking(False)
            if d is not None:
                d.accepting += 1
            task = self.loop.create_task(self._connect(conn))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _connect(self, conn: socket.socket) -> None:
        try:
            await self.loop.connect_accepted_socket(self.factory, conn)
        except (OSError, RuntimeError):  # (closed before it was set up, or the loop is closing)
            conn.close()
        finally:
            if self.descriptors is not None:
                self.descriptors.accepting -= 1

    def _pause(self) -> None:
        if self._resume is None and not self._closed:
            self.loop.remove_reader(self._fd)
            self._resume = self.loop.call_later(PAUSE_S, self._unpause)

    def _unpause(self) -> None:
        self._resume = None
        if not self._closed:
            self.loop.add_reader(self._fd, self._accept)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._resume is not None:
            self._resume.cancel()
            self._resume = None
        else:
            self.loop.remove_reader(self._fd)

    async def wait_closed(self) -> None:
        return None


def drop_transport_cycle(transport: Any) -> None:
    """Clear the bound method an asyncio selector socket transport keeps on itself
    (`_read_ready_cb`) once its connection is lost. Before Python 3.12 that is a reference cycle
    per closed connection (python/cpython#100348, fixed in 3.12 by clearing it on close), so
    each closed connection's transport and socket waited for a full collection of the cyclic
    GC. uvloop's transports have no such attribute: nothing to do there."""
    if getattr(transport, "_read_ready_cb", None) is not None:
        transport._read_ready_cb = None
