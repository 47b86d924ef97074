"""The NDJSON line decoder (core/ndjson.py): whole, byte by byte and at random cuts."""

from __future__ import annotations

import orjson
import pytest

from mlxproxy.core.ndjson import NDJSONDecoder
from mlxproxy.core.sse import SSEEvent, SSEProtocolError
from support import splits

BODY = (
    b'{"model":"m","message":{"role":"assistant","content":"H\xc3\xa9"},"done":false}\n'
    b"\n"
    b'{"model":"m","message":{"role":"assistant","content":"\xe2\x82\xac"},"done":false}\r\n'
    b'{"model":"m","message":{"role":"assistant","content":""},"done":true,"eval_count":2}\n'
)


def _decode(parts: list[bytes], **kw: int) -> list[object]:
    dec = NDJSONDecoder(**kw)
    items: list[object] = []
    for p in parts:
        items += dec.feed(p)
    items += dec.close()
    return items


@pytest.mark.parametrize("parts", splits(BODY))
def test_lines_offsets_and_characters_survive_any_cut(parts: list[bytes]) -> None:
    items = _decode(parts)
    assert all(isinstance(i, SSEEvent) for i in items)
    events = [i for i in items if isinstance(i, SSEEvent)]
    assert [orjson.loads(e.data)["message"]["content"] for e in events] == ["Hé", "€", ""]
    # each item's span is exactly its line in the body (the CR dropped from the text, not the span)
    for e in events:
        line = BODY[e.start : e.end]
        assert line.endswith(b"\n") and line.rstrip(b"\r\n").decode() == e.data
    assert events[-1].end == len(BODY)


@pytest.mark.parametrize("parts", splits(BODY + b'{"cut":'))
def test_an_unterminated_last_line_is_dropped(parts: list[bytes]) -> None:
    dec = NDJSONDecoder()
    got = [i for p in parts for i in dec.feed(p)]
    assert len(got) == 3 and dec.safe_offset == len(BODY)
    assert dec.close() == [] and dec.safe_offset == len(BODY) + len(b'{"cut":')


@pytest.mark.parametrize("parts", splits(b'{"a":1}\n' + b"x" * 100 + b'\n{"b":2}\n' + b"y" * 50, seed=3))
def test_a_line_over_the_bound_is_reported_once_and_skipped(parts: list[bytes]) -> None:
    dec = NDJSONDecoder(max_line_bytes=40)
    items = [i for p in parts for i in dec.feed(p)]
    assert [type(i) for i in items] == [SSEEvent, SSEProtocolError, SSEEvent, SSEProtocolError]
    assert [i.data for i in items if isinstance(i, SSEEvent)] == ['{"a":1}', '{"b":2}']


def test_the_bound_is_validated() -> None:
    with pytest.raises(ValueError):
        NDJSONDecoder(max_line_bytes=0)
