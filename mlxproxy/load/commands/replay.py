"""`mlxproxy replay`: send a capture again against any target and measure it.

The options are read once, at the top (`replay_plan`): they become the rewrites and repeats of
what is sent (`replay_requests.ReplaySource`), the groups' params, and the one test they ask for,
one small frozen class per kind of test carrying only its own fields (its shape, SLO, think time,
fleet). What is sent, and the documented rewrites of the captured requests:
`mlxproxy.load.commands.replay_requests`; the groups: `mlxproxy.load.commands.replay_groups`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Generic

from mlxproxy.capture import CapturedRequest
from mlxproxy.core.cachecheck import PrefixIndex
from mlxproxy.core.detect import Thresholds, prefill_scaling
from mlxproxy.core.record import Record
from mlxproxy.core.stats import summarize
from mlxproxy.edge.runner import run_async
from mlxproxy.load.commands.common import SweepsOnTarget, client_for
from mlxproxy.load.commands.fixreplay import FIX_SUFFIX, fix_savings, fixed_captures
from mlxproxy.load.commands.replay_groups import compare_rows, interrupted_group, replay_group
from mlxproxy.load.commands.replay_requests import ReplaySource, Rewrites, generation_mix, split_sessions
from mlxproxy.load.commands.sweep_options import SweepOptions
from mlxproxy.load.data.results import Group, GroupKind, SessionTurn
from mlxproxy.load.data.summary import JSONObject, JSONValue, Summary
from mlxproxy.load.data.targets import Target
from mlxproxy.load.fleet.threads import streams_fleet
from mlxproxy.load.judge.slo import DEFAULT_SLO, parse_slo
from mlxproxy.load.output.progress import Progress
from mlxproxy.load.output.report import summarize_records
from mlxproxy.load.run.client import MeasuringClient, Timed
from mlxproxy.load.run.runner import ONE_PROCESS, Fleet, closed_loop_step, open_loop_step, send, sessions_step
from mlxproxy.load.run.shapes import (
    ClosedLoop,
    Load,
    OpenLoop,
    Recorded,
    Sequential,
    Sessions,
    Shape,
    Sweep,
    SweptShape,
    Waves,
)
from mlxproxy.load.run.sweep import session_runs

__all__ = ["MODES", "Mode", "ReplayOptions", "ReplayPlan", "replay_plan", "run_replay", "run_sessions"]


@dataclass(frozen=True)
class ReplayOptions:
    """replay's options as the command takes them; `replay_plan` types them, the one place they are read."""

    mode: str = "recorded"  # a key of MODES
    speed: float = 1.0
    concurrency: int = 1
    batch: int = 2
    repeat: int = 1
    warmup: int = 0
    nonce: bool = True
    batches: tuple[int, ...] = ()  # batch mode: wave sizes, one group each (default: (batch,))
    model: str | None = None
    rate: float | None = None  # rate mode: requests/s (open loop)
    arrival: str = "constant"  # rate mode: constant | poisson
    seed: int = 0  # rate mode: the Poisson schedule's seed
    ramp_s: float = 0.0  # rate mode: an unmeasured ramp up to the rate first
    sweep: SweepOptions | None = None  # steps of growing load (sweep_steps, or doubling from 1)
    sweep_steps: tuple[float, ...] = ()
    slo: dict[str, float] | None = None  # the sweep's SLO (default: mlxproxy.load.DEFAULT_SLO)
    sessions: int = 1  # sessions mode: conversations run at once
    think_time: float | None = None  # sessions mode: seconds from a response's end to the next turn (None: captured)
    workers: Fleet = ONE_PROCESS  # the processes or cluster the requests are sent from (not sequential, batch)
    fix: bool = False  # sessions mode: each conversation again with the fix applied (commands/fixreplay.py)


@dataclass(frozen=True)
class OnTarget(SweepsOnTarget):
    """One replay against one target as its test sees it: the client, what it sends, the groups
    it adds to and their params."""

    client: MeasuringClient
    source: ReplaySource
    target: str
    th: Thresholds
    compare: bool
    groups: list[Group]
    params: JSONObject
    say: Callable[[str], None] | None

    def finish(self, mode: str, kind: GroupKind, timed: Timed, summary: Summary, params: JSONObject) -> None:
        scaling = prefill_scaling(timed.records, self.th)
        if scaling is not None:
            summary = summary.with_anomaly(scaling.kind, 1, scaling.evidence)
        rows = compare_rows(self.source.caps, timed) if self.compare else None
        self.groups.append(replay_group(mode, kind, self.target, params, timed, summary, rows))

    def sweep_into(self) -> tuple[str, list[Group]]:
        return self.target, self.groups


