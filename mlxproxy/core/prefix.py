"""Prompt-prefix tracking without keeping prompt text (sans-I/O).

A request's prompt is cut into stable pieces in the order the server renders it: the system
pieces (a Messages `system`, Responses `instructions`, the leading system and developer
messages), `tools`, then every other message's fields (`messages[i].role`, `.content`,
`.reasoning_content`, `.tool_calls`, ...). A content is its text as a template sees it
(`_content`: text blocks' texts, other blocks' JSON, `cache_control` markers left out, so a
one-block list equals the same string). Each piece keeps only a 64-bit fingerprint, its length,
and one fingerprint per `BLOCK_CHARS` block of its text, so two prompts can be compared piece by
piece and, in the first piece that differs, block by block: how much of an earlier prompt a new
one shares, and where they first diverge. Fingerprints are Python's `hash()` of strings: stable
within one process, which is all an in-memory index needs.

Conversation identity (`find_turn`, `continues`; docs/METRICS.md, "Prompt-prefix tracking"): a
conversation belongs to one endpoint family (chat, Messages, Responses) and is found by the stem
of its first user message (`_stem`: its first paragraph past the tagged reminders it opens
with). A new request continues it when its message list (the messages after the leading system
ones) strictly extends the previous request's; or, with the same model, keeps the previous
request's newest message (as it was, or by its stem: a reminder appended or dropped) while
earlier ones were edited, dropped or inserted (compaction, re-rendered tool results, Aider's
restored history); or resends the same messages under another system prompt or tools (a
regenerate). The same prompt sent again whole (a repeat, a retry, bench's identical requests)
starts a conversation of its own, as does a replay's run (its nonce starts the first user
message) and another agent's prompt over the same messages (`_another_agent`). Among several,
the same model, then an extension, then the longest shared prefix wins.

What changed (`prompt_change`) is named from the fingerprints alone: `model_changed`,
`tools_changed` (which tool), `volatile_span` (a line or two of the system prompt changed
while the rest stayed: where, and the line's shape, e.g. `a-a: a=<hex:5>;`, no text),
`system_changed`, `history_rewritten`. For that the system pieces also keep one fingerprint
per line, and the tools one fingerprint and the name per tool; the shape of a changed line
is read from the new request's body while it is still at hand. Whether the server paid for
the change is the cache doctor's question (`core.cachecheck`).

These are pure functions; the conversations an upstream remembers (the latest prompt of
each, bounded) are kept by `core.cachecheck.PrefixIndex`; `find_turn` reads them. The index also
keeps a `PieceMemo`, which makes `fingerprint` incremental: a message, a system prompt or a tools
list fingerprinted for a recent turn is not fingerprinted again (issue 40: an agent's turn resends
the previous turn's messages and adds a few), with the same result. Limits
(documented in docs/METRICS.md): at most `MAX_BLOCKS` blocks (`MAX_BLOCKS * BLOCK_CHARS`
characters) are fingerprinted per prompt; past that, pieces compare whole.
"""

from __future__ import annotations

import re
from array import array
from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from itertools import chain
from operator import attrgetter
from typing import Any, Literal, NamedTuple, get_args

import orjson

__all__ = [
    "PromptPrint",
    "fingerprint",
    "Match",
    "Change",
    "Cause",
    "CAUSES",
    "PromptCause",
    "compare",
    "prompt_change",
    "line_shape",
    "BLOCK_CHARS",
    "MAX_BLOCKS",
    "continues",
    "find_turn",
    "Latest",
    "PieceMemo",
    "MEMO_BYTES",
    "MEMO_RECENT",
    "system_chars",
]

BLOCK_CHARS = 256
MAX_BLOCKS = 4096  # 1 MiB of prompt text per request (~250k tokens); 32 KiB of fingerprints at most
MAX_PIECES = 20_000
MAX_LINES = 4096  # line fingerprints per system piece
SHAPE_LINE_CHARS = 400  # a longer changed line has no shape
VOLATILE_LINES = 2  # a change of at most this many lines, in place...
VOLATILE_REST = 0.5  # ...while at least this share of the piece stays: volatile_span
MEMO_BYTES = 4 * MAX_BLOCKS * BLOCK_CHARS  # a PieceMemo's bound: its keys' bytes (4 MiB)
MEMO_ENTRIES = 4096  # ...and its entries
MEMO_PROBATION = 256  # entries seen once, kept apart until seen again (`PieceMemo`)
MEMO_RECENT = 4  # the latest prompts whose messages a new prompt is compared with first (`PieceMemo`)

#: why a turn could not reuse the previous turn's whole prompt (docs/METRICS.md, "Re-prefill causes")
Cause = Literal[
    "volatile_span",
    "system_changed",
    "tools_changed",
    "history_rewritten",
    "model_changed",
    "cache_evicted",
    "cache_system_only",
]
CAUSES: tuple[Cause, ...] = get_args(Cause)
#: the causes the prompts alone show (`cache_evicted` and `cache_system_only` need the server's answer)
PromptCause = Literal["volatile_span", "system_changed", "tools_changed", "history_rewritten", "model_changed"]

