"""Capacity: what a sweep's judged steps answer (the verdict's sentence, charts and the result
file are `mlxproxy.load.judge.verdict`'s).

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

Every step is judged on its steady state: each stream's first request is sent but not judged
(a warm-up, `warmup` on its record), and each figure has a 95 % bootstrap interval over the
step's requests (`mlxproxy.load.judge.stats`). A step *certainly* holds (or breaks) the SLO when the
interval of every judged percentile lies on the same side of its threshold; otherwise the step is
within the noise. The capacity's interval (`low`, `high`) runs from the largest step that
certainly held to the step before the first that certainly broke: the verdict gives it, and says
when the data cannot decide (no step certainly held) or the steps were not refined.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from mlxproxy.load.data.results import Group, RunRecord
from mlxproxy.load.data.summary import Breach, Goodput, JSONValue
from mlxproxy.load.judge.slo import (
    MIN_STEP_REQUESTS,
    SLO_METRICS,
    effective,
    is_warmup,
    judged,
    percentile_of,
    split_key,
    step_problem,
    succeeded,
)
from mlxproxy.load.judge.stats import Interval, percentile_interval, ratio_interval

__all__ = [
    "Capacity",
    "Step",
    "MAX_AUTO_CONCURRENCY",
    "MIN_PER_STREAM",
    "MIN_STEP_REQUESTS",
    "RATE_UNIT",
    "RISE",
    "answer_of",
    "capacity_of",
    "certainly_breaks",
    "first_break",
    "contradictions",
    "holds",
    "knee_of",
    "rise_needed",
    "step_figures",
    "stop_reason",
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
    #: requests sent but not judged (each stream's first)
    warmup: int = 0
    #: how many times the step was measured (its records are those of every measurement)
    measured: int = 1
    #: 95 % bootstrap intervals: of the aggregate tok/s, and of each SLO key's percentile
    aggregate_tps_ci: Interval | None = None
    intervals: Mapping[str, Interval] = field(default_factory=dict)
    #: event-loop stalls of the load generator over the threshold during the step (seconds each)
    stalls_s: tuple[float, ...] = ()
    #: the SLO's thresholds the step was judged on
    slo_thresholds: Mapping[str, float] = field(default_factory=dict)
    #: measured several times, the measurements (each judged alone) disagreed
    split: bool = False
    #: the TTFT p95 of the warm-up requests (a sessions step's: its conversations' first turns)
    warmup_ttft_p95_s: float | None = None
    #: the fastest TTFT of each whole wave slow in a measurement kept (`mlxproxy.load.judge.waves`)
    slow_waves_s: tuple[float, ...] = ()

    @property
    def certain(self) -> bool:
        """The SLO verdict lies beyond the noise: failed requests, or every judged percentile's
        interval on the verdict's side of its threshold (a breach's wholly past it)."""
        if self.too_small or self.slo_met is None:
            return False
        if self.errors:
            return True
        if self.split:
            return False
        if not self.slo_met:
            return any(_beyond(b.key, self.intervals.get(b.key), b.threshold, broke=True) for b in self.breaches or ())
        return all(_beyond(k, self.intervals.get(k), t, broke=False) for k, t in self.slo_thresholds.items())

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
            "warmup": self.warmup,
            "measured": self.measured,
            "aggregate_tps_ci": None if self.aggregate_tps_ci is None else list(self.aggregate_tps_ci),
            "intervals": {k: list(v) for k, v in self.intervals.items()},
            "certain": self.certain,
            "stalls_s": list(self.stalls_s),
            "split": self.split,
            "warmup_ttft_p95_s": self.warmup_ttft_p95_s,
            "slow_waves_s": list(self.slow_waves_s),
        }


def _beyond(key: str, ci: Interval | None, threshold: float, *, broke: bool) -> bool:
    """Whether the interval `ci` of SLO key `key` lies wholly past `threshold` (`broke`) or
    wholly within it. No interval (fewer than 2 values): not beyond the noise."""
    if ci is None:
        return False
    lower = SLO_METRICS[split_key(key)[0]][2]  # "at least" metrics (decode tok/s)
    lo, hi = ci
    if broke:
        return hi < threshold if lower else lo > threshold
    return lo >= threshold if lower else hi <= threshold


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
    #: where the capacity lies given the noise (None: a file written before the intervals)
    low: float | None = None
    high: float | None = None
    #: (lighter, heavier) steps whose verdicts contradicted each other even after measuring again
    contradicted: tuple[tuple[float, float], ...] = ()
    #: every run's answer (`--runs`), in run order; () for one run
    runs: tuple[float, ...] = ()

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
        if self.low is not None and self.high is not None:
            out["interval"] = [self.low, self.high]
        if self.contradicted:
            out["contradicted"] = [list(p) for p in self.contradicted]
        if self.runs:
            out["runs"] = list(self.runs)
        return out


def step_figures(g: Group) -> Step:
    """The per-step figures of a judged sweep group (what `capacity.steps` holds), over its
    generation requests past the warm-up, with open-loop latencies counted from each request's
    due time, and their 95 % intervals (seeded: the same records give the same intervals)."""
    recs = judged(g.records)
    ok = sorted((r for r in recs if succeeded(r)), key=lambda r: r.record.started_at)  # sent order: blocks

    def values(name: str) -> list[float]:
        return [x for r in ok if (x := effective(r, name)) is not None]

    def p(name: str, q: float) -> float | None:
        return percentile_of(values(name), q)

    anomalies: dict[str, int] = {}
    for r in recs:
        for k in r.record.anomalies:
            anomalies[k] = anomalies.get(k, 0) + 1
    s = g.summary
    slo = s.slo
    thresholds = {} if slo is None else dict(slo.thresholds)
    intervals: dict[str, Interval] = {}
    for key in thresholds:
        metric, pct = split_key(key)
        if (ci := percentile_interval(values(SLO_METRICS[metric][0]), pct)) is not None:
            intervals[key] = ci
    agg, agg_ci = _aggregate(g, ok)
    stalls = g.params.get("stalls_s")
    slow = g.params.get("slow_waves_s")
    warm = [float(r.record.ttft_s) for r in g.records if is_warmup(r) and succeeded(r) and r.record.ttft_s is not None]
    # a step measured several times is judged on all its requests together (the figures shown);
    # `split`: the measurements, each judged alone, disagreed (the step is then within the noise)
    met, problem = None if slo is None else slo.met, step_problem(s)
    votes = g.params.get("verdicts")
    split = met is not None and isinstance(votes, list) and len(set(map(bool, votes))) > 1
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
        agg,
        anomalies,
        s.goodput,
        met,
        None if slo is None else slo.breaches,
        problem,
        g.params.get("unit") == RATE_UNIT,
        warmup=sum(1 for r in g.records if is_warmup(r)),
        measured=int(g.param("measured") or 1),
        aggregate_tps_ci=agg_ci,
        intervals=intervals,
        stalls_s=tuple(float(x) for x in stalls if isinstance(x, (int, float))) if isinstance(stalls, list) else (),
        slo_thresholds=thresholds,
        split=split,
        warmup_ttft_p95_s=percentile_of(warm, 95),
        slow_waves_s=tuple(float(x) for x in slow if isinstance(x, (int, float))) if isinstance(slow, list) else (),
    )


def _aggregate(g: Group, ok: Sequence[RunRecord]) -> tuple[float | None, Interval | None]:
    """A step's aggregate tok/s over its steady state, and its interval. A closed loop's
    streams are never idle, so its aggregate is streams x output tokens / request time over
    the judged requests (the warm-up and the drain at the end left out); a step of sessions or
    rates counts every request's tokens over the time the step ran (`span_s`, summed over its
    measurements). Steps of files written before these keys keep their summary's figure."""
    toks = [float(r.record.n_out or 0) for r in ok if r.record.duration_s]
    walls = [float(r.record.duration_s or 0.0) for r in ok if r.record.duration_s]
    span = g.param("span_s")
    unit = g.params.get("unit", "streams")
    busy = sum(walls)
    if not toks or busy <= 0:
        return g.summary.aggregate_tps, None
    if unit == "streams" and g.param("measured") is not None:
        scale = _step_value(g)
    elif span:
        every = sorted(
            (r for r in g.records if succeeded(r) and r.record.duration_s), key=lambda r: r.record.started_at
        )
        toks = [float(r.record.n_out or 0) for r in every]
        walls = [float(r.record.duration_s or 0.0) for r in every]
        busy = sum(walls)
        scale = busy / span
    else:
        return g.summary.aggregate_tps, None
    return scale * sum(toks) / busy, ratio_interval(toks, walls, scale)


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
    None when it rose at every step: the last step whose throughput may still have risen by
    `rise_needed` over the best step before it. A step's tok/s is judged on its interval: it
    stopped rising only when even the top of its interval falls short (a step without an
    interval, from an earlier file, on its figure)."""
    if not held:
        return None
    best = held[0]
    for s in held[1:]:
        top = s.aggregate_tps_ci[1] if s.aggregate_tps_ci is not None else (s.aggregate_tps or 0.0)
        if top >= rise_needed(best.step, s.step) * (best.aggregate_tps or 0.0):
            best = s
    return None if best is held[-1] else best


def first_break(steps: Sequence[Step]) -> Step | None:
    """The first judged step (in step order) that broke the SLO, passing over a break within the
    noise that a heavier step's certain hold contradicts (measured again, it still could not be
    trusted; the heavier step could)."""
    ordered = sorted(steps, key=lambda s: s.step)
    sure = [s.step for s in ordered if holds(s) and s.certain]
    return next(
        (s for s in ordered if not s.too_small and not s.slo_met and (s.certain or not any(h > s.step for h in sure))),
        None,
    )


def certainly_breaks(s: Step) -> bool:
    """The step broke the SLO beyond the noise (or had failed requests)."""
    return not s.too_small and s.slo_met is False and s.certain


def contradictions(steps: Sequence[Step]) -> list[tuple[Step, Step]]:
    """Pairs (lighter, heavier) of judged steps whose verdicts contradict: the lighter broke
    the SLO, the heavier held it (more load cannot make a server meet its SLO better)."""
    ordered = [s for s in sorted(steps, key=lambda s: s.step) if not s.too_small]
    out = []
    for i, a in enumerate(ordered):
        if a.slo_met is False and not a.errors:
            out += [(a, b) for b in ordered[i + 1 :] if holds(b)]
    return out


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
    `steps` (every step held) or `too_small` (no step was big enough to judge). With several
    runs of the whole search (`--runs`, a `run` param on each step), the capacity is the run
    with the median answer, and `runs` holds every run's."""
    out: dict[str, Capacity] = {}
    sweeps = [g for g in groups if g.kind == "sweep_step" and g.summary.slo is not None]
    for target in dict.fromkeys(g.target for g in sweeps):
        mine = [g for g in sweeps if g.target == target]
        by_run: dict[int, list[Group]] = {}
        for g in mine:
            by_run.setdefault(int(g.param("run") or 1), []).append(g)
        caps = [_capacity(gs) for _, gs in sorted(by_run.items())]
        if len(caps) == 1:
            out[target] = caps[0]
            continue
        values = [c.value for c in caps]
        mid = sorted(values)[(len(values) - 1) // 2]
        pick = next(c for c in caps if c.value == mid)
        out[target] = replace(pick, runs=tuple(values))
    return out


def answer_of(steps: Sequence[Step]) -> tuple[float, Step | None, Step | None]:
    """(the capacity, the first step that broke the SLO, the knee) of judged `steps`: the
    largest step that held below the first break (`first_break`: a break within the noise
    that a heavier step's certain hold contradicts is passed over), never past the knee; 0
    when none held."""
    broke = first_break(steps)
    held = [s for s in sorted(steps, key=lambda s: s.step) if holds(s) and (broke is None or s.step < broke.step)]
    knee = knee_of(held)
    best = knee.step if knee is not None else held[-1].step if held else 0
    return best, broke, knee


def _capacity(groups: Sequence[Group]) -> Capacity:
    gs = sorted(groups, key=_step_value)
    steps = tuple(step_figures(g) for g in gs)
    best, broke, knee = answer_of(steps)
    if knee is not None:
        limited = "throughput"
    elif any(holds(s) for s in steps if broke is None or s.step < broke.step):
        limited = "steps" if broke is None else "errors" if broke.errors else "slo"
    else:
        limited = "too_small" if broke is None else "errors" if broke.errors else "slo"
    verdict = gs[0].summary.slo
    low, high = _interval(steps, best, knee)
    return Capacity(
        best,
        str(gs[0].params.get("unit", "streams")),
        {} if verdict is None else verdict.thresholds,
        limited,
        steps,
        None if broke is None else broke.step,
        None if knee is None else knee.step,
        tuple(s.step for s in steps if s.too_small),
        low=low,
        high=high,
        contradicted=tuple((a.step, b.step) for a, b in contradictions(steps)),
    )


def _interval(steps: Sequence[Step], value: float, knee: Step | None) -> tuple[float | None, float | None]:
    """Where the capacity lies given the noise: from the largest step up to `value` that held
    the SLO beyond the noise (0: none did) to the step before the first past `value` that
    broke it beyond the noise (or, past a knee, the step before the next one measured). None,
    None for steps of files written before the intervals."""
    if not any(s.intervals or s.errors for s in steps if not s.too_small):
        return None, None
    judged_ = [s for s in steps if not s.too_small]
    low = max((s.step for s in judged_ if holds(s) and s.certain and s.step <= value), default=0.0)
    if knee is not None:
        low = value
    above = [s for s in judged_ if s.step > value]
    stop = next((s for s in above if knee is not None or certainly_breaks(s)), None)
    if stop is None:
        high = max((s.step for s in judged_), default=value)
    elif stop.rate:
        high = max((s.step for s in judged_ if s.step < stop.step), default=value)
    else:
        high = stop.step - 1
    return min(low, value), max(high, value)


def _step_value(g: Group) -> float:
    key = "step" if "step" in g.params else "concurrency"
    value = g.param(key)
    if value is None:
        raise KeyError(key)
    return value
