"""Prompt-prefix tracking without keeping prompt text (sans-I/O).

A request's prompt is cut into stable pieces in the order a chat template renders them
(`tools`, a Messages `system` or Responses `instructions`, then every message field:
`messages[i].role`, `.content`, `.reasoning_content`, `.tool_calls`, ...). Each piece keeps
only a 64-bit fingerprint, its length, and one fingerprint per `BLOCK_CHARS` block of its
serialized text, so two prompts can be compared piece by piece and, in the first piece that
differs, block by block: how much of an earlier prompt a new one shares, and where they first
diverge. Fingerprints are Python's `hash()` of strings: stable within one process, which is
all an in-memory index needs.

`PrefixIndex` keeps, per upstream, the latest prompt of at most `MAX_CONVERSATIONS`
conversations. A conversation is keyed by its first user message and the set of declared
tool names: a request with the same key continues it. Limits (documented in the README):
at most `MAX_BLOCKS` blocks (`MAX_BLOCKS * BLOCK_CHARS` characters) are fingerprinted per
prompt; past that, pieces compare whole.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import orjson

__all__ = ["PromptPrint", "fingerprint", "PrefixIndex", "Match", "BLOCK_CHARS", "MAX_BLOCKS", "MAX_CONVERSATIONS"]

BLOCK_CHARS = 256
MAX_BLOCKS = 4096  # 1 MiB of prompt text per request (~250k tokens); 32 KiB of fingerprints at most
MAX_CONVERSATIONS = 256  # per upstream
MAX_PIECES = 20_000


class PromptPrint(NamedTuple):
    """The fingerprints of one prompt (no text). (Tuples, as `Match`: one of each per request,
    and a frozen dataclass's per-field `__init__` cost more than the fingerprinting itself.)"""

    key: int  # the conversation key: first user message and declared tool names
    labels: tuple[str, ...]
    hashes: array[int]  # one per piece
    chars: array[int]  # characters per piece
    # per piece: fingerprints of its BLOCK_CHARS blocks (a tuple for a piece of one block or
    # none, an array for a longer one; None past MAX_BLOCKS)
    blocks: tuple[Sequence[int] | None, ...]
    tools_set: int  # fingerprint of the tools in name order (to tell "tools order" from a change)

    @property
    def total_chars(self) -> int:
        return sum(self.chars)


def _text(v: Any) -> str:
    return v if isinstance(v, str) else orjson.dumps(v, option=orjson.OPT_SORT_KEYS).decode()


def _field_order(k: str) -> tuple[bool, bool, str]:
    return (k != "role", k != "content", k)


def _message_fields(m: dict[str, Any]) -> Any:
    """The fields of a message in rendering order: role, content, then the rest by name."""
    if len(m) == 2 and "role" in m and "content" in m:  # by far the most common message
        return ("role", "content")
    return sorted(m, key=_field_order)


def fingerprint(endpoint: str, obj: Any) -> PromptPrint | None:
    """The prompt fingerprints of a chat, Messages or Responses request body, or None."""
    if not isinstance(obj, dict):
        return None
    pieces: list[tuple[str, str]] = []
    tools = obj.get("tools")
    tools = tools if isinstance(tools, list) and tools else None
    tools_set = 0
    if tools is not None:
        pieces.append(("tools", _text(tools)))
        tools_set = hash("\x00".join(sorted((_text(t) for t in tools), key=str)))
    if endpoint == "messages" and obj.get("system") is not None:
        pieces.append(("system", _text(obj["system"])))
    if endpoint == "responses" and obj.get("instructions") is not None:
        pieces.append(("instructions", _text(obj["instructions"])))
    if endpoint == "responses":
        inp = obj.get("input")
        items = [{"role": "user", "content": inp}] if isinstance(inp, str) else inp
        name = "input"
    else:
        items = obj.get("messages")
        name = "messages"
    if not isinstance(items, list) or not items:
        return None
    first_user = _message_pieces(items, name, pieces)
    if first_user is None:
        return None
    key = hash((first_user, _tool_names(tools) if tools is not None else ()))
    hashes, lengths, blocks = _piece_blocks(pieces)
    return PromptPrint(key, tuple(label for label, _ in pieces), hashes, lengths, blocks, tools_set)


def _message_pieces(items: list[Any], name: str, pieces: list[tuple[str, str]]) -> str | None:
    """Append each message's fields to `pieces` (up to `MAX_PIECES`); the first user message's text."""
    first_user: str | None = None
    add = pieces.append
    for i, m in enumerate(items):
        if len(pieces) >= MAX_PIECES:
            break
        if not isinstance(m, dict):
            add((f"{name}[{i}]", _text(m)))
            continue
        for field in _message_fields(m):
            v = m[field]
            add((f"{name}[{i}].{field}", v if type(v) is str else _text(v)))
        if first_user is None and m.get("role") == "user":
            first_user = _text(m.get("content"))
    return first_user


def _tool_names(tools: list[Any]) -> tuple[str, ...]:
    return tuple(
        str(n)
        for n in sorted(
            t.get("function", t).get("name", "")
            if isinstance(t, dict) and isinstance(t.get("function", t), dict)
            else ""
            for t in tools
        )
    )


def _piece_blocks(
    pieces: list[tuple[str, str]],
) -> tuple[array[int], array[int], tuple[Sequence[int] | None, ...]]:
    """Each piece's hash and length, and its blocks' hashes (`BLOCK_CHARS` each) while the
    `MAX_BLOCKS` budget lasts (None for a piece past it)."""
    budget = MAX_BLOCKS
    blocks: list[Sequence[int] | None] = []
    hashes: list[int] = []
    lengths: list[int] = []
    for _, text in pieces:
        size = len(text)
        h = hash(text)
        hashes.append(h)
        lengths.append(size)
        if size <= BLOCK_CHARS and budget >= 1:  # one block: the piece's own fingerprint
            blocks.append((h,) if size else ())
            budget -= 1 if size else 0
            continue
        n = (size + BLOCK_CHARS - 1) // BLOCK_CHARS
        if n <= budget:
            blocks.append(array("q", [hash(text[k : k + BLOCK_CHARS]) for k in range(0, size, BLOCK_CHARS)]))
            budget -= n
        else:
            blocks.append(None)
    return array("q", hashes), array("q", lengths), tuple(blocks)


class Match(NamedTuple):
    """How a new prompt relates to the latest prompt of its conversation."""

    conversation_id: str  # the id of the conversation's first request
    turn: int  # of the new request
    previous_id: str
    previous_prompt_tokens: int | None
    previous_chars: int
    shared_chars: int
    extends: bool  # the whole previous prompt is a prefix of the new one
    diverged_at: str | None  # where they first differ (None when the new one extends the previous)
    previous_end_s: float  # monotonic end of the previous request (time between turns)

    def tokens(self, chars: int) -> tuple[int, str]:
        """`chars` of the previous prompt in tokens, and how that was counted: from its
        reported `prompt_tokens` (`usage`, scaled by characters when only part is shared),
        else characters / 4 (`chars`)."""
        if self.previous_prompt_tokens is not None and self.previous_chars > 0:
            if chars >= self.previous_chars:
                return self.previous_prompt_tokens, "usage"
            return round(self.previous_prompt_tokens * chars / self.previous_chars), "usage"
        return chars // 4, "chars"


def _where(old: PromptPrint, new: PromptPrint, i: int, within: int | None) -> str:
    """A short human place for the first difference, at piece `i` of both prompts."""
    if i >= len(new.labels):
        return f"{old.labels[i]} removed (the new prompt ends before it)"
    if i >= len(old.labels):
        return f"{new.labels[i]} added"
    a, b = old.labels[i], new.labels[i]
    if a != b:
        if i + 1 < len(old.labels) and old.labels[i + 1] == b:
            return f"{a} removed"
        if i + 1 < len(new.labels) and new.labels[i + 1] == a:
            return f"{b} added"
        return f"{a} replaced by {b}"
    if a == "tools" and old.tools_set == new.tools_set:
        return "tools order"
    return a if within is None else f"{a} char {within}"


def compare(old: PromptPrint, new: PromptPrint) -> tuple[int, bool, str | None]:
    """(shared characters, new extends old, where they diverge)."""
    shared = 0
    n = min(len(old.labels), len(new.labels))
    for i in range(n):
        if old.labels[i] == new.labels[i] and old.hashes[i] == new.hashes[i] and old.chars[i] == new.chars[i]:
            shared += old.chars[i]
            continue
        within = None
        ob, nb = old.blocks[i], new.blocks[i]
        if old.labels[i] == new.labels[i] and ob is not None and nb is not None:
            k = 0
            while k < len(ob) and k < len(nb) and ob[k] == nb[k]:
                k += 1
            # a last, partial block that is equal is a prefix only when it is whole in the new prompt
            within = min(k * BLOCK_CHARS, old.chars[i], new.chars[i])
            shared += within
        return shared, False, _where(old, new, i, within)
    if len(old.labels) <= len(new.labels):
        return shared, True, None
    return shared, False, _where(old, new, n, None)


@dataclass(slots=True)
class _Entry:
    conversation_id: str
    turn: int
    request_id: str
    prompt: PromptPrint
    prompt_tokens: int | None
    end_s: float


class PrefixIndex:
    """The latest prompt of each recent conversation on one upstream (bounded, no text)."""

    def __init__(self, max_conversations: int = MAX_CONVERSATIONS) -> None:
        self.max_conversations = max_conversations
        self._by_key: OrderedDict[int, _Entry] = OrderedDict()
        self.cold_prefill_tps: deque[float] = deque(maxlen=32)  # prefill rates of first turns (no cache)

    def __len__(self) -> int:
        return len(self._by_key)

    def match(self, new: PromptPrint) -> Match | None:
        e = self._by_key.get(new.key)
        if e is None:
            return None
        shared, extends, where = compare(e.prompt, new)
        return Match(
            e.conversation_id,
            e.turn + 1,
            e.request_id,
            e.prompt_tokens,
            e.prompt.total_chars,
            shared,
            extends,
            where,
            e.end_s,
        )

    def add(
        self, new: PromptPrint, match: Match | None, request_id: str, prompt_tokens: int | None, end_s: float
    ) -> tuple[str, int]:
        """Remember `new` as its conversation's latest prompt; returns (conversation_id, turn)."""
        cid, turn = (match.conversation_id, match.turn) if match is not None else (request_id, 1)
        self._by_key[new.key] = _Entry(cid, turn, request_id, new, prompt_tokens, end_s)
        self._by_key.move_to_end(new.key)
        while len(self._by_key) > self.max_conversations:
            self._by_key.popitem(last=False)
        return cid, turn

    def prefill_rate(self) -> float | None:
        """The median prefill tok/s of recent first turns (a cold cache), when there are any."""
        if not self.cold_prefill_tps:
            return None
        v = sorted(self.cold_prefill_tps)
        return v[len(v) // 2]
