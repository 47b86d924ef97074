"""The one place that uses aiohttp's private internals: the guarded connection pool.

Tested with aiohttp 3.14.5 (the newest release on 2026-12-04; `pyproject.toml` pins
`aiohttp>=3.12,<3.15`, and `.ci/newest` runs the forwarding tests against the newest release
whatever the pin). `tests/proxy/test_compat.py` checks that every name in `PRIVATE_NAMES` exists
in the installed aiohttp, and the fallback below.

What it relies on (`PRIVATE_NAMES`): `TCPConnector._release` and `_get` (overridden, to check a
connection when it is given back and when it is taken), `TCPConnector._factory` and `_loop` (the
protocol factory, replaced by one that breaks a reference cycle), `ResponseHandler._parser`
(cleared while a connection is idle, so a stray byte marks it `should_close`),
`ResponseHandler._read_timeout_handle` (a read timer left armed after a response), and the read
timer's `_reschedule_timeout` (overridden: the timer kept lazily), `_drop_timeout`,
`_on_read_timeout`, `_read_timeout` and `_loop`.

Fallback: where any of them is missing, `connector()` logs one warning and returns aiohttp's own
`TCPConnector` with `force_close=True`: a new connection per request, never one that saw anything
unexpected (the property the guarded pool keeps), at the cost of a connect per request.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import TYPE_CHECKING

import aiohttp
from aiohttp.client_proto import ResponseHandler

from mlxproxy.edge.limits import drop_transport_cycle

if TYPE_CHECKING:  # (aiohttp's own annotations name them so; neither is public API)
    from aiohttp.client_reqrep import ConnectionKey
    from aiohttp.tracing import Trace

__all__ = ["PRIVATE_NAMES", "TESTED", "connector", "missing_internals", "reusable"]

TESTED = "aiohttp 3.14.5"
#: class -> the private attributes (methods, or instance attributes set in __init__) used here
PRIVATE_NAMES: dict[str, tuple[str, ...]] = {
    "TCPConnector": ("_release", "_get", "_factory", "_loop"),
    "ResponseHandler": (
        "_parser",
        "_read_timeout_handle",
        "_read_timeout",
        "_reschedule_timeout",
        "_drop_timeout",
        "_on_read_timeout",
        "_loop",
    ),
}

log = logging.getLogger("mlxproxy")


class GuardedHandler(ResponseHandler):
    """An upstream connection that breaks its own reference cycle when it is lost, and keeps
    its read timer lazily.

    aiohttp restarts the read timeout (`sock_read`) on every read from the socket: a timer
    cancelled and a new one made per body chunk, ~6,500 instructions per streamed event (6% of
    a proxied stream's, benchmarks/instructions.py). Here a read only moves the deadline; the
    one timer, when it fires, is set again for the deadline if a read moved it since it was
    set, else it is the timeout. It fires when aiohttp's would (the last read plus the
    timeout), and is armed (`_read_timeout_handle`) and dropped exactly when aiohttp's is."""

    _read_deadline = 0.0  # when the read timeout is due: the last read plus the timeout
    _armed_for = 0.0  # the deadline the armed timer was set for

    def _reschedule_timeout(self) -> None:
        timeout = self._read_timeout
        if not timeout:
            self._drop_timeout()  # (what aiohttp's does then: no timer)
            return
        self._read_deadline = deadline = self._loop.time() + timeout
        if self._read_timeout_handle is None:
            self._armed_for = deadline
            self._read_timeout_handle = self._loop.call_at(deadline, self._read_timer_fired)

    def _read_timer_fired(self) -> None:
        deadline = self._read_deadline
        if deadline != self._armed_for:  # a read since the timer was set: not due yet
            self._armed_for = deadline
            self._read_timeout_handle = self._loop.call_at(deadline, self._read_timer_fired)
            return
        self._on_read_timeout()  # aiohttp's own: the same exception, the timer dropped

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._made = transport  # aiohttp forgets its transport when it closes it itself
        super().connection_made(transport)

    def connection_lost(self, exc: BaseException | None) -> None:
        super().connection_lost(exc)
        drop_transport_cycle(self.__dict__.pop("_made", None))


