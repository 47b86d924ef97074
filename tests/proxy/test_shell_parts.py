"""The proxy shell's pure parts: the header policy (`mlxproxy/headers.py`), the meter's
stop/feed-stripping methods the relay uses, and the `/streams` view of a meter in flight."""

from __future__ import annotations

import orjson
import pytest

import mlxproxy.load.run.client as loadgen
from mlxproxy import headers as H
from mlxproxy.core.meter import RequestMeter
from mlxproxy.core.openai import inject_include_usage, parse_request
from mlxproxy.core.sse import SSEDecoder
from mlxproxy.core.strip import UsageStripper
from mlxproxy.proxy.routes import live_view
from support import splits

CHAT = b'{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}'
EV = b'data: {"choices":[{"index":0,"delta":{"content":"tok "}}]}\n\n'
FINISH = b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'
USAGE = b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":4,"total_tokens":7}}\n\n'
DONE = b"data: [DONE]\n\n"
STREAM = EV * 4 + FINISH + USAGE + DONE


# -- header policy -------------------------------------------------------------------


def test_upstream_headers_drop_hop_by_hop_listed_and_tag_replay() -> None:
    client = [
        (b"host", b"proxy:1"),
        (b"connection", b"keep-alive, X-Secret-Hop"),
        (b"x-secret-hop", b"1"),
        (b"content-length", b"12"),
        (b"accept-encoding", b"gzip"),
        (b"x-mlxproxy-replay", b"1"),
        (b"authorization", b"Bearer client"),
        (b"x-custom", b"kept"),
        (b"te", b"trailers"),
    ]
    out, replay = H.upstream_request_headers(client, H.REQUEST_DROP, None)
    assert replay is True
    assert out == [(b"authorization", b"Bearer client"), (b"x-custom", b"kept"), (b"accept-encoding", b"identity")]
    out, replay = H.upstream_request_headers(client[-2:], H.REQUEST_DROP, b"Bearer upstream")
    assert replay is False
    assert out == [(b"x-custom", b"kept"), (b"accept-encoding", b"identity"), (b"authorization", b"Bearer upstream")]
    out, _ = H.upstream_request_headers(
        [(b"x-api-key", b"k"), (b"authorization", b"Bearer k")], H.REQUEST_DROP | H.CLIENT_KEY_HEADERS, None
    )
    assert out == [(b"accept-encoding", b"identity")]  # the proxy's own key never goes upstream


def test_one_spelling_per_header_rule() -> None:
    assert H.REPLAY_HEADER_B == H.REPLAY_HEADER.encode() == b"x-mlxproxy-replay"
    assert H.HOP_BY_HOP <= H.REQUEST_DROP and H.REPLAY_HEADER_B in H.REQUEST_DROP
    assert {h.decode() for h in H.CLIENT_KEY_HEADERS} <= H.DEFAULT_REDACT
    # the measuring client sends the tag as headers.py spells it, and re-sends no header the
    # policy lists: the client sends by the same ones (one spelling, imported)
    assert loadgen.REPLAY_HEADER is H.REPLAY_HEADER
    assert loadgen.NOT_RESENT is H.NOT_RESENT


# -- the meter's methods the relay uses ------------------------------------------------


def _meter(injected: bool = True) -> RequestMeter:
    body = CHAT
    info, obj = parse_request("POST", "/v1/chat/completions", body)
    if injected:
        inject_include_usage(body, obj)  # type: ignore[arg-type]
    m = RequestMeter(info, request_id="r", upstream="u", t_start=0.0, started_at=0.0, usage_injected=injected)
    m.upstream_sent(0.0)
    m.response_started(0.1, 200, "text/event-stream")
    return m


def _relay(m: RequestMeter, data: bytes, t: float, stripper: UsageStripper) -> bytes:
    """What the relay loop does with one read: strip (SSE framing only), forward, then meter."""
    out, items = m.strip(data, stripper)
    m.feed_forwarded(data, items, t)
    return out


@pytest.mark.parametrize("way", range(4))
def test_strip_then_feed_forwarded_forwards_all_but_the_injected_usage(way: int) -> None:
    pieces = splits(STREAM, seed=way)[way]
    m, stripper = _meter(), UsageStripper()
    out = b"".join(_relay(m, p, 0.2 + i * 0.01, stripper) for i, p in enumerate(pieces)) + stripper.flush()
    assert out == STREAM.replace(USAGE, b"")
    r = m.finish(1.0)
    assert (r.outcome, r.generated_events, r.completion_tokens_reported, r.bytes_out) == ("ok", 4, 4, len(STREAM))
    assert m.failure is None and m.done


def test_strip_never_raises_and_forwards_unchanged_after_a_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    m, stripper = _meter(), UsageStripper()
    first = _relay(m, EV + EV[:10], 0.2, stripper)
    assert first == EV  # the open event is held back
    real = SSEDecoder.feed
    monkeypatch.setattr(SSEDecoder, "feed", lambda self, data: 1 / 0)
    monkeypatch.setattr(SSEDecoder, "data_payloads", lambda self, data: 1 / 0)  # (its fast path)
    rest = EV[10:] + FINISH + USAGE + DONE
    out, items = m.strip(rest, stripper)
    assert m.feed_forwarded(rest, items, 0.3)  # it says the metering failed
    monkeypatch.setattr(SSEDecoder, "feed", real)
    assert isinstance(m.failure, ZeroDivisionError) and m.done
    assert first + out == EV + EV[:10] + rest  # held bytes and the rest: nothing stripped, nothing lost
    assert _relay(m, EV, 0.4, stripper) == EV  # stopped: passes through, bytes still counted
    assert m.generated_events == 1
    assert m.finish(0.5).bytes_out == len(EV) + 10 + len(rest) + len(EV)


def test_feed_forwarded_never_raises_and_says_the_metering_failed(monkeypatch: pytest.MonkeyPatch) -> None:
    m = _meter(injected=False)
    assert not m.feed_forwarded(EV, None, 0.2)
    monkeypatch.setattr(SSEDecoder, "feed", lambda self, data: 1 / 0)
    monkeypatch.setattr(SSEDecoder, "data_payloads", lambda self, data: 1 / 0)  # (its fast path)
    assert m.feed_forwarded(EV, None, 0.3) and isinstance(m.failure, ZeroDivisionError)
    assert m.finish(0.5).bytes_out == 2 * len(EV)


def test_stop_ends_parsing_but_not_byte_counting() -> None:
    m = _meter(injected=False)
    m.feed(EV, 0.2)
    m.stop()
    assert m.done and m.failure is None
    m.feed(EV + FINISH + DONE, 0.3)
    r = m.finish(0.5)
    assert r.generated_events == 1 and r.bytes_out == 2 * len(EV) + len(FINISH) + len(DONE)
    assert r.outcome == "truncated"  # no finish reason was parsed


def test_live_view_of_a_meter_in_flight() -> None:
    m = _meter(injected=False)
    m.feed(b": prefill 5/10\n\n", 0.15)
    for i in range(3):
        m.feed(EV, 0.5 + 0.1 * i)
    view = live_view(m.snapshot(1.0))
    assert view == {
        "id": "r",
        "upstream": "u",
        "model": "m",
        "endpoint": "chat_completions",
        "stream": True,
        "status": 200,
        "age_s": 1.0,
        "ttft_s": 0.5,
        "tokens_so_far": 3,
        "tokens_per_s": 10.0,
        "idle_s": 0.3,
        "prefill_progress": [5, 10],
        "concurrency": 1,
    }
    assert orjson.loads(orjson.dumps(view)) == view
