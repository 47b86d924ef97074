"""SLOs, goodput and `--fail-on`: how one step (or any test) is judged.

An SLO is a set of thresholds `METRIC_pNN=VALUE`: the NNth percentile of METRIC over a
step's successful requests must be at most VALUE (at least VALUE for decode_tps). Times
take `ms` or `s` (a bare number is seconds). Goodput is the share (and the rate, per
second of the step's wall time) of the step's requests that succeeded and whose own
figures met every threshold; a figure a request cannot have (TPOT of a one-token answer)
is not held against it.

Only generation requests are judged (chat and text completions, Messages, Responses): a
replayed `GET /v1/models` answers in a millisecond with no tokens and says nothing about
serving. Nor is a sweep step's warm-up (`is_warmup`: each stream's first request, sent while
every stream starts at once). A request sent late by an open loop (`schedule_lag_s` on its record) is judged on
its effective latency: TTFT and E2E from when it was due, not from when it was sent.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from mlxproxy.core.detect import ANOMALY_KINDS
from mlxproxy.core.openai import GENERATION_ENDPOINTS
from mlxproxy.core.record import OK_OUTCOMES, Record
from mlxproxy.core.stats import percentile
from mlxproxy.load.data.results import Group, RunRecord
from mlxproxy.load.data.summary import Breach, Goodput, Judgment, SloVerdict, Summary

# the option values' meaning (--slo, --fail-on) is the vocabulary's, shared by the commands
from mlxproxy.vocabulary import SLO_METRICS, parse_fail_on, parse_slo

__all__ = [
    "SLO_METRICS",
    "MIN_STEP_REQUESTS",
    "Breach",
    "SloVerdict",
    "Goodput",
    "Judgment",
    "DEFAULT_SLO",
    "parse_slo",
    "slo_text",
    "fmt_value",
    "split_key",
    "succeeded",
    "percentile_of",
    "judge",
    "is_warmup",
    "judged",
    "request_meets",
    "effective",
    "breach_text",
    "step_problem",
    "parse_fail_on",
    "failed_checks",
]

#: a sweep step with fewer generation requests than this is too small to judge (its p95 would
#: be its largest value or next to it)
MIN_STEP_REQUESTS = 20
#: for interactive coding agents: 95 % of requests start answering within 5 s and then
#: stream at least 10 tokens/s (faster than anyone reads a diff)
DEFAULT_SLO = "ttft_p95=5s,tpot_p95=100ms"


def split_key(key: str) -> tuple[str, int]:
    metric, _, pct = key.rpartition("_p")
    return metric, int(pct)


def slo_text(slo: Mapping[str, float]) -> str:
    """`TTFT p95 <= 5 s, TPOT p95 <= 100 ms`."""
    parts = []
    for key, v in slo.items():
        metric, pct = split_key(key)
        _, unit, lower, label = SLO_METRICS[metric]
        parts.append(f"{label} p{pct} {'>=' if lower else '<='} {fmt_value(v, unit)}")
    return ", ".join(parts)


def fmt_value(v: float | None, unit: str, extra: int = 0) -> str:
    """`v` in `unit` for people; `extra` more decimal places than usual."""
    if v is None:
        return "-"
    if unit == "s":
        if v < 0.01:
            return f"{v * 1000:.{1 + extra}f} ms"
        if v < 1:
            return f"{v * 1000:.{extra}f} ms"
        return f"{v:.{2 + extra}f} s" if extra else f"{v:.2f} s".replace(".00 s", " s")
    return f"{v:.{1 + extra}f} {unit}"


def _shown(text: str) -> float:
    """The number a `fmt_value` text shows, in its base unit."""
    number, _, unit = text.partition(" ")
    return float(number) / (1000 if unit == "ms" else 1)


def fmt_apart(v: float, limit: float, unit: str) -> tuple[str, str]:
    """`v` and `limit` as `fmt_value` texts, with more digits while they would read as equal
    (a p95 just over a 100 ms limit reads `100.3 ms`, not `100 ms`)."""
    for extra in range(8):
        a, b = fmt_value(v, unit, extra), fmt_value(limit, unit, extra)
        if _shown(a) != _shown(b):
            break
    return a, b


def succeeded(r: RunRecord) -> bool:
    return r.record.outcome in OK_OUTCOMES


def request_meets(r: RunRecord, slo: Mapping[str, float]) -> bool:
    """One request's own figures against every threshold (a failed request never meets it)."""
    if not succeeded(r):
        return False
    for key, v in slo.items():
        field, _, lower, _ = SLO_METRICS[split_key(key)[0]]
        x = effective(r, field)
        if x is None:
            continue
        if (x < v) if lower else (x > v):
            return False
    return True


def percentile_of(values: list[float], q: float) -> float | None:
    return percentile(sorted(values), q)


#: figures measured from the request's start: an open loop's schedule lag is added to them
_FROM_START = frozenset({"ttft_s", "e2e_s"})


