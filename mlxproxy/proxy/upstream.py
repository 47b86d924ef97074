"""Upstreams: routing by model name and one long-lived HTTP client per upstream.

This is the transport seam of the proxy: `Upstream.open()` sends a request and returns an
`UpstreamResponse` once status and headers arrived; `UpstreamResponse.read()` hands out the
body as it arrives. aiohttp is the client (an httpx client cost several times more CPU per
forwarded event and per request: benchmarks/README.md); its exceptions are translated here
into the project's own (`UpstreamError` before the response, `UpstreamBodyError` after), so
nothing above this module knows which client library is underneath.
"""

from __future__ import annotations

import asyncio
import base64
import fnmatch
import os
from collections.abc import Awaitable, Callable, Iterator
from urllib.parse import unquote, urlsplit, urlunsplit

import aiohttp
from yarl import URL

from mlxproxy.config import Config, TimeoutConfig, UpstreamConfig
from mlxproxy.core.text import clip
from mlxproxy.errors import (
    ConfigError,
    UpstreamBodyError,
    UpstreamBodyTimeout,
    UpstreamTimeout,
    UpstreamUnreachable,
)
from mlxproxy.proxy._compat_aiohttp import connector
from mlxproxy.proxy.reach import Reach

__all__ = ["Upstream", "UpstreamPool", "UpstreamResponse", "display_url"]

# Headers aiohttp would add on its own; the proxy forwards the client's, not a library's.
_NO_AUTO_HEADERS = frozenset({"User-Agent", "Accept", "Accept-Encoding", "Content-Type"})


# An idle pooled connection is dropped after this long: below the 5 s keep-alive of uvicorn
# (vLLM, vllm-mlx) and llama.cpp, so the proxy never sends a request on a connection the
# server is closing at that moment.
POOL_IDLE_S = 4.0


def display_url(url: str) -> str:
    """`url` with any `user:password@` replaced by `***@` (for messages about a configured URL)."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc="***@" + parts.netloc.rsplit("@", 1)[1]))


class UpstreamResponse:
    """A response whose status and headers arrived; the body is read with `read()`."""

    __slots__ = ("status_code", "raw_headers", "content_type", "_resp", "_read", "_closed", "_eof", "_upstream")

    def __init__(self, resp: aiohttp.ClientResponse, upstream: Upstream) -> None:
        self._resp = resp
        self._upstream = upstream
        self.status_code = resp.status
        self.raw_headers: list[tuple[bytes, bytes]] = list(resp.raw_headers)
        self.content_type: str | None = resp.headers.get("content-type")
        self._read = resp.content.readany
        self._eof = False
        # A body delimited by the connection's close (HTTP/1.0 servers such as
        # mlx_lm.server) ends the same way for a clean close and for a reset; the
        # connection's `closed` future tells them apart.
        self._closed: asyncio.Future[None] | None = None
        if (
            resp.headers.get("content-length") is None
            and "chunked" not in resp.headers.get("transfer-encoding", "").lower()
        ):
            conn = resp.connection
            self._closed = (
                getattr(conn.protocol, "closed", None) if conn is not None and conn.protocol is not None else None
            )

    async def read(self) -> bytes:
        """The next part of the body as it arrived (already de-chunked); b"" at its clean end.
        Raises `UpstreamBodyTimeout` after `read_s` of silence and `UpstreamBodyError`
        when the body broke (reset, truncated chunked encoding, bad framing)."""
        try:
            chunk = await self._read()
        except Exception as exc:
            self.body_error(exc)
            raise
        if not chunk:
            self.ended()
        return chunk

    @property
    def raw_read(self) -> Callable[[], Awaitable[bytes]]:
        """`read` without its own coroutine layer, for the relay's loop (every layer between a
        task and its read runs again for every read): the client's own read, whose exceptions
        `body_error` translates, and whose b"" is followed by a call of `ended`."""
        return self._read

    def body_error(self, exc: Exception) -> None:
        """Raise the project's exception for what `raw_read` raised, `UpstreamBodyTimeout` or
        `UpstreamBodyError`; returns when `exc` is no body failure (the caller re-raises it).
        (It raises rather than returns the new one: an exception kept in a local of a frame it
        is raised through makes a reference cycle.)"""
        if isinstance(exc, asyncio.TimeoutError):
            _forget_tracebacks(exc)
            raise UpstreamBodyTimeout(
                f"upstream '{self._upstream.name}' went silent for longer than the read timeout"
            ) from None
        if isinstance(exc, (aiohttp.ClientError, OSError)):
            _forget_tracebacks(exc)
            raise UpstreamBodyError(f"upstream body ended abnormally: {_reason(exc)}") from None

    def ended(self) -> None:
        """The body's end (b"" read): raises `UpstreamBodyError` when a body delimited by the
        connection's close ended with a reset, not a clean close."""
        self._eof = True
        closed = self._closed
        if closed is not None and closed.done() and not closed.cancelled():
            broken = closed.exception()
            if broken is not None:
                raise UpstreamBodyError(f"upstream body ended abnormally: {_reason(broken)}")

    async def aclose(self) -> None:
        """Give the connection back (body read to its end) or close it (anything else:
        the upstream sees the close and can stop generating)."""
        self._upstream.open_responses -= 1
        if self._eof:
            self._resp.release()
        else:
            self._resp.close()


