"""A minimal, fast OpenAI-shaped SSE upstream for the proxy benchmark (raw asyncio).

Run as its own process (so it never shares a GIL with the proxy or the load generator):

    python benchmarks/upstream.py --port 0      # prints "READY <port>" on stdout

POST .../chat/completions (anything ending in /completions):
  * `"stream": true`  -> `text/event-stream`, chunked like real servers: a role chunk right
    away, then `max_tokens` content events, a finish chunk, a usage chunk when
    `stream_options.include_usage` is set, and `data: [DONE]`. Events are paced at the
    current rate (tokens/s per stream, 0 = as fast as possible, yielding to the loop after
    every event so streams interleave). Each content event carries `"ts"`: the
    `time.perf_counter()` (CLOCK_MONOTONIC, shared by all processes on Linux) at which it
    was written, so a client can compute the one-way delay of every event.
  * otherwise a small `chat.completion` JSON body with Content-Length.
GET /_bench/config?rate=R sets the rate for the following requests (the harness sets it
once per scenario, so it works through any proxy whatever it does to bodies and headers).
GET /health answers 200.

Nothing here is clever on purpose: one write per event, TCP_NODELAY, write-buffer bounds.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import socket
import sys
import time

try:
    import orjson

    _loads = orjson.loads
except ImportError:  # pragma: no cover - the project depends on orjson
    import json

    _loads = json.loads

now = time.perf_counter

RATE = {"rate": 100.0}
NONSTREAM_BODY = (
    b'{"id":"chatcmpl-bench","object":"chat.completion","created":1700000000,"model":"bench",'
    b'"choices":[{"index":0,"message":{"role":"assistant","content":"Hello! How can I help you today?"},'
    b'"finish_reason":"stop"}],"usage":{"prompt_tokens":12,"completion_tokens":9,"total_tokens":21}}'
)
SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
    b"transfer-encoding: chunked\r\n\r\n"
)
ROLE = (
    b'data: {"id":"chatcmpl-bench","object":"chat.completion.chunk","created":1700000000,"model":"bench",'
    b'"choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}\n\n'
)
TOKEN = (
    'data: {{"id":"chatcmpl-bench","object":"chat.completion.chunk","created":1700000000,"model":"bench",'
    '"ts":{ts:.7f},"choices":[{{"index":0,"delta":{{"content":"tok{k} "}},"finish_reason":null}}]}}\n\n'
)
FINISH = (
    b'data: {"id":"chatcmpl-bench","object":"chat.completion.chunk","created":1700000000,"model":"bench",'
    b'"choices":[{"index":0,"delta":{},"finish_reason":"length"}]}\n\n'
)
USAGE = (
    'data: {{"id":"chatcmpl-bench","object":"chat.completion.chunk","created":1700000000,"model":"bench",'
    '"choices":[],"usage":{{"prompt_tokens":12,"completion_tokens":{n},"total_tokens":{t}}}}}\n\n'
)
DONE = b"data: [DONE]\n\n"
HIGH_WATER = 256 * 1024


def chunk(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(payload), payload)


def simple(status: str, body: bytes, ctype: bytes = b"application/json") -> bytes:
    return (
        b"HTTP/1.1 "
        + status.encode()
        + b"\r\ncontent-type: "
        + ctype
        + b"\r\ncontent-length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )


async def stream(writer: asyncio.StreamWriter, n: int, usage: bool) -> None:
    rate = RATE["rate"]
    transport = writer.transport
    writer.write(SSE_HEAD + chunk(ROLE))
    t0 = now()
    interval = 1.0 / rate if rate > 0 else 0.0
    for k in range(n):
        if interval:
            delay = t0 + (k + 1) * interval - now()
            if delay > 0:
                await asyncio.sleep(delay)
        elif k:
            await asyncio.sleep(0)
        if transport.is_closing():
            return
        writer.write(chunk(TOKEN.format(ts=now(), k=k).encode()))
        if transport.get_write_buffer_size() > HIGH_WATER:
            await writer.drain()
    tail = chunk(FINISH)
    if usage:
        tail += chunk(USAGE.format(n=n, t=n + 12).encode())
    writer.write(tail + chunk(DONE) + b"0\r\n\r\n")


async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.split(b"\r\n")
            method, target, _ = lines[0].split(b" ", 2)
            length = 0
            close = False
            for line in lines[1:]:
                k, _, v = line.partition(b":")
                k = k.strip().lower()
                if k == b"content-length":
                    length = int(v)
                elif k == b"connection" and v.strip().lower() == b"close":
                    close = True
            body = await reader.readexactly(length) if length else b""
            path, _, query = target.partition(b"?")
            if method == b"POST" and path.endswith(b"/completions"):
                try:
                    obj = _loads(body)
                except ValueError:
                    writer.write(simple("400 Bad Request", b'{"error":{"message":"bad json"}}'))
                    continue
                if obj.get("stream"):
                    so = obj.get("stream_options") or {}
                    n = int(obj.get("max_tokens") or 16)
                    await stream(writer, n, bool(so.get("include_usage")))
                else:
                    writer.write(simple("200 OK", NONSTREAM_BODY))
            elif path == b"/_bench/config":
                for part in query.split(b"&"):
                    k, _, v = part.partition(b"=")
                    if k == b"rate":
                        RATE["rate"] = float(v)
                writer.write(simple("200 OK", b'{"rate":%g}' % RATE["rate"]))
            elif path in (b"/health", b"/v1/models"):
                writer.write(simple("200 OK", b'{"status":"ok","data":[{"id":"bench","object":"model"}]}'))
            else:
                writer.write(simple("404 Not Found", b'{"error":{"message":"not found"}}'))
            if close:
                break
            if writer.transport.get_write_buffer_size() > HIGH_WATER:
                await writer.drain()
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, ValueError):
        pass
    finally:
        writer.close()


async def main(host: str, port: int) -> None:
    server = await asyncio.start_server(handle, host, port, backlog=4096, reuse_address=True)
    sock = server.sockets[0]
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    print(f"READY {sock.getsockname()[1]}", flush=True)
    stop = asyncio.get_running_loop().create_future()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, lambda: stop.done() or stop.set_result(None))
    async with server:
        await stop


def cli(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Fast OpenAI-shaped SSE upstream for benchmarks.")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--rate", type=float, default=100.0, help="initial tokens/s per stream (0 = as fast as possible)")
    args = ap.parse_args(argv)
    RATE["rate"] = args.rate
    run(main(args.host, args.port))
    sys.exit(0)


def run(coro: object) -> object:
    """asyncio.run on uvloop when it is installed (the cheapest loop for every process here)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)  # type: ignore[arg-type]
    return uvloop.run(coro)  # type: ignore[arg-type]


if __name__ == "__main__":
    cli()
