"""The recordings of tests/fixtures/native/ (Ollama and LM Studio, built from their documented
formats: README there), metered as they arrived, read by read, and at random cuts within reads."""

from __future__ import annotations

import json
from typing import Any

import pytest

from mlxproxy.core.analyze import finish_checked
from mlxproxy.core.detect import Thresholds
from mlxproxy.core.meter import RequestMeter
from mlxproxy.core.openai import parse_request
from mlxproxy.core.record import Record
from support import FIXTURES, splits

NATIVE = FIXTURES / "native"
CASES: dict[str, dict[str, Any]] = json.loads((NATIVE / "cases.json").read_text())
SKY = "The sky is blue because of Rayleigh scattering."


def play(name: str, cut: int = 0) -> tuple[Record, bytes, list[float]]:
    """The recording `name` through a meter, each read at its recorded offset (`cut` > 0: each
    read split at random places, all parts at the read's time)."""
    case = CASES[name]
    body = (NATIVE / case["body"]).read_bytes()
    info, _ = parse_request("POST", case["path"], (NATIVE / case["request"]).read_bytes())
    m = RequestMeter(info, request_id=name, upstream="u", t_start=0.0, started_at=0.0, keep_text=True)
    m.upstream_sent(0.0)
    first_t = case["reads"][0][0]
    m.response_started(first_t, case["status"], case["content_type"])
    prev, times = 0, []
    for t, end in case["reads"]:
        chunk = body[prev:end]
        parts = splits(chunk, seed=cut)[2 + cut % 8] if cut and len(chunk) > 1 else [chunk]
        for p in parts:
            m.feed(p, t)
        times.append(t)
        prev = end
    assert prev == len(body)
    return finish_checked(m, times[-1] + 0.0005, Thresholds()), body, times


def ways(name: str) -> list[tuple[Record, bytes, list[float]]]:
    return [play(name, cut) for cut in range(4)]


# the read that carries each stream's first generated item (a line, a delta event)
FIRST = {"lmstudio_v1_chat_stream": 3, "lmstudio_responses_stream": 2, "ollama_messages_stream": 1}


def test_every_recording_cites_its_source_and_is_in_the_readme() -> None:
    readme = (NATIVE / "README.md").read_text()
    for name, case in CASES.items():
        assert case["source"] and f"`{name}`" in readme, name


@pytest.mark.parametrize(
    ("name", "content", "reasoning", "out", "prompt", "cached", "finish"),
    [
        ("ollama_chat_stream", SKY, "", 9, 26, None, "stop"),
        ("ollama_chat_thinking", "The sky is blue because", "Light scatters; blue most.", 11, 26, None, "stop"),
        ("ollama_chat_tool_call", "", "", 12, 163, None, "stop"),
        ("ollama_generate_stream", SKY, "", 9, 15, None, "stop"),
        ("ollama_chat_cached_turn2", "Longer path through air.", "", 5, 1400, 1363, "stop"),
        ("ollama_openai_stream_timings", "Longer path through air, so red.", "", 8, 3100, 3000, "stop"),
        ("ollama_messages_stream", SKY, "", 9, 26, None, "end_turn"),
        ("lmstudio_v0_chat_stream", "Greetings, I'm a helpful AI, here to assist,\n", "", None, None, None, "stop"),
        (
            "lmstudio_v1_chat_stream",
            "Rayleigh scattering makes the sky blue.",
            "Need to answer briefly.",
            12,
            74,
            None,
            "end",
        ),
        ("lmstudio_responses_stream", SKY, "", 9, 18, 0, "completed"),
    ],
)
def test_streams_are_metered_right(
    name: str, content: str, reasoning: str, out: int | None, prompt: int | None, cached: int | None, finish: str
) -> None:
    for r, body, times in ways(name):
        assert r.outcome == "ok", (r.outcome, r.error)
        assert r.stream and r.bytes_out == len(body)
        assert r.response_text == content and (r.reasoning_text or "") == reasoning
        assert r.completion_tokens_reported == out and r.prompt_tokens == prompt and r.cached_tokens == cached
        assert r.finish_reason == finish
        assert r.ttft_s == pytest.approx(times[FIRST.get(name, 0)], abs=0.001)
        if name != "ollama_chat_tool_call":
            assert r.tokens_source == ("usage" if out is not None else "stream")
        if name not in ("ollama_chat_cached_turn2", "ollama_openai_stream_timings"):
            assert r.anomalies == (), (name, r.anomaly_evidence)


