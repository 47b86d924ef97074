"""Issue 20, item 3: every detector right on what the live servers really sent.

Each test drives the sans-I/O core (RequestMeter + finish_checked) with scripted
timestamps, from recorded bytes where a recording exists (tests/fixtures/real*) and
otherwise from bytes shaped like the live servers' (described in each test). Each one
failed before the fix it covers (see the commit messages).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import orjson
import pytest

from mlxproxy.core.analyze import finish_checked
from mlxproxy.core.detect import Thresholds, prefill_judgeable
from mlxproxy.core.meter import RequestMeter
from mlxproxy.core.openai import parse_request
from mlxproxy.core.record import Record
from support import REPO, read_fixture

TH = Thresholds()
USAGE_KINDS = {"usage_mismatch", "phantom_speed"}
WRITE_FILE = {
    "type": "function",
    "function": {
        "name": "write_file",
        "parameters": {
            "type": "object",
            "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
            "required": ["path", "content"],
        },
    },
}


def request(**kw) -> bytes:
    body = {
        "model": "m",
        "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": "hi"}],
    }
    body.update(kw)
    return orjson.dumps(body)


def data(obj) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def delta(d: dict, finish: str | None = None, usage: dict | None = None) -> bytes:
    obj: dict = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": d, "finish_reason": finish}]}
    if usage is not None:
        obj["usage"] = usage
    return data(obj)


def usage(completion: int, prompt: int = 20, cached: int | None = None) -> dict:
    u: dict = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    if cached is not None:
        u["prompt_tokens_details"] = {"cached_tokens": cached}
    return u


DONE = b"data: [DONE]\n\n"


def run(
    req: bytes,
    reads: Sequence[tuple[float, bytes]],
    t_end: float,
    *,
    t0: float = 0.0,
    rid: str = "r",
    earlier: Sequence[Record] = (),
    count_tokens=None,
    status: int = 200,
    ctype: str = "text/event-stream",
    outcome: str | None = None,
) -> tuple[RequestMeter, Record]:
    """One request through the shared finish path: arrival at t0, headers at t0 + 0.005,
    each body read at its scripted time."""
    info, _ = parse_request("POST", "/v1/chat/completions", req)
    m = RequestMeter(info, request_id=rid, upstream="u", t_start=t0, started_at=t0)
    m.upstream_sent(t0 + 0.001)
    m.response_started(t0 + 0.005, status, ctype)
    for t, b in reads:
        m.feed(b, t)
    return m, finish_checked(m, t_end, TH, earlier=earlier, count_tokens=count_tokens, outcome=outcome)


def events_of(body: bytes) -> list[bytes]:
    return [e + b"\n\n" for e in body.split(b"\n\n") if e.strip()]


def paced(parts: Sequence[bytes], t_first: float, gap: float) -> list[tuple[float, bytes]]:
    return [(t_first + i * gap, p) for i, p in enumerate(parts)]


def words_tokenizer(text: str) -> int:
    """A stand-in tokenizer: one token per whitespace-separated word or JSON punctuation run."""
    return len(text.replace("{", " { ").replace("}", " } ").replace(":", " : ").replace(",", " , ").split())


# -- tool calls ------------------------------------------------------------------------------

ARGS = orjson.dumps({"path": "src/app/main.py", "content": "def main():\n    print('hello world')\n"}).decode()


def buffered_tool_call(reported: int = 43) -> list[bytes]:
    """mlx_lm.server / vllm-mlx / mlx-openai-server: the parser sends the whole call as one delta."""
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "write_file", "arguments": ARGS}}
    return [
        delta({"role": "assistant", "content": ""}),
        delta({"tool_calls": [call]}),
        delta({}, "tool_calls"),
        data({"choices": [], "usage": usage(reported)}),
        DONE,
    ]


@pytest.mark.parametrize("tokenizer", [words_tokenizer, None], ids=["tokenizer", "chars"])
def test_buffered_tool_call_is_counted_and_is_no_burst(tokenizer) -> None:
    """A 43-token write_file call in one delta: the recount includes its name and arguments,
    and one delta for a whole call is how tool parsers work, not a non-incremental stream
    (was: `non_incremental_stream`, "43 tokens in 1 events")."""
    seen: list[str] = []

    def counter(text: str) -> int:
        seen.append(text)
        return tokenizer(text)

    reads = paced(buffered_tool_call(), 0.30, 0.001)
    _, r = run(request(tools=[WRITE_FILE], max_tokens=200), reads, 0.31, count_tokens=counter if tokenizer else None)
    assert r.tool_calls == 1 and r.tool_calls_valid == 1
    if tokenizer:
        assert seen == ["write_file" + ARGS] and r.completion_tokens_tokenizer == words_tokenizer("write_file" + ARGS)
    assert r.anomalies == (), r.anomaly_evidence
    assert r.tokens_source == "usage" and r.completion_tokens == 43


def test_text_then_buffered_burst_without_tool_calls_still_fires() -> None:
    """The exemption is for tool calls only: 43 tokens of text in one delta is still a burst."""
    reads = paced(
        [delta({"content": "word " * 43}), delta({}, "stop"), data({"choices": [], "usage": usage(43)}), DONE],
        0.30,
        0.001,
    )
    _, r = run(request(), reads, 0.31)
    assert "non_incremental_stream" in r.anomalies


def test_tool_call_cut_by_max_tokens_is_named_truncated_tool_call() -> None:
    """max_tokens cuts a tool call: the parser held it back, nothing is streamed, usage says
    30. `usage_mismatch` is fair; the missing tokens are a dropped call, not a phantom rate."""
    reads = paced(
        [
            delta({"role": "assistant", "content": ""}),
            delta({}, "length"),
            data({"choices": [], "usage": usage(30)}),
            DONE,
        ],
        0.5,
        0.001,
    )
    for counter in (words_tokenizer, None):
        _, r = run(request(tools=[WRITE_FILE], max_tokens=30), reads, 0.51, count_tokens=counter)
        assert set(r.anomalies) == {"usage_mismatch", "truncated_tool_call"}, r.anomaly_evidence
        ev = r.anomaly_evidence["truncated_tool_call"]
        assert "usage says 30 output tokens but 0 were streamed" in ev and "max_tokens 30" in ev
    # the same stream without tools offered is still phantom usage
    _, r = run(request(max_tokens=30), reads, 0.51)
    assert "phantom_speed" in r.anomalies and "truncated_tool_call" not in r.anomalies


# -- unreported_length ----------------------------------------------------------------------

WORDS = [f" w{i}" for i in range(20)]


def natural_stop(n_events: int, reported: int) -> list[bytes]:
    return [delta({"content": w}) for w in WORDS[:n_events]] + [
        delta({}, "stop"),
        data({"choices": [], "usage": usage(reported)}),
        DONE,
    ]


def test_natural_stop_at_max_tokens_with_eos_in_usage_is_no_unreported_length() -> None:
    """20 words + EOS = usage 21 (mlx_lm.server, mlx-openai-server, Rapid-MLX, mlx-vlm count
    the EOS): with max_tokens 21 the model stopped on its own, one token short."""
    for counter in (None, words_tokenizer):
        _, r = run(
            request(max_tokens=21, stop=["\n\n"]), paced(natural_stop(20, 21), 0.1, 0.02), 0.6, count_tokens=counter
        )
        assert r.finish_reason == "stop" and r.completion_tokens_reported == 21
        assert "unreported_length" not in r.anomalies, r.anomaly_evidence


def test_stop_when_the_stream_reached_max_tokens_is_unreported_length() -> None:
    _, r = run(request(max_tokens=20), paced(natural_stop(20, 20), 0.1, 0.02), 0.6)
    assert "unreported_length" in r.anomalies
    assert "20 streamed tokens reached max_tokens 20" in r.anomaly_evidence["unreported_length"]


def test_real_mlx_openai_server_stop_at_max_tokens_still_fires() -> None:
    """The recorded mlx-openai-server stream: max_tokens 8 reached, 8 events, finish "stop"."""
    body = read_fixture("real/mlx_openai_server_chat_stream_usage.sse")
    _, r = run(request(max_tokens=8), paced(events_of(body), 0.1, 0.02), 0.5)
    assert r.completion_tokens_counted == 8 and r.finish_reason == "stop"
    assert "unreported_length" in r.anomalies
    _, r = run(request(max_tokens=9), paced(events_of(body), 0.1, 0.02), 0.5)
    assert "unreported_length" not in r.anomalies


# -- serialized -----------------------------------------------------------------------------


def text_stream(
    n: int,
    t_first: float,
    gap: float,
    rid: str,
    t0: float,
    *,
    finish: str = "length",
    end_pad: float = 0.01,
    outcome: str | None = None,
    max_tokens: int | None = None,
    prompt: int = 20,
    no_max: bool = False,
    **run_kw,
) -> Record:
    parts = [delta({"content": f" t{i}"}) for i in range(n)]
    tail = [delta({}, finish), data({"choices": [], "usage": usage(n, prompt=prompt)}), DONE] if outcome is None else []
    reads = paced(parts, t_first, gap)
    last = reads[-1][0]
    reads += [(last + 0.001, p) for p in tail]
    req = request() if no_max else request(max_tokens=max_tokens if max_tokens is not None else n)
    return run(req, reads, last + end_pad, t0=t0, rid=rid, outcome=outcome, **run_kw)[1]


def test_serialized_when_the_first_arrival_is_served_second() -> None:
    """A arrives first, B 50 ms later; the server serves B whole, then A. A finishes last
    and is judged against B (which arrived after it): was missed."""
    b = text_stream(100, 0.15, 0.02, "B", 0.05)  # tokens 0.15 .. 2.13
    a = text_stream(100, 2.20, 0.02, "A", 0.0, earlier=[b])  # first token only after B's last
    assert "serialized" in a.anomalies, a.anomaly_evidence
    ev = a.anomaly_evidence["serialized"]
    assert "arrived 50 ms before request B but was served after it" in ev and "whole of that stream" in ev


def test_serialized_in_arrival_order_says_what_was_observed() -> None:
    a = text_stream(100, 0.1, 0.02, "A", 0.0)  # tokens 0.1 .. 2.08
    b = text_stream(100, 2.15, 0.02, "B", 0.3, earlier=[a])
    assert "serialized" in b.anomalies
    assert "whose stream still had 1.78 s to go" in b.anomaly_evidence["serialized"]
    assert "waited for the rest of another stream" in b.anomaly_evidence["serialized"]
    batched = text_stream(100, 0.45, 0.02, "B", 0.3, earlier=[a])
    assert "serialized" not in batched.anomalies


def test_admission_slice_wait_is_not_serialized() -> None:
    """mlx_lm.server batches but admits a new request only between 0.5 s decode slices:
    B arriving 0.4 s before A's end can get its first token just after A's last."""
    a = text_stream(150, 0.1, 0.02, "A", 0.0)  # tokens 0.1 .. 3.08
    b = text_stream(100, 3.12, 0.02, "B", 2.68, earlier=[a])
    assert "serialized" not in b.anomalies, b.anomaly_evidence


def test_serialized_with_a_client_disconnect_counted_until_the_server_stopped() -> None:
    """A's client leaves at 1.6 s (a server that honours disconnects stops there); B arrived
    at 0.2 s and got its first token only at 1.65 s: it waited for A."""
    a = text_stream(75, 0.1, 0.02, "A", 0.0, outcome="client_disconnect", end_pad=0.12)  # last token 1.58, left 1.70
    assert a.outcome == "client_disconnect"
    b = text_stream(50, 1.75, 0.02, "B", 0.2, earlier=[a])
    assert "serialized" in b.anomalies, b.anomaly_evidence
    assert "until its client left" in b.anomaly_evidence["serialized"]


# -- generation after the client left -------------------------------------------------------


def abandoned_pair(
    b_first: float, *, usual_before: bool = True, no_max: bool = False, prompt: int = 20, b_start: float = 1.0
) -> Record:
    """A (max_tokens 200) streams 20 tokens at 50 tok/s and its client leaves at 0.5 s; the
    server would need 3.6 s more to finish it. Earlier requests had a 20 ms TTFT (prompts
    of 20 tokens: 1000 tok/s prefill)."""
    usual = [text_stream(20, -10.0 + i + 0.02, 0.02, f"U{i}", -10.0 + i) for i in range(3)] if usual_before else []
    a = text_stream(
        20, 0.1, 0.02, "A", 0.0, outcome="client_disconnect", end_pad=0.12, max_tokens=200, no_max=no_max, earlier=usual
    )
    return text_stream(20, b_first, 0.02, "B", b_start, earlier=[*usual, a], prompt=prompt)


def test_generation_after_disconnect_inflates_the_next_ttft() -> None:
    """mlx-openai-server ignores the disconnect: the next request's TTFT was 5.13 s instead
    of ~0.02 s while the abandoned generation went on."""
    b = abandoned_pair(4.13)
    assert "generation_after_disconnect" in b.anomalies, b.anomaly_evidence
    ev = b.anomaly_evidence["generation_after_disconnect"]
    assert "TTFT 3.13 s (20 ms expected from the median TTFT here)" in ev and "left at event 20 of max_tokens 200" in ev
    assert "(up to 3.60 s more at its 50.0 events/s)" in ev
    assert "serialized" not in b.anomalies  # it arrived after the client left: nothing to wait for but the server


def test_a_server_that_stops_on_disconnect_is_not_flagged() -> None:
    assert "generation_after_disconnect" not in abandoned_pair(1.03).anomalies


def test_abandoned_generation_needs_the_usual_ttft_and_time_left() -> None:
    b = abandoned_pair(4.13, no_max=True)
    assert "generation_after_disconnect" in b.anomalies
    assert "left at event 20 (no max_tokens)" in b.anomaly_evidence["generation_after_disconnect"]
    # nothing to compare the TTFT with: not judged
    assert "generation_after_disconnect" not in abandoned_pair(4.13, usual_before=False).anomalies
    # arrived after the abandoned request would have finished (0.5 + 3.6 s): not its doing
    assert "generation_after_disconnect" not in abandoned_pair(9.5, b_start=4.2).anomalies


def test_a_request_served_promptly_after_the_disconnect_clears_the_server() -> None:
    """C arrived after A's client left and got its first token in 20 ms: the server had
    stopped, so B's slow TTFT is something else."""
    usual = [text_stream(20, -10.0 + i + 0.02, 0.02, f"U{i}", -10.0 + i) for i in range(3)]
    a = text_stream(20, 0.1, 0.02, "A", 0.0, outcome="client_disconnect", end_pad=0.12, max_tokens=200, earlier=usual)
    c = text_stream(5, 0.62, 0.02, "C", 0.6, earlier=[*usual, a])
    b = text_stream(20, 4.13, 0.02, "B", 1.0, earlier=[*usual, a, c])
    assert "generation_after_disconnect" not in b.anomalies
    b = text_stream(20, 4.13, 0.02, "B", 1.0, earlier=[*usual, a])
    assert "generation_after_disconnect" in b.anomalies


