"""Other hosts (`--cluster ADDRESS`): the segments as tasks on a Dask cluster (the optional
`[cluster]` extra), one per worker, through Dask's asynchronous client on the run's own loop.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from typing import Any

from mlxproxy.load.fleet.merge import FleetTimed
from mlxproxy.load.fleet.parts import STOP_WAIT_S, gather_parts
from mlxproxy.load.fleet.segment import Segment, SegmentResult, WorkersError, run_segment, warm
from mlxproxy.load.run.client import MeasuringClient
from mlxproxy.load.run.shapes import Tick

__all__ = ["CLUSTER_LEAD_S", "CLUSTER_WAIT_S", "MISSING_EXTRA", "run_cluster"]

CLUSTER_LEAD_S = 1.0


#: seconds a run waits for a cluster's first worker
CLUSTER_WAIT_S = 10.0


MISSING_EXTRA = "--cluster needs Dask: pip install 'mlxproxy[cluster]'"


class _Task:
    """One segment's Dask task (a `Part`): its answer, a remote failure as one line. A task
    reports no progress (the parent's line counts its records once they are back)."""

    def __init__(self, dc: Any, future: Any, index: int, host: str) -> None:
        self.index, self.host = index, host
        self.answer: asyncio.Future[SegmentResult] = asyncio.ensure_future(self._result(dc, future))

    async def _result(self, dc: Any, future: Any) -> SegmentResult:
        try:
            result: SegmentResult = await dc.gather(future)
        except Exception as exc:
            raise WorkersError(f"load worker {self.index} ({self.host}) failed: {exc}") from exc
        return result

    def figures(self) -> tuple[int, int, int]:
        return (0, 0, 0)

    def lost(self) -> str:
        return f"load worker {self.index} ({self.host}) did not stop within {STOP_WAIT_S:g} s: cancelled, its requests are lost"


async def run_cluster(
    address: str, plan: Callable[[int], list[Segment]], count: int, client: MeasuringClient, tick: Tick
) -> FleetTimed:
    """The segments as tasks on a Dask cluster, one per worker (round-robin when more segments
    than workers), through Dask's asynchronous client on this event loop, their results gathered
    (`gather_parts`). A cancelled run (Ctrl-C) after the start sets the run's Dask `Event`: each
    task stops and returns the records it had finished; a task that has not within `STOP_WAIT_S`
    is cancelled, said in one line."""
    try:
        from distributed import Client, Event  # the optional [cluster] extra
    except ImportError:
        raise WorkersError(MISSING_EXTRA) from None
    try:
        dc = await Client(address, asynchronous=True, timeout=10, set_as_default=False)
    except (OSError, TimeoutError) as exc:
        raise WorkersError(f"cannot reach the Dask scheduler at {address}: {exc}") from None
    futures: list[Any] = []
    tasks: list[_Task] = []
    try:
        try:
            await dc.wait_for_workers(1, timeout=CLUSTER_WAIT_S)
        except TimeoutError:
            raise WorkersError(f"the Dask scheduler at {address} has no workers") from None
        hosts = sorted(await dc.nthreads())
        segments = plan(count if count > 1 else len(hosts))
        where = [hosts[i % len(hosts)] for i in range(len(segments))]
        # in each worker's task thread, as the segments will run (`Client.run` would run it on
        # the worker's own event loop); each segment sent to its worker (`scatter` returns once
        # it is there) before the start is chosen
        await dc.gather([dc.submit(warm, workers=[h], allow_other_workers=False, pure=False) for h in hosts])
        data = [await dc.scatter(s, workers=[h], broadcast=False, hash=False) for s, h in zip(segments, where)]
        start_at = time.time() + CLUSTER_LEAD_S
        tag = uuid.uuid4().hex[:8]
        event = Event(f"mlxproxy-stop-{tag}", client=dc)
        futures = [
            dc.submit(
                run_segment,
                seg,
                start_at,
                event.name,
                key=f"mlxproxy-segment-{tag}-{i}",
                workers=[where[i]],
                allow_other_workers=False,
                pure=False,
            )
            for i, seg in enumerate(data)
        ]
        tasks = [_Task(dc, f, i, where[i]) for i, f in enumerate(futures)]

        async def stop() -> None:  # bounded: a scheduler that does not answer leaves the tasks to be cancelled
            await asyncio.wait([asyncio.ensure_future(event.set())], timeout=STOP_WAIT_S)

        try:
            return await gather_parts(tasks, stop, client, start_at, tick)
        except asyncio.CancelledError:
            await asyncio.wait([asyncio.ensure_future(event.clear())], timeout=STOP_WAIT_S)  # the scheduler forgets it
            raise
    finally:
        for t in tasks:
            t.answer.cancel()
        if futures:
            await dc.cancel(futures)
        await dc.close()
