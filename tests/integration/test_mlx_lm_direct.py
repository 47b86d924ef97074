"""Direct checks of a real ``mlx_lm.server`` (no proxy) serving the tiny local model.

These pin down the wire behaviour the proxy relies on (see
docs/WIRE.md#what-each-server-sends, "mlx_lm.server"): HTTP/1.0 with the body ending at connection close,
``: keepalive P/T`` prefill comments before the first data event, ``role`` in
every delta, a ``choices: []`` usage chunk with ``object: "chat.completion"``
when ``include_usage`` is set, and ``data: [DONE]`` last.

Skipped (with the reason) where mlx / mlx_lm are not importable. Talks only to
127.0.0.1. Runtime is a few seconds on 2 CPU cores.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from .peers import require_mlx
from .tinymodel import MODEL_NAME

pytestmark = pytest.mark.integration

require_mlx()

from .tinymodel import build_tiny_model, mlx_lm_server  # noqa: E402

#: Server-side default reply cap (``--max-tokens``).
SERVER_MAX_TOKENS = 64
#: Small prefill step so a few-hundred-token prompt takes many steps and
#: produces many ``: keepalive P/T`` comments (the default 2048 gives only
#: ``T-1/T`` and ``T/T`` for prompts under 2048 uncached tokens).
PREFILL_STEP = 16


@dataclass
class Exchange:
    """One HTTP exchange read to connection close, with per-line arrival times."""

    version: int  # 10 for HTTP/1.0, 11 for HTTP/1.1
    status: int
    headers: dict[str, str]  # lower-cased names
    body: bytes
    lines: list[tuple[float, str]] = field(default_factory=list)  # (perf_counter, line)
    t_sent: float = 0.0


@dataclass
class SSE:
    """A parsed SSE stream: comments and data payloads in arrival order."""

    events: list[tuple[float, str, str]]  # (time, "comment" | "data", text)

    @property
    def comments(self) -> list[str]:
        return [t for _, kind, t in self.events if kind == "comment"]

    @property
    def data(self) -> list[str]:
        return [t for _, kind, t in self.events if kind == "data"]

    def chunks(self) -> list[dict[str, Any]]:
        return [json.loads(d) for d in self.data if d != "[DONE]"]


def _request(
    base_url: str, method: str, path: str, body: dict[str, Any] | None = None, timeout: float = 30.0
) -> Exchange:
    """Send one request and read the response to EOF line by line (works for HTTP/1.0 streams)."""
    u = urlsplit(base_url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    try:
        payload = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"} if payload is not None else {}
        t_sent = time.perf_counter()
        conn.request(method, path, body=payload, headers=headers)
        resp = conn.getresponse()
        lines: list[tuple[float, str]] = []
        raw = bytearray()
        while True:
            line = resp.readline()
            if not line:
                break
            raw += line
            lines.append((time.perf_counter(), line.decode("utf-8").rstrip("\r\n")))
        return Exchange(
            version=resp.version,
            status=resp.status,
            headers={k.lower(): v for k, v in resp.getheaders()},
            body=bytes(raw),
            lines=lines,
            t_sent=t_sent,
        )
    finally:
        conn.close()


def _parse_sse(ex: Exchange) -> SSE:
    """Parse SSE lines: ``: text`` is a comment, ``data: x`` a data event; blank lines separate."""
    events: list[tuple[float, str, str]] = []
    for t, line in ex.lines:
        if not line:
            continue
        if line.startswith(":"):
            events.append((t, "comment", line[1:].strip()))
        elif line.startswith("data:"):
            events.append((t, "data", line[5:].strip()))
        else:
            raise AssertionError(f"unexpected SSE line: {line!r}")
    return SSE(events)


def _chat(content: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": content}], **extra}


def _long_prompt(words: int = 60) -> str:
    """A prompt of a few hundred tokens, with a nonce so the server's prompt cache cannot shorten prefill."""
    return f"[{uuid.uuid4().hex}] " + " ".join(f"item{i} fox jumps" for i in range(words))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    model_dir = build_tiny_model(tmp_path_factory.mktemp("tiny-model") / "model", seed=0)
    log = tmp_path_factory.mktemp("mlx-log") / "server.log"
    with mlx_lm_server(
        model_dir,
        max_tokens=SERVER_MAX_TOKENS,
        extra_args=["--prefill-step-size", str(PREFILL_STEP)],
        log_path=log,
    ) as url:
        yield url


