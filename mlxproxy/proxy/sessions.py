"""The conversations view: the proxy's recent records grouped by conversation (`/sessions`,
the live page's conversations panel), and the prefill seconds lost per re-prefill cause
(`/streams`). Pure functions over records; no text leaves (records carry none)."""

from __future__ import annotations

from collections.abc import Iterable

from mlxproxy.core.fixes import worst_cause
from mlxproxy.core.prefix import CAUSES
from mlxproxy.core.record import Record

__all__ = [
    "sessions",
    "side_requests",
    "lost_by_cause",
    "TURN_KEYS",
    "SIDE_KEYS",
    "CACHE_ANOMALIES",
]

#: what each turn of a conversation shows
TURN_KEYS = (
    "id",
    "turn",
    "started_at",
    "outcome",
    "prompt_tokens",
    "prefix_reusable_tokens",
    "cached_tokens",
    "cache_hit_ratio",
    "ttft_s",
    "prefill_tps",
    "reprefill_cause",
    "reprefill_at",
    "reprefill_lost_s",
    "reprefill_fix",
)
#: what each side request shows (they belong to no conversation)
SIDE_KEYS = ("id", "started_at", "client", "side_request", "model", "upstream", "method", "path", "outcome", "ttft_s")
#: the anomalies a turn's row names (the cache doctor's)
CACHE_ANOMALIES = frozenset(
    {"prefix_cache_miss", "prompt_prefix_changed", "cached_tokens_unreported", "cached_tokens_claimed_cold"}
)


def _round(v: object) -> object:
    return round(v, 4) if isinstance(v, float) else v


def lost_by_cause(records: Iterable[Record]) -> dict[str, float]:
    """Seconds of prefill lost to re-prefills in `records`, per cause (every cause listed)."""
    out = dict.fromkeys(CAUSES, 0.0)
    for r in records:
        if r.reprefill_cause is not None and r.reprefill_lost_s:
            out[r.reprefill_cause] += r.reprefill_lost_s
    return {k: round(v, 4) for k, v in out.items()}


def side_requests(records: Iterable[Record], limit: int = 50) -> list[dict[str, object]]:
    """The `limit` most recent side requests among `records` (titles, token counts, probes,
    quota checks: `core.clients`), newest first; they belong to no conversation."""
    side = [r for r in records if r.side_request is not None]
    side.sort(key=lambda r: r.started_at, reverse=True)
    return [{k: _round(getattr(r, k)) for k in SIDE_KEYS} for r in side[:limit]]


def sessions(records: Iterable[Record], limit: int = 50) -> list[dict[str, object]]:
    """The `limit` most recently active conversations among `records`, newest first, each with
    its turns in order (those still among `records`), the prefill seconds it lost in all
    (`lost_s`, from its latest turn's `conversation_lost_s`, so turns no longer held count
    too) and per cause over the turns held (`lost_by_cause`), the client that sent it, and the
    fix for the cause that lost the most (`fix_cause`, `fix`)."""
    groups: dict[str, list[Record]] = {}
    for r in records:
        if r.conversation_id is not None:
            groups.setdefault(r.conversation_id, []).append(r)
    ordered = sorted(groups.items(), key=lambda kv: max(r.started_at for r in kv[1]), reverse=True)
    out: list[dict[str, object]] = []
    for cid, turns in ordered[:limit]:
        turns.sort(key=lambda r: (r.turn or 0, r.started_at))
        last = turns[-1]
        causes = {k: v for k, v in lost_by_cause(turns).items() if v > 0}
        cause, _, fix = worst_cause(turns)
        out.append(
            {
                "conversation_id": cid,
                "client": next((r.client for r in reversed(turns) if r.client), None),
                "upstream": last.upstream,
                "model": last.model,
                "endpoint": last.endpoint,
                "turns": last.turn,
                "turns_held": len(turns),
                "lost_s": round(max((r.conversation_lost_s or 0.0) for r in turns), 4),
                "lost_by_cause": causes,
                "misses": sum(r.reprefill_cause is not None for r in turns),
                "fix_cause": cause,
                "fix": fix,
                "turn_list": [
                    {
                        **{k: _round(getattr(r, k)) for k in TURN_KEYS},
                        "anomalies": [a for a in r.anomalies if a in CACHE_ANOMALIES],
                    }
                    for r in turns
                ],
            }
        )
    return out