class Upstream:
    """One configured upstream. The HTTP client is created on first use, inside the event
    loop that serves the requests. `base` never holds credentials; `secrets` are the values
    (key, URL password) that must never appear in what the proxy writes; `auth_header`, when
    set, replaces the client's `Authorization` header. `reuse_connections=False` opens a new
    connection for every request and closes it after (the load generator's released-together
    requests)."""

    def __init__(self, cfg: UpstreamConfig, timeouts: TimeoutConfig, *, reuse_connections: bool = True) -> None:
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
        self._timeout = aiohttp.ClientTimeout(
            total=None,
            connect=timeouts.connect_s or None,
            sock_connect=timeouts.connect_s or None,
            sock_read=timeouts.read_s or None,
        )
        self._session: aiohttp.ClientSession | None = None
        self._reuse = reuse_connections

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

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=(
                    connector(limit=0, keepalive_timeout=POOL_IDLE_S)
                    if self._reuse
                    else connector(limit=0, force_close=True)
                ),
                timeout=self._timeout,
                auto_decompress=False,  # the client gets the bytes the upstream sent
                cookie_jar=aiohttp.DummyCookieJar(),  # one client's cookies never reach another's request
                trust_env=False,
                skip_auto_headers=_NO_AUTO_HEADERS,
            )
        return self._session

    def url_for(self, raw_path: str, query: bytes) -> URL:
        """The upstream URL for a request target: this upstream's scheme, host and port,
        then the target. Only an origin-form target (`/...`) is accepted, so no request
        can name another host."""
        if not raw_path.startswith("/"):
            raise ValueError("only an origin-form request target (/path) is forwarded")
        url = self.base + raw_path
        if query:
            url += "?" + query.decode("latin-1")
        return URL(url, encoded=True)  # forwarded as the client wrote it, not re-quoted

    async def open(self, method: str, url: URL, headers: list[tuple[bytes, bytes]], body: bytes) -> UpstreamResponse:
        """Send the request; return once status and headers arrived (body not read)."""
        hdrs = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in headers]
        try:
            resp = await self.session.request(
                method, url, headers=hdrs, data=body or None, allow_redirects=False, compress=None, chunked=None
            )
        except asyncio.TimeoutError as exc:
            raise UpstreamTimeout(
                f"upstream '{self.name}' did not answer within the timeout ({type(exc).__name__})"
            ) from exc
        except (aiohttp.ClientConnectionError, OSError) as exc:
            if isinstance(exc, OSError):  # could not connect (or reset at once): /healthz shows it
                self.reach.saw(_reason(exc))
            raise UpstreamUnreachable(f"upstream '{self.name}' at {self.base} is unreachable: {_reason(exc)}") from exc
        except aiohttp.ClientError as exc:
            raise UpstreamUnreachable(f"upstream '{self.name}' failed before responding: {_reason(exc)}") from exc
        except ValueError as exc:  # a URL that cannot be connected to (config checks refuse these at start)
            raise UpstreamUnreachable(f"upstream '{self.name}' has an invalid URL {self.base}: {exc}") from exc
        self.open_responses += 1
        return UpstreamResponse(resp, self)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def _forget_tracebacks(exc: BaseException) -> None:
    """Drop the tracebacks of `exc` and of the exceptions it chains. aiohttp keeps the exception
    of a broken body on the response's stream reader and raises that same object, so its
    traceback's frames (whose locals hold the reader) make a reference cycle per failed body:
    the response, its buffers and headers then wait for a full collection of the cyclic GC.
    Over a 20,000-request soak with faults that garbage piled up between full collections and
    the process kept the memory (benchmarks/README.md, "Memory over a long run"). The proxy
    only keeps the message (`_reason`), so nothing is lost."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        e.__traceback__ = None
        todo += [e.__cause__, e.__context__]


def _reason(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {clip(text.splitlines()[0], 200)}" if text else type(exc).__name__


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
