"""`mlxproxy replay`: send a capture again against any target and measure it: the tests it
runs (one small class per kind of test, typed by its shape, chosen once from the options:
`chosen_test`), their groups and the conversations' runs. What is sent, and the documented
rewrites of the captured requests: `mlxproxy.load.commands.replay_requests`.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mlxproxy.capture import CapturedRequest
from mlxproxy.core.cachecheck import PrefixIndex
from mlxproxy.core.detect import MOSTLY_CACHED, Thresholds, prefill_scaling
from mlxproxy.core.record import Record
from mlxproxy.core.stats import summarize
from mlxproxy.edge.runner import run_async
from mlxproxy.load.commands.fixreplay import FIX_SUFFIX, fix_savings, fixed_captures
from mlxproxy.load.commands.replay_requests import (
    ReplayOptions,
    captured_think_s,
    generation_mix,
    prepare,
    split_sessions,
)
from mlxproxy.load.data.results import CompareRow, Group, GroupKind, RunRecord, SessionTurn
from mlxproxy.load.data.summary import JSONObject, JSONValue, Summary
from mlxproxy.load.judge.slo import DEFAULT_SLO, parse_slo
from mlxproxy.load.output.progress import Progress
from mlxproxy.load.output.report import summarize_records
from mlxproxy.load.run.client import MeasuringClient, PreparedRequest, Timed
from mlxproxy.load.run.runner import closed_loop_step, open_loop_step, send, sessions_step
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
    Turn,
    Waves,
)
from mlxproxy.load.run.sweep import StepRun

__all__ = ["run_replay", "run_sessions", "session_runs"]


def compare_rows(caps: dict[str, CapturedRequest], timed: Timed) -> list[CompareRow]:
    """Each replayed request's TTFT and decode TPS next to its captured values."""
    rows: list[CompareRow] = []
    for r in timed.records:
        src = timed.source_ids.get(r.id)
        c = caps.get(src) if src else None
        if src is None or c is None:
            continue
        rows.append(
            {
                "source_id": src,
                "model": r.model,
                "captured_ttft_s": c.record.ttft_s,
                "replayed_ttft_s": r.ttft_s,
                "captured_cached_tokens": c.record.cached_tokens,
                "replayed_cached_tokens": r.cached_tokens,
                "replayed_prompt_tokens": r.prompt_tokens,
                "captured_decode_tps": c.record.decode_tps,
                "replayed_decode_tps": r.decode_tps,
                "captured_outcome": c.record.outcome,
                "replayed_outcome": r.outcome,
            }
        )
    return rows


def served_from_cache(records: Iterable[RunRecord]) -> tuple[int, int]:
    """(requests whose prompt was mostly cached, requests that reported prompt tokens):
    their TTFT measures the prompt cache, not prefill."""
    reported = [(p, r.record.cached_tokens or 0) for r in records if (p := r.record.prompt_tokens)]
    cached = [p for p, c in reported if c > MOSTLY_CACHED * p]
    return len(cached), len(reported)


def _group(
    name: str,
    kind: GroupKind,
    target: str,
    params: JSONObject,
    timed: Timed,
    summary: Summary,
    compare: list[CompareRow] | None = None,
    where: Mapping[str, SessionTurn] | None = None,
) -> Group:
    """A group of `timed`'s records, each with its `source_id` (and its session's `where` keys)."""
    records = timed.rows(where)
    return Group(name, target, name, kind, params, summary, tuple(records), None if compare is None else tuple(compare))


