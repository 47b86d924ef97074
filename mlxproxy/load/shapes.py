"""Load shapes: how the requests of one test are sent, one small frozen class per shape.

`replay` and `bench` build requests and pick a shape; the shape sends them through the
measuring client (`mlxproxy.load.client`), which keeps each request's record and, where
requests have due times, the schedule lag. A sweep (`Sweep`) runs one shape at growing counts.

- `Sequential`: one request at a time.
- `Recorded(speed)`: each request at its recorded offset / speed (open loop on the capture's clock).
- `OpenLoop(rate, arrival, seed, ramp_s)`: request i due at the i-th arrival of a constant or
  seeded Poisson schedule at `rate` requests/s, after an unmeasured linear ramp.
- `ClosedLoop(streams)`: `streams` workers, each sending its next request when its last ends.
- `Waves(size)`: requests released together, `size` at a time (the double-batch method).
- `Sessions(at_once)`: conversation runs (`Turn`s with their think time), `at_once` at a time.
- `Sweep(inner, steps, refine, budget_s)`: one of `OpenLoop`, `ClosedLoop` or `Sessions` run at
  growing counts (its rate, streams or sessions at once), each step judged against the SLO as
  it finishes (`mlxproxy.load.sweep.run_sweep`); `mlxproxy.load.workers.open_loop_step` and `closed_loop_step` build
  the step that sends a mix at one count.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Generic, TypeVar

from mlxproxy.core.record import Record
from mlxproxy.load.arrivals import arrival_offsets, ramp_offsets, schedule
from mlxproxy.load.capacity import RATE_UNIT
from mlxproxy.load.client import MeasuringClient, PreparedRequest, Timed
from mlxproxy.load.progress import Progress
from mlxproxy.load.results import Group, JSONObject, SessionTurn
from mlxproxy.load.sweep import DEFAULT_BUDGET_S, DEFAULT_STEP_MIN_S, StepRun, run_sweep

__all__ = [
    "ClosedLoop",
    "LoadShape",
    "OpenLoop",
    "Recorded",
    "Sequential",
    "Sessions",
    "Sweep",
    "SweptShape",
    "TimedShape",
    "Turn",
    "Waves",
]

Tick = Callable[[], None] | None


@dataclass(frozen=True, slots=True)
class Sequential:
    """One request at a time."""

    async def run(self, client: MeasuringClient, reqs: Sequence[PreparedRequest], tick: Tick = None) -> Timed:
        return await client.run_sequential(reqs, tick)


@dataclass(frozen=True, slots=True)
class Recorded:
    """Each request at its recorded offset / `speed`, against absolute deadlines."""

    speed: float = 1.0

    async def run(self, client: MeasuringClient, reqs: Sequence[PreparedRequest], tick: Tick = None) -> Timed:
        return await client.run_recorded(reqs, self.speed, tick)


@dataclass(frozen=True, slots=True)
class OpenLoop:
    """`rate` requests/s on a constant or seeded Poisson schedule, whatever the server does,
    after an unmeasured ramp of `ramp_s` seconds up to the rate."""

    rate: float
    arrival: str = "constant"
    seed: int = 0
    ramp_s: float = 0.0

    def params(self, n: int) -> dict[str, float | str | int | None]:
        """The group params that describe this shape for `n` requests (`scheduled_rate` too)."""
        return {**schedule(n, self.rate, self.arrival, self.seed)[1], "ramp_s": self.ramp_s}

    def ramp_size(self) -> int:
        return len(ramp_offsets(self.rate, self.ramp_s, self.arrival, self.seed))

    async def run(
        self,
        client: MeasuringClient,
        reqs: Sequence[PreparedRequest],
        tick: Tick = None,
        ramp: Sequence[PreparedRequest] = (),
    ) -> Timed:
        """`reqs` on the schedule, after `ramp` (one request per due time of the ramp, sent
        and not measured)."""
        offsets = arrival_offsets(len(reqs), self.rate, self.arrival, self.seed)
        ramp_at = ramp_offsets(self.rate, self.ramp_s, self.arrival, self.seed)
        warm = (ramp, ramp_at, self.ramp_s) if ramp and ramp_at else None
        return await client.run_open_loop(reqs, offsets, tick, ramp=warm)


@dataclass(frozen=True, slots=True)
class ClosedLoop:
    """`streams` workers, each sending its next request as soon as its last one ended."""

    streams: int

    async def run(self, client: MeasuringClient, reqs: Sequence[PreparedRequest], tick: Tick = None) -> Timed:
        return await client.run_closed_loop(reqs, self.streams, tick)


@dataclass(frozen=True, slots=True)
class Waves:
    """Waves of `size` requests released together (every task waits on one gate)."""

    size: int

    async def run_waves(
        self, client: MeasuringClient, reqs: Sequence[PreparedRequest], tick: Tick = None
    ) -> tuple[Timed, list[list[Record]]]:
        return await client.run_waves(reqs, self.size, tick)


@dataclass(frozen=True, slots=True)
class Turn:
    """One turn of a conversation run: its request and the seconds to wait, after the
    previous turn's response ended, before sending it (0 for the first turn)."""

    request: PreparedRequest
    think_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Sessions:
    """Conversations, `at_once` at a time: each run its turns in order with its think time; a
    worker takes the next run when its last one ends."""

    at_once: int

    async def run_sessions(
        self, client: MeasuringClient, runs: Sequence[Sequence[Turn]], tick: Tick = None
    ) -> tuple[Timed, dict[str, SessionTurn], list[float]]:
        """The records, each record's `session` (its run's index), `turn` and `think_s`, and
        each run's wall time."""
        queue = list(enumerate(runs))[::-1]
        timed = Timed()
        where: dict[str, SessionTurn] = {}
        session_s: list[float] = []

        async def worker() -> None:
            while queue:
                si, turns = queue.pop()
                t0 = time.perf_counter()
                for ti, turn in enumerate(turns):
                    if ti:
                        await asyncio.sleep(turn.think_s)
                    r = await client.send(turn.request)
                    timed.records.append(r)
                    timed.source_ids[r.id] = turn.request.source_id
                    where[r.id] = SessionTurn(si, ti, turn.think_s)
                    if tick:
                        tick()
                session_s.append(time.perf_counter() - t0)

        await asyncio.gather(*(worker() for _ in range(max(1, self.at_once))))
        return timed, where, session_s


