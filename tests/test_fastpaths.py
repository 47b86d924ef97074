"""The metering fast paths give exactly what the general paths give.

Each shortcut (here: the SSE decoder's whole-`data:`-event path) is compared with the code
it shortcuts, on the recorded fixtures and on generated input. The fast paths are also
checked to be taken on the inputs they exist for, so these comparisons never pass
vacuously. No timing here: performance is measured by benchmarks/bench_meter.py.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlxproxy.core.sse import DEFAULT_MAX_LINE_BYTES, SSEDecoder, SSEEvent

from conftest import FIXTURES, splits

SSE_FIXTURES = sorted(str(p.relative_to(FIXTURES)) for p in FIXTURES.glob("*/*.sse"))


# -- SSE decoder ---------------------------------------------------------------------


class GeneralDecoder(SSEDecoder):
    """The decoder with its fast path off: every read goes through the general rules."""

    __slots__ = ()

    def feed(self, data: bytes) -> list:
        return self._feed_general(data)


class CountingDecoder(SSEDecoder):
    """The real decoder, counting the reads (or rests of reads) left to the general path."""

    __slots__ = ("general_calls",)

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.general_calls = 0

    def _feed_general(self, data: bytes) -> list:
        self.general_calls += 1
        return super()._feed_general(data)


def state(dec: SSEDecoder) -> tuple:
    return tuple(getattr(dec, k) for k in SSEDecoder.__slots__)


def assert_same_decoding(parts: list[bytes], max_line_bytes: int = DEFAULT_MAX_LINE_BYTES) -> None:
    """Fast and general decoders agree after every read: items (offsets included),
    `safe_offset` and every bit of state; and at `close()`."""
    fast, ref = SSEDecoder(max_line_bytes), GeneralDecoder(max_line_bytes)
    for k, p in enumerate(parts):
        assert fast.feed(p) == ref.feed(p), (k, parts)
        assert fast.safe_offset == ref.safe_offset, (k, parts)
        assert state(fast) == state(ref), (k, parts)
    assert fast.close() == ref.close(), parts
    assert state(fast) == state(ref), parts


def cut(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c for c in cuts if 0 < c < len(data)})
    parts, prev = [], 0
    for c in points + [len(data)]:
        parts.append(data[prev:c])
        prev = c
    return parts


PIECES = [
    b"data: ", b"data:", b"data", b"data: {\"a\":1}", b"data: x", b"data:  two spaces", b"event: x", b"event:",
    b"id: 7", b"id: a\x00b", b"id", b"retry: 30", b"retry: 3x", b": keepalive 1/2", b":", b"foo: bar", b"x",
    b"\n", b"\n", b"\n", b"\n\n", b"\r", b"\r\n", b"\r\n\r\n", " é☃🦙".encode(), b"\xc3", b"\xa9", b"\xef\xbb\xbf",
    b"[DONE]", b" ",
]
DATA_EVENT = st.text(max_size=12).map(lambda s: b"data: " + s.replace("\r", "").replace("\n", "").encode() + b"\n\n")
STREAM = st.lists(st.one_of(DATA_EVENT, DATA_EVENT, st.sampled_from(PIECES), st.binary(max_size=6)),
                  max_size=30).map(b"".join)
MAX_LINE = st.sampled_from([1, 4, 8, 16, 64, DEFAULT_MAX_LINE_BYTES])


@settings(max_examples=600, deadline=None)
@given(STREAM, st.lists(st.integers(min_value=0, max_value=400), max_size=12), MAX_LINE)
def test_decoder_fast_path_equals_general_path(body: bytes, cuts: list[int], max_line: int) -> None:
    assert_same_decoding(cut(body, cuts), max_line)


@settings(max_examples=600, deadline=None)
@given(st.lists(st.tuples(st.one_of(DATA_EVENT, st.sampled_from(PIECES), st.binary(max_size=6)), st.booleans()),
                max_size=30), MAX_LINE)
def test_decoder_fast_path_equals_general_path_reads_at_piece_boundaries(pieces: list, max_line: int) -> None:
    """Reads that start and end where lines, fields and events do: every state the
    general path can leave between reads is met by a read that starts with `data: `."""
    parts, cur = [], b""
    for piece, cut_after in pieces:
        cur += piece
        if cut_after:
            parts.append(cur)
            cur = b""
    assert_same_decoding([*parts, cur], max_line)


@pytest.mark.parametrize(
    "parts,max_line",
    [
        ([b"data: a\rb\n\n"], None),  # a CR ends a line too
        ([b"data: a\r\n\n"], None),
        ([b"data: a\n\r\n"], None),
        ([b"data: a\n\ndata: b\r\n\r\n"], None),
        ([b"data: a\r", b"data: b\n\n"], None),  # a CR at the end of the previous read
        ([b"data: a\r", b"\ndata: b\n\n"], None),
        ([b"event: x\n", b"data: y\n\n"], None),  # an open event
        ([b"id: 1\n", b"data: y\n\n", b"data: z\n\n"], None),
        ([b"retry: 5\n", b"data: y\n\n"], None),
        ([b"data: a\n", b"data: y\n\n"], None),
        ([b"data: a", b"data: y\n\n"], None),  # a partial line held
        ([b": c\n", b"data: y\n\n"], None),
        ([b"\xef\xbb\xbf", b"data: y\n\n"], None),  # the BOM alone, then the first line
        ([b"\n\n", b"data: y\n\n"], None),
        ([b"data: 0123456789\n", b"data: y\n\n", b"data: z\n\n"], 8),  # the rest of a dropped event
        ([b"data: 0123456789", b"data: y\n\n", b"data: z\n\n"], 8),  # inside an over-long line
        ([b"data: 01\n", b"data: 0123\n", b"data: 0\n\n", b"data: y\n\n"], 12),  # an over-long event
        ([b"data: y\n\ndata: 0123456789\n\ndata: z\n\n"], 8),
        ([b"data: 01\n\n"], 8),  # exactly at the bound
        ([b"data: 012\n\n"], 8),
        ([b"data: a\n\ndata: b\n\ndata"], None),
        ([b"data: a\n\ndata: b\n\ndata:c\n\n"], None),
        ([b"data: a\n\ndata: b\n"], None),
        ([b"data: a\n\nevent: e\ndata: b\n\n"], None),
        ([b"data: \xff\xc3\n\n", b"data: \xa9\n\n"], None),
        ([b"data: a\n\n\n\ndata: b\n\n"], None),
    ],
)
def test_decoder_fast_path_edge_cases(parts: list[bytes], max_line: int | None) -> None:
    assert_same_decoding(parts, max_line or DEFAULT_MAX_LINE_BYTES)
    assert_same_decoding([b"".join(parts)], max_line or DEFAULT_MAX_LINE_BYTES)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300), st.lists(st.integers(min_value=0, max_value=300), max_size=8), MAX_LINE)
def test_decoder_fast_path_equals_general_path_on_any_bytes(body: bytes, cuts: list[int], max_line: int) -> None:
    assert_same_decoding(cut(body, cuts), max_line)


@settings(max_examples=200, deadline=None)
@given(st.lists(DATA_EVENT, min_size=1, max_size=8), st.lists(st.integers(min_value=0, max_value=200), max_size=4),
       st.sampled_from([PIECES[0], b"", b": c\n", b"\n", b"\r\n", b"\xef\xbb\xbf", b"id: 1\n", b"data: a\n"]))
def test_decoder_fast_path_equals_general_path_after_any_prefix(events: list[bytes], cuts: list[int], prefix: bytes) -> None:
    """Runs of whole data events (the fast path's input) after whatever came before them."""
    body = b"".join(events)
    assert_same_decoding([prefix, *cut(body, cuts)])
    assert_same_decoding([prefix + body])


@pytest.mark.parametrize("name", SSE_FIXTURES)
def test_decoder_fast_path_equals_general_path_on_fixtures(name: str) -> None:
    body = (FIXTURES / name).read_bytes()
    for parts in splits(body, seed=len(body), tries=20):
        assert_same_decoding(parts)
    assert_same_decoding([body], max_line_bytes=100)
    events = [i for i in SSEDecoder().feed(body) if isinstance(i, SSEEvent)]
    assert [(e.start, e.end) for e in events] == [(e.start, e.end) for e in GeneralDecoder().feed(body) if isinstance(e, SSEEvent)]
    assert [body[e.start : e.end].startswith((b"data:", b"event:", b"id:")) for e in events] == [True] * len(events)


def test_decoder_fast_path_is_taken_on_whole_data_events() -> None:
    dec = CountingDecoder()
    reads = [b'data: {"k":%d}\n\n' % k for k in range(50)] + [b'data: {"a":1}\n\ndata: {"b":2}\n\n']
    items = [it for r in reads for it in dec.feed(r)]
    assert dec.general_calls == 0
    end = sum(map(len, reads))
    assert len(items) == 52 and items[-1] == SSEEvent('{"b":2}', end, start=end - len(b'data: {"b":2}\n\n'))
    # a comment, a CR or a partial line sends (the rest of) the read to the general path
    for read in (b": ping\n\n", b"data: x\r\n\r\n", b"data: y\n\ndata: partial"):
        before = dec.general_calls
        dec.feed(read)
        assert dec.general_calls == before + 1, read
