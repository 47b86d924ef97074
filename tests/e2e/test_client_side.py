"""What a real client sees, over real sockets, on both server stacks.

The proxy's own figures cannot see what it costs outside its own code: a write held in the
kernel (Nagle's algorithm waiting for the client's delayed ACK), or a request left unread
while the event loop is busy. These tests measure from the client's side of the socket,
as differences to the same upstream reached directly, and check the `concurrency` the
proxy records for keep-alive clients.
"""

from __future__ import annotations

import asyncio
import json
import socket
import statistics
import subprocess
import sys
import threading
import time

import httpx
import pytest

from fakeupstream import Conn, FakeUpstream, Req
from support import REPO, proxy, read_fixture, wait_for

ROUNDS = 20
REQ = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
# real mlx_lm.server events: the role+first token event, then 8 more
EVENTS = [
    e + b"\n\n" for e in read_fixture("real/mlx_lm_server_stream_usage.sse").split(b"\n\n") if e.startswith(b"data: {")
][:9] + [b"data: [DONE]\n\n"]


def paced_stream(gap_s: float = 0.0):
    """An upstream that writes each event as its own chunk, `gap_s` apart (the upstream's
    pace, like a server decoding; the tests measure on the client, never here)."""

    async def handler(req: Req, conn: Conn) -> None:
        await conn.head(200, [("content-type", "text/event-stream"), ("transfer-encoding", "chunked")])
        for e in EVENTS:
            await conn.chunk(e)
            if gap_s:
                await asyncio.sleep(gap_s)
        await conn.end_chunked()

    return handler


class RawClient:
    """One keep-alive connection; times each response from the request's write to its
    first `data:` event and to the end of the chunked body."""

    def __init__(self, url: str) -> None:
        host, port = url.rsplit("/", 1)[-1].split(":")
        self.sock = socket.create_connection((host, int(port)))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def stream(self) -> tuple[float, float]:
        body = json.dumps(REQ).encode()
        head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        buf = b""
        first = None
        t0 = time.perf_counter()
        self.sock.sendall(head.encode() + body)
        while not buf.endswith(b"\r\n0\r\n\r\n"):
            data = self.sock.recv(65536)
            assert data, "connection closed mid-response"
            buf += data
            if first is None and b"\r\ndata: {" in buf:
                first = time.perf_counter() - t0
        assert first is not None
        return first, time.perf_counter() - t0

    def close(self) -> None:
        self.sock.close()


def interleaved(direct, proxied, rounds: int = ROUNDS) -> tuple[list[float], list[float]]:
    d, p = [], []
    for _ in range(rounds):
        d.append(direct())
        p.append(proxied())
    return d, p


def added_ms(direct: list[float], proxied: list[float]) -> float:
    return (statistics.median(proxied) - statistics.median(direct)) * 1000


def assert_added_below(measure, bound_ms: float, what: str, attempts: int = 3) -> None:
    """`measure()` -> (direct, proxied) samples. Other processes on a shared machine can only
    make the proxied median worse relative to direct by chance, never better every time: so
    the best of a few attempts is what the proxy allows. A systematic delay (the delayed-ACK
    bug added 40 ms to every first event) fails every attempt."""
    seen = []
    for _ in range(attempts):
        d, p = measure()
        seen.append(round(added_ms(d, p), 2))
        if seen[-1] < bound_ms:
            return
    raise AssertionError(f"{what} through the proxy: added {seen} ms (median of {ROUNDS}, {attempts} attempts)")


def test_first_event_reaches_a_raw_socket_client_as_fast_as_direct(stack: str) -> None:
    with FakeUpstream(paced_stream()) as up, proxy(up.url) as (url, app):
        dc, pc = RawClient(up.url), RawClient(url)
        try:
            # the bug this guards against added ~40 ms (a delayed ACK) to every first event;
            # 10 ms leaves room for a loaded 2-core machine (typical: +1 to +2 ms)
            assert_added_below(lambda: interleaved(lambda: dc.stream()[0], lambda: pc.stream()[0]), 10.0, "first event")
        finally:
            dc.close(), pc.close()


def test_every_event_reaches_a_raw_socket_client_as_fast_as_direct(stack: str) -> None:
    """Events 1 ms apart: with Nagle on, each write waits for the ACK of the previous one."""
    with FakeUpstream(paced_stream(0.001)) as up, proxy(up.url) as (url, app):
        dc, pc = RawClient(up.url), RawClient(url)
        try:
            assert_added_below(
                lambda: interleaved(lambda: dc.stream()[1], lambda: pc.stream()[1]), 10.0, "whole stream"
            )
        finally:
            dc.close(), pc.close()


SDK_CLIENT = r"""
import json, sys, time
import openai
rounds = int(sys.argv[3])
clients = [openai.OpenAI(base_url=u + "/v1", api_key="k", max_retries=0) for u in sys.argv[1:3]]
def first_chunk(client):
    t0 = time.perf_counter()
    stream = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], stream=True)
    t = None
    for chunk in stream:
        if t is None and chunk.choices and chunk.choices[0].delta.content:
            t = time.perf_counter() - t0
    return t
first_chunk(clients[0]), first_chunk(clients[1])  # warm-up: imports, connections
out = [[], []]
for _ in range(rounds):
    for i, c in enumerate(clients):
        out[i].append(first_chunk(c))
print(json.dumps(out))
"""


