"""Other hosts (`--cluster ADDRESS`): the segments as tasks on a Dask cluster (the optional
`[cluster]` extra), one per worker, through Dask's asynchronous client on the run's own loop.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from typing import Any

from mlxproxy.load.fleet.local import STOP_WAIT_S
from mlxproxy.load.fleet.segment import Segment, SegmentResult, WorkersError, run_segment, warm
from mlxproxy.load.output.progress import say

__all__ = ["CLUSTER_LEAD_S", "CLUSTER_WAIT_S", "MISSING_EXTRA", "run_cluster"]

CLUSTER_LEAD_S = 1.0


#: seconds a run waits for a cluster's first worker
CLUSTER_WAIT_S = 10.0


MISSING_EXTRA = "--cluster needs Dask: pip install 'mlxproxy[cluster]'"


async def run_cluster(
    address: str,
    plan: Callable[[int], list[Segment]],
    count: int,
    keep: Callable[[list[SegmentResult], float], None],
) -> tuple[list[SegmentResult], float]:
    """The segments as tasks on a Dask cluster, one per worker (round-robin when more segments
    than workers), through Dask's asynchronous client on this event loop. A cancelled run
    (Ctrl-C) after the start sets the run's Dask `Event`: each task stops and returns the
    records it had finished, which `keep` gets; a task that has not within `STOP_WAIT_S` is
    cancelled, said in one line."""
    try:
        from distributed import Client, Event  # the optional [cluster] extra
    except ImportError:
        raise WorkersError(MISSING_EXTRA) from None
    try:
        dc = await Client(address, asynchronous=True, timeout=10, set_as_default=False)
    except (OSError, TimeoutError) as exc:
        raise WorkersError(f"cannot reach the Dask scheduler at {address}: {exc}") from None
    futures: list[Any] = []
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
        stop = f"mlxproxy-stop-{tag}"
        futures = [
            dc.submit(
                run_segment,
                seg,
                start_at,
                stop,
                key=f"mlxproxy-segment-{tag}-{i}",
                workers=[where[i]],
                allow_other_workers=False,
                pure=False,
            )
            for i, seg in enumerate(data)
        ]
        try:
            return list(await dc.gather(futures)), start_at
        except asyncio.CancelledError:
            event = Event(stop, client=dc)
            # bounded: a scheduler that does not answer leaves the tasks to be cancelled below
            await asyncio.wait([asyncio.ensure_future(event.set())], timeout=STOP_WAIT_S)
            answers = [asyncio.ensure_future(dc.gather(f)) for f in futures]
            await asyncio.wait(answers, timeout=STOP_WAIT_S)
            kept = []
            for i, a in enumerate(answers):
                if not a.done() or a.cancelled():
                    a.cancel()
                    say(
                        f"load worker {i} ({where[i]}) did not stop within {STOP_WAIT_S:g} s: cancelled, its requests are lost"
                    )
                elif a.exception() is not None:
                    say(f"load worker {i} ({where[i]}) failed: {a.exception()}")
                else:
                    kept.append(a.result())
            await asyncio.wait([asyncio.ensure_future(event.clear())], timeout=STOP_WAIT_S)  # the scheduler forgets it
            keep(kept, start_at)
            raise
    finally:
        if futures:
            await dc.cancel(futures)
        await dc.close()
