"""The usage check and the trusted token count against the real ``mlx_lm.server``.

A healthy server's usage is the truth: every record's ``tokens_source`` is ``usage`` and
its speeds are the ones computed from the server's count, and no ``usage_mismatch`` or
``phantom_speed`` fires, with or without a local tokenizer, over 200 requests of varied
real text: a model rigged to write code with deep indentation, long words, CJK, Cyrillic
and mixed scripts (``fixedtext.py``), plus the random tiny model with varied prompts
(whose non-canonical token splits re-encode to other counts).
"""

from __future__ import annotations

import contextlib
import json
import random
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from mlxproxy.core.record import Record, rate_figures, wall_window_s

from .conftest import PREFILL_STEP
from .peers import SERVER_CPUS, cpu_affinity, mlxproxy_serve, require_mlx
from .tinymodel import MODEL_NAME

pytestmark = pytest.mark.integration

require_mlx()

RIGGED_REQUESTS = 160  # of the 200 per configuration; the rest go to the random tiny model
RANDOM_REQUESTS = 40
USAGE_KINDS = {"usage_mismatch", "phantom_speed"}


@pytest.fixture(scope="module")
def fixed_text(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, str]]:
    """The rigged model and a real mlx_lm.server serving it."""
    from .fixedtext import build_fixed_text_model
    from .tinymodel import mlx_lm_server

    model = build_fixed_text_model(tmp_path_factory.mktemp("fixed-text") / "model")
    log = tmp_path_factory.mktemp("fixed-text-log") / "server.log"
    with contextlib.ExitStack() as stack:
        with cpu_affinity(SERVER_CPUS):
            url = stack.enter_context(
                mlx_lm_server(
                    model.path, max_tokens=64, log_path=log, extra_args=["--prefill-step-size", str(PREFILL_STEP)]
                )
            )
        yield model, url


