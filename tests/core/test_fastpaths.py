"""The metering fast paths give exactly what the general paths give.

Each shortcut on the metering path (the SSE decoder's, the usage stripper's, the chunk
classification's, the meter's and the metrics') is compared with the code it shortcuts,
on the recorded fixtures and on generated input; the fast paths are also checked to be
taken on the inputs they exist for, so the comparisons never pass vacuously. No timing
here: performance is measured by benchmarks/bench_meter.py.
"""

from __future__ import annotations

import contextlib
import copy
import math
import pickle
from unittest import mock

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram, generate_latest

import mlxproxy.core.detect as detect_mod
import mlxproxy.core.meter as meter_mod
import mlxproxy.core.openai as openai_mod
import mlxproxy.proxy.histograms as histograms_mod
import mlxproxy.proxy.metrics as metrics_mod
from mlxproxy.core.meter import RequestMeter
from mlxproxy.core.openai import Delta, _classify_general, classify_chunk, parse_request, plain_delta
from mlxproxy.core.sse import DEFAULT_MAX_LINE_BYTES, SSEDecoder, SSEEvent
from mlxproxy.core.strip import UsageStripper
from mlxproxy.proxy.histograms import BatchHistogram
from support import FIXTURES, splits

# chat and text completion streams (the Anthropic Messages and Responses recordings have their own rules)
SSE_FIXTURES = sorted(
    str(p.relative_to(FIXTURES))
    for p in FIXTURES.glob("*/*.sse")
    if not p.name.startswith(("anthropic_messages_", "openai_responses_"))
)
CHAT = b'{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}'


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
    b"data: ",
    b"data:",
    b"data",
    b'data: {"a":1}',
    b"data: x",
    b"data:  two spaces",
    b"event: x",
    b"event:",
    b"id: 7",
    b"id: a\x00b",
    b"id",
    b"retry: 30",
    b"retry: 3x",
    b": keepalive 1/2",
    b":",
    b"foo: bar",
    b"x",
    b"\n",
    b"\n",
    b"\n",
    b"\n\n",
    b"\r",
    b"\r\n",
    b"\r\n\r\n",
    " é☃🦙".encode(),
    b"\xc3",
    b"\xa9",
    b"\xef\xbb\xbf",
    b"[DONE]",
    b" ",
]
DATA_EVENT = st.text(max_size=12).map(lambda s: b"data: " + s.replace("\r", "").replace("\n", "").encode() + b"\n\n")
STREAM = st.lists(st.one_of(DATA_EVENT, DATA_EVENT, st.sampled_from(PIECES), st.binary(max_size=6)), max_size=30).map(
    b"".join
)
MAX_LINE = st.sampled_from([1, 4, 8, 16, 64, DEFAULT_MAX_LINE_BYTES])


@settings(max_examples=600, deadline=None)
@given(STREAM, st.lists(st.integers(min_value=0, max_value=400), max_size=12), MAX_LINE)
def test_decoder_fast_path_equals_general_path(body: bytes, cuts: list[int], max_line: int) -> None:
    assert_same_decoding(cut(body, cuts), max_line)


@settings(max_examples=600, deadline=None)
@given(
    st.lists(
        st.tuples(st.one_of(DATA_EVENT, st.sampled_from(PIECES), st.binary(max_size=6)), st.booleans()), max_size=30
    ),
    MAX_LINE,
)
def test_decoder_fast_path_equals_general_path_reads_at_piece_boundaries(pieces: list, max_line: int) -> None:
    """Reads that start and end where lines, fields and events do: every state the
    general path can leave between reads is met by a read that starts with `data: `."""
    assert_same_decoding(reads_at(pieces), max_line)


def reads_at(pieces: list[tuple[bytes, bool]]) -> list[bytes]:
    """The reads made by joining `pieces` and cutting after each piece marked True."""
    parts, cur = [], b""
    for piece, cut_after in pieces:
        cur += piece
        if cut_after:
            parts.append(cur)
            cur = b""
    return [*parts, cur]


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
@given(
    st.lists(DATA_EVENT, min_size=1, max_size=8),
    st.lists(st.integers(min_value=0, max_value=200), max_size=4),
    st.sampled_from([PIECES[0], b"", b": c\n", b"\n", b"\r\n", b"\xef\xbb\xbf", b"id: 1\n", b"data: a\n"]),
)
def test_decoder_fast_path_equals_general_path_after_any_prefix(
    events: list[bytes], cuts: list[int], prefix: bytes
) -> None:
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
    assert [(e.start, e.end) for e in events] == [
        (e.start, e.end) for e in GeneralDecoder().feed(body) if isinstance(e, SSEEvent)
    ]
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