_SYSTEM_ROLES = ("system", "developer")  # a tuple: a role may be any JSON value


class PromptPrint(NamedTuple):
    """The fingerprints of one prompt (no text). (Tuples, as `Match`: one of each per request,
    and a frozen dataclass's per-field `__init__` cost more than the fingerprinting itself.)"""

    key: int  # the conversation key: endpoint family and the first user message's stem (`_stem`)
    labels: tuple[str, ...]
    hashes: array[int]  # one per piece
    chars: array[int]  # characters per piece
    # per piece: fingerprints of its BLOCK_CHARS blocks (a tuple for a piece of one block or
    # none, an array for a longer one; None past MAX_BLOCKS)
    blocks: tuple[Sequence[int] | None, ...]
    tools_set: int  # fingerprint of the tools in name order (to tell "tools order" from a change)
    family: str = ""
    model: str | None = None
    messages: tuple[int, ...] = ()  # one fingerprint per message after the leading system ones
    head_messages: int = 0  # leading system/developer messages (their pieces are system pieces)
    tools: tuple[tuple[str, int], ...] = ()  # (name, fingerprint) per declared tool, in order
    # per system piece index: its line fingerprints
    lines: tuple[tuple[int, array[int]], ...] = ()
    # one per message after the leading system ones: its role and stem (`_stem`), to know a
    # message again after a client appended a reminder to it or dropped one from it
    stems: tuple[int, ...] = ()

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


_TEXT_BLOCKS = frozenset({"text", "input_text", "output_text"})


def _unmarked(block: dict[str, Any]) -> dict[str, Any]:
    """A content block without its `cache_control` markers (also in a tool result's content)."""
    out = {k: v for k, v in block.items() if k != "cache_control"}
    inner = out.get("content")
    if isinstance(inner, list):
        out["content"] = [_unmarked(b) if isinstance(b, dict) else b for b in inner]
    return out


def _content(v: Any) -> str:
    """A message content (or a Messages `system`) as a chat template sees it: a string as it
    is; a list of blocks as its text blocks' texts, other blocks as their JSON without
    `cache_control`, one per line. A one-block list and the same text as a string compare
    equal, and a marker moved from block to block changes nothing (Claude Code moves its
    breakpoint to the newest message every turn)."""
    if type(v) is str:
        return v
    if not isinstance(v, list):
        return _text(v)
    parts: list[str] = []
    for b in v:
        if isinstance(b, dict):
            t = b.get("text")
            if type(t) is str and b.get("type", "text") in _TEXT_BLOCKS:
                parts.append(t)
                continue
            parts.append(_text(_unmarked(b)) if "cache_control" in b or "content" in b else _text(b))
        else:
            parts.append(_text(b))
    return "\n".join(parts)


_TAG = re.compile(r"\s*<([A-Za-z][\w-]{0,63})[^>]{0,200}>")


def _stem(text: str) -> str:
    """A message's own words without the reminders a client puts around them: its first
    paragraph once the tagged blocks it opens with are left out (`<system-reminder>...
    </system-reminder>`: Claude Code, Qwen Code; Codex's `<environment_context>`), the whole
    text when nothing else is left. Clients move such reminders from message to message
    (Qwen Code's current date goes to the newest user message), and Aider appends its format
    reminder after a blank line and drops it on the next turn."""
    start, n = 0, len(text)
    while start < n:
        tag = _TAG.match(text, start)
        if tag is None:
            break
        close = text.find(f"</{tag.group(1)}>", tag.end())
        if close < 0:
            break
        start = close + len(tag.group(1)) + 3
    rest = text[start:].strip()
    if not rest:
        return text
    end = rest.find("\n\n")
    return rest if end < 0 else rest[:end].rstrip()


_TOKEN = re.compile(r"[A-Za-z0-9]+|\s+|.")
_HEX = frozenset("0123456789abcdefABCDEF")


def _token_shape(t: str) -> str:
    if t.isspace():
        return " "
    if not t.isalnum() or not t.isascii():
        return t if len(t) == 1 and not t.isalnum() else "?"
    if t.isdigit():
        return "9" * len(t) if len(t) <= 6 else f"<9:{len(t)}>"
    if t.isalpha():
        return "a"
    if len(t) >= 4 and set(t) <= _HEX:
        return f"<hex:{len(t)}>"
    return f"<x:{len(t)}>"


def line_shape(line: str) -> str:
    """The shape of a line without its text: a word is `a`, digits `9`, a run of hex digits
    `<hex:N>`, other letter-digit mixes `<x:N>`, whitespace one space, punctuation kept
    (`x-anthropic-billing-header: cc_version=2.1.37; cch=3f2a1;` -> `a-a-a-a: a_a=9.9.99; a=<hex:5>;`)."""
    return "".join(_token_shape(m.group()) for m in _TOKEN.finditer(line))[:120]


