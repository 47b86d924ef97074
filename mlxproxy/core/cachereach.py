"""How far an upstream's cache reaches (issue 36): past the system part into a conversation's
messages, or not past it (vllm-mlx 0.6.0 by default keeps only the system prompt and prefills
every message after it on every request). The proxy learns it from the turns that extend a
conversation, never from the server's name; pure functions and one bounded log, no I/O, no clock.

`CacheFacts` is what an upstream's earlier turns say about its cache (`cachecheck.PrefixIndex.facts`),
`ReachLog` its recent extended turns' reach and the rule that makes the reach known,
`reached_by_ttft` how far one turn's TTFT shows the cache reached, and `system_part_hit` where a
TTFT cannot tell a hit of the system part only from a cold prefill of the whole prompt.
`cachecheck` builds its verdicts on them. Definitions: docs/METRICS.md, "How far a cache reaches".
"""

from __future__ import annotations

from collections import deque
from typing import Literal, NamedTuple

from mlxproxy.core.detect import Thresholds

__all__ = ["Reach", "CacheFacts", "ReachLog", "reached_by_ttft", "system_part_hit"]

#: how far an upstream's cache reached on a turn that extended its conversation: past the system
#: part into the messages ("conversation"), or not past it ("system": the messages prefilled again)
Reach = Literal["conversation", "system"]

REACH_SAMPLES = 8  # extended turns kept per upstream that showed how far its cache reaches...
REACH_MIN_SYSTEM = 2  # ...and how many showing the system part only, none past it, say "system"
# the TTFT tells how far a cache reached where the messages past the system part take at least
# this long to prefill at the cold rate: more than twice the fixed cost of a hit seen on any server
# here (vllm-mlx: hits of the same prompt 0.06-0.41 s), which no fit may have subtracted yet
REACH_MIN_S = 1.0


class CacheFacts(NamedTuple):
    """What an upstream's earlier turns say about its cache (`PrefixIndex.facts`)."""

    cold_rate: float | None = None  # median prefill tok/s of cold first turns
    fixed_s: float = 0.0  # a hit's fixed per-request cost: TTFT beyond prefilling the new tokens
    reports_cache: bool = False  # it has reported a positive cached count: its 0 means a miss
    # how far its cache reaches (`ReachLog.known`): "system" where its recent extended turns
    # reused only the system part, "conversation" where one reused past it; None: not shown yet
    reach: Reach | None = None
    reach_turns: int = 0  # the recent extended turns that showed it

    def system_only_with_this_turn(self) -> bool:
        """Whether this upstream's cache is known to keep the system prompt only once the turn
        being judged, which showed its messages prefilled again, is counted with the earlier ones
        (`ReachLog.known`'s rule: `REACH_MIN_SYSTEM` such turns, none that reached past it)."""
        return self.reach == "system" or (self.reach is None and self.reach_turns + 1 >= REACH_MIN_SYSTEM)


class ReachLog:
    """How far an upstream's cache reached on its last `REACH_SAMPLES` extended turns."""

    def __init__(self) -> None:
        self._into: deque[bool] = deque(maxlen=REACH_SAMPLES)  # True: into the messages

    def add(self, reach: Reach) -> None:
        self._into.append(reach == "conversation")

    def known(self) -> tuple[Reach | None, int]:
        """The reach and the turns that showed it: "system" where at least `REACH_MIN_SYSTEM` of
        the kept turns showed the messages past the system part prefilled again and none showed
        them reused, "conversation" where one did, None before either."""
        into = sum(self._into)
        system = len(self._into) - into
        reach: Reach | None = "conversation" if into else "system" if system >= REACH_MIN_SYSTEM else None
        return reach, into or system


def reached_by_ttft(ttft: float, whole: int, reusable: int, system: int, rate: float, fixed_s: float) -> Reach | None:
    """How far the cache reached on an extended turn of `whole` prompt tokens, `reusable` of them
    the previous prompt's, `system` its system part, by its TTFT past a hit of the whole prefix
    (`fixed + new / rate`) against re-prefilling the messages past the system part (`P`, at least
    `REACH_MIN_S` at the cold `rate`): "system" from half of `P` on, "conversation" up to a quarter
    of it, None between. Fractions, not a midpoint: a session's cold first turn is often slower
    than the server (the client starting on the same cores: OpenCode's 79,269 tokens took 2.26 s
    cold in its session, 1.43 s sent again alone), so `P` over-states the re-prefill up to twice."""
    shown = ttft - (fixed_s + max(whole - reusable, 0) / rate)
    messages = (reusable - system) / rate
    return "system" if shown >= messages / 2 else "conversation" if shown <= messages / 4 else None


def system_part_hit(
    whole: int | None, system: int, rate: float | None, facts: CacheFacts, th: Thresholds
) -> float | None:
    """The TTFT a hit of the `system` part only of a `whole`-token prompt predicts (`fixed +
    (prompt - system) / rate`) where it is too near a cold prefill of the whole prompt (`prompt /
    rate`) for the TTFT to tell the two apart, None where it can (or there is no system part of
    `prefix_min_tokens` to reuse, or the upstream is known to keep the conversation: there a
    re-prefill of the messages is an eviction whatever the system part did). Told apart in
    `cachecheck.timing_says`' own terms: a hit is told from a re-prefill only where it predicts at
    most half of it and `cache_timing_min_s` less (`timing_says` holds a hit to half a cold prefill
    so that its side, up to their midpoint, ends where a re-prefill's begins, at `MISS_SHARE` of
    it). So a system part under about half the prompt cannot be told from none by the TTFT:
    OpenCode's ~17,100 system tokens of a 79,300-token prompt predict 0.78 of a cold prefill when
    reused, and on a loaded machine its turn 2 took 2.86 s, as long as its cold turn 1, while
    vllm-mlx logged its usual hit of the system part."""
    if not whole or not rate or system < th.prefix_min_tokens or facts.reach == "conversation":
        return None
    cold = whole / rate
    part = facts.fixed_s + max(whole - system, 0) / rate
    return part if part > cold / 2 or cold - part < th.cache_timing_min_s else None
