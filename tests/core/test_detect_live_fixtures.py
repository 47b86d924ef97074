"""Every detector on the bytes the live servers really sent (tests/fixtures/live, recorded
with the rigged tiny model: README there). Each recorded case goes through the sans-I/O
core with scripted timestamps (one event every 20 ms), without and with a tokenizer, and
must raise exactly the anomalies that are true of it, per server: nothing else.

The tokenizer stands in for the rig's own (space-split: every space-led piece of the
rigged answers is one token, so the recount of a text is its number of space-led
pieces), which is what a proxy finds next to a local model folder.
"""

from __future__ import annotations

import json

import pytest

from mlxproxy.core.analyze import finish_checked
from mlxproxy.core.detect import Thresholds
from mlxproxy.core.meter import RequestMeter
from mlxproxy.core.openai import parse_request
from mlxproxy.core.record import Record
from support import FIXTURES

LIVE = FIXTURES / "live"
# the replays below pace events by script (GAP), not as the servers sent them: a server's own speed
# figures (mlx-vlm's `timings`) cannot be held against invented times, so they are not judged here
TH = Thresholds(speed_claim_ratio=float("inf"))
GAP = 0.02


def rig_tokenizer(text: str) -> int:
    """The rig's tokenizer, near enough: one token per space-led piece."""
    return len([p for p in text.replace(" ", "\0 ").split("\0") if p])


def status_and_type(server: str, case: str) -> tuple[int, str | None]:
    lines = (LIVE / server / f"{case}.headers").read_text().splitlines()
    ctype = next((ln.split(":", 1)[1].strip() for ln in lines if ln.lower().startswith("content-type:")), None)
    return int(lines[0].split()[1]), ctype


def body_of(server: str, case: str) -> bytes:
    for ext in (".sse", ".json"):
        p = LIVE / server / f"{case}{ext}"
        if p.exists():
            return p.read_bytes()
    raise FileNotFoundError(f"{server}/{case}")


def replay(
    server: str,
    case: str,
    *,
    t0: float = 0.0,
    count_tokens=None,
    outcome: str | None = None,
    earlier=(),
    first_at: float = 0.1,
    gap: float = GAP,
    tail_s: float = 0.0,
    rid: str | None = None,
) -> Record:
    """One recorded exchange through the shared finish path: the request at t0, the headers
    5 ms later, the first event at t0 + first_at, then one event every `gap` (a JSON body
    at once); the record ends `tail_s` after the last read."""
    req = (LIVE / server / f"{case}.request.json").read_bytes()
    status, ctype = status_and_type(server, case) if (LIVE / server / f"{case}.headers").exists() else (200, None)
    raw = body_of(server, case)
    if ctype is None:
        ctype = "text/event-stream" if raw.lstrip()[:1] in (b":", b"d") else "application/json"
    info, _ = parse_request("POST", "/v1/chat/completions", req)
    m = RequestMeter(info, request_id=rid or f"{server}/{case}", upstream=server, t_start=t0, started_at=t0)
    m.upstream_sent(t0 + 0.001)
    m.response_started(t0 + 0.005, status, ctype)
    t = t0 + first_at
    if ctype.startswith("text/event-stream"):
        for e in (x + b"\n\n" for x in raw.split(b"\n\n") if x.strip()):
            m.feed(e, t)
            t += gap
        t -= gap
    else:
        m.feed(raw, t)
    return finish_checked(m, t + 0.001 + tail_s, TH, count_tokens=count_tokens, outcome=outcome, earlier=earlier)


CASES = (
    "tool_stream",
    "tool_nonstream",
    "tool_cut_stream",
    "tool_cut_nonstream",
    "stop_at_max_stream",
    "stop_at_max_nonstream",
    "stop_at_words_stream",
    "reasoning_stream",
    "reasoning_nonstream",
    "context_refusal_stream",
    "context_refusal_nonstream",
)

