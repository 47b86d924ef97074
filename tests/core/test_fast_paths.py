"""The fast paths of a chat stream's plain data events (`SSEDecoder.data_payloads`,
`RequestMeter._feed_payloads`, `UsageStripper.pass_whole`) pinned byte for byte against the
general path: the same recorded streams, cut into reads at every byte boundary and event by
event, give the same `Measurement` and the same forwarded bytes with the fast paths as with
them switched off (`data_payloads` answering None: everything through `SSEDecoder.feed`)."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlxproxy.core import meter as meter_mod
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


# -- the template of a plain chunk ---------------------------------------------------
# The parse-free path of a chat stream's plain chunks (`core.meter._template`): a chunk whose
# bytes are the last plain chunk's but for its text string (and, where the envelope allows, its
# digits) is metered from that string alone. Pinned against the general path (every chunk parsed
# whole, no template): the recorded streams and every adversarial case below give the same
# `Measurement` and the same forwarded bytes, read event by event and cut anywhere; and the
# template is really used where it should be (not a vacuous comparison).
HEAD = b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1700000000,"model":"m",'


def plain(text: str, ts: str = "1000.5", head: bytes = HEAD, key: str = "content", ascii_only: bool = False) -> bytes:
    """A plain chunk as a server writes it: `text` encoded by orjson (UTF-8) or by Python's json
    (`ascii_only`: `\\u00e9`), a per-event number `ts` (`benchmarks/upstream.py` stamps one)."""
    s = json.dumps(text).encode() if ascii_only else orjson.dumps(text)
    return (
        head
        + b'"ts":'
        + ts.encode()
        + b',"choices":[{"index":0,"delta":{"'
        + key.encode()
        + b'":'
        + s
        + b'},"finish_reason":null}]}\n\n'
    )


BASE = b"".join(plain(t) for t in ("Hel", "lo", " wo"))  # the template is learned on these
DONE = b"data: [DONE]\n\n"
FINISH = HEAD + b'"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'
USAGE = HEAD + b'"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":5,"total_tokens":8}}\n\n'


def raw(text_token: bytes, ts: bytes = b"1000.5", head: bytes = HEAD) -> bytes:
    """A chunk with the text's JSON string written as is (escapes, invalid bytes)."""
    return (
        head
        + b'"ts":'
        + ts
        + b',"choices":[{"index":0,"delta":{"content":'
        + text_token
        + b'},"finish_reason":null}]}\n\n'
    )


