"""The meter's figures from scripted timestamps: exact, no clock involved."""

from __future__ import annotations

import subprocess
import sys

import orjson
import pytest

from mlxproxy.core.analyze import finish_checked
from mlxproxy.core.detect import Thresholds
from mlxproxy.core.meter import RequestMeter
from mlxproxy.core.openai import inject_include_usage, is_injected_usage_chunk, parse_request

REQ = b'{"model":"qwen","stream":true,"max_tokens":64,"messages":[{"role":"user","content":"hello"}]}'


def chunk(
    delta: dict | None = None, finish: str | None = None, usage: dict | None = None, choices: bool = True
) -> bytes:
    obj: dict = {"id": "x", "object": "chat.completion.chunk"}
    obj["choices"] = [{"index": 0, "delta": delta or {}, "finish_reason": finish}] if choices else []
    if usage is not None:
        obj["usage"] = usage
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def meter(t0: float = 100.0) -> RequestMeter:
    info, _ = parse_request("POST", "/v1/chat/completions", REQ)
    return RequestMeter(info, request_id="r", upstream="u", t_start=t0, started_at=1.7e9)


def record(m: RequestMeter, t_end: float):
    """The meter's record: its speeds follow the trusted count the checks settle."""
    return finish_checked(m, t_end, Thresholds())


def test_exact_ttft_tpot_decode_wall() -> None:
    m = meter()
    m.upstream_sent(100.001)
    m.response_started(100.010, 200, "text/event-stream; charset=utf-8")
    m.feed(b": keepalive 10/20\n\n", 100.1)
    m.feed(chunk({"role": "assistant"}), 100.2)  # role-only: not a token
    m.feed(chunk({"reasoning_content": "a"}), 100.5)  # first token
    for i in range(1, 9):  # 8 more tokens, 0.1 s apart
        m.feed(chunk({"content": f"t{i}"}), 100.5 + 0.1 * i)
    m.feed(chunk({}, finish="stop"), 101.35)
    m.feed(
        chunk(
            choices=False,
            usage={"prompt_tokens": 100, "completion_tokens": 9, "prompt_tokens_details": {"cached_tokens": 40}},
        ),
        101.4,
    )
    m.feed(b"data: [DONE]\n\n", 101.45)
    r = record(m, 101.5)
    assert r.outcome == "ok"
    assert r.ttfb_s == pytest.approx(0.1)
    assert r.ttft_s == pytest.approx(0.5)
    assert r.ttfc_s == pytest.approx(0.6)
    assert r.e2e_s == pytest.approx(1.3)
    assert r.headers_s == pytest.approx(0.010)
    assert r.completion_tokens_reported == 9 and r.completion_tokens_counted == 9
    assert r.tpot_s == pytest.approx(0.1)  # (1.3 - 0.5) / (9 - 1)
    assert r.decode_tps == pytest.approx(10.0)
    assert r.wall_tps == pytest.approx(9 / 1.45)  # to [DONE]: the body's last 50 ms after it are the tail
    assert r.tail_after_done_s == pytest.approx(0.05)
    assert r.prefill_tps == pytest.approx((100 - 40) / 0.5)
    assert r.reasoning_tokens_counted == 1
    assert r.event_gaps_s() == pytest.approx([0.1] * 8)
    assert r.event_offsets_s[0] == pytest.approx(0.5)


def test_reported_tokens_win_over_counted_for_n_out() -> None:
    m = meter(0.0)
    m.response_started(0.0, 200, "text/event-stream")
    m.feed(chunk({"content": "a"}), 1.0)
    m.feed(chunk({"content": "b"}), 2.0)
    m.feed(chunk({}, finish="length", usage={"completion_tokens": 5}), 2.0)
    r = record(m, 4.0)
    assert r.outcome == "ok_no_done"
    assert r.decode_tps == pytest.approx(4.0)  # (5 - 1) / 1 s
    assert r.wall_tps == pytest.approx(5 / 4.0)


def test_single_token_has_no_tpot_and_no_token_has_no_ttft() -> None:
    m = meter(0.0)
    m.response_started(0.0, 200, "text/event-stream")
    m.feed(chunk({"content": "a"}, finish="stop"), 1.0)
    r = record(m, 2.0)
    assert r.tpot_s is None and r.decode_tps is None and r.ttft_s == 1.0
    m = meter(0.0)
    m.response_started(0.0, 200, "text/event-stream")
    m.feed(b"data: [DONE]\n\n", 1.0)
    r = record(m, 2.0)
    assert r.ttft_s is None and r.e2e_s == 2.0 and r.outcome == "truncated"