# -- usage stripper ------------------------------------------------------------------


def reference_process(self: UsageStripper, data: bytes, items: list, safe_offset: int) -> bytes:
    """`UsageStripper.process` as it was before its shortcuts: the reference."""
    from mlxproxy.core.openai import is_injected_usage_chunk

    buf = self._buf + data if self._buf else data
    base = self._start
    cut_at = safe_offset - base
    pieces: list[bytes] = []
    pos = 0
    for it in items:
        if isinstance(it, SSEEvent) and is_injected_usage_chunk(it.data):
            s, e = it.start - base, it.end - base
            if pos <= s and e <= cut_at:
                pieces.append(buf[pos:s])
                pos = e
                self.stripped += 1
    pieces.append(buf[pos:cut_at])
    self._buf = buf[cut_at:]
    self._start = safe_offset
    return pieces[0] if len(pieces) == 1 else b"".join(pieces)


USAGE = b'data: {"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":2,"total_tokens":3}}'


@settings(max_examples=400, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.one_of(
                DATA_EVENT,
                st.sampled_from(PIECES),
                st.sampled_from(
                    [
                        USAGE + b"\n\n",
                        USAGE + b"\r\n\r\n",
                        USAGE + b"\n",
                        b'data: {"usage":null,"choices":[]}\n\n',
                        b'data: "usage"\n\n',
                    ]
                ),
            ),
            st.booleans(),
        ),
        max_size=30,
    ),
    MAX_LINE,
)
def test_stripper_shortcuts_forward_what_the_reference_forwards(pieces: list, max_line: int) -> None:
    parts = reads_at(pieces)
    dec, got, ref = SSEDecoder(max_line), UsageStripper(), UsageStripper()
    for p in parts:
        items = dec.feed(p)
        assert got.process(p, items, dec.safe_offset) == reference_process(ref, p, items, dec.safe_offset)
        assert (got._buf, got._start, got.stripped) == (ref._buf, ref._start, ref.stripped)
    assert got.flush() == ref.flush()


# -- chunk classification ------------------------------------------------------------


def fixture_chunks() -> list[object]:
    out = []
    for name in SSE_FIXTURES:
        for it in SSEDecoder().feed((FIXTURES / name).read_bytes()):
            if isinstance(it, SSEEvent) and not it.data.startswith("[DONE]"):
                try:
                    out.append(orjson.loads(it.data))
                except orjson.JSONDecodeError:
                    pass
    return out


def test_classify_fast_path_equals_general_path_on_fixtures() -> None:
    chunks = fixture_chunks()
    plain = 0
    for obj in chunks:
        assert classify_chunk(obj) == _classify_general(obj), obj
        p = plain_delta(obj)
        if p is not None:
            plain += 1
            assert _classify_general(obj) == Delta(*p)
    assert plain > len(chunks) // 2  # the fast path carries the bulk of real streams


