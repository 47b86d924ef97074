"""What tests share besides fixtures: the recorded fixtures' location, the ways a parser is fed,
readiness polling and a port nothing listens on. Import it as `from support import ...`
(`tests/` is on pytest's `pythonpath`); `conftest.py` keeps only pytest fixtures."""

from __future__ import annotations

import contextlib
import os
import random
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from hypothesis import strategies as st

from mlxproxy import capture
from mlxproxy.capture import CapturedRequest
from mlxproxy.config import build_config
from mlxproxy.core.record import Record
from mlxproxy.core.sse import SSEDecoder
from mlxproxy.edge.runner import ServerThread
from mlxproxy.proxy.app import ProxyApp, create_app

#: the tests folder, the repository and the byte-exact fixtures, wherever a test file sits
TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
FIXTURES = TESTS / "fixtures"


def ok_record(**fields: Any) -> Record:
    """A successful streamed Chat Completions request's record: `fields` over the ones every
    record needs (id, start, upstream, model, endpoint, stream, status, outcome)."""
    needed: dict[str, Any] = {
        "id": "r", "started_at": 0.0, "upstream": "u", "model": "m", "endpoint": "chat_completions",
        "stream": True, "status": 200, "outcome": "ok",
    }  # fmt: skip
    return Record(**{**needed, **fields})


def scripted_record(id_: str, started: float, ttft: float, e2e: float, tokens: int = 32) -> Record:
    """A streamed request's record on a scripted clock: sent at `started` (wall 1000 + `started`),
    `ttft` to its first token, `e2e` to its end, `tokens` long."""
    return ok_record(
        id=id_, started_at=1000.0 + started, upstream="t", ttft_s=ttft, e2e_s=e2e, duration_s=e2e,
        tpot_s=(e2e - ttft) / (tokens - 1), completion_tokens_reported=tokens, t_start_mono=started,
    )  # fmt: skip


def read_fixture(rel: str) -> bytes:
    """The bytes of `tests/fixtures/<rel>`."""
    return (FIXTURES / rel).read_bytes()


def splits(data: bytes, seed: int = 0, tries: int = 8) -> list[list[bytes]]:
    """The ways every parser test feeds a body: whole, byte by byte, and at random cuts."""
    ways = [[data], [data[i : i + 1] for i in range(len(data))]]
    rng = random.Random(seed)
    for _ in range(tries):
        k = rng.randint(1, max(1, min(20, len(data) - 1)))
        cuts = sorted(rng.sample(range(1, len(data)), k)) if len(data) > 1 else []
        parts, prev = [], 0
        for c in cuts + [len(data)]:
            parts.append(data[prev:c])
            prev = c
        ways.append(parts)
    return ways


