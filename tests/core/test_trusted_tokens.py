"""The trusted token count (`completion_tokens`, `tokens_source`) and estimates that only
accuse a server when their own error cannot explain the difference (issue 14, items 4-5;
issue 20: tool calls in every recount). Scripted timestamps, real recordings."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest

from mlxproxy.core.analyze import finish_checked
from mlxproxy.core.detect import Thresholds, check_record
from mlxproxy.core.meter import RequestMeter
from mlxproxy.core.openai import parse_request
from mlxproxy.core.record import Record, rate_figures, wall_window_s
from mlxproxy.load.output.report import summarize_records, summary_row, untrusted_notes
from support import ok_record, read_fixture

TH = Thresholds()
GAP = 0.02  # one event every 20 ms: 50 tok/s when each event is a token
USAGE_KINDS = {"usage_mismatch", "phantom_speed"}


def chat_request(usage: bool = True) -> bytes:
    return b'{"model":"m","stream":true' + (b',"stream_options":{"include_usage":true}}' if usage else b"}")


def run_body(body: bytes, *, count_tokens=None, th: Thresholds = TH, usage: bool = True) -> tuple[RequestMeter, Record]:
    """Feed a recorded SSE body one event every GAP seconds through the shared finish path."""
    info, _ = parse_request("POST", "/v1/chat/completions", chat_request(usage))
    m = RequestMeter(info, request_id="r", upstream="u", t_start=0.0, started_at=0.0)
    m.response_started(0.01, 200, "text/event-stream")
    events = [e + b"\n\n" for e in body.split(b"\n\n") if e.strip()]
    for i, e in enumerate(events):
        m.feed(e, 0.1 + GAP * i)
    return m, finish_checked(m, 0.1 + GAP * len(events), th, count_tokens=count_tokens)


def chunk(text: str) -> bytes:
    import orjson

    return b"data: " + orjson.dumps({"choices": [{"index": 0, "delta": {"content": text}}]}) + b"\n\n"


def stream_of(tokens: list[str], reported: int, finish: str = "length") -> bytes:
    """A healthy server's stream: one event per generated token, then usage."""
    import orjson

    body = b"".join(chunk(t) for t in tokens)
    body += b"data: " + orjson.dumps({"choices": [{"index": 0, "delta": {}, "finish_reason": finish}]}) + b"\n\n"
    body += (
        b"data: "
        + orjson.dumps(
            {
                "choices": [],
                "usage": {"prompt_tokens": 10, "completion_tokens": reported, "total_tokens": 10 + reported},
            }
        )
        + b"\n\n"
    )
    return body + b"data: [DONE]\n\n"


def times_usage(body: bytes, factor: int) -> bytes:
    """The same stream from a server whose usage over-reports `factor` times."""
    return re.sub(
        rb'"completion_tokens":\s*(\d+)', lambda mm: b'"completion_tokens":%d' % (int(mm.group(1)) * factor), body
    )


def usage_rates(r: Record) -> tuple[float | None, float | None, float | None]:
    return rate_figures(
        r.completion_tokens_reported, r.ttft_s, r.e2e_s, wall_window_s(r.duration_s, r.tail_after_done_s)
    )


# -- the trusted count -------------------------------------------------------------------

HEALTHY_RECORDINGS = [
    "real/mlx_lm_server_stream_usage.sse",
    "real/rapid_mlx_chat_stream_usage.sse",
    "real/vllm_mlx_chat_stream_300tok.sse",
    "wire/01_openai_reference_include_usage.sse",
    "wire/05_mlx_omni_server_include_usage.sse",
    "wire/06_vllm_mlx_reasoning_usage_twice.sse",
    "wire/09_omlx_keepalive_usage_timings.sse",
    "wire/11_rapid_mlx_fast_path.sse",
    "real2/chat_mlx_lm_server_cache_turn1.sse",
    "real2/chat_litellm_text_include_usage.sse",
    "real2/chat_litellm_reasoning.sse",
    "real2/chat_litellm_tool_calls.sse",
    "real2/chat_litellm_toolmarkup_in_content.sse",
]


def rough_tokenizer(text: str) -> int:
    """A stand-in tokenizer: about one token per 4 characters (never 0 for text)."""
    return math.ceil(len(text) / 4)