@pytest.mark.parametrize("level", ["chunk", "choice", "delta"])
@pytest.mark.parametrize(
    "key",
    [
        "finish_reason",
        "text",
        "usage",
        "error",
        "timings",
        "metrics",
        "tool_calls",
        "reasoning_content",
        "reasoning",
        "content",
        "choices",
        "delta",
        "role",
        "other",
    ],
)
@pytest.mark.parametrize("value", [None, "", "x", 0, 1, False, True, [], [{"index": 0}], {}, {"message": "m"}])
@pytest.mark.parametrize("content", ["a", "", None])
def test_plain_delta_against_every_member_the_rules_read(level: str, key: str, value: object, content: object) -> None:
    """A plain chunk (content, or reasoning when `content` is not text) with one member
    set at one level: the shortcut must either decline or agree with the general rules."""
    delta = {"content": content} if content else {"content": content, "reasoning_content": "r"}
    obj = {"id": "x", "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}
    {"chunk": obj, "choice": obj["choices"][0], "delta": delta}[level][key] = value
    p = plain_delta(obj)
    assert classify_chunk(obj) == _classify_general(obj)
    if p is not None:
        assert _classify_general(obj) == Delta(*p)


@pytest.mark.parametrize(
    "delta,expected",
    [
        ({"content": "a"}, ("a", "")),
        ({"role": "assistant", "content": "a"}, ("a", "")),
        ({"content": "a", "refusal": None}, ("a", "")),
        ({"reasoning_content": "r"}, ("", "r")),
        ({"reasoning": "r"}, ("", "r")),
        ({"content": None, "reasoning_content": "r", "reasoning": None, "tool_calls": None}, ("", "r")),
        ({"content": "", "reasoning": "r"}, ("", "r")),
        ({"content": "a", "reasoning_content": "r"}, None),  # both: general rules
        ({"reasoning_content": "r", "reasoning": "r"}, None),  # dual reasoning
        ({"reasoning_content": "", "reasoning": "r"}, None),
        ({"content": "a", "tool_calls": []}, None),
        ({"content": ""}, None),
        ({"role": "assistant"}, None),
        ({}, None),
        ({"content": 5}, None),
    ],
)
def test_plain_delta_shapes(delta: dict, expected: tuple[str, str] | None) -> None:
    obj = {"id": "x", "choices": [{"index": 0, "delta": delta, "finish_reason": None}], "usage": None}
    assert plain_delta(obj) == expected
    assert classify_chunk(obj) == _classify_general(obj)
    if expected is not None:
        assert _classify_general(obj) == Delta(*expected)


ANY = st.one_of(
    st.none(),
    st.just(""),
    st.text(max_size=4),
    st.integers(-1, 3),
    st.booleans(),
    st.just([]),
    st.just({}),
    st.floats(allow_nan=False),
)
TEXT = st.one_of(st.none(), st.just(""), st.text(min_size=1, max_size=4))
TOOL_CALL = st.fixed_dictionaries(
    {},
    optional={
        "index": st.one_of(st.integers(0, 2), ANY),
        "id": ANY,
        "function": st.one_of(st.fixed_dictionaries({}, optional={"name": ANY, "arguments": ANY}), ANY),
    },
)
DELTA = st.fixed_dictionaries(
    {},
    optional={
        "role": st.one_of(st.just("assistant"), ANY),
        "content": st.one_of(TEXT, ANY),
        "reasoning_content": st.one_of(TEXT, ANY),
        "reasoning": st.one_of(TEXT, ANY),
        "tool_calls": st.one_of(st.lists(st.one_of(TOOL_CALL, ANY), max_size=2), ANY),
        "refusal": ANY,
    },
)
CHOICE = st.fixed_dictionaries(
    {"index": st.just(0)},
    optional={
        "delta": st.one_of(DELTA, DELTA, ANY),
        "finish_reason": st.one_of(st.sampled_from(["stop", "length", ""]), ANY),
        "text": st.one_of(TEXT, ANY),
        "logprobs": ANY,
    },
)
CHUNK = st.fixed_dictionaries(
    {"id": st.just("chatcmpl-x"), "object": st.just("chat.completion.chunk")},
    optional={
        "choices": st.one_of(st.lists(st.one_of(CHOICE, CHOICE, ANY), max_size=3), ANY),
        "usage": st.one_of(
            st.fixed_dictionaries({"prompt_tokens": st.integers(0, 9), "completion_tokens": st.integers(0, 9)}), ANY
        ),
        "error": st.one_of(st.fixed_dictionaries({"message": st.text(max_size=5)}), ANY),
        "timings": st.one_of(st.just({"predicted_per_second": 1.5}), ANY),
        "metrics": st.one_of(st.just({"tps": 2}), ANY),
        "ts": ANY,
    },
)


KEYS = st.sampled_from(
    [
        "finish_reason",
        "text",
        "usage",
        "error",
        "timings",
        "metrics",
        "tool_calls",
        "reasoning_content",
        "reasoning",
        "content",
        "role",
        "choices",
        "delta",
        "index",
        "refusal",
    ]
)


@st.composite
def near_plain_chunk(draw) -> dict:
    """A plain content or reasoning chunk with a few members changed at random levels."""
    field = draw(st.sampled_from(["content", "reasoning_content", "reasoning"]))
    delta = {field: draw(st.text(min_size=1, max_size=3))}
    if draw(st.booleans()):
        delta["role"] = "assistant"
    ch = {"index": 0, "delta": delta, "finish_reason": None}
    obj = {"id": "x", "object": "chat.completion.chunk", "choices": [ch]}
    for _ in range(draw(st.integers(0, 3))):
        target = draw(st.sampled_from([obj, ch, delta]))
        other = {"index": 1, "delta": {"content": "z"}}
        target[draw(KEYS)] = draw(
            st.one_of(ANY, TEXT, st.just([other]), st.just([copy.deepcopy(ch), other]), st.just([{"index": 0}]))
        )
    return obj


@settings(max_examples=1000, deadline=None)
@given(st.one_of(CHUNK, near_plain_chunk(), near_plain_chunk(), ANY))
def test_classify_fast_path_equals_general_path_on_generated_chunks(obj: object) -> None:
    obj = orjson.loads(orjson.dumps(obj))  # what the meter sees: orjson's own types
    assert classify_chunk(obj) == _classify_general(obj)
    p = plain_delta(obj)
    if p is not None:
        assert _classify_general(obj) == Delta(*p)


# -- meter ---------------------------------------------------------------------------


def meter_record(parts: list[bytes], *, fast: bool):
    """Drive a meter as the proxy does; `fast=False` switches both shortcuts off."""
    info, _ = parse_request("POST", "/v1/chat/completions", CHAT)
    m = RequestMeter(info, request_id="r", upstream="u", t_start=0.0, started_at=0.0, keep_text=True)
    m.upstream_sent(0.1)
    m.response_started(0.5, 200, "text/event-stream")
    if not fast:
        m._decoder = GeneralDecoder()  # (the meter's own decoder: no public way to swap it)
    t = 1.0
    off = contextlib.ExitStack()
    if not fast:  # both the meter's and classify_chunk's own use of it
        for mod in (meter_mod, openai_mod):
            off.enter_context(mock.patch.object(mod, "plain_delta", lambda obj: None))
    with off:
        for p in parts:
            m.feed(p, t)
            t += 0.25
        recounted: list[str] = []  # what a tokenizer is handed: reasoning, content, tool names and arguments
        return m.finish(t + 1.0, count_tokens=lambda text: recounted.append(text) or 1), recounted


@pytest.mark.parametrize("name", SSE_FIXTURES)
def test_meter_fast_paths_equal_general_paths_on_fixtures(name: str) -> None:
    body = (FIXTURES / name).read_bytes()
    for parts in splits(body, seed=len(body) + 1, tries=6):
        assert meter_record(parts, fast=True) == meter_record(parts, fast=False)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.one_of(CHUNK, near_plain_chunk(), near_plain_chunk(), st.just("[DONE]"), st.just("not json")), max_size=12
    ),
    st.lists(st.integers(min_value=0, max_value=3000), max_size=10),
)
def test_meter_fast_paths_equal_general_paths_on_generated_streams(chunks: list, cuts: list[int]) -> None:
    body = b"".join(b"data: " + (c.encode() if isinstance(c, str) else orjson.dumps(c)) + b"\n\n" for c in chunks)
    parts = cut(body, cuts)
    assert meter_record(parts, fast=True) == meter_record(parts, fast=False)