#: what is true of each server's answers (README of the fixtures, docs/VERIFIED.md); every
#: case not listed must raise nothing
EXPECTED: dict[str, dict[str, set[str]]] = {
    "mlx-lm": {
        "tool_cut_stream": {"truncated_tool_call"},  # finish length, usage 8, nothing streamed
    },
    "vllm-mlx": {
        "tool_cut_stream": {"truncated_tool_call"},
        "tool_cut_nonstream": {"tool_call_in_content"},  # the cut markup returned as content
    },
    "vllm-mlx-cb": {
        "tool_cut_stream": {"truncated_tool_call"},
        "tool_cut_nonstream": {"tool_call_in_content"},
        "stop_at_max_stream": {"reasoning_only"},  # a think-less answer streamed as reasoning_content, finish stop
    },
    "mlx-openai-server": {
        # never says `length`: every cut at max_tokens is unreported
        "tool_cut_stream": {"truncated_tool_call", "unreported_length"},
        "tool_cut_nonstream": {"tool_call_in_content"},
        "stop_at_words_stream": {"unreported_length"},
        "context_refusal_stream": {"unreported_length"},  # not refused; cut at max_tokens 16, finish stop
    },
    "rapid-mlx": {
        "tool_cut_stream": {"truncated_tool_call"},
        "context_refusal_stream": {"context_limit"},
        "context_refusal_nonstream": {"context_limit"},
    },
    "rapid-mlx-bare": {
        "tool_stream": {"tool_call_in_content"},
        "tool_cut_stream": {"tool_call_in_content"},
        "tool_cut_nonstream": {"tool_call_in_content"},
        "reasoning_stream": {"reasoning_in_content"},
        "context_refusal_stream": {"context_limit"},
        "context_refusal_nonstream": {"context_limit"},
    },
    "mlx-vlm": {
        "tool_cut_stream": {"stream_error"},  # {"error": "Generation ended with an incomplete tool call."}
        "tool_cut_nonstream": {"tool_call_in_content"},
        "reasoning_stream": {"dual_reasoning_fields"},  # `reasoning` and `reasoning_content` in each delta
        "context_refusal_stream": {"context_limit"},
        "context_refusal_nonstream": {"context_limit"},
    },
}


@pytest.mark.parametrize("tokenizer", [None, rig_tokenizer], ids=["no-tokenizer", "tokenizer"])
@pytest.mark.parametrize("server", sorted(EXPECTED))
def test_each_live_case_raises_exactly_what_is_true(server: str, tokenizer) -> None:
    wrong = {}
    for case in CASES:
        r = replay(server, case, count_tokens=tokenizer)
        expected = EXPECTED[server].get(case, set())
        if set(r.anomalies) != expected:
            wrong[case] = (sorted(r.anomalies), sorted(expected), r.anomaly_evidence)
    assert not wrong, wrong


@pytest.mark.parametrize("server", sorted(EXPECTED))
def test_tool_calls_are_recounted_and_never_a_burst(server: str) -> None:
    """The 39-token write_file call (usage 40 with EOS) is counted by the tokenizer with its
    name and arguments, and a call sent whole is not a non-incremental stream."""
    r = replay(server, "tool_stream", count_tokens=rig_tokenizer)
    if server == "rapid-mlx-bare":  # no parser: the call is text in the content
        assert r.tool_calls == 0 and r.completion_tokens_tokenizer is not None
        return
    assert r.tool_calls == 1 and r.tool_calls_valid == 1
    assert "non_incremental_stream" not in r.anomalies, r.anomaly_evidence
    assert r.completion_tokens_reported == 40
    assert 30 <= r.completion_tokens_tokenizer <= 44, r.completion_tokens_tokenizer
    assert r.tokens_source == "usage"


@pytest.mark.parametrize("server", ["mlx-lm", "mlx-openai-server", "rapid-mlx", "mlx-vlm", "vllm-mlx-cb"])
def test_natural_stop_at_max_tokens_is_not_a_cut(server: str) -> None:
    """20 words + EOS with max_tokens 21: usage 21 (EOS counted), the model stopped on its own."""
    for tokenizer in (None, rig_tokenizer):
        r = replay(server, "stop_at_max_stream", count_tokens=tokenizer)
        assert r.max_tokens == 21 and r.completion_tokens_reported == 21
        assert "unreported_length" not in r.anomalies, r.anomaly_evidence


