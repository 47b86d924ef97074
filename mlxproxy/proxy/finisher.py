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
from typing import Generic, TypeVar

__all__ = ["Finisher"]

log = logging.getLogger("mlxproxy")

T = TypeVar("T")
Work = Callable[[T, float], None]  # finishes one item (a request's flow) that ended at a time


class Finisher(Generic[T]):
    """A queue of finishing work drained one item per loop turn. Before `start()` and after
    `stop()` (or an app used without lifespan) work runs at once."""

    def __init__(self) -> None:
        self._queue: deque[tuple[Work[T], T, float]] = deque()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._scheduled = False

    @property
    def pending(self) -> int:
        return len(self._queue)

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()

    def submit(self, fn: Work[T], item: T, t: float) -> None:
        """Run `fn(item, t)` on a later loop turn (now, when the finisher is not started)."""
        if self._loop is None:
            _run_one(fn, item, t)
            return
        self._queue.append((fn, item, t))
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self._drain_one)

    def _drain_one(self) -> None:
        if self._queue:
            _run_one(*self._queue.popleft())
        if self._queue and self._loop is not None:
            self._loop.call_soon(self._drain_one)  # the next one after the loop has polled its sockets
        else:
            self._scheduled = False

    def stop(self) -> None:
        """Finish everything still queued, now; later work runs at once."""
        self._loop = None
        while self._queue:
            _run_one(*self._queue.popleft())


def _run_one(fn: Work[T], item: T, t: float) -> None:
    try:
        fn(item, t)
    except Exception:  # finishing must never take the loop down; the record is lost, say so
        log.exception("finishing a record failed")
