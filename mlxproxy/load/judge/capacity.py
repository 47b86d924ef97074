"""Capacity: what a sweep's judged steps answer, and the one-line verdict.

A sweep runs steps of growing load with the same mix of requests (closed-loop streams, agent
sessions or open-loop rates), each step judged against the SLO (`mlxproxy.load.judge.slo`). The
capacity is the largest step that holds the SLO, below the first step that breaks it, and
never past the knee: the step after which aggregate tok/s stopped rising (a server whose
throughput is flat while its latency rises is queueing the extra load, whatever the SLO's
thresholds still allow). A step with fewer than `MIN_STEP_REQUESTS` generation requests is
too small to judge: it neither holds nor breaks the SLO, and the verdict says so.

The verdict names the capacity, the step that broke the SLO and the figure that broke it,
or, where throughput stopped rising, the knee and a later step with their tok/s: never the
same step twice.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from mlxproxy.load.data.plot import Chart
from mlxproxy.load.data.results import Group, ResultFile, ResultKind
from mlxproxy.load.data.summary import Breach, Goodput, JSONObject, JSONValue
from mlxproxy.load.judge.slo import (
    MIN_STEP_REQUESTS,
    SLO_METRICS,
    effective,
    fmt_value,
    judged,
    percentile_of,
    split_key,
    step_problem,
    succeeded,
)

__all__ = [
    "Capacity",
    "Step",
    "MAX_AUTO_CONCURRENCY",
    "MIN_PER_STREAM",
    "MIN_STEP_REQUESTS",
    "RATE_UNIT",
    "RISE",
    "capacity_line",
    "capacity_of",
    "holds",
    "knee_of",
    "result_file",
    "rise_needed",
    "step_figures",
    "step_label",
    "stop_reason",
    "sweep_charts",
]

MAX_AUTO_CONCURRENCY = 256
RISE = 1.05  # aggregate tok/s must grow at least 5 % per doubling, else the server is saturated
MIN_PER_STREAM = 3  # each stream of a closed-loop sweep step sends at least this many requests
RATE_UNIT = "req/s"


@dataclass(frozen=True, slots=True)
class Step:
    """One judged step's figures over its generation requests (an entry of `capacity.steps`
    in result files); `step` is the step's count, as the sweep ran it (streams, sessions or
    req/s), `rate` tells a step of an open-loop rate."""

    step: float
    requests: int
    ok: int
    errors: int
    too_small: bool
    ttft_p50_s: float | None = None
    ttft_p95_s: float | None = None
    tpot_p50_s: float | None = None
    tpot_p95_s: float | None = None
    decode_tps_p50: float | None = None
    aggregate_tps: float | None = None
    anomalies: Mapping[str, int] = field(default_factory=dict)
    goodput: Goodput | None = None
    slo_met: bool | None = None
    breaches: tuple[Breach, ...] | None = None
    problem: str = ""
    rate: bool = False

    def to_json(self) -> dict[str, JSONValue]:
        """The step as `capacity.steps` holds it (its count under `step` and under `concurrency`
        or `rate`)."""
        return {
            "step": self.step,
            "rate" if self.rate else "concurrency": self.step,
            "requests": self.requests,
            "ok": self.ok,
            "errors": self.errors,
            "too_small": self.too_small,
            "ttft_p50_s": self.ttft_p50_s,
            "ttft_p95_s": self.ttft_p95_s,
            "tpot_p50_s": self.tpot_p50_s,
            "tpot_p95_s": self.tpot_p95_s,
            "decode_tps_p50": self.decode_tps_p50,
            "aggregate_tps": self.aggregate_tps,
            "anomalies": dict(self.anomalies),
            "goodput": None if self.goodput is None else self.goodput.to_json(),
            "slo_met": self.slo_met,
            "breaches": None if self.breaches is None else [b.to_json() for b in self.breaches],
            "problem": self.problem,
        }


@dataclass(frozen=True, slots=True)
class Capacity:
    """What one target's sweep answers (the result file's `capacity[target]`): the largest step
    that held the SLO (`value`), why it is not larger (`limited_by`: `slo`, `errors`,
    `throughput`, `steps` or `too_small`), the SLO's thresholds, the steps, and where they apply
    the first judged step that broke the SLO, the knee and the steps too small to judge."""

    value: float
    unit: str
    slo: Mapping[str, float]
    limited_by: str
    steps: tuple[Step, ...]
    broken_at: float | None = None
    knee: float | None = None
    too_small: tuple[float, ...] = ()

    def to_json(self) -> dict[str, JSONValue]:
        out: dict[str, JSONValue] = {
            "max_rate" if self.unit == RATE_UNIT else "max_concurrency": self.value,
            "slo": dict(self.slo),
            "limited_by": self.limited_by,
            "unit": self.unit,
            "steps": [st.to_json() for st in self.steps],
        }
        if self.broken_at is not None:
            out["broken_at"] = self.broken_at
        if self.knee is not None:
            out["knee"] = self.knee
        if self.too_small:
            out["too_small"] = list(self.too_small)
        return out


def step_figures(g: Group) -> Step:
    """The per-step figures of a judged sweep group (what `capacity.steps` holds), over its
    generation requests, with open-loop latencies counted from each request's due time."""
    recs = judged(g.records)
    ok = [r for r in recs if succeeded(r)]

    def p(name: str, q: float) -> float | None:
        return percentile_of([x for r in ok if (x := effective(r, name)) is not None], q)

    anomalies: dict[str, int] = {}
    for r in recs:
        for k in r.record.anomalies:
            anomalies[k] = anomalies.get(k, 0) + 1
    s = g.summary
    slo = s.slo
    return Step(
        _step_value(g),
        len(recs),
        len(ok),
        len(recs) - len(ok),
        len(recs) < MIN_STEP_REQUESTS,
        p("ttft_s", 50),
        p("ttft_s", 95),
        p("tpot_s", 50),
        p("tpot_s", 95),
        p("decode_tps", 50),
        s.aggregate_tps,
        anomalies,
        s.goodput,
        None if slo is None else slo.met,
        None if slo is None else slo.breaches,
        step_problem(s),
        g.params.get("unit") == RATE_UNIT,
    )


