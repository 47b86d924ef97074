"""``mlxproxy serve`` in front of a real ``mlx_lm.server``, driven by real clients.

Every test starts the real CLI (``python -m mlxproxy serve``) as its own process in front
of the session's ``mlx_lm.server`` (tiny local model, ``--prefill-step-size 16``) and
reads the proxy's own records back from ``GET /streams`` or its capture file:

* the OpenAI SDK gets the same text through the proxy as directly, and the record's
  usage is the server's;
* the proxy's TTFT / decode speed as seen by the SDK are within 15% of direct (medians
  of interleaved runs);
* a local ``tokenizer.json`` makes the usage check exact;
* prefill progress comments reach the client unchanged and show in ``/streams``;
* two requests released together are batched through the proxy as ``mlxproxy bench``
  measures them.

Skipped, with the reason, where the mlx stack does not import.
"""

from __future__ import annotations

import dataclasses
import re
import statistics
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from mlxproxy.core.detect import Thresholds, overlap_ratio
from mlxproxy.core.record import Record
from mlxproxy.load.commands.bench import BenchOptions, bench_targets
from mlxproxy.load.data.targets import Target, TargetResult
from mlxproxy.load.output.report import aggregate_tps

from .conftest import PREFILL_STEP
from .peers import assert_completed, median, mlxproxy_serve, nonce_prompt, require_mlx
from .tinymodel import MODEL_NAME

pytestmark = pytest.mark.integration

require_mlx()

openai = pytest.importorskip("openai", reason="the OpenAI SDK is part of the [test] extra: pip install -e '.[test]'")

now = time.perf_counter


# -- an OpenAI SDK client that measures what it sees ------------------------------------


@dataclasses.dataclass
class Seen:
    """One chat completion as the client saw it."""

    text: str
    usage: Any  # openai CompletionUsage or None
    request_id: str | None  # x-mlxproxy-request-id (None when direct)
    ttft_s: float | None = None  # request sent -> first content chunk
    decode_tps: float | None = None  # (content chunks - 1) / (last - first content chunk)
    content_chunks: int = 0


def sdk(base_url: str) -> Any:
    return openai.OpenAI(
        base_url=base_url + "/v1",
        api_key="dummy",
        max_retries=0,
        timeout=120.0,
        http_client=httpx.Client(trust_env=False, timeout=120.0),
    )


def sdk_stream(client: Any, **body: Any) -> Seen:
    t0 = now()
    raw = client.chat.completions.with_raw_response.create(model=MODEL_NAME, stream=True, **body)
    times: list[float] = []
    parts: list[str] = []
    usage = None
    for chunk in raw.parse():
        t = now()
        if chunk.choices and chunk.choices[0].delta.content:
            times.append(t)
            parts.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    seen = Seen("".join(parts), usage, raw.headers.get("x-mlxproxy-request-id"), content_chunks=len(times))
    if times:
        seen.ttft_s = times[0] - t0
        if len(times) >= 2 and times[-1] > times[0]:
            seen.decode_tps = (len(times) - 1) / (times[-1] - times[0])
    return seen


def sdk_once(client: Any, **body: Any) -> Seen:
    raw = client.chat.completions.with_raw_response.create(model=MODEL_NAME, **body)
    obj = raw.parse()
    return Seen(obj.choices[0].message.content or "", obj.usage, raw.headers.get("x-mlxproxy-request-id"))


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


# -- tests ----------------------------------------------------------------------------