def test_health_and_models(server: str) -> None:
    """/health is {"status": "ok"} over HTTP/1.0; /v1/models lists the local folder (empty hub cache)."""
    h = _request(server, "GET", "/health")
    assert (h.version, h.status) == (10, 200)
    assert json.loads(h.body) == {"status": "ok"}
    m = _request(server, "GET", "/v1/models")
    assert m.status == 200
    ids = [d["id"] for d in json.loads(m.body)["data"]]
    assert len(ids) == 1 and Path(ids[0]).name == "model"


def test_stream_keepalive_role_usage_done(server: str) -> None:
    """Prefill comments, role in every delta, usage chunk with object chat.completion, [DONE] last."""
    body = _chat(_long_prompt(), stream=True, stream_options={"include_usage": True})
    ex = _request(server, "POST", "/v1/chat/completions", body)
    assert ex.status == 200
    assert ex.version == 10, "mlx_lm.server speaks HTTP/1.0"
    assert ex.headers["content-type"] == "text/event-stream"
    assert "content-length" not in ex.headers and "transfer-encoding" not in ex.headers
    sse = _parse_sse(ex)

    # Keepalive comments: all before the first data event, real prefill progress.
    first_data = next(i for i, (_, kind, _t) in enumerate(sse.events) if kind == "data")
    assert all(kind == "comment" for _, kind, _t in sse.events[:first_data])
    assert all(kind == "data" for _, kind, _t in sse.events[first_data:])
    progress = []
    for c in sse.comments:
        word, frac = c.split()
        assert word == "keepalive"
        p, t = frac.split("/")
        progress.append((int(p), int(t)))
    totals = {t for _, t in progress}
    assert len(totals) == 1
    (total,) = totals
    processed = [p for p, _ in progress]
    assert processed == sorted(processed) and processed[-1] == total
    assert len(set(processed)) >= 3, f"expected several prefill steps, got {progress}"
    assert processed[0] == PREFILL_STEP

    # Data: chunks, then the usage chunk, then [DONE] as the very last event.
    assert sse.data[-1] == "[DONE]"
    chunks = sse.chunks()
    *choice_chunks, usage_chunk = chunks
    ids = {c["id"] for c in chunks}
    assert len(ids) == 1
    for c in choice_chunks:
        assert c["object"] == "chat.completion.chunk"
        assert len(c["choices"]) == 1
        assert c["choices"][0]["delta"]["role"] == "assistant", "role is in every delta"
    assert all(c["choices"][0]["finish_reason"] is None for c in choice_chunks[:-1])
    finish = choice_chunks[-1]["choices"][0]
    assert finish["finish_reason"] == "length"  # random weights: EOS is never the argmax
    assert usage_chunk["object"] == "chat.completion"
    assert usage_chunk["choices"] == []
    usage = usage_chunk["usage"]
    assert usage["completion_tokens"] == SERVER_MAX_TOKENS
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    # Keepalive total counts only the prompt tokens not served from the prompt cache.
    assert total == usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"]
    text_chunks = [c for c in choice_chunks if c["choices"][0]["delta"].get("content")]
    assert 0 < len(text_chunks) <= usage["completion_tokens"]


