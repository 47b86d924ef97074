"""The one runner: any load shape, sent from this process or spread over a fleet of workers
(`mlxproxy.load.fleet.Workers`: local processes or a Dask cluster), with the same records back.

The commands build requests and a shape and call `send`; a sweep's steps (`open_loop_step`,
`closed_loop_step`, `sessions_step`) send each step's shape through it too. The fleet is handed
in (a `Fleet`), so sending never imports the fleet that runs it elsewhere.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from mlxproxy.load.judge.capacity import MIN_PER_STREAM
from mlxproxy.load.run.client import MeasuringClient, PreparedRequest, Timed
from mlxproxy.load.run.shapes import ClosedLoop, Load, OpenLoop, Sessions, Shape, Tick, Turn
from mlxproxy.load.run.sweep import StepRun, mix_copies

__all__ = ["Fleet", "ONE_PROCESS", "OneProcess", "closed_loop_step", "open_loop_step", "send", "sessions_step"]

#: the parts of a test for `n` workers (a shape's `split` of its load)
Plan = Callable[[int], list[tuple[Shape, Load]]]


class Fleet(Protocol):
    """Where a test is sent from: this process (`ONE_PROCESS`), or several workers that each
    send their part of the plan from one shared start and whose records come back merged."""

    @property
    def parallel(self) -> bool: ...

    async def send(self, plan: Plan, client: MeasuringClient, tick: Tick) -> Timed: ...


@dataclass(frozen=True, slots=True)
class OneProcess:
    """Everything sent from this process."""

    @property
    def parallel(self) -> bool:
        return False

    async def send(self, plan: Plan, client: MeasuringClient, tick: Tick) -> Timed:
        ((shape, load),) = plan(1)
        return await shape.send(client, load, tick)


#: the default: everything sent from this process
ONE_PROCESS = OneProcess()


async def send(
    shape: Shape, load: Load, client: MeasuringClient, *, fleet: Fleet = ONE_PROCESS, tick: Tick = None
) -> Timed:
    """`load` sent in `shape` through `client`, from `fleet`: a shape that cannot be split (one
    request at a time, waves released together) is always sent from this process."""
    if not fleet.parallel or not shape.splits:
        return await shape.send(client, load, tick)
    return await fleet.send(lambda n: shape.split(load, n), client, tick)


def open_loop_step(
    client: MeasuringClient, make: Callable[[int], list[PreparedRequest]], n: int, fleet: Fleet = ONE_PROCESS
) -> Callable[[OpenLoop], Awaitable[StepRun]]:
    """A sweep step of the `n` requests `make(n)` returns (the same at every rate), sent in
    the step's open loop (after its unmeasured ramp, if it has one), from `fleet`."""

    async def step(shape: OpenLoop) -> StepRun:
        timed = await send(shape, Load(make(n), make(shape.ramp_size())), client, fleet=fleet)
        return timed, timed.where

    return step


def closed_loop_step(
    client: MeasuringClient,
    make: Callable[[int], list[PreparedRequest]],
    mix_size: int,
    per_stream: int = 1,
    fleet: Fleet = ONE_PROCESS,
) -> Callable[[ClosedLoop], Awaitable[StepRun]]:
    """A sweep step of the step's streams sending whole copies of a mix (`make(k)`: k copies
    of the mix's `mix_size` requests, in order), `mix_copies` of them, from `fleet`."""

    async def step(shape: ClosedLoop) -> StepRun:
        copies = mix_copies(shape.at_once, mix_size, max(per_stream, MIN_PER_STREAM))
        timed = await send(shape, Load(make(copies)), client, fleet=fleet)
        return timed, timed.where

    return step


def sessions_step(
    client: MeasuringClient, make: Callable[[int], Sequence[Sequence[Turn]]], fleet: Fleet = ONE_PROCESS
) -> Callable[[Sessions], Awaitable[StepRun]]:
    """A sweep step of the conversation runs `make(k)` returns for `k` conversations at once."""

    async def step(shape: Sessions) -> StepRun:
        timed = await send(shape, Load(runs=make(shape.at_once)), client, fleet=fleet)
        return timed, timed.where

    return step