def rise_needed(lower: float, upper: float) -> float:
    """How much aggregate tok/s must grow from step `lower` to step `upper` for the server not
    to count as saturated: `RISE` for a doubling, proportionally less for a smaller step (a
    refined step from 6 to 7 streams adds a sixth of the load, not all of it)."""
    if lower <= 0:
        return RISE
    return 1.0 + (RISE - 1.0) * min(1.0, (upper - lower) / lower)


def holds(s: Step) -> bool:
    """The step was big enough to judge and held the SLO."""
    return not s.too_small and bool(s.slo_met)


def knee_of(held: Sequence[Step]) -> Step | None:
    """The step after which aggregate tok/s stopped rising, among `held` (in step order), or
    None when it rose at every step: the last step that rose by `rise_needed` over the best
    step before it."""
    if not held:
        return None
    best = held[0]
    for s in held[1:]:
        if (s.aggregate_tps or 0.0) >= rise_needed(best.step, s.step) * (best.aggregate_tps or 0.0):
            best = s
    return None if best is held[-1] else best


def stop_reason(steps: Sequence[Step]) -> str | None:
    """Why a doubling sweep stops after the last of `steps` (step order), or None to go on:
    `errors`, `slo` (the last step was judged and broke) or `throughput` (it held, but
    aggregate tok/s stopped rising). A step too small to judge never stops it."""
    last = steps[-1]
    if last.too_small:
        return None
    if last.errors:
        return "errors"
    if not last.slo_met:
        return "slo"
    return "throughput" if knee_of([s for s in steps if holds(s)]) is not None else None