def test_meter_duplicate_terminal_content_on_the_fast_path() -> None:
    """A terminal chunk replaying the whole answer is a plain content chunk too."""
    chunk = b'data: {"choices":[{"index":0,"delta":{"content":"%s"}}]}\n\n'
    parts = [
        chunk % b"ab",
        chunk % b"c",
        chunk % b"abc",
        b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n',
    ]
    fast, ref = meter_record(parts, fast=True), meter_record(parts, fast=False)
    assert fast == ref and fast[0].duplicate_content and fast[0].generated_events == 2


# -- metrics -------------------------------------------------------------------------


def samples(registry: CollectorRegistry) -> list[tuple]:
    """Every sample but the creation timestamps, NaN made comparable."""
    out = []
    for fam in registry.collect():
        for s in fam.samples:
            if not s.name.endswith("_created"):
                out.append((s.name, tuple(sorted(s.labels.items())), "nan" if math.isnan(s.value) else s.value))
    return out


AMOUNT = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([*metrics_mod.GAP_BUCKETS, 0.0, -0.0]),
    st.floats(min_value=0, max_value=0.2),
    st.integers(-5, 5),
)


@settings(max_examples=300, deadline=None)
@given(batches=st.lists(st.lists(AMOUNT, max_size=60), max_size=4), labels=st.sampled_from([(), ("a",), ("a", "b")]))
def test_batch_histogram_exposes_what_a_histogram_observing_one_by_one_would(
    batches: list[list[float]], labels: tuple[str, ...]
) -> None:
    names = ["l", "m"][: len(labels)]
    reg_ref, reg = CollectorRegistry(), CollectorRegistry()
    ref_family = Histogram("h", "Gaps.", names, buckets=metrics_mod.GAP_BUCKETS, registry=reg_ref)
    ref = ref_family.labels(*labels) if labels else ref_family
    got = BatchHistogram("h", "Gaps.", names, buckets=metrics_mod.GAP_BUCKETS, registry=reg).labels(*labels)
    for batch in batches:
        for a in batch:
            ref.observe(a)
        metrics_mod.observe_all(got, batch)
        assert samples(reg) == samples(reg_ref)
    # the whole exposition, byte for byte but for the creation times
    strip = lambda text: [ln for ln in text.splitlines() if "_created" not in ln]  # noqa: E731
    assert strip(generate_latest(reg).decode()) == strip(generate_latest(reg_ref).decode())
    created = [s for fam in reg.collect() for s in fam.samples if s.name == "h_created"]
    assert len(created) == 1 and created[0].labels == dict(zip(names, labels))


