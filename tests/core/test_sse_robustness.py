"""The SSE decoder (`core/sse.py`) on any bytes split anywhere: it never raises, stays bounded and
decodes the same however the stream is split (property-based, hypothesis)."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings

from mlxproxy.core.sse import SSEEvent
from support import cut, cut_points, decode_all, wire_bytes


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(wire_bytes, cut_points)
def test_decoder_any_bytes_any_split_never_raises_stays_bounded_and_agrees(data: bytes, cuts: list[int]) -> None:
    assert decode_all(cut(data, cuts)) == decode_all([data])


def test_decoder_drops_an_over_long_line_or_event_with_the_rest_of_its_event() -> None:
    long = b"z" * 100
    body = (
        b"data: a\n"
        + long
        + b"\ndata: b\n\n"  # a long line inside an event: the whole event goes
        + b"data: c\n\n"
        + b"data: 0123456789\n" * 10
        + b"\n"  # an event over the bound in many short lines
        + b"id: 1\n"
        + b"junk\n" * 20
        + b"\n"  # ... or in lines that are not data
        + b"data: d\n\n"
    )
    for parts in [[body], [body[i : i + 1] for i in range(len(body))], cut(body, [5, 9, 50, 101, 130, 200])]:
        out = decode_all(parts)
        assert [type(x).__name__ for x in out] == [
            "SSEProtocolError",
            "SSEEvent",
            "SSEProtocolError",
            "SSEProtocolError",
            "SSEEvent",
        ]
        assert [x.data for x in out if isinstance(x, SSEEvent)] == ["c", "d"]
    assert decode_all([b"\xef\xbb\xbf\n"]) == []  # a BOM alone is a blank line (it raised IndexError)
    digits = b"retry: " + b"9" * 5000 + b"\ndata: e\n\n"  # int() refuses this many digits
    (event,) = decode_all([digits], bound=10_000)
    assert event.data == "e" and event.retry is None