@pytest.mark.parametrize(
    "body,outcome",
    [
        (
            chunk({"content": "a"})
            + b'data: {"error":{"message":"queue full","code":"429"}}\n\n'
            + chunk({}, "stop")
            + b"data: [DONE]\n\n",
            "stream_error",
        ),
        (chunk({"content": "a"}) + b'data: {"error":"boom"}\n\n', "stream_error"),
        (chunk({"content": "a"}) + b"data: [DONE]\n\n", "truncated"),
        (chunk({"content": "a"}), "truncated"),
        (chunk({"content": "a"}) + b"data: {not json\n\n" + chunk({}, "stop") + b"data: [DONE]\n\n", "protocol_error"),
        (chunk({"content": "a"}, "stop"), "ok_no_done"),
    ],
)
def test_outcomes(body: bytes, outcome: str) -> None:
    m = meter(0.0)
    m.response_started(0.0, 200, "text/event-stream")
    m.feed(body, 1.0)
    assert m.finish(2.0).outcome == outcome


def test_after_done_nothing_is_metered() -> None:
    m = meter(0.0)
    m.response_started(0.0, 200, "text/event-stream")
    m.feed(chunk({"content": "a"}, "stop") + b"data: [DONE]\n\n" + chunk({"content": "late"}), 1.0)
    r = m.finish(2.0)
    assert r.generated_events == 1 and r.outcome == "ok"


def test_http_errors_and_transport_overrides() -> None:
    m = meter(0.0)
    m.response_started(0.1, 404, "application/json")
    m.feed(b'{"error": "model not found"}', 0.2)
    r = m.finish(0.3)
    assert (r.outcome, r.error, r.status) == ("http_error", "model not found", 404)
    m = meter(0.0)
    m.response_started(0.1, 422, "application/json")
    m.feed(b'{"detail":[{"loc":["body"],"msg":"field required"}]}', 0.2)
    assert m.finish(0.3).error == "field required"
    m = meter(0.0)
    r = m.finish(0.3, outcome="upstream_unreachable", error="connection refused")
    assert r.outcome == "upstream_unreachable" and r.status is None


def test_duplicate_terminal_content_is_not_counted() -> None:
    m = meter(0.0)
    m.response_started(0.0, 200, "text/event-stream")
    for i, piece in enumerate(["Hel", "lo", "!"]):
        m.feed(chunk({"content": piece}), 1.0 + i)
    m.feed(chunk({"content": "Hello!"}, "stop"), 5.0)
    r = m.finish(6.0)
    assert r.duplicate_content and r.generated_events == 3 and r.e2e_s == 3.0


def test_usage_injection_splices_and_detects() -> None:
    info, obj = parse_request("POST", "/v1/chat/completions", REQ)
    assert obj is not None and not info.usage_requested
    new = inject_include_usage(REQ, obj)
    assert new == REQ[:-1] + b',"stream_options":{"include_usage":true}}'
    body = b'{"stream":true,"stream_options":{"foo":1}}'
    _, obj2 = parse_request("POST", "/v1/chat/completions", body)
    assert orjson.loads(inject_include_usage(body, obj2 or {}))["stream_options"] == {"foo": 1, "include_usage": True}
    assert is_injected_usage_chunk('{"choices":[],"usage":{"completion_tokens":1}}')
    assert not is_injected_usage_chunk('{"choices":[{"index":0}],"usage":{"completion_tokens":1}}')


def test_core_imports_no_io_or_clock() -> None:
    """The core reads no clock and does no I/O: neither its own imports nor what they pull in."""
    import ast
    from pathlib import Path

    import mlxproxy.core as core

    forbidden = {"asyncio", "httpx", "starlette", "uvicorn", "time", "socket", "prometheus_client", "threading"}
    for path in Path(core.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                assert name.split(".")[0] not in forbidden, f"{path.name} imports {name}"
    code = (
        "import sys; before = set(sys.modules); import mlxproxy.core\n"
        "new = {m.split('.')[0] for m in set(sys.modules) - before}\n"
        "print(','.join(sorted(new & {'asyncio','httpx','starlette','uvicorn','socket','prometheus_client','threading'})))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "", f"importing the core pulled in: {out}"


def test_the_meter_has_a_small_read_only_surface() -> None:
    """Like h11's Connection: inputs through methods, state read through read-only properties."""
    m = meter()
    assert [name for name in vars(m) if not name.startswith("_")] == []
    inputs = {"upstream_sent", "response_started", "feed", "strip", "feed_forwarded", "stop", "fail", "finish"}
    reads = {"request", "request_id", "upstream", "t_start", "started_at", "sse", "done", "stream_error", "failure"}
    reads |= {"generated_events", "snapshot"}
    assert {name for name in dir(RequestMeter) if not name.startswith("_")} == inputs | reads
    for name in reads - {"snapshot"}:
        with pytest.raises(AttributeError):
            setattr(m, name, None)