def test_batch_histogram_sorted_batches_count_as_one_by_one() -> None:
    """A batch long enough to be sorted (`observe_all`), its values on, between, under and over
    every bound, once with a NaN among them (the per-value path) and once without."""
    bounds = metrics_mod.GAP_BUCKETS
    values = list(bounds) + [b * 1.5 for b in bounds] + [-1.0, 0.0, -0.0, 1e9, math.inf, -math.inf]
    for batch in (values, values[::-1], [*values, math.nan], [0.001] * 40):
        reg_ref, reg = CollectorRegistry(), CollectorRegistry()
        ref = Histogram("h", "Gaps.", buckets=bounds, registry=reg_ref)
        for v in batch:
            ref.observe(v)
        got = BatchHistogram("h", "Gaps.", [], buckets=bounds, registry=reg).labels()
        got.observe_all(batch)
        assert len(batch) >= histograms_mod._SORTED_BATCH
        assert samples(reg) == samples(reg_ref)


MARKUP_BITS = [
    "<think>",
    "</think>",
    "think>",
    "/think>",
    "<|channel|>analysis",
    "|channel|>analysis",
    "<",
    "/",
    "<|begin_of_thought|>",
    "|begin_of_thought|>",
    "<|end_of_thought|>",
    "|end_of_thought|>",
    " ",
    "\n",
    "x",
]


@settings(max_examples=300, deadline=None)
@given(bits=st.lists(st.sampled_from(MARKUP_BITS), max_size=8))
def test_think_markup_pattern_needs_a_less_than_sign(bits: list[str]) -> None:
    """`check_markup` searches its pattern only in a text holding "<": a text the pattern
    matches always holds one (or markup would be missed)."""
    text = "".join(bits)
    assert detect_mod._THINK.search(text) is None or "<" in text
    assert detect_mod._THINK.search(text.replace("<", "")) is None


def test_think_markup_found_with_the_shortcut() -> None:
    for text in (
        "<think>x",
        "  <think>",
        "a</think>b",
        "<|channel|>analysis",
        "x<|end_of_thought|>",
        "<|begin_of_thought|>",
    ):
        assert detect_mod._THINK.search(text) is not None
        assert detect_mod._THINK.search(text.replace("<", "")) is None


def test_batch_histogram_is_refused_twice_on_one_registry_and_checks_its_labels() -> None:
    reg = CollectorRegistry()
    h = BatchHistogram("h", "h", ["l"], buckets=(1, 2), registry=reg)
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        Histogram("h", "h", ["l"], registry=reg)
    with pytest.raises(ValueError, match="takes 1 label values, got 2"):
        h.labels("a", "b")
    assert h.labels("a") is h.labels("a")
    with pytest.raises(ValueError, match="increasing order"):
        BatchHistogram("g", "g", [], buckets=(2, 1), registry=reg)


