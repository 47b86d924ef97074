"""Real agent sessions are the oracle (issue 36): each recorded session (Claude Code, Codex, Aider,
OpenCode, Qwen Code, llm; ``tests/fixtures/sessions/``) replayed offline through the proxy's
finishing path at its recorded times (``sessions.replay``), and its records held to the session's
truth table (``truth.json``: the server's own log or cached count, and what the request bytes show
turn to turn):

* grouping: every turn of the session is one conversation, numbered 1, 2, 3, ... in order; side
  requests (OpenCode's title, Qwen Code's memory extraction) are kept out of it;
* cause: each turn's re-prefill cause and where it diverges, as the bytes show it (none for a turn
  that extends the previous one as the server renders it), or as the server's log shows it for a
  turn that extends it (``cache_system_only``: vllm-mlx reused its system prompt only and prefilled
  the messages again), except on the first turn that shows it (:data:`FIRST_SHOWN`);
* alarms: no anomaly on a healthy turn (0 false alarms); where the server hit its cache but
  reported 0 cached tokens, ``cached_tokens_unreported`` and never ``cache_evicted``;
* lost: where a cause cost the server a re-prefill, the seconds the record says were lost within
  20% of the measured TTFT difference (this turn's TTFT minus the same prompt's warm TTFT), or within
  the range measured in the session where the same work varied more than that (:data:`NOISY_LOSS`);
  where the server neutralized it (vllm-mlx strips Claude Code's billing line, or prefills the
  history anyway: it caches the system prompt only), 0 s; where nothing the proxy had seen could
  tell, no figure and both bounds (:data:`UNCERTAIN`).

A session recorded after others through the same proxy (``Session.after``) is replayed after them
through one prefix index, as that proxy saw them.

The cases today's core gets wrong are marked ``xfail(strict=True)`` in :data:`KNOWN_WRONG`, each
with what it says instead, so they turn into failures ("XPASS(strict)") the day they are fixed and
the mark must go.
"""

from __future__ import annotations

import dataclasses
import functools
import json

import pytest

from mlxproxy.core.record import OK_OUTCOMES, Record
from sessions import Exchange, Session, load_sessions, replay

SESSIONS = {s.name: s for s in load_sessions()}
PREFIX_ANOMALIES = ("prompt_prefix_changed", "prefix_cache_miss", "cache_evicted")
ASPECTS = ("grouping", "cause", "alarms", "lost")

#: (session, exchange, aspect) -> what today's core does instead (the xfail reason)
KNOWN_WRONG: dict[tuple[str, int, str], str] = {}

#: (session, exchange) -> why the record must say its seconds are uncertain (no figure) rather than
#: the truth: nothing the proxy had seen could tell it
UNCERTAIN: dict[tuple[str, int], str] = {
    ("aider_0.86.2__vllm-mlx", n): "Aider alone through a fresh proxy: vllm-mlx caches the system prompt only "
    "and prefills the history anyway (0 s lost), but no turn of the session extends the previous one, so nothing "
    "in it tells a system-prompt cache from a prefix cache (~0.06 s lost); the record says both and no figure. "
    "After a session that shows the cache, the same Aider turns cost 0 s: aider-after-paste_0.86.2__vllm-mlx"
    for n in (2, 3, 4)
}

#: (session, exchange) -> why the record names no cause where the server's truth has one: the first
#: turn on its upstream to show the cache keeping the system prompt only, which one turn cannot tell
#: from an eviction that left the system part (its evidence says one more will)
FIRST_SHOWN: dict[tuple[str, int], str] = {
    ("opencode-paste_1.18.33__vllm-mlx", 4): "the session's first extended turn: vllm-mlx reused its 17,096 system "
    "tokens and prefilled the 62,203 after them; the TTFT shows that, but not yet that this server always does"
}