# each is sent after BASE: the template must give what the general path gives, or not be used
ADVERSARIAL = {
    "escaped quote and backslash": raw(b'"a\\"b\\\\c"'),
    "escaped newline and tab": raw(b'"line\\n\\tnext"'),
    "unicode escape": raw(b'"caf\\u00e9"'),
    "surrogate pair": raw(b'"\\ud83d\\ude00"'),
    "lone surrogate": raw(b'"\\ud800"'),
    "raw control character": raw(b'"a\x01b"'),
    "raw newline in the string": raw(b'"a\tb"'),
    "invalid UTF-8": raw(b'"caf\xc3\xa9 \xff"'),
    "UTF-8 text": plain("naïve 日本 🙂"),
    "ensure_ascii text": plain("naïve 日本 🙂", ascii_only=True),
    "empty text": raw(b'""'),
    "a string that ends the object": raw(b'"x"},"finish_reason":"stop"}]}'),
    "two strings": raw(b'"x","role":"assistant"'),
    "a number instead of text": raw(b"7"),
    "null text": raw(b"null"),
    "the template's own closing text": raw(b'"\\"},\\"finish_reason\\":null}]}"'),
    "another id": plain("x", head=HEAD.replace(b"chatcmpl-1", b"chatcmpl-2")),
    "another id, another length": plain("x", head=HEAD.replace(b"chatcmpl-1", b"chatcmpl-123")),
    "another id, a letter": plain("x", head=HEAD.replace(b"chatcmpl-1", b"chatcmpl-X")),
    "created a second later": plain("x", head=HEAD.replace(b"1700000000", b"1700000001")),
    "created with a leading zero": plain("x", head=HEAD.replace(b"1700000000", b"0700000000")),
    "ts with a leading zero": plain("x", ts="0000.5"),
    "ts with other digits": plain("x", ts="9999.9"),
    "ts as an exponent": plain("x", ts="1e5"),
    "ts negative": plain("x", ts="-100.5"),
    "ts as a string": plain("x", ts='"1000.5"'),
    "finish chunk": FINISH,
    "finish reason on a content chunk": raw(b'"x"').replace(b'"finish_reason":null', b'"finish_reason":"stop"'),
    "usage chunk": USAGE,
    "usage null": raw(b'"x"').replace(b'"ts":', b'"usage":null,"ts":'),
    "usage null with a space": raw(b'"x"').replace(b'"ts":', b'"usage": null,"ts":'),
    "usage null, then a usage object": USAGE.replace(b'"choices"', b'"usage":null,"choices"'),
    "usage null, then a usage object after a space": USAGE.replace(b'"usage":', b'"usage" :').replace(
        b'"choices"', b'"usage":null,"choices"'
    ),
    "usage on a content chunk": raw(b'"x"').replace(b'"ts":', b'"usage":{"completion_tokens":1},"ts":'),
    "error on a content chunk": raw(b'"x"').replace(b'"ts":', b'"error":{"message":"boom"},"ts":'),
    "timings on a content chunk": raw(b'"x"').replace(b'"ts":', b'"timings":{"n":1},"ts":'),
    "text beside the delta": raw(b'"x"').replace(b'"finish_reason":null', b'"finish_reason":null,"text":"t"'),
    "tool calls": raw(b'"x"').replace(
        b'"content":"x"', b'"content":null,"tool_calls":[{"index":0,"id":"c","function":{"name":"f","arguments":"{}"}}]'
    ),
    "reasoning beside the content": raw(b'"x"').replace(b'"content":"x"', b'"content":"x","reasoning":"r"'),
    "reasoning_content": plain("think", key="reasoning_content"),
    "reasoning": plain("think", key="reasoning"),
    "two choices": raw(b'"x"').replace(b"}]}", b'},{"index":1,"delta":{"content":"y"}}]}'),
    "a whitespace-formatted chunk": b'data: {"choices": [{"delta": {"content": "spaced"}}]}\n\n',
    "a replay of the whole answer": plain("Hello wo"),
    "done": DONE,
}


def test_recorded_streams_use_the_template() -> None:
    """The recorded servers' streams (whose comparison with the general path is
    `test_fast_paths.test_recorded_streams_cut_anywhere_give_what_the_general_path_gives`)
    take the template on most of their chunks."""
    hits = events = 0
    for path in STREAMS:
        if path.name.startswith(("anthropic_", "openai_responses_")) or b'"choices"' not in path.read_bytes():
            continue
        m = _meter(False)
        for data in _events(path.read_bytes()):
            m.feed(data, 0.2)
        hits += m._template_hits
        events += m.generated_events
    assert events > 400 and hits > 0.85 * events, (hits, events)


