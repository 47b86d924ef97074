"""Anthropic Messages (`/v1/messages`) and OpenAI Responses (`/v1/responses`) metered as
fully as chat completions (issue 17, item 5), over the real recordings of
tests/fixtures/real2 (LiteLLM, vllm-mlx, mlx-openai-server; README there).

Every stream is fed whole, byte by byte and at random cuts; the event-aligned feed uses
the recorded arrival time of every event (timings.json), so TTFT and TTFC must equal the
recorded time of the first generated event, found here from the recorded event labels."""

from __future__ import annotations

import json

import httpx
import orjson
import pytest

from fakeupstream import Conn, FakeUpstream, Req, sse_response
from mlxproxy.config import build_config
from mlxproxy.core.analyze import finish_checked
from mlxproxy.core.detect import Thresholds
from mlxproxy.core.meter import RequestMeter
from mlxproxy.core.openai import parse_request
from mlxproxy.core.record import Record
from mlxproxy.edge.runner import ServerThread
from mlxproxy.proxy.app import create_app
from support import FIXTURES, splits, wait_for

TH = Thresholds()
REAL2 = FIXTURES / "real2"
TIMINGS = json.loads((REAL2 / "timings.json").read_text())
GENERATING = (
    "text_delta",
    "thinking_delta",
    "input_json_delta",
    "response.output_text.delta",
    "response.reasoning_summary_text.delta",
    "response.reasoning_text.delta",
    "response.function_call_arguments.delta",
)
ANSWERING = ("text_delta", "input_json_delta", "response.output_text.delta", "response.function_call_arguments.delta")

# name: (outcome, generated events, usage output, prompt, cached, reasoning events, finish, tool calls, valid, anomalies)
STREAMS = {
    "anthropic_messages_litellm_text": ("ok", 24, 24, 35, 1, 0, "max_tokens", 0, None, set()),
    "anthropic_messages_litellm_text_scripted": ("ok", 9, 9, 21, 0, 0, "end_turn", 0, None, set()),
    "anthropic_messages_litellm_thinking": ("ok", 20, 20, 21, 0, 11, "end_turn", 0, None, set()),
    "anthropic_messages_litellm_tool_use": ("ok", 6, 7, 21, 0, 0, "tool_use", 1, 1, set()),
    "anthropic_messages_litellm_error_midstream": (
        "stream_error",
        3,
        None,
        None,
        None,
        0,
        None,
        0,
        None,
        {"stream_error"},
    ),
    # vllm-mlx never reports the prompt on /v1/messages, and says end_turn when max_tokens was hit
    "anthropic_messages_vllm_mlx_text": ("ok", 24, 24, None, None, 0, "end_turn", 0, None, {"unreported_length"}),
    "anthropic_messages_vllm_mlx_thinking_requested": (
        "ok",
        24,
        24,
        None,
        None,
        0,
        "end_turn",
        0,
        None,
        {"unreported_length"},
    ),
    # Anthropic semantics: the prompt is input_tokens + cache reads (+ cache writes)
    "anthropic_messages_litellm_cache_turn1": ("ok", 16, 16, 1227 + 11, 11, 0, "max_tokens", 0, None, set()),
    "anthropic_messages_litellm_cache_turn2": ("ok", 16, 16, 26 + 1254, 1254, 0, "max_tokens", 0, None, set()),
    "anthropic_messages_litellm_cache_turn3_new_system": ("ok", 16, 16, 1268 + 11, 11, 0, "max_tokens", 0, None, set()),
    "openai_responses_litellm_text": ("ok", 24, 24, 35, 34, 0, "max_output_tokens", 0, None, set()),
    "openai_responses_litellm_text_scripted": ("ok", 9, 9, 21, None, 0, "completed", 0, None, set()),
    "openai_responses_litellm_reasoning": ("ok", 20, 20, 21, None, 11, "completed", 0, None, set()),
    "openai_responses_litellm_function_call": ("ok", 6, 7, 21, None, 0, "completed", 1, 1, set()),
    "openai_responses_litellm_toolmarkup_in_text": (
        "ok",
        12,
        12,
        21,
        None,
        0,
        "completed",
        0,
        0,
        {"tool_call_in_content"},
    ),
    # vllm-mlx: event response.completed but status incomplete: the reason is the finish
    "openai_responses_vllm_mlx_text": ("ok", 24, 24, 35, 0, 0, "max_output_tokens", 0, None, set()),
    # mlx-openai-server: max_output_tokens reached, status completed
    "openai_responses_mlx_openai_server_text": ("ok", 24, 24, 35, 0, 0, "completed", 0, None, {"unreported_length"}),
}
BODIES = {  # non-streamed JSON: name -> (status, outcome, usage output, prompt, cached, finish, tool calls, valid, anomalies)
    "anthropic_messages_litellm_nonstream": (200, "ok", 24, 19, 18, "max_tokens", 0, None, set()),
    "anthropic_messages_litellm_tool_use_nonstream": (200, "ok", 7, 21, None, "tool_use", 1, 1, set()),
    "anthropic_messages_vllm_mlx_nonstream": (200, "ok", 24, 35, None, "max_tokens", 0, None, set()),
    "openai_responses_litellm_nonstream": (200, "ok", 24, 19, 18, "max_output_tokens", 0, None, set()),
    "openai_responses_litellm_function_call_nonstream": (200, "ok", 7, 21, None, "completed", 1, 1, set()),
    "openai_responses_vllm_mlx_nonstream": (200, "ok", 24, 19, 0, "max_output_tokens", 0, None, set()),
    "anthropic_messages_litellm_error_context": (
        400,
        "context_limit",
        None,
        None,
        None,
        None,
        0,
        None,
        {"context_limit"},
    ),
    "openai_responses_litellm_error_context": (
        400,
        "context_limit",
        None,
        None,
        None,
        None,
        0,
        None,
        {"context_limit"},
    ),
    "anthropic_messages_vllm_mlx_error_unknown_model": (404, "http_error", None, None, None, None, 0, None, set()),
    "openai_responses_vllm_mlx_error_bad_input": (422, "http_error", None, None, None, None, 0, None, set()),
}