def _lines(text: str) -> list[str]:
    """A piece's lines: at its newlines, or at the escaped ones of a piece serialized as JSON
    (an Anthropic `system` given as a list of text blocks)."""
    lines = text.split("\n", MAX_LINES - 1)
    return text.split("\\n", MAX_LINES - 1) if len(lines) == 1 else lines


class PieceMemo:
    """What `fingerprint` made of the parts of earlier prompts, to reuse where a new prompt
    repeats them (an agent's turn resends the previous turn's messages and adds a few): per
    message, keyed by its exact JSON (`orjson.dumps`; everything a message's pieces are made
    of is read through that view), its pieces and fingerprints; per other piece's text (a
    system prompt, the tools), its fingerprint and blocks; per system piece, its line
    fingerprints; per tools list, its tools' fingerprints. The fingerprints come out exactly
    as without it. A part seen once waits in a probation list of at most `max_probation`
    entries (the oldest out first) and joins the kept entries only when a later prompt repeats
    it: a stream of one-off requests (each its own first turn) churns through probation and
    never fills the memo (a 1,500-request soak of new conversations grew the proxy's memory by
    11 % when every part was kept). The kept entries: least recently used out first, at most
    `max_bytes` of keys in both lists together (a key is at least as long as the text it stands
    for, which the entry keeps) and `max_entries` entries. Kept by the finishing step's state
    (`cachecheck.PrefixIndex.memo`); no I/O, no clock.

    Before any of that, a prompt's messages are compared with those of the `MEMO_RECENT` latest
    prompts (an agent's turn repeats its previous turn's): the leading messages equal (`==`, no
    JSON written, no key hashed) to a recent prompt's take that prompt's pieces, as far as both
    are made of strings, None, lists and objects only (`_plain`: where `==` tells values apart
    exactly as their JSON does; `1 == 1.0 == True` is not such a case). The tools list likewise:
    equal to the latest one, its JSON text is reused."""

    def __init__(
        self, max_bytes: int = MEMO_BYTES, max_entries: int = MEMO_ENTRIES, max_probation: int = MEMO_PROBATION
    ) -> None:
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self.max_probation = max_probation
        self.bytes = 0  # the keys' bytes held, in both lists
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[Any, tuple[int, Any]] = OrderedDict()  # seen again: kept
        self._probation: OrderedDict[Any, tuple[int, Any]] = OrderedDict()  # seen once
        # the latest prompts, newest first: their messages (up to the first one not `_plain`),
        # what they were made into, how many of the first are known `_plain`, and (at most) the
        # bytes of their JSON: a prompt of more than a quarter of `max_bytes` is not kept
        self._recent: deque[tuple[list[Any], list[_Said], int, int]] = deque(maxlen=MEMO_RECENT)
        self._repeated_size = 0  # the JSON bytes of the messages `repeated` last gave (at most)
        # the latest tools list, its JSON as sent (None: it is `_plain`) and its text (`_text`)
        self._tools: tuple[list[Any], bytes | None, str] | None = None

    def __len__(self) -> int:
        return len(self._entries) + len(self._probation)

    def weights(self) -> int:
        """The keys' bytes the two lists hold (what `bytes` counts)."""
        return sum(w for w, _ in self._entries.values()) + sum(w for w, _ in self._probation.values())

    def keys(self) -> list[Any]:
        return [*self._entries, *self._probation]

    def _get(self, key: Any, weight: int, make: Any, arg: Any) -> Any:
        entries = self._entries
        got = entries.get(key)
        if got is not None:
            entries.move_to_end(key)
            self.hits += 1
            return got[1]
        got = self._probation.pop(key, None)
        if got is not None:  # seen again: kept
            self.hits += 1
            entries[key] = got
            self._trim()
            return got[1]
        self.misses += 1
        value = make(arg)
        if weight <= self.max_bytes:
            probation = self._probation
            probation[key] = (weight, value)
            self.bytes += weight
            while len(probation) > self.max_probation:
                self.bytes -= probation.popitem(last=False)[1][0]
            self._trim()
        return value

    def _trim(self) -> None:
        entries, probation = self._entries, self._probation
        while len(entries) > self.max_entries or (self.bytes > self.max_bytes and (entries or probation)):
            self.bytes -= (entries or probation).popitem(last=False)[1][0]

    def piece(self, text: str) -> _Said:
        return self._get(text, len(text), _said_text, text)  # type: ignore[no-any-return]

    def repeated(self, items: list[Any]) -> list[_Said]:
        """What the leading messages of `items` that a recent prompt also begins with were made
        into: those of the newest prompt that `items` extends, else the longest such run (none:
        empty). Only `_plain` messages are taken (checked once per kept prompt)."""
        recent = self._recent
        best, best_n = -1, 0
        self._repeated_size = 0
        for k, (old, _, _, _) in enumerate(recent):
            size = len(old)
            if size <= len(items) and items[:size] == old:  # (one comparison in C: the usual case)
                best, best_n = k, size
                break
            n, limit = 0, min(len(items), size)
            while n < limit and items[n] == old[n]:
                n += 1
            if n > best_n:
                best, best_n = k, n
        if best < 0:
            return []
        old, said, plain, size = recent[best]
        if plain < best_n:  # not known yet whether these are plain
            for i in range(plain, best_n):
                if not _plain(old[i]):  # `==` may equate values JSON writes apart: not taken, from here on
                    old, said = old[:i], said[:i]
                    best_n = i
                    break
            recent[best] = (old, said, best_n, size)
        self._repeated_size = size
        if best_n == len(old):  # `items` extends that prompt (as far as it is taken): it takes its place
            del recent[best]
            return said if best_n == len(said) else said[:best_n]
        return said[:best_n]

    def remember(self, items: list[Any], said: list[_Said], plain: int, size: int) -> None:
        """`items` (the messages `said` was made of, the first `plain` of them known `_plain`, the
        rest `size` bytes of JSON) as the latest prompt, unless it is too large to keep."""
        size += self._repeated_size
        if size <= self.max_bytes // 4:
            self._recent.appendleft((items if len(items) == len(said) else items[: len(said)], said, plain, size))

    def tools_text(self, tools: list[Any]) -> str:
        """`_text(tools)`, reused while the tools list stays the latest one: equal (`==`) where
        it is `_plain`, else written to the same JSON (a schema's numbers and booleans)."""
        last = self._tools
        raw: bytes | None = None
        if last is not None:
            if last[1] is None:
                if tools == last[0]:
                    return last[2]
            else:
                raw = _json(tools)
                if raw == last[1]:
                    return last[2]
        text = _text(tools)
        if len(text) > self.max_bytes // 4:  # (as a prompt's messages: too large to keep)
            self._tools = None
        elif _plain(tools):
            self._tools = (tools, None, text)
        else:
            raw = _json(tools) if raw is None else raw
            self._tools = None if raw is None else (tools, raw, text)
        return text

    def lines(self, text: str) -> array[int]:
        return self._get(("lines", text), len(text), _line_prints, text)  # type: ignore[no-any-return]

    def tools(self, text: str, tools: list[Any]) -> tuple[tuple[int, ...], int]:
        return self._get(("tools", text), len(text), _tool_prints, tools)  # type: ignore[no-any-return]


