"""Finish a meter into a checked record: the one path the proxy, replay and bench share.

In order, each step once, the data flowing one way: the meter measures (`RequestMeter.finish`:
a frozen `Measurement`, with what the wire's figures and error text mean already read); the
prompt is fingerprinted and looked up among this upstream's conversations (`core.prefix`);
the per-request checks run on the measurement and give their verdict: the anomalies and
the trusted output count (`core.detect.findings`, `verdict`); the cache doctor judges the
turn and the index remembers it (`core.cachecheck.conversation_turn`); and the record is
built once from the measurement and the verdict (`core.record.checked_record`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from mlxproxy.core.cachecheck import conversation_turn
from mlxproxy.core.detect import Thresholds, findings, verdict
from mlxproxy.core.meter import RequestMeter
from mlxproxy.core.prefix import PrefixIndex
from mlxproxy.core.record import Outcome, Record, checked_record

__all__ = ["finish_checked"]


def finish_checked(
    meter: RequestMeter,
    t_end: float,
    th: Thresholds,
    *,
    outcome: Outcome | None = None,
    error: str | None = None,
    earlier: Sequence[Record] = (),
    count_tokens: Callable[[str], int] | None = None,
    prefixes: PrefixIndex | None = None,
    scrub: Callable[[str], str] | None = None,
) -> Record:
    """`meter.finish` plus the per-record truth checks and, against `earlier` records
    of the same process, the serialized-batching check. `count_tokens` (a tokenizer)
    makes the usage check exact; a failing tokenizer is ignored. `prefixes` (this
    upstream's prompt-prefix index) adds the conversation fields and the prefix checks,
    and remembers this request's prompt fingerprints. `scrub` takes secrets out of the
    record's error text."""
    m = meter.finish(t_end, outcome=outcome, error=error, count_tokens=count_tokens)
    found, stalls = findings(m, th, earlier)
    v = verdict(m, found, stalls)
    anomalies, evidence = v.anomalies, v.anomaly_evidence
    fields: dict[str, Any] = {}
    if prefixes is not None:
        burst = "non_incremental_stream" in evidence
        fields, more = conversation_turn(m, meter.request, prefixes, th, t_end, burst)
        for a in more:  # (kinds of their own: the per-request checks never name them)
            if a.kind not in evidence:
                anomalies += (a.kind,)
                evidence[a.kind] = a.evidence
    return checked_record(
        m,
        completion_tokens=v.completion_tokens,
        tokens_source=v.tokens_source,
        anomalies=anomalies,
        anomaly_evidence=evidence,
        stall_count=v.stall_count,
        stall_total_s=v.stall_total_s,
        conversation=fields,
        error=scrub(m.error) if scrub is not None and m.error is not None else None,
    )
