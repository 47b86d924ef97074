"""Finish records one per event-loop turn, after the response has been forwarded.

Finishing a record (the truth checks, the metrics, the log line, the capture hand-off)
costs a few hundred microseconds. A batching server ends its streams together, so without
care 16 of them are finished back to back while new requests sit unread in the proxy's
sockets, and their clocks start late. The `Finisher` queues that work and runs one item per
turn of the event loop (a `call_soon` callback that schedules itself again while work is
left), so requests and tokens that arrive meanwhile are served in between. Forwarding never
waits for it: a request's last byte is sent before its record is finished.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from typing import Any

__all__ = ["Finisher"]

log = logging.getLogger("mlxproxy")


class Finisher:
    """A queue of finishing work drained one item per loop turn. Before `start()` and after
    `stop()` (or an app used without lifespan) work runs at once."""

    def __init__(self) -> None:
        self._queue: deque[tuple[Callable[..., None], tuple[Any, ...]]] = deque()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._scheduled = False

    @property
    def pending(self) -> int:
        return len(self._queue)

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()

    def submit(self, fn: Callable[..., None], *args: Any) -> None:
        if self._loop is None:
            _run_one(fn, args)
            return
        self._queue.append((fn, args))
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self._drain_one)

    def _drain_one(self) -> None:
        if self._queue:
            fn, args = self._queue.popleft()
            _run_one(fn, args)
        if self._queue and self._loop is not None:
            self._loop.call_soon(self._drain_one)  # the next one after the loop has polled its sockets
        else:
            self._scheduled = False

    def stop(self) -> None:
        """Finish everything still queued, now; later work runs at once."""
        self._loop = None
        while self._queue:
            fn, args = self._queue.popleft()
            _run_one(fn, args)


def _run_one(fn: Callable[..., None], args: tuple[Any, ...]) -> None:
    try:
        fn(*args)
    except Exception:  # finishing must never take the loop down; the record is lost, say so
        log.exception("finishing a record failed")