def test_openai_sdk_same_text_and_usage_through_proxy(mlx_server: str) -> None:
    """Same seed, temperature 0: the SDK gets identical text directly and through the
    proxy, streamed or not; the record's usage is the server's; counted tokens are the
    reported ones or one fewer; outcome ok, no anomalies."""
    body = {"messages": user("Tell me about the sea."), "temperature": 0, "seed": 7, "max_tokens": 48}
    usage_opts = {"stream_options": {"include_usage": True}}
    direct = sdk(mlx_server)
    d_stream = sdk_stream(direct, **body, **usage_opts)
    d_once = sdk_once(direct, **body)
    assert d_stream.text and d_stream.text == d_once.text
    assert d_stream.usage.completion_tokens == 48

    with mlxproxy_serve(mlx_server) as px:
        client = sdk(px.url)
        p_stream = sdk_stream(client, **body, **usage_opts)
        p_once = sdk_once(client, **body)
        p_bare = sdk_stream(client, **body)  # no stream_options: the proxy injects and strips usage

        assert p_stream.text == d_stream.text
        assert p_once.text == d_once.text
        assert p_bare.text == d_stream.text
        assert p_bare.usage is None, "the usage event the proxy injected must not reach the client"

        rec = px.record(p_stream.request_id)
        assert_completed(rec)
        assert (rec.stream, rec.finish_reason) == (True, "length")
        assert rec.completion_tokens_reported == p_stream.usage.completion_tokens == d_stream.usage.completion_tokens
        assert rec.prompt_tokens == p_stream.usage.prompt_tokens == d_stream.usage.prompt_tokens
        assert rec.cached_tokens == p_stream.usage.prompt_tokens_details.cached_tokens
        assert rec.usage_requested and not rec.usage_injected and rec.usage_reports == 1
        assert 0 <= rec.completion_tokens_reported - rec.completion_tokens_counted <= 1, rec
        assert rec.completion_tokens_counted == p_stream.content_chunks
        assert rec.ttft_s is not None and rec.decode_tps is not None and rec.prefill_tps is not None
        assert rec.completion_tokens_tokenizer is None  # no tokenizer configured, "default_model" is no folder
        # the usage agrees with the stream: it is the trusted count, and the speeds are the usage's
        assert (rec.completion_tokens, rec.tokens_source) == (p_stream.usage.completion_tokens, "usage")
        assert rec.decode_tps == (rec.completion_tokens - 1) / (rec.e2e_s - rec.ttft_s)

        rec = px.record(p_once.request_id)
        assert (rec.outcome, rec.anomalies, rec.stream, rec.finish_reason) == ("ok", (), False, "length")
        assert rec.completion_tokens_reported == p_once.usage.completion_tokens == d_once.usage.completion_tokens
        assert rec.prompt_tokens == p_once.usage.prompt_tokens
        assert rec.completion_tokens_counted is None  # nothing to count in a JSON body

        rec = px.record(p_bare.request_id)
        assert_completed(rec)
        assert rec.usage_injected and not rec.usage_requested
        assert rec.completion_tokens_reported == d_stream.usage.completion_tokens
        assert 0 <= rec.completion_tokens_reported - rec.completion_tokens_counted <= 1


#: Timing comparison. The tiny model decodes ~700-1000 tok/s and, with the server's
#: default prefill step (2048), answers a short prompt in ~10-20 ms; even a ~690-token
#: prompt prefilled in steps of 16 gives a TTFT of only ~80 ms, and the proxy adds ~5-8 ms
#: to that on a 2-core runner (a new upstream connection per request -- mlx_lm.server
#: speaks HTTP/1.0 -- plus one more hop): ~10%, which with scheduler noise crosses 15%.
#: So the prompt is ~1700 tokens (TTFT ~300 ms, the proxy's cost ~2-3%) and each reply
#: is 128 tokens (a decode window of ~180 ms). Direct and proxied requests alternate
#: (order flipped every pair) so drift and background load hit both alike; medians are
#: compared. The model server has its own cores (peers.split_cpus) and the client and
#: the proxy share the others, so the proxy's CPU (~0.25 ms per streamed token: a real
#: cost, but one a Mac's GPU server never competes with) does not slow the CPU-bound tiny
#: server down. Per-request TTFT still scatters by 5-60% on a busy 2-core host, so 12
#: pairs are measured and, while the medians disagree by more than the tolerance, 12 more
#: (36 at most), always judged on all pairs measured.
TIMING_PROMPT_WORDS = 150
TIMING_MAX_TOKENS = 128
TIMING_PAIRS = 12
TIMING_MAX_PAIRS = 36
TIMING_TOLERANCE = 0.15