#: the shapes a `Sweep` runs at growing counts
SweptShape = TypeVar("SweptShape", OpenLoop, ClosedLoop, Sessions)


@dataclass(frozen=True, slots=True)
class Sweep(Generic[SweptShape]):
    """`inner` run at growing counts: an `OpenLoop`'s rate, a `ClosedLoop`'s streams or the
    `Sessions` at once. `steps` run as given; without them the count doubles from 1 until a
    step breaks the SLO, has failed requests or adds no throughput, then, with `refine`
    (`--sweep auto`), the gap between the last good and the first bad step is halved while the
    sweep has run less than `budget_s` seconds; without it (`--sweep double`) the answer stays
    a power of two. The inner shape's own count is a placeholder: each step replaces it."""

    inner: SweptShape
    steps: tuple[float, ...] = ()
    refine: bool = True
    budget_s: float = DEFAULT_BUDGET_S
    min_s: float = DEFAULT_STEP_MIN_S  # a closed-loop step sends its mix again until it ran this long
    runs: int = 1  # the whole search this many times (--runs)

    @property
    def unit(self) -> str:
        """What the steps count: `req/s`, `sessions` or `streams`."""
        if isinstance(self.inner, OpenLoop):
            return RATE_UNIT
        return "sessions" if isinstance(self.inner, Sessions) else "streams"

    def at(self, n: float) -> SweptShape:
        """The inner shape at the count `n`."""
        inner = self.inner
        if isinstance(inner, OpenLoop):
            return replace(inner, rate=n)
        if isinstance(inner, ClosedLoop):
            return replace(inner, streams=int(n))
        return replace(inner, at_once=int(n))

    async def run(
        self,
        step: Callable[[SweptShape], Awaitable[StepRun]],
        slo: dict[str, float],
        *,
        target: str,
        params: JSONObject,
        out: list[Group],
        say: Callable[[str], None] | None = None,
        progress: Progress | None = None,
    ) -> None:
        """`step(shape)` at each count, its judged group appended to `out` as it finishes."""

        async def at(n: float) -> StepRun:
            return await step(self.at(n))

        await run_sweep(
            at, self.steps, slo, target=target, params=dict(params), out=out, say=say, unit=self.unit,
            progress=progress, budget_s=self.budget_s, refine=self.refine, min_s=self.min_s, runs=self.runs,
        )  # fmt: skip


#: the shapes whose `run` gives one `Timed` (a sweep runs `OpenLoop` or `ClosedLoop` at growing counts)
TimedShape = Sequential | Recorded | OpenLoop | ClosedLoop
#: every shape a test can take
LoadShape = TimedShape | Waves | Sessions | Sweep[OpenLoop] | Sweep[ClosedLoop] | Sweep[Sessions]