#: sessions whose measured losses varied so much for the same work that no one figure is within 20% of
#: all of them: the record's seconds must fall within what was measured in the session for that cause
NOISY_LOSS: dict[str, str] = {
    "claude-code-billing_2.1.332__mlx-lm+litellm": "~9,750 tokens re-prefilled every turn, measured 5.27, 1.76, "
    "1.92 s (the session's TTFT minus the same prompt's warm TTFT, taken later: 1.9, 2.2, 4.3 s); calibration.json's "
    "cold runs re-prefilled ~9,850 tokens each in 8.5, 11.5, 5.0 s over warm: on this loaded machine the same work "
    'varied 6x. The issue asks for "a loss with its seconds" here: a figure inside the measured range is that',
    "opencode-paste_1.18.33__vllm-mlx": "the same work every later turn (vllm-mlx prefilled 62,203, 62,234, 62,262 "
    "tokens of messages again, its log) took 1.85, 1.10, 1.28 s to the first token in the session; the same turns "
    "after the previous one on vllm-mlx --continuous-batching, whose cache keeps the conversation, took 0.28, 0.28, "
    "0.38 s (the least of 5 runs each, calibration.vllm-mlx-cb.json): measured 1.57, 0.82, 0.90 s lost. The "
    "proxy's figure is the messages' share of the TTFT (1.10, 1.28 s): it includes a hit's fixed cost (~0.28 s "
    "there), which a server that never serves a whole-prefix hit cannot show it",
}


@functools.cache
def records(name: str) -> dict[int, Record]:
    """The session replayed as it was recorded: after the sessions that went through its proxy
    first (``Session.after``: the proxy's prefix index had seen them), else alone."""
    s = SESSIONS[name]
    return replay(s, before=tuple(SESSIONS[a] for a in s.after))


def _cases() -> list[object]:
    out: list[object] = []
    for s in SESSIONS.values():
        for ex in s.exchanges:
            if not ex.generation or ex.upstream_response is None or not ex.expected:
                continue
            for aspect in ASPECTS:
                if aspect == "lost" and not _lost_applies(ex):
                    continue
                marks = []
                why = KNOWN_WRONG.get((s.name, ex.n, aspect))
                if why is not None:
                    marks.append(pytest.mark.xfail(strict=True, reason=why))
                out.append(pytest.param(s.name, ex.n, aspect, id=f"{s.name}-{ex.n}-{aspect}", marks=marks))
    return out


def _lost_applies(ex: Exchange) -> bool:
    e = ex.expected
    return e.get("role") == "turn" and e.get("cause") is not None and e.get("lost_s") is not None


def _main_conversation(s: Session) -> str | None:
    first = s.turns[0] if s.turns else None
    return records(s.name)[first.n].conversation_id if first is not None else None


@pytest.mark.parametrize(("name", "n", "aspect"), _cases())
def test_real_session(name: str, n: int, aspect: str) -> None:
    s = SESSIONS[name]
    ex = next(e for e in s.exchanges if e.n == n)
    rec = records(name)[n]
    want = ex.expected
    said = (
        f"record: conversation {rec.conversation_id} turn {rec.turn}, cause {rec.reprefill_cause} at "
        f"{rec.reprefill_at!r}, lost {rec.reprefill_lost_s}, anomalies {list(rec.anomalies)}; truth: {want}; "
        f"server: {ex.truth.get('server')}"
    )
    if aspect == "grouping":
        main = _main_conversation(s)
        if want["role"] == "failed":  # the server's error: not a turn (its retry is)
            assert rec.outcome not in OK_OUTCOMES, said
        elif want["role"] == "side":
            assert rec.conversation_id is None or rec.conversation_id != main, said
        else:
            assert (rec.conversation_id, rec.turn) == (main, want["turn"]), said
    elif aspect == "cause":
        if want["role"] in ("side", "failed") or want.get("turn") == 1:
            assert rec.reprefill_cause is None, said
        elif (name, n) in FIRST_SHOWN:
            assert want.get("cause") == "cache_system_only" and rec.reprefill_cause is None, said
            assert rec.cache_evidence is not None and "the first turn on this upstream to show it" in rec.cache_evidence
        else:
            assert rec.reprefill_cause == want.get("cause"), said
            if want.get("at"):
                assert rec.reprefill_at is not None and rec.reprefill_at.startswith(want["at"]), said
    elif aspect == "alarms":
        must = set(want.get("must_name") or ())
        allowed = must | set(want.get("may_name") or ())
        if want.get("role") == "turn" and want.get("cause") not in (None, "cache_system_only"):
            allowed |= {"prompt_prefix_changed", "prefix_cache_miss"}  # (a server keeping its system prompt: none)
        assert must <= set(rec.anomalies) | {rec.reprefill_cause}, said
        assert set(rec.anomalies) <= allowed, said
        assert "cache_evicted" not in (*rec.anomalies, rec.reprefill_cause), said
    else:  # lost
        expect = float(want["lost_s"])
        got = rec.reprefill_lost_s
        if (name, n) in FIRST_SHOWN:
            assert got is None, said
            return
        if (name, n) in UNCERTAIN:
            # no figure, both bounds said, the truth one of them
            assert got is None and rec.cache_evidence is not None, said
            assert "the seconds are uncertain" in rec.cache_evidence, said
            assert expect == 0.0 and "0 s where it keeps only the system prompt" in rec.cache_evidence, said
            return
        assert got is not None, said
        if expect == 0.0:
            assert got == 0.0, said
        elif name in NOISY_LOSS:
            measured = [
                float(e.expected["lost_s"])
                for e in s.turns
                if e.expected.get("cause") == want.get("cause") and e.expected.get("lost_s")
            ]
            assert min(measured) <= got <= max(measured), (said, measured)
        else:
            assert abs(got - expect) <= 0.2 * expect, said


