"""The cache doctor: why a conversation's turn was prefilled again, and whether the server's
cache figures are true (pure functions over a finished measurement and its `Match`); and the
conversations an upstream remembers between requests (`PrefixIndex`, the only state here).

`check_turn` judges one turn that continues a conversation (core.prefix), one decision per
function, each with a typed result: the prefix a cache could reuse (`reusable_prefix`, never
less than what the server says it reused), what the TTFT says (`timing_says`: a hit or a cold
prefill, against the conversation's own cold prefill rate, else the upstream's, and the
upstream's fixed per-request cost of a hit), what an extended prompt's cache did (`extended`:
`cached_tokens_unreported`, `cached_tokens_claimed_cold`, `prefix_cache_miss` and the causes
`cache_evicted`, named by the TTFT only where a hit of the system part could not have given it,
and `cache_system_only`: `claimed_cold`, `evicted`, `system_only`) and what a
changed prompt cost (`changed`: `change_shown` says what the evidence shows, `prefix_changed` the anomaly, `hidden_hit` a hit
the usage hides; a change the server neutralized costs 0 s). A cause is named only where the server's cached count or the TTFT
shows a re-prefill, and `TurnVerdict.evidence` says which. How far an upstream's cache reaches
(the system prompt only, or the conversation: `CacheFacts`, learned in `PrefixIndex.facts`) is
`core.cachereach`'s. Definitions: docs/METRICS.md, "Re-prefill causes" and "Cache honesty".
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal, NamedTuple

from mlxproxy.core.cachereach import REACH_MIN_S, CacheFacts, Reach, ReachLog, reached_by_ttft, system_part_hit
from mlxproxy.core.detect import MOSTLY_CACHED, Anomaly, Measured, Thresholds
from mlxproxy.core.detect import fmt_number as _fmt
from mlxproxy.core.prefix import BLOCK_CHARS, Cause, Change, Latest, Match, PieceMemo, PromptPrint
from mlxproxy.core.record import OK_OUTCOMES

__all__ = [
    "PrefixIndex",
    "MAX_CONVERSATIONS",
    "SAME_KEY",
    "CacheFacts",
    "Reusable",
    "Timing",
    "Reprefill",
    "Shown",
    "Turn",
    "TurnVerdict",
    "check_turn",
    "cold_rate",
    "reusable_prefix",
    "timing_says",
    "extended",
    "claimed_cold",
    "evicted",
    "hidden_hit",
    "changed",
    "change_shown",
    "prefix_changed",
]

Says = Literal["hit", "miss"]
MAX_CONVERSATIONS = 256  # per upstream
SAME_KEY = 8  # conversations kept per first user message (parallel agents, one client's fixed examples)
NEUTRAL_SHARE = 0.95  # a cached count this share of the previous prompt reused past a change
PAST_CHANGE_TOKENS = 2 * BLOCK_CHARS // 4  # ...and this far past the change (the estimate's granularity)
MISS_SHARE = 0.75  # a re-prefill's TTFT is at least this share of the predicted one
COLD_CACHED_SHARE = 0.05  # a first turn with at most this share of its prompt cached is cold
FIXED_SAMPLES = 8  # known hits kept per upstream to fit a hit's fixed cost...
FIXED_MIN_SAMPLES = 2  # ...and how many it takes (one TTFT is too noisy to subtract)


class Reusable(NamedTuple):
    """The prefix of the previous turn's prompt a cache could reuse, in tokens."""

    tokens: int  # never below the server's own cached count
    source: str  # "usage" (from the previous prompt_tokens), "chars" (characters / 4), "cached"
    previous: int  # the previous prompt's tokens
    shared: int  # the prompts' shared prefix as estimated (before the cached floor)


class Timing(NamedTuple):
    """What a TTFT says: a hit (`hit_s`: the fixed cost plus prefilling what the cache did
    not hold) or a prefill from scratch (`cold_s`); None between the two."""

    says: Says | None
    ttft_s: float
    cold_s: float
    hit_s: float
    fixed_s: float
    rate: float
    rate_of: str

    def text(self) -> str:
        said = {"hit": "suggests a hit", "miss": "suggests a re-prefill", None: "tells neither"}[self.says]
        fixed = f", {_fmt(self.fixed_s)} s of it fixed" if self.fixed_s > 0 else ""
        return (
            f"TTFT {_fmt(self.ttft_s)} s {said} (cold ≈ {_fmt(self.cold_s)} s for this prompt, a hit ≈ "
            f"{_fmt(self.hit_s)} s{fixed}; {_fmt(self.rate)} tok/s cold, {self.rate_of})"
        )


