"""Sweeps: steps of growing load run one after another, each step's group judged against the
SLO as it finishes (`--sweep`); `mlxproxy.load.run.shapes.Sweep` is the load shape that runs one.

Every step sends the same mix (the same requests or conversations, scaled by the step's
count), so steps differ only in load. Given steps run as given; without them the sweep
doubles from 1 until a step breaks the SLO, has failed requests or adds no throughput, then
refines between the last good and the first bad step by binary search on integers, for as
long as the time budget allows, so the answer is "7", not "between 4 and 8" (`--sweep auto`;
`--sweep double` stops at the powers of two).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import replace

from mlxproxy.core.record import Record
from mlxproxy.load.data.results import Group, RunRecord, SessionTurn
from mlxproxy.load.data.summary import JSONObject, JSONValue
from mlxproxy.load.judge.capacity import (
    MAX_AUTO_CONCURRENCY,
    MIN_PER_STREAM,
    MIN_STEP_REQUESTS,
    RATE_UNIT,
    Step,
    answer_of,
    certainly_breaks,
    contradictions,
    first_break,
    holds,
    knee_of,
    step_figures,
    stop_reason,
)
from mlxproxy.load.judge.slo import Judgment, judge, step_problem
from mlxproxy.load.judge.verdict import step_label
from mlxproxy.load.judge.waves import slow_looks, slow_waves
from mlxproxy.load.output.progress import Progress
from mlxproxy.load.output.report import summarize_records
from mlxproxy.load.run.client import Timed
from mlxproxy.load.run.stalls import Stall, StallWatch

__all__ = [
    "DEFAULT_BUDGET_S",
    "DEFAULT_STEP_MIN_S",
    "STALL_S",
    "StepRun",
    "run_sweep",
    "mix_copies",
    "session_runs",
    "refine_bounds",
]

#: `--sweep-budget`'s default: refining steps start only while the sweep has run less than this
DEFAULT_BUDGET_S = 600.0
#: `--step-min-s`'s default: a step sends its mix again until it has run at least this long
DEFAULT_STEP_MIN_S = 5.0
#: an event-loop stall of the load generator longer than this during a step distorts the
#: step's latencies: the step is measured again (and, stalled again, reported as such)
STALL_S = 0.1
#: each stream's first requests of a closed-loop step, sent but not judged
WARMUP_PER_STREAM = 1
#: a step is measured at most this many times (a confirmation, a contradiction, a stall)
MAX_MEASURES = 3

#: what one step returns: its records and extra keys per record id (a session's turn, ...)
StepRun = tuple[Timed, Mapping[str, SessionTurn]]
#: one round of a step's measurement: what it returned, its wall time and its warm-up's record ids
_Round = tuple[Timed, Mapping[str, SessionTurn], float, frozenset[str]]


async def run_sweep(
    step: Callable[[float], Awaitable[StepRun]],
    steps: Sequence[float],
    slo: dict[str, float],
    *,
    target: str,
    params: JSONObject,
    out: list[Group],
    say: Callable[[str], None] | None = None,
    unit: str = "streams",
    progress: Progress | None = None,
    budget_s: float = DEFAULT_BUDGET_S,
    refine: bool = True,
    min_s: float = DEFAULT_STEP_MIN_S,
    runs: int = 1,
) -> None:
    """Run `step(n)` at each of `steps` (empty: doubling from 1, then, with `refine`, refining
    within `budget_s` seconds; `mlxproxy.load.run.shapes.Sweep` runs a shape this way). Each step's
    group is appended to `out` as it finishes (a step measured again replaces its group with one
    holding every measurement); `say` gets one line per step; `progress` shows each step as a
    phase. `unit`: what the steps count (streams, sessions, req/s). A step sends its mix again
    until it has run `min_s` seconds. `runs`: the whole search that many times (each step's
    params carry its `run`)."""
    for run in range(1, max(1, runs) + 1):
        tagged = {**params, "run": run} if runs > 1 else dict(params)
        who = f"{target} (run {run} of {runs})" if runs > 1 else target
        search = _Search(step, slo, target, who, tagged, out, say, unit, progress, budget_s, min_s, not steps)
        await search.run(steps, refine)


class _Search:
    """One search for the capacity: its steps' measurements and the decisions they lead to."""

    def __init__(
        self,
        step: Callable[[float], Awaitable[StepRun]],
        slo: dict[str, float],
        target: str,
        who: str,
        params: JSONObject,
        out: list[Group],
        say: Callable[[str], None] | None,
        unit: str,
        progress: Progress | None,
        budget_s: float,
        min_s: float,
        auto: bool,
    ) -> None:
        self.step, self.slo, self.target, self.who, self.out = step, slo, target, who, out
        self.say, self.unit, self.progress, self.budget_s, self.min_s = say, unit, progress, budget_s, min_s
        self.params: JSONObject = {**params, "auto": auto, "budget_s": budget_s}
        self.t0 = time.monotonic()
        self.done: dict[float, Step] = {}
        self.groups: dict[float, Group] = {}
        self.looks: dict[float, list[list[_Round]]] = {}  # each measurement's rounds
        self.votes: dict[float, list[tuple[bool, str]]] = {}  # each measurement's own verdict and problem
        self.retaken: set[float] = set()  # sessions steps that dropped a disturbed look already

    def in_budget(self) -> bool:
        return time.monotonic() - self.t0 < self.budget_s

    def sorted_done(self) -> list[Step]:
        return [self.done[k] for k in sorted(self.done)]

    async def run(self, steps: Sequence[float], refine: bool) -> None:
        if steps:
            for n in steps:
                await self.measure(n)
            await self.settle()
            return
        n = 1
        while True:
            await self.measure(n)
            await self.settle()
            below = [s for s in self.sorted_done() if s.step <= n]
            why = stop_reason(below)
            # a break still within the noise after measuring it again does not end the doubling:
            # the next step tells where the SLO certainly breaks (the interval's top); one more
            # doubling only (the one past it breaks for sure on any server that queues)
            unsure = [s for s in below if s.slo_met is False and not s.too_small and not certainly_breaks(s)]
            if why == "slo" and not certainly_breaks(below[-1]) and len(unsure) < 2 and self.in_budget():
                why = None
            if why or n >= MAX_AUTO_CONCURRENCY:
                break
            n *= 2
        while refine and self.in_budget():
            bounds = refine_bounds(self.sorted_done())
            m = (bounds[0] + bounds[1]) // 2 if bounds is not None else self.unconfirmed()
            if m is None:
                break
            await self.measure(m, again=m in self.done)
            await self.settle()

    async def settle(self) -> None:
        """Measure again, within the budget, each step whose verdict is not yet to be trusted:
        a break of the SLO measured once and within the noise (confirmed before the search
        commits to it), a step past which throughput stopped rising measured once, and both
        steps of a contradiction (a lighter step broke, a heavier one held)."""
        while self.in_budget() and (n := self.doubtful()) is not None:
            await self.measure(n, again=True)

    def doubtful(self) -> float | None:
        steps = self.sorted_done()
        for s in steps:
            if s.measured == 1 and s.slo_met is False and not s.errors and not s.too_small and not s.certain:
                return s.step
            if s.split and s.measured < MAX_MEASURES:  # two measurements disagree: a third decides
                return s.step
        held = [s for s in steps if holds(s)]
        knee = knee_of(held)
        if knee is not None:
            flat = next((s for s in held if s.step > knee.step), None)
            if flat is not None and flat.measured == 1:
                return flat.step
        for a, b in contradictions(steps):
            for s in (a, b):
                if s.measured < MAX_MEASURES - 1:
                    return s.step
        return None

    def unconfirmed(self) -> float | None:
        """A step the answer rests on that was measured only once, or None: the answer's step
        and the next step measured above it (the first break, or the step past the knee), the
        heavier first. A measurement of a few seconds is one moment of a host whose speed drifts
        (the bootstrap interval sees only the noise within it); measured again at another moment,
        the pair is judged on both moments' requests, and should that move the answer, the
        search goes on from there. A step with failed requests needs no second look."""
        steps = [s for s in self.sorted_done() if not s.too_small]
        value = answer_of(steps)[0]
        pair = [s for s in steps if s.step == value] + [s for s in steps if s.step > value][:1]
        return next((s.step for s in reversed(pair) if s.measured < 2 and not s.errors), None)

    async def measure(self, n: float, again: bool = False) -> None:
        """One measurement of step `n`: its mix sent (again) until `min_s` seconds and enough
        requests, each round's first request per stream marked as warm-up; merged with the
        step's earlier measurements. A measurement during which the load generator stalled
        over `STALL_S` is dropped and taken again (once; a second stall is kept and reported). A
        sessions step's look that a busy host disturbed (`slow_looks`: it broke the SLO with a
        whole wave slower than the same turns in the step's looks that held) is dropped and taken
        again, once per step, within the budget; one kept is reported (`slow_waves_s`)."""
        if self.progress is not None:
            self.progress.phase(f"sweep {self.who}: {step_label(n, self.unit)}" + (" (again)" if again else ""))
        while True:
            rounds, stalls, slow, alone = await self._look(n)
            self.looks.setdefault(n, []).append(rounds)
            self.votes.setdefault(n, []).append((bool(alone.slo.met), step_problem(alone)))
            if self.unit != "sessions":
                break
            looks = slow_looks([_rows(r) for r in self.looks[n]], [v for v, _ in self.votes[n]], n)
            slow = [x for xs in looks.values() for x in xs]
            if not looks or n in self.retaken or not self.in_budget():
                break
            i = min(looks)
            del self.looks[n][i], self.votes[n][i]
            self.retaken.add(n)
            if self.say:
                self.say(f"sweep {self.who}: {step_label(n, self.unit)}: {_slow_look(looks[i])}: measuring it again")
        g = _step_group(
            [r for look in self.looks[n] for r in look], n, self.slo, self.target, self.params, self.unit,
            self.votes[n], stalls, slow,
        )  # fmt: skip
        if n in self.groups:
            self.out[self.out.index(self.groups[n])] = g
        else:
            self.out.append(g)
        self.groups[n] = g
        self.done[n] = step_figures(g)
        if self.say:
            self.say(_step_line(self.who, self.unit, self.done[n]))

    async def _look(self, n: float) -> tuple[list[_Round], list[Stall], list[float], Judgment]:
        """One look at step `n` (a stall or a closed loop's whole wave slow: taken again once)."""
        stalls: list[Stall] = []
        slow: list[float] = []
        for attempt in range(2):
            rounds, stalls = await self._rounds(n)
            alone = judge(_rows(rounds), self.slo)
            broke = alone.slo.met is False and not alone.slo.errors
            # a whole wave slow can only have broken the SLO: a measurement that held keeps it (a
            # closed loop's waves only: a sessions step's turns differ in what they send, its looks
            # are measured against each other in `measure`)
            slow = slow_waves(_rows(rounds), n) if broke and self.unit == "streams" else []
            why = _disturbed(stalls, slow)
            if why is None or attempt or not self.in_budget():
                break
            if self.say:
                self.say(f"sweep {self.who}: {step_label(n, self.unit)}: {why}: measuring it again")
        return rounds, stalls, slow, alone

    async def _rounds(self, n: float) -> tuple[list[_Round], list[Stall]]:
        rounds: list[_Round] = []
        watch = StallWatch(STALL_S)
        task = asyncio.ensure_future(watch.run())
        try:
            t0 = time.monotonic()
            while True:
                timed, where = await self.step(n)
                rounds.append((timed, where, _span(timed), _warm(timed, where, n, self.unit)))
                # only a closed loop's streams run again: a sessions step would find its
                # conversations in the server's prompt cache, an open loop has its own length
                if self.unit != "streams" or time.monotonic() - t0 >= self.min_s or not timed.records:
                    break
        finally:
            task.cancel()
        return rounds, watch.stalls


