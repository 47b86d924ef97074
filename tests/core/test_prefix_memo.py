"""Incremental fingerprints (issue 40): `prefix.PieceMemo` reuses what earlier prompts' equal
parts were made into, and changes no result. Every recorded agent session (tests/fixtures/sessions/)
is finished with the memo and without it: the same fingerprints and the same records; the memo
stays within its bounds."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

import sessions
from mlxproxy.core.cachecheck import PrefixIndex
from mlxproxy.core.prefix import BLOCK_CHARS, MAX_BLOCKS, MEMO_RECENT, PieceMemo, fingerprint
from mlxproxy.core.record import Record

SESSIONS = {s.name: s for s in sessions.load_sessions()}
BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _without_memo() -> PrefixIndex:
    index = PrefixIndex()
    index.memo = None
    return index


def _fields(records: dict[int, Record]) -> dict[int, dict[str, Any]]:
    return {n: dataclasses.asdict(r) for n, r in records.items()}


@pytest.mark.parametrize("name", sorted(SESSIONS))
def test_the_memo_changes_no_record_of_a_recorded_session(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with_memo = _fields(sessions.replay(SESSIONS[name]))
    monkeypatch.setattr(sessions, "PrefixIndex", _without_memo)
    without = _fields(sessions.replay(SESSIONS[name]))
    assert with_memo.keys() == without.keys() and with_memo
    for n in with_memo:
        assert with_memo[n] == without[n], f"exchange {n}"


def _bodies(name: str) -> list[tuple[str, Any, str | None]]:
    out = []
    for ex in SESSIONS[name].exchanges:
        if not ex.generation:
            continue
        m, _ = sessions.meter_for(SESSIONS[name], ex)
        if m.request.prompt_obj is not None:
            out.append((m.request.endpoint, m.request.prompt_obj, m.request.model))
    return out


def _same(a: Any, b: Any) -> None:
    """Equal, down to each piece's blocks being a tuple or an array as without the memo."""
    assert a == b
    if a is not None:
        assert [type(x) for x in a.blocks] == [type(x) for x in b.blocks]
        assert a.total_chars == b.total_chars


@pytest.mark.parametrize("max_bytes", [MAX_BLOCKS * BLOCK_CHARS * 4, 3000])
def test_every_recorded_prompt_fingerprints_the_same_with_the_memo(max_bytes: int) -> None:
    """In session order with one memo per session (a later turn hits what the earlier made),
    and with a memo so small that it evicts all the time."""
    hits = 0
    for name in sorted(SESSIONS):
        memo = PieceMemo(max_bytes=max_bytes)
        for endpoint, obj, model in _bodies(name):
            texts: list[str] = []
            texts_memo: list[str] = []
            _same(fingerprint(endpoint, obj, model, texts, memo), fingerprint(endpoint, obj, model, texts_memo))
            assert texts == texts_memo
            assert memo.bytes <= max_bytes
        hits += memo.hits
    assert hits > 0  # the incremental path ran


def test_the_agent_body_fingerprints_the_same_and_its_next_turn_hits() -> None:
    sys.path.insert(0, str(BENCHMARKS))
    from bodies import chat_body

    obj = orjson.loads(chat_body(False, 16, "agent"))
    memo = PieceMemo()
    first = fingerprint("chat", obj, "m", memo=memo)
    misses = memo.misses
    _same(first, fingerprint("chat", obj, "m"))
    # the next turn: the same messages (parsed afresh, as the proxy does) and two more
    nxt = orjson.loads(chat_body(False, 16, "agent"))
    nxt["messages"] += [
        {"role": "assistant", "content": "Done."},
        {"role": "user", "content": "Thanks, now the tests."},
    ]
    _same(fingerprint("chat", nxt, "m", memo=memo), fingerprint("chat", nxt, "m"))
    assert memo.misses - misses == 2  # only the two new messages were made afresh