def request_of(name: str) -> tuple[str, bytes]:
    rq = orjson.loads((REAL2 / f"{name}.request.json").read_bytes())
    return rq["request_line"].split()[1], orjson.dumps(rq["body"])


def events_of(name: str) -> tuple[list[bytes], list[tuple[float, str]]]:
    body = (REAL2 / f"{name}.sse").read_bytes()
    events = [e + b"\n\n" for e in body.split(b"\n\n") if e.strip()]
    times = [(t, label) for t, label in TIMINGS[name][0]["events"][0]]
    assert len(events) == len(times)
    return events, times


def meter_for(name: str, status: int = 200, ctype: str = "text/event-stream") -> RequestMeter:
    path, body = request_of(name)
    info, _ = parse_request("POST", path, body)
    m = RequestMeter(info, request_id="r", upstream="u", t_start=0.0, started_at=0.0)
    m.response_started(0.005, status, ctype)
    return m


def feed_timed(name: str, parts: list[bytes]) -> Record:
    """Feed `parts`; each arrives at the recorded time of the event its last byte belongs to."""
    events, times = events_of(name)
    ends, pos = [], 0
    for e in events:
        pos += len(e)
        ends.append(pos)
    m = meter_for(name)
    seen = 0
    for p in parts:
        seen += len(p)
        i = next(k for k, end in enumerate(ends) if end >= seen)
        m.feed(p, times[i][0])
    return finish_checked(m, times[-1][0] + 0.001, TH)