def _disturbed(stalls: Sequence[Stall], slow: Sequence[float]) -> str | None:
    """Why a measurement says what the host did rather than what the server can take (a stall of
    the load generator, a whole wave slow: `mlxproxy.load.judge.waves`), in words; None: neither."""
    if stalls:
        return f"the load generator had a {max(stalls, key=lambda x: x.late_s).text()}"
    if slow:
        return (
            f"{'a whole wave was' if len(slow) == 1 else f'{len(slow)} whole waves were'} slow from its first token"
            f" ({min(slow) * 1000:.0f} ms at the fastest), the host's, not the server's admission"
        )
    return None


def _slow_look(slow: Sequence[float]) -> str:
    """A sessions look dropped as the host's (`slow_looks`), in words."""
    waves = "a whole wave was" if len(slow) == 1 else f"{len(slow)} whole waves were"
    return (
        f"{waves} slow from its first token ({min(slow) * 1000:.0f} ms at the fastest) against the same turns in"
        " the step's looks that held the SLO, the host's, not the server's"
    )


def _warm(timed: Timed, where: Mapping[str, SessionTurn], n: float, unit: str) -> frozenset[str]:
    """The warm-up of a round. A closed loop's: each stream's first request, the first `n` sent
    (every stream starts at once). A sessions step's: each conversation's first turn, where the
    conversation goes on (its whole prompt uncached, and the step's first conversations all
    start at once: a burst no steady state of that many agents has; reported apart, as
    `warmup_ttft_p95_s`). An open loop's warm-up is its ramp."""
    if unit == "sessions":
        later = {w.session for w in where.values() if w.turn > 0}
        return frozenset(i for i, w in where.items() if w.turn == 0 and w.session in later)
    if unit != "streams":
        return frozenset()
    return frozenset(r.id for r in sorted(timed.records, key=lambda r: r.t_start_mono)[: int(n)])


