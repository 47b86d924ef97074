"""Load shapes: how the requests of one test are sent, one small frozen class per shape. Each
knows how to send itself from this process (`send`) and, where it can be spread over several
workers, how to split itself (`split`: parts a worker sends alike, `mlxproxy.load.run.plan`);
the runner (`mlxproxy.load.run.runner.send`) sends any of them, here or on a fleet.

- `Sequential`: one request at a time.
- `Recorded(speed)`: each request at its recorded offset / speed (open loop on the capture's clock).
- `OpenLoop(rate, arrival, seed, ramp_s)`: request i due at the i-th arrival of a constant or
  seeded Poisson schedule at `rate` requests/s, after an unmeasured linear ramp.
- `ClosedLoop(at_once)`: `at_once` streams, each sending its next request when its last ends.
- `Waves(size)`: requests released together, `size` at a time (the double-batch method).
- `Sessions(at_once)`: conversation runs (`Turn`s with their think time), `at_once` at a time.
- `Burst(size, every_s)`: `size` requests due together every `every_s` seconds.
- `Due`: each request at its own due time from one start (what `Recorded` and `OpenLoop`
  send, and their part on one worker).
- `Sweep(inner, steps, refine, budget_s)`: one of `OpenLoop`, `ClosedLoop` or `Sessions` run at
  growing counts (each shape says what its count is: `unit`, `at`), each step judged against
  the SLO as it finishes (`mlxproxy.load.run.sweep.run_sweep`).

A new shape is one class here: its `send` (and `split`, `unit`, `at` where they apply).
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import ClassVar, Generic, TypeVar

from mlxproxy.core.record import Record
from mlxproxy.load.data.arrivals import arrival_offsets, ramp_offsets, schedule
from mlxproxy.load.data.results import Group, SessionTurn
from mlxproxy.load.data.summary import JSONObject
from mlxproxy.load.judge.capacity import RATE_UNIT
from mlxproxy.load.output.progress import Progress
from mlxproxy.load.run.client import MeasuringClient, PreparedRequest, Timed
from mlxproxy.load.run.plan import plan_closed, plan_due, plan_sessions
from mlxproxy.load.run.sweep import DEFAULT_BUDGET_S, DEFAULT_STEP_MIN_S, StepRun, run_sweep

__all__ = [
    "Burst",
    "ClosedLoop",
    "Due",
    "DueTimes",
    "Load",
    "OpenLoop",
    "Recorded",
    "Sequential",
    "Sessions",
    "Shape",
    "Sweep",
    "SweptShape",
    "Turn",
    "Waves",
]

Tick = Callable[[], None] | None
now = time.perf_counter
_TIMER_RESOLUTION_S = 0.001
#: a run freezes the cyclic collector's view of what it holds after this many finished records
FREEZE_EVERY = 256


@dataclass(frozen=True, slots=True)
class Turn:
    """One turn of a conversation run: its request and the seconds to wait, after the
    previous turn's response ended, before sending it (0 for the first turn)."""

    request: PreparedRequest
    think_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Load:
    """What a shape sends: `requests` (and an unmeasured `ramp` sent before them), or
    conversation `runs` (numbered `run_ids` in the whole test when this is one worker's part)."""

    requests: Sequence[PreparedRequest] = ()
    ramp: Sequence[PreparedRequest] = ()
    runs: Sequence[Sequence[Turn]] = ()
    run_ids: Sequence[int] = ()


class Shape:
    """A load shape. `send` sends `load` through `client` from this process, calling `tick`
    right after each measured request's record was appended to `client.finished` (no await
    between: a worker's progress reads the newest record); `start` (a `perf_counter` instant)
    is the schedule's 0 when several workers share one start. `split` gives the parts `n`
    workers send (only when `splits`)."""

    __slots__ = ()
    #: whether a fleet may spread the shape over several workers (one stream, or waves that
    #: must start from one event loop, may not)
    splits: ClassVar[bool] = False

    async def send(self, client: MeasuringClient, load: Load, tick: Tick = None, start: float | None = None) -> Timed:
        raise NotImplementedError

    def split(self, load: Load, n: int) -> list[tuple[Shape, Load]]:
        return [(self, load)]


async def _sleep_until(t: float | None) -> None:
    while t is not None and (delay := t - now()) > _TIMER_RESOLUTION_S:
        await asyncio.sleep(delay)