def wait_for(pred: Callable[[], object], timeout_s: float = 5.0) -> bool:
    """Poll `pred` until true or the deadline (readiness polling, never a measurement)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.005)
    return False


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def fast_stack_installed() -> bool:
    """Whether uvloop and httptools import (the `fast` server stack)."""
    try:
        import httptools  # noqa: F401
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True


# -- servers and processes the tests start -------------------------------------------------


@contextlib.contextmanager
def proxy(upstream_url: str | None = None, **cfg) -> Iterator[tuple[str, ProxyApp]]:
    raw = cfg.pop("raw", None)
    config = build_config(raw, upstream_url=upstream_url, log_requests=False, **cfg)
    app = create_app(config)
    with ServerThread(app, server_header=False, date_header=False) as srv:
        yield srv.url, app


def last_record(app: ProxyApp, rid: str | None = None):
    """The newest record, or (better, no race with the record's finalisation) the one with id `rid`."""
    if rid is None:
        assert wait_for(lambda: len(app.recent.records) > 0)
        return app.recent.records[-1]
    assert wait_for(lambda: any(r.id == rid for r in app.recent.records)), f"no record {rid}"
    return next(r for r in app.recent.records if r.id == rid)


@dataclass
class Process:
    proc: subprocess.Popen
    url: str
    lines: list[str]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def start(args: list[str], marker: str) -> Process:
    """Start `python -m mlxproxy ARGS`, wait for the line with `marker` and the URL after
    it, and keep draining its output (so it never blocks on a full pipe)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlxproxy", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if marker in line:
            url = "http://127.0.0.1:" + line.split("http://127.0.0.1:")[1].split("/")[0].split()[0]
            break
    else:
        raise AssertionError(f"{args[0]} did not start: {''.join(lines)}")
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()  # type: ignore[arg-type]
    return Process(proc, url, lines)


#: the environment of a `python -m mlxproxy` child: this checkout first on its path
ENV = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def cli(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """`python -m mlxproxy ARGS` to its end, output captured, no stdin."""
    return subprocess.run(
        [sys.executable, "-m", "mlxproxy", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=ENV,
        stdin=subprocess.DEVNULL,
    )


# -- captures ------------------------------------------------------------------------------


def captured_chat(
    rid: str,
    messages: list[dict],
    *,
    started_at: float = 1.0,
    offset_s: float = 0.0,
    duration_s: float | None = None,
    max_tokens: int = 4,
) -> CapturedRequest:
    """One captured streaming chat request (model `m`), as a capture file holds it."""
    body = {"model": "m", "stream": True, "max_tokens": max_tokens, "messages": messages}
    return capture.captured_chat(
        rid, body, upstream="u", started_at=started_at, offset_s=offset_s, duration_s=duration_s
    )


def captured_chats(n: int, max_tokens: int = 4) -> list[CapturedRequest]:
    """`n` captured streaming chat requests (`hello 0`, `hello 1`, ...)."""
    return [
        captured_chat(f"c{i}", [{"role": "user", "content": f"hello {i}"}], started_at=1.0 + i, max_tokens=max_tokens)
        for i in range(n)
    ]


def write_capture(path: Path, caps: list[CapturedRequest]) -> Path:
    """A capture file whose lines are made by the capture format's own `capture_line`."""
    from mlxproxy.capture import capture_line

    lines = []
    for c in caps:
        d = orjson.loads(capture_line(c.record, None, t0_mono=0.0))
        d.update(path=c.path, request=c.request, offset_s=c.offset_s)
        lines.append(orjson.dumps(d))
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


# -- byte-level fuzzing of the core's parsers (hypothesis) ----------------------------------------

#: one generated event, as the servers send it
EVENT_A = b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'

# pieces that real streams are made of, so random byte strings reach deep into the parsers
WIRE_PIECES = [
    b"data: ",
    b"data:",
    b"\n",
    b"\r",
    b"\r\n",
    b"\n\n",
    b": keepalive 12/",
    b"34",
    b"[DONE]",
    b"{",
    b"}",
    b'"choices":[',
    b"]",
    b'{"index":0,"delta":{"role":"assistant","content":"a","reasoning":"r","reasoning_content":"r2",'
    b'"tool_calls":[{"index":0,"id":"c","function":{"name":"f","arguments":"{"}}]},"finish_reason":"stop"}',
    b'"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5,"prompt_tokens_details":{"cached_tokens":1}}',
    b",",
    b'"error":{"message":"boom"}',
    b'"error":"x"',
    b'"detail":[{"msg":"m"}]',
    b"\xff\xfe",
    b"\xe2\x98",
    b"id: 1\n",
    b"event: e\n",
    b"retry: 5\n",
    b'"text":"t"',
    b'"timings":{"predicted_per_second":3}',
    b"null",
    b"1e999",
    b"-0",
    b"\x00",
    b"\xef\xbb\xbf",
    b"x" * 70,
]
wire_bytes = st.one_of(
    st.binary(max_size=300),
    st.lists(st.one_of(st.sampled_from(WIRE_PIECES), st.binary(max_size=8)), max_size=40).map(b"".join),
)
cut_points = st.lists(st.integers(min_value=0, max_value=2000), max_size=10)
LINE_BOUND = 64


async def cancel_after_some(client: Any, run: Any, at_least: int = 4) -> tuple[int, list[Record], int]:
    """`run` (a coroutine sending through `client`, a `MeasuringClient`) cancelled once the
    client counts `at_least` finished requests: (the count seen before the cancel, the client's
    finished records after it, its requests still in flight). The cancel must reach the caller."""
    import asyncio

    import pytest

    task = asyncio.ensure_future(run)
    while client.finished_count < at_least and not task.done():
        await asyncio.sleep(0.05)  # waiting for the records, not measuring
    seen = client.finished_count
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    return seen, list(client.finished), client.in_flight


class Answered:
    """ASGI wrapper counting the generation responses the server has sent (POSTs)."""

    def __init__(self, app: Any) -> None:
        self.app, self.done = app, 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self.app(scope, receive, send)
        if scope["type"] == "http" and scope["method"] == "POST":
            self.done += 1


def cut(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c for c in cuts if 0 < c < len(data)})
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)])]


