"""replay's groups, built from what its tests measured: a group of records with each one's
`source_id` (and a replayed conversation's places), each request next to its captured figures
(`--compare`), the requests a cancelled run finished but no group holds yet, and how many
replayed prompts the cache served."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from mlxproxy.capture import CapturedRequest
from mlxproxy.core.detect import MOSTLY_CACHED
from mlxproxy.core.record import Record
from mlxproxy.load.data.results import CompareRow, Group, GroupKind, RunRecord, SessionTurn
from mlxproxy.load.data.summary import JSONObject, Summary
from mlxproxy.load.output.report import summarize_records
from mlxproxy.load.run.client import Timed

__all__ = ["compare_rows", "interrupted_group", "replay_group", "served_from_cache"]


def replay_group(
    name: str,
    kind: GroupKind,
    target: str,
    params: JSONObject,
    timed: Timed,
    summary: Summary,
    compare: list[CompareRow] | None = None,
    where: Mapping[str, SessionTurn] | None = None,
) -> Group:
    """A group of `timed`'s records, each with its `source_id` (and its session's `where` keys)."""
    records = timed.rows(where)
    return Group(name, target, name, kind, params, summary, tuple(records), None if compare is None else tuple(compare))


def compare_rows(caps: Sequence[CapturedRequest], timed: Timed) -> list[CompareRow]:
    """Each replayed request's TTFT and decode TPS next to its captured values."""
    by_id = {c.record.id: c for c in caps}
    rows: list[CompareRow] = []
    for r in timed.records:
        src = timed.source_ids.get(r.id)
        c = by_id.get(src) if src else None
        if src is None or c is None:
            continue
        rows.append(
            {
                "source_id": src,
                "model": r.model,
                "captured_ttft_s": c.record.ttft_s,
                "replayed_ttft_s": r.ttft_s,
                "captured_cached_tokens": c.record.cached_tokens,
                "replayed_cached_tokens": r.cached_tokens,
                "replayed_prompt_tokens": r.prompt_tokens,
                "captured_decode_tps": c.record.decode_tps,
                "replayed_decode_tps": r.decode_tps,
                "captured_outcome": c.record.outcome,
                "replayed_outcome": r.outcome,
            }
        )
    return rows


def interrupted_group(
    mode: str, target: str, params: JSONObject, groups: Sequence[Group], finished: Sequence[Record]
) -> Group | None:
    """The requests `finished` that no group holds yet, as one more group (`<mode> interrupted`)."""
    done = {r.id for g in groups for r in g.records}
    rest = [r for r in finished if r.id not in done]
    if not rest:
        return None
    return replay_group(f"{mode} interrupted", "interrupted", target, params, Timed(rest), summarize_records(rest))


def served_from_cache(records: Iterable[RunRecord]) -> tuple[int, int]:
    """(requests whose prompt was mostly cached, requests that reported prompt tokens):
    their TTFT measures the prompt cache, not prefill."""
    reported = [(p, r.record.cached_tokens or 0) for r in records if (p := r.record.prompt_tokens)]
    cached = [p for p, c in reported if c > MOSTLY_CACHED * p]
    return len(cached), len(reported)