class _RunHeap:
    """Keeps a long run's finished records out of the cyclic collector's full passes.

    A run holds every record until it ends, and each full collection walks all of them: at
    2,000 req/s for 10 s those walks paused the event loop for tens of ms (schedule lag p99
    45-50 ms; 2.4 ms with the collector off; benchmarks/README.md). Every `FREEZE_EVERY`
    records `gc.freeze()` moves what is alive to the permanent generation (a constant-time
    splice), which later passes skip; reference counting still frees everything as usual, and
    the end of the run unfreezes, so cyclic garbage made meanwhile is collected then."""

    def __init__(self) -> None:
        self.records = 0
        # what was alive before the run (modules, earlier runs' leftovers) out of the full
        # passes at once: a generation-2 pass over it stalled a 2,000 req/s run for 296 ms
        # (benchmarks/generator.py --stalls-for)
        gc.freeze()
        self.frozen = True

    def record_done(self) -> None:
        self.records += 1
        if self.records % FREEZE_EVERY == 0:
            gc.freeze()
            self.frozen = True

    def release(self) -> None:
        if self.frozen:
            gc.unfreeze()
            self.frozen = False


#: a due-time run forgets its finished tasks every this many started (see `_pending`)
_PRUNE_EVERY = 1024


def _pending(tasks: list[asyncio.Task[None]]) -> list[asyncio.Task[None]]:
    """The tasks not done yet; a done one's exception (there is none but a bug) raised here."""
    for task in tasks:
        if task.done():
            task.result()
    return [t for t in tasks if not t.done()]


async def _send_due(client: MeasuringClient, reqs: Sequence[PreparedRequest], t0: float, tick: Tick) -> Timed:
    """Each request sent at `t0` + its `offset_s`, against absolute deadlines; the lag of every
    actual send behind its deadline is kept.

    One dispatcher sleeps until the next deadline and only then starts that request's task:
    creating every task up front would spend the first moments of a long run starting
    thousands of sleeping tasks, late for the first deadlines. The lag is taken inside the
    started task, just before it sends, so the loop's own delay is in it."""
    out = Timed()
    if not reqs:
        return out
    tasks: list[asyncio.Task[None]] = []
    heap = _RunHeap()
    prune_at = _PRUNE_EVERY

    async def one(req: PreparedRequest, deadline: float) -> None:
        lag = max(0.0, now() - deadline)
        out.lag_s.append(lag)
        r = await client.send(req)
        out.lag_by_id[r.id] = lag
        out.records.append(r)
        out.source_ids[r.id] = req.source_id
        heap.record_done()
        if tick:
            tick()

    try:
        for req in sorted(reqs, key=lambda r: r.offset_s):
            deadline = t0 + req.offset_s
            # uvloop's timers have 1 ms resolution and wake up to ~1 ms early: sleep again
            # only for what a timer can resolve (sleeping for less spins the loop)
            while (delay := deadline - now()) > _TIMER_RESOLUTION_S:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(one(req, deadline)))
            if len(tasks) >= prune_at:  # (at least as many started since: linear overall)
                tasks = _pending(tasks)
                prune_at = max(_PRUNE_EVERY, 2 * len(tasks))
        # only the requests still in flight: a gather over a whole long run's tasks at its
        # end held the loop for ~30 ms at 20,000 (benchmarks/generator.py --stalls-for)
        await asyncio.gather(*_pending(tasks))
    finally:
        for task in tasks:  # cancelled (Ctrl-C, a timeout around the run): no orphans
            task.cancel()
        heap.release()
    return out


@dataclass(frozen=True, slots=True)
class Due(Shape):
    """Each request sent at its `offset_s` seconds after the start (now, or `start`), the
    `ramp`'s requests at theirs (sent, not measured)."""

    splits: ClassVar[bool] = True

    async def send(self, client: MeasuringClient, load: Load, tick: Tick = None, start: float | None = None) -> Timed:
        t0 = now() if start is None else start
        if not load.ramp:
            return await _send_due(client, load.requests, t0, tick)
        _, out = await asyncio.gather(
            _send_due(client, load.ramp, t0, None), _send_due(client, load.requests, t0, tick)
        )
        return out

    def split(self, load: Load, n: int) -> list[tuple[Shape, Load]]:
        """Due times dealt round-robin in due order: the union is the schedule asked for."""
        return [(self, Load(m, w)) for m, w in zip(plan_due(load.requests, n), plan_due(load.ramp, n))]


