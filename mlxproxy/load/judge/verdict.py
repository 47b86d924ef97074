"""The capacity's verdict as people read it: the one-line sentence (each step named once, with
the interval the noise leaves and why), the sweep's charts, and the result file that carries
the `capacity` object. What the steps answer is `mlxproxy.load.judge.capacity`'s."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence

from mlxproxy.load.data.plot import Chart, Series
from mlxproxy.load.data.results import Group, ResultFile, ResultKind
from mlxproxy.load.data.summary import JSONObject
from mlxproxy.load.judge.capacity import (
    MIN_STEP_REQUESTS,
    RATE_UNIT,
    Capacity,
    Step,
    capacity_of,
    holds,
)
from mlxproxy.load.judge.slo import SLO_METRICS, fmt_value, split_key

__all__ = ["by_value", "capacity_line", "result_file", "step_label", "sweep_charts"]


def step_label(n: float, unit: str = "streams") -> str:
    if unit == RATE_UNIT:
        return f"{n:g} req/s"
    return f"{n:g} concurrent {unit[:-1] if n == 1 else unit}"


def _at_rate(v: float) -> str:
    return f"{v:g} req/s"


def _at(v: float) -> str:
    return f"{v:g}"


def _uncertainty(cap: Capacity) -> str:
    """The capacity's interval in words, said after the verdict: `; beyond the noise` when the
    steps on both sides were clear of it, `; the capacity lies between 6 and 7: the 7-stream step
    is within the noise of the SLO`, `; the capacity lies between 4 and 7: not refined` where
    steps were skipped (whatever stopped the search), `; the data cannot decide: ...` when no
    step held beyond the noise; empty for a file without intervals."""
    low, high, value, unit = cap.low, cap.high, cap.value, cap.unit
    if low is None or high is None:
        return ""
    at = _at_rate if unit == RATE_UNIT else _at
    measured = {s.step for s in cap.steps if not s.too_small}
    if low == high:
        # past a knee the SLO did not decide; with every step held nothing above was measured
        return "" if cap.knee is not None or cap.limited_by == "steps" else "; beyond the noise"
    noisy = sorted(s.step for s in cap.steps if not s.too_small and low < s.step <= high and not s.certain)
    if cap.knee is None and value in measured and not by_value(cap).certain:
        noisy = sorted({*noisy, value})
    skipped = unit != RATE_UNIT and any(v not in measured for v in range(int(low) + 1, int(high) + 1))
    if low == 0:
        first = min(measured, default=high)
        return (
            f"; the data cannot decide: even the {_kind(first, unit)} step is within the noise of the SLO"
            f" (the capacity lies between 0 and {at(high)})"
        )
    why = []
    if noisy:
        names = " and ".join(", ".join(_kind(v, unit, bare=True) for v in noisy).rsplit(", ", 1))
        tail = f" {unit}" if unit == RATE_UNIT else f"-{unit[:-1]}"
        why.append(f"the {names}{tail} step{'s are' if len(noisy) > 1 else ' is'} within the noise of the SLO")
    if skipped:
        why.append("not refined")
    return f"; the capacity lies between {at(low)} and {at(high)}: {'; '.join(why)}"


def by_value(cap: Capacity) -> Step:
    """The step at the capacity."""
    return next(s for s in cap.steps if s.step == cap.value)


def _kind(v: float, unit: str, *, bare: bool = False) -> str:
    """`8-stream` (or, `bare`, `8`) for a step of `v`."""
    if unit == RATE_UNIT:
        return f"{v:g}" if bare else f"{v:g} req/s"
    return f"{v:g}" if bare else f"{v:g}-{unit[:-1]}"


def capacity_line(target: str, cap: Capacity) -> str:
    """The one-line verdict, e.g. `t: meets the SLO up to 3 concurrent streams (95 % interval
    2-4: ...); at 5, TTFT p95 is 5.2 s (> 3 s)`. Names each step at most once; says the
    interval the noise leaves, whether the steps were refined, a contradiction that measuring
    again did not resolve, and with several runs every run's answer."""
    return _line(target, cap) + _tails(cap)


