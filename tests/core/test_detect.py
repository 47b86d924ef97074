"""Each truth check on scripted records, on both sides of its threshold."""

from __future__ import annotations

import dataclasses

import pytest

from mlxproxy.core.detect import (
    Thresholds,
    check_record,
    find_serialized,
    overlap_ratio,
    prefill_scaling,
    stall_stats,
)
from mlxproxy.core.meter import RequestMeter
from mlxproxy.core.openai import parse_request
from mlxproxy.core.record import Record
from support import read_fixture

TH = Thresholds()


def rec(**kw) -> Record:
    base = dict(
        id="r",
        started_at=0.0,
        upstream="u",
        model="m",
        endpoint="chat_completions",
        stream=True,
        status=200,
        outcome="ok",
        completion_tokens_counted=0,
        duration_s=1.0,
        usage_requested=True,
    )
    base.update(kw)
    return Record(**base)


def stream(n: int, gap: float = 0.02, t0: float = 0.1, reported: int | None = None, **kw) -> Record:
    offs = tuple(t0 + i * gap for i in range(n))
    return rec(
        event_offsets_s=offs,
        generated_events=n,
        completion_tokens_counted=n,
        completion_tokens_reported=n if reported is None else reported,
        ttft_s=t0,
        e2e_s=offs[-1] if offs else None,
        duration_s=(offs[-1] if offs else 0) + 0.01,
        **kw,
    )


def kinds(r: Record, **kw) -> list[str]:
    return [a.kind for a in check_record(r, TH, **kw)]


def test_healthy_stream_has_no_anomalies() -> None:
    assert kinds(stream(100)) == []
    assert kinds(stream(100, reported=101)) == []  # the server counts its EOS token


def test_usage_mismatch_boundary() -> None:
    # streamed estimate 30 events (chars unknown): limit = 2.0 * 30 + 3 = 63
    assert "usage_mismatch" not in kinds(stream(30, reported=63))
    assert "usage_mismatch" in kinds(stream(30, reported=64))
    # more events than usage, beyond the tolerance of 3
    assert "usage_mismatch" not in kinds(stream(30, reported=27))
    assert "usage_mismatch" in kinds(stream(30, reported=26))
    # too few tokens to judge
    assert kinds(stream(3, reported=15)) == []


def test_coarse_chunks_are_estimated_from_characters() -> None:
    # 10 events carrying 400 chars ~ 100 tokens: usage 100 is plausible
    assert "usage_mismatch" not in kinds(stream(10, reported=100), chars=400)
    assert "usage_mismatch" in kinds(stream(10, reported=100), chars=40)


def test_tokenizer_count_replaces_estimate() -> None:
    r = stream(10, reported=100, completion_tokens_tokenizer=98)
    assert "usage_mismatch" not in kinds(r, chars=40)
    r = stream(10, reported=100, completion_tokens_tokenizer=30)
    assert "usage_mismatch" in kinds(r, chars=400)


def test_phantom_speed_boundary_and_evidence() -> None:
    assert "phantom_speed" not in kinds(stream(41, gap=0.001, reported=123))  # exactly 3.0x
    found = check_record(stream(41, gap=0.00075, reported=812), TH)
    ph = [a for a in found if a.kind == "phantom_speed"]
    assert ph and "usage says 812 tokens, 41 streamed in 0.03 s" in ph[0].evidence and "27033 tok/s" in ph[0].evidence


def test_usage_missing() -> None:
    r = stream(30)
    assert "usage_missing" in kinds(dataclasses.replace(r, completion_tokens_reported=None))
    assert "usage_missing" not in kinds(dataclasses.replace(r, completion_tokens_reported=None, usage_requested=False))
    assert "usage_missing" in kinds(
        dataclasses.replace(r, completion_tokens_reported=None, usage_requested=False, usage_injected=True)
    )
    assert "usage_missing" in kinds(rec(stream=False, completion_tokens_counted=None, completion_tokens_reported=None))