class DueTimes(Shape):
    """A shape that gives every request a due time (`due`: each one's `offset_s` from the start),
    sent and split as `Due` sends and splits them."""

    __slots__ = ()
    splits: ClassVar[bool] = True

    def due(self, load: Load) -> Load:
        raise NotImplementedError

    async def send(self, client: MeasuringClient, load: Load, tick: Tick = None, start: float | None = None) -> Timed:
        return await Due().send(client, self.due(load), tick, start)

    def split(self, load: Load, n: int) -> list[tuple[Shape, Load]]:
        return Due().split(self.due(load), n)


@dataclass(frozen=True, slots=True)
class Sequential(Shape):
    """One request at a time."""

    async def send(self, client: MeasuringClient, load: Load, tick: Tick = None, start: float | None = None) -> Timed:
        await _sleep_until(start)
        out = Timed()
        for req in load.requests:
            out.add(await client.send(req), req.source_id)
            if tick:
                tick()
        return out


@dataclass(frozen=True, slots=True)
class Recorded(DueTimes):
    """Each request at its recorded offset / `speed`, against absolute deadlines (the offsets
    count from the first request's, which is sent at once)."""

    speed: float = 1.0

    def due(self, load: Load) -> Load:
        first = min((r.offset_s for r in load.requests), default=0.0)
        return Load([dataclasses.replace(r, offset_s=(r.offset_s - first) / self.speed) for r in load.requests])


@dataclass(frozen=True, slots=True)
class OpenLoop(DueTimes):
    """`rate` requests/s on a constant or seeded Poisson schedule, whatever the server does,
    after an unmeasured ramp of `ramp_s` seconds up to the rate (`load.ramp`: one request per
    due time of the ramp)."""

    rate: float
    arrival: str = "constant"
    seed: int = 0
    ramp_s: float = 0.0
    unit: ClassVar[str] = RATE_UNIT

    def at(self, n: float) -> OpenLoop:
        return replace(self, rate=n)

    def params(self, n: int) -> dict[str, float | str | int | None]:
        """The group params that describe this shape for `n` requests (`scheduled_rate` too)."""
        return {**schedule(n, self.rate, self.arrival, self.seed)[1], "ramp_s": self.ramp_s}

    def ramp_size(self) -> int:
        return len(ramp_offsets(self.rate, self.ramp_s, self.arrival, self.seed))

    def due(self, load: Load) -> Load:
        """The measured requests and the ramp's, each with its due time from the start as
        `offset_s`: the ramp first, the measured requests `ramp_s` later."""
        offsets = arrival_offsets(len(load.requests), self.rate, self.arrival, self.seed)
        ramp_at = ramp_offsets(self.rate, self.ramp_s, self.arrival, self.seed)
        after = self.ramp_s if load.ramp and ramp_at else 0.0
        warm = [dataclasses.replace(r, offset_s=o) for r, o in zip(load.ramp, ramp_at)] if after else []
        return Load([dataclasses.replace(r, offset_s=after + o) for r, o in zip(load.requests, offsets)], warm)


_Job = TypeVar("_Job")


async def _closed_loop(jobs: Sequence[_Job], at_once: int, do: Callable[[_Job], Awaitable[None]]) -> None:
    """`do` each job, in order, `at_once` at a time (at least one): each of `at_once` workers
    takes the next job as soon as its last one ended (the closed loop of `ClosedLoop` and
    `Sessions`)."""
    queue = list(jobs)[::-1]

    async def worker() -> None:
        while queue:
            await do(queue.pop())

    await asyncio.gather(*(worker() for _ in range(max(1, at_once))))


_AtOnceShape = TypeVar("_AtOnceShape", bound="_AtOnce")


@dataclass(frozen=True, slots=True)
class _AtOnce(Shape):
    """A closed loop of `at_once` workers, each taking its next job (a request, a conversation)
    as soon as its last one ended (`_closed_loop`); a sweep grows `at_once`, and a fleet gives
    each worker some of the loops."""

    at_once: int
    splits: ClassVar[bool] = True

    def at(self: _AtOnceShape, n: float) -> _AtOnceShape:
        return replace(self, at_once=int(n))


