"""Finish records one per event-loop turn, after the response has been forwarded.

Finishing a record (the truth checks, the metrics, the log line, the capture hand-off)
costs a few hundred microseconds. A batching server ends its streams together, so without
care 16 of them are finished back to back while new requests sit unread in the proxy's
sockets, and their clocks start late. The `Finisher` queues that work and runs one item per
turn of the event loop, so requests and tokens that arrive meanwhile are served in between.
Forwarding never waits for it: a request's last byte is sent before its record is finished.
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
    """A queue of finishing work run by one task. Before `start()` and after `stop()`
    (no running loop, or an app used without lifespan) work runs at once."""

    def __init__(self) -> None:
        self._queue: deque[tuple[Callable[..., None], tuple[Any, ...]]] = deque()
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def pending(self) -> int:
        return len(self._queue)

    def start(self) -> None:
        self._wake = asyncio.Event()
        self._task = asyncio.ensure_future(self._run())

    def submit(self, fn: Callable[..., None], *args: Any) -> None:
        if self._task is None or self._task.done() or self._wake is None:
            _run_one(fn, args)
            return
        self._queue.append((fn, args))
        self._wake.set()

    async def _run(self) -> None:
        assert self._wake is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                fn, args = self._queue.popleft()
                _run_one(fn, args)
                await asyncio.sleep(0)  # let the loop serve sockets between two records

    def stop(self) -> None:
        """Stop the task and finish everything still queued, now."""
        if self._task is not None:
            self._task.cancel()
            self._task = None
        while self._queue:
            fn, args = self._queue.popleft()
            _run_one(fn, args)


def _run_one(fn: Callable[..., None], args: tuple[Any, ...]) -> None:
    try:
        fn(*args)
    except Exception:  # finishing must never take the loop down; the record is lost, say so
        log.exception("finishing a record failed")