def reusable(proto: ResponseHandler) -> bool:
    """False after anything unexpected: bytes while idle, buffered or half-parsed data, an
    error, or a read timer still armed after the response ended (aiohttp can leave one
    behind after pausing for a large body; it would fail the next request at once)."""
    return not (proto.should_close or getattr(proto, "_read_timeout_handle", None) is not None)


def _guarded_handler(*, loop: asyncio.AbstractEventLoop) -> ResponseHandler:
    """The pool's protocol factory (aiohttp's is `partial(ResponseHandler, loop=...)`)."""
    return GuardedHandler(loop=loop)


class GuardedConnector(aiohttp.TCPConnector):
    """A connection pool that never hands out a connection after anything unexpected: each
    is checked when it is given back and again when it is taken (SECURITY.md, "One request,
    one response")."""

    def __init__(self, *, limit: int, keepalive_timeout: float | None = None, force_close: bool = False) -> None:
        if keepalive_timeout is None:  # (aiohttp's default)
            super().__init__(limit=limit, force_close=force_close)
        else:
            super().__init__(limit=limit, keepalive_timeout=keepalive_timeout, force_close=force_close)
        if not hasattr(self, "_factory"):  # (the fallback in `connector` takes over)
            raise AttributeError("no _factory", name="_factory", obj=self)
        self._factory = functools.partial(_guarded_handler, loop=self._loop)

    def _release(self, key: ConnectionKey, protocol: ResponseHandler, *, should_close: bool = False) -> None:
        if not should_close:
            if reusable(protocol):
                # Idle in the pool, a connection has no response parser: aiohttp then keeps
                # any byte that arrives (an extra response, more body than announced) in its
                # `_tail`, which `should_close` reports, so the connection is never handed out
                # again. The next request on it gets a fresh parser (`set_response_params`).
                # (An override of `data_received` did the same at a Python call per body chunk:
                # 3 % of the proxy's instructions for a stream, benchmarks/instructions.py.)
                protocol._parser = None
            else:
                should_close = True
        super()._release(key, protocol, should_close=should_close)

    async def _get(self, key: ConnectionKey, traces: list[Trace]) -> aiohttp.connector.Connection | None:
        # only the connection about to be handed out is checked (walking every idle one cost
        # O(pool) per request: 2 % of a load generator's CPU at 800 req/s); one that fails is
        # closed and the next is taken
        while True:
            conn = await super()._get(key, traces)
            if conn is None or conn.protocol is None:
                return conn
            if reusable(conn.protocol):
                return conn
            conn.close()  # bytes arrived while it sat idle, or it is half-parsed: never reused


def missing_internals(loop: asyncio.AbstractEventLoop) -> list[str]:
    """The names of `PRIVATE_NAMES` the installed aiohttp lacks (empty: the guarded pool can
    work); the connector's own attributes are checked when one is made (`GuardedConnector`)."""
    missing = [
        f"TCPConnector.{n}" for n in ("_release", "_get") if not callable(getattr(aiohttp.TCPConnector, n, None))
    ]
    handler = ResponseHandler(loop)
    return missing + [f"ResponseHandler.{n}" for n in PRIVATE_NAMES["ResponseHandler"] if not hasattr(handler, n)]


_missing: list[str] | None = None


def connector(*, limit: int, keepalive_timeout: float | None = None, force_close: bool = False) -> aiohttp.TCPConnector:
    """The upstream's connection pool (call inside the running loop): the guarded pool where
    the installed aiohttp has what it needs, else aiohttp's own with a connection per request.
    `keepalive_timeout` None: aiohttp's default."""
    global _missing
    if _missing is None:
        _missing = missing_internals(asyncio.get_running_loop())
    if not _missing:
        try:
            return GuardedConnector(limit=limit, keepalive_timeout=keepalive_timeout, force_close=force_close)
        except AttributeError as exc:
            _missing = [f"TCPConnector.{exc.name}"]
    log.warning(
        "aiohttp %s lacks %s (tested: %s): upstream connections are not reused",
        aiohttp.__version__,
        ", ".join(_missing),
        TESTED,
    )
    return aiohttp.TCPConnector(limit=limit, force_close=True)