def test_ttft_and_decode_speed_through_proxy_match_direct(mlx_server: str, record_property: Any) -> None:
    """The SDK's TTFT and decode tok/s through the proxy are within 15% of direct (medians)."""
    with mlxproxy_serve(mlx_server) as px:
        clients = {"direct": sdk(mlx_server), "proxy": sdk(px.url)}
        seen: dict[str, list[Seen]] = {"direct": [], "proxy": []}

        def one(name: str) -> Seen:
            return sdk_stream(
                clients[name],
                messages=user(nonce_prompt(TIMING_PROMPT_WORDS)),
                temperature=0,
                max_tokens=TIMING_MAX_TOKENS,
                stream_options={"include_usage": True},
            )

        for name in ("direct", "proxy"):  # warm-up: connections, first-request costs
            one(name)

        def run_pairs(n: int) -> None:
            for i in range(n):
                order = ("direct", "proxy") if (len(seen["direct"]) + i) % 2 == 0 else ("proxy", "direct")
                for name in order:
                    seen[name].append(one(name))

        def ratios() -> dict[str, float]:
            return {
                m: median([getattr(s, m) for s in seen["proxy"]]) / median([getattr(s, m) for s in seen["direct"]])
                for m in ("ttft_s", "decode_tps")
            }

        run_pairs(TIMING_PAIRS)
        while any(abs(r - 1) > TIMING_TOLERANCE for r in ratios().values()) and len(seen["direct"]) < TIMING_MAX_PAIRS:
            run_pairs(TIMING_PAIRS)
        r = ratios()

        records = [px.record(s.request_id) for s in seen["proxy"]]
        figures = {
            "pairs": len(seen["direct"]),
            "direct_ttft_ms": 1000 * median([s.ttft_s for s in seen["direct"]]),
            "proxy_ttft_ms": 1000 * median([s.ttft_s for s in seen["proxy"]]),
            "direct_decode_tps": median([s.decode_tps for s in seen["direct"]]),
            "proxy_decode_tps": median([s.decode_tps for s in seen["proxy"]]),
            "proxy_recorded_ttft_ms": 1000 * median([x.ttft_s for x in records]),
            "proxy_recorded_decode_tps": median([x.decode_tps for x in records]),
            "ttft_ratio": r["ttft_s"],
            "decode_ratio": r["decode_tps"],
            "ttft_cv_direct": statistics.pstdev([s.ttft_s for s in seen["direct"]])
            / statistics.mean([s.ttft_s for s in seen["direct"]]),
        }
        for k, v in figures.items():
            record_property(k, round(v, 4))
        summary = ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in figures.items())
        print(f"\ntiming through the proxy vs direct: {summary}")

        for rec, s in zip(records, seen["proxy"]):
            assert_completed(rec)
            assert rec.completion_tokens_reported == s.usage.completion_tokens == TIMING_MAX_TOKENS
            # the proxy counts exactly the chunks the client got; mlx_lm.server streams one
            # chunk per token except that its BPEStreamingDetokenizer holds a lone-space
            # token back and sends it with the next one (with these prompts: never seen)
            assert rec.completion_tokens_counted == s.content_chunks <= rec.completion_tokens_reported
        assert abs(r["ttft_s"] - 1) <= TIMING_TOLERANCE, f"TTFT through the proxy is off by more than 15%: {summary}"
        assert abs(r["decode_tps"] - 1) <= TIMING_TOLERANCE, (
            f"decode tok/s through the proxy is off by more than 15%: {summary}"
        )