class ReplayTest:
    """One kind of replay test: its name (the group's mode), how many requests the progress
    line counts on (None: not known in advance) and how it runs against one target."""

    name: str

    def total(self, n: int) -> int | None:
        return n

    async def run(self, on: OnTarget, tick: Progress) -> None:
        raise NotImplementedError


@dataclass(frozen=True)
class SweepTest(ReplayTest, Generic[SweptShape]):
    """A sweep of one shape, judged against `slo` as it goes, from `fleet`: how many requests it
    sends is known only as it goes."""

    name: str
    sweep: Sweep[SweptShape]
    slo: dict[str, float]
    fleet: Fleet = ONE_PROCESS

    def total(self, n: int) -> int | None:
        return None


@dataclass(frozen=True)
class OneShape(ReplayTest):
    """The capture sent once in one shape: recorded offsets, one at a time or a closed loop."""

    name: str
    shape: Shape
    fleet: Fleet = ONE_PROCESS

    async def run(self, on: OnTarget, tick: Progress) -> None:
        timed = await send(self.shape, self.load(on), on.client, fleet=self.fleet, tick=tick)
        self.finish(on, timed)

    def load(self, on: OnTarget) -> Load:
        return Load(on.source.fresh())

    def finish(self, on: OnTarget, timed: Timed) -> None:
        summary = timed.annotate(summarize_records(timed.records, lag_s=timed.lag_s or None))
        on.finish(self.name, "replay", timed, summary, on.params)


@dataclass(frozen=True)
class Rate(OneShape):
    """The capture in an open loop, after its unmeasured ramp."""

    shape: OpenLoop

    def load(self, on: OnTarget) -> Load:
        return Load(on.source.fresh(), on.source.cycled(self.shape.ramp_size()))

    def finish(self, on: OnTarget, timed: Timed) -> None:
        sent = [x.t_start_mono for x in timed.records]
        summary = timed.annotate(summarize_records(timed.records, lag_s=timed.lag_s, send_times=sent))
        on.finish(self.name, "rate", timed, summary, {**on.params, **self.shape.params(len(timed.records))})


@dataclass(frozen=True)
class Batch(ReplayTest):
    """The capture one at a time (`single`), then in waves of each size released together."""

    sizes: tuple[int, ...]
    name: str = "batch"

    def total(self, n: int) -> int | None:
        return n * (1 + len(self.sizes))

    async def run(self, on: OnTarget, tick: Progress) -> None:
        single = await send(Sequential(), Load(on.source.fresh()), on.client, tick=tick)
        s_single = summarize_records(single.records)
        on.groups.append(replay_group("single", "single", on.target, on.params, single, s_single))
        for size in self.sizes:
            timed = await send(Waves(size), Load(on.source.fresh()), on.client, tick=tick)
            summary = summarize_records(timed.records, waves=timed.waves, single_wall_tps=s_single.wall_tps.p50)
            on.finish(f"batch {size}", "wave", timed, summary, {**on.params, "batch": size})


@dataclass(frozen=True)
class Conversations(ReplayTest):
    """The capture's conversations, `at_once` at a time, each whole with its think time (and,
    with `fix`, again with the fix applied)."""

    name: str
    at_once: int
    think_time: float | None = None
    fix: bool = False
    fleet: Fleet = ONE_PROCESS

    async def run(self, on: OnTarget, tick: Progress) -> None:
        source = on.source
        runs = max(self.at_once, len(split_sessions(source.caps)) * source.repeat)
        timed, where, sess = await run_sessions(
            on.client, source, self.at_once, runs, self.think_time, self.fleet, tick
        )
        summary = timed.annotate(summarize_records(timed.records)).updated({"sessions": sess})
        params = {**on.params, "sessions": self.at_once, "think_time": self.think_time}
        captured = replay_group(f"sessions {self.at_once}", "sessions", on.target, params, timed, summary, None, where)
        on.groups.append(captured)
        if self.fix:  # the same conversations again, the fix applied (their own nonces: a cold cache)
            fixed, applied = fixed_captures(split_sessions(source.caps))
            fixed_source = replace(source, caps=fixed)
            timed, where, sess = await run_sessions(
                on.client, fixed_source, self.at_once, runs, self.think_time, self.fleet, tick
            )
            summary = timed.annotate(summarize_records(timed.records))
            group = replay_group(captured.name + FIX_SUFFIX, "sessions", on.target, {**params, "fix": True}, timed,
                                 summary, None, where)  # fmt: skip
            fix = {"applied": dict(applied), **fix_savings(captured, group)}
            on.groups.append(group.with_summary(group.summary.updated({"sessions": sess, "fix": fix})))