def test_non_incremental_stream() -> None:
    burst = stream(64, gap=0.00001, t0=3.0)  # all 64 tokens within 0.6 ms after 3 s of silence
    ks = check_record(burst, TH)
    assert [a.kind for a in ks] == ["non_incremental_stream"] and "TTFT 3.00 s is 100% of E2E" in ks[0].evidence
    # a long prefill followed by a normal-speed short answer is not a burst
    assert kinds(stream(20, gap=0.02, t0=30.0)) == []
    # the rate boundary: 9901 tok/s could be a (very) fast decoder, 10101 tok/s cannot
    assert kinds(stream(30, gap=0.000101, t0=3.0)) == []
    assert kinds(stream(30, gap=0.000099, t0=3.0)) == ["non_incremental_stream"]
    # below the token floor nothing is judged
    assert kinds(stream(19, gap=0.00001, t0=3.0)) == []
    # many tokens per event
    coarse = dataclasses.replace(stream(10, gap=0.1), completion_tokens_reported=90)
    assert "non_incremental_stream" in kinds(coarse, chars=360)
    assert "non_incremental_stream" not in kinds(dataclasses.replace(coarse, completion_tokens_reported=80), chars=320)


def gaps_record(gaps: list[float]) -> Record:
    offs, t = [0.1], 0.1
    for g in gaps:
        t += g
        offs.append(t)
    n = len(offs)
    return rec(
        event_offsets_s=tuple(offs),
        generated_events=n,
        completion_tokens_counted=n,
        completion_tokens_reported=n,
        ttft_s=0.1,
        e2e_s=t,
        duration_s=t + 0.01,
    )


def test_stall_thresholds_and_cyclic() -> None:
    base = [0.02] * 30
    # 10x the median (0.2 s) is below the 1 s floor: not a stall
    assert kinds(gaps_record(base[:10] + [0.9] + base[10:])) == []
    assert kinds(gaps_record(base[:10] + [1.01] + base[10:])) == ["stall"]
    cyclic = []
    for _ in range(5):
        cyclic += [0.02] * 9 + [2.0]
    found = check_record(gaps_record(cyclic), TH)
    assert [a.kind for a in found] == ["stall"] and "cyclic: every ~10 events" in found[0].evidence
    irregular = [0.02] * 3 + [2.0] + [0.02] * 20 + [2.0] + [0.02] * 2 + [2.0] + [0.02] * 10
    assert "cyclic" not in check_record(gaps_record(irregular), TH)[0].evidence
    idx, lengths = stall_stats(gaps_record(cyclic), TH)  # a record's stall_count and stall_total_s
    assert len(idx) == 5 and sum(lengths) == pytest.approx(10.0)


def test_context_limit_http_and_in_stream() -> None:
    r = rec(
        outcome="context_limit",
        status=400,
        context_prompt_tokens=51587,
        context_limit_tokens=32768,
        error="Prompt too long: 51587 tokens exceeds max context window of 32768 tokens",
    )
    found = check_record(r, TH)
    assert (
        [a.kind for a in found] == ["context_limit"] and "51587" in found[0].evidence and "32768" in found[0].evidence
    )
    r = rec(
        outcome="stream_error",
        error="This model's maximum context length is 8192 tokens. However, you requested 9000 tokens",
    )
    assert kinds(r) == ["context_limit", "stream_error"]
    assert kinds(rec(outcome="http_error", status=400, error="bad temperature")) == []


def test_missing_finish_stream_error_duplicate_dual() -> None:
    assert kinds(rec(outcome="truncated", generated_events=5, completion_tokens_counted=5)) == ["missing_finish"]
    assert kinds(rec(outcome="stream_error", error="queue full", finish_reason="stop")) == ["stream_error"]
    assert "duplicate_content" in kinds(stream(30, duplicate_content=True))
    assert "dual_reasoning_fields" in kinds(stream(30, dual_reasoning_events=3))


def test_unreported_length_boundary() -> None:
    assert "unreported_length" in kinds(stream(64, finish_reason="stop", max_tokens=64))
    assert "unreported_length" not in kinds(stream(63, finish_reason="stop", max_tokens=64))
    assert "unreported_length" not in kinds(stream(64, finish_reason="length", max_tokens=64))


def test_silent_prefill_boundary() -> None:
    assert "silent_prefill" not in kinds(stream(30), headers_to_first_byte_s=120.0)
    assert "silent_prefill" in kinds(stream(30), headers_to_first_byte_s=120.5)


