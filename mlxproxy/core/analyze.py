"""Finish a meter into a checked record: the one path the proxy, replay and bench share.

In order, each step once, the data flowing one way (docs/ARCHITECTURE.md): the meter measures
(`RequestMeter.finish`: a frozen `Measurement`, with what the wire's figures and error text
mean already read); the per-request checks run on it and give their verdict: the anomalies
and the trusted output count (`core.detect.findings`, `verdict`); the prompt is fingerprinted
and its conversation found among this upstream's (`core.prefix.fingerprint`, `find_turn`: pure
functions reading the index); the cache doctor judges a continuing turn, measures a first
turn's cold prefill rate and remembers the turn (`core.cachecheck.check_turn`, `cold_rate`,
`PrefixIndex.add`: the index is written only there, after the judgement); and the record is
built once from the measurement, the verdict and the conversation fields
(`core.record.checked_record`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from mlxproxy.core.cachecheck import PrefixIndex, check_turn, cold_rate
from mlxproxy.core.detect import Thresholds, findings, verdict
from mlxproxy.core.meter import RequestMeter
from mlxproxy.core.prefix import find_turn, fingerprint
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
    m = meter.finish(t_end, outcome=outcome, error=error, count_tokens=count_tokens)
    found, stalls = findings(m, th, earlier)
    v = verdict(m, found, stalls)
    anomalies, evidence = v.anomalies, v.anomaly_evidence
    fields: dict[str, Any] = {}
    info = meter.request
    pp = None
    if prefixes is not None and info.prompt_obj is not None:
        pp = fingerprint(info.endpoint, info.prompt_obj, info.model)
    if prefixes is not None and pp is not None:
        # the turn: looked up, judged, remembered (with its cold rate and lost seconds)
        match = find_turn(prefixes.latest, pp, info.prompt_obj)
        if match is not None:
            fields, more = check_turn(m, match, prefixes.prefill_rate(), th)
            for a in more:  # (kinds of their own: the per-request checks never name them)
                if a.kind not in evidence:
                    anomalies += (a.kind,)
                    evidence[a.kind] = a.evidence
        if m.outcome in OK_OUTCOMES:
            burst = "non_incremental_stream" in evidence
            cold = cold_rate(m, th) if match is None and not burst else None
            lost = fields.get("reprefill_lost_s") or 0.0
            # the whole prompt: a server whose prompt_tokens leaves the cached ones out (mlx-openai-server,
            # Ollama before 0.33.3) would otherwise make the next turn's reusable prefix that small
            whole = m.whole_prompt_tokens
            cid, turn = prefixes.add(pp, match, m.id, whole, t_end, cold_prefill_tps=cold, lost_s=lost)
        elif match is not None:
            cid, turn = match.conversation_id, match.turn
        else:
            cid, turn = None, None
        fields.update(conversation_id=cid, turn=turn)
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
