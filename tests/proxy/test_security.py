"""Security defaults: where the proxy listens, the optional proxy key, and secrets that never
appear in anything the proxy writes (captures, logs, /metrics, /streams, /healthz, its own
error bodies). SECURITY.md names these tests next to the guarantees they back.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest
from click.testing import CliRunner

from fakeupstream import Conn, FakeUpstream, Req
from mlxproxy.cli import main
from mlxproxy.config import build_config, is_loopback_host
from mlxproxy.edge.runner import ServerThread
from mlxproxy.errors import ConfigError
from mlxproxy.proxy import auth as auth_module
from mlxproxy.proxy.app import ProxyApp, create_app
from mlxproxy.proxy.cli import exposure_warning
from support import read_fixture
from support import wait_for as _wait_for

OK_BODY = read_fixture("wire/01_openai_reference_include_usage.sse")
STREAM_REQ = {
    "model": "m",
    "stream": True,
    "messages": [{"role": "user", "content": "hi"}],
    "stream_options": {"include_usage": True},
}
PROXY_KEY = "pk-proxy-7f3a9c1e5b2d4a6f"
UPSTREAM_KEY = "sk-upstream-0b1c2d3e4f5a6b7c"
URL_PASSWORD = "url-pass-8e9f0a1b"
CLIENT_TOKEN = "team-token-5d6e7f8a9b"
COOKIE = "session=cookie-secret-1a2b3c4d"
ALL_SECRETS = (PROXY_KEY, UPSTREAM_KEY, URL_PASSWORD, CLIENT_TOKEN, "cookie-secret-1a2b3c4d")


async def ok_stream(req: Req, conn: Conn) -> None:
    await conn.head(200, [("content-type", "text/event-stream"), ("transfer-encoding", "chunked")])
    for e in [e + b"\n\n" for e in OK_BODY.split(b"\n\n") if e]:
        await conn.chunk(e)
    await conn.end_chunked()


@contextlib.contextmanager
def keyed_proxy(
    monkeypatch: pytest.MonkeyPatch, handler=ok_stream, **cfg
) -> Iterator[tuple[str, ProxyApp, FakeUpstream]]:
    monkeypatch.setenv("MLXPROXY_TEST_KEY", PROXY_KEY)
    with FakeUpstream(handler) as up:
        config = build_config(upstream_url=up.url, log_requests=False, proxy_api_key_env="MLXPROXY_TEST_KEY", **cfg)
        app = create_app(config)
        with ServerThread(app, server_header=False, date_header=False) as srv:
            yield srv.url, app, up


def wait_for(pred, timeout_s: float = 10.0) -> bool:
    return _wait_for(pred, timeout_s)


# -- where the proxy listens --------------------------------------------------------------------


def test_binds_to_loopback_unless_told_otherwise() -> None:
    assert build_config({}).host == "127.0.0.1"
    for host in ["127.0.0.1", "localhost", "::1", "[::1]", "127.0.0.2"]:
        assert is_loopback_host(host), host
        assert exposure_warning(build_config({"host": host})) is None
    for host in ["0.0.0.0", "::", "192.168.1.20", "my-mac.local"]:
        assert not is_loopback_host(host), host
        warning = exposure_warning(build_config({"host": host}))
        assert warning is not None and "without a proxy key" in warning and "proxy_api_key_env" in warning
        assert exposure_warning(build_config({"host": host, "proxy_api_key_env": "K"})) is None


def test_serve_warns_before_listening_beyond_loopback_without_a_key(monkeypatch: pytest.MonkeyPatch) -> None:
    import mlxproxy.edge.runner

    def refuse(host: str, port: int):  # the test never listens on a public address
        raise OSError(99, "not in this test")

    monkeypatch.setattr(mlxproxy.edge.runner, "bind_socket", refuse)
    res = CliRunner().invoke(main, ["serve", "--host", "0.0.0.0", "--upstream", "http://127.0.0.1:9"])
    assert res.exit_code == 1 and "warning: listening on 0.0.0.0 without a proxy key" in res.output
    res = CliRunner().invoke(main, ["serve", "--host", "127.0.0.1", "--upstream", "http://127.0.0.1:9"])
    assert res.exit_code == 1 and "warning" not in res.output


# -- the proxy key ------------------------------------------------------------------------------


def test_proxy_key_is_required_and_stripped_before_forwarding(monkeypatch: pytest.MonkeyPatch) -> None:
    with keyed_proxy(monkeypatch) as (url, app, up):
        chat = url + "/v1/chat/completions"
        for headers in [
            {},
            {"authorization": "Bearer wrong-key"},
            {"x-api-key": "wrong-key"},
            {"authorization": f"Basic {PROXY_KEY}"},
            {"authorization": PROXY_KEY},
            {"authorization": f"Bearer {PROXY_KEY}x"},
            {"authorization": f"Bearer {PROXY_KEY[:-1]}"},
            {"x-api-key": ""},
            {"authorization": "Bearer"},
        ]:
            r = httpx.post(chat, json=STREAM_REQ, headers=headers)
            assert r.status_code == 401, headers
            assert r.headers["www-authenticate"].startswith("Bearer")
            err = r.json()["error"]
            assert (
                err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error" and "key" in err["message"]
            )
            assert "wrong-key" not in r.text and PROXY_KEY not in r.text
        assert up.requests == [] and app.requests_seen == 0  # nothing reached the upstream
        for headers in [
            {"authorization": f"Bearer {PROXY_KEY}"},
            {"authorization": f"bearer  {PROXY_KEY}"},
            {"x-api-key": PROXY_KEY},
            {"authorization": "Bearer wrong", "x-api-key": PROXY_KEY},
        ]:
            r = httpx.post(chat, json=STREAM_REQ, headers=headers)
            assert r.status_code == 200 and r.content == OK_BODY, headers
            sent = up.requests[-1]
            assert sent.header("authorization") is None and sent.header("x-api-key") is None  # the key stays here
        assert httpx.get(url + "/v1/models").status_code == 401  # every forwarded path and method


def test_healthz_stays_open_metrics_and_streams_need_the_key_unless_configured(monkeypatch: pytest.MonkeyPatch) -> None:
    with keyed_proxy(monkeypatch) as (url, app, up):
        assert httpx.get(url + "/healthz").status_code == 200
        for route in ["/metrics", "/streams"]:
            assert httpx.get(url + route).status_code == 401
            assert httpx.get(url + route, headers={"authorization": f"Bearer {PROXY_KEY}"}).status_code == 200
        assert httpx.post(url + "/healthz").status_code == 405
        assert httpx.post(url + "/metrics").status_code == 401  # the key is checked before anything else
    with keyed_proxy(monkeypatch, metrics_need_key=False) as (url, app, up):
        for route in ["/metrics", "/streams", "/healthz"]:
            assert httpx.get(url + route).status_code == 200
        assert httpx.post(url + "/v1/chat/completions", json=STREAM_REQ).status_code == 401


def test_proxy_key_is_compared_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    compared: list[tuple[bytes, bytes]] = []
    real = auth_module.hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(auth_module.hmac, "compare_digest", spy)
    with keyed_proxy(monkeypatch) as (url, app, up):
        assert httpx.get(url + "/v1/models", headers={"x-api-key": "short"}).status_code == 401
        assert (
            httpx.post(
                url + "/v1/chat/completions", json=STREAM_REQ, headers={"authorization": f"Bearer {PROXY_KEY}"}
            ).status_code
            == 200
        )
    digest = hashlib.sha256(PROXY_KEY.encode()).digest()
    # digests of equal length whatever the length of what the client sent: no length leak either
    assert compared == [(hashlib.sha256(b"short").digest(), digest), (digest, digest)]


def test_proxy_key_variable_unset_refuses_to_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLXPROXY_UNSET_KEY", raising=False)
    config = build_config(proxy_api_key_env="MLXPROXY_UNSET_KEY")
    with pytest.raises(ConfigError, match="MLXPROXY_UNSET_KEY, which is not set"):
        create_app(config)
    monkeypatch.setenv("MLXPROXY_UNSET_KEY", "   ")
    with pytest.raises(ConfigError):
        create_app(config)
    res = CliRunner().invoke(main, ["serve", "--config", _write(monkeypatch, "proxy_api_key_env: MLXPROXY_NOPE_KEY\n")])
    assert res.exit_code == 2 and "MLXPROXY_NOPE_KEY, which is not set" in res.output and "Traceback" not in res.output


def _write(monkeypatch: pytest.MonkeyPatch, text: str) -> str:
    import tempfile

    monkeypatch.delenv("MLXPROXY_NOPE_KEY", raising=False)
    f = tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False)
    f.write(text)
    f.close()
    return f.name


# -- secrets never written ----------------------------------------------------------------------


def test_secrets_never_reach_captures_logs_metrics_streams_or_healthz(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Client credentials (proxy key, cookie, a configured team header), the upstream's key
    and the password in its URL: none of them in the capture, any log line (every logger at
    DEBUG, the HTTP clients' included), /metrics, /streams, /healthz, or an error record, even when
    the upstream echoes what it received in its error body."""
    monkeypatch.setenv("MLXPROXY_TEST_UPSTREAM_KEY", UPSTREAM_KEY)
    caplog.set_level(logging.DEBUG)
    got_auth: list[str | None] = []

    async def echoing(req: Req, conn: Conn) -> None:
        got_auth.append(req.header("authorization"))
        if b"echo" in req.body:  # a careless server that puts what it got in its error message
            body = orjson.dumps(
                {
                    "error": {
                        "message": f"bad auth {req.header('authorization')} cookie {req.header('cookie')} "
                        f"team {req.header('x-team-token')}"
                    }
                }
            )
            await conn.head(401, [("content-type", "application/json"), ("content-length", str(len(body)))])
            await conn.send(body)
        else:
            await ok_stream(req, conn)

    cap = tmp_path / "cap.jsonl"
    client_headers = {"authorization": f"Bearer {PROXY_KEY}", "cookie": COOKIE, "x-team-token": CLIENT_TOKEN}
    monkeypatch.setenv("MLXPROXY_TEST_KEY", PROXY_KEY)
    with FakeUpstream(echoing) as up:
        host_port = up.url.split("//")[1]
        dead = "127.0.0.1:9"
        raw = {
            "upstreams": [
                {"name": "u", "url": up.url, "api_key_env": "MLXPROXY_TEST_UPSTREAM_KEY"},
                {"name": "basic", "url": f"http://user:{URL_PASSWORD}@{host_port}", "models": ["basic"]},
                {"name": "dead", "url": f"http://user:{URL_PASSWORD}@{dead}", "models": ["dead"]},
            ],
            "capture": str(cap),
            "capture_responses": True,
            "redact_headers": ["X-Team-Token"],
            "proxy_api_key_env": "MLXPROXY_TEST_KEY",
            "log_requests": True,
        }
        app = create_app(build_config(raw))
        with ServerThread(app) as srv, httpx.Client(base_url=srv.url, headers=client_headers, timeout=30) as c:
            assert c.post("/v1/chat/completions", json=STREAM_REQ).content == OK_BODY
            r = c.post("/v1/chat/completions", json={**STREAM_REQ, "messages": [{"role": "user", "content": "echo"}]})
            assert r.status_code == 401 and UPSTREAM_KEY in r.text  # the upstream's own body passes unchanged
            r = c.post("/v1/chat/completions", json={**STREAM_REQ, "model": "dead"})
            assert r.status_code == 502 and not any(s in r.text for s in ALL_SECRETS)  # the proxy's own error body
            assert c.post("/v1/chat/completions", json={**STREAM_REQ, "model": "basic"}).content == OK_BODY
            assert wait_for(lambda: app.capture is not None and app.capture.written == 4)
            shown = c.get("/metrics").text + c.get("/streams").text + c.get("/healthz").text
    # each upstream gets its own credentials, never the proxy key: the key, or the URL's user:password as Basic auth
    assert got_auth == [f"Bearer {UPSTREAM_KEY}"] * 2 + ["Basic dXNlcjp1cmwtcGFzcy04ZTlmMGExYg=="]
    written = cap.read_text() + shown + "\n".join(r.getMessage() + str(r.exc_info or "") for r in caplog.records)
    assert "[REDACTED]" in cap.read_text()
    for secret in ALL_SECRETS:
        assert secret not in written, secret
    errors = [orjson.loads(line)["error"] for line in cap.read_text().splitlines()]
    assert (
        errors[0] is None
        and "bad auth Bearer [REDACTED] cookie [REDACTED] team [REDACTED]" in errors[1]
        and "unreachable" in errors[2]
        and errors[3] is None
    )


