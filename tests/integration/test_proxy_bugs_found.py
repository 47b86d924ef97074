"""Minimal, deterministic reproductions of bugs first seen with real peers.

Each test replays what a real peer does with a scripted upstream (tests/fakeupstream.py),
so it fails or passes the same way every time, without mlx. Fixed ones stay as
regression tests.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import httpx
import pytest

from fakeupstream import Conn, FakeUpstream, Req
from mlxproxy.config import build_config
from mlxproxy.edge.runner import ServerThread
from mlxproxy.proxy.app import ProxyApp, create_app

from .peers import wait_for

pytestmark = pytest.mark.integration

openai = pytest.importorskip("openai", reason="the OpenAI SDK is part of the [test] extra: pip install -e '.[test]'")

MLX_LM_STREAM = (
    b": keepalive 16/20\n\n: keepalive 20/20\n\n"
    b'data: {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "default_model", '
    b'"choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hello"}, "finish_reason": null}]}\n\n'
    b'data: {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "default_model", '
    b'"choices": [{"index": 0, "delta": {"role": "assistant", "content": " world"}, "finish_reason": "length"}]}\n\n'
    b'data: {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "default_model", "choices": [], '
    b'"usage": {"prompt_tokens": 20, "completion_tokens": 2, "total_tokens": 22, '
    b'"prompt_tokens_details": {"cached_tokens": 0}}}\n\n'
    b"data: [DONE]\n\n"
)


@contextlib.contextmanager
def in_process_proxy(upstream_url: str) -> Iterator[tuple[str, ProxyApp]]:
    app = create_app(build_config(upstream_url=upstream_url, log_requests=False))
    with ServerThread(app, server_header=False, date_header=False) as srv:
        yield srv.url, app


def test_sdk_closing_right_after_done_is_not_a_client_disconnect() -> None:
    """mlx_lm.server speaks HTTP/1.0: its body ends when it closes the socket, a moment
    after ``data: [DONE]``. The OpenAI Python SDK stops at ``[DONE]`` and closes its
    connection at once. When the client's close reaches the proxy before the upstream's
    EOF, the proxy records ``client_disconnect`` for a stream that completed normally
    (seen for ~15% of SDK streams against a real mlx_lm.server). Here the upstream holds
    its socket open after ``[DONE]`` until the test has finished reading, so the race
    always goes the same way. (Fixed in ef36c6a.)"""
    client_done = threading.Event()

    async def mlx_lm_like(req: Req, conn: Conn) -> None:
        await conn.head(200, [("Content-Type", "text/event-stream")], version="1.0")
        await conn.send(MLX_LM_STREAM)
        await conn.wait_gate(client_done, 10)  # the server's handler returns a bit later
        conn.writer.close()

    with FakeUpstream(mlx_lm_like) as up, in_process_proxy(up.url) as (url, app):
        client = openai.OpenAI(
            base_url=url + "/v1", api_key="dummy", max_retries=0, http_client=httpx.Client(trust_env=False, timeout=10)
        )
        raw = client.chat.completions.with_raw_response.create(
            model="default_model",
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            stream_options={"include_usage": True},
        )
        text = "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
        assert text == "Hello world"  # the client got the whole stream, [DONE] included
        rid = raw.headers["x-mlxproxy-request-id"]
        try:
            wait_for(lambda: any(r.id == rid for r in app.recent.records), timeout_s=1.0)
        except AssertionError:
            pass  # a proxy that waits for the upstream's EOF finishes once the gate opens
        finally:
            client_done.set()
        rec = wait_for(lambda: next((r for r in app.recent.records if r.id == rid), None))
        assert rec.finish_reason == "length" and rec.completion_tokens_reported == 2
        assert rec.outcome == "ok", (
            f"outcome {rec.outcome!r} ({rec.error}) for a stream the client read to data: [DONE]"
        )


def test_requests_released_together_start_alike() -> None:
    """``bench``'s double test (the Waves shape) after its single-request phase:
    one request of the wave goes out on the keep-alive connection the single request left
    in the pool, the other has to open a new connection first. Against a keep-alive
    target -- the proxy, or any HTTP/1.1 server -- that skews their arrival by ~2-5 ms on
    a 2-core runner, enough for mlx_lm.server (which admits new requests into a running
    batch only every 0.5 s) to admit the second one late: through the proxy 7 of 10 waves
    joined late vs 0 of 10 direct (mlx_lm.server is HTTP/1.0, so there both connections
    are new), and ``mlxproxy bench --target <proxy>`` reported ~1.2x / overlap ~0.45 where
    the same server gives ~1.65x / overlap 1.0. Fixed: every request of a wave now starts
    on a new connection."""
    import asyncio

    from mlxproxy.load.run.client import MeasuringClient, PreparedRequest
    from mlxproxy.load.run.runner import send
    from mlxproxy.load.run.shapes import Load, Waves

    ports: dict[bytes, int] = {}
    body = b'{"object":"list","data":[]}'

    async def keep_alive(req: Req, conn: Conn) -> None:
        ports[req.body] = conn.writer.get_extra_info("peername")[1]
        await conn.head(200, [("content-type", "application/json"), ("content-length", str(len(body)))])
        await conn.send(body)

    def post(tag: bytes) -> PreparedRequest:
        return PreparedRequest("POST", "/v1/embeddings", tag, (("content-type", "application/json"),))

    async def bench_like(url: str) -> None:
        async with MeasuringClient(url, timeout_s=10) as c:
            await c.send(post(b'"single"'))
            await send(Waves(2), Load([post(b'"a"'), post(b'"b"')]), c)

    with FakeUpstream(keep_alive) as up:
        asyncio.run(bench_like(up.url))
    reused = {tag: ports[tag] == ports[b'"single"'] for tag in (b'"a"', b'"b"')}
    assert len(set(reused.values())) == 1, (
        f"one request of the wave reused the warm connection and the other opened a new one: {reused}"
    )