@pytest.mark.parametrize("injected", [False, True], ids=["feed", "strip"])
@pytest.mark.parametrize("case", list(ADVERSARIAL), ids=list(ADVERSARIAL))
def test_each_case_after_a_learned_template_is_the_general_paths(
    case: str, injected: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    chunk = ADVERSARIAL[case]
    body = BASE + chunk + plain("!") + chunk + FINISH + USAGE + DONE
    for reads in _cuts(body, every_byte=False):
        _both(reads, injected, monkeypatch)


def test_the_template_is_used_where_it_applies_and_not_elsewhere() -> None:
    """Which of the cases the template meters (the others are the general path's, parsed
    whole): what the comparison above covers on each side."""
    used = {}
    for case, chunk in ADVERSARIAL.items():
        m = _meter(False)
        for data in _events(BASE + chunk):
            m.feed(data, 0.2)
        used[case] = m._template_hits == 3  # the two after the first, and this one
    assert {c for c, u in used.items() if u} == {
        "escaped quote and backslash",
        "escaped newline and tab",
        "unicode escape",
        "surrogate pair",
        "UTF-8 text",
        "ensure_ascii text",
        "the template's own closing text",
        "another id",  # (a digit of a string value: no rule reads it)
        "created a second later",
        "ts with other digits",
        "a replay of the whole answer",
    }


def test_a_template_change_mid_stream_is_learned_again(monkeypatch: pytest.MonkeyPatch) -> None:
    other = HEAD.replace(b'"model":"m",', b'"model":"other","system_fingerprint":"fp",')
    body = BASE + b"".join(plain(t, head=other) for t in ("a", "b", "c", "d")) + BASE + FINISH + DONE
    m = _meter(False)
    for data in _events(body):
        m.feed(data, 0.2)
    assert (m._templates_learned, m._template_hits) == (3, len(_events(body)) - 2 - 3)
    for reads in _cuts(body, every_byte=False):
        _both(reads, False, monkeypatch)
        _both(reads, True, monkeypatch)


def test_learning_stops_where_no_template_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    """A server whose chunks differ in more than digits (here a new id each) costs three
    learnings, not one per chunk."""
    body = b"".join(
        plain("x", head=HEAD.replace(b"chatcmpl-1", b"chatcmpl-" + b"ab"[k % 2 :][:1] * (k + 1))) for k in range(40)
    )
    m = _meter(False)
    calls = []
    real = meter_mod._template
    monkeypatch.setattr(meter_mod, "_template", lambda *a: calls.append(1) or real(*a))
    for data in _events(body):
        m.feed(data, 0.2)
    assert (len(calls), m._template_hits, m.generated_events) == (3, 0, 40)


def test_a_key_with_digits_keeps_the_digits_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where an object key holds a digit, a digit change could make two keys one: the
    template then takes only chunks equal to it but for the text."""
    head = HEAD.replace(b'"model":"m",', b'"k1":1,"k2":2,')
    body = b"".join(plain(t, head=head) for t in ("a", "b")) + plain("c", head=head.replace(b'"k2"', b'"k1"')) + DONE
    m = _meter(False)
    for data in _events(body):
        m.feed(data, 0.2)
    assert m._template is not None and m._template.masked_prefix is None and m._template_hits == 1
    for reads in _cuts(body, every_byte=False):
        _both(reads, False, monkeypatch)


TEXT = st.text(st.characters(codec="utf-8"), max_size=6) | st.sampled_from(['"', "\\", "\n", "é", "\u2028", "\x00"])
TS = st.sampled_from(
    ["1000.5", "1000.6", "0000.5", "9.5", "1e5", "-1000.5", "1000", "01000.5", '"x"', "null", "1000.50"]
)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(TEXT, TS, st.booleans(), st.sampled_from(["content", "reasoning_content", "reasoning"])), max_size=10
    ),
    st.lists(st.integers(min_value=0, max_value=2000), max_size=6),
    st.booleans(),
)
def test_generated_streams_give_what_the_general_path_gives(
    chunks: list[tuple[str, str, bool, str]], cuts: list[int], injected: bool
) -> None:
    body = b"".join(plain(t, ts, key=k, ascii_only=a) for t, ts, a, k in chunks) + FINISH + DONE
    points = sorted({c for c in cuts if 0 < c < len(body)})
    reads = [body[a:b] for a, b in zip([0, *points], [*points, len(body)], strict=True)]
    with pytest.MonkeyPatch.context() as mp:
        _both(reads, injected, mp)
        _both(_events(body), injected, mp)