@dataclass(frozen=True)
class RateSweep(SweepTest[OpenLoop]):
    """Open-loop rates at growing counts, each step the same mix cycled."""

    async def run(self, on: OnTarget, tick: Progress) -> None:
        mix, inner = on.source.mix(), self.sweep.inner
        step = open_loop_step(on.client, lambda k: on.source.cycled(k, mix), len(mix), self.fleet)
        await on.sweep(self.sweep, self.slo, step, tick, arrival=inner.arrival, seed=inner.seed, ramp_s=inner.ramp_s)


@dataclass(frozen=True)
class SessionsSweep(SweepTest[Sessions]):
    """Conversations at once at growing counts, every conversation whole at every step."""

    think_time: float | None = None

    async def run(self, on: OnTarget, tick: Progress) -> None:
        on.source.mix()  # (a sweep needs generation requests)
        mix = replace(on.source, caps=generation_mix(on.source.caps))
        turns = [len(c) for c in split_sessions(mix.caps)] * mix.repeat
        if on.client.prefixes is None:  # each turn's re-prefill cause (the report's sessions view)
            on.client.prefixes = PrefixIndex()
        step = sessions_step(
            on.client, lambda k: mix.conversations(session_runs(k, turns), self.think_time), self.fleet
        )
        await on.sweep(self.sweep, self.slo, step, tick, think_time=self.think_time)


@dataclass(frozen=True)
class StreamsSweep(SweepTest[ClosedLoop]):
    """Closed-loop streams at growing counts, each stream sending whole copies of the mix."""

    async def run(self, on: OnTarget, tick: Progress) -> None:
        mix = on.source.mix()
        step = closed_loop_step(on.client, lambda k: on.source.cycled(k * len(mix), mix), len(mix), 1, self.fleet)
        await on.sweep(self.sweep, self.slo, step, tick)


@dataclass(frozen=True)
class Mode:
    """One `--mode`, declared once: what its test is and the options it alone takes or cannot run
    without (the command's checks), its groups' name and its test, once and (if it can be) swept."""

    help: str  # its part of --mode's help
    test: str  # what it runs, for the line naming two tests asked for at once
    name: Callable[[ReplayOptions], str | None]  # its groups' mode (None: it cannot be named)
    once: Callable[[ReplayOptions, str], ReplayTest]
    swept: Callable[[ReplayOptions, str, SweepOptions, dict[str, float]], ReplayTest] | None = None  # None: no sweep
    takes: tuple[str, ...] = ()  # the options no other mode takes
    needs: str = ""  # the values of its own option (--rate, --sessions) it cannot run without
    doubles: bool = True  # a sweep of it needs none of them: it doubles from 1
    one_process: bool = False  # sent from one process whatever --workers says


#: replay's modes, in `--mode`'s order; `--concurrency`, `--batch`, `--rate`, `--sessions` each imply their own
MODES: dict[str, Mode] = {
    "recorded": Mode(
        "at the captured offsets / --speed (default)", "the captured timing", lambda o: f"recorded x{o.speed:g}",
        lambda o, name: OneShape(name, Recorded(o.speed), o.workers), takes=("--speed",),
    ),
    "sequential": Mode(
        "one at a time", "one at a time", lambda o: "sequential", lambda o, name: OneShape(name, Sequential()),
        one_process=True,
    ),
    "concurrency": Mode(
        "closed loop of --concurrency", "a closed loop", lambda o: f"concurrency {o.concurrency}",
        lambda o, name: OneShape(name, ClosedLoop(o.concurrency), streams_fleet(o.workers)),
        lambda o, name, sweep, slo: StreamsSweep(name, sweep.of(ClosedLoop(1), o.sweep_steps), slo, streams_fleet(o.workers)),
    ),
    "batch": Mode(
        "waves of --batch released together, after a one-at-a-time baseline that gives the speedup",
        "waves released together", lambda o: "batch", lambda o, name: Batch(o.batches or (o.batch,)), one_process=True,
    ),
    "rate": Mode(
        "open loop at --rate", "an open loop", lambda o: f"{o.arrival} {o.rate:g}/s" if o.rate else None,
        lambda o, name: Rate(name, OpenLoop(o.rate or 1.0, o.arrival, o.seed, o.ramp_s), o.workers),
        lambda o, name, sweep, slo: RateSweep(
            name, sweep.of(OpenLoop(1.0, o.arrival, o.seed, o.ramp_s), o.sweep_steps or (o.rate or 1.0,)), slo,
            o.workers,
        ),
        needs="R (requests per second)", doubles=False,
    ),
    "sessions": Mode(
        "conversations, --sessions at once", "conversations", lambda o: f"sessions {o.sessions}",
        lambda o, name: Conversations(name, o.sessions, o.think_time, o.fix, streams_fleet(o.workers)),
        lambda o, name, sweep, slo: SessionsSweep(
            name, sweep.of(Sessions(1), o.sweep_steps), slo, streams_fleet(o.workers), o.think_time
        ),
        takes=("--think-time", "--fix"), needs="N (conversations at once)",
    ),
}  # fmt: skip