def _span(timed: Timed) -> float:
    recs = [r for r in timed.records if r.duration_s is not None]
    if not recs:
        return 0.0
    return max(r.t_end_mono for r in recs) - min(r.t_start_mono for r in recs)


def refine_bounds(steps: Sequence[Step]) -> tuple[int, int] | None:
    """(last good, first bad) steps still more than one apart, or None: nothing to refine.
    Good: judged, held the SLO, throughput still rising; bad: the first step past it that
    broke the SLO (`first_break`), added no throughput or was too small to judge. Steps too small to judge
    before the first judged one are passed over (a sessions sweep's first steps send few
    requests)."""
    ordered = sorted(steps, key=lambda s: s.step)
    broke = first_break(ordered)
    good: Step | None = None
    for i, s in enumerate(ordered):
        if good is None and s.too_small:
            continue
        if s is broke or (not holds(s) and (broke is None or s.step > broke.step or s.too_small)):
            break
        if not holds(s):  # a break within the noise that a heavier step's certain hold contradicts
            continue
        if knee_of([x for x in ordered[: i + 1] if holds(x)]) is not None:
            break
        good = s
    if good is None:
        return None
    later = [s for s in ordered if s.step > good.step]
    if not later:
        return None
    lo, hi = int(good.step), int(later[0].step)
    return (lo, hi) if hi - lo > 1 else None


