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

import math
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence

from mlxproxy.load.data.results import Group, SessionTurn
from mlxproxy.load.data.summary import JSONObject
from mlxproxy.load.judge.capacity import (
    MAX_AUTO_CONCURRENCY,
    MIN_PER_STREAM,
    MIN_STEP_REQUESTS,
    RATE_UNIT,
    Step,
    holds,
    knee_of,
    step_figures,
    step_label,
    stop_reason,
)
from mlxproxy.load.judge.slo import judge
from mlxproxy.load.output.progress import Progress
from mlxproxy.load.output.report import summarize_records
from mlxproxy.load.run.client import Timed

__all__ = [
    "DEFAULT_BUDGET_S",
    "StepRun",
    "run_sweep",
    "mix_copies",
    "refine_bounds",
]

#: `--sweep-budget`'s default: refining steps start only while the sweep has run less than this
DEFAULT_BUDGET_S = 600.0

#: what one step returns: its records and extra keys per record id (a session's turn, ...)
StepRun = tuple[Timed, Mapping[str, SessionTurn]]


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
) -> None:
    """Run `step(n)` at each of `steps` (empty: doubling from 1, then, with `refine`, refining
    within `budget_s` seconds; `mlxproxy.load.run.shapes.Sweep` runs a shape this way). Each step's
    group is appended to `out` as it finishes; `say` gets one line per step; `progress` shows
    each step as a phase. `unit`: what the steps count (streams, sessions, req/s)."""
    auto = not steps
    t0 = time.monotonic()
    done: list[Step] = []

    async def one(n: float) -> None:
        if progress is not None:
            progress.phase(f"sweep {target}: {step_label(n, unit)}")
        timed, where = await step(n)
        g = _step_group(timed, where, n, slo, target, {**params, "auto": auto, "budget_s": budget_s}, unit)
        out.append(g)
        done.append(step_figures(g))
        done.sort(key=lambda s: s.step)
        if say:
            say(_step_line(target, unit, next(s for s in done if s.step == n)))

    if not auto:
        for n in steps:
            await one(n)
        return
    n = 1
    while True:
        await one(n)
        if stop_reason([s for s in done if s.step <= n]) or n >= MAX_AUTO_CONCURRENCY:
            break
        n *= 2
    while refine and time.monotonic() - t0 < budget_s and (bounds := refine_bounds(done)) is not None:
        await one((bounds[0] + bounds[1]) // 2)


def refine_bounds(steps: Sequence[Step]) -> tuple[int, int] | None:
    """(last good, first bad) steps still more than one apart, or None: nothing to refine.
    Good: judged, held the SLO, throughput still rising; bad: the first step past it that
    broke the SLO, added no throughput or was too small to judge. Steps too small to judge
    before the first judged one are passed over (a sessions sweep's first steps send few
    requests)."""
    ordered = sorted(steps, key=lambda s: s.step)
    good: Step | None = None
    for i, s in enumerate(ordered):
        if good is None and s.too_small:
            continue
        if not holds(s):
            break
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
    timed: Timed,
    where: Mapping[str, SessionTurn],
    n: float,
    slo: dict[str, float],
    target: str,
    params: JSONObject,
    unit: str,
) -> Group:
    records = timed.rows(where)
    label = {"streams": "concurrency", RATE_UNIT: "rate"}.get(unit, unit)
    key = "rate" if unit == RATE_UNIT else "concurrency"
    summary = summarize_records(
        timed.records,
        lag_s=timed.lag_s or None,
        send_times=[r.t_start_mono for r in timed.records] if timed.lag_s else None,
    )
    summary = timed.annotate(summary)
    return Group(
        f"sweep {n:g}",
        target,
        f"{label} {n:g}" + ("/s" if unit == RATE_UNIT else ""),
        "sweep_step",
        {**params, key: n, "step": n, "sweep": True, "unit": unit},
        summary.judged(judge(records, slo)),
        tuple(records),
    )


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
    stream and `MIN_STEP_REQUESTS` in all."""
    size, count = max(1, mix_size), max(1, int(count))
    per = max(per_stream, math.ceil(MIN_STEP_REQUESTS / count))
    return count * math.ceil(per / size)