class Reprefill(NamedTuple):
    """Why this turn could not reuse the previous prompt, and what that cost in tokens."""

    cause: Cause
    at: str | None
    lost_tokens: int  # 0: a change the server neutralized
    prefilled: int | None  # the tokens prefilled this turn (lost seconds: TTFT x lost / prefilled)


class Turn(NamedTuple):
    """What every decision about one continuing turn reads (`check_turn` builds it once)."""

    r: Measured
    m: Match
    reusable: Reusable
    ratio: float | None  # cache_hit_ratio
    whole: int | None  # the prompt's tokens, reported or counted by the proxy
    rate: float | None  # the cold prefill rate the TTFT is judged by...
    rate_of: str  # ...and whose it is
    facts: CacheFacts
    th: Thresholds


@dataclass(frozen=True, slots=True)
class TurnVerdict:
    """The cache doctor's judgement of one continuing turn."""

    reusable: Reusable
    cache_hit_ratio: float | None
    reprefill: Reprefill | None = None
    lost_s: float | None = None
    evidence: str | None = None  # what the verdict rests on (cached_tokens, TTFT), one line
    anomalies: tuple[Anomaly, ...] = ()
    correct_prefill_tps: bool = False  # replace the measured prefill rate with `prefill_tps`
    prefill_tps: float | None = None
    hit_excess_s: float | None = None  # a known hit's TTFT beyond its prefill (the fixed-cost fit)
    reach: Reach | None = None  # an extended turn: how far the cache reached (`PrefixIndex.facts`)

    def fields(self, m: Match) -> dict[str, Any]:
        """The record's conversation fields (`core.record.checked_record`)."""
        out: dict[str, Any] = {
            "prefix_reusable_tokens": self.reusable.tokens,
            "prefix_tokens_source": self.reusable.source,
            "prefix_diverged_at": m.diverged_at,
            "conversation_lost_s": m.lost_s,
            "cache_evidence": self.evidence,
        }
        if self.cache_hit_ratio is not None:
            out["cache_hit_ratio"] = self.cache_hit_ratio
        if self.correct_prefill_tps:
            out["prefill_tps"] = self.prefill_tps
        rp = self.reprefill
        if rp is not None:
            out.update(reprefill_cause=rp.cause, reprefill_at=rp.at, reprefill_lost_s=self.lost_s)
            out["conversation_lost_s"] = m.lost_s + (self.lost_s or 0.0)
            if rp.cause == "cache_evicted":
                out["prefill_wasted_s"] = self.lost_s
        return out


def cold_rate(r: Measured, th: Thresholds, whole: int | None = None) -> float | None:
    """A first turn's prefill rate when it says how fast a cold cache prefills: it reports no
    cached tokens (or at most `COLD_CACHED_SHARE` of its prompt: mlx_lm.server reuses a chat
    template's first tokens across conversations) and has at least `prefix_min_tokens` prompt tokens (a stream that came in
    one burst says nothing: its caller leaves it out). `whole`: the prompt's tokens counted
    by the proxy, for a server that reports none."""
    if r.cached_tokens and r.cached_tokens > COLD_CACHED_SHARE * (r.whole_prompt_tokens or 0):
        return None
    if r.prefill_tps:
        return r.prefill_tps if (r.prompt_tokens or 0) >= th.prefix_min_tokens else None
    if r.prompt_tokens is None and whole and whole >= th.prefix_min_tokens and r.ttft_s:
        return whole / r.ttft_s
    return None


def reusable_prefix(m: Match, cached: int | None) -> Reusable:
    """The shared prefix in tokens (`Match.tokens`), 0 after a model change (no server shares
    a cache between models), the server's own cached count its floor."""
    estimate, source = m.tokens(m.shared_chars)
    if m.change is not None and m.change.cause == "model_changed":
        estimate = 0
    previous = m.tokens(m.previous_chars)[0]
    if cached is not None and cached > estimate:
        return Reusable(cached, "cached", previous, estimate)
    return Reusable(estimate, source, previous, estimate)


def timing_says(
    whole: int | None,
    reused: int,
    ttft: float | None,
    rate: float | None,
    th: Thresholds,
    *,
    fixed_s: float = 0.0,
    reused_on_miss: int = 0,
    rate_of: str = "",
) -> Timing | None:
    """Whether a TTFT looks like a hit that reused `reused` of `whole` prompt tokens (the fixed
    cost plus the rest at `rate` tok/s, a cold rate) or like a prefill of all but
    `reused_on_miss` of them: a hit up to their midpoint, a re-prefill from the midpoint and at
    least `MISS_SHARE` of the re-prefill's time, neither between. None when the two differ by
    less than `cache_timing_min_s` or a figure is missing."""
    if not rate or not whole or reused <= reused_on_miss or ttft is None or ttft <= 0:
        return None
    cold = (whole - reused_on_miss) / rate + (fixed_s if reused_on_miss else 0.0)
    hit = min(fixed_s + max(whole - reused, 0) / rate, cold / 2)
    if cold - hit < th.cache_timing_min_s:
        return None
    mid = (cold + hit) / 2
    says: Says | None = "hit" if ttft <= mid else "miss" if ttft >= MISS_SHARE * cold else None
    return Timing(says, ttft, cold, hit, fixed_s, rate, rate_of)