def stream_chat(http: httpx.Client, base: str, content: str, max_tokens: int) -> dict[str, Any]:
    """One streamed chat completion; what the client saw."""
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    text, usage, events = [], None, 0
    with http.stream("POST", base + "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        rid = r.headers.get("x-mlxproxy-request-id")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            usage = obj.get("usage") or usage
            for ch in obj.get("choices") or []:
                if (ch.get("delta") or {}).get("content"):
                    text.append(ch["delta"]["content"])
                    events += 1
    return {"id": rid, "text": "".join(text), "usage": usage, "events": events}


def varied_requests(model: Any, seed: int) -> list[tuple[str, str, int]]:
    """(kind, prompt, max_tokens): every start point of every passage, then random ones,
    with reply caps from 16 to 256 (long ones cycle through a passage)."""
    rng = random.Random(seed)
    starts = list(model.starts)
    rng.shuffle(starts)
    picks = (starts * (RIGGED_REQUESTS // len(starts) + 1))[:RIGGED_REQUESTS]
    return [(name, prompt, rng.choice((16, 24, 40, 64, 100, 160, 256))) for name, prompt, _, _ in picks]


RANDOM_PROMPTS = [
    "Write a Python function with four levels of nested loops and explain it.",
    "Переведи на русский: the quick brown fox jumps over the lazy dog.",
    "用中文写一首关于大海的短诗。",
    "日本語で自己紹介をしてください。",
    "List twenty long English words such as internationalization.",
    "Give me a deeply nested YAML config for a Kubernetes deployment.",
    "Schreibe einen Satz mit dem Wort Donaudampfschifffahrtsgesellschaft.",
    "Explain ñ, ü, ø and ß with examples.",
]


def check_records(px: Any, seen: list[dict[str, Any]], tokenizer: bool) -> dict[str, int]:
    px.record(seen[-1]["id"])  # the last record is written just after its response ended
    by_id = {r.id: r for r in px.records()}
    stats = {"requests": 0, "stop": 0, "chars_over_4": 0, "tokenizer_differs": 0}
    for s in seen:
        rec: Record = by_id[s["id"]]
        stats["requests"] += 1
        assert rec.outcome == "ok", rec
        assert not USAGE_KINDS & set(rec.anomalies), (rec.anomaly_evidence, s["text"][:200])
        rep = s["usage"]["completion_tokens"]
        assert rec.completion_tokens_reported == rep and rec.completion_tokens_counted == s["events"]
        # the trusted count is the server's usage, and so are the speeds
        assert (rec.completion_tokens, rec.tokens_source, rec.n_out) == (rep, "usage", rep)
        assert (rec.tpot_s, rec.decode_tps, rec.wall_tps) == rate_figures(
            rep, rec.ttft_s, rec.e2e_s, wall_window_s(rec.duration_s, rec.tail_after_done_s)
        )
        assert (rec.completion_tokens_tokenizer is not None) == (tokenizer and s["events"] > 0)
        stats["stop"] += rec.finish_reason == "stop"
        stats["chars_over_4"] += len(s["text"]) / 4 > rep + 3  # where chars/4 used to cry wolf
        if rec.completion_tokens_tokenizer is not None:
            stats["tokenizer_differs"] += abs(rec.completion_tokens_tokenizer - rep) > 3
    return stats


@pytest.mark.parametrize("tokenizer", [False, True], ids=["no-tokenizer", "tokenizer"])
def test_200_requests_of_real_text_raise_no_usage_alarm(
    fixed_text, mlx_server: str, tiny_model: Path, tokenizer: bool, record_property: Any
) -> None:
    model, fixed_url = fixed_text
    http = httpx.Client(timeout=120.0, trust_env=False)
    totals: dict[str, dict[str, int]] = {}
    try:
        cfg = {"recent_records": 500, **({"tokenizer": str(model.path / "tokenizer.json")} if tokenizer else {})}
        with mlxproxy_serve(fixed_url, cfg) as px:
            seen = []
            for _kind, prompt, max_tokens in varied_requests(model, seed=14):
                s = stream_chat(http, px.url, prompt, max_tokens)
                seen.append(s)
            totals["rigged"] = check_records(px, seen, tokenizer)
        cfg = {"recent_records": 500, **({"tokenizer": str(tiny_model / "tokenizer.json")} if tokenizer else {})}
        rng = random.Random(20)
        with mlxproxy_serve(mlx_server, cfg) as px:
            seen = [
                stream_chat(
                    http,
                    px.url,
                    f"[{rng.random():.8f}] {RANDOM_PROMPTS[i % len(RANDOM_PROMPTS)]}",
                    rng.choice((16, 48, 100, 200, 256)),
                )
                for i in range(RANDOM_REQUESTS)
            ]
            totals["random"] = check_records(px, seen, tokenizer)
    finally:
        http.close()
    print(f"\nusage check on live mlx_lm.server ({'with' if tokenizer else 'without'} a tokenizer): {totals}")
    record_property("totals", totals)
    assert totals["rigged"]["requests"] + totals["random"]["requests"] == 200
    # the text really was of the hard kinds: the old chars/4 estimate overshoots on many
    # replies, and natural stops (EOS counted in usage, not streamed) are among them
    assert totals["rigged"]["chars_over_4"] >= 20 and totals["rigged"]["stop"] >= 20, totals


def test_over_reporting_server_still_fires(fixed_text) -> None:
    """A server whose usage over-reports 4x (the real server's stream, passed on event by
    event by a relay that multiplies its usage): the usage check fires, and the speeds use
    the streamed count, or the tokenizer's."""
    from mlxproxy.edge.runner import ServerThread

    model, fixed_url = fixed_text

    def four_times(event: bytes) -> bytes:
        return re.sub(
            rb'"completion_tokens":\s*(\d+)', lambda m: b'"completion_tokens": %d' % (4 * int(m.group(1))), event
        )

    async def relay(scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        async with httpx.AsyncClient(timeout=60.0, trust_env=False) as c:
            async with c.stream(
                "POST", fixed_url + scope["path"], content=body, headers={"content-type": "application/json"}
            ) as r:
                await send(
                    {
                        "type": "http.response.start",
                        "status": r.status_code,
                        "headers": [(b"content-type", r.headers["content-type"].encode())],
                    }
                )
                buf = b""
                async for data in r.aiter_bytes():
                    buf += data
                    *events, buf = buf.split(b"\n\n")
                    if events:
                        await send(
                            {
                                "type": "http.response.body",
                                "more_body": True,
                                "body": b"".join(four_times(e) + b"\n\n" for e in events),
                            }
                        )
                await send({"type": "http.response.body", "body": four_times(buf)})

    name, prompt, _, stops = next(s for s in model.starts if s[0] == "python" and not s[3])
    http = httpx.Client(timeout=60.0, trust_env=False)
    try:
        with ServerThread(relay) as liar:
            for cfg in ({}, {"tokenizer": str(model.path / "tokenizer.json")}):
                with mlxproxy_serve(liar.url, cfg) as px:
                    s = stream_chat(http, px.url, prompt, 120)
                    rec = px.record(s["id"])
                assert s["usage"]["completion_tokens"] == 480 and s["events"] == 120
                assert rec.completion_tokens_reported == 480 and rec.completion_tokens_counted == 120
                # phantom_speed needs 3x the estimate: without a tokenizer, this code's long tokens
                # (6 chars on average) make chars/4 read 185 for its 120 tokens, so only the mismatch fires
                expected = {"usage_mismatch", "phantom_speed"} if cfg else {"usage_mismatch"}
                assert expected <= set(rec.anomalies), rec.anomaly_evidence
                source = "tokenizer" if cfg else "stream"
                n = rec.completion_tokens_tokenizer if cfg else 120
                assert (rec.completion_tokens, rec.tokens_source) == (n, source)
                assert (rec.tpot_s, rec.decode_tps, rec.wall_tps) == rate_figures(
                    n, rec.ttft_s, rec.e2e_s, wall_window_s(rec.duration_s, rec.tail_after_done_s)
                )
    finally:
        http.close()