def _step_group(
    rounds: Sequence[_Round],
    n: float,
    slo: dict[str, float],
    target: str,
    params: JSONObject,
    unit: str,
    votes: Sequence[tuple[bool, str]] = ((True, ""),),
    stalls: Sequence[Stall] = (),
    slow: Sequence[float] = (),
) -> Group:
    """The group of one step: the records of every round of every measurement (each round's
    warm-up marked), judged together; `span_s` is the rounds' wall time, `votes` each
    measurement's own verdict and problem (`measured` their number; the step is judged on
    every measurement's requests together), `stalls_s` the generator's stalls over `STALL_S` kept,
    `slow_waves_s` the fastest TTFT of each whole wave slow in a measurement kept (measured again,
    or past the budget)."""
    records = _rows(rounds)
    every: list[Record] = []
    lags: list[float] = []
    for timed, *_ in rounds:
        every += timed.records
        lags += timed.lag_s
    label = {"streams": "concurrency", RATE_UNIT: "rate"}.get(unit, unit)
    key = "rate" if unit == RATE_UNIT else "concurrency"
    summary = summarize_records(every, lag_s=lags or None, send_times=[r.t_start_mono for r in every] if lags else None)
    summary = rounds[-1][0].annotate(summary) if rounds else summary
    extra: dict[str, JSONValue] = {"measured": len(votes), "span_s": sum(r[2] for r in rounds)}
    if len(votes) > 1:
        extra["verdicts"] = [v for v, _ in votes]
        extra["problems"] = [p for _, p in votes]
    if stalls:
        extra["stalls_s"] = [round(x.late_s, 4) for x in stalls]
        extra["stall_causes"] = [x.cause for x in stalls]
    if slow:
        extra["slow_waves_s"] = [round(x, 4) for x in slow]
    return Group(
        f"sweep {n:g}" + (f" (run {params['run']})" if "run" in params else ""),
        target,
        f"{label} {n:g}" + ("/s" if unit == RATE_UNIT else "") + (f" run {params['run']}" if "run" in params else ""),
        "sweep_step",
        {**params, key: n, "step": n, "sweep": True, "unit": unit, **extra},
        summary.judged(judge(records, slo)),
        tuple(records),
    )