#: the record's figure of each field an SLO metric names (`SLO_METRICS`)
_FIGURES: dict[str, Callable[[Record], float | None]] = {
    "ttft_s": lambda r: r.ttft_s,
    "tpot_s": lambda r: r.tpot_s,
    "e2e_s": lambda r: r.e2e_s,
    "decode_tps": lambda r: r.decode_tps,
}


def effective(r: RunRecord, field: str) -> float | None:
    """A record's figure as the SLO sees it: TTFT and E2E count the time the request waited
    in the load generator past its due time (`schedule_lag_s`, open loops only)."""
    v = _FIGURES[field](r.record)
    if v is None or field not in _FROM_START:
        return v
    return float(v) + (r.schedule_lag_s or 0.0)


def is_warmup(r: RunRecord) -> bool:
    """A request sent to warm a sweep step up (`"warmup": true` on its row), not judged."""
    return r.extra.get("warmup") is True


def judged(records: Sequence[RunRecord]) -> list[RunRecord]:
    """The records an SLO judges: generation requests only (not `GET /v1/models`; a row
    without an endpoint counts as one), past a sweep step's warm-up."""
    return [r for r in records if r.record.endpoint in GENERATION_ENDPOINTS and not is_warmup(r)]


def judge(records: Sequence[RunRecord], slo: Mapping[str, float]) -> Judgment:
    """The SLO and goodput of one step (records as in result files), over its generation
    requests (`judged`). A step with failed requests or none that succeeded does not meet the SLO."""
    records = judged(records)
    ok = [r for r in records if succeeded(r)]
    breaches: list[Breach] = []
    values: dict[str, float | None] = {}
    for key, v in slo.items():
        metric, pct = split_key(key)
        field_, _, lower, _ = SLO_METRICS[metric]
        value = values[key] = percentile_of([x for r in ok if (x := effective(r, field_)) is not None], pct)
        if value is not None and ((value < v) if lower else (value > v)):
            breaches.append(Breach(key, value, v))
    good = sum(1 for r in records if request_meets(r, slo))
    starts = [r.record.started_at for r in records]
    ends = [r.record.started_at + (r.record.duration_s or 0.0) for r in records]
    span = (max(ends) - min(starts)) if starts else 0.0
    errors = len(records) - len(ok)
    return Judgment(
        SloVerdict(bool(ok) and not breaches and not errors, tuple(breaches), errors, values, dict(slo)),
        Goodput(good, len(records), good / len(records) if records else None, good / span if span > 0 else None),
    )


def breach_text(b: Breach) -> str:
    """`TTFT p95 is 5.2 s (> 3 s)`."""
    metric, pct = split_key(b.key)
    _, unit, lower, label = SLO_METRICS[metric]
    value, limit = fmt_apart(b.value, b.threshold, unit)
    return f"{label} p{pct} is {value} ({'<' if lower else '>'} {limit})"


def step_problem(step: Judgment | Summary) -> str:
    """Why a judged step (a summary, or `judge`'s output) broke the SLO, in words (empty when it held)."""
    s, goodput = step.slo, step.goodput
    if s is None:
        return ""
    parts = [breach_text(b) for b in s.breaches]
    if s.errors:
        parts.append(f"{s.errors} of {goodput.requests if goodput else None} requests failed")
    if not parts and not s.met:
        parts.append("no request succeeded")
    return "; ".join(parts)


# -- --fail-on -------------------------------------------------------------------------------


def failed_checks(kinds: Sequence[str], groups: Sequence[Group]) -> list[str]:
    """What broke, one phrase per failed check (empty: every check held). `groups` are
    result groups; the SLO is read from the judged ones (`summary.slo`)."""
    out = []
    uniq = {(g.target, r.id): r for g in groups for r in g.records}.values()
    total = len(uniq)
    for kind in kinds:
        if kind == "slo":
            by_target: dict[str, list[Group]] = {}
            for g in groups:
                if g.summary.slo is not None:
                    by_target.setdefault(g.target, []).append(g)
            for target, gs in by_target.items():
                steps = sorted((g for g in gs if g.kind == "sweep_step"), key=lambda g: g.param("step") or 0.0)
                big = [g for g in steps if len(judged(g.records)) >= MIN_STEP_REQUESTS]
                if steps and not big:
                    out.append(
                        f"SLO not judged on {target}: every sweep step sent under {MIN_STEP_REQUESTS} generation"
                        " requests"
                    )
                    continue
                lightest = big[:1] if steps else gs
                broken = [g for g in lightest if not (g.summary.slo is not None and g.summary.slo.met)]
                if broken:
                    g = broken[0]
                    out.append(f"SLO broken on {target} {g.mode}: {step_problem(g.summary)}")
        elif kind == "errors":
            bad = [r for r in uniq if not succeeded(r)]
            if bad:
                out.append(f"{len(bad)} of {total} requests failed")
        else:
            kinds_ = ANOMALY_KINDS if kind == "anomaly" else (kind,)
            hit = [r for r in uniq if any(k in kinds_ for k in r.record.anomalies)]
            if hit:
                seen = sorted({k for r in hit for k in r.record.anomalies if k in kinds_})
                out.append(f"{', '.join(seen)} in {len(hit)} of {total} requests")
    return out
