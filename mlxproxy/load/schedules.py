"""Load shapes and what they answer: open-loop arrival schedules and the load generator's
own limit (more in later sections: SLOs, goodput, sweeps and the capacity verdict).

Arrival schedules (`--rate R --arrival constant|poisson --seed N`): request i is due at
`offsets[i]` seconds from the start of the step, whatever the server does (open loop).
`constant` spaces requests exactly 1/R apart; `poisson` draws independent exponential gaps
of mean 1/R from a seeded generator, so a run can be repeated exactly.

The load generator measures its own lateness (schedule lag: actual send time - due time)
and says when it, rather than the server, was the limit: when the lag's p99 exceeds both
`GENERATOR_LAG_S` (25 ms) and a quarter of the mean gap, or when it sent under 95 % of the
schedule's own rate, the requests did not go out as asked and the figures describe the
generator, not the server.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from mlxproxy.load.results import ResultFile, ResultKind, Summary

if TYPE_CHECKING:
    from mlxproxy.load.results import Group

__all__ = [
    "ARRIVALS",
    "arrival_offsets",
    "ramp_offsets",
    "GENERATOR_LAG_S",
    "generator_note",
    "sent_rate",
    "schedule",
    "SLO_METRICS",
    "DEFAULT_SLO",
    "parse_slo",
    "slo_text",
    "judge",
    "step_problem",
    "parse_fail_on",
    "failed_checks",
    "step_figures",
    "capacity_of",
    "result_file",
    "capacity_line",
    "sweep_charts",
    "capacity_value",
    "RATE_UNIT",
]

ARRIVALS = ("constant", "poisson")
GENERATOR_LAG_S = 0.025  # schedule lag p99 above this and above ...
GENERATOR_LAG_SHARE = 0.25  # ... this share of the mean gap (1/R): the generator was the limit
GENERATOR_RATE_SHARE = 0.95  # or it sent under this share of the schedule's own rate


def arrival_offsets(n: int, rate: float, arrival: str = "constant", seed: int = 0) -> list[float]:
    """Due times (seconds from the step's start) of `n` requests at `rate` requests/s."""
    if not rate > 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate!r}")
    if arrival == "constant":
        return [i / rate for i in range(n)]
    if arrival != "poisson":
        raise ValueError(f"unknown arrival {arrival!r}; choose one of {', '.join(ARRIVALS)}")
    rng = random.Random(seed)
    out, t = [], 0.0
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def ramp_offsets(rate: float, ramp_s: float, arrival: str = "constant", seed: int = 0) -> list[float]:
    """Due times of a ramp: the arrival rate rising linearly from 0 to `rate` over `ramp_s`
    seconds (about rate * ramp_s / 2 requests). Arrivals are those of a unit-rate schedule
    (evenly spaced, or Poisson from `seed`) mapped through the inverse of the ramp's
    cumulative rate, Lambda(t) = rate * t**2 / (2 * ramp_s)."""
    if not ramp_s > 0:
        return []
    total = rate * ramp_s / 2.0
    if arrival == "constant":
        units = [float(i) for i in range(int(total))]
    else:
        rng = random.Random(seed + 1)  # not the measured schedule's draws
        units, s = [], rng.expovariate(1.0)
        while s < total:
            units.append(s)
            s += rng.expovariate(1.0)
    return [math.sqrt(2.0 * ramp_s * u / rate) for u in units]


def schedule(n: int, rate: float, arrival: str = "constant", seed: int = 0) -> tuple[list[float], dict[str, Any]]:
    """`arrival_offsets` and the group params that describe them (`scheduled_rate`: the
    schedule's own rate, which a short Poisson schedule makes differ from `rate`)."""
    offs = arrival_offsets(n, rate, arrival, seed)
    return offs, {"rate": rate, "arrival": arrival, "seed": seed, "scheduled_rate": sent_rate(offs)}


def sent_rate(send_times: Sequence[float]) -> float | None:
    """Requests/s actually sent: (n - 1) / (last send - first send)."""
    ts = sorted(send_times)
    if len(ts) < 2 or ts[-1] <= ts[0]:
        return None
    return (len(ts) - 1) / (ts[-1] - ts[0])