def check(r: Record, exp: tuple, timing_kinds: bool = True) -> None:
    outcome, gen, rep, prompt, cached, reasoning, finish, calls, valid, kinds = exp
    assert (r.outcome, r.generated_events, r.completion_tokens_reported, r.prompt_tokens, r.cached_tokens) == (
        outcome,
        gen,
        rep,
        prompt,
        cached,
    )
    assert (r.reasoning_tokens_counted, r.finish_reason, r.tool_calls, r.tool_calls_valid) == (
        reasoning,
        finish,
        calls,
        valid,
    )
    # a cut that lumps events together makes them arrive at one instant: a burst, rightly
    got = set(r.anomalies) if timing_kinds else set(r.anomalies) - {"non_incremental_stream", "stall"}
    assert got == kinds, r.anomaly_evidence
    if rep is not None and not kinds & {"usage_mismatch", "phantom_speed"}:
        assert (r.completion_tokens, r.tokens_source) == (rep, "usage")


@pytest.mark.parametrize("name", sorted(STREAMS))
def test_stream_recordings_event_by_event_with_recorded_times(name: str) -> None:
    events, times = events_of(name)
    r = feed_timed(name, events)
    check(r, STREAMS[name])
    first = next(t for t, label in times if label.endswith(GENERATING))
    first_answer = next((t for t, label in times if label.endswith(ANSWERING)), None)
    assert r.ttft_s == pytest.approx(first)
    assert r.ttfc_s == (None if first_answer is None else pytest.approx(first_answer))
    gen_times = [t for t, label in times if label.endswith(GENERATING)]
    assert r.event_offsets_s == pytest.approx(tuple(gen_times))
    assert r.event_gaps_s() == pytest.approx([b - a for a, b in zip(gen_times, gen_times[1:])])
    if r.completion_tokens is not None and r.completion_tokens >= 2:
        assert r.decode_tps == pytest.approx((r.completion_tokens - 1) / (gen_times[-1] - gen_times[0]))
        assert r.wall_tps == pytest.approx(
            r.completion_tokens / (r.duration_s - (r.tail_after_done_s or 0.0))
        )  # to the end event


@pytest.mark.parametrize("name", sorted(STREAMS))
def test_stream_recordings_whole_bytewise_and_cut(name: str) -> None:
    events, times = events_of(name)
    body = b"".join(events)
    first = next(t for t, label in times if label.endswith(GENERATING))
    for parts in splits(body):
        r = feed_timed(name, parts)
        exp = STREAMS[name]
        check(r, exp, timing_kinds=False)
        assert r.ttft_s >= first - 1e-9  # a cut can only make an event complete later


def test_whole_body_in_one_read_is_still_measured() -> None:
    """One read with everything: same counts; every event at the same instant is a burst."""
    name = "anthropic_messages_litellm_text"
    events, _ = events_of(name)
    m = meter_for(name)
    m.feed(b"".join(events), 1.0)
    r = finish_checked(m, 1.0, TH)
    assert (r.generated_events, r.completion_tokens_reported, r.finish_reason) == (24, 24, "max_tokens")
    assert "non_incremental_stream" in r.anomalies


@pytest.mark.parametrize("name", sorted(BODIES))
def test_non_streamed_bodies(name: str) -> None:
    status, outcome, rep, prompt, cached, finish, calls, valid, kinds = BODIES[name]
    m = meter_for(name, status, "application/json")
    m.feed((REAL2 / f"{name}.json").read_bytes(), 0.2)
    r = finish_checked(m, 0.25, TH)
    assert (r.outcome, r.completion_tokens_reported, r.prompt_tokens, r.cached_tokens, r.finish_reason) == (
        outcome,
        rep,
        prompt,
        cached,
        finish,
    )
    assert (r.tool_calls, r.tool_calls_valid) == (calls, valid)
    assert set(r.anomalies) == kinds, r.anomaly_evidence