def _json(v: Any) -> bytes | None:
    """`v`'s JSON in its own key order (None: not JSON as orjson writes it)."""
    try:
        return orjson.dumps(v)
    except orjson.JSONEncodeError:
        return None


def _plain(v: Any) -> bool:
    """Made of strings, None, lists and string-keyed dicts only: a value that `==` tells from
    another exactly where their JSON differs (not so for numbers: `1 == 1.0 == True`). Key
    order, which `==` ignores, changes nothing a message or a tools list is made into."""
    if type(v) is str or v is None:
        return True
    if type(v) is dict:
        return all(type(k) is str and _plain(x) for k, x in v.items())
    if type(v) is list:
        return all(_plain(x) for x in v)
    return False


class _Said(NamedTuple):
    """What one message (or one other piece) contributes to a prompt's fingerprints,
    whatever its place."""

    suffixes: tuple[str, ...]  # per piece, its label after `messages[i]`
    texts: tuple[str, ...]
    hashes: array[int]  # (arrays: a prompt's are joined as bytes, in C: `_piece_blocks`)
    chars: array[int]
    blocks: tuple[Sequence[int], ...]  # per piece, its blocks' fingerprints (`_piece_blocks`)
    cost: int  # the blocks its pieces take from the `MAX_BLOCKS` budget
    content: str = ""
    user: bool = False  # a user message
    system: bool = False  # a system or developer message
    whole: int = 0  # the message's fingerprint
    stem: int = 0  # its role's and stem's (`_stem`)
    user_stem: str = ""  # a user message's stem (a conversation's key is its first one's): made once


def _prints(texts: tuple[str, ...]) -> tuple[array[int], array[int], tuple[Sequence[int], ...], int]:
    """The pieces' hashes, lengths and blocks' fingerprints (a tuple for a piece of one block
    or none, an array for a longer one), and the blocks they take."""
    hashes: list[int] = []
    chars: list[int] = []
    blocks: list[Sequence[int]] = []
    cost = 0
    for t in texts:
        h = hash(t)
        size = len(t)
        hashes.append(h)
        chars.append(size)
        if size <= BLOCK_CHARS:  # one block: the piece's own fingerprint
            blocks.append((h,) if size else ())
            cost += 1 if size else 0
        else:
            blocks.append(array("q", [hash(t[k : k + BLOCK_CHARS]) for k in range(0, size, BLOCK_CHARS)]))
            cost += (size + BLOCK_CHARS - 1) // BLOCK_CHARS
    return array("q", hashes), array("q", chars), tuple(blocks), cost