def generator_note(label: str, summary: Summary, params: Mapping[str, Any] | None = None) -> str | None:
    """One line on the load generator's schedule lag; says when the generator, rather than
    the server, was the limit. None when the group had no schedule."""
    lag = summary.figure("schedule_lag_s")
    if not lag or not lag.get("count"):
        return None
    params = params or {}
    rate, scheduled, achieved = params.get("rate"), params.get("scheduled_rate"), summary.figure("sent_rate")
    p50, p99 = lag["p50"] or 0.0, lag["p99"] or 0.0
    limit = max(GENERATOR_LAG_S, GENERATOR_LAG_SHARE / rate) if rate else GENERATOR_LAG_S
    head = f"{label}: schedule lag p50 {p50 * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms"
    if scheduled and achieved:
        head += f"; sent {achieved:.2f} req/s, scheduled {scheduled:.2f}"
    why = []
    if p99 > limit:
        why.append(f"lag p99 over {limit * 1000:.0f} ms")
    if scheduled and achieved and achieved < GENERATOR_RATE_SHARE * scheduled:
        why.append(f"sent under {GENERATOR_RATE_SHARE:.0%} of the scheduled rate")
    if why:
        return (
            head + f": the load generator, not the server, was the limit ({', '.join(why)}); these figures do"
            " not describe the server at the load asked"
        )
    return head + " (the load generator kept to its schedule)"


# -- SLOs and goodput ----------------------------------------------------------------------
#
# An SLO is a set of thresholds `METRIC_pNN=VALUE`: the NNth percentile of METRIC over a
# step's successful requests must be at most VALUE (at least VALUE for decode_tps). Times
# take `ms` or `s` (a bare number is seconds). Goodput is the share (and the rate, per
# second of the step's wall time) of the step's requests that succeeded and whose own
# figures met every threshold; a figure a request cannot have (TPOT of a one-token answer)
# is not held against it.

#: metric -> (record key, unit, True when the threshold is a lower bound, label)
SLO_METRICS: dict[str, tuple[str, str, bool, str]] = {
    "ttft": ("ttft_s", "s", False, "TTFT"),
    "tpot": ("tpot_s", "s", False, "TPOT"),
    "itl": ("tpot_s", "s", False, "ITL"),  # inter-token latency: a stream's mean gap, the same as TPOT
    "e2e": ("e2e_s", "s", False, "E2E"),
    "decode_tps": ("decode_tps", "tok/s", True, "decode tok/s"),
}
#: for interactive coding agents: 95 % of requests start answering within 5 s and then
#: stream at least 10 tokens/s (faster than anyone reads a diff)
DEFAULT_SLO = "ttft_p95=5s,tpot_p95=100ms"


def parse_slo(text: str) -> dict[str, float]:
    """`ttft_p95=3s,tpot_p50=60ms` -> {"ttft_p95": 3.0, "tpot_p50": 0.06}; ValueError (one
    sentence naming the bad part and the right form) otherwise."""
    out: dict[str, float] = {}
    form = (
        "give KEY=VALUE,... with KEY one of "
        + ", ".join(f"{m}_pNN" for m in SLO_METRICS)
        + ", e.g. ttft_p95=3s,tpot_p50=60ms"
    )
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        key, sep, value = part.partition("=")
        key, value = key.strip().lower(), value.strip().lower()
        metric, _, pct = key.rpartition("_p")
        if not sep or metric not in SLO_METRICS or not pct.isdigit() or not 1 <= int(pct) <= 100:
            raise ValueError(f"{part!r}: {form}")
        unit = SLO_METRICS[metric][1]
        scale = 1.0
        if unit == "s":
            if value.endswith("ms"):
                value, scale = value[:-2], 0.001
            elif value.endswith("s"):
                value = value[:-1]
        elif value.endswith("tok/s"):
            value = value[:-5]
        try:
            v = float(value) * scale
        except ValueError:
            raise ValueError(
                f"{part!r}: the value must be a number" + (" (with ms or s)" if unit == "s" else "") + f"; {form}"
            ) from None
        if not (v > 0 and math.isfinite(v)):
            raise ValueError(f"{part!r}: the value must be more than 0; {form}")
        out[f"{metric}_p{int(pct)}"] = v
    if not out:
        raise ValueError(f"no thresholds in {text!r}; {form}")
    return out


def _split(key: str) -> tuple[str, int]:
    metric, _, pct = key.rpartition("_p")
    return metric, int(pct)


def slo_text(slo: dict[str, float]) -> str:
    """`TTFT p95 <= 5 s, TPOT p95 <= 100 ms`."""
    parts = []
    for key, v in slo.items():
        metric, pct = _split(key)
        _, unit, lower, label = SLO_METRICS[metric]
        parts.append(f"{label} p{pct} {'>=' if lower else '<='} {fmt_value(v, unit)}")
    return ", ".join(parts)


