"""A measurement disturbed as a whole: one wave of a step's requests slow from its first token.

A closed loop's streams, and a sessions step's conversations, run in waves on a batching server:
the requests admitted together end together and are sent again together. A server that cannot
take a wave leaves part of it behind (its first requests on time, the rest a batch later); a host
that gives the server or the load generator no core for a moment slows every request in flight
at once: a whole wave, its fastest request included, late. Measured against mlx_lm.server on a
busy 2-core machine (issue 37): a 7-stream step whose waves took 0.35 s to their first token had
one wave of all 7 at 0.60-0.73 s, and its p95 broke the SLO where an independent client measured
0.38-0.48 s that minute. Such a measurement says what the host did, not what the server can take:
the sweep measures it again (`mlxproxy.load.run.sweep`).

A sessions step's conversations run in waves too (all start together; each turn of one ends with
the others' and, after the think time, is sent with them), but its turns differ in what they
send: on the same server a later turn (a longer cached history, a new tool output) takes longer
to its first token than an earlier one (at 8 sessions 0.18 s at turn 1, 0.30-0.33 s at turn 4),
so a wave cannot be measured against the other waves of its look. It is measured against the
same turn in the step's other looks: a look that broke the SLO where another look of the step
held it, with a whole wave slower than that turn took in the looks that held (`slow_looks`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from mlxproxy.core.stats import percentile
from mlxproxy.load.data.results import RunRecord
from mlxproxy.load.judge.slo import judged, succeeded

__all__ = ["MIN_WAVE", "SLOW_WAVE", "WAVE_GAP", "WAVE_GAP_MIN_S", "WHOLE_WAVE", "slow_looks", "slow_waves", "waves_of"]

#: requests sent within this share of the step's median TTFT of the one before are one wave
WAVE_GAP: float = 0.25
#: ... and at least this far apart in seconds (a busy host spreads one wave's sends over 8-30 ms)
WAVE_GAP_MIN_S: float = 0.03
#: a wave is whole when it holds at least this share of the step's streams (a split leaves less),
#: and `MIN_WAVE` requests (two or three streams slow together by chance is not rare)
WHOLE_WAVE: float = 0.75
MIN_WAVE: int = 3
#: a whole wave is slow when even its fastest request's TTFT is over this many times the step's
#: undisturbed pace (on a closed loop at a fixed count every whole wave is alike: 0.33-0.34 s on
#: mlx_lm.server at 8 streams, where a busy host's waves took 0.56-0.73 s)
SLOW_WAVE: float = 1.3


def waves_of(records: Sequence[RunRecord]) -> list[list[RunRecord]]:
    """The judged, successful requests with a TTFT, in sent order, cut into waves: a new wave
    where a request was sent more than `WAVE_GAP` x the median TTFT (at least `WAVE_GAP_MIN_S`)
    after the one before."""
    recs = sorted(
        (r for r in judged(records) if succeeded(r) and r.record.ttft_s is not None),
        key=lambda r: r.record.started_at,
    )
    if not recs:
        return []
    median = percentile(sorted(float(r.record.ttft_s or 0.0) for r in recs), 50) or 0.0
    gap = max(WAVE_GAP_MIN_S, WAVE_GAP * median)
    out = [[recs[0]]]
    for prev, r in zip(recs, recs[1:]):
        if r.record.started_at - prev.record.started_at > gap:
            out.append([])
        out[-1].append(r)
    return out


def slow_waves(records: Sequence[RunRecord], streams: float) -> list[float]:
    """The fastest TTFT of each whole wave (at least `WHOLE_WAVE` of `streams`, and `MIN_WAVE`) of
    the step whose every request was slower than `SLOW_WAVE` x the step's undisturbed pace: the
    first quartile of its whole waves' fastest TTFTs (a wave as fast as the server allows; a
    measurement whose host was slow for seconds has most of its waves slow, not just one). []
    for a step of fewer streams or fewer than 3 whole waves to compare."""
    whole = max(MIN_WAVE, math.ceil(WHOLE_WAVE * streams))
    fastest = [min(float(r.record.ttft_s or 0.0) for r in w) for w in waves_of(records) if len(w) >= whole]
    if len(fastest) < 3:
        return []
    pace = percentile(sorted(fastest), 25) or 0.0
    return [f for f in fastest if f > SLOW_WAVE * pace]


def slow_looks(looks: Sequence[Sequence[RunRecord]], held: Sequence[bool], sessions: float) -> dict[int, list[float]]:
    """The looks (measurements) of one sessions step that a busy host disturbed, by index into
    `looks` (`held`: each look's own SLO verdict), each with the fastest TTFT of its slow waves: a
    look that broke the SLO while another look of the step held it, with a whole wave (at least
    `WHOLE_WAVE` of `sessions`, and `MIN_WAVE`) whose every request was slower than `SLOW_WAVE` x
    the median TTFT of the same captured turn in the looks that held. {} where no look held or
    none broke (a step whose every look broke is the server's, whatever its waves did)."""
    if all(held) or not any(held):
        return {}
    pace: dict[tuple[str | None, int | None], list[float]] = {}
    for look, ok in zip(looks, held):
        if ok:
            for w in waves_of(look):
                for r in w:
                    pace.setdefault((r.source_id, r.turn), []).append(float(r.record.ttft_s or 0.0))
    ref = {k: percentile(sorted(v), 50) or 0.0 for k, v in pace.items()}
    whole = max(MIN_WAVE, math.ceil(WHOLE_WAVE * sessions))
    out: dict[int, list[float]] = {}
    for i, (look, ok) in enumerate(zip(looks, held)):
        if ok:
            continue
        slow = [
            min(float(r.record.ttft_s or 0.0) for r in w)
            for w in waves_of(look)
            if len(w) >= whole
            and all((r.source_id, r.turn) in ref for r in w)
            and all(float(r.record.ttft_s or 0.0) > SLOW_WAVE * ref[(r.source_id, r.turn)] for r in w)
        ]
        if slow:
            out[i] = slow
    return out