@settings(max_examples=100, deadline=None)
@given(
    steps=st.lists(st.tuples(st.sampled_from(["u", "v"]), st.sampled_from(["m", "n", "o"]), st.booleans()), max_size=40)
)
def test_the_in_flight_count_gauge_exposes_what_a_gauge_would(steps: list[tuple[str, str, bool]]) -> None:
    """`ProxyMetrics`' requests in flight (a `CountGauge`) against the same with prometheus_client's
    `Gauge`: the same exposition, byte for byte, after any order of starts and ends."""
    import dataclasses

    from prometheus_client import Gauge

    from mlxproxy.proxy.histograms import CountGauge
    from mlxproxy.proxy.metrics import METRICS, ProxyMetrics

    assert [x.kind for x in METRICS if x.key == "in_flight"] == [CountGauge]
    reference = tuple(dataclasses.replace(x, kind=Gauge) if x.kind is CountGauge else x for x in METRICS)
    texts = []
    for table in (METRICS, reference):
        with mock.patch.object(metrics_mod, "METRICS", table):
            pm = ProxyMetrics(CollectorRegistry(), max_model_labels=2)
        open_now: dict[tuple[str, str], int] = {}
        for up, model, start in steps:
            label = pm.model_label(model)
            if start or not open_now.get((up, label)):
                pm.request_started(up, label)
                open_now[(up, label)] = open_now.get((up, label), 0) + 1
            else:
                pm.request_ended(up, label)
                open_now[(up, label)] -= 1
        texts.append([ln for ln in generate_latest(pm.registry).decode().splitlines() if "_created" not in ln])
    assert texts[0] == texts[1]
    if steps:
        assert any(ln.startswith("mlxproxy_requests_in_flight{") for ln in texts[0])


def test_count_gauge_checks_its_labels() -> None:
    from mlxproxy.proxy.histograms import CountGauge

    reg = CollectorRegistry()
    g = CountGauge("g", "g", ["l"], registry=reg)
    with pytest.raises(ValueError, match="takes 1 label values, got 2"):
        g.labels("a", "b")
    assert g.labels("a") is g.labels("a")
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        CountGauge("g", "g", ["l"], registry=reg)


def test_proxy_metrics_same_exposition_as_observing_one_by_one() -> None:
    from mlxproxy.core.analyze import finish_checked
    from mlxproxy.core.detect import Thresholds
    from mlxproxy.proxy.metrics import ProxyMetrics

    def naive(child, amounts):
        for a in amounts:
            child.observe(a)

    records = []
    for name in SSE_FIXTURES:
        info, _ = parse_request("POST", "/v1/chat/completions", CHAT)
        m = RequestMeter(info, request_id="r", upstream="u", t_start=0.0, started_at=0.0)
        m.upstream_sent(0.1)
        m.response_started(0.5, 200, "text/event-stream")
        body = (FIXTURES / name).read_bytes()
        for k in range(0, len(body), 97):
            m.feed(body[k : k + 97], 1.0 + k * 0.000137)
        records.append(finish_checked(m, 99.0, Thresholds()))
    out = []
    for obs in (metrics_mod.observe_all, naive):
        pm = ProxyMetrics(CollectorRegistry())
        with mock.patch.object(metrics_mod, "observe_all", obs):
            for r in records:
                pm.on_record(r)
                pm.observe_overhead(0.0003, [0.00004, 0.0001, 0.0007, 0.02, 3.0][: len(r.event_offsets_s) % 6])
        out.append(samples(pm.registry))
    assert out[0] == out[1]
    assert any(name == "mlxproxy_inter_token_latency_seconds_count" and v > 0 for name, _, v in out[0])


# -- Record.evolve (finishing copies each record once, without dataclasses.replace) ------


def test_record_evolve_is_dataclasses_replace() -> None:
    import dataclasses

    from mlxproxy.core.record import Record

    base = Record(
        id="r1",
        started_at=1.0,
        upstream="u",
        model="m",
        endpoint="chat_completions",
        stream=True,
        status=200,
        outcome="ok",
        anomalies=("stall",),
        anomaly_evidence={"stall": "x"},
        event_offsets_s=(0.1, 0.2),
    )
    changes = {"anomalies": ("stall", "usage_mismatch"), "wall_tps": 12.5, "conversation_id": "c", "turn": 2}
    new = base.evolve(**changes)
    assert new == dataclasses.replace(base, **changes)
    assert new is not base and base.anomalies == ("stall",)  # the original is untouched
    with pytest.raises(dataclasses.FrozenInstanceError):
        new.wall_tps = 1.0  # type: ignore[misc]
    for f in dataclasses.fields(Record):  # every field copied, not only the changed ones
        assert getattr(new, f.name) == changes.get(f.name, getattr(base, f.name)), f.name
    with pytest.raises(AttributeError):
        base.evolve(not_a_field=1)