def timed(id_: str, start: float, first: float, last: float, n: int = 20) -> Record:
    gap = (last - first) / (n - 1)
    offs = tuple(first - start + i * gap for i in range(n))
    return rec(
        id=id_,
        t_start_mono=start,
        event_offsets_s=offs,
        generated_events=n,
        completion_tokens_counted=n,
        completion_tokens_reported=n,
        duration_s=offs[-1] + 0.01,
    )


def test_serialized_pair_and_batched_pair() -> None:
    a = timed("A", 0.0, 0.1, 2.0)
    b_serial = timed("B", 0.01, 2.05, 4.0)
    found = find_serialized(b_serial, [a], TH)
    assert found is not None and found.kind == "serialized" and "request A" in found.evidence
    b_batched = timed("B", 0.01, 0.2, 2.1)
    assert find_serialized(b_batched, [a], TH) is None
    # arrived when A had less than serialized_min_wait_s left: waiting is not evidence
    b_late = timed("B", 1.8, 2.05, 3.0)
    assert find_serialized(b_late, [a], TH) is None
    assert overlap_ratio([a, b_serial]) == pytest.approx(0.0)
    assert overlap_ratio([a, b_batched]) > 0.85


def test_serialized_needs_a_first_token_wait_of_the_minimum() -> None:
    """Another stream can only have run while `later` waited for its first token, so a TTFT
    under `serialized_min_wait_s` is never serialized, and the earlier records are not even
    read (the check runs on every finished record)."""

    class Unread(list):  # type: ignore[type-arg]
        def __iter__(self):  # type: ignore[no-untyped-def]
            raise AssertionError("earlier records read")

    a = timed("A", 0.0, 0.1, 2.0)
    edge = TH.serialized_min_wait_s
    assert find_serialized(timed("B", 0.5, 0.5 + edge - 0.001, 4.0), Unread([a]), TH) is None
    found = find_serialized(timed("B", 0.9, 2.05, 4.0), [a], TH)  # waited 1.15 s, 1.1 s of it for A
    assert found is not None and found.kind == "serialized"


def test_superlinear_prefill() -> None:
    def p(size: int, tps: float) -> Record:
        return rec(prompt_tokens=size, prefill_tps=tps)

    linear = [p(100, 500), p(4000, 1800), p(32000, 2000), p(53000, 2000)]
    assert prefill_scaling(linear, TH) is None
    quad = [p(100, 500), p(4000, 1800), p(32000, 900), p(53000, 500)]
    found = prefill_scaling(quad, TH)
    assert found is not None and found.kind == "superlinear_prefill" and "4000" in found.evidence
    assert prefill_scaling([p(4000, 1800), p(53000, 601)], TH) is None  # 2.99x
    assert prefill_scaling([p(4000, 1800), p(53000, 599)], TH) is not None


def test_prefill_is_judged_on_uncached_incremental_prompts_only() -> None:
    """A cache hit makes prefill look fast and `superlinear_prefill` fire on nothing: the
    sizes are uncached prompt tokens, and mostly cached or non-incremental records are out."""
    from mlxproxy.core.detect import prefill_judgeable

    def p(size: int, tps: float, cached: int | None = None, anomalies: tuple[str, ...] = ()) -> Record:
        return rec(prompt_tokens=size, prefill_tps=tps, cached_tokens=cached, anomalies=anomalies)

    assert prefill_judgeable(p(1000, 900, cached=500)) and not prefill_judgeable(p(1000, 900, cached=501))
    assert not prefill_judgeable(p(1000, 900, anomalies=("non_incremental_stream",)))
    # the large prompt's rate comes from a cache hit (its uncached part is tiny): not judged
    cached_hit = [p(100, 500), p(4000, 1800), p(53000, 100, cached=52990)]
    assert prefill_scaling(cached_hit, TH) is None
    # a non-incremental server: TTFT is the whole reply, its "prefill rate" means nothing
    held = [p(100, 500), p(4000, 1800), p(53000, 100, anomalies=("non_incremental_stream",))]
    assert prefill_scaling(held, TH) is None
    # sizes are uncached tokens: 53000 with ~26000 cached is judged as a ~27000-token prefill
    assert prefill_scaling([p(4000, 1800), p(53000, 500, cached=26000), p(53000, 500, cached=26400)], TH) is not None
    assert prefill_scaling([p(4000, 1800), p(4400, 500, cached=0)], TH) is None  # too close in size to judge


