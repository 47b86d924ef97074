"""The fast paths of a chat stream's plain data events (`SSEDecoder.data_payloads`,
`RequestMeter._feed_payloads`, `UsageStripper.pass_whole`) pinned byte for byte against the
general path: the same recorded streams, cut into reads at every byte boundary and event by
event, give the same `Measurement` and the same forwarded bytes with the fast paths as with
them switched off (`data_payloads` answering None: everything through `SSEDecoder.feed`)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from mlxproxy.core.meter import Measurement, RequestMeter
from mlxproxy.core.openai import RequestInfo
from mlxproxy.core.sse import SSEDecoder, SSEEvent
from mlxproxy.core.strip import UsageStripper

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
STREAMS = sorted(p for d in ("real", "real2", "wire", "native") for p in (FIXTURES / d).glob("*.sse"))
BYTE_BY_BYTE_MAX = 7_000  # chat streams up to this size are cut at every byte boundary (two reads each)
USAGE = b'data: {"id":"x","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}}\n\n'


def _chunk(delta: str, extra: str = "", choice: str = "") -> bytes:
    return (
        b'data: {"id":"x","object":"chat.completion.chunk"'
        + extra.encode()
        + b',"choices":[{"index":0,"delta":'
        + delta.encode()
        + choice.encode()
        + b"}]}\n\n"
    )


# every shape next to the plain content chunk: each must take the general rules
SHAPES = b"".join(
    [
        _chunk('{"role":"assistant","content":""}'),
        _chunk('{"content":"Hel"}'),
        _chunk('{"content":"lo"}', ',"usage":null,"timings":null'),
        _chunk('{"content":" wo"}', "", ',"finish_reason":null,"text":"x"'),
        _chunk('{"content":"rld"}', ',"timings":{"predicted_per_second":9.5}'),
        _chunk('{"content":"!"}', ',"metrics":{"a":1}'),
        _chunk('{"content":"?"}', ',"stats":{"b":2}'),
        _chunk('{"content":"."}', ',"error":null'),
        _chunk('{"content":7}'),
        _chunk('{"content":""}'),
        _chunk('{"content":null,"reasoning_content":"think"}'),
        _chunk('{"reasoning":"more"}'),
        _chunk('{"reasoning_content":"a","reasoning":"b"}'),
        _chunk('{"content":"x","tool_calls":null}'),
        _chunk('{"tool_calls":[{"index":0,"id":"c1","function":{"name":"f","arguments":"{\\"a\\""}}]}'),
        _chunk('{"tool_calls":[{"index":0,"function":{"arguments":":1}"}}]}'),
        b'data: {"choices":[{"delta":{"content":"a"}},{"delta":{"content":"b"}}]}\n\n',
        b'data: {"choices":{"delta":{"content":"a"}}}\n\n',
        b'data: {"choices":["x"]}\n\n',
        b'data: ["choices"]\n\n',
        b'data: "text"\n\n',
        b"data: 42\n\n",
        b"data: \n\n",
        b'data: {"choices":[{"delta":{"content":"caf\xc3\xa9 \xff"}}]}\n\n',  # invalid UTF-8: replaced
        b'data: {"choices":[{"delta":{"content":\n"split"}}]}\n\n',  # a newline inside: two lines
        b'data: {"choices":[{"delta":{"content":\r"cr"}}]}\n\n',
        b'data: {"choices":[{"delta":{"content":"crlf"}}]}\r\n\r\n',
        b": keep-alive 3/9\n\n",
        b'data:{"choices":[{"delta":{"content":"nospace"}}]}\n\n',
        b'id: 7\ndata: {"choices":[{"delta":{"content":"with id"}}]}\n\n',
        b'data: {"choices":[{"delta":{"content":"two"}}]}\ndata: {"x":1}\n\n',
        _chunk('{"content":"Hello world!?.xthinkmore"}'),  # not a replay: lengths differ
        _chunk("{}", "", ',"finish_reason":"stop"'),
        USAGE,
        b"data: [DONE]\n\n",
        _chunk('{"content":"after done"}'),
    ]
)
REPLAY = b"".join(
    [_chunk('{"content":"ab"}'), _chunk('{"content":"cd"}'), _chunk('{"content":"ef"}'), _chunk('{"content":"abcdef"}')]
)


def _events(body: bytes) -> list[bytes]:
    """`body` cut after each blank line (one read per event, as a paced upstream writes)."""
    out, start = [], 0
    while (i := body.find(b"\n\n", start)) >= 0:
        out.append(body[start : i + 2])
        start = i + 2
    if start < len(body):
        out.append(body[start:])
    return out


def _cuts(body: bytes, every_byte: bool = True) -> Iterator[list[bytes]]:
    yield [body]
    yield _events(body)
    if every_byte and len(body) <= BYTE_BY_BYTE_MAX:
        for k in range(1, len(body)):
            yield [body[:k], body[k:]]
    rng = random.Random(len(body))
    for _ in range(30):
        points = sorted(rng.sample(range(1, len(body)), min(len(body) - 1, rng.randint(1, 12))))
        yield [body[a:b] for a, b in zip([0, *points], [*points, len(body)], strict=True)]


def _meter(injected: bool, max_line_bytes: int | None = None) -> RequestMeter:
    info = RequestInfo("POST", "/v1/chat/completions", "chat_completions", "m", True, 50, not injected, True)
    m = RequestMeter(
        info,
        request_id="r",
        upstream="u",
        t_start=0.0,
        started_at=0.0,
        usage_injected=injected,
        keep_text=True,
        max_line_bytes=max_line_bytes,
    )
    m.upstream_sent(0.05)
    m.response_started(0.1, 200, "text/event-stream")
    return m


def _run(reads: list[bytes], injected: bool, max_line_bytes: int | None = None) -> tuple[Measurement, bytes]:
    """A stream as the proxy's relay meters it (`strip` before each send, `feed_forwarded`
    after) where it strips its injected usage event, else as `feed` (the measuring client)."""
    m = _meter(injected, max_line_bytes)
    out = []
    stripper = UsageStripper()
    for k, data in enumerate(reads):
        t = 0.2 + 0.01 * k
        if injected:
            forwarded, items = m.strip(data, stripper)
            out.append(forwarded)
            assert not m.feed_forwarded(data, items, t)
        else:
            m.feed(data, t)
            out.append(data)
    out.append(stripper.flush())
    return m.finish(1.0), b"".join(out)


def _general(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(SSEDecoder, "data_payloads", lambda self, data: None)


def _both(reads: list[bytes], injected: bool, monkeypatch: pytest.MonkeyPatch, limit: int | None = None) -> None:
    fast = _run(reads, injected, limit)
    with monkeypatch.context() as mp:
        _general(mp)
        general = _run(reads, injected, limit)
    assert fast == general, [len(r) for r in reads]


@pytest.mark.parametrize("injected", [False, True], ids=["feed", "strip"])
@pytest.mark.parametrize("path", STREAMS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_recorded_streams_cut_anywhere_give_what_the_general_path_gives(
    path: Path, injected: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    body = path.read_bytes()
    # (the other APIs' streams never take the chat fast path: event by event and random cuts)
    chat = b'"choices"' in body and not path.name.startswith(("anthropic_", "openai_responses_"))
    for reads in _cuts(body, every_byte=chat):
        _both(reads, injected, monkeypatch)


@pytest.mark.parametrize("injected", [False, True], ids=["feed", "strip"])
@pytest.mark.parametrize(
    "body", [SHAPES, REPLAY, SHAPES.replace(USAGE, b"") + USAGE], ids=["shapes", "replay", "usage-last"]
)
def test_every_chunk_shape_cut_anywhere_gives_what_the_general_path_gives(
    body: bytes, injected: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    for reads in _cuts(body):
        _both(reads, injected, monkeypatch)


def test_the_shapes_take_both_paths() -> None:
    """What the two tests above compare is not vacuous: the fast path takes the plain reads,
    and the general path the rest (a newline inside, a CR, no space, an id)."""
    m = _meter(False)
    fed = []
    real = m._feed_payloads

    def counting(payloads: list[bytes], nbytes: int, t: float) -> None:
        fed.extend(payloads)
        real(payloads, nbytes, t)

    m._feed_payloads = counting  # type: ignore[method-assign]
    for data in _events(SHAPES):
        m.feed(data, 0.2)
    assert fed and len(fed) < len(_events(SHAPES))
    assert b'{"choices":[{"delta":{"content":\n"split"}}]}' not in fed
    r = m.finish(1.0)
    assert r.duplicate_content is False and r.response_text and r.response_text.startswith("Hello world!?.")
    assert (r.finish_reason, r.usage_reports, r.events > r.generated_events) == ("stop", 1, True)
    replay = _run(_events(REPLAY), False)[0]
    assert replay.duplicate_content and replay.response_text == "abcdef"


def test_an_over_long_line_is_the_general_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    body = _chunk('{"content":"' + "x" * 300 + '"}') + _chunk('{"content":"ok"}')
    for reads in _cuts(body):
        _both(reads, False, monkeypatch, limit=200)
        _both(reads, True, monkeypatch, limit=200)


@pytest.mark.parametrize("path", STREAMS[:12], ids=lambda p: p.name)
def test_data_payloads_leave_the_decoder_as_feed_does(path: Path) -> None:
    """Read by read, where `data_payloads` takes a read it gives `feed`'s events' data (undecoded)
    and leaves the decoder exactly as `feed` leaves another one."""
    a, b = SSEDecoder(), SSEDecoder()
    for data in _events(path.read_bytes()):
        payloads = a.data_payloads(data)
        items = b.feed(data)
        if payloads is None:
            a.feed(data)
        else:
            assert [p.decode("utf-8", "replace") for p in payloads] == [
                i.data for i in items if isinstance(i, SSEEvent)
            ]
            assert all(isinstance(i, SSEEvent) for i in items)
        assert [getattr(a, s) for s in SSEDecoder.__slots__] == [getattr(b, s) for s in SSEDecoder.__slots__]
