"""The proxy over real sockets: uvicorn on port 0 in front of scripted upstreams."""

from __future__ import annotations

import gzip
import shutil
import socket
import subprocess
import threading

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fakeupstream import Conn, FakeUpstream, Req, sse_response
from support import closed_port, last_record, proxy, read_fixture, wait_for

# every forwarding test runs on both server stacks (conftest.stack): plain asyncio + h11 and uvloop + httptools
pytestmark = pytest.mark.usefixtures("stack")

STREAM_REQ = {
    "model": "m",
    "stream": True,
    "messages": [{"role": "user", "content": "hi"}],
    "stream_options": {"include_usage": True},
}


@pytest.mark.parametrize("http10", [False, True], ids=["chunked", "http10-close"])
@pytest.mark.parametrize(
    "fixture",
    [
        "wire/02_mlx_lm_server_reasoning_keepalive.sse",
        "wire/06_vllm_mlx_reasoning_usage_twice.sse",
        "real/mlx_lm_server_stream_usage.sse",
    ],
)
def test_stream_bytes_identical_and_measured(fixture: str, http10: bool) -> None:
    body = read_fixture(fixture)
    with FakeUpstream(sse_response(body, http10=http10)) as up, proxy(up.url) as (url, app):
        with httpx.Client() as c:
            with c.stream("POST", url + "/v1/chat/completions", json=STREAM_REQ, headers={"x-custom": "yes"}) as r:
                got = b"".join(r.iter_raw())
                assert r.status_code == 200
                rid = r.headers["x-mlxproxy-request-id"]
                assert r.headers["x-accel-buffering"] == "no"
                assert r.headers["content-type"].startswith("text/event-stream")
        assert got == body
        rec = last_record(app)
        assert rec.id == rid and rec.outcome == "ok" and rec.completion_tokens_reported is not None
        assert rec.ttft_s is not None and rec.generated_events > 0
        sent = up.requests[0]
        assert sent.header("x-custom") == "yes"
        assert orjson.loads(sent.body) == STREAM_REQ  # the client asked for usage: body untouched
        assert sent.body == orjson.dumps(STREAM_REQ)