@dataclass(frozen=True)
class ReplayPlan:
    """replay's options typed once (`replay_plan`): the test, the rewrites and repeats of what it
    sends, the warm-up and the groups' params."""

    test: ReplayTest
    rewrites: Rewrites
    repeat: int
    warmup: int
    params: JSONObject


def replay_plan(opts: ReplayOptions) -> ReplayPlan:
    """The plan the options ask for: the one place replay's options are read (ValueError for an
    unknown mode, before anything is sent)."""
    params: dict[str, JSONValue] = {
        "speed": opts.speed,
        "concurrency": opts.concurrency,
        "batch": opts.batch,
        "repeat": opts.repeat,
        "nonce": opts.nonce,
        "model": opts.model,
    }
    return ReplayPlan(_test(opts), Rewrites(opts.model, opts.nonce), opts.repeat, opts.warmup, params)


def _test(opts: ReplayOptions) -> ReplayTest:
    """The test the options ask for: its mode's, once or swept."""
    mode = MODES.get(opts.mode)
    name = mode.name(opts) if mode else None
    if mode is None or name is None:
        raise ValueError(f"unknown replay mode {opts.mode!r}")
    if opts.sweep is None:
        return mode.once(opts, name)
    if mode.swept is None:
        raise ValueError(f"replay mode {opts.mode!r} cannot be swept")
    return mode.swept(opts, name, opts.sweep, opts.slo or parse_slo(DEFAULT_SLO))


async def run_replay(
    caps: Sequence[CapturedRequest],
    target: Target,
    opts: ReplayOptions,
    *,
    compare: bool = False,
    out: list[Group] | None = None,
    say: Callable[[str], None] | None = None,
) -> list[Group]:
    """Run one replay against `target`; return the result groups (see `mlxproxy.load.output.report`). Groups are
    appended to `out` (when given) as they finish; when the run is cancelled (Ctrl-C),
    the requests finished so far are appended as one more group (mode `... interrupted`). The run's
    lines go to `say`, with its progress (drawn on a terminal, a plain line now and then elsewhere);
    without `say` it prints nothing."""
    plan = replay_plan(opts)  # an unknown mode fails before anything is sent
    th = Thresholds()
    groups: list[Group] = out if out is not None else []
    source = ReplaySource(caps, plan.rewrites, plan.repeat)
    async with client_for(target, th) as client:
        on = OnTarget(client, source, target.name, th, compare, groups, plan.params, say)
        if plan.warmup:
            await send(Sequential(), Load(source.first(plan.warmup)), client)
        measured_from = len(client.finished)
        tick = Progress(
            f"replay {target.name}", plan.test.total(len(caps) * plan.repeat), None if say else False, client
        )
        tick.start()
        try:
            await plan.test.run(on, tick)
        except asyncio.CancelledError:
            rest = interrupted_group(plan.test.name, target.name, plan.params, groups, client.finished[measured_from:])
            groups.extend([rest] if rest else [])
            raise
        finally:
            tick.close()
    return groups


async def run_sessions(
    client: MeasuringClient,
    source: ReplaySource,
    at_once: int,
    runs: int,
    think_time: float | None = None,
    fleet: Fleet = ONE_PROCESS,
    tick: Callable[[], None] | None = None,
) -> tuple[Timed, dict[str, SessionTurn], JSONObject]:
    """`at_once` conversations at a time, `runs` conversation runs in all (the capture's
    conversations in order, cycled), each its turns in order with the think time between
    a response's end and the next turn (`Sessions`); each run has its own nonce (so it is a
    conversation of its own, never the continuation of another run). Returns the records,
    each record's `session`, `turn` and `think_s`, and the `sessions` summary. The client
    keeps the prompts' fingerprints (each turn's re-prefill cause, the report's sessions view)."""
    if client.prefixes is None:
        client.prefixes = PrefixIndex()
    plans = source.conversations(runs, think_time)
    timed = await send(Sessions(at_once), Load(runs=plans), client, fleet=fleet, tick=tick)
    conversations = len(split_sessions(source.caps))
    return timed, timed.where, {"count": runs, "conversations": conversations, "session_s": summarize(timed.session_s)}


def run(caps: Sequence[CapturedRequest], target_url: str, opts: ReplayOptions, **kw: Any) -> list[Group]:
    """`run_replay` against the target at `target_url`, named `target`, to the end."""
    return run_async(run_replay(caps, Target("target", target_url), opts, **kw))


def records_of(group: Group) -> list[Record]:
    return [r.record for r in group.records]
