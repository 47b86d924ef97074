"""The cache doctor: why a conversation's turn was prefilled again, and whether the server's
cache figures are true (pure functions over a finished record and its `Match`); and the
conversations an upstream remembers between requests (`PrefixIndex`, the only state here).

`check_turn` judges one turn that continues a conversation (core.prefix): the prefix a cache
could reuse (never less than what the server says it reused), the re-prefill's cause
(`prefix.CAUSES`) and the prefill seconds it lost, the cache-honesty anomalies
(`cached_tokens_unreported`, `cached_tokens_claimed_cold`), the prefix anomalies
(`prompt_prefix_changed`, `prefix_cache_miss`) and a `prefill_tps` that counts only the tokens
the evidence says were prefilled. Timing is judged against the conversation's own prefill
rate on a cold cache (its first turn), else the upstream's (`timing_says`). Definitions:
docs/METRICS.md, "Re-prefill causes" and "Cache honesty".
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from mlxproxy.core.detect import MOSTLY_CACHED, Anomaly, Measured, Thresholds
from mlxproxy.core.detect import fmt_number as _fmt
from mlxproxy.core.prefix import Latest, Match, PromptPrint
from mlxproxy.core.record import OK_OUTCOMES

__all__ = ["PrefixIndex", "MAX_CONVERSATIONS", "SAME_KEY", "check_turn", "cold_rate", "timing_says"]

Timing = Literal["hit", "miss"]

MAX_CONVERSATIONS = 256  # per upstream
SAME_KEY = 4  # conversations kept per first user message (parallel agents with one task)


def cold_rate(r: Measured, th: Thresholds) -> float | None:
    """A first turn's prefill rate when it says how fast a cold cache prefills: it reports no
    cached tokens and has at least `prefix_min_tokens` prompt tokens (a stream that came in
    one burst says nothing: its caller leaves it out)."""
    if r.cached_tokens or not r.prefill_tps:
        return None
    return r.prefill_tps if (r.prompt_tokens or 0) >= th.prefix_min_tokens else None


def timing_says(
    whole: int | None, reusable: int, ttft: float | None, rate: float | None, th: Thresholds
) -> tuple[Timing, float, float] | None:
    """Whether a TTFT looks like a cache hit on `reusable` of `whole` prompt tokens or a cold
    prefill of them all, at `rate` tok/s (a cold prefill rate): ("hit" or "miss", seconds to
    prefill all, seconds to prefill only the rest); the midpoint divides them. None when
    the two differ by less than `cache_timing_min_s` or a figure is missing."""
    if not rate or not whole or reusable <= 0 or ttft is None or ttft <= 0:
        return None
    full, hit = whole / rate, max(whole - reusable, 0) / rate
    if full - hit < th.cache_timing_min_s:
        return None
    return ("hit" if ttft <= (full + hit) / 2 else "miss"), full, hit


def check_turn(
    r: Measured, m: Match, upstream_rate: float | None, th: Thresholds
) -> tuple[dict[str, Any], list[Anomaly]]:
    """Record fields and anomalies of a request that continues a conversation (`m`).
    `upstream_rate`: this upstream's prefill rate on cold first turns (used when the
    conversation has none of its own)."""
    change = m.change
    estimate, source = m.tokens(m.shared_chars)
    if change is not None and change.cause == "model_changed":
        estimate = 0  # no server shares a prompt cache between models
    prev_tokens = m.tokens(m.previous_chars)[0]
    cached, ttft = r.cached_tokens, r.ttft_s
    reusable = estimate
    if cached is not None and cached > reusable:  # the server's own count is a floor
        reusable, source = cached, "cached"
    fields: dict[str, Any] = {
        "prefix_reusable_tokens": reusable,
        "prefix_tokens_source": source,
        "prefix_diverged_at": m.diverged_at,
        "conversation_lost_s": m.lost_s,
    }
    if cached is not None and reusable > 0:
        fields["cache_hit_ratio"] = round(cached / reusable, 3)
    out: list[Anomaly] = []
    if r.outcome not in OK_OUTCOMES:
        return fields, out
    whole = r.whole_prompt_tokens
    rate = m.cold_prefill_tps or upstream_rate
    rate_of = "this conversation's first turn" if m.cold_prefill_tps else "this upstream's first turns"
    said = timing_says(whole, reusable, ttft, rate, th) if reusable >= th.prefix_min_tokens else None
    claimed = timing_says(whole, cached or 0, ttft, rate, th) if cached and cached >= th.prefix_min_tokens else None
    prefilled = r.uncached_prompt_tokens

    lost_tokens, cause, at = 0, None, None
    reused_from = f"~{reusable} prompt tokens were reusable from request {m.previous_id} (turn {m.turn - 1})"
    unreported = (cached is None or cached < th.prefix_miss_ratio * reusable) and said is not None and said[0] == "hit"
    if unreported and said is not None:
        told = "no cached_tokens" if cached is None else f"cached_tokens {cached}"
        out.append(
            Anomaly(
                "cached_tokens_unreported",
                f"{reused_from} and TTFT {_fmt(ttft or 0)} s matches prefilling only the "
                f"{(whole or 0) - reusable} new tokens ({_fmt(said[2])} s at {_fmt(rate or 0)} tok/s, {rate_of}) "
                f"rather than all {whole} ({_fmt(said[1])} s): the cache worked, but usage says {told}",
            )
        )
        fields["prefill_tps"] = None  # the prefilled share is unknown
    elif (
        claimed is not None
        and claimed[0] == "miss"
        and whole
        and cached is not None
        and cached >= MOSTLY_CACHED * whole
    ):
        out.append(
            Anomaly(
                "cached_tokens_claimed_cold",
                f"usage claims {cached} of {whole} prompt tokens cached, but TTFT {_fmt(ttft or 0)} s matches a "
                f"cold prefill of all of them ({_fmt(claimed[1])} s at {_fmt(rate or 0)} tok/s, {rate_of}) "
                f"rather than of the {whole - cached} uncached ones ({_fmt(claimed[2])} s)",
            )
        )
        prefilled = whole
        fields["prefill_tps"] = whole / ttft if ttft else None
    elif cached is None and reusable >= th.prefix_min_tokens and (said is None or said[0] != "miss"):
        fields["prefill_tps"] = None  # unknown share, and TTFT does not show a cold prefill
    elif change is None:
        miss = _evicted(m, reusable, cached, said, th)
        if miss is not None:
            out.append(Anomaly("prefix_cache_miss", f"{reused_from}{miss}"))
            cause, lost_tokens = "cache_evicted", reusable - (cached or 0)
            prefilled = whole if said is not None else prefilled
    if change is not None and prev_tokens > reusable:
        cause, at, lost_tokens = change.cause, change.where, prev_tokens - reusable
        if not m.extends and lost_tokens >= th.prefix_min_tokens:
            out.append(
                Anomaly(
                    "prompt_prefix_changed",
                    f"continues conversation {m.conversation_id} (turn {m.turn}) but differs from its "
                    f"previous request {m.previous_id} at {m.diverged_at} ({change.cause}: {change.where}): "
                    f"~{lost_tokens} of its {prev_tokens} prompt tokens cannot be reused by any cache "
                    f"(counted from {source})",
                )
            )
        elif change.cause == "model_changed" and lost_tokens >= th.prefix_min_tokens:
            out.append(
                Anomaly(
                    "prompt_prefix_changed",
                    f"continues conversation {m.conversation_id} (turn {m.turn}) with another model "
                    f"({change.where}): none of its {prev_tokens} earlier prompt tokens can be reused",
                )
            )
        if cached is None and said is None:
            prefilled = (whole or 0) - reusable
    if cause is None:
        return fields, out
    lost_s = None
    if ttft is not None and ttft > 0 and prefilled and lost_tokens > 0:
        lost_s = min(ttft * lost_tokens / prefilled, ttft)
    fields.update(reprefill_cause=cause, reprefill_at=at, reprefill_lost_s=lost_s)
    fields["conversation_lost_s"] = m.lost_s + (lost_s or 0.0)
    if cause == "cache_evicted":
        fields["prefill_wasted_s"] = lost_s
    return fields, out


def _evicted(
    m: Match, reusable: int, cached: int | None, said: tuple[Timing, float, float] | None, th: Thresholds
) -> str | None:
    """The evidence that the server prefilled an extended prompt whole (`prefix_cache_miss`,
    cause `cache_evicted`): its reported `cached_tokens` fall short of `prefix_miss_ratio` of
    the reusable prefix, or (none reported) its TTFT matches a cold prefill; None otherwise."""
    if reusable < th.prefix_min_tokens:
        return None
    if cached is not None:
        if cached >= th.prefix_miss_ratio * reusable:
            return None
        return f" but the server reported {cached} cached (ratio {cached / reusable:.2f})"
    if said is None or said[0] != "miss":
        return None
    return (
        f"; no cached_tokens reported, but TTFT matches re-prefilling the whole prompt "
        f"({_fmt(said[1])} s) rather than the new tokens alone ({_fmt(said[2])} s)"
    )


class PrefixIndex:
    """The latest prompt of each recent conversation on one upstream (bounded, no text):
    `prefix.find_turn` reads it (`latest`) before a turn is judged, `add` writes the turn
    after, with what the judgement found."""

    def __init__(self, max_conversations: int = MAX_CONVERSATIONS) -> None:
        self.max_conversations = max_conversations
        # per key (family and first user message), the latest prompts of up to SAME_KEY
        # conversations, the most recent first; `latest` is the same dict, read-only to others
        self._by_key: OrderedDict[int, list[Latest]] = OrderedDict()
        self.latest: Mapping[int, Sequence[Latest]] = self._by_key
        self._count = 0
        self.cold_prefill_tps: deque[float] = deque(maxlen=32)  # prefill rates of first turns (no cache)

    def __len__(self) -> int:
        return self._count

    def add(
        self,
        new: PromptPrint,
        match: Match | None,
        request_id: str,
        prompt_tokens: int | None,
        end_s: float,
        *,
        cold_prefill_tps: float | None = None,
        lost_s: float = 0.0,
    ) -> tuple[str, int]:
        """Remember `new` as its conversation's latest prompt; returns (conversation_id, turn).
        `cold_prefill_tps`: this request's prefill rate when its cache was cold (kept as the
        conversation's own until a later cold turn replaces it, and, on a first turn, among
        this upstream's: `prefill_rate`); `lost_s`: the prefill seconds it lost (summed per
        conversation)."""
        if match is None and cold_prefill_tps is not None:
            self.cold_prefill_tps.append(cold_prefill_tps)
        entries = self._by_key.setdefault(new.key, [])
        self._by_key.move_to_end(new.key)
        if match is not None:
            old = next((e for e in entries if e.conversation_id == match.conversation_id), None)
            if old is not None:
                entries.remove(old)
                self._count -= 1
            cid, turn = match.conversation_id, match.turn
            rate = cold_prefill_tps or match.cold_prefill_tps
            lost = match.lost_s + lost_s
        else:
            cid, turn, rate, lost = request_id, 1, cold_prefill_tps, lost_s
        entries.insert(0, Latest(cid, turn, request_id, new, prompt_tokens, end_s, rate, lost))
        self._count += 1
        if len(entries) > SAME_KEY:
            entries.pop()
            self._count -= 1
        while self._count > self.max_conversations:
            _, dropped = self._by_key.popitem(last=False)
            self._count -= len(dropped)
        return cid, turn

    def prefill_rate(self) -> float | None:
        """The median prefill tok/s of recent first turns (a cold cache), when there are any."""
        if not self.cold_prefill_tps:
            return None
        v = sorted(self.cold_prefill_tps)
        return v[len(v) // 2]