def held_by_decoder(dec: SSEDecoder) -> tuple[int, int]:
    """(bytes of partial line held, characters of event data held)."""
    return len(dec._buf), sum(map(len, dec._data))  # characters: at most one per byte received


def decode_all(parts: list[bytes], bound: int = LINE_BOUND) -> list:
    dec = SSEDecoder(bound)
    out = []
    for p in parts:
        out.extend(dec.feed(p))
        line, data = held_by_decoder(dec)
        assert line <= bound and data <= bound
    return out + dec.close()


# -- the simulator's truth -------------------------------------------------------------------


@dataclass(frozen=True)
class EngineRequest:
    """One request of a closed loop as the simulator's engine plans it (simulated seconds)."""

    started: float
    first_token: float
    finished: float


def engine_closed_loop(
    profile, conc: int, n_total: int, prompt_tokens: int, n_tokens: int, seed: int = 0
) -> list[EngineRequest]:
    """What a closed loop of `conc` streams sending `n_total` requests gets from the
    simulator's own engine in scripted time (the network's milliseconds are left out), in
    the order the requests finished; `seed`: the engine's (its jitter)."""
    from mlxproxy.sim.engine import Engine, Finish, Token

    eng = Engine(profile, seed)
    started: dict[str, float] = {}
    first: dict[str, float] = {}
    out: list[EngineRequest] = []

    def issue(t: float) -> None:
        rid = f"r{len(started)}"
        eng.admit(rid, t, prompt_tokens, n_tokens)
        started[rid] = t

    for _ in range(min(conc, n_total)):
        issue(0.0)
    while len(out) < n_total:
        t = eng.next_event_time()
        assert t is not None
        for ev in eng.advance(t):
            if isinstance(ev, Token) and ev.index == 0:
                first[ev.req_id] = ev.t_s
            elif isinstance(ev, Finish):
                out.append(EngineRequest(started[ev.req_id], first[ev.req_id], ev.t_s))
                if len(started) < n_total:
                    issue(ev.t_s)
    return out


CLAUDE_UA = "claude-cli/2.1.332 (external, sdk-cli)"  # Claude Code's User-Agent (tests/fixtures/clients/)


def volatile_session_capture(
    path: Path, model: str, turns: int = 4, words: int = 60, max_tokens: int = 8, quota: bool = False
) -> None:
    """Write a capture of one Claude-Code-like session (its User-Agent): a system prompt of
    ~`words` * 3 tokens with a per-turn hex value on line 1 (the billing line's shape), and a
    history that grows by an answer and a question each turn (`replay --fix`'s tests); `quota`:
    Claude Code's one-token quota check after the first turn, a side request."""
    from mlxproxy.capture import capture_line

    lines = []
    msgs: list[dict[str, object]] = [
        {"role": "user", "content": "Fix the parser: " + " ".join(f"w{j} fox" for j in range(words))}
    ]
    for t in range(turns):
        system = f"x-billing-header: cc_version=2.1.37; cch={t * 7919 % 65536:05x};\nYou are a careful coding agent.\n"
        system += " ".join(f"rule{j} keep" for j in range(words * 2))
        body = {
            "model": model,
            "stream": True,
            "max_tokens": max_tokens,
            "temperature": 0,
            "messages": [{"role": "system", "content": system}, *msgs],
        }
        rec = Record(
            id=f"cap{t}", started_at=1.0 + 5 * t, upstream="u", model=model, endpoint="chat_completions", stream=True,
            status=200, outcome="ok", method="POST", path="/v1/chat/completions", duration_s=1.0, t_start_mono=5.0 * t,
        )  # fmt: skip
        d = orjson.loads(capture_line(rec, None, t0_mono=0.0))
        d["request"] = body
        d["request_headers"] = [["user-agent", CLAUDE_UA]]
        lines.append(orjson.dumps(d))
        if quota and t == 0:
            q = {**d, "id": "quota", "offset_s": 1.5}
            q["request"] = {"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": "quota"}]}
            lines.append(orjson.dumps(q))
        msgs += [
            {"role": "assistant", "content": f"step {t} done " + " ".join(f"o{j}" for j in range(words // 2))},
            {"role": "user", "content": f"now step {t + 1}: " + " ".join(f"u{j} q" for j in range(words // 2))},
        ]
    path.write_bytes(b"\n".join(lines) + b"\n")
