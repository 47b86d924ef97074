"""`mlxproxy replay`: send a capture again against any target and measure it.

Documented rewrites of the captured request body (nothing else changes):
  - streaming chat and text completions get `stream_options.include_usage: true` (so usage
    can be checked; Anthropic Messages and OpenAI Responses streams always carry usage);
  - `--model NAME` replaces `model`;
  - the nonce (on by default; `--no-nonce` turns it off) prefixes the first message (or
    the prompt, or a Responses `input`) with `[nonce <hex>] `, a new one for every request sent (the baseline and
    the waves of `--batch`, every repeat), so no prompt cache can serve the request;
  - a privacy capture (`capture_prompts: false`) has only message lengths: each message is
    sent as filler text of its recorded length.
Captured headers are sent again except redacted ones and hop-by-hop ones; `--api-key-env`
supplies the target's key.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any

from mlxproxy.capture import CapturedRequest
from mlxproxy.core.cachecheck import PrefixIndex
from mlxproxy.core.detect import MOSTLY_CACHED, Thresholds, prefill_scaling
from mlxproxy.core.record import Record
from mlxproxy.core.stats import summarize
from mlxproxy.edge.runner import run_async
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
        self.mode = _mode_name(opts)

    def fresh(self) -> list[PreparedRequest]:
        return [prepare(c, self.opts) for _ in range(self.opts.repeat) for c in self.caps]

    def finish(self, mode: str, kind: GroupKind, timed: Timed, summary: Summary, params: JSONObject) -> None:
        scaling = prefill_scaling(timed.records, self.th)
        if scaling is not None:
            summary = summary.with_anomaly(scaling.kind, 1, scaling.evidence)
        rows = compare_rows(self.by_id, timed) if self.compare else None
        self.groups.append(_group(mode, kind, self.target, params, timed, summary, rows))

    def shape(self) -> Shape:
        """The load shape of a single test (not a sweep, sessions or batch)."""
        opts = self.opts
        if opts.mode == "recorded":
            return Recorded(opts.speed)
        if opts.mode == "rate":
            return OpenLoop(opts.rate or 1.0, opts.arrival, opts.seed, opts.ramp_s)
        if opts.mode == "concurrency":
            return ClosedLoop(opts.concurrency)
        return Sequential()

    async def run(self, tick: Progress) -> None:
        opts = self.opts
        if opts.sweep:
            await self.sweep(tick)
        elif opts.mode == "sessions":
            await self.sessions(tick)
        elif opts.mode == "batch":
            await self.batch(tick)
        elif opts.mode == "rate":
            shape = OpenLoop(opts.rate or 1.0, opts.arrival, opts.seed, opts.ramp_s)
            ramp = [prepare(self.caps[i % len(self.caps)], opts) for i in range(shape.ramp_size())]
            timed = await send(shape, Load(self.fresh(), ramp), self.client, fleet=opts.workers, tick=tick)
            sent = [r.t_start_mono for r in timed.records]
            summary = timed.annotate(summarize_records(timed.records, lag_s=timed.lag_s, send_times=sent))
            self.finish(self.mode, "rate", timed, summary, {**self.params, **shape.params(len(timed.records))})
        else:
            timed = await send(self.shape(), Load(self.fresh()), self.client, fleet=opts.workers, tick=tick)
            summary = timed.annotate(summarize_records(timed.records, lag_s=timed.lag_s or None))
            self.finish(self.mode, "replay", timed, summary, self.params)

    async def sessions(self, tick: Progress) -> None:
        opts = self.opts
        runs = max(opts.sessions, len(split_sessions(self.caps)) * opts.repeat)
        timed, where, sess = await run_sessions(self.client, self.caps, opts, opts.sessions, runs, tick)
        summary = timed.annotate(summarize_records(timed.records)).updated({"sessions": sess})
        params = {**self.params, "sessions": opts.sessions, "think_time": opts.think_time}
        self.groups.append(
            _group(f"sessions {opts.sessions}", "sessions", self.target, params, timed, summary, None, where)
        )

    async def batch(self, tick: Progress) -> None:
        single = await send(Sequential(), Load(self.fresh()), self.client, tick=tick)
        s_single = summarize_records(single.records)
        self.groups.append(_group("single", "single", self.target, self.params, single, s_single))
        for size in self.opts.batches or (self.opts.batch,):
            timed = await send(Waves(size), Load(self.fresh()), self.client, tick=tick)
            summary = summarize_records(timed.records, waves=timed.waves, single_wall_tps=s_single.wall_tps.p50)
            self.finish(f"batch {size}", "wave", timed, summary, {**self.params, "batch": size})

    async def sweep(self, tick: Progress) -> None:
        """A sweep of the capture's generation requests (the same mix at every step): rates
        (open loop), conversations (whole, every turn) or closed-loop streams."""
        opts = self.opts
        mix = generation_mix(self.caps)
        if not mix:
            raise ValueError(
                "a sweep needs generation requests (chat, completions, messages, responses); none selected"
            )
        reps = [c for _ in range(opts.repeat) for c in mix]

        def copies(k: int) -> list[PreparedRequest]:
            return [prepare(reps[i % len(reps)], opts) for i in range(k * len(reps))]

        def cycle(k: int) -> list[PreparedRequest]:
            return [prepare(reps[i % len(reps)], opts) for i in range(k)]

        slo = opts.slo or parse_slo(DEFAULT_SLO)

        async def sweep(
            shape: Sweep[SweptShape], step: Callable[[SweptShape], Awaitable[StepRun]], **params: JSONValue
        ) -> None:
            await shape.run(
                step, slo, target=self.target, params={**self.params, **params}, out=self.groups, say=self.say,
                progress=tick,
            )  # fmt: skip

        steps, refine, budget = opts.sweep_steps, opts.refine, opts.budget_s
        if opts.mode == "rate":
            open_loop = OpenLoop(1.0, opts.arrival, opts.seed, opts.ramp_s)
            shape = Sweep(open_loop, steps or (opts.rate or 1.0,), refine, budget)
            step = open_loop_step(self.client, cycle, len(reps), opts.workers)
            await sweep(shape, step, arrival=opts.arrival, seed=opts.seed, ramp_s=opts.ramp_s)
        elif opts.mode == "sessions":
            convs = len(split_sessions(mix))
            step_s = sessions_step(
                self.client, lambda k: session_runs(self.client, mix, opts, k * convs * opts.repeat), opts.workers
            )
            await sweep(Sweep(Sessions(1), steps, refine, budget), step_s, think_time=opts.think_time)
        else:
            await sweep(
                Sweep(ClosedLoop(1), steps, refine, budget),
                closed_loop_step(self.client, copies, len(reps), 1, opts.workers),
            )

    def interrupted(self, measured_from: int) -> None:
        """The requests finished so far but in no group yet, as one more group."""
        done = {r.id for g in self.groups for r in g.records}
        rest = [r for r in self.client.finished[measured_from:] if r.id not in done]
        if rest:
            name = f"{self.mode} interrupted"
            self.groups.append(
                _group(name, "interrupted", self.target, self.params, Timed(rest), summarize_records(rest))
            )


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
    _mode_name(opts)  # an unknown mode fails before anything is sent
    n = len(caps) * opts.repeat
    async with MeasuringClient(
        target_url, name=target_name, thresholds=th, api_key=api_key, timeout_s=timeout_s
    ) as client:
        if opts.warmup:
            await send(Sequential(), Load([prepare(c, opts) for c in caps[: opts.warmup]]), client)
        measured_from = len(client.finished)
        run = _ReplayRun(client, caps, opts, target_name, th, compare, groups, say)
        total = None if opts.sweep else n * (1 + len(opts.batches or (opts.batch,)) if opts.mode == "batch" else 1)
        tick = Progress(f"replay {target_name}", total, progress, client)
        tick.start()
        try:
            await run.run(tick)
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