def check_turn(r: Measured, m: Match, facts: CacheFacts, th: Thresholds, *, whole: int | None = None) -> TurnVerdict:
    """The judgement of a request that continues a conversation (`m`). `facts`: what this
    upstream's earlier turns say about its cache; `whole`: the prompt's tokens when the server
    reported none (counted by the proxy)."""
    reusable = reusable_prefix(m, r.cached_tokens)
    cached = r.cached_tokens
    ratio = round(cached / reusable.tokens, 3) if cached is not None and reusable.tokens > 0 else None
    if r.outcome not in OK_OUTCOMES:
        return TurnVerdict(reusable, ratio)
    if whole is None:
        whole = r.whole_prompt_tokens
    rate, rate_of = (
        (m.cold_prefill_tps, "this conversation's first turn")
        if m.cold_prefill_tps
        else (facts.cold_rate, "this upstream's first turns")
    )
    t = Turn(r, m, reusable, ratio, whole, rate, rate_of, facts, th)
    return extended(t) if m.change is None else changed(t, m.change)


def _reused_from(m: Match, reusable: Reusable) -> str:
    return f"~{reusable.tokens} prompt tokens were reusable from request {m.previous_id} (turn {m.turn - 1})"


def _excess(ttft: float | None, whole: int | None, reused: int, rate: float | None) -> float | None:
    """A known hit's TTFT beyond prefilling its new tokens: the upstream's fixed cost."""
    if ttft is None or not whole or not rate:
        return None
    return max(ttft - max(whole - reused, 0) / rate, 0.0)


def extended(t: Turn) -> TurnVerdict:
    """A prompt that extends the previous one: did the server reuse it, and say so? A cached
    count is the evidence where it shows the hit, or where this server reports its hits (then
    a 0 is a miss, whatever the TTFT); else the TTFT decides: a hit the usage hides
    (`cached_tokens_unreported`), a hit of the system part only (`system_only`), a re-prefill
    (`cache_evicted`, only where a hit of the system part could not have given that TTFT:
    `cachereach.system_part_hit`), or nothing. Each says how far the cache reached (`TurnVerdict.reach`)
    where the messages past the system part are `prefix_min_tokens` or more."""
    r, m, reusable, ratio, whole, rate, rate_of, facts, th = t
    cached, ttft = r.cached_tokens, r.ttft_s
    if reusable.tokens < th.prefix_min_tokens:
        return TurnVerdict(reusable, ratio)
    claimed = claimed_cold(t)
    if claimed is not None:
        return TurnVerdict(
            reusable,
            ratio,
            evidence=claimed.evidence,
            anomalies=(claimed,),
            correct_prefill_tps=True,
            prefill_tps=(whole or 0) / ttft if ttft else None,
        )
    said = timing_says(whole, reusable.tokens, ttft, rate, th, fixed_s=facts.fixed_s, rate_of=rate_of)
    says = said.says if said is not None else None
    system = _system_tokens(m)
    # the messages past the system part: enough to tell how far the cache reached, by count or by TTFT
    past = reusable.tokens - system >= th.prefix_min_tokens
    timed = past and rate is not None and (reusable.tokens - system) / rate >= REACH_MIN_S
    if cached is not None and cached >= th.prefix_miss_ratio * reusable.tokens:  # the count shows the hit
        hit = _excess(ttft, whole, cached, rate) if says != "miss" else None
        into = cached - system >= PAST_CHANGE_TOKENS  # reused into the messages, not just the system part
        return TurnVerdict(
            reusable,
            ratio,
            evidence=f"cached_tokens {cached} of ~{reusable.tokens} reusable",
            hit_excess_s=hit,
            reach=None if not past else "conversation" if into else "system",
        )
    if _counted(r, facts) and cached is not None:
        evidence = f"cached_tokens {cached} of ~{reusable.tokens} reusable (this server reports its hits)"
        only_system = past and cached <= system + PAST_CHANGE_TOKENS
        if only_system and cached >= th.prefix_miss_ratio * system and facts.system_only_with_this_turn():
            evidence += f": the system part (~{system} tokens) reused, the messages after it prefilled again"
            lost = system_only_lost(t, system, reusable.tokens - cached, r.uncached_prompt_tokens, evidence)
            return TurnVerdict(reusable, ratio, *lost, reach="system")
        why = f" but the server reported {cached} cached (ratio {cached / reusable.tokens:.2f})"
        missed = evicted(t, why, evidence, r.uncached_prompt_tokens)
        return _reached(missed, "system" if only_system else None)
    # how far the cache reached, by the TTFT: the messages past the system part re-prefilled or not
    reach = (
        reached_by_ttft(ttft, whole, reusable.tokens, system, rate, facts.fixed_s)
        if timed and rate and whole and ttft is not None
        else None
    )
    if reach == "system":
        return system_only(t, system)
    if said is not None and says == "hit":
        hit = _excess(ttft, whole, reusable.tokens, rate)
        # a server that reports no prompt figures at all (vllm-mlx's Messages stream) hides nothing
        found = () if r.prompt_tokens is None else (_unreported(r, m, reusable, whole, said),)
        return TurnVerdict(
            reusable,
            ratio,
            evidence=said.text(),
            anomalies=found,
            correct_prefill_tps=True,
            hit_excess_s=hit,
            reach=reach,
        )
    part = system_part_hit(whole, system, rate, facts, th)
    if said is not None and says == "miss" and part is None:
        told = "no cached_tokens reported" if cached is None else f"the server reported {cached} cached"
        why = f"; {told}, and {said.text()}: the whole prompt was prefilled again"
        return evicted(t, why, said.text(), whole)
    # nothing shows a re-prefill: a count this server may never report, a TTFT between the two, or
    # one a hit of the system part only would give as well
    unknown = said.text() if said is not None else "no cold prefill rate to judge TTFT by"
    if said is not None and says == "miss" and part is not None:
        unknown += f"; {_too_near(part, said.cold_s, system)}"
    told = "no cached_tokens" if cached is None else f"cached_tokens {cached} (no hit reported by this server yet)"
    return TurnVerdict(reusable, ratio, evidence=f"{told}; {unknown}", correct_prefill_tps=True)


