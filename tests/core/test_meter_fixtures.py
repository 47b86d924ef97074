"""Every wire fixture, fed whole, byte by byte and at random cuts, gives EXPECTED.md's results."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from mlxproxy.core.meter import Measurement, RequestMeter
from mlxproxy.core.openai import parse_request
from support import read_fixture, splits

CHAT = b'{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}'


def run(
    body: bytes,
    parts: list[bytes],
    *,
    status: int = 200,
    ctype: str = "text/event-stream",
    req: bytes = CHAT,
    path: str = "/v1/chat/completions",
    count_tokens: Callable[[str], int] | None = None,
) -> tuple[RequestMeter, Measurement]:
    info, _ = parse_request("POST", path, req)
    m = RequestMeter(info, request_id="r1", upstream="u", t_start=0.0, started_at=0.0, keep_text=True)
    m.upstream_sent(0.0)
    m.response_started(0.5, status, ctype)
    t = 1.0
    for p in parts:
        m.feed(p, t)
        t += 1.0
    return m, m.finish(t, count_tokens=count_tokens)


def all_ways(name: str, **kw):
    body = read_fixture(name)
    for parts in splits(body, seed=hash(name) & 0xFFFF):
        yield run(body, parts, **kw)


def test_01_openai_reference() -> None:
    for m, r in all_ways("wire/01_openai_reference_include_usage.sse"):
        assert r.content_text == "Hello world"
        assert r.generated_events == 2 and r.completion_tokens_counted == 2
        assert r.finish_reason == "stop" and r.completion_tokens_reported == 2 and r.usage_reports == 1
        assert m.done and r.outcome == "ok"
        assert r.prompt_tokens == 9 and r.cached_tokens == 0 and r.reasoning_tokens_reported == 0


def test_02_mlx_lm_reasoning_keepalive() -> None:
    for _m, r in all_ways("wire/02_mlx_lm_server_reasoning_keepalive.sse"):
        assert r.comments == 2 and r.prefill_progress == (4096, 5120)
        assert r.reasoning_text == "Let me think." and r.content_text == "Hi there"
        assert r.finish_reason == "stop" and r.outcome == "ok"
        assert r.completion_tokens_reported == 7 and r.completion_tokens_counted == 4
        assert r.reasoning_tokens_counted == 2
        assert r.ttfc_s is not None and r.ttft_s is not None and r.ttfc_s >= r.ttft_s


def test_03_mlx_openai_server() -> None:
    for _m, r in all_ways("wire/03_mlx_openai_server.sse"):
        assert r.generated_events == 2  # role-only first chunk is not a token
        assert r.completion_tokens_reported == 3 and r.usage_reports == 1 and not r.usage_requested
        assert r.reasoning_text == "Thinking" and r.content_text == "Hi" and r.outcome == "ok"


def test_05_mlx_omni_server() -> None:
    for _m, r in all_ways("wire/05_mlx_omni_server_include_usage.sse"):
        assert r.content_text == "Okay, the user asks...Hello!" and r.reasoning_text == ""
        assert r.finish_reason == "stop" and r.finish_reasons_seen == 2
        assert r.completion_tokens_reported == 5 and r.outcome == "ok"
        assert r.ttft_s == r.ttfc_s


def test_06_vllm_mlx_reasoning_usage_twice() -> None:
    body = read_fixture("wire/06_vllm_mlx_reasoning_usage_twice.sse")
    for parts in splits(body):
        m, r = run(body, parts)
        assert r.usage_reports == 2 and r.completion_tokens_reported == 4
        assert r.comments == 1 and r.generated_events == 4 and r.reasoning_tokens_counted == 2
        assert r.reasoning_text == "The user wants" and r.content_text == "Sure."
    # first generated event is the reasoning chunk: feed event by event with distinct times
    events = [e + b"\n\n" for e in body.split(b"\n\n") if e]
    m, r = run(body, events)
    assert r.ttft_s == pytest.approx(3.0)  # role chunk t=1, heartbeat t=2, reasoning t=3
    assert r.ttfc_s == pytest.approx(5.0)


def test_09_omlx_keepalive_first() -> None:
    body = read_fixture("wire/09_omlx_keepalive_usage_timings.sse")
    for parts in splits(body):
        m, r = run(body, parts)
        assert r.comments == 2 and r.completion_tokens_reported == 2 and r.outcome == "ok"
        assert r.server_claims["usage"]["time_to_first_token"] == 11.37
        assert r.cached_tokens == 16384 and r.prompt_tokens == 18000
    events = [e + b"\n\n" for e in body.split(b"\n\n") if e]
    m, r = run(body, events)
    assert r.ttfb_s == pytest.approx(1.0) and r.ttft_s == pytest.approx(4.0)


def test_10_omlx_context_400() -> None:
    raw = read_fixture("wire/10_omlx_context_400.http")
    head, body = raw.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 400")
    for parts in splits(body):
        m, r = run(body, parts, status=400, ctype="application/json")
        assert r.outcome == "context_limit"
        assert r.context_prompt_tokens == 51587 and r.context_limit_tokens == 32768
        assert r.generated_events == 0 and r.ttft_s is None
        assert "Prompt too long" in (r.error or "")


def test_11_rapid_mlx_fast_path() -> None:
    for _m, r in all_ways("wire/11_rapid_mlx_fast_path.sse"):
        assert r.reasoning_text == "Think" and r.content_text == "Answer" and r.outcome == "ok"
        assert r.completion_tokens_reported == 3 and r.reasoning_tokens_reported == 1


def test_13_mlx_vlm_nulls_dual_reasoning() -> None:
    for _m, r in all_ways("wire/13_mlx_vlm_nulls_dual_reasoning_timings.sse"):
        assert r.reasoning_text == "Hmm" and r.content_text == "Yes"
        assert r.dual_reasoning_events == 1 and r.generated_events == 2
        assert r.server_claims["timings"]["predicted_n"] == 2
        assert r.outcome == "ok" and r.completion_tokens_reported == 2


def test_16_omlx_nonstream_leading_spaces() -> None:
    req = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'
    for _m, r in all_ways("wire/16_omlx_nonstream_leading_spaces.json", ctype="application/json", req=req):
        assert r.completion_tokens_reported == 5 and r.outcome == "ok" and r.finish_reason == "stop"
        assert r.content_text == "Hi" and r.reasoning_text == "Think"
        assert r.completion_tokens_counted is None and r.ttft_s is None


def test_17a_tool_calls_incremental() -> None:
    body = read_fixture("wire/17a_tool_calls_incremental.sse")
    for parts in splits(body):
        recounted: list[str] = []  # what a tokenizer is handed: the call's name and arguments, whole
        m, r = run(body, parts, count_tokens=lambda text: recounted.append(text) or 1)  # noqa: B023
        assert recounted == ['read_file{"path":"a.py"}'] and r.completion_tokens_tokenizer == 1
        assert r.finish_reason == "tool_calls" and r.outcome == "ok" and r.tool_calls == 1
        assert r.generated_events == 3
    m, r = run(body, [body])
    assert r.ttft_s == pytest.approx(1.0) and r.ttfc_s == pytest.approx(1.0)


@pytest.mark.parametrize(
    "name,reported,counted,prompt",
    [
        ("real/mlx_lm_server_stream_usage.sse", 8, None, 17),
        ("real/mlx_openai_server_chat_stream_usage.sse", None, None, None),
        ("real/rapid_mlx_chat_stream_usage.sse", 8, None, 17),
        ("real/vllm_mlx_chat_stream_300tok.sse", 300, 277, 20),  # 23 empty deltas {} are not tokens
    ],
)
def test_real_streams(name: str, reported: int | None, counted: int | None, prompt: int | None) -> None:
    results = [(r.content_text, r) for _, r in all_ways(name)]
    first_text, first = results[0]
    assert first.outcome == "ok" and first.finish_reason is not None
    if reported is not None:
        assert first.completion_tokens_reported == reported
    if counted is not None:
        assert first.generated_events == counted
    if prompt is not None:
        assert first.prompt_tokens == prompt
    for text, r in results[1:]:
        assert text == first_text
        assert (r.generated_events, r.completion_tokens_reported, r.finish_reason, r.outcome, r.usage_reports) == (
            first.generated_events,
            first.completion_tokens_reported,
            first.finish_reason,
            first.outcome,
            first.usage_reports,
        )
