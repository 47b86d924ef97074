"""Finish records in steps, one step per event-loop turn, after the response has been forwarded.

Finishing a record (the truth checks, the prompt's fingerprints, the metrics, the log line,
the capture hand-off) costs a few hundred microseconds. A batching server ends its streams
together, so without care 16 of them are finished back to back while new requests sit unread
in the proxy's sockets, and their clocks start late. The `Finisher` queues that work and runs
it one step per turn of the event loop (a `call_soon` callback that schedules itself again
while work is left): a piece of work that is a generator (`core.analyze.finish_steps`) pauses
at each `yield`, so a request or a token that arrives meanwhile waits for one step of a few
tens of microseconds, not for a whole record. Items are finished in the order they were
submitted, each to its end before the next begins. Forwarding never waits for it: a
request's last byte is sent before its record is finished.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

__all__ = ["Finisher"]

log = logging.getLogger("mlxproxy")

T = TypeVar("T")
# finishes one item (a request's flow) that ended at a time: at once, or in the steps of the
# generator it returns
Work = Callable[[T, float], Iterator[None] | None]


class Finisher(Generic[T]):
    """A queue of finishing work drained one step per loop turn. Before `start()` and after
    `stop()` (or an app used without lifespan) work runs at once, all its steps."""

    def __init__(self) -> None:
        self._queue: deque[tuple[Work[T], T, float]] = deque()
        self._steps: Iterator[None] | None = None  # the item being finished, paused
        self._loop: asyncio.AbstractEventLoop | None = None
        self._scheduled = False

    @property
    def pending(self) -> int:
        """Items not finished yet (the one paused between its steps included)."""
        return len(self._queue) + (self._steps is not None)

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
        if self._steps is None and self._queue:
            self._steps = _begin(*self._queue.popleft())
        elif self._steps is not None:
            self._steps = _step(self._steps)
        if (self._steps is not None or self._queue) and self._loop is not None:
            self._loop.call_soon(self._drain_one)  # the next step after the loop has polled its sockets
        else:
            self._scheduled = False

    def stop(self) -> None:
        """Finish everything still queued, now; later work runs at once."""
        self._loop = None
        while self._steps is not None:
            self._steps = _step(self._steps)
        while self._queue:
            _run_one(*self._queue.popleft())


def _run_one(fn: Work[T], item: T, t: float) -> None:
    """`fn(item, t)`, all its steps."""
    steps = _begin(fn, item, t)
    while steps is not None:
        steps = _step(steps)


def _begin(fn: Work[T], item: T, t: float) -> Iterator[None] | None:
    """The first step of `fn(item, t)`; its remaining steps (None: it is done)."""
    try:
        steps = fn(item, t)
    except Exception:  # finishing must never take the loop down; the record is lost, say so
        log.exception("finishing a record failed")
        return None
    return None if steps is None else _step(steps)


def _step(steps: Iterator[None]) -> Iterator[None] | None:
    """One step of `steps`; the steps still left (None: done, or failed and logged)."""
    try:
        next(steps)
    except StopIteration:
        return None
    except Exception:  # as `_begin`
        log.exception("finishing a record failed")
        return None
    return steps
