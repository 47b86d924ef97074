"""Messages and Responses streams recorded from the live servers (tests/fixtures/live/*/api/,
README there), metered with scripted timestamps: one event every 10 ms from t = 0.1 s."""

from __future__ import annotations

import json

import pytest

from mlxproxy.core.analyze import finish_checked
from mlxproxy.core.detect import Thresholds
from mlxproxy.core.meter import RequestMeter
from mlxproxy.core.openai import parse_request
from mlxproxy.core.record import Record
from support import FIXTURES

TH = Thresholds()
LIVE = FIXTURES / "live"
STEP_S = 0.01


def events(rel: str) -> list[bytes]:
    body = (LIVE / rel).read_bytes()
    return [e + b"\n\n" for e in body.split(b"\n\n") if e.strip()]


def metered(rel: str) -> tuple[Record, list[bytes]]:
    """The recording fed one event at a time, event i at 0.1 + i * STEP_S."""
    req = json.loads((LIVE / rel.replace(".sse", ".request.json")).read_text())
    info, _ = parse_request("POST", req["path"], json.dumps(req["body"]).encode())
    m = RequestMeter(info, request_id="r", upstream="u", t_start=0.0, started_at=0.0)
    m.response_started(0.005, 200, "text/event-stream")
    evs = events(rel)
    for i, e in enumerate(evs):
        m.feed(e, 0.1 + i * STEP_S)
    return finish_checked(m, 0.1 + len(evs) * STEP_S, TH), evs


def first_index(evs: list[bytes], *kinds: bytes) -> int:
    return next(i for i, e in enumerate(evs) if any(b'"type":"' + k + b'"' in e.replace(b": ", b":") for k in kinds))


def test_vllm_mlx_responses_function_call_counted_once() -> None:
    """vllm-mlx 0.6.0's /v1/responses tool call: the call's markup streamed as reasoning text, then a
    function_call item whose `output_item.added` already carries the whole arguments, the same
    arguments again as one delta, and once more in `output_item.done`. The call is one valid call,
    its arguments counted once (no false usage_mismatch, unreported_length or invalid arguments),
    and TTFT is the first reasoning delta (not response.created)."""
    r, evs = metered("vllm-mlx/api/responses_tool_stream.sse")
    assert (r.outcome, r.finish_reason, r.tool_calls, r.tool_calls_valid) == ("ok", "completed", 1, 1)
    assert r.completion_tokens_reported == 40 and r.prompt_tokens == 188
    assert (r.completion_tokens, r.tokens_source) == (40, "usage")
    assert r.anomalies == (), r.anomaly_evidence
    first = first_index(evs, b"response.reasoning_text.delta")
    assert first > first_index(evs, b"response.created")
    assert r.ttft_s == pytest.approx(0.1 + first * STEP_S)
    args = first_index(evs, b"response.function_call_arguments.delta")
    assert r.ttfc_s == pytest.approx(0.1 + args * STEP_S)  # the call is the first answer a client can use


@pytest.mark.parametrize(
    ("name", "endpoint", "max_tokens", "tools"),
    [("claude_code_2.1.332_messages", "messages", 32000, 12), ("codex_0.171.0_responses", "responses", None, 8)],
)
def test_agent_cli_requests_parse(name: str, endpoint: str, max_tokens: int | None, tools: int) -> None:
    """Claude Code's and Codex's real requests (tests/fixtures/clients/, recorded through the proxy
    by tests/integration/test_agent_clis.py): the API, the stream flag, the limit and the tools are
    read from them, and the prefix tracker can follow their conversation."""
    from mlxproxy.core.prefix import fingerprint

    head, _, body = (FIXTURES / "clients" / f"{name}.req").read_bytes().partition(b"\r\n\r\n")
    method, target, _ = head.split(b"\r\n", 1)[0].decode().split(" ")
    info, _ = parse_request(method, target.split("?", 1)[0], body)  # the proxy leaves the query out
    assert (info.endpoint, info.model, info.stream, info.max_tokens) == (endpoint, "rigged", True, max_tokens)
    assert len(info.tools or ()) == tools
    assert fingerprint(info.endpoint, info.prompt_obj) is not None
