"""The capture file: redaction, privacy, durability, reading back, versions."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import orjson
import pytest

from fakeupstream import Conn, FakeUpstream, Req, sse_response
from mlxproxy.capture import MIGRATIONS, Exchange, read_capture
from mlxproxy.core.record import Record
from mlxproxy.errors import CaptureFormatError
from mlxproxy.proxy.capture_writer import CaptureWriter
from support import proxy, read_fixture, wait_for

SECRET = "sk-live-0123456789abcdef"


def lines(path: Path) -> list[dict]:
    return [orjson.loads(x) for x in path.read_bytes().splitlines() if x.strip()]


def test_capture_through_proxy_redacts_both_directions(tmp_path: Path) -> None:
    body = read_fixture("wire/01_openai_reference_include_usage.sse")
    base = sse_response(body)

    async def handler(req: Req, conn: Conn) -> None:
        if req.method == "GET":
            await conn.head(
                200, [("content-type", "application/json"), ("content-length", "2"), ("set-cookie", f"s={SECRET}")]
            )
            await conn.send(b"{}")
        else:
            await base(req, conn)

    cap = tmp_path / "cap.jsonl"
    with FakeUpstream(handler) as up, proxy(up.url, capture=str(cap), redact_headers=["x-team-token"]) as (url, app):
        req = {"model": "gpt-x", "stream": True, "messages": [{"role": "user", "content": "hello there"}]}
        r = httpx.post(
            url + "/v1/chat/completions",
            json=req,
            headers={"authorization": f"Bearer {SECRET}", "x-team-token": SECRET, "cookie": f"a={SECRET}"},
        )
        assert r.status_code == 200
        httpx.get(url + "/v1/models", headers={"x-api-key": SECRET})
        assert wait_for(lambda: app.capture is not None and app.capture.written == 2)
        assert up.requests[0].header("authorization") == f"Bearer {SECRET}"  # forwarded, only the file is redacted
    raw = cap.read_text()
    assert SECRET not in raw
    first, second = lines(cap)
    assert first["v"] == 1 and first["method"] == "POST" and first["path"] == "/v1/chat/completions"
    assert first["request"] == req  # the client's body, before the proxy's include_usage injection
    heads = {k.lower(): v for k, v in first["request_headers"]}
    assert heads["authorization"] == heads["x-team-token"] == heads["cookie"] == "[REDACTED]"
    assert first["outcome"] == "ok" and len(first["event_offsets_ms"]) == 2 and first["offset_s"] >= 0
    assert "response_text" not in first
    assert {k.lower(): v for k, v in second["response_headers"]}["set-cookie"] == "[REDACTED]"
    caps = read_capture(cap)
    assert [c.record.outcome for c in caps] == ["ok", "ok"] and caps[0].body() == orjson.dumps(req)
    assert caps[0].record.event_offsets_s[0] == pytest.approx(first["event_offsets_ms"][0] / 1000)


def test_responses_and_privacy_mode(tmp_path: Path) -> None:
    body = read_fixture("wire/01_openai_reference_include_usage.sse")
    cap = tmp_path / "cap.jsonl"
    with (
        FakeUpstream(sse_response(body)) as up,
        proxy(up.url, capture=str(cap), capture_responses=True, capture_prompts=False) as (url, app),
    ):
        httpx.post(
            url + "/v1/chat/completions",
            json={"model": "m", "stream": True, "messages": [{"role": "user", "content": "secret plan"}]},
        )
        assert wait_for(lambda: app.capture is not None and app.capture.written == 1)
    (line,) = lines(cap)
    assert line["response_text"] == "Hello world"
    assert line["request"]["messages"] == [{"role": "user", "content_chars": 11}]
    assert "secret plan" not in cap.read_text()


def rec(i: int) -> Record:
    return Record(
        id=f"r{i}",
        started_at=0.0,
        upstream="u",
        model="m",
        endpoint="chat_completions",
        stream=True,
        status=200,
        outcome="ok",
        t_start_mono=float(i),
    )


def test_full_queue_drops_and_counts(tmp_path: Path) -> None:
    dropped = []
    w = CaptureWriter(tmp_path / "c.jsonl", queue_size=1, on_drop=lambda: dropped.append(1))
    block = threading.Event()
    w._file.write = lambda data, _orig=w._file.write: (block.wait(5), _orig(data))[1]  # a stuck disk
    for i in range(50):
        w.on_record(rec(i), None)
    assert w.dropped >= 48 and len(dropped) == w.dropped
    block.set()
    w.close()
    assert w.written + w.dropped == 50


def test_write_errors_are_counted_not_raised(tmp_path: Path, caplog) -> None:
    errors = []
    w = CaptureWriter(tmp_path / "c.jsonl", on_error=lambda: errors.append(1))
    w._file.close()  # every write now fails, as on a full or read-only disk
    for i in range(3):
        w.on_record(rec(i), Exchange(b"{}", []))
    deadline = time.monotonic() + 5
    while w.write_errors < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert w.write_errors == 3 and len(errors) == 3
    assert sum("capture to" in r.getMessage() for r in caplog.records) == 1  # reported once


def test_reader_torn_line_versions_and_migrations(tmp_path: Path) -> None:
    good = orjson.dumps({"v": 1, **rec(1).to_dict(timeline=True), "request": {"model": "m"}})
    p = tmp_path / "c.jsonl"
    p.write_bytes(good + b"\n" + good + b"\n" + good[:40])
    warnings: list[str] = []
    assert len(read_capture(p, warn=warnings.append)) == 2 and "torn last line" in warnings[0]
    p.write_bytes(good + b"\n" + good[:40] + b"\n" + good + b"\n")
    with pytest.raises(CaptureFormatError, match=":2: not a JSON line"):
        read_capture(p)
    p.write_bytes(orjson.dumps({"v": 99, "id": "x"}) + b"\n")
    with pytest.raises(CaptureFormatError, match="version 99 is newer"):
        read_capture(p)
    p.write_bytes(b'{"id": "x"}\n')
    with pytest.raises(CaptureFormatError, match="no capture format version"):
        read_capture(p)
    # an older version goes through the migration chain
    old = {"v": 0, **rec(1).to_dict(timeline=True), "request": {"model": "m"}}
    old["event_times_ms"] = old.pop("event_offsets_ms")
    p.write_bytes(orjson.dumps(old) + b"\n")
    with pytest.raises(CaptureFormatError, match="version 0 is not supported"):
        read_capture(p)
    MIGRATIONS[0] = lambda d: {
        **{k: v for k, v in d.items() if k != "event_times_ms"},
        "event_offsets_ms": d["event_times_ms"],
    }
    try:
        (c,) = read_capture(p)
        assert c.record.id == "r1" and c.raw["v"] == 1
    finally:
        del MIGRATIONS[0]
    with pytest.raises(CaptureFormatError, match="cannot read capture file"):
        read_capture(tmp_path / "missing.jsonl")


def test_kill_9_leaves_a_readable_capture(tmp_path: Path) -> None:
    gate = threading.Event()
    done_body = read_fixture("wire/01_openai_reference_include_usage.sse")

    async def handler(req: Req, conn: Conn) -> None:
        if b'"hang"' in req.body:
            await conn.head(200, [("content-type", "text/event-stream"), ("transfer-encoding", "chunked")])
            await conn.chunk(b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n')
            await conn.wait_gate(gate, 20)
            return
        await sse_response(done_body)(req, conn)

    cap = tmp_path / "cap.jsonl"
    with FakeUpstream(handler) as up:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mlxproxy",
                "serve",
                "--upstream",
                up.url,
                "--port",
                "0",
                "--capture",
                str(cap),
                "--log-level",
                "warning",
            ],
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            line = proc.stderr.readline()
            port = int(line.split("http://127.0.0.1:")[1].split("/")[0])
            url = f"http://127.0.0.1:{port}"
            for _ in range(30):
                assert (
                    httpx.post(
                        url + "/v1/chat/completions", json={"model": "m", "stream": True, "messages": []}
                    ).status_code
                    == 200
                )
            assert wait_for(lambda: cap.exists() and cap.read_bytes().count(b"\n") == 30, 10)
            clients = []
            for _ in range(20):
                c = httpx.Client(timeout=20)
                s = c.stream(
                    "POST", url + "/v1/chat/completions", json={"model": "hang", "stream": True, "messages": []}
                )
                it = s.__enter__().iter_raw()
                next(it)
                clients.append((c, s, it))  # keep the iterator: dropping it closes the connection
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
        finally:
            gate.set()
            if proc.poll() is None:
                proc.kill()
    caps = read_capture(cap)
    assert len(caps) == 30 and all(c.record.outcome == "ok" for c in caps)