def test_first_chunk_reaches_the_openai_sdk_as_fast_as_direct(stack: str) -> None:
    """The SDK runs in its own process: in this one it would compete with the proxy's and
    the upstream's threads for the GIL and measure that instead."""
    pytest.importorskip("openai")
    with FakeUpstream(paced_stream()) as up, proxy(up.url) as (url, app):

        def measure() -> tuple[list[float], list[float]]:
            out = subprocess.run(
                [sys.executable, "-c", SDK_CLIENT, up.url, url, str(ROUNDS)],
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert out.returncode == 0, out.stderr[-2000:]
            d, p = json.loads(out.stdout)
            return d, p

        assert_added_below(measure, 10.0, "first chunk")


@pytest.mark.parametrize("client", ["httpx", "raw"])
def test_a_sequential_keep_alive_client_is_recorded_at_concurrency_1(stack: str, client: str) -> None:
    with FakeUpstream(paced_stream()) as up, proxy(up.url) as (url, app):
        if client == "raw":
            c = RawClient(url)
            for _ in range(ROUNDS):
                c.stream()
            c.close()
        else:
            with httpx.Client() as hc:
                for _ in range(ROUNDS):
                    r = hc.post(url + "/v1/chat/completions", json=REQ)
                    assert r.status_code == 200
        assert wait_for(lambda: len(app.recent.records) == ROUNDS)
        assert len(up.requests) == ROUNDS
        conc = [r.concurrency for r in app.recent.records]
    assert conc == [1] * ROUNDS, f"recorded concurrency of {ROUNDS} sequential requests: {conc}"


def test_two_overlapping_streams_are_recorded_at_concurrency_2(stack: str) -> None:
    both_in = threading.Barrier(2, timeout=10)

    async def handler(req: Req, conn: Conn) -> None:
        await conn.head(200, [("content-type", "text/event-stream"), ("transfer-encoding", "chunked")])
        await conn.loop.run_in_executor(None, both_in.wait)  # each answers once both have arrived
        for e in EVENTS:
            await conn.chunk(e)
        await conn.end_chunked()

    with FakeUpstream(handler) as up, proxy(up.url) as (url, app):

        def one() -> None:
            with httpx.Client(timeout=10) as hc:
                assert hc.post(url + "/v1/chat/completions", json=REQ).status_code == 200

        threads = [threading.Thread(target=one) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(15)
        assert wait_for(lambda: len(app.recent.records) == 2)
        recs = list(app.recent.records)
    assert sorted(r.concurrency for r in recs) == [1, 2]  # the second was sent while the first was in flight
    assert all(r.duration_s is not None and r.duration_s > 0 for r in recs)


CLOCK = REPO / "benchmarks" / "clock.py"
# Loose on purpose: with a CPU hog beside the suite, 16 plain-stack streams of 10 tokens (the
# proxy's, the simulator's and the clients' processes on the one core left) gave p50 10-14 ms
# and p95 25-64 ms (the better of two runs is judged). A finished record's work done synchronously for all 16 streams, or a stall
# of the loop, shows above these; the quiet-machine figures are in benchmarks/README.md.
P50_MS, P95_MS = 20.0, 50.0


def test_the_clock_starts_when_the_request_arrives(stack: str) -> None:
    """Client-side TTFT against the record's ttft_s at 4 and 16 concurrent streams, with
    the proxy and a simulated server in their own processes (benchmarks/clock.py). The
    figures, measured on a quiet machine, are in benchmarks/README.md; this test only guards
    against the proxy losing tens of milliseconds (a delayed ACK costs 40) on a busy one."""
    # Other processes on the machine can only make these figures worse, never better: so the
    # better of two runs is what the proxy itself allows.
    attempts = []
    for _ in range(2):
        out = subprocess.run(
            [
                sys.executable,
                str(CLOCK),
                "--stack",
                stack,
                "--streams",
                "4",
                "--streams",
                "16",
                "--requests",
                "10",
                "--tokens",
                "10",
                "--json",
            ],
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        rows = json.loads(out.stdout.strip().splitlines()[-1])
        for row in rows:
            assert row["n"] >= row["streams"] * 8, row
        attempts.append(rows)
        if all(row["p50_ms"] < P50_MS and row["p95_ms"] < P95_MS for row in rows):
            return
    best = [min((a[i] for a in attempts), key=lambda r: r["p95_ms"]) for i in range(len(attempts[0]))]
    for row in best:
        assert row["p50_ms"] < P50_MS, (
            f"client waited {row['p50_ms']:.1f} ms (p50) beyond the record's ttft_s: {attempts}"
        )
        assert row["p95_ms"] < P95_MS, (
            f"client waited {row['p95_ms']:.1f} ms (p95) beyond the record's ttft_s: {attempts}"
        )