@pytest.mark.parametrize("name", HEALTHY_RECORDINGS)
def test_healthy_recordings_trust_usage_and_speeds_are_usages(name: str) -> None:
    _, r = run_body(read_fixture(name))
    assert r.outcome in ("ok", "ok_no_done")
    assert not USAGE_KINDS & set(r.anomalies), r.anomaly_evidence
    assert r.completion_tokens_reported is not None
    assert (r.completion_tokens, r.tokens_source, r.n_out) == (
        r.completion_tokens_reported,
        "usage",
        r.completion_tokens_reported,
    )
    assert (r.tpot_s, r.decode_tps, r.wall_tps) == usage_rates(r)


@pytest.mark.parametrize(
    "name,phantom",
    [
        ("real/vllm_mlx_chat_stream_300tok.sse", True),
        ("real2/chat_mlx_lm_server_cache_turn1.sse", True),
        ("real2/chat_litellm_text_include_usage.sse", True),
        ("real/mlx_lm_server_stream_usage.sse", False),  # 32 vs 8 events of 47 chars: 2.7x the estimate of 12
    ],
)
def test_over_reporting_recordings_fire_and_speeds_use_the_stream(name: str, phantom: bool) -> None:
    """The same recordings with usage x4 (the phantom-usage pathology) still fire both
    checks, and no speed uses the contradicted count."""
    _, honest = run_body(read_fixture(name))
    _, r = run_body(times_usage(read_fixture(name), 4))
    assert r.completion_tokens_reported == 4 * honest.completion_tokens_reported
    assert "usage_mismatch" in r.anomalies
    assert ("phantom_speed" in r.anomalies) == phantom
    assert (r.completion_tokens, r.tokens_source) == (r.completion_tokens_counted, "stream")
    assert r.usage_untrusted and not honest.usage_untrusted
    n, window = r.completion_tokens_counted, r.e2e_s - r.ttft_s
    assert r.decode_tps == pytest.approx((n - 1) / window)
    assert r.wall_tps == pytest.approx(n / wall_window_s(r.duration_s, r.tail_after_done_s))
    assert r.decode_tps < usage_rates(r)[1] / 2


def test_over_reporting_with_a_tokenizer_uses_the_tokenizer_count() -> None:
    _, r = run_body(times_usage(read_fixture("real/vllm_mlx_chat_stream_300tok.sse"), 4), count_tokens=rough_tokenizer)
    assert "usage_mismatch" in r.anomalies and "phantom_speed" in r.anomalies
    assert r.tokens_source == "tokenizer" and r.completion_tokens == r.completion_tokens_tokenizer


def test_no_usage_falls_back_to_tokenizer_then_stream() -> None:
    body = read_fixture("real/vllm_mlx_chat_stream_300tok.sse")
    body = re.sub(rb',?"usage":\s*\{[^}]*\}', b"", body)
    _, r = run_body(body, usage=False)
    assert r.completion_tokens_reported is None and (r.completion_tokens, r.tokens_source) == (
        r.completion_tokens_counted,
        "stream",
    )
    _, r = run_body(body, usage=False, count_tokens=rough_tokenizer)
    assert (r.completion_tokens, r.tokens_source) == (r.completion_tokens_tokenizer, "tokenizer")


def test_old_records_without_the_new_keys_still_load() -> None:
    _, r = run_body(times_usage(read_fixture("real/vllm_mlx_chat_stream_300tok.sse"), 4))
    d = r.to_dict(timeline=True)
    back = Record.from_dict(d)
    assert (back.completion_tokens, back.tokens_source, back.n_out, back.usage_untrusted) == (
        r.completion_tokens,
        "stream",
        r.completion_tokens_counted,
        True,
    )
    old = {k: v for k, v in d.items() if k not in ("completion_tokens", "tokens_source")}
    o = Record.from_dict(old)
    assert o.tokens_source is None and o.n_out == o.completion_tokens_reported and not o.usage_untrusted


# -- no false alarms from estimates ---------------------------------------------------------

# Tokens of real text whose average is above 4 characters: each event is one token, usage
# equals the events. The chars/4 estimate used to read more tokens than the server sent.
CODE_TOKENS = [
    "\n",
    "                ",
    "return",
    " self",
    ".",
    "configuration",
    "[",
    "key",
    "]",
    "\n",
    "            ",
    "raise",
    " NotImplementedError",
    "(",
    "name",
    ")",
]
LONG_WORDS = [
    " internationalization",
    " responsibilities",
    " Donaudampfschifffahrtsgesellschaft",
    " characteristically",
    " notwithstanding",
    " telecommunications",
    " misunderstanding",
]
NON_ENGLISH = [" Привет", " мир", ",", " как", " дела", "?", " 你好", "世界", "。", " こんにちは", " überall", " Größe"]


