"""Real agent sessions are the oracle (issue 36): each recorded session (Claude Code, Codex, Aider,
OpenCode, Qwen Code, llm; ``tests/fixtures/sessions/``) replayed offline through the proxy's
finishing path at its recorded times (``sessions.replay``), and its records held to the session's
truth table (``truth.json``: the server's own log or cached count, and what the request bytes show
turn to turn):

* grouping: every turn of the session is one conversation, numbered 1, 2, 3, ... in order; side
  requests (OpenCode's title, Qwen Code's memory extraction) are kept out of it;
* cause: each turn's re-prefill cause and where it diverges, as the bytes show it (none for a turn
  that extends the previous one as the server renders it);
* alarms: no anomaly on a healthy turn (0 false alarms); where the server hit its cache but
  reported 0 cached tokens, ``cached_tokens_unreported`` and never ``cache_evicted``;
* lost: where a cause cost the server a re-prefill, the seconds the record says were lost within
  20% of the measured TTFT difference (this turn's TTFT minus the same prompt's warm TTFT); where the
  server neutralized it (vllm-mlx strips Claude Code's billing line), 0 s.

The cases today's core gets wrong are marked ``xfail(strict=True)`` in :data:`KNOWN_WRONG`, each
with what it says instead, so they turn into failures ("XPASS(strict)") the day they are fixed and
the mark must go.
"""

from __future__ import annotations

import functools
import json

import pytest

from mlxproxy.core.record import Record
from sessions import Exchange, Session, load_sessions, replay

SESSIONS = {s.name: s for s in load_sessions()}
PREFIX_ANOMALIES = ("prompt_prefix_changed", "prefix_cache_miss", "cache_evicted")
ASPECTS = ("grouping", "cause", "alarms", "lost")

#: (session, exchange, aspect) -> what today's core does instead (the xfail reason)
KNOWN_WRONG: dict[tuple[str, int, str], str] = {
    **{
        ("aider_0.86.2__vllm-mlx", n, "alarms"): "the hidden hit is vllm-mlx's 624 system tokens, under "
        "prefix_min_tokens: not judged, no cached_tokens_unreported (and turns 3-4's TTFTs, 0.160 and 0.196 s, "
        "are within 20% of a cold prefill of the whole prompt at turn 1's rate: no timing shows that hit)"
        for n in (2, 3, 4)
    },
    **{
        ("aider_0.86.2__vllm-mlx", n, "lost"): "vllm-mlx caches the system prompt only and prefills the history "
        "anyway; the core models a prefix cache and counts the ~500 re-prefilled history tokens as lost "
        "(0.06 s each at turn 1's 8,270 tok/s, not 0): no turn of the session extends the previous one, so "
        "nothing in it tells a system-prompt cache from a prefix cache"
        for n in (2, 3, 4)
    },
    **{
        ("claude-code-billing_2.1.332__mlx-lm+litellm", n, "lost"): "lost 3.04, 3.05, 3.06 s (~9,750 tokens at "
        "turn 1's 3,203 tok/s; the TTFT share says 7.2, 4.0, 5.3 s) against 5.27, 1.76, 1.92 s measured (the "
        "session's TTFT minus the same prompt's warm TTFT, taken later: 1.9, 2.2, 4.3 s); calibration.json's cold "
        "runs re-prefilled ~9,850 tokens each (their tools cached) in 8.5, 11.5, 5.0 s over warm: on this loaded "
        "machine the same work varied 6x, and no one rate is within 20% of all three"
        for n in (2, 3, 4)
    },
}


@functools.cache
def records(name: str) -> dict[int, Record]:
    return replay(SESSIONS[name])


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
        if want["role"] == "side":
            assert rec.conversation_id is None or rec.conversation_id != main, said
        else:
            assert (rec.conversation_id, rec.turn) == (main, want["turn"]), said
    elif aspect == "cause":
        if want["role"] == "side" or want.get("turn") == 1:
            assert rec.reprefill_cause is None, said
        else:
            assert rec.reprefill_cause == want.get("cause"), said
            if want.get("at"):
                assert rec.reprefill_at is not None and rec.reprefill_at.startswith(want["at"]), said
    elif aspect == "alarms":
        must = set(want.get("must_name") or ())
        allowed = must | set(want.get("may_name") or ())
        if want.get("role") == "turn" and want.get("cause") is not None:
            allowed |= {"prompt_prefix_changed", "prefix_cache_miss"}
        assert must <= set(rec.anomalies) | {rec.reprefill_cause}, said
        assert set(rec.anomalies) <= allowed, said
        assert "cache_evicted" not in (*rec.anomalies, rec.reprefill_cause), said
    else:  # lost
        expect = float(want["lost_s"])
        got = rec.reprefill_lost_s
        assert got is not None, said
        if expect == 0.0:
            assert got == 0.0, said
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
        assert rec.ttft_s is not None and d["ttft_s"] is not None
        assert abs(rec.ttft_s - d["ttft_s"]) < 0.05, (name, n, rec.ttft_s, d["ttft_s"])
