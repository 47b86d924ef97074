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
from typing import Any

import orjson
from prometheus_client import CollectorRegistry

from mlxproxy.capture import CaptureWriter, Exchange
from mlxproxy.config import Config, proxy_api_key
from mlxproxy.core.analyze import finish_checked
from mlxproxy.core.meter import RequestMeter
from mlxproxy.core.openai import inject_include_usage, parse_request
from mlxproxy.core.prefix import PrefixIndex
from mlxproxy.core.record import Record
from mlxproxy.core.strip import UsageStripper
from mlxproxy.errors import UpstreamBodyError, UpstreamBodyTimeout, UpstreamError
from mlxproxy.proxy.auth import CLIENT_KEY_HEADERS, KeyCheck, Scrubber
from mlxproxy.proxy.finisher import Finisher
from mlxproxy.proxy.looplag import LoopLagMonitor
from mlxproxy.proxy.limits import MAX_FIELD_CHARS, HeadLimits, bounded_field, origin_form
from mlxproxy.proxy.metrics import ProxyMetrics
from mlxproxy.proxy.observers import Fanout, LogObserver, Observer, RecentRecords
from mlxproxy.proxy.routes import OWN_PATHS, PAGE_PATHS, own_routes
from mlxproxy.proxy.upstream import Upstream, UpstreamPool, UpstreamResponse
from mlxproxy.tokens import TokenCounter

__all__ = ["ProxyApp", "create_app", "REQUEST_ID_HEADER", "REPLAY_HEADER"]

log = logging.getLogger("mlxproxy")

REQUEST_ID_HEADER = b"x-mlxproxy-request-id"
REPLAY_HEADER = b"x-mlxproxy-replay"  # set by `mlxproxy replay`/`bench`; tags the record, not forwarded
HOP_BY_HOP = frozenset(
    {b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te", b"trailer", b"trailers",
     b"transfer-encoding", b"upgrade", b"host", b"content-length", b"accept-encoding", REPLAY_HEADER}
)
RESPONSE_DROP = frozenset({b"connection", b"keep-alive", b"transfer-encoding", b"upgrade", b"proxy-authenticate", b"trailer"})
OWN_ROUTES = OWN_PATHS  # answered by routes.py, never forwarded
OFF_LOOP_EVENTS = 20_000  # a stream with more generated events has its record finished off the event loop

now = time.perf_counter


def json_error(status: int, message: str, code: str, err_type: str = "proxy_error") -> tuple[int, bytes]:
    """An OpenAI-shaped error body."""
    return status, orjson.dumps({"error": {"message": message, "type": err_type, "code": code, "param": None}})


BAD_TARGET = json_error(400, "the request target must be a path starting with '/' (origin-form)",
                        "invalid_request_target", "invalid_request_error")[1]
INTERNAL_ERROR = json_error(500, "the proxy failed on this request (a bug; the log has details)", "internal_error")[1]
RID_SCOPE_KEY = "mlxproxy.request_id"  # set in the scope once a request has a record

UNAUTHORIZED = json_error(401, "missing or wrong API key for this proxy: send it as 'Authorization: Bearer <key>' "
                               "or 'x-api-key: <key>'", "invalid_api_key", "invalid_request_error")[1]