def test_checked_record_is_the_record_init() -> None:
    """`checked_record` (the one build of a record, field by field) gives what `Record(...)` gives."""
    import dataclasses

    from mlxproxy.core.record import (
        CHECKED_FIELDS,
        MEASURED_FIELDS,
        Record,
        checked_record,
        rate_figures,
        wall_window_s,
    )

    info, _ = parse_request("POST", "/v1/chat/completions", CHAT)
    m = RequestMeter(info, request_id="r", upstream="u", t_start=0.0, started_at=0.0, keep_text=True)
    m.response_started(0.5, 200, "text/event-stream")
    m.feed((FIXTURES / "wire/01_openai_reference_include_usage.sse").read_bytes(), 1.0)
    measured = m.finish(2.0)
    verdict = {
        "completion_tokens": 7,
        "tokens_source": "tokenizer",
        "anomalies": ("stall",),
        "anomaly_evidence": {"stall": "x"},
        "stall_count": 1,
        "stall_total_s": 1.5,
    }
    got = checked_record(measured, **verdict, conversation={"conversation_id": "c", "turn": 2}, error="scrubbed")
    window = wall_window_s(measured.duration_s, measured.tail_after_done_s)  # to [DONE], here at 1.0 of 2.0
    tpot, decode, wall = rate_figures(7, measured.ttft_s, measured.e2e_s, window)
    want = Record(
        **{name: getattr(measured, name) for name in MEASURED_FIELDS if name != "error"},
        **verdict,
        error="scrubbed",
        conversation_id="c",
        turn=2,
        tpot_s=tpot,
        decode_tps=decode,
        wall_tps=wall,
    )
    assert got == want and set(MEASURED_FIELDS) | set(CHECKED_FIELDS) == {f.name for f in dataclasses.fields(Record)}
    # built as a `_Building` by plain stores, it is a `Record` like any other: frozen, hashed,
    # copied and pickled as one
    assert type(got) is Record
    with pytest.raises(dataclasses.FrozenInstanceError):
        got.turn = 3  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        del got.turn  # type: ignore[misc]
    assert pickle.loads(pickle.dumps(got)) == want and copy.copy(got) == want and dataclasses.replace(got) == want
    from mlxproxy.core.clients import ClientInfo

    named = checked_record(measured, **verdict, client=ClientInfo("opencode", "title"))
    assert (named.client, named.side_request) == ("opencode", "title") and type(named) is Record
    with pytest.raises(AttributeError):
        checked_record(measured, **verdict, conversation={"not_a_field": 1})


def test_the_measurement_is_built_in_field_order() -> None:
    """`RequestMeter._measurement` builds its `Measurement` positionally (a NamedTuple called with
    60 keywords cost ~6 us per request): each value's line names its field, in the field order."""
    import inspect
    import re

    from mlxproxy.core.meter import Measurement

    source = inspect.getsource(RequestMeter._measurement)
    built = source[source.index("_new_measurement(") :]
    assert re.findall(r",  # (\w+)", built) == list(Measurement._fields)


# -- prompt fingerprints: the fast paths give what the plain rule gives -------------------


def _content_reference(v):
    """A content as its template sees it, written plainly: text blocks' texts, other blocks as
    JSON without cache_control (also inside a tool result's content), one per line."""
    import orjson

    def text(x):
        return x if isinstance(x, str) else orjson.dumps(x, option=orjson.OPT_SORT_KEYS).decode()

    def unmarked(b):
        out = {k: x for k, x in b.items() if k != "cache_control"}
        if isinstance(out.get("content"), list):
            out["content"] = [unmarked(c) if isinstance(c, dict) else c for c in out["content"]]
        return out

    if isinstance(v, str) or not isinstance(v, list):
        return text(v)
    parts = []
    for b in v:
        if (
            isinstance(b, dict)
            and isinstance(b.get("text"), str)
            and b.get("type", "text")
            in (
                "text",
                "input_text",
                "output_text",
            )
        ):
            parts.append(b["text"])
        else:
            parts.append(text(unmarked(b)) if isinstance(b, dict) else text(b))
    return "\n".join(parts)


