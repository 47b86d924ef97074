from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlxproxy.core.sse import SSEComment, SSEDecoder, SSEEvent, SSEProtocolError
from support import splits


def decode(parts: list[bytes], **kw) -> list:
    dec = SSEDecoder(**kw)
    out = []
    for p in parts:
        out.extend(dec.feed(p))
    out.extend(dec.close())
    return out


def simple(items: list) -> list:
    res = []
    for it in items:
        if isinstance(it, SSEEvent):
            res.append(("event", it.data, it.event, it.id, it.retry))
        elif isinstance(it, SSEComment):
            res.append(("comment", it.text))
        else:
            res.append(("error",))
    return res


@pytest.mark.parametrize("eol", [b"\n", b"\r", b"\r\n"])
def test_line_endings_give_same_events(eol: bytes) -> None:
    body = eol.join(
        [
            b": keepalive 1/2",
            b"",
            b"data: a",
            b"data:b",
            b"",
            b"event: x",
            b"id: 7",
            b"retry: 300",
            b"data:  c",
            b"",
            b"",
        ]
    )
    for parts in splits(body):
        assert simple(decode(parts)) == [
            ("comment", "keepalive 1/2"),
            ("event", "a\nb", "", None, None),
            ("event", " c", "x", "7", 300),
        ]


def test_cr_at_end_of_read_then_lf() -> None:
    dec = SSEDecoder()
    assert simple(dec.feed(b"data: x\r")) == []
    assert simple(dec.feed(b"\n\r")) == [("event", "x", "", None, None)]
    assert simple(dec.feed(b"\ndata: y\r\n\r\n")) == [("event", "y", "", None, None)]


def test_utf8_split_inside_character() -> None:
    body = "data: héllo ☃ 🦙\n\n".encode()
    for parts in splits(body, tries=30):
        assert simple(decode(parts)) == [("event", "héllo ☃ 🦙", "", None, None)]


def test_bom_and_unknown_fields_and_field_without_colon() -> None:
    body = b"\xef\xbb\xbfdata: a\nfoo: bar\ndata\n\n"
    assert simple(decode([body])) == [("event", "a\n", "", None, None)]


def test_blank_line_without_data_dispatches_nothing() -> None:
    assert decode([b"event: x\n\n\n\n"]) == []


def test_id_with_nul_is_ignored_and_bad_retry_ignored() -> None:
    assert simple(decode([b"id: a\x00b\nretry: 1x\ndata: z\n\n"])) == [("event", "z", "", None, None)]


def test_overlong_line_is_one_protocol_error_and_bounded() -> None:
    long = b"data: " + b"x" * 5000
    body = b"data: a\n\n" + long + b"\n\ndata: b\n\n"
    for parts in splits(body, tries=10):
        dec = SSEDecoder(max_line_bytes=1000)
        out = []
        for p in parts:
            out.extend(dec.feed(p))
            assert len(dec._buf) <= 1000
        out.extend(dec.close())
        kinds = simple(out)
        assert kinds == [("event", "a", "", None, None), ("error",), ("event", "b", "", None, None)], parts[:3]


def test_close_dispatches_unterminated_last_event() -> None:
    assert simple(decode([b"data: [DONE]"])) == [("event", "[DONE]", "", None, None)]
    assert simple(decode([b"data: x\n"])) == [("event", "x", "", None, None)]


def test_event_offsets_cover_exact_byte_spans() -> None:
    body = b": c\n\ndata: a\n\ndata: bb\r\n\r\n"
    items = decode([body])
    events = [i for i in items if isinstance(i, SSEEvent)]
    assert [body[e.start : e.end] for e in events] == [b"data: a\n\n", b"data: bb\r\n\r\n"]


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=400), st.lists(st.integers(min_value=0, max_value=400), max_size=8))
def test_any_bytes_any_split_never_raises_and_agrees(data: bytes, cuts: list[int]) -> None:
    cuts = sorted({c for c in cuts if 0 < c < len(data)})
    parts, prev = [], 0
    for c in cuts + [len(data)]:
        parts.append(data[prev:c])
        prev = c
    whole = simple(decode([data], max_line_bytes=64))
    assert simple(decode(parts, max_line_bytes=64)) == whole


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.lists(
            st.text(alphabet=st.characters(blacklist_characters="\r\n", blacklist_categories=("Cs",)), max_size=20),
            min_size=1,
            max_size=3,
        ),
        max_size=6,
    ),
    st.sampled_from([b"\n", b"\r", b"\r\n"]),
    st.data(),
)
def test_valid_streams_parse_to_their_events(events: list[list[str]], eol: bytes, data) -> None:
    body = b"".join(b"".join(b"data: " + line.encode() + eol for line in ev) + eol for ev in events)
    expected = ["\n".join(ev) for ev in events]
    cut = data.draw(st.integers(min_value=0, max_value=len(body)))
    got = decode([body[:cut], body[cut:]])
    assert [e.data for e in got if isinstance(e, SSEEvent)] == expected
    assert not any(isinstance(e, SSEProtocolError) for e in got)