def _rows(rounds: Sequence[_Round]) -> list[RunRecord]:
    """The rows of `rounds`, each round's warm-up marked (`"warmup": true`), a later round's
    conversations numbered after the earlier ones'."""
    records: list[RunRecord] = []
    sessions = 0
    for timed, where, _, warm in rounds:
        for r in timed.rows(where):
            if r.where is not None and sessions:
                r = replace(r, where=replace(r.where, session=r.where.session + sessions))
            records.append(replace(r, extra={**r.extra, "warmup": True}) if r.id in warm else r)
        sessions = max((r.session + 1 for r in records if r.session is not None), default=0)
    return records


def _step_line(target: str, unit: str, st: Step) -> str:
    head = (
        f"sweep {target}: {step_label(st.step, unit)}: {st.ok}/{st.requests} ok, aggregate "
        f"{st.aggregate_tps or 0.0:.1f} tok/s, goodput {(st.goodput.share if st.goodput else None) or 0.0:.0%}, SLO "
    )
    if st.too_small:
        return head + f"not judged: too few requests (under {MIN_STEP_REQUESTS})"
    return head + ("held" if st.slo_met else "broken: " + st.problem)


def mix_copies(count: int, mix_size: int, per_stream: int = MIN_PER_STREAM) -> int:
    """Whole copies of a mix of `mix_size` requests a closed-loop step of `count` streams
    sends: the same whole number of copies per stream (so every stream works to the end and
    no tail of fewer streams skews the step's throughput), at least `per_stream` requests per
    stream and `MIN_STEP_REQUESTS` in all, past each stream's warm-up request."""
    size, count = max(1, mix_size), max(1, int(count))
    per = max(per_stream, math.ceil(MIN_STEP_REQUESTS / count)) + WARMUP_PER_STREAM
    return count * math.ceil(per / size)


def session_runs(count: int, turns: Sequence[int]) -> int:
    """Conversation runs a sessions step of `count` conversations at once sends: `turns` is each
    conversation's turn count in one copy of the mix; whole copies, `count` at least, more while
    the step would judge fewer than `MIN_STEP_REQUESTS` turns (a conversation that goes on is
    judged past its first turn, the step's warm-up), so a step of one or two sessions is judged."""
    steady = sum(t - 1 if t > 1 else t for t in turns)
    count = max(1, int(count))
    return count * max(1, math.ceil(MIN_STEP_REQUESTS / max(1, count * steady))) * len(turns)