def fmt_value(v: float | None, unit: str) -> str:
    if v is None:
        return "-"
    if unit == "s":
        if v < 0.01:
            return f"{v * 1000:.1f} ms"
        return f"{v * 1000:.0f} ms" if v < 1 else f"{v:.2f} s".replace(".00 s", " s")
    return f"{v:.1f} {unit}"


def _ok(r: Mapping[str, Any]) -> bool:
    return r.get("outcome") in ("ok", "ok_no_done")


def request_meets(r: Mapping[str, Any], slo: dict[str, float]) -> bool:
    """One request's own figures against every threshold (a failed request never meets it)."""
    if not _ok(r):
        return False
    for key, v in slo.items():
        field, _, lower, _ = SLO_METRICS[_split(key)[0]]
        x = r.get(field)
        if x is None:
            continue
        if (x < v) if lower else (x > v):
            return False
    return True


def _pct(values: list[float], q: float) -> float | None:
    from mlxproxy.core.stats import percentile

    return percentile(sorted(values), q)


def judge(records: Sequence[Mapping[str, Any]], slo: dict[str, float]) -> dict[str, Any]:
    """The SLO and goodput of one step (records as in result files): `{"slo": {"met",
    "breaches": [{"key", "value", "threshold"}]}, "goodput": {"good", "requests", "share",
    "rate"}}`. A step with failed requests or none that succeeded does not meet the SLO."""
    ok = [r for r in records if _ok(r)]
    breaches, values = [], {}
    for key, v in slo.items():
        metric, pct = _split(key)
        field, _, lower, _ = SLO_METRICS[metric]
        value = values[key] = _pct([r[field] for r in ok if r.get(field) is not None], pct)
        if value is not None and ((value < v) if lower else (value > v)):
            breaches.append({"key": key, "value": value, "threshold": v})
    good = sum(1 for r in records if request_meets(r, slo))
    starts = [r["started_at"] for r in records if r.get("started_at") is not None]
    ends = [r["started_at"] + (r.get("duration_s") or 0.0) for r in records if r.get("started_at") is not None]
    span = (max(ends) - min(starts)) if starts else 0.0
    errors = len(records) - len(ok)
    return {
        "slo": {
            "met": bool(ok) and not breaches and not errors,
            "breaches": breaches,
            "errors": errors,
            "values": values,
            "thresholds": dict(slo),
        },
        "goodput": {
            "good": good,
            "requests": len(records),
            "share": good / len(records) if records else None,
            "rate": good / span if span > 0 else None,
        },
    }


def breach_text(b: dict[str, Any]) -> str:
    """`TTFT p95 is 5.2 s (> 3 s)`."""
    metric, pct = _split(b["key"])
    _, unit, lower, label = SLO_METRICS[metric]
    return (
        f"{label} p{pct} is {fmt_value(b['value'], unit)} ({'<' if lower else '>'} {fmt_value(b['threshold'], unit)})"
    )


def step_problem(step: Mapping[str, Any] | Summary) -> str:
    """Why a judged step (a summary, or `judge`'s output) broke the SLO, in words (empty when it held)."""
    s = (step.slo if isinstance(step, Summary) else step.get("slo")) or {}
    goodput = (step.goodput if isinstance(step, Summary) else step.get("goodput")) or {}
    parts = [breach_text(b) for b in s.get("breaches", ())]
    if s.get("errors"):
        parts.append(f"{s['errors']} of {goodput.get('requests')} requests failed")
    if not parts and not s.get("met"):
        parts.append("no request succeeded")
    return "; ".join(parts)


# -- --fail-on -------------------------------------------------------------------------------

FAIL_ON_WORDS = {
    "slo": "a judged test broke the SLO (a sweep: its lightest step)",
    "errors": "a request failed",
    "anomaly": "any anomaly was found",
}


def parse_fail_on(text: str) -> tuple[str, ...]:
    from mlxproxy.core.detect import ANOMALY_KINDS

    kinds = tuple(dict.fromkeys(k.strip().lower() for k in text.split(",") if k.strip()))
    known = (*FAIL_ON_WORDS, *ANOMALY_KINDS)
    bad = [k for k in kinds if k not in known]
    if bad or not kinds:
        raise ValueError(f"{(bad or [text])[0]!r} is not a check; give KIND,... with KIND one of {', '.join(known)}")
    return kinds