def test_first_event_reaches_client_before_upstream_sends_second() -> None:
    gate = threading.Event()

    async def handler(req: Req, conn: Conn) -> None:
        await conn.head(200, [("content-type", "text/event-stream"), ("transfer-encoding", "chunked")])
        await conn.chunk(b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n')
        assert await conn.wait_gate(gate), "the test never saw the first event"
        await conn.chunk(
            b'data: {"choices":[{"index":0,"delta":{"content":"b"},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n'
        )
        await conn.end_chunked()

    with FakeUpstream(handler) as up, proxy(up.url) as (url, app):
        with httpx.Client(timeout=5) as c, c.stream("POST", url + "/v1/chat/completions", json=STREAM_REQ) as r:
            it = r.iter_raw()
            first = next(it)
            assert b'"content":"a"' in first and b'"b"' not in first
            gate.set()
            rest = b"".join(it)
        assert b"[DONE]" in rest
        rec = last_record(app)
        assert rec.outcome == "ok" and rec.generated_events == 2


def test_openai_sdk_streams_through_proxy() -> None:
    openai = pytest.importorskip("openai")
    body = read_fixture("wire/01_openai_reference_include_usage.sse")
    with FakeUpstream(sse_response(body)) as up, proxy(up.url) as (url, app):
        client = openai.OpenAI(base_url=url + "/v1", api_key="sk-test", max_retries=0)
        stream = client.chat.completions.create(
            model="gpt-x",
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            stream_options={"include_usage": True},
        )
        text, usage = "", None
        for ch in stream:
            if ch.choices and ch.choices[0].delta.content:
                text += ch.choices[0].delta.content
            if ch.usage:
                usage = ch.usage
        assert text == "Hello world" and usage is not None and usage.completion_tokens == 2
        rec = last_record(app)
        assert rec.outcome == "ok" and rec.model == "gpt-x" and rec.completion_tokens_reported == 2
        assert up.requests[0].header("authorization") == "Bearer sk-test"


def test_client_disconnect_cancels_upstream() -> None:
    cancelled = threading.Event()

    async def handler(req: Req, conn: Conn) -> None:
        await conn.head(200, [("content-type", "text/event-stream"), ("transfer-encoding", "chunked")])
        await conn.chunk(b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n')
        if await conn.wait_peer_close(10):
            cancelled.set()

    with FakeUpstream(handler) as up, proxy(up.url) as (url, app):
        with httpx.Client(timeout=5) as c:
            with c.stream("POST", url + "/v1/chat/completions", json=STREAM_REQ) as r:
                next(r.iter_raw())
        assert cancelled.wait(5), "upstream connection was not closed after the client left"
        rec = last_record(app)
        assert rec.outcome == "client_disconnect" and rec.generated_events == 1
        assert wait_for(lambda: not app.in_flight)


def test_unreachable_upstream_gives_502_openai_error() -> None:
    with proxy(f"http://127.0.0.1:{closed_port()}") as (url, app):
        r = httpx.post(url + "/v1/chat/completions", json=STREAM_REQ)
        assert r.status_code == 502
        err = r.json()["error"]
        assert set(err) >= {"message", "type", "code"} and err["code"] == "upstream_unreachable"
        assert "unreachable" in err["message"]
        rec = last_record(app)
        assert rec.outcome == "upstream_unreachable" and rec.id == r.headers["x-mlxproxy-request-id"]


def test_usage_injection_and_stripping() -> None:
    body = read_fixture("wire/01_openai_reference_include_usage.sse")
    usage_event = [e for e in body.split(b"\n\n") if b'"choices":[]' in e][0] + b"\n\n"
    req = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    with FakeUpstream(sse_response(body)) as up, proxy(up.url) as (url, app):
        r = httpx.post(
            url + "/v1/chat/completions", content=orjson.dumps(req), headers={"content-type": "application/json"}
        )
        assert r.content == body.replace(usage_event, b"")
        sent = up.requests[0].body
        assert sent == orjson.dumps(req)[:-1] + b',"stream_options":{"include_usage":true}}'
        rec = last_record(app)
        assert (
            rec.usage_injected
            and not rec.usage_requested
            and rec.completion_tokens_reported == 2
            and rec.outcome == "ok"
        )
    with FakeUpstream(sse_response(body)) as up, proxy(up.url, inject_usage=False) as (url, app):
        r = httpx.post(
            url + "/v1/chat/completions", content=orjson.dumps(req), headers={"content-type": "application/json"}
        )
        assert r.content == body and up.requests[0].body == orjson.dumps(req)


def test_non_stream_and_error_bodies_pass_through() -> None:
    raw = read_fixture("wire/10_omlx_context_400.http")
    err_body = raw.split(b"\r\n\r\n", 1)[1]
    ok_body = read_fixture("wire/16_omlx_nonstream_leading_spaces.json")

    async def handler(req: Req, conn: Conn) -> None:
        if b"long" in req.body:
            await conn.head(400, [("content-type", "application/json"), ("content-length", str(len(err_body)))])
            await conn.send(err_body)
        else:
            await conn.head(200, [("content-type", "application/json"), ("content-length", str(len(ok_body)))])
            await conn.send(ok_body)

    with FakeUpstream(handler) as up, proxy(up.url) as (url, app):
        r = httpx.post(
            url + "/v1/chat/completions?x=1", json={"model": "m", "messages": [{"role": "user", "content": "long"}]}
        )
        assert r.status_code == 400 and r.content == err_body
        rec = last_record(app, r.headers["x-mlxproxy-request-id"])
        assert (rec.outcome, rec.context_prompt_tokens, rec.context_limit_tokens) == ("context_limit", 51587, 32768)
        assert up.requests[0].path == "/v1/chat/completions?x=1"
        r = httpx.post(
            url + "/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "x"}]}
        )
        assert r.status_code == 200 and r.content == ok_body and r.headers["content-length"] == str(len(ok_body))
        rec = last_record(app, r.headers["x-mlxproxy-request-id"])
        assert rec.outcome == "ok" and rec.completion_tokens_reported == 5 and not rec.stream


def test_routing_by_model_pattern() -> None:
    async def a(req: Req, conn: Conn) -> None:
        await conn.head(200, [("content-type", "application/json"), ("content-length", "3")])
        await conn.send(b'"a"')

    async def b(req: Req, conn: Conn) -> None:
        await conn.head(200, [("content-type", "application/json"), ("content-length", "3")])
        await conn.send(b'"b"')

    with FakeUpstream(a) as ua, FakeUpstream(b) as ub:
        raw = {
            "upstreams": [
                {"name": "qwen", "url": ua.url, "models": ["qwen*", "Qwen*"]},
                {"name": "other", "url": ub.url},
            ],
            "default_upstream": "other",
        }
        with proxy(raw=raw) as (url, app):
            assert httpx.post(url + "/v1/chat/completions", json={"model": "qwen3.5"}).content == b'"a"'
            assert httpx.post(url + "/v1/chat/completions", json={"model": "llama"}).content == b'"b"'
            assert httpx.get(url + "/v1/models").content == b'"b"'
            assert wait_for(lambda: len(app.recent.records) == 3)
            assert [r.upstream for r in app.recent.records] == ["qwen", "other", "other"]


def test_own_routes_and_metrics_values() -> None:
    body = read_fixture("wire/01_openai_reference_include_usage.sse")
    with FakeUpstream(sse_response(body)) as up, proxy(up.url) as (url, app):
        for _ in range(3):
            httpx.post(url + "/v1/chat/completions", json={**STREAM_REQ, "model": "gpt-x"})
        assert wait_for(lambda: len(app.recent.records) == 3)
        h = httpx.get(url + "/healthz").json()
        assert h["status"] == "ok" and h["requests"] == 3
        s = httpx.get(url + "/streams").json()
        assert s["in_flight"] == [] and len(s["recent"]) == 3
        assert all("response_text" not in r for r in s["recent"])
        text = httpx.get(url + "/metrics").text
        fams = {f.name: f for f in text_string_to_metric_families(text)}
        for name in [
            "mlxproxy_requests",
            "mlxproxy_requests_in_flight",
            "mlxproxy_request_duration_seconds",
            "mlxproxy_time_to_first_byte_seconds",
            "mlxproxy_time_to_first_token_seconds",
            "mlxproxy_time_to_first_content_seconds",
            "mlxproxy_inter_token_latency_seconds",
            "mlxproxy_time_per_output_token_seconds",
            "mlxproxy_output_tokens_per_second",
            "mlxproxy_prefill_tokens_per_second",
            "mlxproxy_tokens",
            "mlxproxy_usage_reports",
            "mlxproxy_anomalies",
            "mlxproxy_proxy_overhead_seconds",
            "mlxproxy_build_info",
        ]:
            assert name in fams, name
        reg = app.registry
        lab = {"upstream": "default", "model": "gpt-x"}
        assert (
            reg.get_sample_value(
                "mlxproxy_requests_total",
                {**lab, "endpoint": "chat_completions", "stream": "true", "code": "200", "outcome": "ok"},
            )
            == 3
        )
        assert reg.get_sample_value("mlxproxy_tokens_total", {**lab, "type": "completion", "source": "reported"}) == 6
        assert reg.get_sample_value("mlxproxy_tokens_total", {**lab, "type": "completion", "source": "counted"}) == 6
        assert reg.get_sample_value("mlxproxy_tokens_total", {**lab, "type": "prompt", "source": "reported"}) == 27
        assert (
            reg.get_sample_value("mlxproxy_time_to_first_token_seconds_count", {**lab, "endpoint": "chat_completions"})
            == 3
        )
        assert reg.get_sample_value("mlxproxy_inter_token_latency_seconds_count", lab) == 3  # one gap per request
        assert reg.get_sample_value("mlxproxy_usage_reports_total", {**lab, "present": "true"}) == 3
        assert (
            reg.get_sample_value("mlxproxy_output_tokens_per_second_count", {**lab, "kind": "wall", "concurrency": "1"})
            == 3
        )
        assert reg.get_sample_value("mlxproxy_requests_in_flight", lab) == 0
        assert reg.get_sample_value("mlxproxy_proxy_overhead_seconds_count", {"phase": "request"}) == 3
        promtool = shutil.which("promtool")
        if promtool is None:
            pytest.skip("promtool not installed (Debian package 'prometheus'); .ci/run installs it")
        res = subprocess.run([promtool, "check", "metrics"], input=text.encode(), capture_output=True)
        assert res.returncode == 0, res.stdout.decode() + res.stderr.decode()


def test_request_body_limit_and_own_route_method() -> None:
    with proxy("http://127.0.0.1:9", max_request_body_bytes=100) as (url, app):
        r = httpx.post(url + "/v1/chat/completions", content=b"x" * 101)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        r = httpx.post(url + "/metrics")
        assert r.status_code == 405 and "error" in r.json()


def test_client_leaving_after_done_is_not_a_disconnect() -> None:
    """The OpenAI SDK stops reading at [DONE]; an HTTP/1.0 upstream (mlx_lm.server) closes
    only later. The client got the whole stream: the record must say ok."""
    body = read_fixture("wire/01_openai_reference_include_usage.sse")
    closed = threading.Event()

    async def handler(req: Req, conn: Conn) -> None:
        await conn.head(200, [("Content-type", "text/event-stream")], version="1.0")
        await conn.send(body)
        if await conn.wait_peer_close(10):
            closed.set()

    with FakeUpstream(handler) as up, proxy(up.url) as (url, app):
        with httpx.Client(timeout=5) as c, c.stream("POST", url + "/v1/chat/completions", json=STREAM_REQ) as r:
            got = b""
            for chunk in r.iter_raw():
                got += chunk
                if b"[DONE]" in got:
                    break
            rid = r.headers["x-mlxproxy-request-id"]
        assert closed.wait(5)
        rec = last_record(app, rid)
        assert rec.outcome == "ok" and rec.error is None and rec.completion_tokens_reported == 2


def test_the_upstream_gets_the_clients_request_not_the_http_clients() -> None:
    """The path and query arrive as the client wrote them (no re-quoting), the client's own
    headers pass, the HTTP client adds none of its own (user agent, accept, content type,
    compression), and a cookie one upstream response sets is never sent with a later
    request (the proxy serves many clients on one connection pool)."""

    async def handler(req: Req, conn: Conn) -> None:
        await conn.head(
            200,
            [
                ("content-type", "application/json"),
                ("content-length", "2"),
                ("set-cookie", "session=from-upstream; Path=/"),
            ],
        )
        await conn.send(b"{}")

    path = "/v1/chat/completions/a%2Fb/%7Ex;p=1?q=a%20b&q=%2F&empty="
    body = b'{"model":"m","messages":[]}'
    with FakeUpstream(handler) as up, proxy(up.url.replace("127.0.0.1", "localhost")) as (url, app):
        # (a host name, not an address: an HTTP client's cookie jar may skip IP hosts)
        for _ in range(2):
            s = socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])))
            s.sendall(
                b"POST " + path.encode() + b" HTTP/1.1\r\nhost: x\r\nx-client: 1\r\n"
                b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
            )
            got = b""
            while not got.endswith(b"{}"):
                part = s.recv(65536)
                assert part, got
                got += part
            s.close()
        assert [r.path for r in up.requests] == [path, path]
        for r in up.requests:
            names = {k.lower() for k, _ in r.headers}
            assert r.header("x-client") == "1" and r.header("accept-encoding") == "identity" and r.body == body
            assert not names & {"user-agent", "accept", "content-type", "cookie"}, r.headers


def test_a_compressed_body_is_forwarded_as_sent() -> None:
    """An upstream that compresses although the proxy asked for `identity`: the client gets
    the compressed bytes and the `content-encoding` that describes them, never a body
    decompressed under a header that says otherwise."""
    compressed = gzip.compress(b'{"id":"x","object":"chat.completion","choices":[]}')

    async def handler(req: Req, conn: Conn) -> None:
        await conn.head(
            200,
            [
                ("content-type", "application/json"),
                ("content-encoding", "gzip"),
                ("content-length", str(len(compressed))),
            ],
        )
        await conn.send(compressed)

    with FakeUpstream(handler) as up, proxy(up.url) as (url, app):
        with (
            httpx.Client() as c,
            c.stream("POST", url + "/v1/chat/completions", json={"model": "m", "messages": []}) as r,
        ):
            raw = b"".join(r.iter_raw())
        assert r.status_code == 200 and r.headers["content-encoding"] == "gzip" and raw == compressed
        assert up.requests[0].header("accept-encoding") == "identity"
