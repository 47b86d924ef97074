"""Record observers: every finished request's record is handed to each of them.

A failing observer is logged and counted and never allowed to break forwarding or the
other observers (mitmproxy's `safecall`).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable
from typing import Protocol

from mlxproxy.capture import Exchange
from mlxproxy.core.record import Record
from mlxproxy.core.text import clip

__all__ = ["Observer", "Fanout", "RecentRecords", "LogObserver", "format_record_line"]

log = logging.getLogger("mlxproxy")


class Observer(Protocol):
    """What the proxy hands every finished request to (Prometheus, the `/streams` ring, the log
    line, the capture, and any passed to `create_app(observers=...)`).

    `on_record(record, exchange)` is called once per request, on the event loop, after its last
    byte was forwarded; `exchange` is the request as the client sent it (body and headers) when a
    capture is on, else None (only the capture uses it). It must not block: queue slow work.
    `close()` is called once at shutdown, after the last record (the capture writes what is
    queued and closes its file). An exception from either is logged and counted
    (`mlxproxy_observer_errors_total`), never passed on to forwarding or the other observers."""

    name: str

    def on_record(self, record: Record, exchange: Exchange | None = None) -> None: ...

    def close(self) -> None: ...


class Fanout:
    """Calls each observer in turn; `on_error(name)` is told about each failure."""

    def __init__(self, observers: Iterable[Observer], on_error: Callable[[str], None] | None = None) -> None:
        self.observers = list(observers)
        self.on_error = on_error
        self.errors = 0

    def add(self, observer: Observer) -> None:
        self.observers.append(observer)

    def emit(self, record: Record, exchange: Exchange | None = None, skip: object | None = None) -> None:
        """Hand `record` (and its exchange) to every observer but `skip` (one that already has it)."""
        for obs in self.observers:
            if obs is skip:
                continue
            try:
                obs.on_record(record, exchange)
            except Exception:  # an observer must never break forwarding
                self._failed(obs, f"on record {record.id}")

    def close(self) -> None:
        """Close every observer, in order, each whatever the others did."""
        for obs in self.observers:
            try:
                obs.close()
            except Exception:
                self._failed(obs, "closing")

    def _failed(self, obs: Observer, what: str) -> None:
        self.errors += 1
        name = getattr(obs, "name", type(obs).__name__)
        log.exception("observer %s failed %s", name, what)
        if self.on_error is not None:
            try:
                self.on_error(name)
            except Exception:  # pragma: no cover - counting must not fail either
                log.exception("counting an observer failure failed")


class RecentRecords:
    """The last N finished records, newest last (for `/streams`)."""

    name = "recent"

    def __init__(self, size: int) -> None:
        self.records: deque[Record] = deque(maxlen=max(size, 0))
        self.total = 0  # records ever seen

    def on_record(self, record: Record, exchange: Exchange | None = None) -> None:
        self.records.append(record)
        self.total += 1

    def close(self) -> None:
        pass


def _f(v: float | None, fmt: str, unit: str = "") -> str:
    return "-" if v is None else format(v, fmt) + unit


def format_record_line(r: Record) -> str:
    """One human line with the headline figures of a record."""
    toks = "-" if r.n_out is None else str(r.n_out)
    if r.completion_tokens_reported is not None and r.completion_tokens_counted is not None:
        toks = f"{r.completion_tokens_reported}/{r.completion_tokens_counted}"
    line = (
        f"{r.id} {r.upstream} {r.model or '-'} {r.endpoint} {'stream' if r.stream else 'once'} "
        f"{r.status if r.status is not None else '---'} {r.outcome} "
        f"ttft={_f(r.ttft_s, '.3f', 's')} e2e={_f(r.e2e_s, '.3f', 's')} "
        f"decode={_f(r.decode_tps, '.1f', 't/s')} wall={_f(r.wall_tps, '.1f', 't/s')} "
        f"tokens(rep/cnt)={toks} prompt={r.prompt_tokens if r.prompt_tokens is not None else '-'} conc={r.concurrency}"
    )
    if r.anomalies:
        line += " anomalies=" + ",".join(r.anomalies)
    if r.error:
        line += f" error={clip(r.error, 200)!r}"
    return line


class LogObserver:
    """One log line per finished request (never per chunk)."""

    name = "log"

    def __init__(self, logger: logging.Logger | None = None) -> None:
        self.logger = logger or log

    def on_record(self, record: Record, exchange: Exchange | None = None) -> None:
        if self.logger.isEnabledFor(logging.INFO):
            self.logger.info("%s", format_record_line(record))

    def close(self) -> None:
        pass