NORMAL_FIXTURES = [
    "wire/01_openai_reference_include_usage.sse",
    "wire/02_mlx_lm_server_reasoning_keepalive.sse",
    "wire/03_mlx_openai_server.sse",
    "wire/05_mlx_omni_server_include_usage.sse",
    "wire/06_vllm_mlx_reasoning_usage_twice.sse",
    "wire/09_omlx_keepalive_usage_timings.sse",
    "wire/11_rapid_mlx_fast_path.sse",
    "wire/17a_tool_calls_incremental.sse",
    "real/mlx_lm_server_stream_usage.sse",
    "real/mlx_openai_server_chat_stream_usage.sse",
    "real/rapid_mlx_chat_stream_usage.sse",
    "real/vllm_mlx_chat_stream_300tok.sse",
]


@pytest.mark.parametrize("name", NORMAL_FIXTURES)
def test_normal_fixtures_raise_no_anomaly(name: str) -> None:
    body = read_fixture(name)
    asked = b'"usage": {' in body or b'"usage":{' in body  # ask for usage where the recorded client did
    req = b'{"model":"m","stream":true' + (b',"stream_options":{"include_usage":true}}' if asked else b"}")
    info, _ = parse_request("POST", "/v1/chat/completions", req)
    m = RequestMeter(info, request_id="r", upstream="u", t_start=0.0, started_at=0.0)
    m.response_started(0.01, 200, "text/event-stream")
    events = [e + b"\n\n" for e in body.split(b"\n\n") if e]
    for i, e in enumerate(events):  # one event every 20 ms, as a healthy server streams
        m.feed(e, 0.1 + 0.02 * i)
    r = m.finish(0.1 + 0.02 * len(events))
    found = check_record(r, TH, chars=r.generated_chars)
    assert found == [], found


def test_dual_reasoning_fixture_is_named() -> None:
    body = read_fixture("wire/13_mlx_vlm_nulls_dual_reasoning_timings.sse")
    info, _ = parse_request("POST", "/v1/chat/completions", b'{"model":"m","stream":true}')
    m = RequestMeter(info, request_id="r", upstream="u", t_start=0.0, started_at=0.0)
    m.response_started(0.01, 200, "text/event-stream")
    m.feed(body, 0.5)
    assert [a.kind for a in check_record(m.finish(0.6), TH)] == ["dual_reasoning_fields"]


def test_quoted_error_text_is_cut_after_a_whole_word() -> None:
    """The server's error text quoted in a `stream_error` evidence is cut after a whole word
    (or punctuation), never inside a word or a number."""
    words = "the engine stopped because worker 18999 of pool 42 lost its connection to the scheduler " * 4
    r = rec(outcome="stream_error", error=words)
    (ev,) = [a.evidence for a in check_record(r, TH) if a.kind == "stream_error"]
    quoted = ev.split("stream: ", 1)[1]
    assert quoted.endswith("…") and len(quoted) <= 160
    assert words.startswith(quoted[:-1]) and words[len(quoted) - 1] == " ", quoted  # the next character was a space


def test_missing_finish_says_how_the_stream_ended() -> None:
    """The evidence names the end the stream really had: `[DONE]` for chat, the API's own end
    event for Messages/Responses, or none (cut short). vllm-mlx 0.6.0's Responses stream, refused
    while its simple engine is busy, sends `response.created` and `response.in_progress` and stops:
    no end event, which an earlier wording called "ended with [DONE]"."""

    def evidence(**kw: object) -> str:
        return check_record(rec(outcome="truncated", **kw), TH)[0].evidence

    assert evidence(events=2, generated_events=0, endpoint="responses").startswith(
        "stream ended without an end-of-stream event after 0 generated events"
    )
    assert evidence(events=5, generated_events=4, tail_after_done_s=0.0).startswith("stream ended with [DONE] after 4")
    assert evidence(events=5, generated_events=3, endpoint="messages", tail_after_done_s=0.0).startswith(
        "stream ended with its end-of-stream event after 3"
    )