def _system_tokens(m: Match) -> int:
    """The previous prompt's system part (system pieces and tools) in tokens (`Match.tokens`)."""
    return m.tokens(m.system_chars)[0] if m.system_chars else 0


def _reached(v: TurnVerdict, reach: Reach | None) -> TurnVerdict:
    return v if reach is None else replace(v, reach=reach)


def _too_near(part: float, cold: float, system: int) -> str:
    return (
        f"a hit of the system part only (~{system} tokens) would take ≈ {_fmt(part)} s, too near a cold prefill "
        f"(≈ {_fmt(cold)} s) for the TTFT to tell whether it was reused (no eviction named)"
    )


def system_only(t: Turn, system: int) -> TurnVerdict:
    """An extended turn whose TTFT shows the messages past the system part prefilled again
    (`cachereach.reached_by_ttft`): a cache that keeps only the system prompt (vllm-mlx 0.6.0 by default).
    Where the TTFT is closer to a hit of the system part than to a cold prefill of the whole
    prompt, the usage hiding that hit is `cached_tokens_unreported` from `prefix_min_tokens` on.
    The re-prefilled messages are no anomaly (this server never keeps them: nothing failed), but
    where this turn makes the upstream known to keep the system prompt only
    (`CacheFacts.system_only_with_this_turn`) they are the cause `cache_system_only`, with the
    seconds a cache of the conversation would have saved (`system_only_lost`); so is a TTFT
    closer to a cold prefill on such an upstream, this turn counted (the system part is too small
    a share to tell, with a cold rate this noisy, but the messages were prefilled again: a loaded
    machine's turn 3 of the OpenCode session took 2.61 s against 2.54 s cold while vllm-mlx logged
    its usual system hit). Elsewhere such a TTFT, at least `MISS_SHARE` of a cold prefill, is an
    eviction (`cache_evicted`: the whole prompt prefilled again) only where a hit of the system
    part could not have given it (`cachereach.system_part_hit`: it predicts at most half a cold prefill) or
    the upstream is known to keep the conversation; else it is undecided, and says so: the
    messages were prefilled again, the TTFT cannot tell whether the system part was reused, and
    the turn counts toward the upstream's reach as the messages' re-prefill it shows."""
    r, m, reusable, ratio, whole, rate, rate_of, facts, th = t
    cached, ttft = r.cached_tokens, r.ttft_s
    if not whole or not rate or ttft is None:  # (never: `reached_by_ttft` said "system")
        return TurnVerdict(reusable, ratio)
    cold = whole / rate
    part = facts.fixed_s + (whole - system) / rate  # a hit of the system part only
    figures = (
        f"a hit of the whole prefix ≈ {_fmt(facts.fixed_s + max(whole - reusable.tokens, 0) / rate)} s, of the "
        f"system part only ≈ {_fmt(part)} s, cold ≈ {_fmt(cold)} s; {_fmt(rate)} tok/s cold, {rate_of}"
    )
    messages = reusable.tokens - system
    if cold - part < th.cache_timing_min_s or ttft > (cold + part) / 2:  # not closer to the system part's hit
        known = facts.system_only_with_this_turn()  # (this turn showed the messages prefilled again)
        near = system_part_hit(
            whole, system, rate, facts, th
        )  # a hit of the system part too near a cold prefill to tell
        if not known and ttft >= MISS_SHARE * cold and near is None:
            why = f"; {'no cached_tokens reported' if cached is None else f'the server reported {cached} cached'}"
            said = f"TTFT {_fmt(ttft)} s suggests the whole prompt was prefilled again ({figures})"
            return _reached(evicted(t, f"{why}, and {said}", said, whole), "system")
        evidence = (
            f"TTFT {_fmt(ttft)} s suggests the ~{messages} tokens of messages after the system part were prefilled "
            f"again, and tells neither whether the system part (~{system} tokens) was reused ({figures})"
        )
        if known:
            lost = system_only_lost(t, system, messages, whole, evidence)
            return TurnVerdict(reusable, ratio, *lost, correct_prefill_tps=True, reach="system")
        if near is not None and ttft >= MISS_SHARE * cold:
            evidence += f": {_too_near(near, cold, system)}"
        if facts.reach is None:
            evidence += _FIRST_SHOWN
        return TurnVerdict(reusable, ratio, evidence=evidence, correct_prefill_tps=True, reach="system")
    evidence = (
        f"TTFT {_fmt(ttft)} s suggests only the system part was reused (~{system} tokens: system prompt and tools) "
        f"and the ~{messages} tokens of messages after it were prefilled again ({figures}): this server keeps the "
        "system prompt, not the conversation"
    )
    found: tuple[Anomaly, ...] = ()
    hidden = cached is None or cached < th.prefix_miss_ratio * system
    if r.prompt_tokens is not None and system >= th.prefix_min_tokens and hidden:
        told = "no cached_tokens" if cached is None else f"cached_tokens {cached}"
        found = (
            Anomaly(
                "cached_tokens_unreported",
                f"{_reused_from(m, reusable)}; {evidence}, prefilling {whole - system} of {whole} tokens: the cache "
                f"reused ~{system} tokens, but usage says {told}",
            ),
        )
    hit = _excess(ttft, whole, system, rate)
    if facts.system_only_with_this_turn():
        rp, lost_s, evidence = system_only_lost(t, system, messages, whole - system, evidence)
        return TurnVerdict(reusable, ratio, rp, lost_s, evidence, found, True, hit_excess_s=hit, reach="system")
    if facts.reach is None:
        evidence += _FIRST_SHOWN
    return TurnVerdict(
        reusable, ratio, evidence=evidence, anomalies=found, correct_prefill_tps=True, hit_excess_s=hit, reach="system"
    )


