"""`replay --sessions N --fix` (load/fixreplay.py): the fix transforms on request bodies, and
a captured session with a per-turn volatile system line replayed as captured and with the fix
against the simulator's prompt cache: the fixed run's later turns reuse the cache, and the
seconds saved are printed per turn and per session."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import orjson
from click.testing import CliRunner

from mlxproxy.cli import main
from mlxproxy.edge.runner import ServerThread
from mlxproxy.load.commands.fixreplay import fix_conversation
from mlxproxy.sim.app import create_app as create_sim
from support import volatile_session_capture

CLAUDE_UA_NAME = "Claude Code 2.1.332"


def _tool(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}


def test_fix_pins_the_system_prompt_and_orders_the_tools() -> None:
    turns = [
        {
            "system": [{"type": "text", "text": f"billing: cch={k:05x};"}, {"type": "text", "text": "You are..."}],
            "messages": [{"role": "user", "content": "hi"}] * (k + 1),
            "tools": [_tool("a"), _tool("b"), _tool("c")] if k != 1 else [_tool("c"), _tool("d"), _tool("a")],
        }
        for k in range(3)
    ]
    fixed, applied = fix_conversation(turns)
    assert fixed[0] == turns[0]
    assert all(f["system"] == turns[0]["system"] for f in fixed)
    assert [t["function"]["name"] for t in fixed[1]["tools"]] == ["a", "c", "d"]  # turn 1's order, new ones after
    assert [f["messages"] for f in fixed] == [t["messages"] for t in turns]  # nothing else changes
    assert applied == {"system prompt pinned to turn 1's": 2, "tools in turn 1's order": 1}
    # leading system messages of a chat request, a Responses `instructions`
    chat = [
        {"messages": [{"role": "system", "content": f"id {k}\nrules"}, {"role": "user", "content": "x"}]}
        for k in (1, 2)
    ]
    out, applied = fix_conversation(chat)
    assert out[1]["messages"][0]["content"] == "id 1\nrules" and applied["system prompt pinned to turn 1's"] == 1
    resp = [{"instructions": f"now {k}", "input": "x"} for k in (1, 2)]
    assert fix_conversation(resp)[0][1]["instructions"] == "now 1"
    # a conversation whose system prompt moved (added on turn 2) is left alone
    moved = [{"messages": [{"role": "user", "content": "x"}]}, {"messages": [{"role": "system", "content": "s"}]}]
    assert fix_conversation(moved)[0] == moved


def test_fix_replay_against_a_caching_server(tmp_path: Path) -> None:
    cap, out = tmp_path / "cap.jsonl", tmp_path / "out.json"
    volatile_session_capture(cap, "default_model")
    with ServerThread(create_sim("healthy", speed=4.0, prompt_cache=True, prefill_tps=300.0)) as sim:
        args = ["replay", str(cap), "--target", f"sim={sim.url}", "--sessions", "1", "--fix", "--think-time", "0"]
        res = CliRunner().invoke(main, [*args, "--json", str(out)])
    assert res.exit_code == 0, res.output
    groups = orjson.loads(out.read_bytes())["groups"]
    assert [g["name"] for g in groups] == ["sessions 1", "sessions 1, fix applied"]
    captured, fixed = groups
    # as captured: every later turn re-prefilled, named with Claude Code's own fix
    later = [r for r in captured["records"] if r["turn"] >= 1]
    assert {r["reprefill_cause"] for r in later} == {"volatile_span"}
    assert all(r["client"] == "Claude Code 2.1.332" for r in captured["records"])
    assert all("CLAUDE_CODE_ATTRIBUTION_HEADER=0" in r["reprefill_fix"] for r in later)
    # with the fix: no cause, later turns served from the cache
    assert not any(r["reprefill_cause"] for r in fixed["records"])
    fix = fixed["summary"]["fix"]
    assert fix["applied"] == {"system prompt pinned to turn 1's": 3, "tools in turn 1's order": 0}
    (session,) = fix["sessions"]
    assert [t["turn"] for t in session["turns"]] == [1, 2, 3, 4]
    assert all(t["saved_s"] > 0 for t in session["turns"][1:])
    assert session["later_turns_speedup"] >= 2.0
    assert abs(session["saved_s"] - sum(t["saved_s"] for t in session["turns"])) < 1e-3
    # printed: per turn and per session
    assert "fix replay: system prompt pinned to turn 1's on 3 turns" in res.output
    assert f"session 0: {session['saved_s']:.3f} s saved; turns >= 2 " in res.output
    assert "volatile_span: set CLAUDE_CODE_ATTRIBUTION_HEADER=0" in res.output


def test_fix_needs_sessions(tmp_path: Path) -> None:
    cap = tmp_path / "cap.jsonl"
    volatile_session_capture(cap, "m", turns=1)
    res = CliRunner().invoke(main, ["replay", str(cap), "--target", "http://127.0.0.1:9", "--fix"])
    assert res.exit_code != 0 and "--fix replays conversations: use it with --sessions N" in res.output


def test_fix_replay_html_report_in_browser(tmp_path: Path) -> None:
    """The HTML report of a fix replay, in the real headless Chromium: each session's client,
    its seconds lost and the fix in one line, the side request apart, the seconds the fix saved."""
    from browser import Chromium, require_chromium

    require_chromium()
    cap, html, js = tmp_path / "cap.jsonl", tmp_path / "r.html", tmp_path / "r.json"
    volatile_session_capture(cap, "default_model", quota=True)
    with ServerThread(create_sim("healthy", speed=4.0, prompt_cache=True, prefill_tps=300.0)) as sim:
        args = ["replay", str(cap), "--target", f"sim={sim.url}", "--sessions", "1", "--fix", "--think-time", "0"]
        res = CliRunner().invoke(main, [*args, "--html", str(html), "--json", str(js)])
    assert res.exit_code == 0, res.output
    captured, fixed = orjson.loads(js.read_bytes())["groups"]
    quota = [r for r in captured["records"] if r["side_request"]]
    assert [(r["side_request"], r["client"], r["conversation_id"]) for r in quota] == [("quota", CLAUDE_UA_NAME, None)]
    lost = sum(r["reprefill_lost_s"] or 0 for r in captured["records"])
    shots = Path(os.environ.get("MLXPROXY_TEST_ARTIFACTS") or tmp_path)
    shots.mkdir(parents=True, exist_ok=True)
    with Chromium() as chromium:
        page = chromium.page(offline=True)
        page.goto(html.resolve().as_uri())
        section = "document.querySelector('#sessions')"
        heads = page.eval(f"[...{section}.querySelectorAll('tr.conv')].map(tr => tr.textContent)")
        text = page.eval(f"{section}.textContent")
        page.eval(f"{section}.scrollIntoView()")
        print(f"\nscreenshot: {page.screenshot(shots / 'report-sessions-fix.png')}")
        assert page.errors == [], page.errors
    fix = fixed["summary"]["fix"]
    # the captured run: client, turns, seconds lost and the fix in one line
    assert heads[0] == (
        f"session 0 · {CLAUDE_UA_NAME} · 4 turns · {lost:.2f} s lost to volatile_span. "
        f"Fix: {captured['records'][1]['reprefill_fix']}"
    )
    assert f"session 0 · {CLAUDE_UA_NAME} · 4 turns · 0 s lost" in heads  # the fixed run
    assert "side requests (1): kept out of the sessions and their turns" in text and "quota" in text
    assert [s["session"] for s in fix["sessions"]] == [0]  # the side request is no session of the fix's
    assert f"session 0: {fix['sessions'][0]['saved_s']:.3f} s saved · turns ≥ 2" in text
    assert (
        f"the fix, replayed: system prompt pinned to turn 1's on 3 turns; {fix['saved_s']:.3f} s saved in all" in text
    )


def test_a_server_side_cause_is_printed_not_replayed() -> None:
    """A cache that keeps only the system prompt (vllm-mlx's default: `cache_system_only`) is the
    server's setting: no body rewrite fixes it. A fix replay of such a session changes no body,
    so its lines say the two runs differ run to run (no "saved"), and print the fix as not replayed;
    a fix the replay applies keeps its plain line."""
    from mlxproxy.core.fixes import FIXES
    from mlxproxy.load.commands.fixreplay import fix_lines

    savings = {
        "sessions": [
            {
                "session": 0,
                "turns": [{"turn": 1, "ttft_captured_s": 2.2, "ttft_fixed_s": 2.1, "saved_s": 0.1}],
                "saved_s": 0.1,
                "later_turns_speedup": None,
            }
        ],
        "saved_s": 0.1,
    }
    fixes = [("cache_system_only", FIXES["cache_system_only"]), ("volatile_span", FIXES["volatile_span"])]
    lines = fix_lines(savings, {"system prompt pinned to turn 1's": 0}, fixes)
    text = "\n".join(lines)
    assert "the bodies needed no change" in lines[0]
    assert "saved" not in text.replace("no change", "")
    assert "session 0: 0.100 s apart (the same bodies sent again: not a saving)" in lines
    assert "all sessions: 0.100 s apart, run to run (nothing was fixed)" in lines
    assert (
        f"cache_system_only: {FIXES['cache_system_only']} (not replayed: the server's setting, which the same "
        "request bodies sent again cannot apply)" in lines
    )
    assert f"volatile_span: {FIXES['volatile_span']}" in lines


def test_the_report_shows_a_system_only_cache_with_its_seconds_and_fix() -> None:
    """The HTML report's sessions view on the recorded OpenCode session on vllm-mlx 0.6.0 (its
    default cache keeps the system prompt only): the session's heading gives the seconds lost to
    `cache_system_only` and its fix in one line, each named turn its cause and seconds."""
    from html import escape

    from mlxproxy.core.fixes import FIXES
    from mlxproxy.load.data.results import Group, ResultFile, RunRecord, SessionTurn
    from mlxproxy.load.output.report import summarize_records
    from mlxproxy.load.output.sessions_view import sessions_html
    from sessions import load_sessions, replay

    (paste,) = [s for s in load_sessions() if s.name == "opencode-paste_1.18.33__vllm-mlx"]
    recs = [r for r in replay(paste).values() if r.outcome == "ok"]
    rows = tuple(RunRecord(r, where=None if r.side_request else SessionTurn(0, i, 0.0)) for i, r in enumerate(recs))
    group = Group("sessions 1", "vllm-mlx", "sessions", "sessions", {}, summarize_records(recs), rows)
    html = sessions_html([("run", ResultFile.new("replay", [group]))], lambda label, target: target)
    named = [r for r in recs if r.reprefill_cause == "cache_system_only"]
    assert len(named) == 2
    lost = sum(r.reprefill_lost_s or 0.0 for r in named)
    head = f"session 0 · OpenCode 1.18.33 · 4 turns · {lost:.2f} s lost to cache_system_only.</b>"
    assert head in html and f'<span class="fix">Fix: {escape(FIXES["cache_system_only"])}</span>' in html
    for r in named:
        assert f'<td class="num">{r.reprefill_lost_s:.3f}</td><td>cache_system_only</td>' in html