@pytest.mark.parametrize(
    "tokens", [CODE_TOKENS, LONG_WORDS, NON_ENGLISH], ids=["indented-code", "long-words", "non-english"]
)
@pytest.mark.parametrize("n", [16, 100, 256])
def test_one_token_per_event_real_text_is_no_usage_mismatch(tokens: list[str], n: int) -> None:
    toks = [tokens[i % len(tokens)] for i in range(n)]
    for reported in (n, n + 1):  # + EOS, counted by mlx_lm.server and others
        m, r = run_body(stream_of(toks, reported))
        assert r.anomalies == (), r.anomaly_evidence
        assert r.tokens_source == "usage"


def test_the_issue_case_100_events_452_chars() -> None:
    """'usage says 100 output tokens, 113 streamed (100 events, 452 chars)' on a healthy server."""
    toks = ["abcde" if i < 52 else "abcd" for i in range(100)]
    assert len("".join(toks)) == 452
    _, r = run_body(stream_of(toks, 100))
    assert r.anomalies == (), r.anomaly_evidence


def test_tokenizer_recount_tolerates_what_reencoding_cannot_reproduce() -> None:
    """'256 reported vs 266 tokenizer count': re-encoding decoded text need not give back
    the generated tokens. Within tokenizer_tolerance it is no anomaly; far outside it is."""
    toks = ["ab"] * 256
    for tok_count in (266, 240):
        _, r = run_body(stream_of(toks, 256), count_tokens=lambda _t, k=tok_count: k)
        assert r.completion_tokens_tokenizer == tok_count
        assert r.anomalies == () and r.tokens_source == "usage", r.anomaly_evidence
    # a non-canonical split re-encodes to far more tokens: with one event per counted token the
    # events are the count, so it is no anomaly (measured on mlx_lm.server: 100 vs 265)
    _, r = run_body(stream_of(toks, 256), count_tokens=lambda _t: 680)
    assert r.anomalies == () and r.tokens_source == "usage", r.anomaly_evidence
    # the same recount from coarse chunks (4 tokens an event) says the usage is too low
    coarse = ["abababab"] * 64
    _, r = run_body(stream_of(coarse, 256), count_tokens=lambda _t: 280)  # within 10%
    assert r.anomalies == () and r.tokens_source == "usage", r.anomaly_evidence
    _, r = run_body(stream_of(coarse, 200), count_tokens=lambda _t: 256)
    assert "usage_mismatch" in r.anomalies and r.tokens_source == "tokenizer"
    # fewer than the usage: one event per counted token still explains it (merges on re-encoding)...
    _, r = run_body(stream_of(toks, 256), count_tokens=lambda _t: 220)
    assert r.anomalies == () and r.tokens_source == "usage", r.anomaly_evidence
    # ...coarse chunks do not: usage 256 for 64 events whose text re-encodes to 80 tokens
    _, r = run_body(stream_of(coarse, 256), count_tokens=lambda _t: 80)
    assert {"usage_mismatch", "phantom_speed"} <= set(r.anomalies) and r.tokens_source == "tokenizer"