def _fingerprint_reference(endpoint, obj):
    """The plain rule, written without shortcuts: pieces in rendering order (the system pieces,
    the leading system messages, tools, the other messages; cache_control left out), a hash
    per piece and per BLOCK_CHARS block, within the MAX_BLOCKS budget."""
    from array import array

    from mlxproxy.core.prefix import BLOCK_CHARS, MAX_BLOCKS, _text

    if not isinstance(obj, dict):
        return None
    pieces = []
    if endpoint == "messages" and obj.get("system") is not None:
        pieces.append(("system", _content_reference(obj["system"])))
    if endpoint == "responses" and obj.get("instructions") is not None:
        pieces.append(("instructions", _content_reference(obj["instructions"])))
    items = obj.get("input") if endpoint == "responses" else obj.get("messages")
    if endpoint == "responses" and isinstance(items, str):
        items = [{"role": "user", "content": items}]
    name = "input" if endpoint == "responses" else "messages"
    if not isinstance(items, list) or not items:
        return None
    first_user = None
    said, head, leading = [], 0, True
    for i, m in enumerate(items):
        if not isinstance(m, dict):
            said.append((f"{name}[{i}]", _text(m)))
            leading = False
            continue
        for field in sorted(m, key=lambda k: (k != "role", k != "content", k)):
            if field == "cache_control":
                continue
            value = _content_reference(m[field]) if field == "content" else _text(m[field])
            said.append((f"{name}[{i}].{field}", value))
        if first_user is None and m.get("role") == "user":
            first_user = _content_reference(m.get("content"))
        if leading and m.get("role") in ("system", "developer"):
            head = len(said)
        else:
            leading = False
    if first_user is None:
        return None
    pieces += said[:head]
    tools = obj.get("tools")
    if isinstance(tools, list) and tools:
        pieces.append(("tools", _text(tools)))
    pieces += said[head:]
    budget, blocks = MAX_BLOCKS, []
    for _, text in pieces:
        n = (len(text) + BLOCK_CHARS - 1) // BLOCK_CHARS
        if n <= budget:
            blocks.append(array("q", [hash(text[k : k + BLOCK_CHARS]) for k in range(0, len(text), BLOCK_CHARS)]))
            budget -= n
        else:
            blocks.append(None)
    return ([label for label, _ in pieces], [hash(t) for _, t in pieces], [len(t) for _, t in pieces], blocks)


_texts = st.one_of(st.text(max_size=40), st.text(min_size=250, max_size=600))
_ints = st.integers(-(2**63), 2**64 - 1)  # orjson.loads turns larger integers into floats
_values = st.one_of(
    _texts, st.none(), _ints, st.lists(st.dictionaries(st.text(max_size=5), _texts, max_size=2), max_size=2)
)
_message = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "tool"]), "content": _values}),
    st.dictionaries(
        st.sampled_from(["role", "content", "name", "tool_calls", "reasoning_content", "tool_call_id"]),
        _values,
        max_size=5,
    ),
    _texts,
)


@settings(max_examples=300, deadline=None)
@given(
    endpoint=st.sampled_from(["chat_completions", "messages", "responses"]),
    messages=st.lists(_message, max_size=6),
    extra=st.dictionaries(st.sampled_from(["tools", "system", "instructions"]), _values, max_size=3),
)
def test_fingerprint_matches_the_plain_rule(endpoint, messages, extra) -> None:
    from mlxproxy.core.prefix import fingerprint

    body = dict(extra, **({"input": messages} if endpoint == "responses" else {"messages": messages}))
    got, want = fingerprint(endpoint, body), _fingerprint_reference(endpoint, body)
    if want is None:
        assert got is None
        return
    assert got is not None
    blocks = [None if b is None else list(b) for b in got.blocks]  # tuples or arrays: the same fingerprints
    assert (list(got.labels), list(got.hashes), list(got.chars), blocks) == (
        want[0],
        want[1],
        want[2],
        [None if b is None else list(b) for b in want[3]],
    )


def test_fingerprint_block_budget_matches_the_plain_rule() -> None:
    from mlxproxy.core import prefix

    # a tiny budget: short pieces stop being fingerprinted by block exactly where the rule says
    body = {
        "messages": [
            {"role": "user", "content": "a" * 10},
            {"role": "assistant", "content": ""},
            {"role": "user", "content": "b" * 600},
            {"role": "user", "content": "c"},
        ]
    }
    with mock.patch.object(prefix, "MAX_BLOCKS", 3):
        got = prefix.fingerprint("chat_completions", body)
        want = _fingerprint_reference("chat_completions", body)
    assert got is not None and want is not None
    assert [None if b is None else list(b) for b in got.blocks] == [None if b is None else list(b) for b in want[3]]
    assert any(b is None for b in got.blocks) and any(b is not None and len(b) for b in got.blocks)
