"""Finish a meter into a checked record: the one path the proxy, replay and bench share.

In order, each step once: the meter measures (`RequestMeter.finish`, a frozen
`Measurement`); the checks run on the measurement (`core.detect.findings`), the prompt-prefix
checks against this upstream's conversations too; the verdict settles the anomalies and the
trusted output count (`core.detect.verdict`); and the record is built once from the
measurement and the verdict (`core.record.checked_record`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from mlxproxy.core.cachecheck import check_turn
from mlxproxy.core.detect import Anomaly, Thresholds, findings, is_burst, verdict
from mlxproxy.core.meter import Measurement, RequestMeter
from mlxproxy.core.prefix import PrefixIndex, fingerprint
from mlxproxy.core.record import OK_OUTCOMES, Outcome, Record, checked_record

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
    info = meter.request
    m = meter.finish(t_end, outcome=outcome, error=error, count_tokens=count_tokens)
    found, stalls = findings(m, th, earlier)
    pp = (
        fingerprint(info.endpoint, info.prompt_obj, info.model)
        if prefixes is not None and info.prompt_obj is not None
        else None
    )
    fields: dict[str, Any] = {}
    if prefixes is not None and pp is not None:
        fields = _conversation(m, pp, info.prompt_obj, prefixes, th, t_end, is_burst(found), found)
    v = verdict(m, found, stalls)
    return checked_record(
        m,
        completion_tokens=v.completion_tokens,
        tokens_source=v.tokens_source,
        anomalies=v.anomalies,
        anomaly_evidence=v.anomaly_evidence,
        stall_count=v.stall_count,
        stall_total_s=v.stall_total_s,
        conversation=fields,
        error=scrub(m.error) if scrub is not None and m.error is not None else None,
    )


def _conversation(
    record: Measurement,
    pp: Any,
    record_body: Any,
    prefixes: PrefixIndex,
    th: Thresholds,
    t_end: float,
    burst: bool,
    found: list[Anomaly],
) -> dict[str, Any]:
    """The cache doctor's checks against this upstream's earlier prompts (appended to
    `found`), the record's `conversation_id` and `turn`, and this prompt remembered (when it
    was served)."""
    fields: dict[str, Any] = {}
    match = prefixes.match(pp, record_body)
    if match is not None:
        fields, more = check_turn(record, match, prefixes.prefill_rate(), th)
        found.extend(more)
    if record.outcome in OK_OUTCOMES:
        cold = _cold_rate(record, match, burst, th)
        if cold is not None and match is None:
            prefixes.cold_prefill_tps.append(cold)
        cid, turn = prefixes.add(
            pp,
            match,
            record.id,
            record.prompt_tokens,
            t_end,
            cold_prefill_tps=cold,
            lost_s=fields.get("reprefill_lost_s") or 0.0,
        )
    elif match is not None:
        cid, turn = match.conversation_id, match.turn
    else:
        cid, turn = None, None
    fields.update(conversation_id=cid, turn=turn)
    return fields


def _cold_rate(record: Measurement, match: Any, burst: bool, th: Thresholds) -> float | None:
    """This request's prefill rate when it says how fast a cold cache prefills: a first turn
    that reports no cached tokens, over at least `prefix_min_tokens` prompt tokens."""
    if match is not None or record.cached_tokens or burst or not record.prefill_tps:
        return None
    return record.prefill_tps if (record.prompt_tokens or 0) >= th.prefix_min_tokens else None
