"""Usage stripping (`core/strip.py`): the same bytes forwarded and the same events however the
stream is split and whatever its line ends (property-based, hypothesis)."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlxproxy.core.sse import SSEDecoder, SSEEvent
from mlxproxy.core.strip import UsageStripper
from support import EVENT_A, LINE_BOUND, cut, cut_points

USAGE_EVENT = b'data: {"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":2,"total_tokens":3}}'
STRIP_PIECES_LF = [
    EVENT_A,
    USAGE_EVENT + b"\n\n",
    b": keepalive\n\n",
    b"id: 5\n",
    b"retry: 10\n",
    b"event: e\n",
    b"\n",
    b"foo\n",
    b"data: a\n",
    b"data: " + b"y" * 100 + b"\n",
    b"z" * 70,
]
STRIP_PIECES_CR = [b"\r\n", USAGE_EVENT + b"\r\n\r\n", b"data: b\r", b"\r"]


def strip_all(parts: list[bytes]) -> tuple[bytes, int]:
    """The proxy's usage-stripping path (`ProxyApp._forward`) on the core alone."""
    dec, stripper, out = SSEDecoder(LINE_BOUND), UsageStripper(), b""
    for p in parts:
        out += stripper.process(p, dec.feed(p), dec.safe_offset)
        assert len(stripper._buf) <= 2 * LINE_BOUND  # an open event and a partial line are held back, within the bound
    return out + stripper.flush(), stripper.stripped


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from(STRIP_PIECES_LF), max_size=12), cut_points)
def test_usage_stripping_forwards_the_same_bytes_however_the_stream_is_split(
    pieces: list[bytes], cuts: list[int]
) -> None:
    data = b"".join(pieces)
    out, stripped = strip_all([data])
    assert strip_all(cut(data, cuts)) == (out, stripped)
    assert out == data.replace(USAGE_EVENT + b"\n\n", b"", stripped) or stripped == 0 or b"data: a\n" in data


def sse_events(data: bytes) -> list[str]:
    dec = SSEDecoder()
    return [e.data for e in dec.feed(data) + dec.close() if isinstance(e, SSEEvent)]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from(STRIP_PIECES_LF + STRIP_PIECES_CR), max_size=12), cut_points)
def test_usage_stripping_gives_the_same_events_with_any_line_ends(pieces: list[bytes], cuts: list[int]) -> None:
    """A CR that ends one read and the LF that starts the next may leave one stray line end
    behind (a blank line: no event); the events the client parses are the same."""
    data = b"".join(pieces)
    out, stripped = strip_all([data])
    out2, stripped2 = strip_all(cut(data, cuts))
    assert stripped2 == stripped and sse_events(out2) == sse_events(out)