def _tails(cap: Capacity) -> str:
    at = _at_rate if cap.unit == RATE_UNIT else _at
    out = ""
    if cap.contradicted:
        a, b = cap.contradicted[0]
        out += f"; {at(a)} broke the SLO and {at(b)} held it even when measured again: they differ within the noise"
    stalled = [s for s in cap.steps if s.stalls_s]
    if stalled:
        worst = max(max(s.stalls_s) for s in stalled)
        out += (
            f"; the load generator stalled (up to {worst * 1000:.0f} ms) during "
            f"{', '.join(at(s.step) for s in stalled)} even when measured again"
        )
    slowed = [s for s in cap.steps if s.slow_waves_s]
    if slowed:
        out += (
            f"; at {', '.join(at(s.step) for s in slowed)}, a whole wave was slow from its first token (a busy"
            " host) in the measurement kept"
        )
    first = _first_turns(cap)
    if first is not None:
        out += (
            f"; the conversations' first turns (the whole prompt, started together; not judged) had TTFT p95"
            f" {fmt_value(first.warmup_ttft_p95_s, 's')} at {at(first.step)}"
        )
    if len(cap.runs) > 1:
        vals = ", ".join(at(v) for v in cap.runs)
        med = statistics.median(cap.runs)
        out += f"; {len(cap.runs)} runs: {vals} (median {med:g}, spread {at(min(cap.runs))}-{at(max(cap.runs))})"
    return out


def _first_turns(cap: Capacity) -> Step | None:
    """A sessions sweep's step whose first turns the verdict names: the capacity's step, else
    the lightest judged one (None: not sessions, or a file without the figure)."""
    if cap.unit != "sessions":
        return None
    steps = [s for s in cap.steps if s.warmup_ttft_p95_s is not None and not s.too_small]
    return next((s for s in steps if s.step == cap.value), steps[0] if steps else None)


def _line(target: str, cap: Capacity) -> str:
    steps, unit, value = cap.steps, cap.unit, cap.value
    by_step = {s.step: s for s in steps}
    broke = None if cap.broken_at is None else by_step.get(cap.broken_at)
    at = _at_rate if unit == RATE_UNIT else _at
    small = [s.step for s in steps if s.too_small]
    tail = ""
    if small:
        tail = (
            f"; {', '.join(at(v) for v in small)}: too few requests to judge (under {MIN_STEP_REQUESTS}"
            " generation requests; add --repeat)"
        )
    if cap.limited_by == "too_small":
        return (
            f"{target}: cannot say: every step was too small to judge ({', '.join(at(v) for v in small)}: under"
            f" {MIN_STEP_REQUESTS} generation requests each; add --repeat)"
        )
    unsure = _uncertainty(cap)
    if cap.knee is not None:
        knee = by_step[cap.knee]
        later = [s for s in steps if holds(s) and s.step > knee.step]
        flat = max(later, key=lambda s: s.step)
        line = (
            f"{target}: capacity {step_label(value, unit)}, where aggregate tok/s stopped rising"
            f" ({knee.aggregate_tps or 0.0:.0f} tok/s{_ci(knee)}; {flat.aggregate_tps or 0.0:.0f}{_ci(flat)} at"
            f" {at(flat.step)}, where the SLO still held: more load only queues)"
        )
        if broke is not None:
            line += f"; at {at(broke.step)}, {broke.problem}"
        return line + unsure + tail
    if broke is not None and value == 0:
        return (
            f"{target}: does not meet the SLO even at {step_label(broke.step, unit)}: {broke.problem}" + unsure + tail
        )
    if broke is not None:
        if cap.low is None and unit != RATE_UNIT and broke.step - value > 1:
            unsure = f" (the capacity lies between {at(value)} and {at(broke.step - 1)}: not refined)"
        line = f"{target}: meets the SLO up to {step_label(value, unit)}; at {at(broke.step)}, {broke.problem}"
        return line + unsure + tail
    return f"{target}: meets the SLO at every step, up to {step_label(value, unit)}" + unsure + tail