def failed_checks(kinds: Sequence[str], groups: Sequence[Group]) -> list[str]:
    """What broke, one phrase per failed check (empty: every check held). `groups` are
    result groups; the SLO is read from the judged ones (`summary.slo`)."""
    from mlxproxy.core.detect import ANOMALY_KINDS

    out = []
    uniq = {(g.target, r["id"]): r for g in groups for r in g.records}.values()
    total = len(uniq)
    for kind in kinds:
        if kind == "slo":
            by_target: dict[str, list[Group]] = {}
            for g in groups:
                if g.summary.slo is not None:
                    by_target.setdefault(g.target, []).append(g)
            for target, gs in by_target.items():
                steps = [g for g in gs if g.kind == "sweep_step"]
                judged = steps[:1] if steps else gs
                broken = [g for g in judged if not (g.summary.slo or {}).get("met")]
                if broken:
                    g = broken[0]
                    out.append(f"SLO broken on {target} {g.mode}: {step_problem(g.summary)}")
        elif kind == "errors":
            bad = [r for r in uniq if not _ok(r)]
            if bad:
                out.append(f"{len(bad)} of {total} requests failed")
        else:
            kinds_ = ANOMALY_KINDS if kind == "anomaly" else (kind,)
            hit = [r for r in uniq if any(k in kinds_ for k in r.get("anomalies", ()))]
            if hit:
                seen = sorted({k for r in hit for k in r.get("anomalies", ()) if k in kinds_})
                out.append(f"{', '.join(seen)} in {len(hit)} of {total} requests")
    return out


# -- sweeps and the capacity verdict ---------------------------------------------------------
#
# A sweep runs steps of growing load with the same requests: closed-loop streams or agent
# sessions at once (given, or doubling from 1), or open-loop rates (given). Doubling stops at
# saturation: the step broke the SLO, or had failed requests, or its aggregate tok/s rose less
# than `RISE` over the best earlier step. The capacity is the largest step up to which every
# step met the SLO. One sweep per target and run.

MAX_AUTO_CONCURRENCY = 256
RISE = 1.05  # aggregate tok/s must grow at least 5 % per doubling, else the server is saturated
MIN_PER_STREAM = 3  # each stream of a sweep step sends at least this many requests


def step_figures(g: Group) -> dict[str, Any]:
    """The per-step figures of a judged sweep group (what `capacity.steps` holds)."""
    recs = g.records
    ok = [r for r in recs if _ok(r)]

    def p(field: str, q: float) -> float | None:
        return _pct([r[field] for r in ok if r.get(field) is not None], q)

    anomalies: dict[str, int] = {}
    for r in recs:
        for k in r.get("anomalies", ()):
            anomalies[k] = anomalies.get(k, 0) + 1
    s = g.summary
    slo = s.slo or {}
    step = _step_value(g)
    key = "rate" if g.params.get("unit") == RATE_UNIT else "concurrency"
    return {
        "step": step,
        key: step,
        "requests": len(recs),
        "ok": len(ok),
        "errors": len(recs) - len(ok),
        "ttft_p50_s": p("ttft_s", 50),
        "ttft_p95_s": p("ttft_s", 95),
        "tpot_p50_s": p("tpot_s", 50),
        "tpot_p95_s": p("tpot_s", 95),
        "decode_tps_p50": p("decode_tps", 50),
        "aggregate_tps": s.aggregate_tps,
        "anomalies": anomalies,
        "goodput": s.goodput,
        "slo_met": slo.get("met"),
        "breaches": slo.get("breaches"),
        "problem": step_problem(s),
    }


def stop_reason(steps: Sequence[dict[str, Any]]) -> str | None:
    """Why doubling stops after the last of `steps` (step_figures), or None to go on."""
    last = steps[-1]
    if last["errors"]:
        return "errors"
    if not last["slo_met"]:
        return "slo"
    earlier = [s["aggregate_tps"] for s in steps[:-1] if s["aggregate_tps"] is not None]
    if earlier and (last["aggregate_tps"] or 0.0) < RISE * max(earlier):
        return "throughput"
    return None


