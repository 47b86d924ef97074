"""Real clients on the `ollama` and `lm-studio` profiles through the proxy: the official `ollama`
Python client on Ollama's native API, the OpenAI and Anthropic SDKs on its compatible ones, and
the cache doctor on an Ollama-native conversation. Every record is checked as the proxy made it."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator

import httpx
import pytest

from fakeupstream import Conn, FakeUpstream, Req
from mlxproxy.config import build_config
from mlxproxy.core.meter import RequestMeter
from mlxproxy.core.openai import parse_request
from mlxproxy.core.record import Record
from mlxproxy.edge.runner import ServerThread
from mlxproxy.proxy.app import ProxyApp, create_app
from mlxproxy.sim.app import create_app as create_sim
from support import FIXTURES, last_record, proxy, wait_for

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


@pytest.fixture
def clients() -> Iterator[contextlib.ExitStack]:
    """Every client a test opens is closed at its end (no socket left to the collector)."""
    with contextlib.ExitStack() as es:
        yield es


def last(app: ProxyApp, since: int, n: int = 1) -> list[Record]:
    assert wait_for(lambda: not app.in_flight and app.recent.total >= since + n)
    assert app.recent.total == since + n
    return list(app.recent.records)[-n:]


def ok(r: Record, endpoint: str, *, stream: bool) -> None:
    assert r.endpoint == endpoint and r.stream is stream and r.outcome == "ok", (r.outcome, r.error)
    assert r.completion_tokens_reported and r.prompt_tokens and r.finish_reason
    assert r.anomalies == (), r.anomaly_evidence


def test_the_ollama_client_through_the_proxy(stack: tuple[str, ProxyApp], clients: contextlib.ExitStack) -> None:
    """On the `ollama` profile with honest speed figures (its cache makes the default one claim
    phantom prefill rates: the trap test below)."""
    url, app = stack
    c = clients.enter_context(ollama.Client(host=url))
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
    called = c.chat(
        model="honest", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS, stream=False
    )
    (r,) = last(app, n0)
    ok(r, "ollama_chat", stream=False)
    assert called.message.tool_calls and called.message.tool_calls[0].function.name == "get_weather"
    assert r.tool_calls == 1 and r.tool_calls_valid == 1

    n0 = app.recent.total
    streamed = list(
        c.chat(model="honest", messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS, stream=True)
    )
    (r,) = last(app, n0)
    ok(r, "ollama_chat", stream=True)
    assert any(p.message.tool_calls for p in streamed) and r.tool_calls == 1 and r.tool_calls_valid == 1

    # the live page's feed (/streams) lists them like any other request, with their figures
    recent = httpx.get(url + "/streams").json()["recent"]
    native = [row for row in recent if row["endpoint"] in ("ollama_chat", "ollama_generate")]
    assert len(native) >= 5 and all(
        row["outcome"] == "ok" and row["ttft_s"] is not None for row in native if row["stream"]
    )


def test_the_sdks_on_ollamas_compatible_apis(stack: tuple[str, ProxyApp], clients: contextlib.ExitStack) -> None:
    url, app = stack
    n0 = app.recent.total
    oa = clients.enter_context(openai.OpenAI(base_url=url + "/v1", api_key="ollama"))
    chunks = list(oa.chat.completions.create(model="honest", messages=MSGS, stream=True, max_tokens=20))
    (r,) = last(app, n0)
    ok(r, "chat_completions", stream=True)
    assert "timings" in r.server_claims and r.completion_tokens_reported == 20 and r.finish_reason == "length"
    assert chunks and not any(c.usage for c in chunks)  # the usage the proxy asked for never reaches the client

    n0 = app.recent.total
    an = clients.enter_context(anthropic.Anthropic(base_url=url, api_key="ollama"))
    with an.messages.stream(model="honest", max_tokens=20, messages=MSGS) as s:
        final = s.get_final_message()
    (r,) = last(app, n0)
    ok(r, "messages", stream=True)
    assert r.completion_tokens_reported == final.usage.output_tokens == 20 and r.finish_reason == "max_tokens"


def test_lm_studio_native_and_v0(stack: tuple[str, ProxyApp], clients: contextlib.ExitStack) -> None:
    url, app = stack
    n0 = app.recent.total
    resp = httpx.post(
        url + "/api/v1/chat", json={"model": "qwen/qwen3-8b", "input": "Why?", "stream": True}, timeout=30
    )
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


def test_the_ollama_rate_trap_is_named_on_a_cached_turn(
    stack: tuple[str, ProxyApp], clients: contextlib.ExitStack
) -> None:
    url, app = stack
    system = {"role": "system", "content": "You are a careful assistant who answers briefly. " * 120}
    turn1 = [system, {"role": "user", "content": "Why is the sky blue?"}]
    c = clients.enter_context(ollama.Client(host=url))
    n0 = app.recent.total
    a1 = c.chat(model="qwen3:8b", messages=turn1, stream=True, options={"num_predict": 10})
    text = "".join(p.message.content for p in a1)
    list(
        c.chat(
            model="qwen3:8b",
            messages=[*turn1, {"role": "assistant", "content": text}, {"role": "user", "content": "And red sunsets?"}],
            options={"num_predict": 10},
            stream=True,
        )
    )
    r1, r2 = last(app, n0, 2)
    assert r1.anomalies == () and r2.cached_tokens and r2.turn == 2
    assert r2.anomalies == ("speed_claim_mismatch",), r2.anomaly_evidence
    assert "claimed prefill" in r2.anomaly_evidence["speed_claim_mismatch"]


def test_the_cache_doctor_on_an_ollama_native_session(
    stack: tuple[str, ProxyApp], clients: contextlib.ExitStack
) -> None:
    url, app = stack
    c = clients.enter_context(ollama.Client(host=url))
    lines = [f"Rule {i}: answer in plain words and keep it short." for i in range(100)]

    def system(first: str) -> dict[str, str]:
        return {"role": "system", "content": "\n".join([first, *lines])}

    # a first message of its own: the module's other tests ask MSGS of the same model without a
    # system prompt, and the same messages under a changed system prompt are a regenerate, that
    # is the same conversation (docs/METRICS.md, "Prompt-prefix tracking")
    msgs = [{"role": "user", "content": "Why is the sea salty?"}]
    n0 = app.recent.total
    recs = []
    for turn, first in enumerate(["Session a1b2c3", "Session a1b2c3", "Session 9f8e7d"], start=1):
        parts = list(c.chat(model="honest", messages=[system(first), *msgs], options={"num_predict": 8}, stream=True))
        msgs += [
            {"role": "assistant", "content": "".join(p.message.content for p in parts)},
            {"role": "user", "content": f"Turn {turn + 1}?"},
        ]
    recs = last(app, n0, 3)
    one, two, three = recs
    assert one.turn == 1 and two.turn == 2 and three.turn == 3
    # an honest cached turn: nothing named, the prefix reused
    assert two.anomalies == () and two.reprefill_cause is None and two.cached_tokens
    # the changed first line of the system prompt: named, with the seconds it cost. Nearly the whole
    # prompt was prefilled again, so nearly the whole TTFT was lost; turn 2 reported only its 7
    # uncached tokens as prompt_eval_count (the honest, pre-0.33.3 count), and the doctor must still
    # know that turn's whole prompt (before the fix: 0.0003 s lost of a 0.08 s TTFT)
    assert three.reprefill_cause == "volatile_span" and three.reprefill_at.startswith("messages[0].content line 1")
    assert three.ttft_s is not None and three.reprefill_lost_s is not None
    assert 0.8 * three.ttft_s <= three.reprefill_lost_s <= three.ttft_s
    assert two.prompt_tokens is not None and two.cached_tokens is not None and two.prompt_tokens < two.cached_tokens


def test_ollamas_other_routes_pass_through_unmetered(
    stack: tuple[str, ProxyApp], clients: contextlib.ExitStack
) -> None:
    url, app = stack
    n0 = app.recent.total
    listed = clients.enter_context(ollama.Client(host=url)).list()
    (r,) = last(app, n0)
    assert [m.model for m in listed.models] == ["qwen3:8b"]
    assert r.endpoint == "other" and r.path == "/api/tags" and r.outcome == "ok" and r.anomalies == ()
    assert r.ttft_s is None and r.completion_tokens is None and r.prompt_tokens is None


def test_a_native_capture_replays_and_bench_speaks_ollama(tmp_path, clients: contextlib.ExitStack) -> None:
    """Ollama-native requests captured through the proxy replay against the profile; bench sends
    its tests through /api/chat; the HTML report shows those records like any other."""
    import asyncio

    from mlxproxy.capture import read_capture
    from mlxproxy.load.commands.bench import BenchOptions, bench_targets
    from mlxproxy.load.commands.replay import ReplayOptions, run
    from mlxproxy.load.data.targets import Target
    from mlxproxy.load.output.bench_report import write_bench_html

    cap = tmp_path / "capture.jsonl"
    with ServerThread(create_sim("ollama", speed=20, speed_claims="")) as sim:
        with proxy(sim.url, capture=str(cap)) as (url, app):
            c = clients.enter_context(ollama.Client(host=url))
            list(c.chat(model="qwen3:8b", messages=MSGS, stream=True, options={"num_predict": 8}))
            c.generate(model="qwen3:8b", prompt="Why?", stream=False, options={"num_predict": 8})
            assert wait_for(lambda: app.capture is not None and app.capture.written == 2)
        caps = read_capture(cap)
        (g,) = run(caps, sim.url, ReplayOptions(), compare=True)
        recs = [rr.record for rr in g.records]
        assert [(r.endpoint, r.stream, r.outcome) for r in recs] == [
            ("ollama_chat", True, "ok"),
            ("ollama_generate", False, "ok"),
        ]
        assert all(r.completion_tokens_reported == 8 and r.anomalies == () for r in recs)
        opts = BenchOptions(prompt_tokens=(64,), max_tokens=16, repeat=2, api="ollama")
        (res,) = asyncio.run(bench_targets([Target("ollama", sim.url, 60.0)], opts))
    assert res.error is None
    rows = [rr.record for grp in res.groups for rr in grp.records]
    assert rows and all(r.endpoint == "ollama_chat" and r.outcome == "ok" for r in rows)
    assert all(r.anomalies == () for r in rows), [r.anomaly_evidence for r in rows if r.anomalies]
    html = tmp_path / "bench.html"
    write_bench_html([res], str(html))
    page = html.read_text()  # each request a lane of the timeline, with its TTFT, as for any API
    drawn = [r for r in rows if f'data-id="{r.id}"' in page]
    assert drawn and all(f"{r.id} {r.model} ok: TTFT" in page for r in drawn)


NATIVE = FIXTURES / "native"
CASES = json.loads((NATIVE / "cases.json").read_text())
TRAPS = {"ollama_chat_cached_turn2", "ollama_openai_stream_timings"}


def _paced(case: dict, body: bytes):
    """An upstream that sends the recording's reads at their recorded offsets (chunked)."""

    async def handler(req: Req, conn: Conn) -> None:
        t0 = conn.loop.time()
        await conn.head(case["status"], [("content-type", case["content_type"]), ("transfer-encoding", "chunked")])
        prev = 0
        for t, end in case["reads"]:
            await asyncio.sleep(max(t0 + t - conn.loop.time(), 0.0))
            await conn.chunk(body[prev:end])
            prev = end
        await conn.end_chunked()

    return handler


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_recording_through_the_proxy_byte_for_byte(name: str) -> None:
    """Each recording of tests/fixtures/native/, paced as recorded, reaches the client unchanged,
    and the proxy's record says what the meter says of it: outcome, counts, finish, and nothing
    flagged but the two rate traps."""
    case = CASES[name]
    body = (NATIVE / case["body"]).read_bytes()
    req_body = (NATIVE / case["request"]).read_bytes()
    # recorded answers to the request as sent: the proxy must not ask for a usage report they lack
    with FakeUpstream(_paced(case, body)) as up, proxy(up.url, inject_usage=False) as (url, app):
        got = httpx.post(url + case["path"], content=req_body, headers={"content-type": "application/json"}, timeout=30)
        assert got.status_code == 200 and got.content == body
        r = last_record(app, got.headers["x-mlxproxy-request-id"])
    info, _ = parse_request("POST", case["path"], req_body)
    m = RequestMeter(info, request_id="offline", upstream="u", t_start=0.0, started_at=0.0)
    m.response_started(0.0, case["status"], case["content_type"])
    m.feed(body, 0.1)
    ref = m.finish(0.2)
    assert r.endpoint == ref.endpoint != "other" and r.outcome == ref.outcome == "ok"
    assert (r.completion_tokens_reported, r.prompt_tokens, r.cached_tokens, r.finish_reason, r.tool_calls) == (
        ref.completion_tokens_reported,
        ref.prompt_tokens,
        ref.cached_tokens,
        ref.finish_reason,
        ref.tool_calls,
    )
    assert r.bytes_out == len(body)
    assert r.ttft_s is None or r.ttft_s >= case["reads"][0][0] * 0.9
    assert set(r.anomalies) == ({"speed_claim_mismatch"} if name in TRAPS else set()), r.anomaly_evidence