def test_a_long_prompt_explains_a_long_ttft_after_a_disconnect() -> None:
    """4000 uncached prompt tokens at this upstream's 1000 tok/s prefill take ~4 s on their own."""
    assert "generation_after_disconnect" not in abandoned_pair(4.13, prompt=4000).anomalies


# -- markup and reasoning -------------------------------------------------------------------


def test_rapid_mlx_tool_markup_in_content_is_flagged() -> None:
    """Rapid-MLX streams the call as plain content with finish "stop" when streaming."""
    text = '<tool_call>\n{"name": "write_file", "arguments": ' + ARGS + "}\n</tool_call>"
    pieces = [text[i : i + 12] for i in range(0, len(text), 12)]
    reads = paced(
        [delta({"content": p}) for p in pieces]
        + [delta({}, "stop"), data({"choices": [], "usage": usage(len(pieces))}), DONE],
        0.1,
        0.02,
    )
    _, r = run(request(tools=[WRITE_FILE]), reads, 1.0)
    assert "tool_call_in_content" in r.anomalies


def test_think_markup_in_content_is_reasoning_in_content() -> None:
    parts = ["<think>", "\n", "The", " user", " wants", "\n", "</think>", "\n\n", "Hello", "!"]
    reads = paced(
        [delta({"content": p}) for p in parts] + [delta({}, "stop"), data({"choices": [], "usage": usage(11)}), DONE],
        0.1,
        0.02,
    )
    _, r = run(request(), reads, 1.0)
    assert r.anomalies == ("reasoning_in_content",), r.anomaly_evidence
    assert "'<think>' at char 0" in r.anomaly_evidence["reasoning_in_content"]
    # the block opened in the prompt (Qwen3's template): only its end is streamed
    reads = paced(
        [delta({"content": p}) for p in parts[1:]]
        + [delta({}, "stop"), data({"choices": [], "usage": usage(10)}), DONE],
        0.1,
        0.02,
    )
    assert run(request(), reads, 1.0)[1].anomalies == ("reasoning_in_content",)
    # an answer that mentions the tag is not reasoning markup
    parts = ["Wrap", " it", " in", " a", " <think>", " tag", "."]
    reads = paced(
        [delta({"content": p}) for p in parts] + [delta({}, "stop"), data({"choices": [], "usage": usage(8)}), DONE],
        0.1,
        0.02,
    )
    assert run(request(), reads, 1.0)[1].anomalies == ()