# an extended turn's evidence where it is the first on its upstream to show the messages prefilled again
_FIRST_SHOWN = " (the first turn on this upstream to show it: one more, and the loss is named `cache_system_only`)"


def system_only_lost(
    t: Turn, system: int, lost: int, prefilled: int | None, evidence: str
) -> tuple[Reprefill, float | None, str]:
    """`cache_system_only`: the `lost` tokens of messages past the system part that a cache of the
    conversation would have reused, prefilled again on an upstream known to keep the system prompt
    only (with this turn); their seconds as every cause's (`_lost_s`: at the cold rate, at most
    their share of the TTFT past a hit's fixed cost), and the evidence saying what it rests on."""
    facts = t.facts
    rp = Reprefill("cache_system_only", None, lost, prefilled)
    lost_s = _lost_s(t.r.ttft_s, rp, facts.fixed_s, t.rate)
    cost = f"~{_fmt(lost_s)} s lost" if lost_s is not None else "its seconds unknown"
    evidence += (
        f"; {facts.reach_turns + 1} turns on this upstream that extended their conversation, this one included, "
        f"showed its cache keeping the system prompt only, none past it: the ~{lost} tokens of messages a cache of "
        f"the conversation would have reused were prefilled again ({cost})"
    )
    return rp, lost_s, evidence


def claimed_cold(t: Turn) -> Anomaly | None:
    """`cached_tokens_claimed_cold`: usage claims most of the prompt cached, the TTFT shows a
    cold prefill of all of it."""
    r, whole, rate, rate_of, facts, th = t.r, t.whole, t.rate, t.rate_of, t.facts, t.th
    cached, ttft = r.cached_tokens, r.ttft_s
    if not cached or cached < th.prefix_min_tokens or not whole or cached < MOSTLY_CACHED * whole:
        return None
    said = timing_says(whole, cached, ttft, rate, th, fixed_s=facts.fixed_s, rate_of=rate_of)
    if said is None or said.says != "miss":
        return None
    return Anomaly(
        "cached_tokens_claimed_cold",
        f"usage claims {cached} of {whole} prompt tokens cached, but {said.text()}: a cold prefill of all "
        f"of them rather than of the {whole - cached} uncached ones",
    )