_HASHES, _CHARS, _BLOCKS, _COST, _TEXTS, _WHOLE, _STEM = (
    attrgetter(f) for f in ("hashes", "chars", "blocks", "cost", "texts", "whole", "stem")
)


def _said_text(text: str) -> _Said:
    return _Said(("",), (text,), *_prints((text,)))


def _said(m: Any) -> _Said:
    """The pieces of message `m` (a `cache_control` marker never reaches the prompt and is
    left out), their fingerprints, and the message's own."""
    if not isinstance(m, dict):
        texts: tuple[str, ...] = (_text(m),)
        return _Said(("",), texts, *_prints(texts), "", False, False, hash(texts), hash((None, _stem(""))))
    content = ""
    suffixes: list[str] = []
    said: list[str] = []
    role = m.get("role")
    for field in _message_fields(m):
        if field == "cache_control":
            continue
        v = m[field]
        if field == "content":
            content = _content(v)
            suffixes.append(".content")
            said.append(content)
        else:
            suffixes.append(f".{field}")
            said.append(v if type(v) is str else _text(v))
    texts = tuple(said)
    stem = _stem(content)
    return _Said(
        tuple(suffixes),
        texts,
        *_prints(texts),
        content,
        role == "user",
        role in _SYSTEM_ROLES,
        hash(texts),
        hash((role if type(role) is str else None, stem)),
        stem if role == "user" else "",
    )


def _line_prints(text: str) -> array[int]:
    return array("q", [hash(x) for x in _lines(text)])


def _tool_prints(tools: list[Any]) -> tuple[tuple[int, ...], int]:
    """Per declared tool, its fingerprint; the fingerprint of the tools in name order."""
    each = [_text(t) for t in tools]
    return tuple(hash(t) for t in each), hash("\x00".join(sorted(each)))


def fingerprint(
    endpoint: str,
    obj: Any,
    model: str | None = None,
    texts: list[str] | None = None,
    memo: PieceMemo | None = None,
) -> PromptPrint | None:
    """The prompt fingerprints of a chat, Messages or Responses request body, or None. The
    pieces follow the rendered prompt: the system pieces (`system` / `instructions`, then the
    leading system and developer messages), `tools`, then the other messages, each content as
    the server's template sees its text (`_content`). `texts`, when given, receives each
    piece's text (to count the prompt's tokens where the server reports none). `memo` reuses
    what earlier prompts' equal parts were made into (`PieceMemo`): the same result, less work."""
    if not isinstance(obj, dict):
        return None
    labels: list[str] = []
    said: list[str] = []  # the pieces' texts
    groups: list[_Said] = []  # the pieces' fingerprints, by message or piece
    piece = _said_text if memo is None else memo.piece
    system: list[int] = []  # indices of the system pieces
    for field, family in (("system", "messages"), ("instructions", "responses")):
        if endpoint == family and obj.get(field) is not None:
            system.append(len(labels))
            labels.append(field)
            said.append(_content(obj[field]))
            groups.append(piece(said[-1]))
    if endpoint == "responses":
        inp = obj.get("input")
        items = [{"role": "user", "content": inp}] if isinstance(inp, str) else inp
        name = "input"
    else:
        items = obj.get("messages")
        name = "messages"
    if not isinstance(items, list) or not items:
        return None
    messages = _message_pieces(items, memo)
    first_user, head = messages.first_user, messages.head
    if first_user is None:
        return None
    for i, s in enumerate(messages.said[:head]):
        system += range(len(labels), len(labels) + len(s.texts))
        labels += _LABELS.get((name, i, s.suffixes)) or _labels_at(name, i, s.suffixes)
        said += s.texts
    groups += messages.said[:head]
    tools = obj.get("tools")
    tools = tools if isinstance(tools, list) and tools else None
    tools_set = 0
    tool_prints: tuple[tuple[str, int], ...] = ()
    if tools is not None:  # rendered after the system prompt (Qwen's and most chat templates)
        text = _text(tools) if memo is None else memo.tools_text(tools)
        labels.append("tools")
        said.append(text)
        groups.append(piece(text))
        each, tools_set = _tool_prints(tools) if memo is None else memo.tools(text, tools)
        tool_prints = tuple(zip(_tool_names(tools), each))
    rest = messages.said[head:]
    labels += chain.from_iterable(
        [_LABELS.get((name, i, s.suffixes)) or _labels_at(name, i, s.suffixes) for i, s in enumerate(rest, head)]
    )
    said += chain.from_iterable(map(_TEXTS, rest))
    groups += rest
    key = hash((endpoint, first_user))
    if texts is not None:
        texts.extend(said)
    hashes, lengths, blocks = _piece_blocks(groups)
    line_prints = _line_prints if memo is None else memo.lines
    lines = tuple((i, line_prints(said[i])) for i in system)
    return PromptPrint(
        key,
        tuple(labels),
        hashes,
        lengths,
        blocks,
        tools_set,
        endpoint,
        model,
        tuple(map(_WHOLE, rest)),
        head,
        tool_prints,
        lines,
        tuple(map(_STEM, rest)),
    )