def test_answer_streamed_entirely_as_reasoning_is_reasoning_only() -> None:
    """vllm-mlx --reasoning-parser qwen3 on a think-less answer: all of it as reasoning."""
    parts = ["The", " capital", " of", " France", " is", " Paris", "."]
    body = [delta({"role": "assistant"})] + [delta({"reasoning_content": p}) for p in parts]
    reads = paced(body + [delta({}, "stop"), data({"choices": [], "usage": usage(8)}), DONE], 0.1, 0.02)
    _, r = run(request(), reads, 1.0)
    assert r.ttfc_s is None and r.reasoning_tokens_counted == 7
    assert r.anomalies == ("reasoning_only",), r.anomaly_evidence
    # thinking cut by the token limit is not an answer given as reasoning
    reads = paced(body + [delta({}, "length"), data({"choices": [], "usage": usage(7)}), DONE], 0.1, 0.02)
    assert "reasoning_only" not in run(request(max_tokens=7), reads, 1.0)[1].anomalies


# -- context limits -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body,prompt,limit",
    [
        (b'{"detail":"Protected conversation exceeds the available context budget."}', None, None),  # mlx-vlm 0.7.10
        (
            b'{"error":{"code":400,"message":"request (4476 tokens) exceeds the available context size (4096 tokens)",'
            b'"type":"exceed_context_size_error"}}',
            4476,
            4096,
        ),  # llama.cpp server
    ],
)
def test_context_refusal_wordings(body: bytes, prompt, limit) -> None:
    _, r = run(request(), [(0.05, body)], 0.06, status=400, ctype="application/json")
    assert r.outcome == "context_limit" and "context_limit" in r.anomalies
    assert (r.context_prompt_tokens, r.context_limit_tokens) == (prompt, limit)