def _answer(target: str, cap: Capacity) -> str:
    """`s: 4 (3-5)`: the capacity and its interval, short (a plot's note)."""
    at = _at_rate if cap.unit == RATE_UNIT else _at
    if cap.limited_by == "too_small":
        return f"{target}: cannot say"
    span = "" if cap.low is None or cap.high is None or cap.low == cap.high else f" ({at(cap.low)}-{at(cap.high)})"
    runs = f", {len(cap.runs)} runs {at(min(cap.runs))}-{at(max(cap.runs))}" if len(cap.runs) > 1 else ""
    return f"{target}: {at(cap.value)}{span}{runs}"


def _ci(s: Step) -> str:
    ci = s.aggregate_tps_ci
    return "" if ci is None else f" [{ci[0]:.0f}-{ci[1]:.0f}]"


def sweep_charts(groups: Sequence[Group]) -> list[Chart]:
    """The plot of a sweep: TTFT and TPOT p50/p95 and aggregate tok/s by concurrency, one
    line per target and percentile, the SLO's thresholds as dashed lines ([] without a sweep)."""
    caps = capacity_of(groups)
    if not caps:
        return []
    ttft, tpot, agg = [], [], []
    for target, cap in caps.items():
        steps = cap.steps
        for q in ("p50", "p95"):
            ttft.append(
                (f"{target} {q}", [(float(s.step), s.ttft_p50_s if q == "p50" else s.ttft_p95_s) for s in steps])
            )
            tpot.append(
                (
                    f"{target} {q}",
                    [
                        (
                            float(s.step),
                            None if (v := s.tpot_p50_s if q == "p50" else s.tpot_p95_s) is None else v * 1000.0,
                        )
                        for s in steps
                    ],
                )
            )
        agg.append((target, [(float(s.step), s.aggregate_tps) for s in steps]))
    first = next(iter(caps.values()))
    slo, unit = first.slo, first.unit
    xl = "requests/s sent (open loop)" if unit == RATE_UNIT else f"concurrent {unit}"
    by = "rate" if unit == RATE_UNIT else "concurrency"

    def lines(metric: str, scale: float) -> list[tuple[str, float]]:
        out = []
        for key, v in slo.items():
            m, pct = split_key(key)
            if m in metric.split("|"):
                out.append((f"SLO {SLO_METRICS[m][3]} p{pct} {fmt_value(v, 's')}", v * scale))
        return out

    def by_step(
        title: str, ylabel: str, series: Sequence[Series], hlines: Sequence[tuple[str, float]] = (), note: str = ""
    ) -> Chart:
        """A chart of one figure by the sweep's step (the x axis the same in all three)."""
        return Chart(title, xl, ylabel, series, integer_x=unit != RATE_UNIT, hlines=hlines, note=note)

    return [
        by_step(
            f"TTFT by {by} (p50, p95)",
            "seconds",
            ttft,
            hlines=lines("ttft", 1.0),
            note="dashed: the SLO's thresholds; capacity " + "; ".join(_answer(t, c) for t, c in caps.items()),
        ),
        by_step(f"TPOT by {by} (p50, p95)", "milliseconds per token", tpot, hlines=lines("tpot|itl", 1000.0)),
        by_step(
            f"Aggregate tokens/s by {by}",
            "tokens/s (all streams)",
            agg,
            note="flat or falling: the server is saturated",
        ),
    ]


def result_file(
    kind: ResultKind,
    groups: Sequence[Group],
    verdicts: Mapping[str, str] | None = None,
    extra: JSONObject | None = None,
) -> ResultFile:
    """The result file of this run, written now by this version, with the sweeps' capacity."""
    capacity = {t: c.to_json() for t, c in capacity_of(groups).items()}
    return ResultFile.new(kind, groups, verdicts, {**(extra or {}), **({"capacity": capacity} if capacity else {})})
