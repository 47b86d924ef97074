"""A loopback TCP tap: forwards every connection to a target port, both ways, and keeps the bytes
the clients sent, so a test can store a real client's requests exactly as they were sent."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator


class Tap:
    """Listening on ``url``; ``sent`` holds each accepted connection's client bytes, in order."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.sent: list[bytearray] = []
        self._lock = threading.Lock()
        self._server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._server.getsockname()[1]}"

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return  # closed
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            buf = bytearray()
            with self._lock:
                self.sent.append(buf)
            for src, dst, keep in ((client, upstream, buf), (upstream, client, None)):
                threading.Thread(target=self._pipe, args=(src, dst, keep), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket, keep: bytearray | None) -> None:
        try:
            while data := src.recv(65536):
                if keep is not None:
                    keep += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

    def requests(self) -> list[bytes]:
        """Every HTTP request the clients sent (head and body), split by Content-Length (or at the
        last chunk of a chunked body)."""
        out = []
        with self._lock:
            streams = [bytes(b) for b in self.sent]
        for data in streams:
            while data:
                head, sep, rest = data.partition(b"\r\n\r\n")
                if not sep:
                    break
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value.strip())
                    elif name.strip().lower() == b"transfer-encoding" and b"chunked" in value.lower():
                        end = rest.find(b"\r\n0\r\n\r\n")
                        length = len(rest) if end < 0 else end + 7
                out.append(head + sep + rest[:length])
                data = rest[length:]
        return out


@contextlib.contextmanager
def tap(target_port: int) -> Iterator[Tap]:
    t = Tap(target_port)
    acceptor = threading.Thread(target=t._accept, daemon=True)
    acceptor.start()
    try:
        yield t
    finally:
        t._server.close()
        acceptor.join(timeout=5)