def capacity_of(groups: Sequence[Group]) -> dict[str, dict[str, Any]]:
    """The `capacity` object per target of a run's sweep groups (empty without a sweep):
    `{"max_concurrency", "slo", "limited_by", "steps"}`; limited_by is `slo` or `errors`
    (the first step past the capacity broke the SLO / had failed requests), `throughput`
    (aggregate tok/s stopped rising while the SLO still held) or `steps` (every step held)."""
    out: dict[str, dict[str, Any]] = {}
    judged = [g for g in groups if g.kind == "sweep_step" and g.summary.slo is not None]
    for target in dict.fromkeys(g.target for g in judged):
        gs = sorted((g for g in judged if g.target == target), key=_step_value)
        steps = [step_figures(g) for g in gs]
        best, broke = 0, None
        for st in steps:
            if not st["slo_met"]:
                broke = st
                break
            best = st["step"]
        if broke is not None:
            limited = "errors" if broke["errors"] else "slo"
        else:
            limited = "throughput" if len(steps) > 1 and stop_reason(steps) == "throughput" else "steps"
        unit = gs[0].params.get("unit", "streams")
        cap = {
            "max_rate" if unit == RATE_UNIT else "max_concurrency": best,
            "slo": (gs[0].summary.slo or {})["thresholds"],
            "limited_by": limited,
            "unit": unit,
            "steps": steps,
        }
        if broke is not None:
            cap["broken_at"] = broke["step"]
        out[target] = cap
    return out


RATE_UNIT = "req/s"


def _step_value(g: Group) -> float:
    p = g.params
    return p["step"] if "step" in p else p["concurrency"]


def step_label(n: float, unit: str = "streams") -> str:
    if unit == RATE_UNIT:
        return f"{n:g} req/s"
    return f"{n:g} concurrent {unit[:-1] if n == 1 else unit}"


def capacity_value(cap: dict[str, Any]) -> float:
    """The capacity figure: `max_concurrency` or, for a sweep of rates, `max_rate`."""
    return cap["max_rate"] if "max_rate" in cap else cap["max_concurrency"]


def capacity_line(target: str, cap: dict[str, Any]) -> str:
    """The one-line verdict: `t: meets the SLO up to 3 concurrent streams; at 4, TTFT p95 is 5.2 s (> 3 s)`."""
    steps, unit = cap["steps"], cap.get("unit", "streams")
    broke = next((s for s in steps if s["step"] == cap.get("broken_at")), None)
    at = (lambda v: f"{v:g} req/s") if unit == RATE_UNIT else (lambda v: f"{v:g}")
    if broke is not None and capacity_value(cap) == 0:
        return f"{target}: does not meet the SLO even at {step_label(broke['step'], unit)}: {broke['problem']}"
    if broke is not None:
        return (
            f"{target}: meets the SLO up to {step_label(capacity_value(cap), unit)}; at {at(broke['step'])}, "
            f"{broke['problem']}"
        )
    last = steps[-1]
    line = f"{target}: meets the SLO at every step, up to {step_label(last['step'], unit)}"
    if cap["limited_by"] == "throughput":
        best = max(steps, key=lambda s: s["aggregate_tps"] or 0.0)
        line += (
            f"; aggregate tok/s stopped rising ({best['aggregate_tps']:.0f} tok/s at {at(best['step'])},"
            f" {last['aggregate_tps'] or 0.0:.0f} at {at(last['step'])})"
        )
    return line


def sweep_charts(groups: Sequence[Group]) -> list[Any]:
    """The plot of a sweep: TTFT and TPOT p50/p95 and aggregate tok/s by concurrency, one
    line per target and percentile, the SLO's thresholds as dashed lines ([] without a sweep)."""
    from mlxproxy.load.plot import Chart

    caps = capacity_of(groups)
    if not caps:
        return []
    ttft, tpot, agg = [], [], []
    for target, cap in caps.items():
        steps = cap["steps"]
        for q in ("p50", "p95"):
            ttft.append((f"{target} {q}", [(float(s["step"]), s[f"ttft_{q}_s"]) for s in steps]))
            tpot.append(
                (
                    f"{target} {q}",
                    [
                        (float(s["step"]), None if s[f"tpot_{q}_s"] is None else s[f"tpot_{q}_s"] * 1000.0)
                        for s in steps
                    ],
                )
            )
        agg.append((target, [(float(s["step"]), s["aggregate_tps"]) for s in steps]))
    slo = next(iter(caps.values()))["slo"]
    unit = next(iter(caps.values())).get("unit", "streams")
    xl = "requests/s sent (open loop)" if unit == RATE_UNIT else f"concurrent {unit}"
    by = "rate" if unit == RATE_UNIT else "concurrency"

    def lines(metric: str, scale: float) -> list[tuple[str, float]]:
        out = []
        for key, v in slo.items():
            m, pct = _split(key)
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
    extra: Mapping[str, Any] | None = None,
) -> ResultFile:
    """The result file of this run, written now by this version, with the sweeps' capacity."""
    capacity = capacity_of(groups)
    return ResultFile.new(kind, groups, verdicts, {**(extra or {}), **({"capacity": capacity} if capacity else {})})
