"""The bookkeeping of a run's parts, however they are sent (a thread each, a local process each,
a Dask task each; `gather_parts`): their progress summed into the parent client's, the first
failure raised as one line, every result merged into one `FleetTimed` counted as the client's,
and on Ctrl-C each part stopped and the records it had finished kept before the cancel goes on.
How a part is started, stopped and ended is its transport's (`threads.py`, `local.py`,
`cluster.py`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from mlxproxy.load.fleet.merge import FleetTimed, merge
from mlxproxy.load.fleet.segment import SegmentResult
from mlxproxy.load.output.progress import say
from mlxproxy.load.run.client import MeasuringClient
from mlxproxy.load.run.shapes import Tick

__all__ = ["STOP_WAIT_S", "Part", "gather_parts"]

#: seconds a part has to send back what it measured after a Ctrl-C, before it is ended
STOP_WAIT_S = 5.0


class Part(Protocol):
    """One part of a run, sent elsewhere from the shared start."""

    @property
    def answer(self) -> asyncio.Future[SegmentResult]:
        """Its result: whole, or after a stop the records it had finished; `WorkersError` (one
        line) when it failed."""
        ...

    def figures(self) -> tuple[int, int, int]:
        """(finished, in flight, tokens received) so far, for the progress line."""
        ...

    def lost(self) -> str:
        """It did not stop within `STOP_WAIT_S`: end it if it can be; the line that says so."""
        ...


async def gather_parts(
    parts: Sequence[Part],
    stop: Callable[[], Awaitable[object]],
    client: MeasuringClient,
    start_at: float,
    tick: Tick,
    *,
    say_kept: bool = True,
) -> FleetTimed:
    """The parts' answers merged (send times onto this process's clock from `start_at`, the
    shared start's wall-clock time) and counted as `client`'s finished records, each ticked.
    Meanwhile `client.elsewhere` sums the parts' progress. The first part that fails raises its
    error (its transport ends the others). When the run is cancelled (Ctrl-C), `stop` asks every
    part to stop; what they had finished within `STOP_WAIT_S` is counted as the client's (said in
    one line unless not `say_kept`), and the cancel goes on."""
    answers = [p.answer for p in parts]

    def figures() -> tuple[int, int, int]:
        done, flying, tokens = (sum(f) for f in zip(*(p.figures() for p in parts)))
        return done, flying, tokens

    client.elsewhere = figures
    try:
        await asyncio.wait(answers, return_when=asyncio.FIRST_EXCEPTION)
    except asyncio.CancelledError:
        client.elsewhere = None
        kept = await _stopped(parts, stop)
        fleet = _counted(client, kept, start_at, None)
        if say_kept:
            n, k = len(fleet.records), len(kept)
            say(f"Ctrl-C: {n} finished request{'' if n == 1 else 's'} kept from {k} load worker{'' if k == 1 else 's'}")
        raise
    finally:
        client.elsewhere = None
    failed = [exc for a in answers if a.done() and (exc := a.exception()) is not None]
    if failed:
        raise failed[0]  # a part's failure: one line
    return _counted(client, [a.result() for a in answers], start_at, tick)


async def _stopped(parts: Sequence[Part], stop: Callable[[], Awaitable[object]]) -> list[SegmentResult]:
    """Every part asked to stop: the answers in within `STOP_WAIT_S` (a failed part's error said
    in one line), each part not answering by then ended and said."""
    await stop()
    await asyncio.wait([p.answer for p in parts], timeout=STOP_WAIT_S)
    kept: list[SegmentResult] = []
    for p in parts:
        a = p.answer
        if not a.done() or a.cancelled():
            a.cancel()
            say(p.lost())
        elif (exc := a.exception()) is not None:
            say(str(exc))
        else:
            kept.append(a.result())
    return kept


def _counted(client: MeasuringClient, results: Sequence[SegmentResult], start_at: float, tick: Tick) -> FleetTimed:
    """`results` merged onto this process's clock, counted as `client`'s finished records."""
    fleet = merge(results, time.perf_counter() + (start_at - time.time()))
    client.finished.extend(fleet.records)
    if tick:
        for _ in fleet.records:
            tick()
    return fleet