class _ReplayRun:
    """One replay against one target: which load shape the options ask for, the requests it
    sends (prepared anew for every phase: with the nonce on, the baseline, each wave size and
    each repeat send prompts no cache has seen) and the groups it makes."""

    def __init__(
        self,
        client: MeasuringClient,
        caps: Sequence[CapturedRequest],
        opts: ReplayOptions,
        target: str,
        th: Thresholds,
        compare: bool,
        groups: list[Group],
        say: Callable[[str], None] | None,
    ) -> None:
        self.client, self.caps, self.opts, self.target, self.th = client, caps, opts, target, th
        self.compare, self.groups, self.say = compare, groups, say
        self.by_id = {c.record.id: c for c in caps}
        self.params: dict[str, JSONValue] = {
            "speed": opts.speed,
            "concurrency": opts.concurrency,
            "batch": opts.batch,
            "repeat": opts.repeat,
            "nonce": opts.nonce,
            "model": opts.model,
        }
        self.mode = chosen_test(opts).name

    def fresh(self) -> list[PreparedRequest]:
        return [prepare(c, self.opts) for _ in range(self.opts.repeat) for c in self.caps]

    def finish(self, mode: str, kind: GroupKind, timed: Timed, summary: Summary, params: JSONObject) -> None:
        scaling = prefill_scaling(timed.records, self.th)
        if scaling is not None:
            summary = summary.with_anomaly(scaling.kind, 1, scaling.evidence)
        rows = compare_rows(self.by_id, timed) if self.compare else None
        self.groups.append(_group(mode, kind, self.target, params, timed, summary, rows))

    async def sweep(
        self,
        shape: Sweep[SweptShape],
        step: Callable[[SweptShape], Awaitable[StepRun]],
        tick: Progress,
        **params: JSONValue,
    ) -> None:
        """`shape`'s steps, each sending through `step`, judged against the SLO as they finish."""
        await shape.run(
            step, self.opts.slo or parse_slo(DEFAULT_SLO), target=self.target, params={**self.params, **params},
            out=self.groups, say=self.say, progress=tick,
        )  # fmt: skip

    def mix(self) -> list[CapturedRequest]:
        """What a sweep sends at every step: the capture's generation requests, `--repeat` times."""
        mix = generation_mix(self.caps)
        if not mix:
            raise ValueError(
                "a sweep needs generation requests (chat, completions, messages, responses); none selected"
            )
        return [c for _ in range(self.opts.repeat) for c in mix]

    def interrupted(self, measured_from: int) -> None:
        """The requests finished so far but in no group yet, as one more group."""
        done = {r.id for g in self.groups for r in g.records}
        rest = [r for r in self.client.finished[measured_from:] if r.id not in done]
        if rest:
            name = f"{self.mode} interrupted"
            self.groups.append(
                _group(name, "interrupted", self.target, self.params, Timed(rest), summarize_records(rest))
            )


class ReplayTest:
    """One kind of replay test: its name (the group's mode), how many requests the progress
    line counts on (None: not known in advance) and how it runs (`_ReplayRun` holds the client,
    the requests and the groups)."""

    name: str

    def total(self, n: int) -> int | None:
        return n

    async def run(self, r: _ReplayRun, tick: Progress) -> None:
        raise NotImplementedError


class SweepTest(ReplayTest):
    """A sweep: how many requests it sends is known only as it goes."""

    def total(self, n: int) -> int | None:
        return None


@dataclass(frozen=True)
class OneShape(ReplayTest):
    """The capture sent once in one shape: recorded offsets, one at a time or a closed loop."""

    name: str
    shape: Shape

    async def run(self, r: _ReplayRun, tick: Progress) -> None:
        timed = await send(self.shape, Load(r.fresh()), r.client, fleet=r.opts.workers, tick=tick)
        summary = timed.annotate(summarize_records(timed.records, lag_s=timed.lag_s or None))
        r.finish(self.name, "replay", timed, summary, r.params)


@dataclass(frozen=True)
class Rate(ReplayTest):
    """The capture in an open loop, after its unmeasured ramp."""

    name: str
    shape: OpenLoop

    async def run(self, r: _ReplayRun, tick: Progress) -> None:
        ramp = [prepare(r.caps[i % len(r.caps)], r.opts) for i in range(self.shape.ramp_size())]
        timed = await send(self.shape, Load(r.fresh(), ramp), r.client, fleet=r.opts.workers, tick=tick)
        sent = [x.t_start_mono for x in timed.records]
        summary = timed.annotate(summarize_records(timed.records, lag_s=timed.lag_s, send_times=sent))
        r.finish(self.name, "rate", timed, summary, {**r.params, **self.shape.params(len(timed.records))})


@dataclass(frozen=True)
class Batch(ReplayTest):
    """The capture one at a time (`single`), then in waves of each size released together."""

    sizes: tuple[int, ...]
    name: str = "batch"

    def total(self, n: int) -> int | None:
        return n * (1 + len(self.sizes))

    async def run(self, r: _ReplayRun, tick: Progress) -> None:
        single = await send(Sequential(), Load(r.fresh()), r.client, tick=tick)
        s_single = summarize_records(single.records)
        r.groups.append(_group("single", "single", r.target, r.params, single, s_single))
        for size in self.sizes:
            timed = await send(Waves(size), Load(r.fresh()), r.client, tick=tick)
            summary = summarize_records(timed.records, waves=timed.waves, single_wall_tps=s_single.wall_tps.p50)
            r.finish(f"batch {size}", "wave", timed, summary, {**r.params, "batch": size})


