"""The fix, proven by replay, against a real ``mlx_lm.server`` (issue 36, "Done when").

A captured Claude-Code-like session (its User-Agent; a per-turn hex value on system line 1, the
billing line's shape; a growing history) replayed with ``mlxproxy replay --sessions 1 --fix``:
as captured, every later turn re-prefills the whole prompt (``volatile_span``, named with Claude
Code's own fix, ``CLAUDE_CODE_ATTRIBUTION_HEADER=0``); with the fix (the system prompt pinned to
its first turn's) the server reuses its prompt cache and turns >= 2 reach their first token at
least 2x faster; the seconds saved are printed per turn and per session.

Skipped, with the reason, where the mlx stack does not import.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

from support import volatile_session_capture

from .peers import REPO, loopback_env, require_mlx
from .tinymodel import MODEL_NAME

pytestmark = pytest.mark.integration

require_mlx()

TURNS = 4
WORDS = 120  # a system prompt of ~700 tokens: a re-prefill that dwarfs the new tokens of a turn


def test_fix_replay_turns_later_turns_into_cache_hits(mlx_server: str, tmp_path: Path, record_property: Any) -> None:
    cap, out = tmp_path / "session.jsonl", tmp_path / "fix.json"
    volatile_session_capture(cap, MODEL_NAME, turns=TURNS, words=WORDS, max_tokens=4)
    res = subprocess.run(
        [sys.executable, "-m", "mlxproxy", "replay", str(cap), "--target", f"mlx-lm={mlx_server}",
         "--sessions", "1", "--fix", "--think-time", "0", "--json", str(out)],
        capture_output=True, text=True, timeout=300, env=loopback_env(), stdin=subprocess.DEVNULL, cwd=REPO,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    print(res.stdout[res.stdout.index("fix replay:") :])
    captured, fixed = orjson.loads(out.read_bytes())["groups"]
    assert fixed["name"] == "sessions 1, fix applied"
    rows = [
        (r["turn"], r["prompt_tokens"], r["cached_tokens"], r["ttft_s"], r["reprefill_cause"])
        for r in captured["records"]
    ]
    rows += [
        (r["turn"], r["prompt_tokens"], r["cached_tokens"], r["ttft_s"], r["reprefill_cause"]) for r in fixed["records"]
    ]
    record_property("turns", rows)
    assert captured["records"][0]["prompt_tokens"] > 600
    # as captured: the later turns re-prefill, named with Claude Code's setting
    for r in captured["records"][1:]:
        assert r["reprefill_cause"] == "volatile_span", r
        assert r["client"] == "Claude Code 2.1.332" and "CLAUDE_CODE_ATTRIBUTION_HEADER=0" in r["reprefill_fix"]
    # with the fix: the server reuses the previous turn's prompt, no cause
    for r in fixed["records"][1:]:
        assert r["reprefill_cause"] is None and r["cached_tokens"] > 0.8 * captured["records"][0]["prompt_tokens"], r
    fix = fixed["summary"]["fix"]
    (session,) = fix["sessions"]
    record_property("fix", fix)
    later = session["turns"][1:]
    # every later turn at least 2x faster to first token, and the saving printed per turn and session
    assert all(t["ttft_captured_s"] >= 2 * t["ttft_fixed_s"] for t in later), later
    assert session["later_turns_speedup"] >= 2.0
    for t in session["turns"]:
        assert (
            f"{t['turn']:>4}  {t['ttft_captured_s']:>16.3f}  {t['ttft_fixed_s']:>13.3f}  {t['saved_s']:>7.3f}"
            in res.stdout
        )
    assert (
        f"session 0: {session['saved_s']:.3f} s saved; turns >= 2 {session['later_turns_speedup']:g}x faster"
        in res.stdout
    )
    assert "volatile_span: set CLAUDE_CODE_ATTRIBUTION_HEADER=0" in res.stdout