_LABELS: dict[tuple[str, int, tuple[str, ...]], tuple[str, ...]] = {}  # (made once: `_labels_at`)
_MAX_LABELS = 8192


def _labels_at(name: str, i: int, suffixes: tuple[str, ...]) -> tuple[str, ...]:
    """The labels of the pieces of message `i` of list `name` (`messages[3].content`)."""
    labels = tuple(f"{name}[{i}]{suffix}" for suffix in suffixes)
    if len(_LABELS) < _MAX_LABELS:
        _LABELS[name, i, suffixes] = labels
    return labels


def _message_index(label: str) -> int:
    """`messages[3].content` -> 3; -1 for a piece that is not a message's."""
    at = label.find("[")
    return int(label[at + 1 : label.index("]")]) if at >= 0 else -1


class _Messages(NamedTuple):
    said: list[_Said]  # per message kept (up to `MAX_PIECES` pieces)
    first_user: str | None  # the first user message's stem (`_stem` of its text)
    head: int  # leading system and developer messages


def _message_pieces(items: list[Any], memo: PieceMemo | None) -> _Messages:
    """Each message's pieces and fingerprints (`_said`) while fewer than `MAX_PIECES` pieces
    came before it, the first user message's text and the number of leading system messages."""
    first_user: str | None = None
    head = pieces = 0
    leading = True
    # the leading messages a recent prompt also sent: its pieces (`PieceMemo.repeated`)
    out: list[_Said] = [] if memo is None else memo.repeated(items)
    reused, size = len(out), 0  # (size: the JSON bytes of the messages made here, for `remember`)
    for k, m in enumerate(items):
        if k < reused:
            s = out[k]
        elif pieces >= MAX_PIECES:
            break
        elif memo is None:
            s = _said(m)
        else:  # a message is kept by its JSON (`PieceMemo`; its hit inlined: once per message)
            try:
                key = orjson.dumps(m)
            except orjson.JSONEncodeError:  # not JSON as orjson writes it: made afresh, not kept
                s = _said(m)
                size += sum(s.chars)  # (its text's length: near enough for a bound)
            else:
                size += len(key)
                got = memo._entries.get(key)
                if got is not None:
                    memo._entries.move_to_end(key)
                    memo.hits += 1
                    s = got[1]
                else:  # (in probation, or new)
                    s = memo._get(key, len(key), _said, m)
        if k >= reused:
            out.append(s)
        pieces += len(s.texts)
        if first_user is None and s.user:
            first_user = s.user_stem
        if leading and s.system:
            head += 1
        else:
            leading = False
    if memo is not None:
        memo.remember(items, out, reused, size)
    return _Messages(out, first_user, head)


def _tool_names(tools: list[Any]) -> list[str]:
    return [
        str(t.get("function", t).get("name", ""))
        if isinstance(t, dict) and isinstance(t.get("function", t), dict)
        else ""
        for t in tools
    ]


def _piece_blocks(groups: list[_Said]) -> tuple[array[int], array[int], tuple[Sequence[int] | None, ...]]:
    """Each piece's hash and length, and its blocks' hashes (`BLOCK_CHARS` each) while the
    `MAX_BLOCKS` budget lasts (None for a piece past it)."""
    if sum(map(_COST, groups)) < MAX_BLOCKS:  # every group whole (the usual case): joined in C
        hashes_, lengths_ = array("q"), array("q")
        hashes_.frombytes(b"".join(map(_HASHES, groups)))
        lengths_.frombytes(b"".join(map(_CHARS, groups)))
        return hashes_, lengths_, tuple(chain.from_iterable(map(_BLOCKS, groups)))
    budget = MAX_BLOCKS
    blocks: list[Sequence[int] | None] = []
    hashes: list[int] = []
    lengths: list[int] = []
    for g in groups:
        hashes += g.hashes
        lengths += g.chars
        if g.cost < budget:  # (so every piece of it still finds at least one block left)
            blocks += g.blocks
            budget -= g.cost
            continue
        for size, b in zip(g.chars, g.blocks):
            if size <= BLOCK_CHARS and budget >= 1:  # one block: the piece's own fingerprint
                blocks.append(b)
                budget -= 1 if size else 0
                continue
            n = (size + BLOCK_CHARS - 1) // BLOCK_CHARS
            if n <= budget:  # (a piece of one block here is an empty one: no blocks)
                blocks.append(b if size > BLOCK_CHARS else array("q"))
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
    change: Change | None = None  # what changed, when the new prompt does not extend the previous one
    cold_prefill_tps: float | None = None  # the conversation's own prefill rate on a cold cache
    lost_s: float = 0.0  # prefill seconds the conversation lost to re-prefills so far
    previous_source: str = "usage"  # where previous_prompt_tokens came from (the proxy's count: "tokenizer", "chars")
    system_chars: int = 0  # the previous prompt's system part (system pieces and tools: `system_chars`)

    def tokens(self, chars: int) -> tuple[int, str]:
        """`chars` of the previous prompt in tokens, and how that was counted: from its
        `prompt_tokens` (`usage`, or as the proxy counted them where the server reported none:
        `tokenizer`, `chars`; scaled by characters when only part is shared), else characters / 4
        (`chars`)."""
        if self.previous_prompt_tokens is not None and self.previous_chars > 0:
            if chars >= self.previous_chars:
                return self.previous_prompt_tokens, self.previous_source
            return round(self.previous_prompt_tokens * chars / self.previous_chars), self.previous_source
        return chars // 4, "chars"


