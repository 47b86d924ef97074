"""The fix users apply for each re-prefill cause, in one line (pure data and one lookup).

The one home of the fix table: records carry the line (`reprefill_fix`, set when a cause is
named), and `/sessions`, the live page, the HTML report and `replay --fix` show it from there.
A client whose own setting removes the cause gets that setting (Claude Code's billing line:
`CLAUDE_CODE_ATTRIBUTION_HEADER=0`); otherwise the cause's general fix. Definitions:
docs/METRICS.md, "Re-prefill causes".
"""

from __future__ import annotations

from collections.abc import Iterable

from mlxproxy.core.prefix import Cause
from mlxproxy.core.record import Record

__all__ = ["FIXES", "CLIENT_FIXES", "REPLAYED", "fix_for", "not_replayed", "worst_cause"]

#: per cause, what the user changes so the next turns reuse the cache
FIXES: dict[Cause, str] = {
    "volatile_span": "keep per-request values (ids, dates, counters) out of the system prompt, or pin them per session",
    "system_changed": "keep the system prompt fixed within a conversation (edit it between conversations)",
    "tools_changed": "declare the same tools in one fixed order on every turn (pin their order)",
    "history_rewritten": "turn off the client's history rewriting (compaction, reminders moved), or raise its threshold",
    "model_changed": "keep one model per conversation (no cache is shared between models)",
    "cache_evicted": "give the server's prompt cache more room: mlx_lm.server --prompt-cache-size/--prompt-cache-bytes, "
    "vllm-mlx --cache-memory-mb",
    "cache_system_only": "give the server a cache that keeps the conversation: vllm-mlx --continuous-batching (its "
    "prefix cache; 0.6.0's --prefix-trie-cache never hits); mlx_lm.server keeps it by default",
}

#: the causes `replay --fix` removes by rewriting the request bodies (the system prompt pinned, the
#: tools in one order); the others' fix is a setting of the client or the server, which the same
#: bodies sent again cannot apply
REPLAYED: frozenset[Cause] = frozenset({"volatile_span", "system_changed", "tools_changed"})
_SERVER_SIDE: frozenset[Cause] = frozenset({"cache_evicted", "cache_system_only"})

#: (client name without its version, cause) -> the client's own setting for it
CLIENT_FIXES: dict[tuple[str, Cause], str] = {
    ("Claude Code", "volatile_span"): "set CLAUDE_CODE_ATTRIBUTION_HEADER=0: Claude Code then leaves its per-request "
    "billing line (cch=...) out of the system prompt",
    ("Aider", "history_rewritten"): "none in Aider's settings: it re-sends its file messages and reminder after the "
    "growing history every turn (a few hundred tokens); fewer turns per chat lose less",
}


def fix_for(cause: Cause | None, client: str | None = None) -> str | None:
    """The one-line fix for `cause`, the client's own setting where it has one (`client` as
    `core.clients` names it, e.g. "Claude Code 2.1.332"); None without a cause."""
    if cause is None:
        return None
    if client:
        for (who, c), line in CLIENT_FIXES.items():
            if c == cause and (client == who or client.startswith(who + " ")):
                return line
    return FIXES.get(cause)


def not_replayed(cause: str) -> str | None:
    """Why `replay --fix` cannot show what `cause`'s fix saves (None where its body rewrite does)."""
    if cause in REPLAYED:
        return None
    whose = "the server's" if cause in _SERVER_SIDE else "the client's"
    return f"not replayed: {whose} setting, which the same request bodies sent again cannot apply"


def worst_cause(turns: Iterable[Record]) -> tuple[Cause | None, float, str | None]:
    """Of a conversation's turns: the cause that lost the most prefill seconds, the seconds
    all causes lost, and the fix the turns carry for that cause (`reprefill_fix`);
    (None, 0.0, None) when no turn names a cause."""
    lost: dict[Cause, float] = {}
    fix: dict[Cause, str] = {}
    for r in turns:
        if r.reprefill_cause is not None:
            lost[r.reprefill_cause] = lost.get(r.reprefill_cause, 0.0) + (r.reprefill_lost_s or 0.0)
            if r.reprefill_fix:
                fix.setdefault(r.reprefill_cause, r.reprefill_fix)
    if not lost:
        return None, 0.0, None
    cause = max(lost, key=lambda c: lost[c])
    return cause, sum(lost.values()), fix.get(cause)