def test_stream_without_include_usage_has_no_usage(server: str) -> None:
    """Without stream_options the stream carries no usage at all, but still ends with [DONE]."""
    ex = _request(server, "POST", "/v1/chat/completions", _chat("hello", stream=True, max_tokens=8))
    sse = _parse_sse(ex)
    assert sse.data[-1] == "[DONE]"
    chunks = sse.chunks()
    assert all("usage" not in c for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_non_stream(server: str) -> None:
    """A non-stream reply is one JSON object with a correct Content-Length."""
    body = _chat("Write a short story about a robot.", max_tokens=16)
    ex = _request(server, "POST", "/v1/chat/completions", body)
    assert (ex.version, ex.status) == (10, 200)
    assert ex.headers["content-type"] == "application/json"
    assert int(ex.headers["content-length"]) == len(ex.body)
    obj = json.loads(ex.body)
    assert obj["object"] == "chat.completion"
    assert obj["model"] == MODEL_NAME
    (choice,) = obj["choices"]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["role"] == "assistant"
    assert isinstance(choice["message"]["content"], str) and choice["message"]["content"]
    assert obj["usage"]["completion_tokens"] == 16


def test_temperature_zero_seed_is_deterministic(server: str) -> None:
    """temperature 0 + seed (the unbatched path) repeats exactly, streamed or not."""
    body = _chat("Tell me about the sea.", temperature=0, seed=7, max_tokens=32)
    texts = []
    for _ in range(2):
        obj = json.loads(_request(server, "POST", "/v1/chat/completions", body).body)
        texts.append(obj["choices"][0]["message"]["content"])
    assert texts[0] == texts[1]
    assert len(texts[0]) > 0
    # Streaming the same request yields the same text, chunk by chunk.
    ex = _request(server, "POST", "/v1/chat/completions", {**body, "stream": True})
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in _parse_sse(ex).chunks())
    assert streamed == texts[0]


def test_two_parallel_streams_complete(server: str) -> None:
    """Two concurrent streams (continuous batching) both finish with usage and [DONE]."""
    results: dict[int, Exchange] = {}
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = _request(
                server, "POST", "/v1/chat/completions",
                _chat(_long_prompt(20), stream=True, stream_options={"include_usage": True}, max_tokens=48),
            )  # fmt: skip
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    assert sorted(results) == [0, 1]
    ids = set()
    for ex in results.values():
        sse = _parse_sse(ex)
        assert sse.data[-1] == "[DONE]"
        chunks = sse.chunks()
        assert chunks[-1]["usage"]["completion_tokens"] == 48
        ids.add(chunks[0]["id"])
    assert len(ids) == 2


def test_decode_speed_64_tokens(server: str, record_property: Any) -> None:
    """Measure (not assert tightly) a 64-token streamed reply: total time, TTFT, decode tokens/s."""
    body = _chat(_long_prompt(10), stream=True, stream_options={"include_usage": True}, max_tokens=64)
    ex = _request(server, "POST", "/v1/chat/completions", body)
    sse = _parse_sse(ex)
    content_times = []
    for t, kind, d in sse.events:
        if kind == "data" and d != "[DONE]":
            choices = json.loads(d)["choices"]
            if choices and choices[0]["delta"].get("content"):
                content_times.append(t)
    usage = sse.chunks()[-1]["usage"]
    assert usage["completion_tokens"] == 64
    total_s = ex.lines[-1][0] - ex.t_sent
    ttft_s = content_times[0] - ex.t_sent
    decode_s = content_times[-1] - content_times[0]
    tps = (len(content_times) - 1) / decode_s if decode_s > 0 else float("inf")
    record_property("mlx_lm_64tok_total_s", round(total_s, 4))
    record_property("mlx_lm_ttft_s", round(ttft_s, 4))
    record_property("mlx_lm_decode_tps", round(tps, 1))
    print(
        f"\n64-token reply: total {total_s * 1000:.1f} ms, TTFT {ttft_s * 1000:.1f} ms, "
        f"decode {tps:.0f} tok/s ({len(content_times)} content chunks)"
    )
    assert total_s < 30, "a 64-token reply from the tiny model should take well under a second"
