"""The measuring client of `replay` and `bench` (mlxproxy.load.run.client) against a scripted upstream:
bytes sent and received as they are, one timestamp per event, the headers it never re-sends,
keep-alive and fresh connections, timeouts and failures as one-line outcomes, and a schedule
that starts each request's task only when it is due."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
from collections.abc import Coroutine
from typing import Any, TypeVar

import orjson

from fakeupstream import Conn, FakeUpstream, Req, sse_response
from mlxproxy.load.run.client import MeasuringClient, PreparedRequest
from mlxproxy.load.run.runner import send
from mlxproxy.load.run.shapes import Due, Load, Waves
from support import REPO, read_fixture

SSE = read_fixture("wire/01_openai_reference_include_usage.sse")
CHAT = "/v1/chat/completions"
T = TypeVar("T")


def _body(stream: bool = True) -> bytes:
    return orjson.dumps({"model": "m", "stream": stream, "messages": [{"role": "user", "content": "héllo \u2603"}]})


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def test_body_sent_byte_exact_and_headers_not_resent() -> None:
    """The body goes out as given; hop-by-hop, framing and the client's own headers are
    dropped from what a capture recorded; the key replaces the captured Authorization."""
    got: list[Req] = []

    async def handler(req: Req, conn: Conn) -> None:
        got.append(req)
        await sse_response(SSE)(req, conn)

    body = _body() + b"  "  # bytes as captured, even with trailing whitespace
    captured = (
        ("Host", "elsewhere:1"),
        ("Content-Length", "999"),
        ("Transfer-Encoding", "chunked"),
        ("Connection", "close"),
        ("Keep-Alive", "timeout=5"),
        ("TE", "trailers"),
        ("Upgrade", "h2c"),
        ("Accept-Encoding", "gzip"),
        ("Proxy-Authorization", "Basic eA=="),
        ("x-mlxproxy-replay", "0"),
        ("Authorization", "Bearer captured"),
        ("X-Custom", "kept"),
        ("Content-Type", "application/json"),
    )

    async def main() -> None:
        async with MeasuringClient(up.url, api_key="sk-new") as c:
            rec = await c.send(PreparedRequest("POST", CHAT, body, captured))
            assert rec.outcome == "ok", rec.error

    with FakeUpstream(handler) as up:
        run(main())
    (req,) = got
    assert req.body == body
    names = [k.lower() for k, _ in req.headers]
    assert len(names) == len(set(names)), req.headers  # nothing sent twice
    assert req.header("content-length") == str(len(body)) and req.header("host") == f"127.0.0.1:{up.port}"
    assert req.header("accept-encoding") == "identity" and req.header("x-mlxproxy-replay") == "1"
    assert req.header("authorization") == "Bearer sk-new" and req.header("x-custom") == "kept"
    assert not set(names) & {"transfer-encoding", "keep-alive", "te", "upgrade", "proxy-authorization"}
    assert req.header("connection") in (None, "keep-alive")
    assert "user-agent" not in names  # no library announces itself


def test_received_bytes_metered_with_one_timestamp_per_event() -> None:
    """Every event is stamped when it arrives: a pause the server makes between two events
    shows up between exactly those two, and the body is metered byte for byte."""

    def chunk(delta: dict, finish: str | None = None) -> bytes:
        obj = {
            "id": "c",
            "object": "chat.completion.chunk",
            "model": "m",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        }
        return b"data: " + orjson.dumps(obj) + b"\n\n"

    events = [chunk({"role": "assistant", "content": ""})] + [chunk({"content": f"w{i} "}) for i in range(8)]
    events += [chunk({}, "stop"), b"data: [DONE]\n\n"]
    content = list(range(1, 9))
    pause_before = 5

    async def handler(req: Req, conn: Conn) -> None:
        await conn.head(200, [("content-type", "text/event-stream"), ("transfer-encoding", "chunked")])
        for i, e in enumerate(events):
            if i == pause_before:
                await asyncio.sleep(0.3)  # the server's pause, not a measurement
            await conn.chunk(e)
        await conn.end_chunked()

    async def main():
        async with MeasuringClient(up.url, tag_replay=False, keep_text=True) as c:
            return await c.send(PreparedRequest("POST", CHAT, _body()))

    with FakeUpstream(handler) as up:
        rec = run(main())
    assert rec.outcome == "ok" and rec.bytes_out == sum(map(len, events))
    gaps = rec.event_gaps_s()
    assert len(rec.event_offsets_s) == rec.generated_events == len(content)
    big = max(range(len(gaps)), key=gaps.__getitem__)
    assert big == content.index(pause_before) - 1  # the gap before the paused event
    assert gaps[big] >= 0.25 and sorted(gaps)[-2] < gaps[big] / 2


def test_keep_alive_reuses_one_connection_and_fresh_requests_do_not() -> None:
    peers: list[tuple[str, object]] = []

    async def handler(req: Req, conn: Conn) -> None:
        peers.append((req.path, conn.writer.get_extra_info("peername")))
        await sse_response(SSE)(req, conn)

    async def main() -> None:
        async with MeasuringClient(up.url) as c:
            for _ in range(4):
                assert (await c.send(PreparedRequest("POST", "/v1/chat/completions?seq", _body()))).outcome == "ok"
            timed = await send(Waves(2), Load([PreparedRequest("POST", "/v1/chat/completions?wave", _body())] * 4), c)
            waves = timed.waves
            assert [len(w) for w in waves] == [2, 2] and all(r.outcome == "ok" for r in timed.records)

    with FakeUpstream(handler) as up:
        run(main())
    seq = {p for path, p in peers if path.endswith("?seq")}
    wave = [p for path, p in peers if path.endswith("?wave")]
    assert len(seq) == 1  # one keep-alive connection for the sequential requests
    assert len(wave) == 4 and len(set(wave)) == 4 and not set(wave) & seq  # each released request on its own


def test_no_answer_and_silent_body_are_timeouts_in_one_line() -> None:
    async def handler(req: Req, conn: Conn) -> None:
        if req.path.endswith("headers"):
            await conn.wait_peer_close(10)  # never answers
            return
        await conn.head(200, [("content-type", "text/event-stream"), ("transfer-encoding", "chunked")])
        await conn.chunk(SSE.split(b"\n\n")[0] + b"\n\n")
        await conn.wait_peer_close(10)  # then goes silent

    async def main():
        async with MeasuringClient(up.url, timeout_s=0.3) as c:
            return [await c.send(PreparedRequest("POST", CHAT + "?" + p, _body())) for p in ("headers", "body")]

    with FakeUpstream(handler) as up:
        no_head, silent = run(main())
    assert no_head.outcome == "upstream_timeout" and no_head.status is None
    assert silent.outcome == "upstream_timeout" and silent.status == 200
    for rec in (no_head, silent):
        assert rec.error and "\n" not in rec.error and "timeout" in rec.error


def test_refused_and_broken_are_outcomes_not_exceptions() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"

    async def handler(req: Req, conn: Conn) -> None:
        await conn.head(200, [("content-type", "text/event-stream"), ("transfer-encoding", "chunked")])
        await conn.chunk(SSE.split(b"\n\n")[0] + b"\n\n")
        conn.reset()  # the body breaks mid-stream

    async def main():
        async with MeasuringClient(dead) as c:
            refused = await c.send(PreparedRequest("POST", CHAT, _body()))
        async with MeasuringClient(up.url) as c:
            broken = await c.send(PreparedRequest("POST", CHAT, _body()))
        return refused, broken

    with FakeUpstream(handler) as up:
        refused, broken = run(main())
    assert refused.outcome == "upstream_unreachable" and dead in (refused.error or "")
    assert broken.status == 200 and broken.outcome not in ("ok", "ok_no_done") and "abnormally" in (broken.error or "")
    for rec in (refused, broken):
        assert "\n" not in (rec.error or "")


def test_fetch_is_unmetered_and_untagged() -> None:
    got: list[Req] = []
    models = b'{"object":"list","data":[{"id":"qwen","object":"model"}]}'

    async def handler(req: Req, conn: Conn) -> None:
        got.append(req)
        await conn.head(200, [("content-type", "application/json"), ("content-length", str(len(models)))])
        await conn.send(models)

    async def main():
        async with MeasuringClient(up.url, api_key="k") as c:
            return await c.fetch("GET", "/v1/models"), c.finished

    with FakeUpstream(handler) as up:
        (status, body), finished = run(main())
    assert (status, body) == (200, models) and finished == []
    assert got[0].header("x-mlxproxy-replay") is None and got[0].header("authorization") == "Bearer k"


def test_open_loop_starts_each_task_when_it_is_due() -> None:
    """A long schedule must not start all its requests' tasks up front (thousands of sleeping
    tasks make the first sends late): when the first request goes out, few tasks exist."""
    seen: list[int] = []

    async def main() -> None:
        async with MeasuringClient(up.url) as c:
            real = c.send

            async def spy(req: PreparedRequest, **kw: bool):
                seen.append(len(asyncio.all_tasks()))
                return await real(req, **kw)

            c.send = spy  # type: ignore[method-assign]
            reqs = [PreparedRequest("POST", CHAT, _body(False))] * 200
            timed = await send(Due(), Load([dataclasses.replace(r, offset_s=i * 0.002) for i, r in enumerate(reqs)]), c)
            assert len(timed.records) == len(timed.lag_s) == 200 and all(lag >= 0 for lag in timed.lag_s)

    async def handler(req: Req, conn: Conn) -> None:
        body = b'{"choices":[{"message":{"content":"hi"}}]}'
        await conn.head(200, [("content-type", "application/json"), ("content-length", str(len(body)))])
        await conn.send(body)

    with FakeUpstream(handler) as up:
        run(main())
    assert seen[0] < 20, seen[:5]


def test_unsendable_requests_are_one_line_records() -> None:
    """A hand-edited capture cannot stop a run: a header with a line break (header injection)
    or a target that is not a path becomes a failed record; a non-latin-1 value is sent."""
    got: list[Req] = []

    async def handler(req: Req, conn: Conn) -> None:
        got.append(req)
        await sse_response(SSE)(req, conn)

    async def main():
        async with MeasuringClient(up.url) as c:
            return [
                await c.send(PreparedRequest("POST", path, _body(), headers))
                for path, headers in (
                    (CHAT, (("x-a", "a\r\nx-injected: 1"),)),
                    ("v1/chat/completions", ()),
                    (CHAT, (("x-b", "caf\u2603"),)),
                )
            ]

    with FakeUpstream(handler) as up:
        injected, no_path, utf8 = run(main())
    assert injected.outcome == no_path.outcome == "upstream_unreachable"
    assert "line break" in (injected.error or "") and "origin-form" in (no_path.error or "")
    assert utf8.outcome == "ok" and len(got) == 1 and got[0].header("x-injected") is None


def test_the_client_runs_on_the_chosen_stack() -> None:
    """`replay`/`bench` run their client through `runner.run_async`: asyncio for the plain
    stack, uvloop for the fast one (where installed)."""
    import pytest

    from mlxproxy.edge.runner import run_async

    async def loop_module() -> str:
        return type(asyncio.get_running_loop()).__module__

    assert run_async(loop_module(), "plain").startswith("asyncio")
    pytest.importorskip("uvloop")
    assert run_async(loop_module(), "fast").startswith("uvloop")


def test_an_unknown_stack_is_one_line_before_anything_is_sent() -> None:
    import os
    import subprocess
    import sys

    repo = REPO
    env = {**os.environ, "PYTHONPATH": str(repo), "MLXPROXY_STACK": "turbo"}
    for args in (
        ["replay", "builtin:agent", "--target", "http://127.0.0.1:9"],
        ["bench", "--target", "http://127.0.0.1:9"],
    ):
        res = subprocess.run(
            [sys.executable, "-m", "mlxproxy", *args],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
            stdin=subprocess.DEVNULL,
        )
        assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-800:]
        assert (
            res.stderr.strip().splitlines()[-1]
            == "mlxproxy: MLXPROXY_STACK must be one of plain, fast (or unset), got 'turbo'"
        )


def test_a_run_keeps_its_records_out_of_full_collections_and_unfreezes_at_its_end() -> None:
    import gc

    from mlxproxy.load.run.shapes import FREEZE_EVERY, _RunHeap

    assert gc.get_freeze_count() == 0
    heap = _RunHeap()
    before = gc.get_freeze_count()
    assert before > 0  # what was alive before the run is out of the full passes from its start
    kept = [object() for _ in range(10)]
    for _ in range(FREEZE_EVERY):
        heap.record_done()
    assert gc.get_freeze_count() > before  # and what the run holds after FREEZE_EVERY records
    heap.release()
    assert gc.get_freeze_count() == 0 and kept  # and back in them once the run has ended