def test_every_session_has_turns_and_truth() -> None:
    """The fixtures are there and each has its truth (a lost folder would silently test nothing)."""
    assert len(SESSIONS) >= 6, sorted(SESSIONS)
    clients = {s.client.removesuffix("-billing").removesuffix("-billing-off") for s in SESSIONS.values()}
    assert {"claude-code", "codex", "aider", "opencode"} <= clients, clients
    for s in SESSIONS.values():
        assert len(s.turns) >= 3, s.name
        assert all(e.truth.get("server") for e in s.turns), s.name


@pytest.mark.parametrize("name", sorted(SESSIONS))
def test_the_offline_replay_measures_what_the_proxy_measured(name: str) -> None:
    """The harness is faithful: fed the recorded upstream bytes at their recorded times, the meter
    finds the TTFT, prompt, cached and output counts the live proxy wrote when it was recorded
    (``records.jsonl``; its verdicts may differ: they are what the core then said)."""
    s = SESSIONS[name]
    live = {}
    for line in (s.folder / "records.jsonl").read_text().splitlines():
        d = json.loads(line)
        live[d["id"]] = d
    ids = {e["n"]: e["request_id"] for e in json.loads((s.folder / "session.json").read_text())["exchanges"]}
    got = records(name)
    assert got, name
    for n, rec in got.items():
        d = live[ids[n]]
        assert (rec.prompt_tokens, rec.cached_tokens, rec.completion_tokens) == (
            d["prompt_tokens"],
            d["cached_tokens"],
            d["completion_tokens"],
        ), (name, n)
        if d["ttft_s"] is None:  # (a request the server failed before its first token)
            assert rec.ttft_s is None and rec.outcome == d["outcome"], (name, n)
            continue
        assert rec.ttft_s is not None
        assert abs(rec.ttft_s - d["ttft_s"]) < 0.05, (name, n, rec.ttft_s, d["ttft_s"])


def test_aider_on_vllm_mlx_costs_nothing_once_the_proxy_has_seen_its_cache() -> None:
    """The Aider session recorded on its own (a loaded machine: its TTFTs show ~0.06 s of history
    re-prefilled per turn, `UNCERTAIN` without evidence) judged as a proxy that had first seen the
    OpenCode session with a pasted document on the same server would judge it: both were recorded
    on vllm-mlx 0.6.0 in its default configuration (the system-prompt cache), through different
    proxies; replayed here through one prefix index. The rewrite then costs 0 s, and says why."""
    aider, before = SESSIONS["aider_0.86.2__vllm-mlx"], SESSIONS["opencode-paste_1.18.33__vllm-mlx"]
    recs = replay(aider, before=(before,))
    for ex in aider.turns[1:]:
        rec = recs[ex.n]
        assert (rec.reprefill_cause, rec.reprefill_lost_s) == ("history_rewritten", 0.0), rec.cache_evidence
        assert rec.cache_evidence is not None
        assert "this server reused only the system prompt on 3 earlier turns" in rec.cache_evidence
        assert not {"prompt_prefix_changed", "prefix_cache_miss"} & set(rec.anomalies)
        assert float(ex.expected["lost_s"]) == 0.0  # the truth: vllm-mlx prefilled the history anyway


def _with_ttft(s: Session, n: int, ttft: float) -> Session:
    """``s`` as if exchange ``n``'s first token had come at ``ttft`` s (every byte after the response
    head that much later, every later exchange sent that much later): the same bytes, another
    machine's timing."""
    ex = next(e for e in s.exchanges if e.n == n)
    delta = ttft - float(ex.truth["ttft_s"])
    slowed = []
    for e in s.exchanges:
        if e.n == n:
            marks = tuple((off, t + delta if off > 0 else t) for off, t in e.upstream_marks)
            end = e.t_end + delta if e.t_end is not None else None
            e = dataclasses.replace(e, upstream_marks=marks, t_end=end)
        elif e.t_sent > ex.t_sent:
            e = dataclasses.replace(e, t_sent=e.t_sent + delta)
        slowed.append(e)
    return dataclasses.replace(s, exchanges=tuple(slowed))