def test_metrics_and_streams_expose_no_prompt_or_completion_text(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    prompt, answer = "PROMPT-MARKER-31337", "ANSWER-MARKER-42424"
    gate = threading.Event()
    first = b'data: {"choices":[{"index":0,"delta":{"content":"' + answer.encode() + b'"}}]}\n\n'

    async def gated(req: Req, conn: Conn) -> None:
        await conn.head(200, [("content-type", "text/event-stream"), ("transfer-encoding", "chunked")])
        await conn.chunk(first)
        await conn.wait_gate(gate, 30)
        await conn.chunk(b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n')
        await conn.end_chunked()

    with keyed_proxy(
        monkeypatch, gated, capture=str(tmp_path / "c.jsonl"), capture_responses=True, metrics_need_key=False
    ) as (url, app, up):
        body = {**STREAM_REQ, "messages": [{"role": "user", "content": prompt}]}
        with (
            httpx.Client(timeout=30) as c,
            c.stream("POST", url + "/v1/chat/completions", json=body, headers={"x-api-key": PROXY_KEY}) as r,
        ):
            it = r.iter_raw()
            assert answer.encode() in next(it)
            live = c.get(url + "/streams").json()["in_flight"]
            assert len(live) == 1 and live[0]["tokens_so_far"] == 1
            shown = c.get(url + "/streams").text + c.get(url + "/metrics").text + c.get(url + "/healthz").text
            gate.set()
            b"".join(it)
        assert wait_for(lambda: app.capture is not None and app.capture.written == 1)
        shown += httpx.get(url + "/streams").text + httpx.get(url + "/metrics").text
        assert answer in (tmp_path / "c.jsonl").read_text()  # kept where it was asked for: the capture
    assert prompt not in shown and answer not in shown


def test_proxy_error_bodies_never_echo_secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    with keyed_proxy(monkeypatch, max_request_body_bytes=64) as (url, app, up):
        bodies = [
            httpx.post(url + "/v1/chat/completions", headers={"authorization": f"Bearer {UPSTREAM_KEY}"}).text,
            httpx.post(
                url + "/v1/chat/completions",
                content=b"x" * 100,
                headers={"authorization": f"Bearer {PROXY_KEY}", "cookie": COOKIE},
            ).text,
            httpx.post(url + "/metrics", headers={"x-api-key": PROXY_KEY}).text,
        ]
    assert "request_too_large" in bodies[1] and "method_not_allowed" in bodies[2]
    for body in bodies:
        assert not any(s in body for s in ALL_SECRETS), body


def test_capture_file_is_created_readable_by_its_owner_only(tmp_path: Path) -> None:
    from mlxproxy.proxy.capture_writer import CaptureWriter

    w = CaptureWriter(tmp_path / "new" / "cap.jsonl")
    w.close()
    assert (tmp_path / "new" / "cap.jsonl").stat().st_mode & 0o077 == 0  # prompts are not for other local users