@dataclass(frozen=True)
class Conversations(ReplayTest):
    """The capture's conversations, `at_once` at a time, each whole with its think time."""

    name: str
    at_once: int

    async def run(self, r: _ReplayRun, tick: Progress) -> None:
        opts = r.opts
        runs = max(self.at_once, len(split_sessions(r.caps)) * opts.repeat)
        timed, where, sess = await run_sessions(r.client, r.caps, opts, self.at_once, runs, tick)
        summary = timed.annotate(summarize_records(timed.records)).updated({"sessions": sess})
        params = {**r.params, "sessions": self.at_once, "think_time": opts.think_time}
        captured = _group(f"sessions {self.at_once}", "sessions", r.target, params, timed, summary, None, where)
        r.groups.append(captured)
        if opts.fix:  # the same conversations again, the fix applied (their own nonces: a cold cache)
            fixed, applied = fixed_captures(split_sessions(r.caps))
            timed, where, sess = await run_sessions(r.client, fixed, opts, self.at_once, runs, tick)
            summary = timed.annotate(summarize_records(timed.records))
            group = _group(captured.name + FIX_SUFFIX, "sessions", r.target, {**params, "fix": True}, timed,
                           summary, None, where)  # fmt: skip
            fix = {"applied": dict(applied), **fix_savings(captured, group)}
            r.groups.append(group.with_summary(group.summary.updated({"sessions": sess, "fix": fix})))


@dataclass(frozen=True)
class RateSweep(SweepTest):
    """Open-loop rates at growing counts, each step the same mix cycled."""

    name: str
    sweep: Sweep[OpenLoop]

    async def run(self, r: _ReplayRun, tick: Progress) -> None:
        reps, opts, inner = r.mix(), r.opts, self.sweep.inner

        def cycle(k: int) -> list[PreparedRequest]:
            return [prepare(reps[i % len(reps)], opts) for i in range(k)]

        step = open_loop_step(r.client, cycle, len(reps), opts.workers)
        await r.sweep(self.sweep, step, tick, arrival=inner.arrival, seed=inner.seed, ramp_s=inner.ramp_s)


@dataclass(frozen=True)
class SessionsSweep(SweepTest):
    """Conversations at once at growing counts, every conversation whole at every step."""

    name: str
    sweep: Sweep[Sessions]

    async def run(self, r: _ReplayRun, tick: Progress) -> None:
        r.mix()  # (a sweep needs generation requests)
        mix, opts = generation_mix(r.caps), r.opts
        convs = len(split_sessions(mix))
        step = sessions_step(
            r.client, lambda k: session_runs(r.client, mix, opts, k * convs * opts.repeat), opts.workers
        )
        await r.sweep(self.sweep, step, tick, think_time=opts.think_time)


@dataclass(frozen=True)
class StreamsSweep(SweepTest):
    """Closed-loop streams at growing counts, each stream sending whole copies of the mix."""

    name: str
    sweep: Sweep[ClosedLoop]

    async def run(self, r: _ReplayRun, tick: Progress) -> None:
        reps, opts = r.mix(), r.opts

        def copies(k: int) -> list[PreparedRequest]:
            return [prepare(reps[i % len(reps)], opts) for i in range(k * len(reps))]

        await r.sweep(self.sweep, closed_loop_step(r.client, copies, len(reps), 1, opts.workers), tick)


def chosen_test(opts: ReplayOptions) -> ReplayTest:
    """The test the options ask for, typed by its shape: the one place a replay mode is read
    (ValueError for an unknown one, before anything is sent)."""
    name = _mode_name(opts)
    steps, refine, budget = opts.sweep_steps, opts.refine, opts.budget_s
    if opts.sweep and opts.mode == "rate":
        open_loop = OpenLoop(1.0, opts.arrival, opts.seed, opts.ramp_s)
        return RateSweep(
            name, Sweep(open_loop, steps or (opts.rate or 1.0,), refine, budget, opts.step_time, opts.runs)
        )
    if opts.sweep and opts.mode == "sessions":
        return SessionsSweep(name, Sweep(Sessions(1), steps, refine, budget, opts.step_time, opts.runs))
    if opts.sweep:
        return StreamsSweep(name, Sweep(ClosedLoop(1), steps, refine, budget, opts.step_time, opts.runs))
    tests: dict[str, Callable[[], ReplayTest]] = {
        "recorded": lambda: OneShape(name, Recorded(opts.speed)),
        "sequential": lambda: OneShape(name, Sequential()),
        "concurrency": lambda: OneShape(name, ClosedLoop(opts.concurrency)),
        "rate": lambda: Rate(name, OpenLoop(opts.rate or 1.0, opts.arrival, opts.seed, opts.ramp_s)),
        "batch": lambda: Batch(opts.batches or (opts.batch,)),
        "sessions": lambda: Conversations(name, opts.sessions),
    }
    return tests[opts.mode]()