def test_trimmed_recording_is_caught_by_the_usage_check() -> None:
    """The 3,774-delta recording was trimmed to 150 + 4 events: the usage (3780) cannot be
    explained by the stream that is left, and the speeds use the streamed count."""
    name = "openai_responses_vllm_mlx_max_output_tokens_unchecked"
    body = (REAL2 / f"{name}.sse").read_bytes()
    events = [e + b"\n\n" for e in body.split(b"\n\n") if e.strip()]
    m = meter_for(name)
    for i, e in enumerate(events):
        m.feed(e, 0.1 + 0.0026 * i)
    r = finish_checked(m, 0.1 + 0.0026 * len(events), TH)
    assert r.completion_tokens_reported == 3780 and r.generated_events == 146
    assert {"usage_mismatch", "phantom_speed"} <= set(r.anomalies)
    assert (r.completion_tokens, r.tokens_source) == (146, "stream")


def test_broken_messages_and_responses_tool_calls_fire() -> None:
    name = "anthropic_messages_litellm_tool_use"
    body = (REAL2 / f"{name}.sse").read_bytes()
    broken = body.replace(b'"partial_json": "\\"}"', b'"partial_json": "\\""')
    assert broken != body
    m = meter_for(name)
    m.feed(broken, 0.3)
    r = finish_checked(m, 0.4, TH)
    assert r.tool_calls_valid == 0 and "invalid_tool_arguments" in r.anomalies
    stop = body.replace(b'"stop_reason": "tool_use"', b'"stop_reason": "end_turn"')
    assert stop != body
    m = meter_for(name)
    m.feed(stop, 0.3)
    r = finish_checked(m, 0.4, TH)
    assert (
        "tool_call_finish_mismatch" in r.anomalies and "'tool_use'" in r.anomaly_evidence["tool_call_finish_mismatch"]
    )
    name = "openai_responses_litellm_function_call"
    body = (REAL2 / f"{name}.sse").read_bytes().replace(b'"name":"get_weather"', b'"name":"get_wether"')
    m = meter_for(name)
    m.feed(body, 0.3)
    r = finish_checked(m, 0.4, TH)
    assert "invalid_tool_arguments" in r.anomalies and "get_wether" in r.anomaly_evidence["invalid_tool_arguments"]


def test_a_stream_without_usage_is_flagged() -> None:
    name = "anthropic_messages_litellm_text_scripted"
    body = (REAL2 / f"{name}.sse").read_bytes()
    cut = body.replace(b', "usage": {"input_tokens": 21, "output_tokens": 9}', b"")
    assert cut != body
    m = meter_for(name)
    m.feed(cut, 0.3)
    r = finish_checked(m, 0.4, TH)
    assert r.completion_tokens_reported is None and "usage_missing" in r.anomalies
    assert (r.completion_tokens, r.tokens_source) == (9, "stream")


# -- through the proxy: byte-exact, no usage injection, metered ----------------------------


@pytest.mark.parametrize(
    "name",
    ["anthropic_messages_litellm_thinking", "openai_responses_litellm_function_call", "openai_responses_vllm_mlx_text"],
)
def test_proxy_forwards_byte_exact_and_meters(name: str) -> None:
    path, req = request_of(name)
    body = (REAL2 / f"{name}.sse").read_bytes()
    config = build_config(None, upstream_url=None, log_requests=False)
    with FakeUpstream(sse_response(body)) as up:
        config = build_config(None, upstream_url=up.url, log_requests=False)
        app = create_app(config)
        with ServerThread(app, server_header=False, date_header=False) as srv, httpx.Client() as c:
            with c.stream("POST", srv.url + path, content=req, headers={"content-type": "application/json"}) as r:
                got = b"".join(r.iter_raw())
                rid = r.headers["x-mlxproxy-request-id"]
            assert got == body
            assert up.requests[0].body == req  # no usage injection for these APIs
            assert wait_for(lambda: any(x.id == rid for x in app.recent.records))
            rec = next(x for x in app.recent.records if x.id == rid)
    exp = STREAMS[name]
    assert not rec.usage_injected
    assert (rec.outcome, rec.generated_events, rec.completion_tokens_reported, rec.finish_reason) == (
        exp[0],
        exp[1],
        exp[2],
        exp[6],
    )
    assert rec.ttft_s is not None and rec.ttft_s > 0


