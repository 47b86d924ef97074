"""Upstreams: routing by model name and one long-lived HTTP client per upstream.

This is the transport seam of the proxy: `Upstream.open()` returns a streaming httpx
response, translating httpx's exceptions into the project's `UpstreamError`s.
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Iterator
from urllib.parse import unquote, urlsplit, urlunsplit

import httpx

from mlxproxy.config import Config, TimeoutConfig, UpstreamConfig
from mlxproxy.errors import UpstreamTimeout, UpstreamUnreachable

__all__ = ["Upstream", "UpstreamPool", "display_url"]


def display_url(url: str) -> str:
    """`url` with any `user:password@` replaced by `***@` (for messages about a configured URL)."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc="***@" + parts.netloc.rsplit("@", 1)[1]))


class Upstream:
    """One configured upstream. The httpx client is created on first use, inside the
    event loop that serves the requests. `base` never holds credentials; `secrets` are the
    values (key, URL password) that must never appear in what the proxy writes."""

    def __init__(self, cfg: UpstreamConfig, timeouts: TimeoutConfig, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.cfg = cfg
        self.name = cfg.name
        parts = urlsplit(cfg.url.rstrip("/"))
        # credentials in the URL become Basic auth, so the URL itself (in errors, logs and
        # /healthz, httpx's own log lines included) never carries them
        self._auth = (unquote(parts.username or ""), unquote(parts.password or "")) if "@" in parts.netloc else None
        self.base = urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[-1]))
        self.patterns = cfg.models
        self.api_key = os.environ.get(cfg.api_key_env) if cfg.api_key_env else None
        self.secrets = tuple(x for x in (self.api_key, parts.password, self._auth and self._auth[1]) if x)
        self.in_flight = 0
        self._timeouts = httpx.Timeout(connect=timeouts.connect_s, read=timeouts.read_s or None,
                                       write=timeouts.write_s or None, pool=timeouts.pool_s or None)
        self._transport = transport
        self._client: httpx.AsyncClient | None = None

    def matches(self, model: str | None) -> bool:
        return model is not None and any(fnmatch.fnmatchcase(model, p) for p in self.patterns)

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(
                timeout=self._timeouts,
                auth=self._auth,
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=256, keepalive_expiry=30.0),
                transport=self._transport,
                trust_env=False,
                follow_redirects=False,
            )
        return self._client

    def url_for(self, raw_path: str, query: bytes) -> str:
        url = self.base + raw_path
        if query:
            url += "?" + query.decode("latin-1")
        return url

    async def open(self, method: str, url: str, headers: list[tuple[bytes, bytes]], body: bytes) -> httpx.Response:
        """Send the request; return once status and headers arrived (body not read)."""
        request = httpx.Request(method, url, headers=headers, content=body)
        try:
            return await self.client.send(request, stream=True)
        except httpx.TimeoutException as exc:
            raise UpstreamTimeout(f"upstream '{self.name}' did not answer within the timeout ({type(exc).__name__})") from exc
        except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
            raise UpstreamUnreachable(f"upstream '{self.name}' at {self.base} is unreachable: {_reason(exc)}") from exc
        except httpx.HTTPError as exc:
            raise UpstreamUnreachable(f"upstream '{self.name}' failed before responding: {_reason(exc)}") from exc

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None


def _reason(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__


class UpstreamPool:
    """All upstreams of a config; `route(model)` picks the first whose pattern matches."""

    def __init__(self, config: Config, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.upstreams = [Upstream(u, config.timeouts, transport) for u in config.upstreams]
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
