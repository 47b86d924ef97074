"""The live page's conversations panel, in a real headless Chromium (tests/browser.py): two
scripted agents through the proxy against the simulator's prompt cache, one with a volatile
header line in its system prompt. The panel shows each conversation's turns with the figures
`/sessions` gives, the cause and place of every re-prefill, and the seconds lost."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from browser import Chromium, require_chromium
from mlxproxy.config import build_config
from mlxproxy.edge.runner import ServerThread
from mlxproxy.proxy.app import create_app
from mlxproxy.sim.agent import Agent, AgentKnobs
from mlxproxy.sim.app import create_app as create_sim
from support import CLAUDE_UA, read_fixture, wait_for


@pytest.fixture(scope="module")
def chromium() -> Iterator[Chromium]:
    require_chromium()
    with Chromium() as c:
        yield c


def run_agent(url: str, agent: Agent, turns: int, user_agent: str | None = None) -> None:
    with httpx.Client(timeout=30, headers={"user-agent": user_agent} if user_agent else None) as c:
        for t in range(1, turns + 1):
            with c.stream("POST", url + "/v1/chat/completions", json=agent.request(t)) as r:
                assert r.status_code == 200
                events = [
                    orjson.loads(x[6:]) for x in b"".join(r.iter_bytes()).split(b"\n\n") if x.startswith(b"data: {")
                ]
            agent.answered("".join((e["choices"] or [{}])[0].get("delta", {}).get("content") or "" for e in events))


def test_conversations_panel_matches_sessions(chromium: Chromium, tmp_path: Path) -> None:
    artifacts = Path(os.environ.get("MLXPROXY_TEST_ARTIFACTS") or tmp_path)
    # (also: the client of each conversation, its seconds lost and fix, and the side requests apart: issue 36)
    artifacts.mkdir(parents=True, exist_ok=True)
    with ServerThread(create_sim("healthy", speed=5.0, prompt_cache=True)) as sim:
        app = create_app(build_config(None, upstream_url=sim.url, log_requests=False))
        with ServerThread(app) as px:
            run_agent(px.url, Agent("Fix the flaky test."), 4)
            run_agent(px.url, Agent("Port the parser.", knobs=AgentKnobs(volatile_header=True)), 4, CLAUDE_UA)
            # side requests: OpenCode's title request (its real bytes) and Claude Code's probe
            head, _, body = read_fixture("clients/opencode_1.18.33_title.req").partition(b"\r\n\r\n")
            ua = next(v for k, _, v in (h.partition(b": ") for h in head.split(b"\r\n")) if k.lower() == b"user-agent")
            title = {**orjson.loads(body), "model": "default_model", "max_tokens": 8}
            assert httpx.post(
                px.url + "/v1/chat/completions", json=title, headers={"user-agent": ua.decode()}
            ).is_success
            httpx.head(px.url + "/api/hello", headers={"user-agent": CLAUDE_UA})
            assert wait_for(lambda: len(app.recent.records) == 10)
            answer = httpx.get(px.url + "/sessions").json()
            sessions, side = answer["sessions"], answer["side_requests"]
            page = chromium.page()
            page.goto(px.url + "/")
            page.wait_for("document.querySelectorAll('#conversations tr.turn').length === 8")
            page.wait_for("document.querySelectorAll('#side tbody tr').length === 2")
            assert page.eval("document.querySelector('#conversation-count').textContent") == "2"
            heads = page.eval("[...document.querySelectorAll('#conversations tr.conv')].map(tr => tr.textContent)")
            rows = page.eval(
                "[...document.querySelectorAll('#conversations tr.turn')].map(tr => [tr.dataset.id,"
                " [...tr.querySelectorAll('td')].map(td => td.textContent)])"
            )
            fixes = page.eval("[...document.querySelectorAll('#conversations tr.fix')].map(tr => tr.textContent)")
            sides = page.eval(
                "[...document.querySelectorAll('#side tbody tr')].map(tr => [...tr.querySelectorAll('td')]"
                ".map(td => td.textContent))"
            )
            page.eval("document.querySelector('#conversations').scrollIntoView()")
            shot = page.screenshot(artifacts / "live-page-conversations.png")
            print(f"\nscreenshot: {shot}")
    assert [s["turns"] for s in sessions] == [4, 4]  # the side requests took no turn and made no conversation
    volatile, clean = sessions  # most recent first
    assert volatile["client"] == "Claude Code 2.1.332" and clean["client"].startswith("python-httpx ")
    assert volatile["fix_cause"] == "volatile_span" and "CLAUDE_CODE_ATTRIBUTION_HEADER=0" in volatile["fix"]
    assert clean["fix"] is None
    assert [(s["side_request"], s["client"]) for s in side] == [
        ("probe", "Claude Code 2.1.332"),
        ("title", "OpenCode 1.18.33"),
    ]
    # the panel: the client in the heading, one line with the seconds lost and the fix, side requests apart
    assert "4 turnsClaude Code 2.1.332 · m @ default" in heads[0] and "4 turnspython-httpx " in heads[1]
    assert fixes == [f"{volatile['lost_s']:.2f} s lost to volatile_span. Fix: {volatile['fix']}"]
    assert [c[1:4] for c in sides] == [
        ["Claude Code 2.1.332", "probe", "HEAD /api/hello"],
        ["OpenCode 1.18.33", "title", "POST /v1/chat/completions"],
    ]
    assert volatile["lost_by_cause"].keys() == {"volatile_span"} and volatile["lost_s"] > 0.1
    assert clean["lost_s"] == 0 and clean["misses"] == 0
    # the panel: the most recent conversation first, its lost seconds and cause in its heading
    assert heads[0].startswith(f"{volatile['conversation_id']} · 4 turns") and "volatile_span" in heads[0]
    assert f"{volatile['lost_s']:.2f}" in heads[0] and "volatile_span" not in heads[1]
    by_id = dict(rows)
    for s in sessions:
        for t in s["turn_list"]:
            cells = by_id[t["id"]]
            assert cells[0].startswith(f"turn {t['turn']} ")
            assert cells[2:5] == [
                str(t["prompt_tokens"]),
                str(t["prefix_reusable_tokens"] or "–"),
                str(t["cached_tokens"]),
            ]
            assert cells[7] == (t["reprefill_cause"] or "") and cells[8] == (t["reprefill_at"] or "")
    assert all(by_id[t["id"]][8].endswith("a=<hex:5>;") for t in volatile["turn_list"][1:])


def test_a_system_only_cache_on_the_page(chromium: Chromium, tmp_path: Path) -> None:
    """The recorded OpenCode session on vllm-mlx 0.6.0 (its default cache keeps the system prompt
    only), as the proxy judged it: `/sessions` and the panel give the seconds lost to
    `cache_system_only` and its fix in one line, each named turn its cause and no alarm of a miss."""
    from mlxproxy.core.fixes import FIXES
    from sessions import load_sessions, replay

    (paste,) = [s for s in load_sessions() if s.name == "opencode-paste_1.18.33__vllm-mlx"]
    recs = sorted(replay(paste).values(), key=lambda r: r.started_at)
    app = create_app(build_config(None, upstream_url="http://127.0.0.1:9", log_requests=False))
    for rec in recs:
        app.recent.on_record(rec)
    with ServerThread(app) as px:
        answer = httpx.get(px.url + "/sessions").json()
        page = chromium.page()
        page.goto(px.url + "/")
        page.wait_for("document.querySelectorAll('#conversations tr.turn').length === 4")
        fixes = page.eval("[...document.querySelectorAll('#conversations tr.fix')].map(tr => tr.textContent)")
        causes = page.eval(
            "[...document.querySelectorAll('#conversations tr.turn')].map(tr => tr.querySelectorAll('td')[7].textContent)"
        )
        page.eval("document.querySelector('#conversations').scrollIntoView()")
        shots = Path(os.environ.get("MLXPROXY_TEST_ARTIFACTS") or tmp_path)
        shots.mkdir(parents=True, exist_ok=True)
        print(f"\nscreenshot: {page.screenshot(shots / 'live-page-system-only.png')}")
        assert page.errors == [], page.errors
    (conv,) = answer["sessions"]
    named = [r for r in recs if r.reprefill_cause == "cache_system_only"]
    lost = sum(r.reprefill_lost_s or 0.0 for r in named)
    assert conv["client"] == "OpenCode 1.18.33" and conv["fix_cause"] == "cache_system_only"
    assert conv["fix"] == FIXES["cache_system_only"] and conv["lost_s"] == pytest.approx(lost, abs=1e-3)
    assert fixes == [f"{conv['lost_s']:.2f} s lost to cache_system_only. Fix: {FIXES['cache_system_only']}"]
    assert sorted(causes) == ["", "", "cache_system_only", "cache_system_only"]
    assert not any("prefix_cache_miss" in r.anomalies for r in recs)