def capacity_of(groups: Sequence[Group]) -> dict[str, Capacity]:
    """The capacity per target of a run's sweep groups (empty without a sweep). `broken_at`:
    the first judged step that broke the SLO; `knee`: where throughput stopped rising;
    `limited_by`: `slo` or `errors` (the first step past the capacity broke the SLO / had
    failed requests), `throughput` (aggregate tok/s stopped rising while the SLO still held),
    `steps` (every step held) or `too_small` (no step was big enough to judge)."""
    out: dict[str, Capacity] = {}
    sweeps = [g for g in groups if g.kind == "sweep_step" and g.summary.slo is not None]
    for target in dict.fromkeys(g.target for g in sweeps):
        gs = sorted((g for g in sweeps if g.target == target), key=_step_value)
        steps = tuple(step_figures(g) for g in gs)
        broke = next((s for s in steps if not s.too_small and not s.slo_met), None)
        held = [s for s in steps if holds(s) and (broke is None or s.step < broke.step)]
        knee = knee_of(held)
        best: float = 0
        if knee is not None:
            best, limited = knee.step, "throughput"
        elif held:
            best, limited = held[-1].step, "steps" if broke is None else "errors" if broke.errors else "slo"
        else:
            limited = "too_small" if broke is None else "errors" if broke.errors else "slo"
        verdict = gs[0].summary.slo
        out[target] = Capacity(
            best,
            str(gs[0].params.get("unit", "streams")),
            {} if verdict is None else verdict.thresholds,
            limited,
            steps,
            None if broke is None else broke.step,
            None if knee is None else knee.step,
            tuple(s.step for s in steps if s.too_small),
        )
    return out


def _step_value(g: Group) -> float:
    key = "step" if "step" in g.params else "concurrency"
    value = g.param(key)
    if value is None:
        raise KeyError(key)
    return value


def step_label(n: float, unit: str = "streams") -> str:
    if unit == RATE_UNIT:
        return f"{n:g} req/s"
    return f"{n:g} concurrent {unit[:-1] if n == 1 else unit}"


def _at_rate(v: float) -> str:
    return f"{v:g} req/s"


def _at(v: float) -> str:
    return f"{v:g}"


def capacity_line(target: str, cap: Capacity) -> str:
    """The one-line verdict, e.g. `t: meets the SLO up to 3 concurrent streams; at 4, TTFT p95
    is 5.2 s (> 3 s)`. Names each step at most once."""
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
    if cap.knee is not None:
        knee = by_step[cap.knee]
        later = [s for s in steps if holds(s) and s.step > knee.step]
        flat = max(later, key=lambda s: s.step)
        line = (
            f"{target}: capacity {step_label(value, unit)}, where aggregate tok/s stopped rising"
            f" ({knee.aggregate_tps or 0.0:.0f} tok/s; {flat.aggregate_tps or 0.0:.0f} at {at(flat.step)},"
            " where the SLO still held: more load only queues)"
        )
        if broke is not None:
            line += f"; at {at(broke.step)}, {broke.problem}"
        return line + tail
    if broke is not None and value == 0:
        return f"{target}: does not meet the SLO even at {step_label(broke.step, unit)}: {broke.problem}" + tail
    if broke is not None:
        line = f"{target}: meets the SLO up to {step_label(value, unit)}; at {at(broke.step)}, {broke.problem}"
        if unit != RATE_UNIT and broke.step - value > 1:
            line += f" (the capacity lies between {at(value)} and {at(broke.step - 1)}: not refined)"
        return line + tail
    return f"{target}: meets the SLO at every step, up to {step_label(value, unit)}" + tail


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

    return [
        Chart(
            f"TTFT by {by} (p50, p95)",
            xl,
            "seconds",
            ttft,
            integer_x=unit != RATE_UNIT,
            hlines=lines("ttft", 1.0),
            note="dashed: the SLO's thresholds",
        ),
        Chart(
            f"TPOT by {by} (p50, p95)",
            xl,
            "milliseconds per token",
            tpot,
            integer_x=unit != RATE_UNIT,
            hlines=lines("tpot|itl", 1000.0),
        ),
        Chart(
            f"Aggregate tokens/s by {by}",
            xl,
            "tokens/s (all streams)",
            agg,
            integer_x=unit != RATE_UNIT,
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