class Change(NamedTuple):
    """What a new prompt changed against its conversation's previous one, from fingerprints."""

    cause: PromptCause
    where: str  # e.g. "system line 1: a-a-a-a: a_a=9.9.99; a=<hex:5>;", "tools: read_file changed"


def system_chars(pp: PromptPrint) -> int:
    """The characters of a prompt's system part: its system pieces (`system`, `instructions`, the
    leading system and developer messages) and its tools, which come first in its pieces. A cache
    that keeps only the system prompt (vllm-mlx 0.6.0's default) keeps this part (as the server
    renders it, with the tools) and prefills everything after it on every request."""
    k = len(pp.lines) + (1 if pp.tools else 0)
    return sum(pp.chars[:k])


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


def _first_difference(old: PromptPrint, new: PromptPrint) -> tuple[int, int, int | None]:
    """(index of the first piece that differs, characters shared before it and within it,
    characters shared within it when its blocks tell); the index is the shorter prompt's
    piece count when one prompt's pieces all begin the other."""
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
        return i, shared, within
    return n, shared, None


def compare(old: PromptPrint, new: PromptPrint) -> tuple[int, bool, str | None]:
    """(shared characters, new extends old, where they diverge)."""
    i, shared, within = _first_difference(old, new)
    if i == len(old.labels) and len(old.labels) <= len(new.labels):
        return shared, True, None
    return shared, False, _where(old, new, i, within)


def _tools_where(old: PromptPrint, new: PromptPrint) -> str:
    """Which tool changed: `tools: NAME changed|added|removed`, or `tools order`."""
    if old.tools_set == new.tools_set and sorted(old.tools) == sorted(new.tools):
        return "tools order"
    before, after = dict(old.tools), dict(new.tools)
    for name, h in new.tools:
        if name not in before:
            return f"tools: {name} added"
        if before[name] != h:
            return f"tools: {name} changed"
    for name, _ in old.tools:
        if name not in after:
            return f"tools: {name} removed"
    return "tools"


def _piece_text(pp: PromptPrint, body: Any, i: int) -> str | None:
    """The text of piece `i` of `pp`, read again from the request body it was made of."""
    label = pp.labels[i]
    if not isinstance(body, dict):
        return None
    if label in ("system", "instructions"):
        v = body.get(label)
        field = "content"
    else:
        name, _, field = label.partition(".")
        items = body.get(name[: name.index("[")])
        k = _message_index(label)
        m = items[k] if isinstance(items, list) and 0 <= k < len(items) else None
        v = m.get(field) if isinstance(m, dict) else None
    if v is None:
        return None
    return _content(v) if field == "content" else _text(v)


def _volatile(old: PromptPrint, new: PromptPrint, i: int, body: Any) -> str | None:
    """Where and what shape a volatile span in system piece `i` has: at most `VOLATILE_LINES`
    lines replaced in place while at least `VOLATILE_REST` of the piece stays; else None.
    The changed line's shape is read from `body`, the new prompt's request body."""
    a = next((x for x in old.lines if x[0] == i), None)
    b = next((x for x in new.lines if x[0] == i), None)
    if a is None or b is None or len(a[1]) != len(b[1]) or len(b[1]) < 2:
        return None
    la, lb = a[1], b[1]
    changed = [k for k in range(len(lb)) if la[k] != lb[k]]
    if not changed or len(changed) > VOLATILE_LINES or changed[-1] - changed[0] >= VOLATILE_LINES:
        return None
    k = changed[0]
    text = _piece_text(new, body, i)
    line = _lines(text)[k] if text is not None else None
    shape = line_shape(line) if line is not None and len(line) <= SHAPE_LINE_CHARS else None
    unchanged = 1 - len(changed) / len(lb)
    if unchanged < VOLATILE_REST and new.chars[i] > 0:
        return None
    label = new.labels[i]
    return f"{label} line {k + 1}" + (f": {shape}" if shape is not None else "")


def _short(name: str | None, limit: int = 64) -> str:
    """A model name as `reprefill_at` shows it: at most `limit` characters, printable."""
    text = repr(name)[1:-1] if name is not None else "none"
    return text if len(text) <= limit else text[: limit - 1] + "…"


