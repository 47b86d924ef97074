"""The cache doctor end to end: a scripted agent (sim/agent.py) through the proxy against the
simulator's prompt cache. Each re-prefill cause and cache-honesty anomaly fires on the knob
that injects it, on exactly the turns it affects, and nowhere else; 200 healthy multi-turn
requests raise none. `/sessions` and `/streams` sum the seconds lost."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from mlxproxy.config import build_config
from mlxproxy.core.prefix import CAUSES
from mlxproxy.core.record import Record
from mlxproxy.edge.runner import ServerThread
from mlxproxy.proxy.app import create_app
from mlxproxy.sim.agent import Agent, AgentKnobs
from mlxproxy.sim.app import create_app as create_sim
from support import wait_for

HONESTY = ("cached_tokens_unreported", "cached_tokens_claimed_cold")
ALL_FINDINGS = (*CAUSES, *HONESTY, "prefix_cache_miss")
# speed 2: a cold prefill of the agent's ~3,000-token prompt takes ~0.75 s, a hit a few ms; the
# timing checks split them at ~0.37 s. (At speed 5, a 0.33 s stall of a loaded 2-core machine once
# made a healthy hit look like a cold prefill.)
SPEED = 2.0


@contextlib.contextmanager
def stack(**knobs: Any) -> Iterator[tuple[str, Any]]:
    sim_app = create_sim("healthy", speed=SPEED, prompt_cache=True, **knobs)
    with ServerThread(sim_app) as sim:
        app = create_app(build_config(None, upstream_url=sim.url, log_requests=False))
        with ServerThread(app) as proxy:
            yield proxy.url, app


def run(url: str, app: Any, agent: Agent, turns: int, client: httpx.Client) -> list[Record]:
    out = []
    for t in range(1, turns + 1):
        with client.stream("POST", url + "/v1/chat/completions", json=agent.request(t)) as r:
            text = b"".join(r.iter_bytes())
            rid = r.headers["x-mlxproxy-request-id"]
        assert wait_for(lambda: any(x.id == rid for x in app.recent.records))  # noqa: B023
        out.append(next(x for x in app.recent.records if x.id == rid))
        agent.answered(
            "".join(
                (orjson.loads(line[6:])["choices"] or [{}])[0].get("delta", {}).get("content") or ""
                for line in text.split(b"\n\n")
                if line.startswith(b"data: {")
            )
        )
    return out


def findings(r: Record) -> set[str]:
    return ({r.reprefill_cause} - {None}) | {a for a in r.anomalies if a in ALL_FINDINGS}


CASES = {
    # name: (simulator knobs, agent knobs, {turn: expected findings}; every other turn: none)
    "volatile header line": ({}, AgentKnobs(volatile_header=True), dict.fromkeys(range(2, 7), {"volatile_span"})),
    "re-ordered tools": ({}, AgentKnobs(reorder_tools_at=3), {3: {"tools_changed"}}),
    "compacted history": ({}, AgentKnobs(compact_at=4), {4: {"history_rewritten"}}),
    "reminder inserted in the system prompt": ({}, AgentKnobs(system_change_at=3), {3: {"system_changed"}}),
    "another model": ({}, AgentKnobs(switch_model_at=4), {4: {"model_changed"}}),
    "eviction": (
        {"cache_drop": "every-other"},
        AgentKnobs(),
        dict.fromkeys((2, 4, 6), {"cache_evicted", "prefix_cache_miss"}),
    ),
    "claims cache, prefills cold": (
        {"cache_report": "claimed-cold"},
        AgentKnobs(),
        dict.fromkeys(range(2, 7), {"cached_tokens_claimed_cold"}),
    ),
    "hides cache hits": (
        {"cache_report": "hidden"},
        AgentKnobs(),
        dict.fromkeys(range(2, 7), {"cached_tokens_unreported"}),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_cause_fires_on_its_knob_and_nowhere_else(case: str) -> None:
    sim_knobs, agent_knobs, expected = CASES[case]
    with stack(**sim_knobs) as (url, app), httpx.Client(timeout=30) as c:
        recs = run(url, app, Agent(f"Fix bug {case}.", knobs=agent_knobs), 6, c)
        sessions = c.get(url + "/sessions").json()["sessions"]
        streams = c.get(url + "/streams").json()
    assert [r.turn for r in recs] == list(range(1, 7)) and len({r.conversation_id for r in recs}) == 1
    assert recs[0].prompt_tokens > 2000
    got = {r.turn: findings(r) for r in recs if findings(r)}
    assert got == expected, {r.turn: (r.reprefill_at, r.anomaly_evidence) for r in recs}
    if case == "volatile header line":
        assert all(r.reprefill_at == "messages[0].content line 1: a-a-a-a: a_a=9.9.99; a=<hex:5>;" for r in recs[1:])
    if case == "reminder inserted in the system prompt":
        assert recs[2].reprefill_at is not None and recs[2].reprefill_at.startswith("messages[0].content char ")
    if case == "another model":
        assert recs[3].reprefill_at == "model m -> m-other" and {r.model for r in recs[3:]} == {"m-other"}
    if case == "hides cache hits":
        assert all(r.prefill_tps is None for r in recs[1:]) and recs[0].prefill_tps is not None
    # the seconds lost: per turn, summed per conversation (/sessions) and per cause (/streams)
    lost = sum(r.reprefill_lost_s or 0 for r in recs)
    (session,) = sessions
    assert session["turns"] == 6 and len(session["turn_list"]) == 6
    assert session["lost_s"] == pytest.approx(lost, abs=1e-3) == pytest.approx(recs[-1].conversation_lost_s, abs=1e-3)
    assert sum(streams["reprefill_lost_s"].values()) == pytest.approx(lost, abs=1e-3)
    causes = {r.reprefill_cause for r in recs} - {None}
    assert set(session["lost_by_cause"]) == causes
    if causes & {"volatile_span", "cache_evicted", "model_changed"}:
        assert lost > 0.3  # each of these re-prefills the system prompt: ~0.75 s here
    elif causes == {"system_changed"}:
        assert 0.15 < lost < 0.6  # the second half of the system prompt: ~0.37 s here
    elif causes:
        assert 0 < lost < 0.1  # the tools and the history come after it: only they are prefilled again


def test_two_hundred_healthy_multi_turn_requests_raise_none() -> None:
    recs: list[Record] = []
    with stack() as (url, app), httpx.Client(timeout=30) as c:
        for group in range(25):  # 25 agents, 8 turns each: 200 requests
            recs += run(url, app, Agent(f"Task number {group}: update the docs."), 8, c)
        metrics = c.get(url + "/metrics").text
    assert len(recs) == 200 and len({r.conversation_id for r in recs}) == 25
    assert not [(r.turn, r.reprefill_cause, r.anomaly_evidence) for r in recs if findings(r)]
    assert all(r.cache_hit_ratio is None or r.cache_hit_ratio <= 1 for r in recs)
    lost = [x for x in metrics.splitlines() if x.startswith("mlxproxy_reprefill_lost_seconds_total{")]
    assert len(lost) == len(CAUSES) and all(float(x.split()[-1]) == 0 for x in lost)


def test_sessions_needs_the_key_and_checks_its_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CACHE_DOCTOR_TEST_KEY", "pk-sessions-7c1e")
    with ServerThread(create_sim("healthy", speed=50.0)) as sim:
        raw = {"upstreams": [{"name": "sim", "url": sim.url}], "proxy_api_key_env": "CACHE_DOCTOR_TEST_KEY"}
        with ServerThread(create_app(build_config(raw, log_requests=False))) as px, httpx.Client() as c:
            assert c.get(px.url + "/sessions").status_code == 401
            auth = {"authorization": "Bearer pk-sessions-7c1e"}
            ok = c.get(px.url + "/sessions", headers=auth)
            assert ok.status_code == 200 and ok.json()["sessions"] == []
            bad = c.get(px.url + "/sessions?limit=many", headers=auth)
            assert bad.status_code == 400 and "limit" in bad.json()["error"]["message"]