# -- capture and replay of the two APIs ----------------------------------------------------


def _api_handler(received: list[Req]):
    bodies = {
        "/v1/messages": (REAL2 / "anthropic_messages_litellm_thinking.sse").read_bytes(),
        "/v1/responses": (REAL2 / "openai_responses_litellm_function_call.sse").read_bytes(),
    }

    async def handler(req: Req, conn: Conn) -> None:
        received.append(req)
        await sse_response(bodies[req.path])(req, conn)

    return handler


@pytest.mark.parametrize("keep_prompts", [True, False], ids=["prompts", "privacy"])
def test_capture_and_replay_messages_and_responses(tmp_path, keep_prompts: bool) -> None:
    from mlxproxy.capture import read_capture
    from mlxproxy.load.commands.replay import ReplayOptions, records_of, run

    cap = tmp_path / "capture.jsonl"
    m_path, m_req = request_of("anthropic_messages_litellm_thinking")
    r_path, r_req = request_of("openai_responses_litellm_function_call")
    m_req = orjson.dumps({**orjson.loads(m_req), "system": [{"type": "text", "text": "Secret system text"}]})
    r_req = orjson.dumps({**orjson.loads(r_req), "instructions": "Secret instructions"})
    received: list[Req] = []
    with FakeUpstream(_api_handler(received)) as up:
        app = create_app(
            build_config(None, upstream_url=up.url, log_requests=False, capture=str(cap), capture_prompts=keep_prompts)
        )
        with ServerThread(app) as srv, httpx.Client() as c:
            for path, req in ((m_path, m_req), (r_path, r_req)):
                assert (
                    c.post(srv.url + path, content=req, headers={"content-type": "application/json"}).status_code == 200
                )
            assert wait_for(lambda: app.capture is not None and app.capture.written == 2)
    caps = read_capture(cap)
    raw = cap.read_bytes()
    if not keep_prompts:  # no prompt text of either API in a privacy capture
        for text in (b"What is the weather in Paris", b"Paris?", b"Secret"):
            assert text not in raw
    assert [c.record.endpoint for c in caps] == ["messages", "responses"]
    received.clear()
    with FakeUpstream(_api_handler(received)) as up:
        groups = run(caps, up.url, ReplayOptions(mode="sequential"))
    recs = records_of(groups[0])
    assert [(r.endpoint, r.outcome, r.generated_events, r.completion_tokens_reported) for r in recs] == [
        ("messages", "ok", 20, 20),
        ("responses", "ok", 6, 7),
    ]
    assert recs[1].tool_calls == 1 and recs[1].tool_calls_valid == 1
    sent = [orjson.loads(r.body) for r in received]
    assert all("stream_options" not in b for b in sent)  # these APIs always report usage
    assert sent[0]["messages"][0]["content"].startswith("[nonce ")
    first_input = sent[1]["input"] if isinstance(sent[1]["input"], str) else sent[1]["input"][0]["content"]
    assert (first_input if isinstance(first_input, str) else first_input[0]["text"]).startswith("[nonce ")
    if keep_prompts:
        assert sent[0]["system"] == [{"type": "text", "text": "Secret system text"}]
        assert sent[1]["instructions"] == "Secret instructions"
        assert sent[0]["messages"][0]["content"].endswith("What is the weather in Paris?")
    else:  # filler of the recorded lengths
        assert len(sent[0]["system"]) == len("Secret system text") and len(sent[1]["instructions"]) == len(
            "Secret instructions"
        )
        assert (
            sent[0]["messages"][0]["content"].split("] ", 1)[1] == "the quick brown fox jumps ove"
        )  # filler, same length