def _mode_name(opts: ReplayOptions) -> str:
    mode = {
        "recorded": f"recorded x{opts.speed:g}",
        "sequential": "sequential",
        "concurrency": f"concurrency {opts.concurrency}",
        "batch": "batch",
        "rate": f"{opts.arrival} {opts.rate:g}/s" if opts.rate else None,
        "sessions": f"sessions {opts.sessions}",
    }.get(opts.mode)
    if mode is None:
        raise ValueError(f"unknown replay mode {opts.mode!r}")
    return mode


async def run_replay(
    caps: Sequence[CapturedRequest],
    target_url: str,
    opts: ReplayOptions,
    *,
    target_name: str = "target",
    api_key: str | None = None,
    thresholds: Thresholds | None = None,
    timeout_s: float = 1800.0,
    progress: bool | None = None,
    compare: bool = False,
    out: list[Group] | None = None,
    say: Callable[[str], None] | None = None,
) -> list[Group]:
    """Run one replay; return the result groups (see `mlxproxy.load.output.report`). Groups are
    appended to `out` (when given) as they finish; when the run is cancelled (Ctrl-C),
    the requests finished so far are appended as one more group (mode `... interrupted`)."""
    th = thresholds or Thresholds()
    groups: list[Group] = out if out is not None else []
    test = chosen_test(opts)  # an unknown mode fails before anything is sent
    n = len(caps) * opts.repeat
    async with MeasuringClient(
        target_url, name=target_name, thresholds=th, api_key=api_key, timeout_s=timeout_s,
        max_connections=opts.max_connections,
    ) as client:  # fmt: skip
        if opts.warmup:
            await send(Sequential(), Load([prepare(c, opts) for c in caps[: opts.warmup]]), client)
        measured_from = len(client.finished)
        run = _ReplayRun(client, caps, opts, target_name, th, compare, groups, say)
        tick = Progress(f"replay {target_name}", test.total(n), progress, client)
        tick.start()
        try:
            await test.run(run, tick)
        except asyncio.CancelledError:
            run.interrupted(measured_from)
            raise
        finally:
            tick.close()
    return groups


async def run_sessions(
    client: MeasuringClient,
    caps: Sequence[CapturedRequest],
    opts: ReplayOptions,
    at_once: int,
    runs: int,
    tick: Callable[[], None] | None = None,
) -> tuple[Timed, dict[str, SessionTurn], JSONObject]:
    """`at_once` conversations at a time, `runs` conversation runs in all (the capture's
    conversations in order, cycled), each its turns in order with the think time between
    a response's end and the next turn (`Sessions`); each run has its own nonce (so it is a
    conversation of its own, never the continuation of another run). Returns the records,
    each record's `session`, `turn` and `think_s`, and the `sessions` summary."""
    plans = session_runs(client, caps, opts, runs)
    timed = await send(Sessions(at_once), Load(runs=plans), client, fleet=opts.workers, tick=tick)
    conversations = len(split_sessions(caps))
    return timed, timed.where, {"count": runs, "conversations": conversations, "session_s": summarize(timed.session_s)}


def session_runs(
    client: MeasuringClient, caps: Sequence[CapturedRequest], opts: ReplayOptions, runs: int
) -> list[list[Turn]]:
    """`runs` conversation runs (the capture's conversations in order, cycled), each with a
    nonce of its own; the client keeps the prompts' fingerprints (each turn's re-prefill cause,
    the report's sessions view)."""
    convs = split_sessions(caps)
    if client.prefixes is None:
        client.prefixes = PrefixIndex()
    return [_session_run(convs[i % len(convs)], opts) for i in range(runs)]


def _session_run(conv: Sequence[CapturedRequest], opts: ReplayOptions) -> list[Turn]:
    """One run of a conversation: its turns prepared with one nonce of their own, each with
    its think time (`--think-time`, else as captured)."""
    nonce = f"[nonce {os.urandom(6).hex()}] " if opts.nonce else None
    turns = []
    for ti, c in enumerate(conv):
        think = 0.0
        if ti:
            think = opts.think_time if opts.think_time is not None else captured_think_s(conv[ti - 1], c)
        turns.append(Turn(prepare(c, opts, nonce), think))
    return turns


def run(caps: Sequence[CapturedRequest], target_url: str, opts: ReplayOptions, **kw: Any) -> list[Group]:
    return run_async(run_replay(caps, target_url, opts, **kw))


def records_of(group: Group) -> list[Record]:
    return [r.record for r in group.records]
