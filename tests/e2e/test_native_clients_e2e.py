"""Real clients on the `ollama` and `lm-studio` profiles through the proxy: the official `ollama`
Python client on Ollama's native API, the OpenAI and Anthropic SDKs on its compatible ones, and
the cache doctor on an Ollama-native conversation. Every record is checked as the proxy made it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import httpx
import pytest
from support import wait_for

from mlxproxy.config import build_config
from mlxproxy.core.record import Record
from mlxproxy.edge.runner import ServerThread
from mlxproxy.proxy.app import ProxyApp, create_app
from mlxproxy.sim.app import create_app as create_sim

ollama = pytest.importorskip("ollama")
openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

SPEED = 8.0
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
MSGS = [{"role": "user", "content": "Why is the sky blue?"}]


@pytest.fixture(scope="module")
def stack() -> Iterator[tuple[str, ProxyApp]]:
    with contextlib.ExitStack() as es:
        sims = {
            "ollama": es.enter_context(ServerThread(create_sim("ollama", speed=SPEED))),
            "ollama-honest": es.enter_context(ServerThread(create_sim("ollama", speed=SPEED, speed_claims=""))),
            "lm-studio": es.enter_context(ServerThread(create_sim("lm-studio", speed=SPEED))),
        }
        raw = {
            "upstreams": [
                {"name": "ollama", "url": sims["ollama"].url, "models": ["qwen3:8b"]},
                {"name": "ollama-honest", "url": sims["ollama-honest"].url, "models": ["honest"]},
                {"name": "lm-studio", "url": sims["lm-studio"].url, "models": ["qwen/qwen3-8b"]},
            ]
        }
        app = create_app(build_config(raw, log_requests=False))
        px = es.enter_context(ServerThread(app, server_header=False, date_header=False))
        yield px.url, app


def last(app: ProxyApp, since: int, n: int = 1) -> list[Record]:
    assert wait_for(lambda: not app.in_flight and app.recent.total >= since + n)
    assert app.recent.total == since + n
    return list(app.recent.records)[-n:]


def ok(r: Record, endpoint: str, *, stream: bool) -> None:
    assert r.endpoint == endpoint and r.stream is stream and r.outcome == "ok", (r.outcome, r.error)
    assert r.completion_tokens_reported and r.prompt_tokens and r.finish_reason
    assert r.anomalies == (), r.anomaly_evidence


def test_the_ollama_client_through_the_proxy(stack: tuple[str, ProxyApp]) -> None:
    """On the `ollama` profile with honest speed figures (its cache makes the default one claim
    phantom prefill rates: the trap test below)."""
    url, app = stack
    c = ollama.Client(host=url)
    n0 = app.recent.total
    parts = list(c.chat(model="honest", messages=MSGS, stream=True))  # the client asks; the server streams by default
    (r,) = last(app, n0)
    ok(r, "ollama_chat", stream=True)
    assert parts[-1].done and r.completion_tokens_reported == parts[-1].eval_count == r.completion_tokens_counted
    assert r.ttft_s is not None and r.ttfc_s is not None and r.ttfc_s > r.ttft_s  # thinking first
    assert r.reasoning_tokens_counted == sum(1 for p in parts if p.message.thinking)
    assert r.server_claims["ollama"]["eval_count"] == r.completion_tokens_reported

    n0 = app.recent.total
    one = c.chat(model="honest", messages=MSGS, stream=False, think=True)
    (r,) = last(app, n0)
    ok(r, "ollama_chat", stream=False)
    assert r.completion_tokens_reported == one.eval_count and r.prompt_tokens == one.prompt_eval_count
    assert one.message.thinking

    n0 = app.recent.total
    gen = list(c.generate(model="honest", prompt="Why is the sky blue?", options={"num_predict": 12}, stream=True))
    (r,) = last(app, n0)
    ok(r, "ollama_generate", stream=True)
    assert r.max_tokens == 12 and r.finish_reason == "length" == gen[-1].done_reason
    assert r.completion_tokens_counted == 12

    n0 = app.recent.total
    called = c.chat(model="honest", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS, stream=False)
    (r,) = last(app, n0)
    ok(r, "ollama_chat", stream=False)
    assert called.message.tool_calls and called.message.tool_calls[0].function.name == "get_weather"
    assert r.tool_calls == 1 and r.tool_calls_valid == 1

    n0 = app.recent.total
    streamed = list(c.chat(model="honest", messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS, stream=True))
    (r,) = last(app, n0)
    ok(r, "ollama_chat", stream=True)
    assert any(p.message.tool_calls for p in streamed) and r.tool_calls == 1 and r.tool_calls_valid == 1

    # the page (/streams) lists them like any other request
    rows = httpx.get(url + "/streams").json()
    endpoints = {row.get("endpoint") for row in rows.get("recent", rows.get("records", []))} if isinstance(rows, dict) else set()
    assert {"ollama_chat", "ollama_generate"} <= endpoints, rows if not endpoints else endpoints


def test_the_sdks_on_ollamas_compatible_apis(stack: tuple[str, ProxyApp]) -> None:
    url, app = stack
    n0 = app.recent.total
    oa = openai.OpenAI(base_url=url + "/v1", api_key="ollama")
    chunks = list(oa.chat.completions.create(model="honest", messages=MSGS, stream=True, max_tokens=20))
    (r,) = last(app, n0)
    ok(r, "chat_completions", stream=True)
    assert "timings" in r.server_claims and r.completion_tokens_reported == 20 and r.finish_reason == "length"
    assert chunks and not any(c.usage for c in chunks)  # the usage the proxy asked for never reaches the client

    n0 = app.recent.total
    an = anthropic.Anthropic(base_url=url, api_key="ollama")
    with an.messages.stream(model="honest", max_tokens=20, messages=MSGS) as s:
        final = s.get_final_message()
    (r,) = last(app, n0)
    ok(r, "messages", stream=True)
    assert r.completion_tokens_reported == final.usage.output_tokens == 20 and r.finish_reason == "max_tokens"


def test_lm_studio_native_and_v0(stack: tuple[str, ProxyApp]) -> None:
    url, app = stack
    n0 = app.recent.total
    resp = httpx.post(url + "/api/v1/chat", json={"model": "qwen/qwen3-8b", "input": "Why?", "stream": True}, timeout=30)
    assert resp.status_code == 200 and "event: chat.end" in resp.text
    (r,) = last(app, n0)
    ok(r, "lmstudio_chat", stream=True)
    assert r.finish_reason == "end" and "stats" in r.server_claims
    n0 = app.recent.total
    body = {"model": "qwen/qwen3-8b", "messages": MSGS, "max_tokens": -1, "stream": False}
    assert httpx.post(url + "/api/v0/chat/completions", json=body, timeout=30).json()["stats"]
    (r,) = last(app, n0)
    ok(r, "chat_completions", stream=False)
    assert r.max_tokens is None


def test_the_ollama_rate_trap_is_named_on_a_cached_turn(stack: tuple[str, ProxyApp]) -> None:
    url, app = stack
    system = {"role": "system", "content": "You are a careful assistant who answers briefly. " * 120}
    turn1 = [system, {"role": "user", "content": "Why is the sky blue?"}]
    c = ollama.Client(host=url)
    n0 = app.recent.total
    a1 = c.chat(model="qwen3:8b", messages=turn1, stream=True, options={"num_predict": 10})
    text = "".join(p.message.content for p in a1)
    list(c.chat(model="qwen3:8b", messages=[*turn1, {"role": "assistant", "content": text}, {"role": "user", "content": "And red sunsets?"}], options={"num_predict": 10}, stream=True))
    r1, r2 = last(app, n0, 2)
    assert r1.anomalies == () and r2.cached_tokens and r2.turn == 2
    assert r2.anomalies == ("speed_claim_mismatch",), r2.anomaly_evidence
    assert "claimed prefill" in r2.anomaly_evidence["speed_claim_mismatch"]


def test_the_cache_doctor_on_an_ollama_native_session(stack: tuple[str, ProxyApp]) -> None:
    url, app = stack
    c = ollama.Client(host=url)
    lines = [f"Rule {i}: answer in plain words and keep it short." for i in range(100)]

    def system(first: str) -> dict[str, str]:
        return {"role": "system", "content": "\n".join([first, *lines])}

    msgs = [{"role": "user", "content": "Why is the sky blue?"}]
    n0 = app.recent.total
    recs = []
    for turn, first in enumerate(["Session a1b2c3", "Session a1b2c3", "Session 9f8e7d"], start=1):
        parts = list(c.chat(model="honest", messages=[system(first), *msgs], options={"num_predict": 8}, stream=True))
        msgs += [{"role": "assistant", "content": "".join(p.message.content for p in parts)}, {"role": "user", "content": f"Turn {turn + 1}?"}]
    recs = last(app, n0, 3)
    one, two, three = recs
    assert one.turn == 1 and two.turn == 2 and three.turn == 3
    # an honest cached turn: nothing named, the prefix reused
    assert two.anomalies == () and two.reprefill_cause is None and two.cached_tokens
    # the changed first line of the system prompt: named, with the seconds it cost
    assert three.reprefill_cause in ("volatile_span", "system_changed"), three.reprefill_cause
    assert three.reprefill_lost_s is not None and three.reprefill_lost_s > 0
