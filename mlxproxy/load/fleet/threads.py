"""Streams as independent clients (`Threads`): each stream of a closed-loop step, or each
conversation slot of a sessions step, sent from an OS thread of its own, with its own event loop
and measuring client, all from one shared start, their records merged as the workers' are.

Why (docs/METRICS.md, "Why each stream has a thread of its own"): a closed loop's streams on a
batching server end together and send together again. On one event loop they share one thread,
which the operating system schedules as one: on a busy host it waits for a core a few
milliseconds at a time, and the responses that end meanwhile are noticed, and their next
requests sent, late and together. Independent clients are scheduled each on their own. Against
mlx_lm.server, whose batch takes in the requests queued when it starts and leaves a later one a
whole batch behind, 7 streams on one event loop split 19-40 % of their waves (TTFT p95 0.40-0.53 s
in 13 of 16 runs) where the same client with a thread per stream split none (0.34-0.36 s), as an
independent threaded client measured (0.34-0.40 s).

Sent from this process: a thread's GIL is shared, its scheduling is not. At most `most`
threads (streams past that share them, stream s on thread s mod `most`), and never when the
client's connection cap is below the threads' count (the cap counts one process's connections:
its queue must stay one).
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

from mlxproxy.edge.runner import run_async
from mlxproxy.load.fleet.parts import STOP_WAIT_S, gather_parts
from mlxproxy.load.fleet.segment import ClientSpec, Measured, Segment, SegmentResult, WorkersError, run_part
from mlxproxy.load.run.client import MeasuringClient, Timed
from mlxproxy.load.run.runner import Fleet, Plan
from mlxproxy.load.run.shapes import Tick

__all__ = ["STREAM_THREADS", "THREADS_LEAD_S", "THREADS_MOST", "Threads", "streams_fleet"]

#: threads of one step at most (streams past that share them)
THREADS_MOST = 256

#: seconds between the threads being started and the shared start
THREADS_LEAD_S = 0.05


class _Part:
    """One thread's segment (a `Part`): the thread that sends it, its answer (set from that
    thread) and a way to stop its run."""

    def __init__(self, seg: Segment, loop: asyncio.AbstractEventLoop) -> None:
        self.seg = seg
        self.measured = Measured()
        self.answer: asyncio.Future[SegmentResult] = loop.create_future()
        self.thread = threading.Thread(target=self._run, name=f"mlxproxy-stream-{seg.index}", daemon=True)
        self._loop = loop
        self._lock = threading.Lock()
        self._stop_now = False
        self._cancel: tuple[asyncio.AbstractEventLoop, asyncio.Task[SegmentResult]] | None = None

    def _run(self) -> None:
        async def main() -> SegmentResult:
            task = asyncio.ensure_future(run_part(self.seg, self.measured))
            with self._lock:
                self._cancel = (asyncio.get_running_loop(), task)
                if self._stop_now:
                    task.cancel()
            try:
                return await task
            except asyncio.CancelledError:
                return self.measured.partial(self.seg)

        try:
            result = run_async(main())
        except BaseException as exc:  # a thread's failure is one line in the caller
            self._answer(WorkersError(f"a stream's thread failed: {type(exc).__name__}: {exc}"))
        else:
            self._answer(result)

    def _answer(self, outcome: SegmentResult | BaseException) -> None:
        def settle() -> None:
            if self.answer.done():  # given up on (`lost`)
                return
            if isinstance(outcome, BaseException):
                self.answer.set_exception(outcome)
            else:
                self.answer.set_result(outcome)

        try:
            self._loop.call_soon_threadsafe(settle)
        except RuntimeError:  # the caller's loop is closed
            pass

    def figures(self) -> tuple[int, int, int]:
        return self.measured.figures()

    def stop(self) -> None:
        """Cancel the run (the answer is then the records finished so far)."""
        with self._lock:
            self._stop_now = True
            if self._cancel is not None:
                loop, task = self._cancel
                try:
                    loop.call_soon_threadsafe(task.cancel)
                except RuntimeError:  # its loop has closed: the run is over
                    pass

    def lost(self) -> str:
        return f"stream thread {self.seg.index} did not stop within {STOP_WAIT_S:g} s: its requests are lost"


@dataclass(frozen=True, slots=True)
class Threads:
    """A `Fleet` of threads in this process: the plan split into up to `most` parts (one per
    stream or conversation slot), each sent from a thread of its own from one shared start."""

    most: int = THREADS_MOST

    @property
    def parallel(self) -> bool:
        return True

    async def send(self, plan: Plan, client: MeasuringClient, tick: Tick) -> Timed:
        parts = plan(self.most)
        if len(parts) <= 1 or len(parts) > client.max_connections:
            ((shape, load),) = plan(1)
            return await shape.send(client, load, tick)
        spec = ClientSpec.of(client)
        start_at = time.time() + THREADS_LEAD_S
        loop = asyncio.get_running_loop()
        runs = [_Part(Segment(k, spec, shape, load, start_at), loop) for k, (shape, load) in enumerate(parts)]
        for p in runs:
            p.thread.start()

        async def stop() -> None:
            for p in runs:
                p.stop()

        try:
            fleet = await gather_parts(runs, stop, client, start_at, tick, say_kept=False)
        finally:  # done, failed or cancelled: no thread is left sending
            await stop()
            await asyncio.to_thread(_join, [p.thread for p in runs])
        # a plain Timed: the threads are this process, not workers with figures of their own
        return Timed(fleet.records, fleet.lag_s, fleet.source_ids, fleet.lag_by_id, fleet.where, fleet.session_s)


def _join(threads: list[threading.Thread]) -> None:
    for t in threads:
        t.join()


#: the fleet a closed-loop or sessions step is sent from when no --workers or --cluster is given
STREAM_THREADS = Threads()


def streams_fleet(fleet: Fleet) -> Fleet:
    """Where a closed loop's streams or a sessions step's conversations are sent from: the
    workers or cluster given (`fleet`), else a thread of their own each (`STREAM_THREADS`)."""
    return fleet if fleet.parallel else STREAM_THREADS
