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
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from multiprocessing.context import SpawnProcess
from typing import Any

from mlxproxy.edge.runner import run_async
from mlxproxy.load.fleet.segment import (
    REPORT_EVERY_S,
    Measured,
    Segment,
    SegmentResult,
    WorkersError,
    run_part,
    warm,
)
from mlxproxy.load.output.progress import say
from mlxproxy.load.run.client import MeasuringClient

__all__ = ["LOCAL_LEAD_S", "STOP_WAIT_S", "run_local"]

#: seconds between the workers being ready and the shared start (local processes, a cluster)
LOCAL_LEAD_S = 0.25


#: seconds a local worker has to send back what it measured after a Ctrl-C, before it is ended
STOP_WAIT_S = 5.0


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
    """The parent's end of one local worker's pipe: one thread reads it (a read cancelled in
    the event loop would go on in its thread and swallow the next message), keeps the latest
    progress figures and hands every other message to the loop."""

    def __init__(self, conn: Connection, index: int, loop: asyncio.AbstractEventLoop) -> None:
        self.conn, self.index, self.loop = conn, index, loop
        self.figures = (0, 0, 0)  # finished, in flight, tokens received: the worker's latest report
        self.messages: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        threading.Thread(target=self._read, name=f"mlxproxy-load-link-{index}", daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                what, value = self.conn.recv()
            except (EOFError, OSError):
                what, value = "eof", None
            if what == "count":
                self.figures = value
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


async def _stop(
    links: Sequence[_Link], results: Sequence[asyncio.Future[Any]], procs: Sequence[SpawnProcess]
) -> list[SegmentResult]:
    """Ctrl-C in a run of local workers: each still running is told to stop and sends back the
    records it had finished (`results`: each worker's answer, whole or stopped); one that does
    not answer within `STOP_WAIT_S` is terminated, said in one line."""
    for link, res in zip(links, results):
        if not res.done():
            try:
                link.conn.send("stop")
            except OSError:  # it has just exited (its result, or an error, is on the way)
                pass
    await asyncio.wait(results, timeout=STOP_WAIT_S)
    kept: list[SegmentResult] = []
    for link, res, p in zip(links, results, procs):
        if not res.done() or res.cancelled():
            res.cancel()
            p.terminate()
            say(f"load worker {link.index} did not stop within {STOP_WAIT_S:g} s: terminated, its requests are lost")
        elif res.exception() is not None:
            say(str(res.exception()))
        else:
            kept.append(res.result())
    return kept


async def run_local(
    segments: Sequence[Segment], client: MeasuringClient, keep: Callable[[list[SegmentResult], float], None]
) -> tuple[list[SegmentResult], float]:
    """Each segment in a process of its own (started with `spawn`: no fork of a process that
    runs an event loop), all started at one instant once every segment is in its process (a
    segment of 30,000 requests takes a while to pickle and unpickle: not inside the schedule).
    Meanwhile `client.elsewhere` sums the workers' progress reports; when the run is cancelled
    (Ctrl-C) after the start, the workers stop and `keep` gets the records they had finished
    (before the start: nothing was sent, the workers are ended)."""
    ctx = multiprocessing.get_context("spawn")
    loop = asyncio.get_running_loop()
    procs: list[SpawnProcess] = []
    links: list[_Link] = []
    results: list[asyncio.Future[Any]] = []

    def figures() -> tuple[int, int, int]:
        done, flying, tokens = (sum(f) for f in zip(*(k.figures for k in links)))
        return done, flying, tokens

    try:
        for seg in segments:
            mine, theirs = ctx.Pipe()
            p = ctx.Process(target=_serve, args=(theirs,), name=f"mlxproxy-load-{seg.index}", daemon=True)
            p.start()
            theirs.close()
            procs.append(p)
            links.append(_Link(mine, len(links), loop))
        # off the loop: a pipe takes a big segment only as fast as its process reads it
        await asyncio.gather(*(asyncio.to_thread(k.conn.send, seg) for k, seg in zip(links, segments)))
        await asyncio.gather(*(k.receive("ready") for k in links))
        start_at = time.time() + LOCAL_LEAD_S
        for k in links:
            k.conn.send(start_at)
        client.elsewhere = figures
        # each worker's answer a task of its own, so that a Ctrl-C (which cancels only this
        # wait) loses none already received
        results = [asyncio.ensure_future(k.receive("done", "stopped")) for k in links]
        try:
            await asyncio.wait(results, return_when=asyncio.FIRST_EXCEPTION)
        except asyncio.CancelledError:
            client.elsewhere = None
            keep(await _stop(links, results, procs), start_at)
            raise
        for r in results:
            if r.done() and (exc := r.exception()) is not None:
                raise exc  # a worker's failure: one line
        return [r.result() for r in results], start_at
    finally:
        client.elsewhere = None
        for r in results:
            r.cancel()
        for p in procs:
            if p.is_alive():
                p.terminate()
            p.join(5)
        for k in links:
            k.conn.close()