def test_local_tokenizer_makes_usage_check_exact(mlx_server: str, tiny_model: Path, record_property: Any) -> None:
    """With ``tokenizer: <model>/tokenizer.json`` every streamed record carries the
    tokenizer's count of exactly the text the client received, and that count is the
    server's usage to within a token or two, while counting chunks can be off by many
    (see the measured figures)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    tok_diffs, chunk_diffs = [], []
    reported: list[int] = []
    alarms: list[str] = []

    def check(px: Any, s: Seen) -> None:
        rec = px.record(s.request_id)
        assert_completed(rec)
        assert rec.completion_tokens_reported == s.usage.completion_tokens
        # exact: the proxy counts precisely the text the client got, with the same tokenizer
        assert rec.completion_tokens_tokenizer == len(tok.encode(s.text, add_special_tokens=False).ids)
        assert rec.completion_tokens_counted == s.content_chunks
        tok_diffs.append(rec.completion_tokens_reported - rec.completion_tokens_tokenizer)
        reported.append(rec.completion_tokens_reported)
        alarms.extend(k for k in rec.anomalies if k in ("usage_mismatch", "phantom_speed"))
        chunk_diffs.append(rec.completion_tokens_reported - rec.completion_tokens_counted)

    with mlxproxy_serve(mlx_server, {"tokenizer": str(tiny_model / "tokenizer.json")}) as px:
        client = sdk(px.url)
        # long nonce prompts, and short chat-like ones (whose replies hold many lone spaces)
        for max_tokens in (16, 32, 64, 128, 256):
            check(
                px,
                sdk_stream(
                    client,
                    messages=user(nonce_prompt(10)),
                    temperature=0,
                    max_tokens=max_tokens,
                    stream_options={"include_usage": True},
                ),
            )
        for i in range(5):
            check(
                px,
                sdk_stream(
                    client,
                    messages=user(f"hi {i}"),
                    temperature=0,
                    max_tokens=64,
                    stream_options={"include_usage": True},
                ),
            )
    # Without a configured tokenizer, a model name that is the local folder finds it too.
    with mlxproxy_serve(mlx_server) as px:
        s = sdk_stream(
            sdk(px.url),
            messages=user(nonce_prompt(10)),
            temperature=0,
            max_tokens=64,
            stream_options={"include_usage": True},
            extra_body={"model": str(tiny_model)},
        )
        assert px.record(s.request_id).model == str(tiny_model)
        check(px, s)
    record_property("usage_minus_tokenizer", tok_diffs)
    record_property("usage_minus_chunks", chunk_diffs)
    print(f"\nusage - tokenizer count per request: {tok_diffs}\nusage - streamed chunks per request: {chunk_diffs}")
    # Re-encoding the streamed text is not always the generated token sequence: a random
    # model emits non-canonical splits that BPE merges (count lower) and whitespace tokens
    # that the pre-tokenizer splits (count higher). Usually within 2 either way, but more on
    # long replies (a clean-clone CI run saw more than 3), which is why the usage check
    # allows the tokenizer a relative tolerance (detectors.tokenizer_tolerance, 10 %) plus
    # usage_extra_tokens (3). What must hold is that band, and no false usage alarm.
    tol = Thresholds().tokenizer_tolerance
    assert all(abs(d) <= 3 + tol * r for d, r in zip(tok_diffs, reported)), (tok_diffs, reported)
    assert not alarms, alarms
    assert all(d >= 0 for d in chunk_diffs), chunk_diffs


PROGRESS_PROMPT_WORDS = 250  # ~2900 tokens: ~180 prefill steps of 16, a few hundred ms
_KEEPALIVE = re.compile(rb"^: keepalive (\d+)/(\d+)$")


def test_prefill_progress_comments_pass_through_and_show_in_streams(mlx_server: str, record_property: Any) -> None:
    """mlx_lm.server's ``: keepalive P/T`` comments reach the client byte for byte, and
    ``GET /streams`` shows the in-flight request's ``prefill_progress`` advancing."""
    with mlxproxy_serve(mlx_server) as px:
        polls: list[dict[str, Any]] = []
        stop = threading.Event()

        def poll() -> None:
            with httpx.Client(trust_env=False, timeout=10) as c:
                while not stop.is_set():
                    polls.extend(c.get(px.url + "/streams").json()["in_flight"])
                    time.sleep(0.005)  # polling interval, not a measurement

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        body = {
            "model": MODEL_NAME,
            "messages": user(nonce_prompt(PROGRESS_PROMPT_WORDS)),
            "stream": True,
            "max_tokens": 8,
            "stream_options": {"include_usage": True},
        }
        try:
            with (
                httpx.Client(trust_env=False, timeout=120) as c,
                c.stream("POST", px.url + "/v1/chat/completions", json=body) as r,
            ):
                assert r.status_code == 200
                rid = r.headers["x-mlxproxy-request-id"]
                raw = b"".join(r.iter_raw())
        finally:
            stop.set()
            poller.join(10)
        rec = px.record(rid)

    # What the client got: comments, then data, exactly as mlx_lm.server writes them.
    blocks = raw.split(b"\n\n")
    assert blocks[-1] == b"" and blocks[-2] == b"data: [DONE]"
    comments = [b for b in blocks if b.startswith(b":")]
    first_data = next(i for i, b in enumerate(blocks) if b.startswith(b"data:"))
    assert blocks[:first_data] == comments, "all comments come before the first data event"
    progress = []
    for c in comments:
        m = _KEEPALIVE.match(c)
        assert m, f"not mlx_lm.server's keepalive comment: {c!r}"
        progress.append((int(m.group(1)), int(m.group(2))))
    total = progress[-1][1]
    assert {t for _, t in progress} == {total} and progress[-1][0] == total
    # steps of 16, then T-1 (the last prompt token is fed with the first decode step), then T
    steps = [p for p, _ in progress[:-2]]
    assert steps == list(range(PREFILL_STEP, PREFILL_STEP * len(steps) + 1, PREFILL_STEP)), (steps[:3], steps[-3:])
    assert progress[-2][0] == total - 1 and total - 1 - steps[-1] <= PREFILL_STEP, progress[-3:]
    assert total > 2000, f"prompt too short for a visible prefill: {total} tokens"

    # The record agrees with what the client received.
    assert (rec.outcome, rec.anomalies) == ("ok", ())
    assert rec.comments == len(comments) and rec.prefill_progress == (total, total)
    assert rec.prompt_tokens - (rec.cached_tokens or 0) == total

    # What /streams showed while the prompt was processed.
    mine = [e for e in polls if e["id"] == rid]
    during = [tuple(e["prefill_progress"]) for e in mine if e["prefill_progress"] and e["ttft_s"] is None]
    record_property("prefill_snapshots", len(during))
    print(
        f"\n/streams showed prefill progress in {len(during)} snapshots of a {total}-token prefill "
        f"({len(comments)} comments, {len(mine)} snapshots in all): first {during[:1]}, last {during[-1:]}"
    )
    assert any(p < t for p, t in during), f"no in-flight snapshot caught the prefill in progress: {mine[:3]}"
    assert set(during) <= set(progress), "the proxy reported progress the client never received"
    assert [p for p, _ in during] == sorted(p for p, _ in during), "progress went backwards"
    assert all(e["tokens_so_far"] == 0 for e in mine if e["ttft_s"] is None)