def test_chars_band_boundaries() -> None:
    """10 events of 400 ASCII chars: estimate 100, band 50..200 (+3)."""
    base = dict(
        usage_requested=True,
        generated_events=10,
        completion_tokens_counted=10,
        event_offsets_s=tuple(0.1 + 0.02 * i for i in range(10)),
        ttft_s=0.1,
        e2e_s=0.28,
        duration_s=0.3,
    )

    def kinds(rep: int, **kw) -> set[str]:
        kw.setdefault("chars", 400)
        return {a.kind for a in check_record(ok_record(completion_tokens_reported=rep, **base), TH, **kw)}

    assert "usage_mismatch" not in kinds(203) and "usage_mismatch" in kinds(204)
    # 1000 chars in 10 events cannot be one token per event: at least 1000 / 24 = 42 tokens
    assert "usage_mismatch" not in kinds(42 - 3, chars=1000) and "usage_mismatch" in kinds(42 - 4, chars=1000)
    assert "usage_mismatch" in kinds(10, chars=1000)
    # 200 chars in 10 events may be 10 long tokens: a usage of 10 is what the stream shows
    assert "usage_mismatch" not in kinds(10, chars=200) and "usage_mismatch" not in kinds(7, chars=200)
    # the streamed count: 30 events are at least 30 tokens whatever their text
    more = dict(
        base,
        generated_events=30,
        completion_tokens_counted=30,
        event_offsets_s=tuple(0.1 + 0.02 * i for i in range(30)),
    )
    assert "usage_mismatch" not in {
        a.kind for a in check_record(ok_record(completion_tokens_reported=27, **more), TH, chars=60)
    }
    assert "usage_mismatch" in {
        a.kind for a in check_record(ok_record(completion_tokens_reported=26, **more), TH, chars=60)
    }
    # 40 CJK characters (120 UTF-8 bytes) in 10 events: one token per byte is possible, up to 120 (+3)
    assert "usage_mismatch" not in kinds(123, chars=40, nonascii_chars=40, nonascii_bytes=120)
    assert "usage_mismatch" in kinds(124, chars=40, nonascii_chars=40, nonascii_bytes=120)


# -- tool calls are generated tokens (issue 20) ---------------------------------------------


def test_tool_call_recording_is_recounted_with_its_name_and_arguments() -> None:
    """LiteLLM's real tool-call stream: one name delta and 6 argument fragments, usage 7.
    The recount must see `get_weather{"city": "Paris"}`, not an empty text."""
    th = Thresholds(usage_min_tokens=1, phantom_min_tokens=1)  # judge even this short call
    seen: list[str] = []

    def counter(text: str) -> int:
        seen.append(text)
        return rough_tokenizer(text)

    m, r = run_body(read_fixture("real2/chat_litellm_tool_calls.sse"), count_tokens=counter, th=th)
    assert seen == ['get_weather{"city": "Paris"}']
    assert r.tool_calls == 1 and r.completion_tokens_reported == 7 and r.completion_tokens_tokenizer == 7
    assert r.anomalies == () and r.tokens_source == "usage", r.anomaly_evidence


def test_buffered_tool_call_of_43_tokens_is_no_phantom() -> None:
    """mlx_lm.server sends a parsed tool call as one delta; usage counts the markup too."""
    import orjson

    args = orjson.dumps({"path": "src/app/main.py", "content": "def main():\n    print('hello world')\n"}).decode()
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "write_file", "arguments": args}}
    body = (
        b"data: "
        + orjson.dumps({"choices": [{"index": 0, "delta": {"tool_calls": [call]}}]})
        + b"\n\n"
        + b"data: "
        + orjson.dumps(
            {
                "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}],
                "usage": {"prompt_tokens": 50, "completion_tokens": 43, "total_tokens": 93},
            }
        )
        + b"\n\ndata: [DONE]\n\n"
    )
    for tokenizer in (rough_tokenizer, None):
        _, r = run_body(body, count_tokens=tokenizer)
        assert not USAGE_KINDS & set(r.anomalies), r.anomaly_evidence
        assert r.tokens_source == "usage"


# -- tables ------------------------------------------------------------------------------


def test_tables_mark_untrusted_usage_and_print_both_figures() -> None:
    _, honest = run_body(read_fixture("real/vllm_mlx_chat_stream_300tok.sse"))
    _, lying = run_body(times_usage(read_fixture("real/vllm_mlx_chat_stream_300tok.sse"), 4))
    good = summarize_records([honest, dataclasses.replace(honest, id="r2")])
    bad = summarize_records([lying, dataclasses.replace(lying, id="r2")])
    assert good.untrusted_usage == 0 and bad.untrusted_usage == 2
    row_good, row_bad = summary_row("t", "m", good), summary_row("t", "m", bad)
    assert not row_good["wall tok/s"].endswith("*")
    assert row_bad["wall tok/s"].endswith("*") and row_bad["decode tok/s"].endswith("*")
    assert float(row_bad["decode tok/s"].rstrip("*")) == pytest.approx(lying.decode_tps, abs=0.05)
    assert untrusted_notes([("t good", good)]) == []
    (note,) = untrusted_notes([("t bad", bad)])
    assert note.startswith("* t bad:") and f"{usage_rates(lying)[1]:.1f}" in note and "2 of 2" in note