def evicted(t: Turn, why: str, evidence: str, prefilled: int | None) -> TurnVerdict:
    """`cache_evicted` (and `prefix_cache_miss`): the reusable prefix was prefilled again."""
    r, m, reusable, ratio, facts = t.r, t.m, t.reusable, t.ratio, t.facts
    a = Anomaly("prefix_cache_miss", f"{_reused_from(m, reusable)}{why}")
    rp = Reprefill("cache_evicted", None, reusable.tokens - (r.cached_tokens or 0), prefilled)
    ttft = r.ttft_s
    return TurnVerdict(reusable, ratio, rp, _lost_s(ttft, rp, facts.fixed_s, t.rate), evidence, (a,))


def _unreported(r: Measured, m: Match, reusable: Reusable, whole: int | None, said: Timing) -> Anomaly:
    """`cached_tokens_unreported`: the TTFT shows a hit of the reusable prefix that the usage's
    count does not."""
    cached = r.cached_tokens
    told = "no cached_tokens" if cached is None else f"cached_tokens {cached}"
    return Anomaly(
        "cached_tokens_unreported",
        f"{_reused_from(m, reusable)} and {said.text()}, prefilling only the {(whole or 0) - reusable.tokens} "
        f"new tokens rather than all {whole}: the cache worked, but usage says {told}",
    )


def hidden_hit(t: Turn) -> Anomaly | None:
    """A changed prompt's reusable prefix (up to the change) served from the cache while the
    usage, which reports the prompt, shows no such count: `cached_tokens_unreported`."""
    r, m, reusable, whole, rate, rate_of, facts, th = t.r, t.m, t.reusable, t.whole, t.rate, t.rate_of, t.facts, t.th
    cached = r.cached_tokens
    if r.prompt_tokens is None or reusable.tokens < th.prefix_min_tokens:
        return None
    if cached is not None and cached >= th.prefix_miss_ratio * reusable.tokens:
        return None
    said = timing_says(whole, reusable.tokens, r.ttft_s, rate, th, fixed_s=facts.fixed_s, rate_of=rate_of)
    return _unreported(r, m, reusable, whole, said) if said is not None and said.says == "hit" else None


def _counted(r: Measured, facts: CacheFacts) -> bool:
    """Whether the server's cached count is evidence: a positive one, or a 0 from a server that
    has reported a hit before (some report 0 on every hit)."""
    return r.cached_tokens is not None and (r.cached_tokens > 0 or facts.reports_cache)


class Shown(NamedTuple):
    """What the evidence shows a changed prompt cost (`change_shown`)."""

    says: Literal["reprefilled", "neutralized", "too_small", "nothing"]
    evidence: str
    prefilled: int | None = None  # the tokens prefilled this turn, where re-prefilled
    hit_excess_s: float | None = None  # a known (partial) hit's TTFT past its prefill


def change_shown(t: Turn, change: Change) -> Shown:
    """Whether the server re-prefilled a changed prompt past the change: by its cached count
    (from a server that reports its hits, a 0 too), else by the TTFT against a hit of the whole
    previous prompt and a prefill from the change on."""
    r, reusable, whole, rate, rate_of, facts, th = t.r, t.reusable, t.whole, t.rate, t.rate_of, t.facts, t.th
    cached, ttft = r.cached_tokens, r.ttft_s
    lost = reusable.previous - reusable.tokens
    if cached is not None and _counted(r, facts):
        past = cached - reusable.shared >= PAST_CHANGE_TOKENS  # reused clearly past where the prompts differ
        if past and cached >= NEUTRAL_SHARE * reusable.previous:
            return Shown("neutralized", f"cached_tokens {cached} of the previous prompt's {reusable.previous}")
        hit = _excess(ttft, whole, cached, rate) if whole and cached >= MOSTLY_CACHED * whole else None
        return Shown(
            "reprefilled",
            f"cached_tokens {cached}: ~{lost} of the previous prompt's {reusable.previous} tokens prefilled again",
            r.uncached_prompt_tokens,
            hit,
        )
    said = timing_says(
        whole, reusable.previous, ttft, rate, th, fixed_s=facts.fixed_s, reused_on_miss=reusable.tokens, rate_of=rate_of
    )
    where = f"{change.cause} at {change.where}"
    if said is None and rate and whole and ttft:
        return Shown(
            "too_small",
            f"the prompt changed ({where}): at most ~{lost} tokens to prefill again, ~{_fmt(lost / rate)} s at "
            f"{_fmt(rate)} tok/s cold ({rate_of}), too little for TTFT to tell (0 s counted)",
        )
    if said is None or said.says is None:
        unknown = said.text() if said is not None else "no cold prefill rate to judge TTFT by"
        told = "no cached_tokens" if cached is None else f"cached_tokens {cached}"
        return Shown("nothing", f"the prompt changed ({where}), but nothing shows a re-prefill: {told}; {unknown}")
    if said.says == "hit":
        return Shown("neutralized", said.text())
    return Shown("reprefilled", said.text(), (whole or 0) - reusable.tokens)


