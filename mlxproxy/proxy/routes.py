"""The proxy's own routes, on Starlette: the live page, `/metrics`, `/healthz`, `/streams`, `/sessions`.

`ProxyApp` (a `ProxyState`) hands a request here only when its path is one of `OWN_PATHS` (one set lookup);
everything else is forwarded by the pure ASGI code in `app.py`, and nothing here runs while
nobody asks. The key check happens before dispatch, in `app.py`: `PAGE_PATHS` (the page and
its script and stylesheet, static files that hold no data) are open like `/healthz`; the
page reads its data from `/streams`, which follows the `/metrics` rule.

`/streams` answers with the streams in flight and the recent records, newest first. With
`?since=SEQ` (the `seq` of an earlier answer) only the records finished after that one are
listed (the page polls it that way), `?id=ID` (repeatable) lists only those records, and
`?timeline=1` adds each listed record's `event_offsets_ms` (the page asks for one record's when
it is opened: a timeline costs ~1 µs per token event to encode). Its `reprefill_lost_s` sums
the recent records' prefill seconds lost per re-prefill cause. `/sessions` groups the recent
records by conversation (`proxy/sessions.py`; `?limit=N`, default 50), each with its client and
the fix for what it lost, and lists the side requests (titles, token counts, probes) apart.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import orjson
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.routing import Route

from mlxproxy import __version__
from mlxproxy.asgi import Receive, Scope, Send
from mlxproxy.core.detect import Thresholds
from mlxproxy.core.meter import Snapshot
from mlxproxy.core.record import Record
from mlxproxy.errors import error_body
from mlxproxy.proxy.reach import has_reach, refresh
from mlxproxy.proxy.sessions import lost_by_cause, sessions, side_requests

__all__ = ["OWN_PATHS", "PAGE_PATHS", "DATA_PATHS", "own_routes", "live_view"]

log = logging.getLogger("mlxproxy")


class UpstreamView(Protocol):
    """What `/healthz` shows of an upstream (`proxy.upstream.Upstream`; with a `reach`, its
    reachability too: `proxy.reach.has_reach`)."""

    @property
    def name(self) -> str: ...
    @property
    def base(self) -> str: ...
    @property
    def in_flight(self) -> int: ...


class Upstreams(Protocol):
    @property
    def upstreams(self) -> Sequence[UpstreamView]: ...


class InFlight(Protocol):
    """The requests being forwarded (`proxy.inflight.InFlight`)."""

    def __len__(self) -> int: ...

    def snapshots(self, now: float) -> list[Snapshot]: ...


class Ring(Protocol):
    @property
    def total(self) -> int: ...
    @property
    def records(self) -> Sequence[Record]: ...


class ProxyState(Protocol):
    """What the own routes read of the proxy (`ProxyApp` has it), without importing it."""

    # (read-only properties: the routes only read them, and a `ProxyApp` holds narrower types)
    @property
    def registry(self) -> CollectorRegistry: ...
    @property
    def started_mono(self) -> float: ...
    @property
    def in_flight(self) -> InFlight: ...
    @property
    def requests_seen(self) -> int: ...
    @property
    def pool(self) -> Upstreams: ...
    @property
    def recent(self) -> Ring: ...
    @property
    def thresholds(self) -> Thresholds: ...


WEB_DIR = Path(__file__).parent / "web"
PAGE_FILES = {"/": "index.html", "/ui/app.js": "app.js", "/ui/app.css": "app.css", "/ui/LICENSE": "LICENSE"}
PAGE_PATHS = frozenset(PAGE_FILES)
DATA_PATHS = frozenset({"/metrics", "/streams", "/sessions"})
OWN_PATHS = PAGE_PATHS | DATA_PATHS | {"/healthz"}
MEDIA_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    "": "text/plain; charset=utf-8",
}
# the page loads nothing from anywhere else and may not be framed
PAGE_HEADERS = {
    "content-security-policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'; "
    "base-uri 'none'; form-action 'none'",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-cache",
}


def _json(body: object, status: int = 200) -> Response:
    return Response(orjson.dumps(body), status_code=status, media_type="application/json")


def _error(
    status: int, message: str, code: str, headers: dict[str, str] | None = None, err_type: str = "invalid_request_error"
) -> Response:
    body = error_body(message, code, err_type)
    return Response(body, status_code=status, media_type="application/json", headers=headers)


def _flag(request: Request, name: str) -> bool:
    value = request.query_params.get(name, "0").lower()
    if value not in ("0", "1", "true", "false"):
        raise HTTPException(400, f"query parameter {name!r} must be 0 or 1, got {value[:40]!r}")
    return value in ("1", "true")


def own_routes(proxy: ProxyState) -> _Quiet:
    """The Starlette app that answers `OWN_PATHS` for `proxy`."""

    async def page_file(request: Request) -> Response:
        name = PAGE_FILES[request.url.path]
        path = WEB_DIR / name
        return FileResponse(path, media_type=MEDIA_TYPES[path.suffix], headers=PAGE_HEADERS)

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(proxy.registry), media_type=CONTENT_TYPE_LATEST)

    async def healthz(request: Request) -> Response:
        body: dict[str, object] = {
            "status": "ok",
            "version": __version__,
            "uptime_s": round(time.perf_counter() - proxy.started_mono, 3),
            "in_flight": len(proxy.in_flight),
            "requests": proxy.requests_seen,
            "tasks": len(asyncio.all_tasks()),
        }
        loop_lag = getattr(proxy, "loop_lag", None)  # the proxy's event-loop lag monitor, where it has one
        if loop_lag is not None:
            body["event_loop_lag_max_s"] = round(loop_lag.max_lag_s, 6)
        views: list[dict[str, object]] = [
            {"name": u.name, "url": u.base, "in_flight": u.in_flight} for u in proxy.pool.upstreams
        ]
        body["upstreams"] = views
        await upstream_reach(proxy.pool.upstreams, views)
        if any(view.get("reachable") is False for view in views):
            body["status"] = "degraded"  # the proxy runs, an upstream cannot be reached (still HTTP 200)
        return _json(body)

    async def streams(request: Request) -> Response:
        since_arg = request.query_params.get("since")
        timeline = _flag(request, "timeline")
        ring = proxy.recent
        records = list(ring.records)
        if since_arg is not None:
            try:
                since = int(since_arg)
            except ValueError:
                since = -1
            if since < 0:
                raise HTTPException(400, f"query parameter 'since' must be a whole number >= 0, got {since_arg[:40]!r}")
            # since > total: the proxy restarted since that answer, so everything it holds is new
            new = ring.total - since if since <= ring.total else len(records)
            records = records[len(records) - min(new, len(records)) :] if new > 0 else []
        ids = request.query_params.getlist("id")
        if ids:
            records = [r for r in records if r.id in ids]
        t = time.perf_counter()
        return _json(
            {
                "now": time.time(),
                "seq": ring.total,
                "in_flight": [live_view(s) for s in proxy.in_flight.snapshots(t)],
                "recent": [_record(r, timeline) for r in reversed(records)],
                "stall_rule": {"factor": proxy.thresholds.stall_factor, "min_s": proxy.thresholds.stall_min_s},
                "reprefill_lost_s": lost_by_cause(ring.records),
            }
        )

    async def conversations(request: Request) -> Response:
        arg = request.query_params.get("limit", "50")
        if not arg.isdigit() or int(arg) < 1:
            raise HTTPException(400, f"query parameter 'limit' must be a whole number >= 1, got {arg[:40]!r}")
        records = list(proxy.recent.records)
        return _json(
            {
                "now": time.time(),
                "sessions": sessions(records, int(arg)),
                "side_requests": side_requests(records, int(arg)),
            }
        )

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        if exc.status_code == 405:
            return _error(405, f"{request.url.path} only answers GET", "method_not_allowed", {"allow": "GET, HEAD"})
        if exc.status_code == 404:
            return _error(404, f"no route {request.url.path}", "not_found")
        return _error(exc.status_code, str(exc.detail), "invalid_request")

    async def server_error(request: Request, exc: Exception) -> Response:
        message = f"the proxy failed to answer {request.url.path}: {type(exc).__name__}"
        return _error(500, message, "internal_error", err_type="proxy_error")

    routes = [Route(p, page_file, methods=["GET"]) for p in PAGE_FILES]
    routes += [
        Route("/metrics", metrics, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/streams", streams, methods=["GET"]),
        Route("/sessions", conversations, methods=["GET"]),
    ]
    return _Quiet(Starlette(routes=routes, exception_handlers={HTTPException: http_error, Exception: server_error}))


async def upstream_reach(upstreams: Sequence[UpstreamView], views: list[dict[str, object]]) -> None:
    """Each upstream's `reachable`, `last_error` and `last_error_at` (proxy/reach.py) added to
    its `/healthz` entry, probed again when the last evidence is a few seconds old."""
    await refresh([u for u in upstreams if has_reach(u)])
    for u, view in zip(upstreams, views):
        if has_reach(u):
            view.update(u.reach.view())


class _Quiet:
    """Starlette re-raises a handler's exception after its 500 went out (for the server to log
    a traceback); the client has its answer by then, so one log line is enough."""

    def __init__(self, app: Starlette) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.app(scope, receive, send)
        except Exception as exc:
            log.error("the proxy's own route %s failed: %s: %s", scope.get("path"), type(exc).__name__, exc)


def _record(record: Record, timeline: bool) -> dict[str, object]:
    d = record.to_dict(timeline=timeline)
    d.pop("response_text", None)  # no prompt or completion text leaves through /streams
    d.pop("reasoning_text", None)
    return d


def live_view(s: Snapshot) -> dict[str, object]:
    """`/streams`' view of a request in flight (`RequestMeter.snapshot`: its figures so far, no text)."""
    return {
        "id": s.id,
        "upstream": s.upstream,
        "model": s.model,
        "endpoint": s.endpoint,
        "stream": s.stream,
        "status": s.status,
        "age_s": round(s.age_s, 3),
        "ttft_s": None if s.ttft_s is None else round(s.ttft_s, 4),
        "tokens_so_far": s.tokens_so_far,
        "tokens_per_s": None if s.tokens_per_s is None else round(s.tokens_per_s, 2),
        "idle_s": round(s.idle_s, 3),
        "prefill_progress": list(s.prefill_progress) if s.prefill_progress else None,
        "concurrency": s.concurrency,
    }
