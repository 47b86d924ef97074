"""A scripted HTTP upstream on a raw socket, for tests that need byte-level control.

Each connection's request is parsed and handed to the test's async `handler(req, conn)`,
which writes exactly the bytes it wants (HTTP/1.1 chunked, HTTP/1.0 close-delimited,
resets, stalls) and can wait on gates the test opens, so tests never sleep to measure.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field


@dataclass
class Req:
    method: str
    path: str
    headers: list[tuple[str, str]]
    body: bytes

    def header(self, name: str) -> str | None:
        for k, v in self.headers:
            if k.lower() == name.lower():
                return v
        return None


@dataclass
class Conn:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    loop: asyncio.AbstractEventLoop
    closed_by_peer: threading.Event = field(default_factory=threading.Event)

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def head(self, status: int = 200, headers: list[tuple[str, str]] | None = None, version: str = "1.1") -> None:
        lines = [f"HTTP/{version} {status} X"] + [f"{k}: {v}" for k, v in (headers or [])]
        await self.send(("\r\n".join(lines) + "\r\n\r\n").encode())

    async def chunk(self, data: bytes) -> None:
        await self.send(f"{len(data):x}\r\n".encode() + data + b"\r\n")

    async def end_chunked(self) -> None:
        await self.send(b"0\r\n\r\n")

    async def wait_gate(self, gate: threading.Event, timeout_s: float = 10.0) -> bool:
        return await self.loop.run_in_executor(None, gate.wait, timeout_s)

    async def wait_peer_close(self, timeout_s: float = 10.0) -> bool:
        """True once the proxy closed this connection (what a cancelled request looks like)."""
        try:
            data = await asyncio.wait_for(self.reader.read(1), timeout_s)
        except (asyncio.TimeoutError, ConnectionError):
            return False
        if data == b"":
            self.closed_by_peer.set()
            return True
        return False

    def reset(self) -> None:
        sock = self.writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        self.writer.transport.abort()


Handler = Callable[[Req, Conn], Awaitable[None]]


class FakeUpstream:
    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.requests: list[Req] = []
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.port = 0
        self.errors: list[BaseException] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)

        async def main() -> None:
            self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
            self.port = self.server.sockets[0].getsockname()[1]
            self._ready.set()
            async with self.server:
                await self.server.serve_forever()

        try:
            self.loop.run_until_complete(main())
        except (asyncio.CancelledError, RuntimeError):
            pass
        # connection handlers cancelled at exit finish here (their `finally` closes the writer),
        # not later when the garbage collector finalizes them on a closed loop
        pending = asyncio.all_tasks(self.loop)
        if pending:
            self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        self.loop.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = [tuple(x.split(": ", 1)) for x in lines[1:] if x]
                n = 0
                for k, v in headers:
                    if k.lower() == "content-length":
                        n = int(v)
                body = await reader.readexactly(n) if n else b""
                req = Req(method, path, headers, body)  # type: ignore[arg-type]
                self.requests.append(req)
                conn = Conn(reader, writer, self.loop)
                await self.handler(req, conn)
                if writer.is_closing():
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except BaseException as exc:  # surfaced to the test through .errors
            self.errors.append(exc)
        finally:
            writer.close()

    def __enter__(self) -> FakeUpstream:
        self._thread.start()
        self._ready.wait(5)
        return self

    def __exit__(self, *exc: object) -> None:
        def stop() -> None:
            self.server.close()
            for t in asyncio.all_tasks(self.loop):
                t.cancel()

        self.loop.call_soon_threadsafe(stop)
        self._thread.join(5)


def sse_response(body: bytes, *, http10: bool = False) -> Handler:
    """A handler that sends `body` as an SSE stream, one event per write."""

    async def handler(req: Req, conn: Conn) -> None:
        events = [e + b"\n\n" for e in body.split(b"\n\n") if e]
        if http10:
            await conn.head(200, [("Content-type", "text/event-stream")], version="1.0")
            for e in events:
                await conn.send(e)
            conn.writer.close()
        else:
            await conn.head(200, [("content-type", "text/event-stream"), ("transfer-encoding", "chunked")])
            for e in events:
                await conn.chunk(e)
            await conn.end_chunked()

    return handler