def test_ollama_thinking_times_the_answer_apart() -> None:
    r, _, times = play("ollama_chat_thinking")
    assert r.ttfc_s == pytest.approx(times[6], abs=0.001) and r.ttfc_s > r.ttft_s
    assert r.reasoning_tokens_counted == 6


def test_ollama_tool_call_arrives_whole() -> None:
    for r, _, times in ways("ollama_chat_tool_call"):
        assert r.tool_calls == 1 and r.tool_calls_valid == 1 and r.anomalies == ()
        assert r.ttft_s == pytest.approx(times[0], abs=0.001) and r.ttfc_s == r.ttft_s


def test_ollama_native_claims_are_kept_apart() -> None:
    r, _, _ = play("ollama_chat_stream")
    assert r.server_claims["ollama"]["eval_duration"] == 360_000_000
    assert r.server_claims["ollama"]["load_duration"] == 12_300_000


@pytest.mark.parametrize(
    ("name", "claimed", "measured"),
    [("ollama_chat_cached_turn2", "4375", "116"), ("ollama_openai_stream_timings", "3875", "125")],
)
def test_the_two_ollama_rate_traps_are_named_with_both_figures(name: str, claimed: str, measured: str) -> None:
    for r, _, _ in ways(name):
        assert r.anomalies == ("speed_claim_mismatch",), r.anomaly_evidence
        ev = r.anomaly_evidence["speed_claim_mismatch"]
        assert f"claimed prefill {claimed} tok/s" in ev and f"measured {measured} tok/s" in ev, ev


@pytest.mark.parametrize(
    ("name", "content", "out", "prompt", "finish", "claims"),
    [
        ("ollama_chat_nonstream", SKY, 9, 26, "stop", "ollama"),
        ("lmstudio_v0_chat_nonstream", None, 53, 24, "stop", "stats"),
    ],
)
def test_non_streamed_bodies(name: str, content: str | None, out: int, prompt: int, finish: str, claims: str) -> None:
    r, body, _ = play(name)
    assert r.outcome == "ok" and not r.stream and r.bytes_out == len(body)
    assert r.completion_tokens_reported == out and r.prompt_tokens == prompt and r.finish_reason == finish
    assert content is None or r.response_text == content
    assert claims in r.server_claims
    # LM Studio's documented "max_tokens": -1 means no limit: never a limit reached (unreported_length)
    assert r.anomalies == () and r.max_tokens is None


def test_a_v1_chat_stream_is_not_read_as_chat_completions() -> None:
    """Before: parsed as a Chat Completions stream, `truncated` with `missing_finish`."""
    r, _, _ = play("lmstudio_v1_chat_stream")
    assert r.endpoint == "lmstudio_chat" and r.outcome == "ok" and "missing_finish" not in r.anomalies
    assert r.server_claims["stats"]["tokens_per_second"] == 40.0


def test_a_speed_claim_the_stream_contradicts_is_named() -> None:
    """A decode claim twice the streamed pace (the LM Studio v0 stream, its stats doctored)."""
    case = CASES["lmstudio_v0_chat_stream"]
    body = (NATIVE / case["body"]).read_bytes().replace(b'"tokens_per_second":48.0', b'"tokens_per_second":480.0')
    info, _ = parse_request("POST", case["path"], (NATIVE / case["request"]).read_bytes())
    m = RequestMeter(info, request_id="x", upstream="u", t_start=0.0, started_at=0.0)
    m.response_started(0.1, 200, "text/event-stream")
    prev = 0
    for t, end in case["reads"]:
        end += len(body) - len((NATIVE / case["body"]).read_bytes()) if end == case["reads"][-1][1] else 0
        m.feed(body[prev:end], t)
        prev = end
    r = finish_checked(m, 1.0, Thresholds())
    assert r.anomalies == ("speed_claim_mismatch",)
    assert "claimed decode 480.0 tok/s" in r.anomaly_evidence["speed_claim_mismatch"]
    assert "measured 48.0 tok/s" in r.anomaly_evidence["speed_claim_mismatch"]
