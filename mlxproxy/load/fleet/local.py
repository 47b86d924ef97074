"""Local workers (`--workers N`): `multiprocessing` processes started with `spawn`, one segment
each over a pipe, all started at one instant; their progress figures read from the pipe, and a
Ctrl-C in the parent stops them, each sending back the records it had finished.
"""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from multiprocessing.context import SpawnProcess
from typing import Any

from mlxproxy.edge.runner import run_async
from mlxproxy.load.fleet.merge import FleetTimed
from mlxproxy.load.fleet.parts import STOP_WAIT_S, gather_parts
from mlxproxy.load.fleet.segment import (
    REPORT_EVERY_S,
    Measured,
    Segment,
    SegmentResult,
    WorkersError,
    run_part,
    warm,
)
from mlxproxy.load.run.client import MeasuringClient
from mlxproxy.load.run.shapes import Tick

__all__ = ["LOCAL_LEAD_S", "run_local"]

#: seconds between the workers being ready and the shared start (local processes, a cluster)
LOCAL_LEAD_S = 0.25


async def _run_stoppable(seg: Segment, conn: Connection) -> tuple[str, SegmentResult]:
    """A local worker's run of its segment: its figures reported to the parent every
    `REPORT_EVERY_S`, and a `stop` from the parent (Ctrl-C there), or the parent gone, cancels
    the run: ("done", the whole result) or ("stopped", the records finished before the stop)."""
    loop = asyncio.get_running_loop()
    measured = Measured()
    task = asyncio.ensure_future(run_part(seg, measured))

    def watch() -> None:  # the pipe's only reader from now on
        try:
            conn.recv()  # "stop"
        except (EOFError, OSError):
            pass  # the parent is gone: stop too
        try:
            loop.call_soon_threadsafe(task.cancel)
        except RuntimeError:  # the run is over, its loop closed
            pass

    async def report() -> None:
        while True:
            await asyncio.sleep(REPORT_EVERY_S)
            try:
                conn.send(("count", measured.figures()))
            except OSError:  # the parent is gone (the watcher stops the run)
                return

    threading.Thread(target=watch, name="mlxproxy-load-stop", daemon=True).start()
    reporter = asyncio.ensure_future(report())
    try:
        return "done", await task
    except asyncio.CancelledError:
        if not task.cancelled():
            raise
        return "stopped", measured.partial(seg)
    finally:
        reporter.cancel()


def _serve(conn: Connection) -> None:
    """A local worker process: its segment, ready once that and the imports are in, then the
    shared start, its result, exit. Ctrl-C is the parent's to handle: it sends `stop`, and the
    worker sends back what it has measured so far (`_run_stoppable`)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    warm()
    seg = conn.recv()
    conn.send(("ready", os.getpid()))
    start_at = conn.recv()
    try:
        conn.send(run_async(_run_stoppable(dataclasses.replace(seg, start_at=start_at), conn)))
    except BaseException as exc:  # a worker's failure is one line in the parent
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        conn.close()


class _Link:
    """The parent's end of one local worker (a `Part`): its process and pipe, which one thread
    reads (a read cancelled in the event loop would go on in its thread and swallow the next
    message), keeping the latest progress figures and handing every other message to the loop;
    after the start, its `answer`."""

    def __init__(self, proc: SpawnProcess, conn: Connection, index: int, loop: asyncio.AbstractEventLoop) -> None:
        self.proc, self.conn, self.index, self.loop = proc, conn, index, loop
        self.latest = (0, 0, 0)  # finished, in flight, tokens received: the worker's latest report
        self.messages: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self.answer: asyncio.Future[SegmentResult] = loop.create_future()  # replaced at the start
        threading.Thread(target=self._read, name=f"mlxproxy-load-link-{index}", daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                what, value = self.conn.recv()
            except (EOFError, OSError):
                what, value = "eof", None
            if what == "count":
                self.latest = value
                continue
            try:
                self.loop.call_soon_threadsafe(self.messages.put_nowait, (what, value))
            except RuntimeError:  # the parent's loop is closed
                return
            if what != "ready":
                return

    async def receive(self, *expected: str) -> Any:
        """The next message's value, one of `expected`; WorkersError for an error or none."""
        what, value = await self.messages.get()
        if what == "eof":
            raise WorkersError(f"load worker {self.index} exited without a result")
        if what == "error":
            raise WorkersError(f"load worker {self.index} failed: {value}")
        if what not in expected:
            raise WorkersError(f"load worker {self.index} sent {what!r}, not {' or '.join(expected)}")
        return value

    async def _result(self) -> SegmentResult:
        """The worker's answer, whole or stopped (`_run_stoppable`)."""
        result: SegmentResult = await self.receive("done", "stopped")
        return result

    def start(self, start_at: float) -> None:
        """Send the shared start; from now on its answer is awaited (a task of its own, so that
        a Ctrl-C, which cancels only the wait for it, loses none already received)."""
        self.conn.send(start_at)
        self.answer = asyncio.ensure_future(self._result())

    def figures(self) -> tuple[int, int, int]:
        return self.latest

    def stop(self) -> None:
        if not self.answer.done():
            try:
                self.conn.send("stop")
            except OSError:  # it has just exited (its result, or an error, is on the way)
                pass

    def lost(self) -> str:
        self.proc.terminate()
        return f"load worker {self.index} did not stop within {STOP_WAIT_S:g} s: terminated, its requests are lost"


async def run_local(segments: Sequence[Segment], client: MeasuringClient, tick: Tick) -> FleetTimed:
    """Each segment in a process of its own (started with `spawn`: no fork of a process that
    runs an event loop), all started at one instant once every segment is in its process (a
    segment of 30,000 requests takes a while to pickle and unpickle: not inside the schedule),
    their results gathered (`gather_parts`: progress, a failed worker, Ctrl-C after the start).
    A cancel before the start ends the workers: nothing was sent."""
    ctx = multiprocessing.get_context("spawn")
    loop = asyncio.get_running_loop()
    links: list[_Link] = []

    async def stop() -> None:
        for k in links:
            k.stop()

    try:
        for seg in segments:
            mine, theirs = ctx.Pipe()
            p = ctx.Process(target=_serve, args=(theirs,), name=f"mlxproxy-load-{seg.index}", daemon=True)
            p.start()
            theirs.close()
            links.append(_Link(p, mine, len(links), loop))
        # off the loop: a pipe takes a big segment only as fast as its process reads it
        await asyncio.gather(*(asyncio.to_thread(k.conn.send, seg) for k, seg in zip(links, segments)))
        await asyncio.gather(*(k.receive("ready") for k in links))
        start_at = time.time() + LOCAL_LEAD_S
        for k in links:
            k.start(start_at)
        return await gather_parts(links, stop, client, start_at, tick)
    finally:
        for k in links:
            k.answer.cancel()
            if k.proc.is_alive():
                k.proc.terminate()
            k.proc.join(5)
            k.conn.close()