def test_odd_messages_fingerprint_the_same() -> None:
    """A message orjson cannot write (a lone surrogate) is made afresh and not kept; values JSON
    writes alike (infinity as null) or apart (1 and 1.0, true) give what they gave without it."""
    memo = PieceMemo()
    cases = [
        {"messages": [{"role": "user", "content": "a\ud800b"}]},
        {"messages": [{"role": "user", "content": None}, {"role": "assistant", "content": float("inf")}]},
        {
            "messages": [
                {"role": "user", "content": 1},
                {"role": "user", "content": 1.0},
                {"role": "user", "content": True},
            ]
        },
        {
            "messages": [
                "plain",
                {"role": "system", "content": "s\nt"},
                {"role": "user", "content": ""},
                {"role": "user"},
            ]
        },
        {
            "messages": [
                {"content": [{"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}}], "role": "user"}
            ]
        },
        # tools whose names JSON writes alike (null) but str() does not ("inf", "None")
        {"messages": [{"role": "user", "content": "q"}], "tools": [{"name": float("inf")}]},
        {"messages": [{"role": "user", "content": "q"}], "tools": [{"name": None}]},
    ]
    for body in cases + cases:
        _same(fingerprint("chat", body, None, memo=memo), fingerprint("chat", body, None))
    assert memo.hits > 0
    assert all(not isinstance(k, bytes) or b"\\ud800" not in k for k in memo.keys())


def test_the_memo_stays_bounded() -> None:
    memo = PieceMemo(max_bytes=50_000, max_entries=100)
    for k in range(2000):
        body = {"messages": [{"role": "user", "content": f"question {k} " + "x" * (k % 700)}]}
        fingerprint("chat", body, None, memo=memo)
        assert memo.bytes <= 50_000 and len(memo._entries) <= 100 and len(memo._probation) <= memo.max_probation
    assert memo.bytes == memo.weights()
    big = PieceMemo(max_bytes=1000)
    fingerprint("chat", {"messages": [{"role": "user", "content": "y" * 5000}]}, None, memo=big)
    assert big.bytes <= 1000  # a part larger than the whole bound is made, not kept
    # nor are a prompt's messages or a tools list of more than a quarter of it kept as the latest
    assert not big._recent and big._tools is None
    tools = [{"name": "t" * 300}]
    fingerprint("chat", {"messages": [{"role": "user", "content": "y" * 200}], "tools": tools}, None, memo=big)
    assert len(big._recent) == 1 and big._recent[0][3] <= 250 and big._tools is None
    more = {"messages": [{"role": "user", "content": "y" * 200}, {"role": "assistant", "content": "z" * 60}]}
    _same(fingerprint("chat", more, None, memo=big), fingerprint("chat", more, None))
    assert not big._recent  # it extended the kept prompt (which made way) and is too large itself
    assert PrefixIndex().memo is not None  # the finishing step's state keeps one per upstream


def test_past_the_block_budget_the_same_pieces_compare_whole() -> None:
    """Where `MAX_BLOCKS` runs out (mid-message, at an empty piece, at a one-block piece), the
    memo's by-message path walks piece by piece as without it."""
    big = "z" * (BLOCK_CHARS * (MAX_BLOCKS - 3))
    for tail in (["", "a"], ["a" * BLOCK_CHARS, ""], ["b" * (BLOCK_CHARS * 2 + 1), "c"], ["", "", "d"]):
        body = {
            "messages": [
                {"role": "user", "content": big},
                {"role": "assistant", "content": "e" * (BLOCK_CHARS * 2), "reasoning_content": ""},
                *({"role": "user", "content": t} for t in tail),
            ]
        }
        memo = PieceMemo()
        fingerprint("chat", body, None, memo=memo)  # warm: every message a hit the second time
        with_memo, without = fingerprint("chat", body, None, memo=memo), fingerprint("chat", body, None)
        _same(with_memo, without)
        assert without is not None and None in without.blocks  # the budget did run out


def test_one_off_requests_churn_through_probation_and_keep_nothing() -> None:
    """A part seen once waits in probation; only a part a later prompt repeats is kept. New
    conversations one after another (the soak's traffic: each its own first turn, sharing the
    system prompt) keep the shared system prompt's parts and nothing else, however many there
    are (the system message itself is found in the latest prompts, `PieceMemo.repeated`)."""
    memo = PieceMemo(max_probation=16)
    system = {"role": "system", "content": "You are a coding agent. " * 40}
    for k in range(500):
        body = {"messages": [system, {"role": "user", "content": f"hello there {k:x}"}]}
        _same(fingerprint("chat", body, None, memo=memo), fingerprint("chat", body, None))
        assert len(memo._probation) <= 16 and len(memo._recent) <= MEMO_RECENT
    kept = memo._entries
    assert kept and all(b"hello there" not in repr(k).encode() for k in kept)
    assert ("lines", system["content"]) in kept and len(kept) <= 3
    assert memo.bytes == memo.weights()
    # an agent's next turn: what the first turn sent is the latest prompt's; only the new message is made
    turn1 = {"messages": [system, {"role": "user", "content": "fix the bug"}]}
    fingerprint("chat", turn1, None, memo=memo)
    misses, before = memo.misses, len(kept)
    turn2 = {"messages": [*turn1["messages"], {"role": "assistant", "content": "done"}]}
    _same(fingerprint("chat", turn2, None, memo=memo), fingerprint("chat", turn2, None))
    assert memo.misses - misses == 1 and len(kept) == before


def test_recent_prompts_equal_but_written_apart_are_made_afresh() -> None:
    """A message equal (`==`) to the latest prompt's but written apart in JSON (1, 1.0, true; a
    nested number) is not taken from it; equal ones in another key order are; a conversation
    interleaved with others finds its previous turn among the `MEMO_RECENT` latest prompts."""
    memo = PieceMemo()
    system = {"role": "system", "content": "s"}
    variants: list[Any] = [1, 1.0, True, [{"type": "x", "n": 1}], [{"type": "x", "n": 1.0}], [{"type": "x", "n": True}]]
    for v in variants + variants:
        body = {"messages": [system, {"role": "user", "content": v}, {"role": "user", "content": "q"}]}
        _same(fingerprint("chat", body, None, memo=memo), fingerprint("chat", body, None))
    tools = [{"name": "a", "n": 1}]
    for t in (tools, [{"name": "a", "n": True}], [{"n": True, "name": "a"}], [{"name": "a", "n": "1"}]) * 2:
        for again in (t, orjson.loads(orjson.dumps(t))):  # each also twice in a row: reused
            body = {"messages": [{"role": "user", "content": "q"}], "tools": again}
            _same(fingerprint("chat", body, None, memo=memo), fingerprint("chat", body, None))
    turns = [
        [{"role": "user", "content": f"conversation {c}"}, {"role": "assistant", "content": "a"}] for c in range(3)
    ]
    for step in range(3):
        for c, msgs in enumerate(turns):
            msgs += [{"content": f"turn {step} of {c}", "role": "user"}]
            body = {"messages": orjson.loads(orjson.dumps(msgs))}  # parsed afresh, as the proxy does
            misses = memo.misses
            _same(fingerprint("chat", body, None, memo=memo), fingerprint("chat", body, None))
            if step:
                assert memo.misses - misses == 1  # only the new message made