class ProxyApp:
    """The ASGI application. `observers` receive every finished record after the
    built-in ones (metrics, recent records, log line)."""

    def __init__(self, config: Config, *, registry: CollectorRegistry | None = None,
                 observers: list[Observer] | None = None) -> None:
        """Raises `ConfigError` when `proxy_api_key_env` names an unset variable."""
        self.config = config
        self.head_limits = HeadLimits(config.max_request_header_bytes, config.max_request_headers,
                                      config.request_header_timeout_s)  # applied by the server (runner.py)
        key = proxy_api_key(config)
        self._authorized = KeyCheck(key) if key is not None else None
        self._open_routes = frozenset(PAGE_PATHS | {"/healthz"} if config.metrics_need_key else OWN_ROUTES)
        self._drop_request_headers = (HOP_BY_HOP | CLIENT_KEY_HEADERS) if key is not None else HOP_BY_HOP
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = ProxyMetrics(self.registry, max_model_labels=config.max_model_labels)
        self.loop_lag = LoopLagMonitor(self.registry)
        self.finisher = Finisher()
        self.pool = UpstreamPool(config)
        self._scrub = Scrubber(tuple(s for u in self.pool for s in u.secrets) + ((key.decode("latin-1"),) if key else ()),
                               config.redact_headers)
        self.recent = RecentRecords(config.recent_records)
        base: list[Observer] = [self.metrics, self.recent]
        if config.log_requests:
            base.append(LogObserver())
        self.fanout = Fanout(base + list(observers or []), on_error=lambda name: self.metrics.observer_errors.labels(name).inc())
        self.in_flight: dict[str, RequestMeter] = {}
        self.thresholds = config.detectors
        self._recent_by_upstream: dict[str, deque[Record]] = {u.name: deque(maxlen=64) for u in self.pool.upstreams}
        self.prefixes = {u.name: PrefixIndex() for u in self.pool.upstreams}  # prompt fingerprints, no text
        self.tokens = TokenCounter(config.tokenizer, config.tokenizer_search)
        self.capture: CaptureWriter | None = None
        if config.capture:
            self.capture = CaptureWriter(config.capture, keep_responses=config.capture_responses,
                                         keep_prompts=config.capture_prompts, redact=config.redact_headers,
                                         queue_size=config.capture_queue_size, queue_bytes=config.capture_queue_bytes,
                                         on_drop=self.metrics.capture_dropped.inc,
                                         on_error=self.metrics.capture_errors.inc)
            self.fanout.add(self.capture)
        _quiet_client_aborts()
        self.started_mono = now()
        self.requests_seen = 0
        self._own_routes = own_routes(self)

    def add_observer(self, observer: Observer) -> None:
        self.fanout.add(observer)

    # -- ASGI entry -------------------------------------------------------------------

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        kind = scope["type"]
        if kind == "http":
            try:
                await self._http(scope, receive, send)
            except (_AbortClient, asyncio.CancelledError):
                raise
            except Exception as exc:  # a bug: answer in the promised shape, log one line
                log.error("internal error on a %s request: %s", bounded_field(str(scope.get("method"))),
                          bounded_field(f"{type(exc).__name__}: {exc}"), exc_info=log.isEnabledFor(logging.DEBUG))
                rid = scope.get(RID_SCOPE_KEY)
                try:
                    await _respond(send, 500, INTERNAL_ERROR, extra=[(REQUEST_ID_HEADER, rid.encode())] if rid else None)
                except Exception:  # the response had started: let the server drop the connection
                    raise exc from None
        elif kind == "lifespan":
            await self._lifespan(receive, send)

    async def _http(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        path = scope["path"]
        if not origin_form(scope.get("raw_path") or path.encode("latin-1", "replace")):
            await _respond(send, 400, BAD_TARGET)  # checked first: never forwarded, whatever the key
            return
        if self._authorized is not None and path not in self._open_routes and not self._authorized(scope["headers"]):
            await _respond(send, 401, UNAUTHORIZED, extra=[(b"www-authenticate", b'Bearer realm="mlxproxy"')])
            return
        if path in OWN_ROUTES:
            await self._own_routes(scope, receive, send)
        else:
            await self._proxy(scope, receive, send)

    async def _lifespan(self, receive: Any, send: Any) -> None:
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
                if self.capture is not None:
                    self.capture.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    # -- forwarding -------------------------------------------------------------------

    async def _proxy(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        chunks: list[bytes] = []
        size = 0
        limit = self.config.max_request_body_bytes
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            part = msg.get("body", b"")
            if part:
                size += len(part)
                if size > limit:
                    status, body = json_error(413, f"request body is larger than max_request_body_bytes ({limit} bytes)",
                                              "request_too_large", "invalid_request_error")
                    await _respond(send, status, body)
                    return
                chunks.append(part)
            if not msg.get("more_body", False):
                break
        t_start = now()
        started_at = time.time()
        body = b"".join(chunks)
        method = scope["method"]
        info, obj = parse_request(method, scope["path"], body)
        upstream = self.pool.route(info.model)
        if info.model is not None and (len(info.model) > MAX_FIELD_CHARS or not info.model.isprintable()):
            info = dataclasses.replace(info, model=bounded_field(info.model))  # labels, records, logs: bounded

        headers: list[tuple[bytes, bytes]] = []
        tags: tuple[str, ...] = ()
        connection_tokens = set()
        drop = self._drop_request_headers  # hop-by-hop, and the client's key when the proxy has one
        for k, v in scope["headers"]:
            if k == b"connection":
                connection_tokens.update(x.strip().lower() for x in v.split(b","))
        for k, v in scope["headers"]:
            if k == REPLAY_HEADER:
                tags = ("replay",)
            if k in drop or k in connection_tokens:
                continue
            if upstream.auth_header is not None and k == b"authorization":
                continue
            headers.append((k, v))
        headers.append((b"accept-encoding", b"identity"))  # the meter reads the bytes it forwards
        if upstream.auth_header is not None:
            headers.append((b"authorization", upstream.auth_header))

        inject = (self.config.inject_usage and info.stream and not info.usage_requested and obj is not None
                  and info.endpoint in ("chat_completions", "completions"))
        exchange = Exchange(body, scope["headers"]) if self.capture is not None else None
        if inject:
            body = inject_include_usage(body, obj)  # type: ignore[arg-type]

        request_id = os.urandom(8).hex()
        scope[RID_SCOPE_KEY] = request_id
        # `concurrency` is what the server saw: requests to this upstream whose response is
        # still being forwarded. A request leaves the count the moment its last byte has been
        # forwarded (`release`), not when its record is done: a keep-alive client sends its
        # next request while the proxy is still finishing the previous record.
        upstream.in_flight += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                upstream.in_flight -= 1

        meter = RequestMeter(info, request_id=request_id, upstream=upstream.name, t_start=t_start, started_at=started_at,
                             usage_injected=inject, concurrency=upstream.in_flight, tags=tags,
                             keep_text=self.config.capture_responses)
        self.requests_seen += 1
        self.in_flight[request_id] = meter
        model_label = self.metrics.model_label(info.model)
        self.metrics.request_started(upstream.name, model_label)
        try:
            await self._forward(scope, receive, send, upstream, meter, method, headers, body, inject, exchange, release)
        finally:
            release()
            self.in_flight.pop(request_id, None)
            self.metrics.request_ended(upstream.name, model_label)

    async def _forward(self, scope: dict[str, Any], receive: Any, send: Any, upstream: Upstream, meter: RequestMeter,
                       method: str, headers: list[tuple[bytes, bytes]], body: bytes, inject: bool,
                       exchange: Exchange | None, release: Any) -> None:
        rid = meter.request_id.encode()
        url = upstream.url_for(scope.get("raw_path", scope["path"].encode()).decode("latin-1").split("?", 1)[0],
                               scope.get("query_string", b""))
        state = {"finished": False, "disconnected": False}
        task = asyncio.current_task()

        async def watch_disconnect() -> None:
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    break
            if not state["finished"]:
                state["disconnected"] = True
                # an HTTP client may absorb a cancellation (httpx did, while a connection
                # was being set up) or turn it into its own error: repeat it until the
                # forwarding has really stopped
                while task is not None and not state["finished"]:
                    task.cancel()
                    await asyncio.sleep(0.1)

        watcher = asyncio.ensure_future(watch_disconnect())
        outcome: str | None = None
        error: str | None = None
        response: UpstreamResponse | None = None
        chunk_overheads: list[float] = []
        request_overhead: float | None = None
        try:
            t_sent = now()
            meter.upstream_sent(t_sent)
            request_overhead = t_sent - meter.t_start
            try:
                response = await upstream.open(method, url, headers, body)
            except UpstreamError as exc:
                if state["disconnected"]:  # the client left first; the cancellation surfaced as an error
                    outcome, error = "client_disconnect", "the client disconnected"
                    return
                outcome, error = exc.outcome, self._scrub(str(exc), scope["headers"])
                status, err_body = json_error(exc.status, error, exc.code)
                state["finished"] = True
                await _respond(send, status, err_body, extra=[(REQUEST_ID_HEADER, rid)])
                return
            meter.response_started(now(), response.status_code, response.content_type)
            if exchange is not None:
                exchange.response_headers.extend(response.raw_headers)
            stripper = UsageStripper() if inject and meter.decoder is not None else None
            out_headers = [(k, v) for k, v in response.raw_headers if k.lower() not in RESPONSE_DROP]
            if stripper is not None:
                out_headers = [(k, v) for k, v in out_headers if k.lower() != b"content-length"]
            out_headers.append((REQUEST_ID_HEADER, rid))
            if meter.decoder is not None and not any(k.lower() == b"x-accel-buffering" for k, _ in out_headers):
                out_headers.append((b"x-accel-buffering", b"no"))
            await send({"type": "http.response.start", "status": response.status_code, "headers": out_headers})
            try:
                read = response.read
                if stripper is None:
                    while chunk := await read():
                        t = now()
                        await send({"type": "http.response.body", "body": chunk, "more_body": True})
                        chunk_overheads.append(now() - t)
                        try:
                            meter.feed(chunk, t)
                        except Exception as exc:  # a metering bug must never break the stream
                            outcome, error = _metering_failed(meter, exc)
                else:
                    decoder = meter.decoder
                    assert decoder is not None
                    while chunk := await read():
                        t = now()
                        if meter.done:
                            out = stripper.flush() + chunk
                            meter.feed(chunk, t)
                        else:
                            try:
                                items = decoder.feed(chunk)
                                out = stripper.process(chunk, items, decoder.safe_offset)
                            except Exception as exc:  # forward what is held and the rest unmetered
                                outcome, error = _metering_failed(meter, exc)
                                out = stripper.flush() + chunk
                            else:
                                try:
                                    meter.feed_decoded(len(chunk), items, t)
                                except Exception as exc:
                                    outcome, error = _metering_failed(meter, exc)
                        if out:
                            await send({"type": "http.response.body", "body": out, "more_body": True})
                        chunk_overheads.append(now() - t)
                    rest = stripper.flush()
                    if rest:
                        await send({"type": "http.response.body", "body": rest, "more_body": True})
            except UpstreamBodyTimeout as exc:
                outcome, error = "upstream_timeout", str(exc)
                raise _AbortClient() from None
            except UpstreamBodyError as exc:
                # the upstream broke the body (reset, truncated chunked encoding): the client
                # must see a broken body too, never a clean end that did not happen
                error = str(exc)
                raise _AbortClient() from None
            state["finished"] = True
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if state["disconnected"]:
                if not meter.done:  # a client that leaves after [DONE] (the OpenAI SDK stops reading
                    outcome = "client_disconnect"  # there) got the whole stream: classify it normally
                    error = "the client disconnected"
            else:
                raise
        finally:
            t_end = now()  # the last byte has been forwarded (or the request failed): duration_s ends here
            release()
            state["finished"] = True
            watcher.cancel()
            if response is not None:
                await _aclose_quietly(response)
            self.finisher.submit(self._complete, meter, t_end, outcome, error, scope["headers"], request_overhead,
                                 chunk_overheads, exchange)

    def _complete(self, meter: RequestMeter, t_end: float, outcome: str | None, error: str | None,
                  client_headers: list[tuple[bytes, bytes]], request_overhead: float | None,
                  chunk_overheads: list[float], exchange: Exchange | None) -> None:
        """Finish, check and hand out one request's record (run by the finisher)."""
        if meter.generated_events > OFF_LOOP_EVENTS:
            self._finish_off_loop(meter, t_end, outcome, error, client_headers, request_overhead, chunk_overheads,
                                  exchange)
            return
        record = self._finish(meter, t_end, outcome, error, self._recent_by_upstream[meter.upstream])
        if record.error is not None:
            record = record.evolve(error=self._scrub(record.error, client_headers))
        self._recent_by_upstream[record.upstream].append(record)
        self.metrics.observe_overhead(request_overhead, chunk_overheads)
        self.fanout.emit(record, exchange)

    def _finish_off_loop(self, meter: RequestMeter, t_end: float, outcome: str | None, error: str | None,
                         headers: list[tuple[bytes, bytes]], request_overhead: float | None,
                         chunk_overheads: list[float], exchange: Exchange | None) -> None:
        """Finish a very long stream's record in a worker thread: its checks and histogram
        observations grow with its events (0.5 s and more at 10^6), and on the event loop
        they would stall every other stream. The other observers get it on the loop."""
        loop = asyncio.get_running_loop()
        earlier = list(self._recent_by_upstream[meter.upstream])

        def work() -> Record:
            record = self._finish(meter, t_end, outcome, error, earlier)
            if record.error is not None:
                record = record.evolve(error=self._scrub(record.error, headers))
            try:
                self.metrics.on_record(record)
            except Exception:  # as Fanout does for every observer
                log.exception("observer metrics failed on record %s", record.id)
                self.metrics.observer_errors.labels("metrics").inc()
            return record

        def done(fut: asyncio.Future[Record]) -> None:
            record = fut.result()
            self._recent_by_upstream[record.upstream].append(record)
            self.metrics.observe_overhead(request_overhead, chunk_overheads)
            self.fanout.emit(record, exchange, skip=self.metrics)

        loop.run_in_executor(None, work).add_done_callback(done)

    def _finish(self, meter: RequestMeter, t_end: float, outcome: str | None, error: str | None,
                earlier: Any = ()) -> Record:
        try:
            return finish_checked(meter, t_end, self.thresholds, outcome=outcome, error=error,
                                  earlier=earlier, prefixes=self.prefixes.get(meter.upstream),
                                  count_tokens=self.tokens.for_model(meter.request.model) if meter.decoder is not None else None)
        except Exception as exc:  # metering must never take the request down
            log.exception("metering failed for %s", meter.request_id)
            return RequestMeter(meter.request, request_id=meter.request_id, upstream=meter.upstream,
                                t_start=meter.t_start, started_at=meter.started_at).finish(
                t_end, outcome="protocol_error", error=f"metering failed: {type(exc).__name__}")


def _metering_failed(meter: RequestMeter, exc: Exception) -> tuple[str, str]:
    """Stop metering a request whose meter raised (a bug); forwarding goes on unchanged.
    Returns the outcome and error for its record."""
    log.error("metering failed for %s; the stream is forwarded unmetered", meter.request_id, exc_info=exc)
    meter.done = True  # the meter parses nothing more; its body is still forwarded
    return "protocol_error", f"metering failed: {type(exc).__name__}"


class _AbortClient(Exception):
    """Raised after the response started to make the server drop the client connection
    (the only way ASGI offers); it mirrors an upstream that broke its body."""


class _DropAbortTracebacks(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, _AbortClient)


def _quiet_client_aborts() -> None:
    """An intentional abort is not a server error: keep uvicorn from logging a traceback."""
    logger = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, _DropAbortTracebacks) for f in logger.filters):
        logger.addFilter(_DropAbortTracebacks())


async def _aclose_quietly(response: UpstreamResponse) -> None:
    try:
        await asyncio.shield(response.aclose())
    except BaseException:  # closing a broken upstream connection may fail; nothing to do
        pass


async def _respond(send: Any, status: int, body: bytes, content_type: bytes = b"application/json",
                   extra: list[tuple[bytes, bytes]] | None = None) -> None:
    headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
    if extra:
        headers.extend(extra)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def create_app(config: Config, **kwargs: Any) -> ProxyApp:
    """The proxy ASGI app for `config` (see `ProxyApp` for keyword arguments)."""
    return ProxyApp(config, **kwargs)
