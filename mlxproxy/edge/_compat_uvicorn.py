"""The one place that uses uvicorn's internals: its two HTTP/1.1 protocol classes, subclassed to
apply the head limits of `limits.py` (what is refused and how it is answered is there).

Tested with uvicorn 0.55.0 (the newest release on 2026-12-04; `pyproject.toml` pins
`uvicorn>=0.29,<0.56`, and `.ci/newest` runs the forwarding tests against the newest release
whatever the pin). `tests/edge/test_compat_uvicorn.py` checks that every name in `PRIVATE_NAMES`
and `INTERNAL_NAMES` exists in the installed uvicorn.

What it relies on: `HttpToolsProtocol` and `H11Protocol` (neither is public API): their
callbacks and attributes in `INTERNAL_NAMES`, the private helpers of the httptools protocol's
`data_received` (rewritten here so the head's bytes are counted in the same pass) in
`PRIVATE_NAMES`, and the request cycle's `response_started`, `response_complete`, `disconnected`
and `message_event`.

Fallback: none keeps the limits (they live inside the protocol), so none is taken silently:
`protocol_class` raises, naming what is missing and the tested version, and the server does not
start.
"""

from __future__ import annotations

import weakref
from typing import Any

from mlxproxy.edge.limits import (
    Acceptor,
    Deadlines,
    Descriptors,
    HeadGuard,
    HeadLimits,
    drop_transport_cycle,
    framing_problem,
)

__all__ = ["INTERNAL_NAMES", "PRIVATE_NAMES", "TESTED", "missing_internals", "protocol_class", "serve"]

TESTED = "uvicorn 0.55.0"
#: class -> private methods used here
PRIVATE_NAMES: dict[str, tuple[str, ...]] = {
    "HttpToolsProtocol": ("_unset_keepalive_if_required", "_should_upgrade", "_unsupported_upgrade_warning"),
}
#: class -> methods overridden or called here that are not uvicorn's public API either
INTERNAL_NAMES: dict[str, tuple[str, ...]] = {
    "HttpToolsProtocol": (
        "data_received",
        "on_message_begin",
        "on_headers_complete",
        "on_message_complete",
        "send_400_response",
        "handle_websocket_upgrade",
        "connection_made",
        "connection_lost",
        "on_response_complete",
    ),
    "H11Protocol": ("data_received", "on_response_complete", "send_400_response", "connection_made", "connection_lost"),
    "Server": ("startup",),
}


def _base_class(name: str) -> type | None:
    """uvicorn's protocol class `name`, or None where its parser is not installed."""
    try:
        if name == "Server":
            from uvicorn.server import Server

            return Server
        if name == "H11Protocol":
            from uvicorn.protocols.http.h11_impl import H11Protocol

            return H11Protocol
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        return HttpToolsProtocol
    except ImportError:
        return None


def missing_internals(http: str | None = None) -> list[str]:
    """What the installed uvicorn lacks of `PRIVATE_NAMES` and `INTERNAL_NAMES`: for `http`'s
    class ("httptools" or "h11"), or for both (a class whose parser is not installed is skipped)."""
    names = {"httptools": ["HttpToolsProtocol", "Server"], "h11": ["H11Protocol", "Server"]}.get(
        http or "", list(INTERNAL_NAMES)
    )
    out = []
    for name in names:
        cls = _base_class(name)
        if cls is None:
            continue
        for attr in (*PRIVATE_NAMES.get(name, ()), *INTERNAL_NAMES[name]):
            if not callable(getattr(cls, attr, None)):
                out.append(f"{name}.{attr}")
    return out


class _Answering(HeadGuard):
    """How a refusal stops the app's answer: through uvicorn's request cycle."""

    def _drop_app_answer(self) -> bool:
        cycle = getattr(self, "cycle", None)
        if cycle is None or cycle.response_complete or not cycle.response_started:
            if cycle is not None and not cycle.response_complete:
                cycle.disconnected = True  # the app's own answer, if it comes, is dropped
                cycle.message_event.set()
            return True
        return False

    def _idle_cycle(self) -> bool:
        cycle = getattr(self, "cycle", None)
        return cycle is None or bool(cycle.response_complete)