#: Batching. mlx_lm.server admits a request into a running batch only between time
#: budgets of 0.5 s (TimeBudget in mlx_lm/server.py): a second request arriving a
#: millisecond after the first, once the first is in the batch, waits until the first
#: finishes *or* 0.5 s pass. A tiny-model reply of 64 tokens lasts ~80 ms, so whether two
#: such requests overlap at all is a coin flip decided by sub-millisecond arrival jitter
#: (with or without a proxy). Replies of 1000 tokens (~1-1.5 s) outlast the budget: the
#: second request always joins the first's batch, at once (overlap ~1.0, speedup ~1.6x
#: here) or at the next budget (overlap ~0.4-0.5, speedup ~1.2x), never after the first
#: has finished (overlap 0, "serialized").
#:
#: The proxy side is sent by bench's own client (the Waves shape) with a fresh
#: connection pool per wave, so both requests of a wave open new connections, as they do
#: against mlx_lm.server directly (HTTP/1.0). Run through the proxy, ``mlxproxy bench``
#: itself sends one request of each wave on the keep-alive connection left by its single
#: request and the other on a new one: the ~2-5 ms skew makes mlx_lm.server admit the
#: second one late in most waves (test_proxy_bugs_found.py shows it).
BATCH_MAX_TOKENS = 1000
BATCH_PROMPT_TOKENS = 100
BATCH_ROUNDS = 3
#: The proxy's figures vs the client's for the very same requests: they must agree closely.
SAME_REQUESTS_SPEEDUP_TOL = 0.10
SAME_REQUESTS_OVERLAP_TOL = 0.05
#: The proxy's figures vs bench run directly against the server, rounds interleaved. Every
#: wave on both sides must overlap (>= 0.3: a late admission at most halves the overlap).
#: Speedups are compared between waves admitted the same way (at once: overlap >= 0.8),
#: medians within 25%: a round's speedup moves by ~10-20% with a shared runner's load.
MIN_OVERLAP = 0.3
AT_ONCE_OVERLAP = 0.8
SPEEDUP_TOL = 0.25