def test_wire_fixture_context_refusal_still_recognised() -> None:
    raw = read_fixture("wire/10_omlx_context_400.http")
    body = raw.split(b"\r\n\r\n", 1)[1] if b"\r\n\r\n" in raw else raw.split(b"\n\n", 1)[1]
    _, r = run(request(), [(0.05, body)], 0.06, status=400, ctype="application/json")
    assert r.outcome == "context_limit" and (r.context_prompt_tokens, r.context_limit_tokens) == (51587, 32768)


# -- figures --------------------------------------------------------------------------------


def test_prefill_of_a_server_whose_prompt_tokens_exclude_cached_ones() -> None:
    """mlx-openai-server: prompt_tokens 1, cached_tokens 41 (was -80 tok/s here, -2074 live)."""
    reads = paced(
        [delta({"content": f" t{i}"}) for i in range(20)] + [delta({}, "length", usage(20, prompt=1, cached=41)), DONE],
        0.5,
        0.02,
    )
    _, r = run(request(), reads, 1.0)
    assert r.prefill_tps == pytest.approx(1 / 0.5)
    assert not prefill_judgeable(r)  # 41 of 42 prompt tokens came from the cache


def test_prefill_of_a_full_cache_hit_is_none() -> None:
    """Rapid-MLX full cache hit: nothing prefilled, no rate (was 0.0)."""
    reads = paced(
        [delta({"content": f" t{i}"}) for i in range(20)]
        + [delta({}, "length", usage(20, prompt=42, cached=42)), DONE],
        0.5,
        0.02,
    )
    assert run(request(), reads, 1.0)[1].prefill_tps is None
    reads = paced(
        [delta({"content": f" t{i}"}) for i in range(20)] + [delta({}, "length", usage(20, prompt=42, cached=2)), DONE],
        0.5,
        0.02,
    )
    assert run(request(), reads, 1.0)[1].prefill_tps == pytest.approx(40 / 0.5)