def _fast_class(limits: HeadLimits) -> type:
    import httptools
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class LimitedHttpToolsProtocol(_Answering, HttpToolsProtocol):
        _deadlines = Deadlines(limits.timeout_s) if limits.timeout_s > 0 else None
        _descriptors = Descriptors()

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.limits = limits
            self._guard_init()
            self._head_begun = False

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._guard_connected()

        def connection_lost(self, exc: Exception | None) -> None:
            self._guard_lost()
            super().connection_lost(exc)

        def _sheddable(self) -> bool:
            return self._awaiting_head and self._idle_cycle()

        def on_response_complete(self) -> None:
            HttpToolsProtocol.on_response_complete(self)
            self._idle_since = self.loop.time()

        def data_received(self, data: bytes) -> None:
            self._fresh = False
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
            problem = framing_problem(self.headers, self.parser.get_http_version(), self.url, limits, self._head_bytes)
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


def _plain_class(limits: HeadLimits) -> type:
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    IDLE, Request, base_next_event = h11.IDLE, h11.Request, h11.Connection.next_event

    class GuardedConnection(h11.Connection):
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
                problem = framing_problem(
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

    class LimitedH11Protocol(_Answering, H11Protocol):
        _deadlines = Deadlines(limits.timeout_s) if limits.timeout_s > 0 else None
        _descriptors = Descriptors()

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.limits = limits
            self._guard_init()
            self.conn = GuardedConnection(self)

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._guard_connected()

        def connection_lost(self, exc: Exception | None) -> None:
            self._guard_lost()
            super().connection_lost(exc)
            drop_transport_cycle(self.transport)

        def _sheddable(self) -> bool:
            return self.conn.their_state is IDLE and self._idle_cycle()

        def data_received(self, data: bytes) -> None:
            self._fresh = False
            if self.conn.their_state is IDLE:
                self._awaiting_head = True
                self._head_bytes += len(data)
            H11Protocol.data_received(self, data)  # (not super(): this runs per read)
            if self._awaiting_head and self._head_bytes and self.conn.their_state is IDLE:
                self._head_pending()  # (a whole head makes h11 leave IDLE and resets the count)

        def on_response_complete(self) -> None:
            H11Protocol.on_response_complete(self)
            self._idle_since = self.loop.time()
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


def _bare_lf(head: bytes) -> bool:
    return head.count(b"\n") != head.count(b"\r\n")


def _folded(head: bytes) -> bool:
    return b"\n " in head or b"\n\t" in head


def _head_end(buf: bytes) -> int:
    """Offset of the blank line that ends a request head (LF or CRLF line ends), or -1.
    `buf` usually holds the request's body too: the search for an LF-only blank line stops at
    the CRLF one (a search of the whole buffer, ~50 us for an agent's 57 kB body, cost more than
    h11's parse of the whole request)."""
    crlf = buf.find(b"\n\r\n")
    lf = buf.find(b"\n\n", 0, crlf + 1) if crlf >= 0 else buf.find(b"\n\n")
    end = lf if lf >= 0 else crlf  # (an LF-only blank line found here comes before the CRLF one)
    return end + 1 if end >= 0 else -1


def protocol_class(http: str, limits: HeadLimits | None = None) -> type:
    """The uvicorn protocol class for `http` ("httptools" or "h11") with `limits` applied.
    Raises RuntimeError when the installed uvicorn lacks what the subclass needs."""
    limits = limits or HeadLimits()
    if http in ("httptools", "h11") and (missing := missing_internals(http)):
        import uvicorn

        raise RuntimeError(
            f"uvicorn {uvicorn.__version__} lacks {', '.join(missing)}, which the request-head limits need "
            f"(tested: {TESTED}); install a tested version: pip install 'uvicorn<0.56'"
        )
    if http == "httptools":
        return _fast_class(limits)
    if http == "h11":
        return _plain_class(limits)
    raise ValueError(f"unknown HTTP protocol {http!r}")


def serve(server: Any, sock: Any) -> Any:
    """`server.serve(sockets=[sock])` (a `uvicorn.Server`), with the connections accepted by an
    `Acceptor` that asks the protocol class's `Descriptors` before each one, instead of by the
    loop's own server (which has no way to hold back at the open-files limit). uvicorn's startup
    runs without sockets (lifespan, state), then the acceptor joins its `servers`, which its
    shutdown closes."""
    import asyncio

    base_startup = server.startup

    async def startup(sockets: Any = None) -> None:
        await base_startup(sockets=[])
        config = server.config
        cls = config.http_protocol_class

        def factory() -> Any:
            return cls(config=config, server_state=server.server_state, app_state=server.lifespan.state)

        loop = asyncio.get_running_loop()
        try:
            acceptor: Any = Acceptor(loop, sock, factory, getattr(cls, "_descriptors", None))
        except NotImplementedError:  # a loop without add_reader (Windows' proactor): its own server
            acceptor = await loop.create_server(factory, sock=sock, backlog=config.backlog)
        server.servers.append(acceptor)

    server.startup = startup
    return server.serve(sockets=[sock])