def test_mlx_vlm_context_refusal_is_a_context_limit() -> None:
    for case in ("context_refusal_stream", "context_refusal_nonstream"):
        r = replay("mlx-vlm", case)
        assert (r.status, r.outcome) == (400, "context_limit")
        assert "available context budget" in r.anomaly_evidence["context_limit"]


def test_mlx_openai_server_prefill_with_cached_tokens_above_prompt_tokens() -> None:
    """Its non-streamed usage says prompt_tokens 1, cached_tokens 190: a rate is never negative."""
    r = replay("mlx-openai-server", "tool_nonstream")
    assert (r.prompt_tokens, r.cached_tokens) == (1, 190)
    for case in CASES:
        for server in EXPECTED:
            rec = replay(server, case)
            assert rec.prefill_tps is None or rec.prefill_tps > 0, (server, case, rec.prefill_tps)


# -- a disconnect, then the next request (timings from each server's cases.json) -------------


def disconnect_then_next(server: str) -> Record:
    """Two earlier answers (the upstream's usual TTFT), then `disconnect_stream`: its client
    read 5 events and closed `closed_after_s` after sending; the next request was sent at
    once and got its first text `next_request_first_content_s` later."""
    timing = json.loads((LIVE / server / "cases.json").read_text())["disconnect"]
    usual = [replay(server, "stop_at_max_stream", t0=-10.0 + i, rid=f"U{i}") for i in range(2)]
    closed = timing["closed_after_s"]
    n_items = len([x for x in body_of(server, "disconnect_stream").split(b"\n\n") if x.strip()])
    gap = closed / 2 / n_items  # the reads spread over the second half, the last one a gap before the close
    a = replay(
        server,
        "disconnect_stream",
        t0=0.0,
        outcome="client_disconnect",
        earlier=usual,
        first_at=closed / 2,
        gap=gap,
        tail_s=gap - 0.001,
        rid="A",
    )
    assert a.outcome == "client_disconnect" and a.t_end_mono == pytest.approx(closed, abs=0.01)
    first = timing["next_request_first_content_s"]
    return replay(server, "disconnect_next", t0=closed + 0.002, first_at=first, gap=0.002, earlier=[*usual, a], rid="B")


@pytest.mark.parametrize("server", ["mlx-lm", "vllm-mlx", "rapid-mlx", "mlx-vlm", "mlx-openai-server"])
def test_generation_after_disconnect_only_where_the_server_kept_going(server: str) -> None:
    """mlx-openai-server kept generating (next first text after 3.3 s); the others stopped
    (0.02 s on vllm-mlx and mlx-vlm; 0.49 s on mlx_lm.server, an admission slice; 0.33 s on
    Rapid-MLX)."""
    b = disconnect_then_next(server)
    assert ("generation_after_disconnect" in b.anomalies) == (server == "mlx-openai-server"), b.anomaly_evidence
    assert "serialized" not in b.anomalies
    if server == "mlx-openai-server":
        assert (
            "the server kept generating for a client that had gone" in b.anomaly_evidence["generation_after_disconnect"]
        )


def test_rapid_mlx_body_open_after_done_is_the_tail_not_the_wall_time() -> None:
    """Rapid-MLX's 4-token answer: first text after 0.326 s, the body ended at 0.641 s, long
    after [DONE] (scripted here 2 ms after the last event)."""
    timing = json.loads((LIVE / "rapid-mlx" / "cases.json").read_text())["disconnect"]
    first, total = timing["next_request_first_content_s"], timing["next_request_total_s"]
    raw = body_of("rapid-mlx", "disconnect_next")
    n_events = len([x for x in raw.split(b"\n\n") if x.strip()])
    t_done = first + (n_events - 1) * 0.002
    r = replay("rapid-mlx", "disconnect_next", first_at=first, gap=0.002, tail_s=total - t_done - 0.001)
    assert r.duration_s == pytest.approx(total)
    assert r.tail_after_done_s == pytest.approx(total - t_done, abs=1e-6)
    assert r.wall_tps == pytest.approx(r.completion_tokens / t_done)
    assert r.wall_tps > 1.8 * r.completion_tokens / total  # was understated ~2x here (4-7x in bench runs)
