"""The proxy: a pure ASGI app that forwards every byte and meters a copy.

Forward first, measure second: each upstream read is written to the client as soon as it
arrives, then fed to the request's meter. The record is finalised in `finally`, so a
client disconnect, an upstream failure or a cancelled task still yields exactly one record.

Routes: `/` (the live page and its files under `/ui/`), `/metrics`, `/healthz`, `/streams`
are the proxy's own, answered by a Starlette app (`routes.py`); every other path (the whole
OpenAI API under `/v1/`, and a server's own routes such as `/health`) is forwarded to the
upstream chosen by the request's `model`, whatever its method.

With `proxy_api_key_env` set, every request but `/healthz` and the page's static files (and,
with `metrics_need_key: false`, `/metrics` and `/streams`) must carry the key, or gets 401;
the key is removed before forwarding. What the proxy promises under faults and attacks: SECURITY.md.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from collections import deque
from collections.abc import Generator, Iterator, Sequence

from prometheus_client import CollectorRegistry

from mlxproxy.asgi import Message, Receive, Scope, Send
from mlxproxy.capture import Exchange
from mlxproxy.config import Config, proxy_api_key
from mlxproxy.core.analyze import finish_steps, run_steps
from mlxproxy.core.cachecheck import PrefixIndex
from mlxproxy.core.clients import classify
from mlxproxy.core.meter import RequestMeter
from mlxproxy.core.openai import USAGE_INJECTABLE, inject_include_usage, parse_request
from mlxproxy.core.record import Record
from mlxproxy.edge.limits import MAX_FIELD_CHARS, HeadLimits, bounded_field, origin_form
from mlxproxy.errors import UpstreamError, error_body
from mlxproxy.headers import (
    CLIENT_KEY_HEADERS,
    REPLAY_HEADER_B,
    REQUEST_DROP,
    REQUEST_ID_HEADER,
    upstream_request_headers,
)
from mlxproxy.proxy.auth import KeyCheck, Scrubber
from mlxproxy.proxy.capture_writer import CaptureWriter
from mlxproxy.proxy.finisher import Finisher
from mlxproxy.proxy.inflight import InFlight
from mlxproxy.proxy.looplag import LoopLagMonitor
from mlxproxy.proxy.metrics import ProxyMetrics
from mlxproxy.proxy.observers import Fanout, LogObserver, Observer, RecentRecords
from mlxproxy.proxy.relay import AbortClient, Flow, Outbound, relay, respond, watch_disconnect
from mlxproxy.proxy.routes import OWN_PATHS, PAGE_PATHS, own_routes
from mlxproxy.proxy.tokens import TokenCounter
from mlxproxy.proxy.upstream import UpstreamPool, UpstreamResponse

__all__ = ["ProxyApp", "create_app", "REQUEST_ID_HEADER", "REPLAY_HEADER"]

log = logging.getLogger("mlxproxy")

REPLAY_HEADER = REPLAY_HEADER_B  # the name as the proxy reads it (headers.py spells it)
OWN_ROUTES = OWN_PATHS  # answered by routes.py, never forwarded
OFF_LOOP_EVENTS = 20_000  # a stream with more generated events has its record finished off the event loop

now = time.perf_counter

BAD_TARGET = error_body(
    "the request target must be a path starting with '/' (origin-form)",
    "invalid_request_target",
    "invalid_request_error",
)
INTERNAL_ERROR = error_body("the proxy failed on this request (a bug; the log has details)", "internal_error")
RID_SCOPE_KEY = "mlxproxy.request_id"  # set in the scope once a request has a record

UNAUTHORIZED = error_body(
    "missing or wrong API key for this proxy: send it as 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
    "invalid_api_key",
    "invalid_request_error",
)


class ProxyApp:
    """The ASGI application. `observers` receive every finished record after the
    built-in ones (metrics, recent records, log line)."""

    def __init__(
        self, config: Config, *, registry: CollectorRegistry | None = None, observers: list[Observer] | None = None
    ) -> None:
        """Raises `ConfigError` when `proxy_api_key_env` names an unset variable."""
        self.config = config
        self.head_limits = HeadLimits(
            config.max_request_header_bytes, config.max_request_headers, config.request_header_timeout_s
        )  # applied by the server (runner.py)
        key = proxy_api_key(config)
        self._authorized = KeyCheck(key) if key is not None else None
        self._open_routes = frozenset(PAGE_PATHS | {"/healthz"} if config.metrics_need_key else OWN_ROUTES)
        self._drop_request_headers = (REQUEST_DROP | CLIENT_KEY_HEADERS) if key is not None else REQUEST_DROP
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = ProxyMetrics(self.registry, max_model_labels=config.max_model_labels)
        self.loop_lag = LoopLagMonitor(self.registry)
        self.finisher: Finisher[Flow] = Finisher()
        self.pool = UpstreamPool(config)
        self._scrub = Scrubber(
            tuple(s for u in self.pool for s in u.secrets) + ((key.decode("latin-1"),) if key else ()),
            config.redact_headers,
        )
        self.recent = RecentRecords(config.recent_records)
        base: list[Observer] = [self.metrics, self.recent]
        if config.log_requests:
            base.append(LogObserver())
        self.fanout = Fanout(
            base + list(observers or []), on_error=lambda name: self.metrics.observer_errors.labels(name).inc()
        )
        self.in_flight = InFlight(self.metrics)  # what is being forwarded: /streams, /healthz, the gauge
        self.thresholds = config.detectors
        self._recent_by_upstream: dict[str, deque[Record]] = {u.name: deque(maxlen=64) for u in self.pool.upstreams}
        self.prefixes = {u.name: PrefixIndex() for u in self.pool.upstreams}  # prompt fingerprints, no text
        self.tokens = TokenCounter(config.tokenizer, config.tokenizer_search)
        self.capture: CaptureWriter | None = None
        if config.capture:
            self.capture = CaptureWriter(
                config.capture,
                keep_responses=config.capture_responses,
                keep_prompts=config.capture_prompts,
                redact=config.redact_headers,
                queue_size=config.capture_queue_size,
                queue_bytes=config.capture_queue_bytes,
                on_drop=self.metrics.capture_dropped.inc,
                on_error=self.metrics.capture_errors.inc,
            )
            self.fanout.add(self.capture)
        _quiet_client_aborts()
        self.started_mono = now()
        self.requests_seen = 0
        self._own_routes = own_routes(self)

    def add_observer(self, observer: Observer) -> None:
        self.fanout.add(observer)

    # -- ASGI entry -------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            if scope["type"] == "lifespan":
                await self._lifespan(receive, send)
            return
        try:  # (no helper coroutine here: each layer runs again on every resumption of a request)
            path = scope["path"]
            if not origin_form(scope.get("raw_path") or path.encode("latin-1", "replace")):
                await respond(send, 400, BAD_TARGET)  # checked first: never forwarded, whatever the key
            elif (
                self._authorized is not None
                and path not in self._open_routes
                and not self._authorized(scope["headers"])
            ):
                await respond(send, 401, UNAUTHORIZED, extra=[(b"www-authenticate", b'Bearer realm="mlxproxy"')])
            elif path in OWN_ROUTES:
                await self._own_routes(scope, receive, send)
            else:
                await self._proxy(scope, receive, send)
        except (AbortClient, asyncio.CancelledError):
            raise
        except Exception as exc:  # a bug: answer in the promised shape, log one line
            log.error(
                "internal error on a %s request: %s",
                bounded_field(str(scope.get("method"))),
                bounded_field(f"{type(exc).__name__}: {exc}"),
                exc_info=log.isEnabledFor(logging.DEBUG),
            )
            rid = scope.get(RID_SCOPE_KEY)
            try:
                await respond(send, 500, INTERNAL_ERROR, extra=[(REQUEST_ID_HEADER, rid.encode())] if rid else None)
            except Exception:  # the response had started: let the server drop the connection
                raise exc from None

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                self.loop_lag.start()
                self.finisher.start()
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                self.loop_lag.stop()
                self.finisher.stop()  # finishes what is queued: every record reaches the capture
                await self.pool.aclose()
                self.fanout.close()  # every observer, the capture too: what is queued is written
                await send({"type": "lifespan.shutdown.complete"})
                return

    # -- forwarding -------------------------------------------------------------------

    async def _proxy(self, scope: Scope, receive: Receive, send: Send) -> None:
        msg = await receive()
        body = msg.get("body", b"")
        if (
            msg.get("more_body", False)
            or msg["type"] != "http.request"
            or len(body) > self.config.max_request_body_bytes
        ):
            body = await self._read_body(msg, receive, send)  # the body comes in parts (or is too large)
            if body is None:
                return
        flow, outbound = self._start(scope, body)
        self.requests_seen += 1
        try:
            await self._forward(flow, outbound, receive, send)
        finally:
            self.in_flight.leave(flow)  # (already, unless forwarding failed before its own `finally`)

    async def _read_body(self, msg: Message, receive: Receive, send: Send) -> bytes | None:
        """The whole request body from its first message `msg` on, or None when the client left
        or the body is too large (answered 413)."""
        chunks: list[bytes] = []
        size = 0
        limit = self.config.max_request_body_bytes
        while True:
            if msg["type"] == "http.disconnect":
                return None
            part = msg.get("body", b"")
            if part:
                size += len(part)
                if size > limit:
                    body = error_body(
                        f"request body is larger than max_request_body_bytes ({limit} bytes)",
                        "request_too_large",
                        "invalid_request_error",
                    )
                    await respond(send, 413, body)
                    return None
                chunks.append(part)
            if not msg.get("more_body", False):
                return b"".join(chunks)
            msg = await receive()

    def _start(self, scope: Scope, body: bytes) -> tuple[Flow, Outbound]:
        """Route a request, have its upstream admit it (its `concurrency`), give it a record id
        and a meter, and enter it in the requests in flight."""
        t_start = now()
        started_at = time.time()
        method = scope["method"]
        info, obj = parse_request(method, scope["path"], body)
        upstream = self.pool.route(info.model)
        if info.model is not None and (len(info.model) > MAX_FIELD_CHARS or not info.model.isprintable()):
            info = dataclasses.replace(info, model=bounded_field(info.model))  # labels, records, logs: bounded
        url = upstream.url_for(
            scope.get("raw_path", scope["path"].encode()).decode("latin-1").split("?", 1)[0],
            scope.get("query_string", b""),
        )
        headers, replay = upstream_request_headers(scope["headers"], self._drop_request_headers, upstream.auth_header)
        inject = (
            self.config.inject_usage
            and info.stream
            and not info.usage_requested
            and obj is not None
            and info.endpoint in USAGE_INJECTABLE
        )
        exchange = Exchange(body, scope["headers"]) if self.capture is not None else None
        if inject and obj is not None:  # (`inject` implies the parsed object; said again for the type)
            body = inject_include_usage(body, obj)
        request_id = os.urandom(8).hex()
        scope[RID_SCOPE_KEY] = request_id
        # `concurrency` is what the server saw: requests to this upstream whose response is
        # still being forwarded (a request leaves the count in `InFlight.leave`)
        concurrency = upstream.admit()
        meter = RequestMeter(
            info,
            request_id=request_id,
            upstream=upstream.name,
            t_start=t_start,
            started_at=started_at,
            usage_injected=inject,
            concurrency=concurrency,
            tags=("replay",) if replay else (),
            keep_text=self.config.capture_responses,
        )
        flow = Flow(upstream, meter, scope["headers"], exchange)
        self.in_flight.enter(flow, self.metrics.model_label(info.model))
        return flow, Outbound(method, url, headers, body, inject)

    async def _forward(self, flow: Flow, outbound: Outbound, receive: Receive, send: Send) -> None:
        """Open the upstream request and relay its response; whatever happens, the record is finished."""
        watcher = asyncio.ensure_future(watch_disconnect(receive, flow, asyncio.current_task()))
        meter = flow.meter
        response: UpstreamResponse | None = None
        try:
            t_sent = now()
            meter.upstream_sent(t_sent)
            flow.request_overhead = t_sent - meter.t_start
            try:
                response = await flow.upstream.open(outbound.method, outbound.url, outbound.headers, outbound.body)
            except UpstreamError as exc:
                await self._open_failed(flow, exc, send)
                return
            meter.response_started(now(), response.status_code, response.content_type)
            if flow.exchange is not None:
                flow.exchange.response_headers.extend(response.raw_headers)
            await relay(flow, response, send, outbound.strip_usage)
        except asyncio.CancelledError:
            if not flow.disconnected:
                raise
            # a client that leaves after [DONE] (the OpenAI SDK stops reading there) got the whole
            # stream, and one that leaves after an in-stream error event (the SDK raises there) got
            # the server's last word: classify both by what the server sent
            if not meter.done and not meter.stream_error:
                flow.end("client_disconnect", "the client disconnected")
        finally:
            t_end = now()  # the last byte has been forwarded (or the request failed): duration_s ends here
            self.in_flight.leave(flow)
            flow.finished = True
            watcher.cancel()
            if response is not None:
                _close_quietly(response)
            long = meter.generated_events > OFF_LOOP_EVENTS
            self.finisher.submit(self._complete_off_loop if long else self._complete, flow, t_end)

    async def _open_failed(self, flow: Flow, exc: UpstreamError, send: Send) -> None:
        """No response from the upstream: the client gets the error (unless it had left)."""
        if flow.disconnected:  # the client left first; the cancellation surfaced as an error
            flow.end("client_disconnect", "the client disconnected")
            return
        message = self._scrub(str(exc), flow.client_headers)
        flow.end(exc.outcome, message)
        flow.finished = True
        await respond(
            send, exc.status, error_body(message, exc.code), extra=[(REQUEST_ID_HEADER, flow.meter.request_id.encode())]
        )

    def _complete(self, flow: Flow, t_end: float) -> Iterator[None]:
        """Finish, check and hand out one request's record (run by the finisher, a step per
        loop turn)."""
        record = yield from self._record(flow, t_end, self._recent_by_upstream[flow.upstream.name])
        yield
        self._recent_by_upstream[record.upstream].append(record)
        self.metrics.observe_overhead(flow.request_overhead, flow.chunk_overheads)
        self.fanout.emit(record, flow.exchange)

    def _complete_off_loop(self, flow: Flow, t_end: float) -> None:
        """`_complete` for a very long stream: its record is finished in a worker thread (its
        checks and histogram observations grow with its events, 0.5 s and more at 10^6, and
        on the event loop they would stall every other stream). The other observers get it
        on the loop."""
        loop = asyncio.get_running_loop()
        earlier = list(self._recent_by_upstream[flow.upstream.name])

        def work() -> Record:
            record = run_steps(self._record(flow, t_end, earlier))
            try:
                self.metrics.on_record(record)
            except Exception:  # as Fanout does for every observer
                log.exception("observer metrics failed on record %s", record.id)
                self.metrics.observer_errors.labels("metrics").inc()
            return record

        def done(fut: asyncio.Future[Record]) -> None:
            record = fut.result()
            self._recent_by_upstream[record.upstream].append(record)
            self.metrics.observe_overhead(flow.request_overhead, flow.chunk_overheads)
            self.fanout.emit(record, flow.exchange, skip=self.metrics)

        loop.run_in_executor(None, work).add_done_callback(done)

    def _record(self, flow: Flow, t_end: float, earlier: Sequence[Record]) -> Generator[None, None, Record]:
        """The request's checked record, its error text scrubbed of secrets (in steps:
        `finish_steps`)."""
        meter = flow.meter
        count_tokens = self.tokens.for_model(meter.request.model) if meter.sse else None
        try:
            info = meter.request
            client = classify(flow.client_headers, info.method, info.path, info.prompt_obj)
            return (
                yield from finish_steps(
                    meter,
                    t_end,
                    self.thresholds,
                    outcome=flow.outcome,
                    error=flow.error,
                    earlier=earlier,
                    prefixes=self.prefixes.get(flow.upstream.name),
                    count_tokens=count_tokens,
                    scrub=lambda text: self._scrub(text, flow.client_headers),
                    client=client,
                )
            )
        except Exception as exc:  # metering must never take the request down: a bare record says why
            log.exception("metering failed for %s", meter.request_id)
            info = meter.request
            return Record(
                id=meter.request_id,
                started_at=meter.started_at,
                upstream=meter.upstream,
                model=info.model,
                endpoint=info.endpoint,
                stream=info.stream,
                status=None,
                outcome="protocol_error",
                method=info.method,
                path=info.path,
                duration_s=t_end - meter.t_start,
                e2e_s=t_end - meter.t_start,
                usage_requested=info.usage_requested,
                max_tokens=info.max_tokens,
                error=f"metering failed: {type(exc).__name__}",
                t_start_mono=meter.t_start,
            )


class _DropAbortTracebacks(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, AbortClient)


def _quiet_client_aborts() -> None:
    """An intentional abort is not a server error: keep uvicorn from logging a traceback."""
    logger = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, _DropAbortTracebacks) for f in logger.filters):
        logger.addFilter(_DropAbortTracebacks())


def _close_quietly(response: UpstreamResponse) -> None:
    try:
        response.close()
    except Exception:  # closing a broken upstream connection may fail; nothing to do
        pass


def create_app(
    config: Config, *, registry: CollectorRegistry | None = None, observers: list[Observer] | None = None
) -> ProxyApp:
    """The proxy ASGI app for `config` (see `ProxyApp` for keyword arguments)."""
    return ProxyApp(config, registry=registry, observers=observers)