def _clusters(records: list[Record]) -> list[list[Record]]:
    """Records grouped by overlapping [start, end] intervals (a single, or a wave)."""
    out: list[list[Record]] = []
    end = -1.0
    for r in sorted(records, key=lambda r: r.t_start_mono):
        if out and r.t_start_mono < end:
            out[-1].append(r)
            end = max(end, r.t_end_mono)
        else:
            out.append([r])
            end = r.t_end_mono
    return out


def _figures(single: Record, wave: list[Record]) -> dict[str, float]:
    """bench's "double" figures: pair tok/s over the single's wall tok/s, and overlap."""
    agg = aggregate_tps(wave)
    return {
        "speedup": agg / single.wall_tps,
        "overlap": overlap_ratio(wave),
        "single_tps": single.wall_tps,
        "pair_tps": agg,
    }


def _bench_figures(res: TargetResult) -> dict[str, float]:
    groups = {g.name: g for g in res.groups}
    (single,) = [r.record for r in groups["single"].records]
    s = groups["double"].summary
    return {"speedup": s.speedup, "overlap": s.overlap, "single_tps": single.wall_tps, "pair_tps": s.aggregate_tps}


def test_two_parallel_requests_batched_through_proxy_as_bench_reports(mlx_server: str, record_property: Any) -> None:
    """Two requests released together through the proxy are batched by mlx_lm.server, and
    the proxy's own records show it with the figures ``mlxproxy bench`` reports."""
    import asyncio

    from mlxproxy.load.commands.bench_requests import chat_body
    from mlxproxy.load.commands.common import filler_text
    from mlxproxy.load.run.client import MeasuringClient, PreparedRequest
    from mlxproxy.load.run.runner import send
    from mlxproxy.load.run.shapes import Load, Waves

    def req() -> PreparedRequest:  # like bench's: nonce + filler, ~100 prompt tokens, temperature 0
        text = f"[nonce {uuid.uuid4().hex[:12]}] " + filler_text(4 * BATCH_PROMPT_TOKENS - 60)
        return PreparedRequest(
            "POST",
            "/v1/chat/completions",
            chat_body(MODEL_NAME, text, BATCH_MAX_TOKENS),
            (("content-type", "application/json"),),
        )

    async def through_proxy(url: str) -> tuple[Record, list[Record]]:
        async with MeasuringClient(url, timeout_s=120) as c:
            single = await c.send(req())
        async with MeasuringClient(url, timeout_s=120) as c:  # fresh pool: both open a connection
            (wave,) = (await send(Waves(2), Load([req(), req()]), c)).waves
        return single, wave

    opts = BenchOptions(
        prompt_tokens=(BATCH_PROMPT_TOKENS,), max_tokens=BATCH_MAX_TOKENS, repeat=1, batch=2, model=MODEL_NAME
    )
    direct: list[TargetResult] = []
    client: list[tuple[Record, list[Record]]] = []
    with mlxproxy_serve(mlx_server, capture=True) as px:
        for i in range(BATCH_ROUNDS):  # interleaved, order flipped each round
            for side in ("direct", "proxy") if i % 2 == 0 else ("proxy", "direct"):
                if side == "direct":
                    (res,) = asyncio.run(bench_targets([Target("mlx-lm", mlx_server, 120.0)], opts))
                    assert res.error is None, res.error
                    direct.append(res)
                else:
                    client.append(asyncio.run(through_proxy(px.url)))
        captured = px.captured(at_least=3 * BATCH_ROUNDS)
    clusters = _clusters([r for r in captured if r.stream and r.max_tokens == BATCH_MAX_TOKENS])
    assert [len(c) for c in clusters] == [1, 2] * BATCH_ROUNDS, [len(c) for c in clusters]

    rows = []
    for i in range(BATCH_ROUNDS):
        (single,), wave = clusters[2 * i], clusters[2 * i + 1]
        for r in (single, *wave):
            assert (r.outcome, r.anomalies) == ("ok", ()), r
            assert r.completion_tokens_reported == BATCH_MAX_TOKENS
        assert sorted(r.concurrency for r in wave) == [1, 2], "the proxy saw both requests in flight together"
        c_single, c_wave = client[i]
        for r in (c_single, *c_wave):
            assert (r.outcome, r.anomalies) == ("ok", ()), r
        rows.append(
            {
                "proxy": _figures(single, wave),
                "client": _figures(c_single, c_wave),
                "bench_direct": _bench_figures(direct[i]),
            }
        )
    for res in direct:
        for g in res.groups:
            assert not g.summary.anomalies, (g.name, g.summary.anomalies)

    lines = [
        f"  round {i}: "
        + "; ".join(
            f"{src} speedup {f['speedup']:.2f}x overlap {f['overlap']:.2f} "
            f"(single {f['single_tps']:.0f}, pair {f['pair_tps']:.0f} tok/s)"
            for src, f in row.items()
        )
        for i, row in enumerate(rows)
    ]
    print("\nbatching, two requests released together:\n" + "\n".join(lines))

    # 1. The very same requests: the proxy's figures are the client's (bench's meter).
    for row in rows:
        p, c = row["proxy"], row["client"]
        assert abs(p["speedup"] / c["speedup"] - 1) <= SAME_REQUESTS_SPEEDUP_TOL, lines
        assert abs(p["overlap"] - c["overlap"]) <= SAME_REQUESTS_OVERLAP_TOL, lines
    # 2. bench directly against the same server: overlapping streams in every wave on both
    #    sides, and the same speedup for waves admitted the same way.
    assert all(row[src]["overlap"] >= MIN_OVERLAP for row in rows for src in ("proxy", "bench_direct")), lines
    compared = 0
    for at_once in (True, False):
        sp = {
            src: [row[src]["speedup"] for row in rows if (row[src]["overlap"] >= AT_ONCE_OVERLAP) == at_once]
            for src in ("proxy", "bench_direct")
        }
        if sp["proxy"] and sp["bench_direct"]:
            ratio = median(sp["proxy"]) / median(sp["bench_direct"])
            record_property(f"speedup_ratio_{'at_once' if at_once else 'late'}", round(ratio, 3))
            assert abs(ratio - 1) <= SPEEDUP_TOL, (at_once, sp, lines)
            compared += 1
    assert compared, f"no admission mode in common over {BATCH_ROUNDS} rounds: {lines}"
    for src in ("proxy", "bench_direct"):
        record_property(f"{src}_speedup_p50", round(median([row[src]["speedup"] for row in rows]), 3))
        record_property(f"{src}_overlap_p50", round(median([row[src]["overlap"] for row in rows]), 3))