PASTE = "opencode-paste_1.18.33__vllm-mlx"
#: the full runs where the OpenCode-then-Aider live test failed: OpenCode's turn 2 (79,299 prompt
#: tokens, 17,096 of them the system part) came in 2.86 s, as slow as a cold prefill, while vllm-mlx
#: logged its usual HIT of the system part (``System KV cache HIT: reusing 17096 tokens``)
SLOW_TURN_S = 2.86


def test_a_first_system_only_turn_as_slow_as_cold_is_undecided_not_an_eviction() -> None:
    """OpenCode's session with a pasted document, its turn 2 as slow as in the failed runs (2.86 s,
    cold turn 1 2.26 s at 35,000 tok/s): a hit of the system part only would predict ~1.78 s (0.78 of
    a cold prefill), too near a cold prefill for any TTFT to tell the two, so nothing names an
    eviction; the turn still shows the messages prefilled again, so from turn 3 the upstream is known
    to keep the system prompt only (`cache_system_only`), and Aider's history rewrites after it cost
    0 s with that evidence."""
    paste = _with_ttft(SESSIONS[PASTE], 4, SLOW_TURN_S)
    recs = replay(paste)
    slow = recs[4]
    assert slow.ttft_s == pytest.approx(SLOW_TURN_S, abs=0.01)
    assert slow.reprefill_cause is None and not set(slow.anomalies) & set(PREFIX_ANOMALIES), slow.anomalies
    ev = slow.cache_evidence or ""
    assert "tells neither whether the system part (~17" in ev, ev
    assert "too near a cold prefill" in ev and "no eviction named" in ev, ev
    assert "the first turn on this upstream to show it" in ev, ev
    for n in (5, 6):  # turns 3 and 4: the loss named, no alarm
        assert recs[n].reprefill_cause == "cache_system_only", recs[n].cache_evidence
        assert not set(recs[n].anomalies) & set(PREFIX_ANOMALIES), recs[n].anomalies
    aider = SESSIONS["aider-after-paste_0.86.2__vllm-mlx"]
    after = replay(aider, before=(paste,))
    for ex in aider.turns[1:]:
        rec = after[ex.n]
        assert (rec.reprefill_cause, rec.reprefill_lost_s) == ("history_rewritten", 0.0), rec.cache_evidence
        assert "this server reused only the system prompt on 3 earlier turns" in (rec.cache_evidence or "")


def test_a_slow_system_only_turn_on_an_upstream_known_so_names_the_loss() -> None:
    """The same slow TTFT on turn 4, once turns 2 and 3 have shown the cache keeping the system prompt
    only: the messages' loss is `cache_system_only` with its seconds, no eviction."""
    recs = replay(_with_ttft(SESSIONS[PASTE], 6, SLOW_TURN_S))
    slow = recs[6]
    assert slow.reprefill_cause == "cache_system_only" and not set(slow.anomalies) & set(PREFIX_ANOMALIES)
    assert "tells neither whether the system part" in (slow.cache_evidence or ""), slow.cache_evidence
    assert slow.reprefill_lost_s is not None and 0.5 < slow.reprefill_lost_s < SLOW_TURN_S


def test_an_eviction_that_left_nothing_is_still_named_where_the_ttft_tells() -> None:
    """OpenCode's plain session on vllm-mlx (a 17,092-token system part of ~17,150: a hit of it leaves
    ~0.002 s to prefill), its turn 3 as slow as its cold turn 1 (0.83 s), as after a server restart:
    a hit of the system part could not take that long, so the whole prompt was prefilled again:
    `cache_evicted` with its seconds (the issue: "the eviction after a server restart named with 2.64 s
    lost of 2.68 s")."""
    s = SESSIONS["opencode_1.18.33__vllm-mlx"]
    cold = float(s.turns[0].truth["ttft_s"])
    recs = replay(_with_ttft(s, 4, cold))
    rec = recs[4]
    assert rec.reprefill_cause == "cache_evicted" and "prefix_cache_miss" in rec.anomalies, rec.cache_evidence
    assert rec.reprefill_lost_s is not None and 0.8 * cold <= rec.reprefill_lost_s <= cold
    assert recs[3].reprefill_cause is None and recs[5].reprefill_cause is None  # its neighbours: hits
