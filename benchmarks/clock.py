"""Does the proxy's clock start when the client's request arrives?

Starts a simulated server (`mlxproxy sim`) and the proxy (`mlxproxy serve`), each in its own
process, runs N concurrent streaming clients over raw sockets (one keep-alive connection
each, timestamps taken in `data_received` before any parsing), and compares every request's
client-side TTFT (request written -> first content event read) with the `ttft_s` of the
proxy's record of the same request (matched by X-Mlxproxy-Request-Id, read from /streams).
The difference is what the client waited for that the proxy's figure does not contain:
event-loop lag before the proxy read the request, and the write back to the client.

    python benchmarks/clock.py                 # 4 and 16 streams, 2 x 40 requests each
    python benchmarks/clock.py --streams 4 --streams 16 --requests 60 --stack plain
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import time
import urllib.request


def request_body(tokens: int) -> bytes:
    return json.dumps(
        {
            "model": "sim",
            "stream": True,
            "max_tokens": tokens,
            "messages": [{"role": "user", "content": "Tell me about the sea. " * 20}],
        }
    ).encode()


FIRST_TOKEN = re.compile(rb'"(?:content|reasoning_content|reasoning)":"[^"]')  # a non-empty delta: a generated token


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


class StreamClient(asyncio.Protocol):
    def __init__(self, body: bytes) -> None:
        self.body = body
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.waiter: asyncio.Future[None] | None = None
        self.t_first: float | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        t = time.perf_counter()
        self.buf += data
        if self.t_first is None and FIRST_TOKEN.search(self.buf):
            self.t_first = t
        if self.buf.endswith(b"0\r\n\r\n") and self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def request(self, port: int) -> tuple[float, str]:
        assert self.transport is not None
        self.buf.clear()
        self.t_first = None
        self.waiter = asyncio.get_running_loop().create_future()
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(self.body)}\r\n\r\n"
        ).encode()
        t0 = time.perf_counter()
        self.transport.write(head + self.body)
        await asyncio.wait_for(self.waiter, 60)
        head_end = self.buf.index(b"\r\n\r\n")
        rid = ""
        for line in bytes(self.buf[:head_end]).split(b"\r\n")[1:]:
            k, _, v = line.partition(b":")
            if k.strip().lower() == b"x-mlxproxy-request-id":
                rid = v.strip().decode()
        assert self.t_first is not None, "no content event"
        return self.t_first - t0, rid


async def run_clients(port: int, streams: int, requests: int, tokens: int = 40) -> list[tuple[float, str]]:
    loop = asyncio.get_running_loop()
    out: list[tuple[float, str]] = []
    body = request_body(tokens)

    async def one() -> None:
        _, proto = await loop.create_connection(lambda: StreamClient(body), "127.0.0.1", port)
        for _ in range(requests):
            out.append(await proto.request(port))
        proto.transport.close()  # type: ignore[union-attr]

    await asyncio.gather(*(one() for _ in range(streams)))
    return out


def wait_http(url: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url, timeout=1).read()
            return
        except OSError:
            time.sleep(0.05)
    raise SystemExit(f"clock.py: {url} did not come up")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, action="append", help="concurrent streams (repeatable; default 4 and 16)")
    ap.add_argument("--requests", type=int, default=40, help="requests per stream (default 40)")
    ap.add_argument("--tokens", type=int, default=40, help="max_tokens per request (default 40)")
    ap.add_argument("--json", action="store_true", help="also print the figures as one JSON line at the end")
    ap.add_argument("--stack", choices=["plain", "fast"], default=None, help="the proxy's loop/parser (MLXPROXY_STACK)")
    a = ap.parse_args()
    env = dict(os.environ)
    if a.stack:
        env["MLXPROXY_STACK"] = a.stack
    sim_port, px_port = free_port(), free_port()
    exe = [sys.executable, "-m", "mlxproxy"]
    procs = [
        subprocess.Popen(
            exe + ["sim", "--port", str(sim_port), "--decode-tps", "100", "--max-batch", "0"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    ]
    try:
        wait_http(f"http://127.0.0.1:{sim_port}/health")
        procs.append(
            subprocess.Popen(
                exe
                + [
                    "serve",
                    "--upstream",
                    f"http://127.0.0.1:{sim_port}",
                    "--port",
                    str(px_port),
                    "--log-level",
                    "warning",
                ],
                env=env,
                stderr=subprocess.DEVNULL,
            )
        )
        wait_http(f"http://127.0.0.1:{px_port}/healthz")
        print(
            f"stack: {a.stack or 'fastest installed'}; sim 100 tok/s per stream, {a.tokens} tokens; "
            f"{a.requests} requests per stream",
            flush=True,
        )
        rows = []
        for n in a.streams or [4, 16]:
            got = asyncio.run(run_clients(px_port, n, a.requests, a.tokens))
            recs = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{px_port}/streams").read())["recent"]
            by_id = {r["id"]: r for r in recs}
            diffs = [(c - by_id[rid]["ttft_s"]) * 1000 for c, rid in got if rid in by_id and by_id[rid]["ttft_s"]]
            diffs = diffs[len(diffs) // 10 :]  # the first tenth is warm-up (connections, caches)
            health = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{px_port}/healthz").read())
            row = {
                "streams": n,
                "n": len(diffs),
                "p50_ms": round(statistics.median(diffs), 3),
                "p95_ms": round(pct(diffs, 95), 3),
                "max_ms": round(max(diffs), 3),
                "loop_lag_max_ms": round(health.get("event_loop_lag_max_s", 0.0) * 1000, 3),
            }
            rows.append(row)
            print(
                f"{n:>3} streams: client TTFT - record ttft_s: p50 {row['p50_ms']:.2f} ms  p95 {row['p95_ms']:.2f} ms  "
                f"max {row['max_ms']:.2f} ms  (n={row['n']}); proxy loop lag max so far {row['loop_lag_max_ms']:.1f} ms",
                flush=True,
            )
        if a.json:
            print(json.dumps(rows))
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
