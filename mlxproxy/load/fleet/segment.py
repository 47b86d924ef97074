"""One worker's part of a test (`Segment`: a shape and its load, the client to build, the shared
start) and its run in a worker process or a Dask task (`run_segment`), which sends back the raw
records (`SegmentResult`) or, when stopped, those it had finished.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mlxproxy.core.cachecheck import PrefixIndex
from mlxproxy.core.detect import Thresholds
from mlxproxy.core.record import Record
from mlxproxy.edge.runner import run_async
from mlxproxy.load.data.results import SessionTurn
from mlxproxy.load.run.client import MeasuringClient
from mlxproxy.load.run.shapes import Load, Shape

__all__ = [
    "REPORT_EVERY_S",
    "ClientSpec",
    "Measured",
    "Segment",
    "SegmentResult",
    "WorkersError",
    "run_segment",
    "warm",
]

#: seconds between a local worker's progress reports (its figures; never one per request)
REPORT_EVERY_S = 0.5


class WorkersError(RuntimeError):
    """The segments cannot run: the [cluster] extra is missing, no scheduler or no workers
    answer, a worker failed. Its message is one line for the command line."""


@dataclass(frozen=True, slots=True)
class ClientSpec:
    """What a worker needs to build its own measuring client like the parent's."""

    base_url: str
    name: str
    thresholds: Thresholds
    api_key: str | None
    timeout_s: float
    connect_timeout_s: float
    tag_replay: bool
    keep_text: bool
    prefixes: bool
    max_connections: int | None = None

    @classmethod
    def of(cls, c: MeasuringClient) -> ClientSpec:
        return cls(
            c.base_url, c.name, c.th, c.api_key, c.timeout_s, c.connect_timeout_s, c.tag_replay, c.keep_text,
            c.prefixes is not None, c.max_connections,
        )  # fmt: skip

    def client(self) -> MeasuringClient:
        c = MeasuringClient(
            self.base_url, name=self.name, thresholds=self.thresholds, api_key=self.api_key,
            timeout_s=self.timeout_s, connect_timeout_s=self.connect_timeout_s, tag_replay=self.tag_replay,
            keep_text=self.keep_text, max_connections=self.max_connections,
        )  # fmt: skip
        if self.prefixes:
            c.prefixes = PrefixIndex()
        return c


@dataclass(frozen=True, slots=True)
class Segment:
    """One worker's part of a test: `load` sent in `shape` (a part of the whole test's shape,
    `Shape.split`) from the schedule's 0, `start_at`."""

    index: int
    client: ClientSpec
    shape: Shape
    load: Load
    start_at: float = 0.0  # wall clock (time.time()) of the schedule's 0, the same in every segment


@dataclass(frozen=True, slots=True)
class SegmentResult:
    """What a worker sends back: its raw records (send times on its own monotonic clock, whose
    reading at the shared start is `start_mono`), lag samples, session keys, CPU and wall time."""

    index: int
    host: str
    pid: int
    records: tuple[Record, ...]
    start_mono: float
    lag_s: tuple[float, ...]
    lag_by_id: Mapping[str, float]
    source_ids: Mapping[str, str | None]
    where: Mapping[str, SessionTurn]
    session_s: tuple[float, ...]
    cpu_s: float
    wall_s: float


def run_segment(seg: Segment, start_at: float | None = None, stop_event: str | None = None) -> SegmentResult:
    """Run one segment on this process's stack event loop (in a worker process or a Dask task),
    from `start_at` when given (the segment itself was handed over earlier). `stop_event`: the
    name of a Dask `Event` (in a Dask task) whose setting stops the run; the result then holds
    the records finished before the stop."""
    seg = seg if start_at is None else dataclasses.replace(seg, start_at=start_at)
    if stop_event is None:
        return run_async(run_part(seg))
    from distributed import Event, get_client  # the optional [cluster] extra, there in a Dask task

    # the worker's client, got in the task's own thread (where Dask knows the task's worker)
    return run_async(run_until_event(seg, Event(stop_event, client=get_client())))


async def run_until_event(seg: Segment, event: Any) -> SegmentResult:
    """A Dask task's run of its segment, polling the Dask `Event` `event` every
    `REPORT_EVERY_S` (the parent sets it on Ctrl-C): once set, the run is cancelled and the
    result is the records finished so far."""
    measured = Measured()
    task = asyncio.ensure_future(run_part(seg, measured))
    try:
        while not task.done():
            await asyncio.wait([task], timeout=REPORT_EVERY_S)
            if not task.done() and await asyncio.to_thread(event.is_set):
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    return measured.partial(seg)
        return task.result()
    finally:
        task.cancel()


class Measured:
    """The records a segment's run has finished so far, as its shape counts them (the ramp's
    requests are not counted): each tick takes the client's newest record, since every shape
    counts a request right after `MeasuringClient.send` appended its record, with no await
    between. What a stopped worker sends back, and what its progress reports count."""

    def __init__(self) -> None:
        self.client: MeasuringClient | None = None
        self.records: list[Record] = []
        self.start_mono = 0.0
        self.cpu0 = 0.0

    def __call__(self) -> None:
        if self.client is not None:
            self.records.append(self.client.finished[-1])

    def figures(self) -> tuple[int, int, int]:
        """(finished, in flight, tokens received) for the parent's progress line."""
        c = self.client
        return (len(self.records), c.in_flight, c.tokens_received()) if c is not None else (0, 0, 0)

    def partial(self, seg: Segment) -> SegmentResult:
        """The records finished before the stop (the requests in flight are not records)."""
        return SegmentResult(
            seg.index, socket.gethostname(), os.getpid(), tuple(self.records), self.start_mono, (), {}, {}, {}, (),
            time.thread_time() - self.cpu0, time.perf_counter() - self.start_mono,
        )  # fmt: skip


async def run_part(seg: Segment, measured: Measured | None = None) -> SegmentResult:
    """The segment's shape sent from the shared start, its raw records and figures."""
    start_mono = time.perf_counter() + (seg.start_at - time.time())
    m = measured if measured is not None else Measured()
    async with seg.client.client() as client:
        cpu0 = time.thread_time()
        m.client, m.start_mono, m.cpu0 = client, start_mono, cpu0
        timed = await seg.shape.send(client, seg.load, m, start_mono)
        cpu_s, wall_s = time.thread_time() - cpu0, time.perf_counter() - start_mono
    return SegmentResult(
        seg.index, socket.gethostname(), os.getpid(), tuple(timed.records), start_mono, tuple(timed.lag_s),
        timed.lag_by_id, timed.source_ids, timed.where, tuple(timed.session_s), cpu_s, wall_s,
    )  # fmt: skip


def warm() -> int:
    """Run in every worker before the start is chosen, so that importing the package and the
    event loop's modules is not in the schedule."""
    run_async(asyncio.sleep(0))
    return os.getpid()