@dataclass(frozen=True, slots=True)
class ClosedLoop(_AtOnce):
    """`at_once` streams, each sending its next request as soon as its last one ended."""

    unit: ClassVar[str] = "streams"

    async def send(self, client: MeasuringClient, load: Load, tick: Tick = None, start: float | None = None) -> Timed:
        await _sleep_until(start)
        out = Timed()
        heap = _RunHeap()

        async def one(req: PreparedRequest) -> None:
            out.add(await client.send(req), req.source_id)
            heap.record_done()
            if tick:
                tick()

        try:
            await _closed_loop(load.requests, self.at_once, one)
        finally:
            heap.release()
        return out

    def split(self, load: Load, n: int) -> list[tuple[Shape, Load]]:
        """Stream s on worker s mod n, with that stream's share of the requests."""
        return [(ClosedLoop(s), Load(rs)) for s, rs in plan_closed(load.requests, self.at_once, n)]


@dataclass(frozen=True, slots=True)
class Waves(Shape):
    """Waves of `size` requests released together: every task is started and waiting on one
    gate before the gate opens (the double-batch method), each on a new connection. The
    records of each wave are the result's `waves`."""

    size: int

    async def send(self, client: MeasuringClient, load: Load, tick: Tick = None, start: float | None = None) -> Timed:
        await _sleep_until(start)
        out = Timed()
        items = list(load.requests)
        for i in range(0, len(items), self.size):
            wave = items[i : i + self.size]
            gate = asyncio.Event()
            ready = 0
            all_ready = asyncio.Event()

            # awaited within this iteration (gather below), so the loop variables are this wave's
            async def one(req: PreparedRequest) -> Record:
                nonlocal ready
                ready += 1
                if ready == len(wave):  # noqa: B023
                    all_ready.set()  # noqa: B023
                await gate.wait()  # noqa: B023
                return await client.send(req, fresh_connection=True)

            tasks = [asyncio.ensure_future(one(r)) for r in wave]
            await all_ready.wait()
            gate.set()
            recs = list(await asyncio.gather(*tasks))
            for req, r in zip(wave, recs):
                out.source_ids[r.id] = req.source_id
                if tick:
                    tick()
            out.records.extend(recs)
            out.waves.append(recs)
        return out


@dataclass(frozen=True, slots=True)
class Sessions(_AtOnce):
    """Conversations, `at_once` at a time: each run its turns in order with its think time; a
    worker takes the next run when its last one ends. The result has each record's `session`
    (its run's number), `turn` and `think_s` (`where`) and each run's wall time."""

    unit: ClassVar[str] = "sessions"

    async def send(self, client: MeasuringClient, load: Load, tick: Tick = None, start: float | None = None) -> Timed:
        await _sleep_until(start)
        ids = load.run_ids
        out = Timed()

        async def one(run: tuple[int, Sequence[Turn]]) -> None:
            si, turns = run
            t0 = ended = time.perf_counter()
            for ti, turn in enumerate(turns):
                if ti:
                    # the think time runs from the response's end (its record's clock), not from
                    # when the client had finished checking it: that CPU, serialized over the
                    # conversations' threads on a busy host, spread the sends of turns that end
                    # together, and a server that admits the requests queued when it looks left
                    # the late ones a whole batch behind
                    await asyncio.sleep(max(0.0, turn.think_s - (time.perf_counter() - ended)))
                r = await client.send(turn.request)
                ended = r.t_end_mono if r.duration_s is not None else time.perf_counter()
                out.add(r, turn.request.source_id)
                out.where[r.id] = SessionTurn(ids[si] if ids else si, ti, turn.think_s)
                if tick:
                    tick()
            out.session_s.append(time.perf_counter() - t0)

        await _closed_loop(list(enumerate(load.runs)), self.at_once, one)
        return out

    def split(self, load: Load, n: int) -> list[tuple[Shape, Load]]:
        """Slot k of the conversations at once on worker k mod n: a conversation never moves."""
        parts = plan_sessions(load.runs, self.at_once, n)
        return [(Sessions(s), Load(runs=rs, run_ids=ids)) for s, rs, ids in parts]


@dataclass(frozen=True, slots=True)
class Burst(DueTimes):
    """Bursts: `size` requests due together every `every_s` seconds, whatever the server does
    (a step from nothing to `size` at once, again and again); each burst's lag is kept."""

    size: int
    every_s: float

    def due(self, load: Load) -> Load:
        size = max(1, self.size)
        return Load([dataclasses.replace(r, offset_s=(i // size) * self.every_s) for i, r in enumerate(load.requests)])


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
        return self.inner.unit

    def at(self, n: float) -> SweptShape:
        """The inner shape at the count `n`."""
        return self.inner.at(n)

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