def test_negative_prefill_never_reaches_prometheus() -> None:
    from prometheus_client import CollectorRegistry

    from mlxproxy.proxy.metrics import ProxyMetrics

    reg = CollectorRegistry()
    pm = ProxyMetrics(reg)
    old = Record(
        id="x",
        started_at=0.0,
        upstream="u",
        model="m",
        endpoint="chat_completions",
        stream=True,
        status=200,
        outcome="ok",
        prefill_tps=-2074.0,
        ttft_s=0.02,
    )  # a record of an older version
    pm.on_record(old)
    count = reg.get_sample_value("mlxproxy_prefill_tokens_per_second_count", {"upstream": "u", "model": "m"})
    assert not count


def test_wall_tps_stops_at_done_and_the_tail_is_reported() -> None:
    """Rapid-MLX keeps the body open 0.3-0.7 s after [DONE]; an SDK stops reading at [DONE]."""
    body = read_fixture("real/rapid_mlx_chat_stream_usage.sse")
    events = events_of(body)
    reads = paced(events, 0.1, 0.01)
    t_done = reads[-1][0]
    assert events[-1] == DONE
    _, r = run(request(max_tokens=8), reads, t_done + 0.6)
    assert r.tail_after_done_s == pytest.approx(0.6)
    assert r.wall_tps == pytest.approx(8 / t_done)
    assert r.to_dict()["tail_after_done_s"] == pytest.approx(0.6)
    # no [DONE]: the whole request is the wall time and there is no tail
    _, r = run(request(max_tokens=8), reads[:-1], t_done + 0.6)
    assert r.tail_after_done_s is None and r.wall_tps == pytest.approx(8 / (t_done + 0.6))
    assert math.isclose(r.duration_s, t_done + 0.6)


def test_every_anomaly_kind_is_documented() -> None:
    """A kind a user can see (record, metric label, report) is explained in the anomalies guide and the
    dashboard guide."""

    from mlxproxy.core.detect import ANOMALY_KINDS

    root = REPO
    for doc in ("docs/ANOMALIES.md", "docs/DASHBOARDS.md"):
        text = (root / doc).read_text()
        missing = [k for k in ANOMALY_KINDS if f"`{k}`" not in text]
        assert not missing, f"{doc} does not explain {missing}"