def changed(t: Turn, change: Change) -> TurnVerdict:
    """A prompt that changed part of the previous one: a cause with its cost where the server
    re-prefilled past the change, the cause at 0 s where it reused the previous prompt anyway
    (neutralized: a server that strips a volatile line before caching) or the cost is too small
    to show, no cause where nothing tells; and a hidden hit of the prefix up to the change."""
    r, m, reusable, ratio, facts, th = t.r, t.m, t.reusable, t.ratio, t.facts, t.th
    lost = reusable.previous - reusable.tokens
    if lost <= 0 and not _counted(r, facts):  # nothing of the previous prompt was lost
        return TurnVerdict(reusable, ratio)
    hidden = hidden_hit(t)
    also: tuple[Anomaly, ...] = () if hidden is None else (hidden,)
    shown = change_shown(t, change)
    unknown_share = r.cached_tokens is None or hidden is not None  # the prefilled share is unknown
    # a change past the system part that only the TTFT could price: what this server's cache keeps
    # decides, also against a TTFT that looks like a hit past the change (on a server known to keep the
    # system prompt only, that is a cold rate measured slow: Aider's ~1,400-token turn 1 on a loaded
    # machine, 5,600 tok/s, made its rewrite's 0.06 s read as a hit of the whole previous prompt)
    by_reach = not _counted(r, facts) and change.cause != "model_changed" and m.shared_chars >= m.system_chars
    if by_reach and facts.reach == "system":
        evidence = (
            f"this server reused only the system prompt on {facts.reach_turns} earlier turns that extended their "
            f"conversation, none past it (TTFT): it prefills the messages after it on every turn, so the change at "
            f"{change.where} cost nothing here (0 s lost)"
        )
        zero = Reprefill(change.cause, change.where, 0, None)
        return TurnVerdict(reusable, ratio, zero, 0.0, evidence, also, correct_prefill_tps=unknown_share)
    if shown.says == "nothing":
        return TurnVerdict(reusable, ratio, evidence=shown.evidence, anomalies=also, correct_prefill_tps=unknown_share)
    if shown.says != "reprefilled":  # (too small, neutralized: 0 s)
        evidence = shown.evidence
        if shown.says == "neutralized":
            evidence += ": this server reused the prompt past the change (neutralized, 0 s lost)"
        zero = Reprefill(change.cause, change.where, 0, None)
        return TurnVerdict(reusable, ratio, zero, 0.0, evidence, also, correct_prefill_tps=unknown_share)
    if lost <= 0:  # the count shows the previous prompt reused
        return TurnVerdict(reusable, ratio, evidence=shown.evidence)
    rp = Reprefill(change.cause, change.where, lost, shown.prefilled)
    found = prefix_changed(m, change, reusable, lost, shown.evidence, th)
    lost_s = _lost_s(r.ttft_s, rp, facts.fixed_s, t.rate)
    evidence = shown.evidence
    if by_reach and facts.reach is None:  # no turn has shown whether this server keeps the conversation
        bound = f"~{_fmt(lost_s)} s" if lost_s is not None else "its share of this TTFT"
        evidence += (
            f"; the seconds are uncertain: {bound} where this server keeps the conversation in its cache, 0 s where "
            "it keeps only the system prompt, and no turn on this upstream has shown which yet (one that extends a "
            "long conversation will)"
        )
        lost_s = None
    return TurnVerdict(
        reusable,
        ratio,
        rp,
        lost_s,
        evidence,
        (*found, *also),
        correct_prefill_tps=hidden is not None,
        hit_excess_s=shown.hit_excess_s,
    )


