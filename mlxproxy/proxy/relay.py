"""Relaying one upstream response to the client while its meter reads a copy.

`Flow` is one forwarded request's state: the flags its forwarding sets (finished, the
client disconnected) and what its record needs beyond the meter (outcome and error seen by
the shell, set only through `Flow.end`; the proxy's own overhead). `relay` sends the status line and then the body, each
read forwarded first and metered after, so the client never waits for the meter. For a stream
whose usage event the proxy injected, only the SSE framing of a read is decoded before it is
forwarded (`RequestMeter.strip`: the stripper must see whole events to cut that one out);
its JSON is metered after (`RequestMeter.feed_forwarded`).

A metering failure never breaks the stream: the meter stops (`RequestMeter.fail`) and the
bytes keep flowing; the record says `protocol_error`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import NamedTuple

from mlxproxy.asgi import Headers, Receive, Send
from mlxproxy.capture import Exchange
from mlxproxy.core.meter import RequestMeter
from mlxproxy.core.record import Outcome
from mlxproxy.core.strip import UsageStripper
from mlxproxy.errors import UpstreamBodyError, UpstreamBodyTimeout, error_body
from mlxproxy.headers import REQUEST_ID_HEADER, RESPONSE_DROP
from mlxproxy.proxy.upstream import Upstream, UpstreamResponse

__all__ = ["Flow", "Outbound", "AbortClient", "relay", "watch_disconnect", "respond", "error_body"]

log = logging.getLogger("mlxproxy")
now = time.perf_counter


async def respond(send: Send, status: int, body: bytes, extra: Headers | None = None) -> None:
    """A whole JSON answer of the proxy's own."""
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if extra:
        headers.extend(extra)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class Outbound(NamedTuple):
    """The request as it goes upstream (a tuple: built once per request, cheaply)."""

    method: str
    url: bytes  # the request target upstream (`Upstream.url_for`)
    headers: Headers
    body: bytes
    strip_usage: bool  # the proxy injected `include_usage`: the usage event is removed again


@dataclass(slots=True, eq=False)
class Flow:
    """One forwarded request: its meter, and what its forwarding observed for the record."""

    upstream: Upstream
    meter: RequestMeter
    client_headers: Headers
    exchange: Exchange | None
    finished: bool = False  # the response is complete (or answered by the proxy): a disconnect is no news
    disconnected: bool = False  # the client left while the response was being forwarded
    outcome: Outcome | None = None  # what the shell saw (`end`): a transport failure or a metering failure
    error: str | None = None
    request_overhead: float | None = None
    chunk_overheads: list[float] = field(default_factory=list)

    def end(self, outcome: Outcome | None, error: str) -> None:
        """The one transition of what the shell saw: `error` happened, with `outcome` (None:
        the meter classifies the response, e.g. a body the upstream broke). A later fact
        replaces an earlier one's error, and its outcome unless it has none."""
        if outcome is not None:
            self.outcome = outcome
        self.error = error

    def metering_failed(self) -> None:
        """The meter stopped on a bug: log it once; the record says `protocol_error`
        (unless the shell saw another outcome first)."""
        if self.outcome is not None:
            return
        exc = self.meter.failure
        log.error("metering failed for %s; the stream is forwarded unmetered", self.meter.request_id, exc_info=exc)
        self.end("protocol_error", f"metering failed: {type(exc).__name__}")


class AbortClient(Exception):
    """Raised after the response started to make the server drop the client connection
    (the only way ASGI offers); it mirrors an upstream that broke its body."""


async def watch_disconnect(receive: Receive, flow: Flow, task: asyncio.Task[object] | None) -> None:
    """Cancel the forwarding `task` when the client disconnects before the response is complete."""
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            break
    if not flow.finished:
        flow.disconnected = True
        # an HTTP client may absorb a cancellation (httpx did, while a connection was being
        # set up) or turn it into its own error: repeat it until the forwarding has really stopped
        while task is not None and not flow.finished:
            task.cancel()
            await asyncio.sleep(0.1)


async def relay(flow: Flow, response: UpstreamResponse, send: Send, strip_usage: bool) -> None:
    """Send `response` to the client, metering it: each read is forwarded first and metered
    after (the client never waits for the meter). A body the upstream broke (or stopped
    sending) breaks the client's body too (`AbortClient`), never a clean end that did not happen."""
    meter = flow.meter
    strip_usage = strip_usage and meter.sse
    headers = [(k, v) for k, v in response.raw_headers if k.lower() not in RESPONSE_DROP]
    if strip_usage:  # the body gets shorter
        headers = [(k, v) for k, v in headers if k.lower() != b"content-length"]
    headers.append((REQUEST_ID_HEADER, meter.request_id.encode()))
    if meter.sse and not any(k.lower() == b"x-accel-buffering" for k, _ in headers):
        headers.append((b"x-accel-buffering", b"no"))
    await send({"type": "http.response.start", "status": response.status_code, "headers": headers})
    # the connection's read itself, not `response.read`: one coroutine layer less per read; it
    # raises the project's body errors (`UpstreamBodyError`, `UpstreamBodyTimeout`) itself
    read, overheads = response.raw_read, flow.chunk_overheads
    stripper = UsageStripper() if strip_usage else None
    try:
        while True:
            chunk = await read()
            if not chunk:
                break
            t = now()
            # forward first, meter after: only the stripper's SSE framing (no JSON) comes first
            out, items = (chunk, None) if stripper is None else meter.strip(chunk, stripper)
            if out:
                await send({"type": "http.response.body", "body": out, "more_body": True})
            overheads.append(now() - t)
            # never raises: a failure stops the metering, not the bytes
            if meter.feed_forwarded(chunk, items, t):
                flow.metering_failed()
        if stripper is not None and (rest := stripper.flush()):
            await send({"type": "http.response.body", "body": rest, "more_body": True})
    except UpstreamBodyTimeout as exc:
        flow.end("upstream_timeout", str(exc))
        raise AbortClient() from None
    except UpstreamBodyError as exc:  # a reset, a truncated chunked encoding
        flow.end(None, str(exc))
        raise AbortClient() from None
    flow.finished = True
    await send({"type": "http.response.body", "body": b"", "more_body": False})
