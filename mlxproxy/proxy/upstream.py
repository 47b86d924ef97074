"""Upstreams: routing by model name and one long-lived HTTP client per upstream.

This is the transport seam of the proxy: `Upstream.open()` sends a request and returns an
`UpstreamResponse` once status and headers arrived; `UpstreamResponse.read()` hands out the
body as it arrives. The transport underneath is the proxy's own raw asyncio HTTP/1.1 client
(`proxy/transport.py`; aiohttp before it, httpx before that: each cost more CPU per request
and per forwarded event, benchmarks/README.md); its errors are the project's own
(`UpstreamError` before the response, `UpstreamBodyError` after).
"""

from __future__ import annotations

import base64
import fnmatch
import os
from collections.abc import Awaitable, Callable, Iterator
from urllib.parse import unquote, urlsplit, urlunsplit

from mlxproxy.config import Config, TimeoutConfig, UpstreamConfig
from mlxproxy.errors import ConfigError
from mlxproxy.proxy.reach import Reach
from mlxproxy.proxy.transport import Conn, Pool

__all__ = ["Upstream", "UpstreamPool", "UpstreamResponse", "display_url"]


def display_url(url: str) -> str:
    """`url` with any `user:password@` replaced by `***@` (for messages about a configured URL)."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc="***@" + parts.netloc.rsplit("@", 1)[1]))


class UpstreamResponse:
    """A response whose status and headers arrived; the body is read with `read()`."""

    __slots__ = ("status_code", "raw_headers", "content_type", "_conn", "_upstream")

    def __init__(self, conn: Conn, upstream: Upstream) -> None:
        self._conn = conn
        self._upstream = upstream
        self.status_code = conn.status
        self.raw_headers: list[tuple[bytes, bytes]] = conn.headers
        self.content_type: str | None = conn.content_type

    async def read(self) -> bytes:
        """The next part of the body as it arrived (already de-chunked); b"" at its clean end.
        Raises `UpstreamBodyTimeout` after `read_s` of silence and `UpstreamBodyError`
        when the body broke (reset, truncated chunked encoding, bad framing)."""
        return await self._conn.read()

    @property
    def raw_read(self) -> Callable[[], Awaitable[bytes]]:
        """`read` without its own coroutine layer, for the relay's loop (every layer between a
        task and its read runs again for every read): the connection's own read, which raises
        the project's exceptions itself."""
        return self._conn.read

    def close(self) -> None:
        """Give the connection back (body read to its end) or close it (anything else:
        the upstream sees the close and can stop generating). Nothing in it waits, so it is no
        coroutine: awaited in a task of its own (as an `asyncio.shield` does) it cost the
        request three more turns of the event loop after its last byte."""
        self._upstream.open_responses -= 1
        self._conn.release()


class Upstream:
    """One configured upstream. The HTTP client is created on first use, inside the event
    loop that serves the requests. `base` never holds credentials; `secrets` are the values
    (key, URL password) that must never appear in what the proxy writes; `auth_header`, when
    set, replaces the client's `Authorization` header."""

    def __init__(self, cfg: UpstreamConfig, timeouts: TimeoutConfig) -> None:
        self.cfg = cfg
        self.name = cfg.name
        parts = urlsplit(cfg.url.rstrip("/"))
        self.base = urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[-1]))
        self.patterns = cfg.models
        self.api_key = os.environ.get(cfg.api_key_env) if cfg.api_key_env else None
        password = unquote(parts.password or "") if "@" in parts.netloc else None
        self.auth_header: bytes | None = None
        try:
            if self.api_key is not None:
                self.auth_header = b"Bearer " + self.api_key.strip().encode("latin-1")
            elif password is not None:
                # credentials in the URL become Basic auth, so the URL itself (in errors, logs
                # and /healthz) never carries them
                user_pass = f"{unquote(parts.username or '')}:{password}".encode("latin-1")
                self.auth_header = b"Basic " + base64.b64encode(user_pass)
        except UnicodeEncodeError:
            where = (
                f"the environment variable {cfg.api_key_env}" if self.api_key is not None else "the URL's user:password"
            )
            raise ConfigError(
                f"upstream '{cfg.name}': {where} holds characters an HTTP header cannot carry (only latin-1)"
            ) from None
        if self.auth_header is not None and any(c in self.auth_header for c in b"\r\n\0"):
            raise ConfigError(
                f"upstream '{cfg.name}': its key holds a line break or NUL, which an HTTP header cannot carry"
            )
        self.secrets = tuple(x for x in (self.api_key, parts.password, password) if x)
        self._in_flight = 0
        self.reach = Reach()  # whether it can be reached, for /healthz (proxy/reach.py)
        self.open_responses = 0  # responses opened and not yet closed (tests: nothing leaks)
        self.pool = Pool(
            cfg.name,
            self.base,
            connect_s=timeouts.connect_s or None,
            read_s=timeouts.read_s or None,
            on_unreachable=self.reach.saw,
        )

    @property
    def in_flight(self) -> int:
        """Requests to this upstream whose response is still being forwarded."""
        return self._in_flight

    def admit(self) -> int:
        """One more request in flight to this upstream; returns how many there are now, this
        one included (the request's `concurrency`: what the server saw). `leave` when done."""
        self._in_flight += 1
        return self._in_flight

    def leave(self) -> None:
        """A request admitted here is done forwarding (`proxy.inflight.InFlight.leave`)."""
        self._in_flight -= 1

    def matches(self, model: str | None) -> bool:
        return model is not None and any(fnmatch.fnmatchcase(model, p) for p in self.patterns)

    def url_for(self, raw_path: str, query: bytes) -> bytes:
        """The request target for a client's: its path and query as the client wrote them (not
        re-quoted); the transport puts this upstream's path prefix before it. Only an origin-form
        target (`/...`) is accepted, so no request can name another host."""
        if not raw_path.startswith("/"):
            raise ValueError("only an origin-form request target (/path) is forwarded")
        target = raw_path.encode("latin-1")
        return target + b"?" + query if query else target

    async def open(self, method: str, url: bytes, headers: list[tuple[bytes, bytes]], body: bytes) -> UpstreamResponse:
        """Send the request (`url`: `url_for`'s target); return once status and headers arrived
        (body not read). Raises `UpstreamError` (unreachable, timed out, failed before responding)."""
        conn = await self.pool.open(method, url, headers, body)
        self.open_responses += 1
        return UpstreamResponse(conn, self)

    async def aclose(self) -> None:
        await self.pool.aclose()


class UpstreamPool:
    """All upstreams of a config; `route(model)` picks the first whose pattern matches."""

    def __init__(self, config: Config) -> None:
        self.upstreams = [Upstream(u, config.timeouts) for u in config.upstreams]
        self.default = next(u for u in self.upstreams if u.cfg is config.default())

    def route(self, model: str | None) -> Upstream:
        for up in self.upstreams:
            if up.matches(model):
                return up
        return self.default

    async def aclose(self) -> None:
        for up in self.upstreams:
            await up.aclose()

    def __iter__(self) -> Iterator[Upstream]:
        return iter(self.upstreams)
