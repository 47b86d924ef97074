"""The meter (`core/meter.py`) on any bytes split anywhere: it never raises, stays bounded, and
measures the same however the stream is split (property-based, hypothesis)."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlxproxy.core import meter as meter_module
from mlxproxy.core.meter import RequestMeter
from mlxproxy.core.openai import parse_request
from mlxproxy.core.record import Record
from support import LINE_BOUND, cut, cut_points, held_by_decoder, wire_bytes


def run_meter(
    req: tuple[str, str, bytes], resp: tuple[int, str | None], parts: list[bytes], bound: int = LINE_BOUND
) -> Record:
    info, _ = parse_request(*req)
    m = RequestMeter(
        info, request_id="r", upstream="u", t_start=0.0, started_at=0.0, keep_text=True, max_line_bytes=bound
    )
    m.upstream_sent(0.0)
    m.response_started(0.5, *resp)
    for p in parts:
        m.feed(p, 1.0)  # one timestamp for every read: a split must not change any figure
        if m._decoder is not None:
            line, data = held_by_decoder(m._decoder)
            assert line <= bound and data <= bound
        assert len(m._body) <= meter_module.MAX_BUFFERED_BODY_BYTES
    return m.finish(2.0)


REQUESTS = st.sampled_from(
    [
        ("POST", "/v1/chat/completions", b'{"model":"m","stream":true,"max_tokens":2}'),
        ("POST", "/v1/chat/completions", b'{"model":"m"}'),
        ("POST", "/v1/completions", b'{"stream":true}'),
        ("GET", "/v1/models", b""),
        ("POST", "/x", b"not json"),
    ]
)
RESPONSES = st.sampled_from(
    [
        (200, "text/event-stream"),
        (200, "application/json"),
        (500, "text/html"),
        (400, "application/json"),
        (200, None),
        (404, "text/event-stream; charset=utf-8"),
    ]
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(REQUESTS, RESPONSES, wire_bytes, cut_points)
def test_meter_any_bytes_any_split_never_raises_stays_bounded_and_agrees(
    req,
    resp,
    data: bytes,
    cuts: list[int],
) -> None:
    whole = run_meter(req, resp, [data])
    assert run_meter(req, resp, cut(data, cuts)) == whole
    assert whole.bytes_out == len(data)


def test_meter_non_stream_body_buffer_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(meter_module, "MAX_BUFFERED_BODY_BYTES", 100)
    rec = run_meter(
        ("POST", "/v1/chat/completions", b'{"model":"m"}'), (200, "application/json"), [b'{"a": "' + b"x" * 60] * 5
    )
    assert rec.bytes_out == 5 * 67


chunk_texts = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=6)


@st.composite
def valid_openai_streams(draw) -> tuple[bytes, dict]:
    """A valid chat stream in one of the servers' shapes, and what it must measure to."""
    contents = draw(st.lists(chunk_texts, max_size=8))
    reasonings = draw(st.lists(chunk_texts, max_size=4))
    eol = draw(st.sampled_from([b"\n", b"\r\n", b"\r"]))
    space = draw(st.sampled_from([b" ", b""]))
    comments = draw(st.booleans())
    finish = draw(st.sampled_from([None, "stop", "length"]))
    done = draw(st.booleans())
    events = [{"choices": [{"index": 0, "delta": {"role": "assistant"}}]}]
    events += [{"choices": [{"index": 0, "delta": {"reasoning_content": r}}]} for r in reasonings]
    events += [{"choices": [{"index": 0, "delta": {"content": c}}]} for c in contents]
    if finish:
        events.append({"choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
    events.append(
        {
            "choices": [],
            "usage": {
                "prompt_tokens": 3,
                "completion_tokens": len(contents) + len(reasonings),
                "total_tokens": 3 + len(contents) + len(reasonings),
            },
        }
    )
    body = b""
    for ev in events:
        if comments:
            body += b": keepalive" + eol + eol
        body += b"data:" + space + orjson.dumps(ev) + eol + eol
    if done:
        body += b"data: [DONE]" + eol + eol
    outcome = ("ok" if done else "ok_no_done") if finish else "truncated"
    return body, {
        "generated_events": len(contents) + len(reasonings),
        "reasoning_tokens_counted": len(reasonings),
        "finish_reason": finish,
        "outcome": outcome,
        "completion_tokens_reported": len(contents) + len(reasonings),
        "comments": len(events) if comments else 0,
    }


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(valid_openai_streams(), cut_points)
def test_meter_valid_streams_measure_the_same_whole_and_split(stream, cuts: list[int]) -> None:
    body, expected = stream
    req = ("POST", "/v1/chat/completions", b'{"model":"m","stream":true,"stream_options":{"include_usage":true}}')
    whole = run_meter(req, (200, "text/event-stream"), [body], 4096)
    assert run_meter(req, (200, "text/event-stream"), cut(body, cuts), 4096) == whole
    assert run_meter(req, (200, "text/event-stream"), [body[i : i + 1] for i in range(len(body))], 4096) == whole
    assert {k: getattr(whole, k) for k in expected} == expected


@pytest.mark.parametrize("where", ["comment", "error"])
def test_meter_survives_thousands_of_digits(where: str) -> None:
    digits = b"1" * 5000
    if where == "comment":
        rec = run_meter(
            ("POST", "/v1/chat/completions", b'{"stream":true}'),
            (200, "text/event-stream"),
            [b": keepalive " + digits + b"/2\n\n"],
            10_000,
        )
    else:
        rec = run_meter(
            ("POST", "/v1/chat/completions", b"{}"),
            (400, "application/json"),
            [b'{"error":"' + digits + b' tokens exceeds max context window of 8"}'],
            10_000,
        )
    assert rec is not None
