"""The rig the proxy's fault tests share: a proxy in front of a scripted raw-socket upstream
(`fakeupstream.py`) with a gate, and small helpers to read what the client got."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator

import httpx
import orjson

from fakeupstream import Conn, FakeUpstream, Req
from mlxproxy.config import build_config
from mlxproxy.core.record import Record
from mlxproxy.edge.runner import ServerThread
from mlxproxy.proxy.app import ProxyApp, create_app
from support import read_fixture
from support import wait_for as _wait_for

OK_BODY = read_fixture("wire/01_openai_reference_include_usage.sse")
STREAM_REQ = {
    "model": "m",
    "stream": True,
    "messages": [{"role": "user", "content": "hi"}],
    "stream_options": {"include_usage": True},
}
SSE_CHUNKED = [("content-type", "text/event-stream"), ("transfer-encoding", "chunked")]
FINISH = b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'


# -- rig ------------------------------------------------------------------------------------


class Rig:
    """A proxy in front of one fake upstream whose behaviour is chosen per request by the
    request's `model`: `handlers[model]`. Model `healthy` is always a gated good stream (one
    event, wait for `gate`, the rest), so a test can keep a healthy stream in flight while a
    fault happens next to it."""

    def __init__(self, server: ServerThread, app: ProxyApp, upstream: FakeUpstream, gate: threading.Event) -> None:
        self.server = server
        self.url = server.url
        self.app = app
        self.upstream = upstream
        self.gate = gate

    def in_loop(self, fn):
        """Run `fn()` on the proxy's event loop thread and return its result."""

        async def call():
            return fn()

        assert self.server.loop is not None
        return asyncio.run_coroutine_threadsafe(call(), self.server.loop).result(10)

    def tasks(self) -> int:
        """Tasks alive on the proxy's event loop (uvicorn's own included)."""
        return self.in_loop(lambda: len(asyncio.all_tasks()))

    def busy_upstream_connections(self) -> int:
        """Upstream responses the proxy opened and has not closed yet (each holds a connection)."""
        return self.in_loop(lambda: sum(up.open_responses for up in self.app.pool.upstreams))

    def settled(self, tasks_before: int) -> bool:
        """Nothing of a finished request is left: no request in flight, no busy upstream
        connection, no task beyond the baseline."""
        return wait_for(
            lambda: not self.app.in_flight and self.busy_upstream_connections() == 0 and self.tasks() <= tasks_before
        )

    def records(self, n: int, timeout_s: float = 10.0) -> list[Record]:
        """The first `n` finished records, once there are that many."""
        assert wait_for(lambda: len(self.app.recent.records) >= n, timeout_s), (
            f"expected {n} records, have {len(self.app.recent.records)}"
        )
        return list(self.app.recent.records)[:n]

    def record(self, rid: str) -> Record:
        """The record of request `rid` (the `x-mlxproxy-request-id` header), once finished."""

        def find() -> Record | None:
            return next((r for r in list(self.app.recent.records) if r.id == rid), None)

        assert wait_for(lambda: find() is not None), f"no record for {rid}"
        rec = find()
        assert rec is not None
        return rec

    def only_record(self, model: str) -> Record:
        """The one finished record for `model` (a fault request has no request-id header
        when it broke before the response started... it always has one here)."""
        assert wait_for(lambda: any(r.model == model for r in self.app.recent.records)), f"no record for {model}"
        (rec,) = [r for r in self.app.recent.records if r.model == model]
        return rec

    @contextlib.contextmanager
    def healthy_stream_alongside(self) -> Iterator[None]:
        """A good stream in flight for the whole block; afterwards it must finish byte-exact and
        `ok`, and a fresh request must succeed too: the fault next to it took nothing down."""
        self.gate.clear()
        with (
            httpx.Client(timeout=30) as c,
            c.stream("POST", self.url + "/v1/chat/completions", json={**STREAM_REQ, "model": "healthy"}) as r,
        ):
            it = r.iter_raw()
            got = next(it)
            yield
            self.gate.set()
            got += b"".join(it)
            rid = r.headers["x-mlxproxy-request-id"]
        assert got == OK_BODY
        assert wait_for(lambda: any(x.id == rid and x.outcome == "ok" for x in self.app.recent.records))
        self.healthy_request()

    def healthy_request(self) -> None:
        r = httpx.post(self.url + "/v1/chat/completions", json={**STREAM_REQ, "model": "healthy-now"}, timeout=30)
        assert r.status_code == 200 and r.content == OK_BODY

    @contextlib.contextmanager
    def request_in_background(self, body: dict) -> Iterator:
        """POST `body` on a thread for the duration of the block; yields a function that
        returns its response (after the block)."""
        box: list = []
        th = threading.Thread(
            target=lambda: box.append(httpx.post(self.url + "/v1/chat/completions", json=body, timeout=30))
        )
        th.start()
        assert wait_for(lambda: len(self.app.in_flight) >= 1), "the background request never arrived"
        yield lambda: box[0]
        th.join(30)
        assert box, "the background request did not finish"


def wait_for(pred, timeout_s: float = 10.0) -> bool:
    return _wait_for(pred, timeout_s)


def ok_events(body: bytes) -> list[bytes]:
    return [e + b"\n\n" for e in body.split(b"\n\n") if e]


async def healthy_handler(req: Req, conn: Conn, gate: threading.Event | None) -> None:
    events = ok_events(OK_BODY)
    await conn.head(200, SSE_CHUNKED)
    await conn.chunk(events[0])
    if gate is not None:
        await conn.wait_gate(gate, 30)
    for e in events[1:]:
        await conn.chunk(e)
    await conn.end_chunked()


@contextlib.contextmanager
def rig(handlers: dict, *, extra_upstreams: list[dict] | None = None, **cfg) -> Iterator[Rig]:
    gate = threading.Event()

    async def dispatch(req: Req, conn: Conn) -> None:
        try:
            model = orjson.loads(req.body).get("model")
        except (orjson.JSONDecodeError, AttributeError):
            model = None
        if model == "healthy":
            await healthy_handler(req, conn, gate)
        elif model == "healthy-now":
            await healthy_handler(req, conn, None)
        else:
            await handlers[model if model in handlers else None](req, conn)

    with FakeUpstream(dispatch) as up:
        raw = {
            "upstreams": [*(extra_upstreams or []), {"name": "default", "url": up.url}],
            "default_upstream": "default",
        }
        config = build_config(raw, log_requests=False, **cfg)
        app = create_app(config)
        try:
            with ServerThread(app, server_header=False, date_header=False) as srv:
                yield Rig(srv, app, up, gate)
        finally:
            gate.set()
        assert not up.errors, up.errors


def read_all(url: str, body: dict, **kw) -> tuple[int, bytes, BaseException | None, httpx.Headers]:
    """POST and read the whole body; return the error instead of raising when the body breaks."""
    with (
        httpx.Client(timeout=kw.pop("timeout", 30)) as c,
        c.stream("POST", url + "/v1/chat/completions", json=body, **kw) as r,
    ):
        got = b""
        try:
            for part in r.iter_raw():
                got += part
        except httpx.HTTPError as exc:
            return r.status_code, got, exc, r.headers
        return r.status_code, got, None, r.headers