def prefix_changed(
    m: Match, change: Change, reusable: Reusable, lost: int, evidence: str, th: Thresholds
) -> tuple[Anomaly, ...]:
    """`prompt_prefix_changed` for a re-prefill of at least `prefix_min_tokens` that the
    prompts caused (not an extension: a rewrite, or another model)."""
    if lost < th.prefix_min_tokens or (m.extends and change.cause != "model_changed"):
        return ()
    if change.cause == "model_changed":
        text = (
            f"continues conversation {m.conversation_id} (turn {m.turn}) with another model "
            f"({change.where}): none of its {reusable.previous} earlier prompt tokens can be reused"
        )
    else:
        text = (
            f"continues conversation {m.conversation_id} (turn {m.turn}) but differs from its "
            f"previous request {m.previous_id} at {m.diverged_at} ({change.cause}: {change.where}): "
            f"~{lost} of its {reusable.previous} prompt tokens were prefilled again (counted from "
            f"{reusable.source}; {evidence})"
        )
    return (Anomaly("prompt_prefix_changed", text),)


def _lost_s(ttft: float | None, rp: Reprefill, fixed_s: float = 0.0, rate: float | None = None) -> float | None:
    """The prefill seconds a re-prefill cost: the lost tokens at the upstream's cold prefill
    `rate` (tok/s), or the TTFT past the upstream's fixed cost x lost tokens / prefilled tokens,
    whichever is smaller, at most that TTFT. Both over-state: the cold rate was measured with a
    first turn's fixed cost in its TTFT (so it is slower than the prefill alone), and a turn's TTFT
    share charges the lost tokens with their part of a fixed cost no hit was seen to fit; the
    smaller is the tighter bound."""
    if ttft is None or ttft <= 0 or not rp.prefilled or rp.lost_tokens <= 0:
        return None
    prefill = max(ttft - fixed_s, 0.0)
    share = min(prefill * rp.lost_tokens / rp.prefilled, prefill)
    return min(share, rp.lost_tokens / rate) if rate else share


class PrefixIndex:
    """The latest prompt of each recent conversation on one upstream (bounded, no text), and
    what its turns showed about its cache (`facts`): `prefix.find_turn` reads `latest` before a
    turn is judged, `add` writes the turn after, with what the judgement found."""

    def __init__(self, max_conversations: int = MAX_CONVERSATIONS) -> None:
        self.max_conversations = max_conversations
        # per key (family and first user message), the latest prompts of up to SAME_KEY
        # conversations, the most recent first; `latest` is the same dict, read-only to others
        self._by_key: OrderedDict[int, list[Latest]] = OrderedDict()
        self.latest: Mapping[int, Sequence[Latest]] = self._by_key
        self._count = 0
        self.cold_prefill_tps: deque[float] = deque(maxlen=32)  # prefill rates of first turns (no cache)
        self.hit_excess_s: deque[float] = deque(maxlen=FIXED_SAMPLES)  # known hits' TTFT past their prefill
        self.reports_cache = False
        # how far the cache reached on recent extended turns (True: into the messages)
        self.reach = ReachLog()
        # what `prefix.fingerprint` made of recent prompts' parts, reused where the next turn
        # repeats them (bounded; the same fingerprints as without it)
        self.memo: PieceMemo | None = PieceMemo()

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
        cached_tokens: int | None = None,
        hit_excess_s: float | None = None,
        prompt_source: str = "usage",
        reach: Reach | None = None,
    ) -> tuple[str, int]:
        """Remember `new` as its conversation's latest prompt; returns (conversation_id, turn).
        `cold_prefill_tps`: this request's prefill rate when its cache was cold (kept as the
        conversation's own until a later cold turn replaces it, and, on a first turn, among
        this upstream's: `prefill_rate`); `lost_s`: the prefill seconds it lost (summed per
        conversation); `cached_tokens`: its reported count (a positive one says this server
        reports its hits); `hit_excess_s`: a known hit's TTFT beyond its prefill (`facts`);
        `prompt_source`: where `prompt_tokens` came from (`usage`, or the proxy's count); `reach`:
        how far the cache reached on an extended turn (`TurnVerdict.reach`, `facts`)."""
        if match is None and cold_prefill_tps is not None:
            self.cold_prefill_tps.append(cold_prefill_tps)
        if cached_tokens:
            self.reports_cache = True
        if hit_excess_s is not None:
            self.hit_excess_s.append(hit_excess_s)
        if reach is not None:
            self.reach.add(reach)
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
        entries.insert(0, Latest(cid, turn, request_id, new, prompt_tokens, end_s, rate, lost, prompt_source))
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

    def facts(self) -> CacheFacts:
        """What this upstream's turns so far say about its cache: its cold prefill rate, a hit's
        fixed cost (the smallest TTFT past its prefill among its last `FIXED_SAMPLES` known hits,
        once there are `FIXED_MIN_SAMPLES`), whether it reports its hits, and how far its cache
        reaches (`cachereach.ReachLog.known`)."""
        fixed = min(self.hit_excess_s) if len(self.hit_excess_s) >= FIXED_MIN_SAMPLES else 0.0
        return CacheFacts(self.prefill_rate(), fixed, self.reports_cache, *self.reach.known())