def prompt_change(old: PromptPrint, new: PromptPrint, body: Any = None) -> Change | None:
    """What `new` changed that makes part of `old` unusable by a prompt cache, or None when
    it extends `old` with the same model. `body`: the request body `new` was made of (for
    the shape of a volatile line)."""
    if old.model != new.model:
        return Change("model_changed", f"model {_short(old.model)} -> {_short(new.model)}")
    i, _, within = _first_difference(old, new)
    if i == len(old.labels) and len(old.labels) <= len(new.labels):
        return None
    label = (old.labels if i < len(old.labels) else new.labels)[i]
    sys_old = any(x[0] == i for x in old.lines)
    sys_new = any(x[0] == i for x in new.lines)
    if label == "tools" or (i < len(new.labels) and new.labels[i] == "tools"):
        return Change("tools_changed", _tools_where(old, new) if old.tools and new.tools else _where(old, new, i, None))
    if sys_old and sys_new and old.labels[i] == new.labels[i]:
        span = _volatile(old, new, i, body)
        if span is not None:
            return Change("volatile_span", span)
    where = _where(old, new, i, within)
    if sys_old or sys_new or old.head_messages != new.head_messages:
        return Change("system_changed", where)
    return Change("history_rewritten", where)


_BLANK = hash("")


def _another_agent(old: PromptPrint, new: PromptPrint) -> bool:
    """Whether `new` is another agent's prompt over the same messages: other tools (not just
    re-ordered) and a system prompt that keeps less than `VOLATILE_REST` of the previous one's
    distinct non-blank lines (Qwen Code's memory-extraction subagent resends the main
    conversation under its own system prompt and tools)."""
    if old.tools_set == new.tools_set or not old.lines:
        return False
    before = {h for _, lines in old.lines for h in lines} - {_BLANK}
    after = {h for _, lines in new.lines for h in lines}
    return bool(before) and len(before & after) < VOLATILE_REST * len(before)


def continues(old: PromptPrint, new: PromptPrint) -> bool:
    """Whether `new` is the next turn of the conversation whose latest prompt is `old`: the
    same endpoint family, and a message list (the messages after the leading system ones) that
    strictly extends the previous one; or, with the same model, one that keeps the previous
    request's newest message (as it was, or without the reminder a client appended to it or
    with one added: its stem) while earlier ones were edited, dropped or inserted (compaction,
    truncation, Aider's restored history before its fixed messages, re-rendered tool results);
    or the same message list under another system prompt or other tools (a regenerate after
    editing the system prompt). The same prompt sent again whole is a repeat: a conversation
    of its own; another agent's prompt over the same messages (`_another_agent`) is not this
    conversation's."""
    if old.family != new.family:
        return False
    a, b = old.messages, new.messages
    if len(b) > len(a) and b[: len(a)] == a:
        pass
    elif old.model != new.model or not a:
        return False
    elif a == b:
        if old.hashes == new.hashes and old.chars == new.chars:
            return False  # a repeat (most prompts a conversation's index holds are not this one's)
    elif a[-1] not in b and not (old.stems and old.stems[-1] in new.stems):
        return False
    # (last: the sets of lines it compares cost more than the checks above)
    return not _another_agent(old, new)


class Latest(NamedTuple):
    """A conversation's latest prompt as an upstream's index keeps it (`cachecheck.PrefixIndex`)."""

    conversation_id: str
    turn: int
    request_id: str
    prompt: PromptPrint
    prompt_tokens: int | None
    end_s: float
    cold_prefill_tps: float | None = None  # the conversation's own prefill rate on a cold cache
    lost_s: float = 0.0  # prefill seconds lost to re-prefills, summed over the conversation
    prompt_source: str = "usage"  # where prompt_tokens came from (`Match.previous_source`)


def find_turn(latest: Mapping[int, Sequence[Latest]], new: PromptPrint, body: Any = None) -> Match | None:
    """The conversation `new` continues, and how (None: it starts one), among the `latest`
    prompts of an upstream's recent conversations (per key, the most recent first). Of those
    it `continues`, the same model first, then one it extends, then the one it shares most
    with (a replayed conversation's turn belongs to its own run, not to the latest run's first
    turn). `body`: the request body `new` was made of, still at hand (the shape of a volatile
    line is read from it)."""
    best: tuple[tuple[bool, bool, int], Latest, int, bool, str | None] | None = None
    messages, hashes = new.messages, new.hashes
    for e in latest.get(new.key, ()):
        p = e.prompt
        if p.messages == messages and p.hashes == hashes and p.chars == new.chars:
            continue  # the same prompt sent again: a repeat (`continues`), told without the call
        if not continues(p, new):
            continue
        shared, extends, where = compare(e.prompt, new)
        rank = (e.prompt.model == new.model, extends, shared)
        if best is None or rank > best[0]:
            best = (rank, e, shared, extends, where)
    if best is None:
        return None
    _, e, shared, extends, where = best
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
        prompt_change(e.prompt, new, body),
        e.cold_prefill_tps,
        e.lost_s,
        e.prompt_source,
        system_chars(e.prompt),
    )
