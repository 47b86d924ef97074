"""A loopback tap that keeps both directions of every connection with a receive time per chunk,
and splits them into HTTP exchanges: the exact request bytes, the exact response bytes, and when
the request was sent, the first response byte came, the first token came and the response ended.

Used by the session recorder (``record_sessions``) to keep a real agent's multi-turn session
exactly as it went over the wire in front of ``mlxproxy serve``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import socket
import threading
import time
from collections.abc import Iterator
from typing import TypeVar

from .serving import serving

#: A token-bearing event in any of the three streaming dialects (chat ``content`` /
#: ``reasoning_content``, Messages ``text`` / ``thinking`` deltas, Responses ``delta``), a
#: non-empty string value.
_TOKEN = re.compile(rb'"(?:content|reasoning_content|reasoning|text|thinking|delta)":\s*"(?!")')


@dataclasses.dataclass
class _Side:
    data: bytearray = dataclasses.field(default_factory=bytearray)
    marks: list[tuple[int, float]] = dataclasses.field(default_factory=list)  # (offset, monotonic time)

    def add(self, chunk: bytes, t: float) -> None:
        self.marks.append((len(self.data), t))
        self.data += chunk

    def time_at(self, offset: int) -> float:
        """Receive time of the chunk holding byte ``offset``."""
        t = self.marks[0][1] if self.marks else 0.0
        for off, when in self.marks:
            if off > offset:
                break
            t = when
        return t


@dataclasses.dataclass
class Exchange:
    """One HTTP request and its response, as the bytes went over the wire."""

    request: bytes  # request line, headers, blank line, body
    response: bytes  # status line, headers, blank line, body (framing as sent)
    t_sent: float  # monotonic time of the request's first byte
    t_request_end: float
    t_first_byte: float | None  # of the response
    t_first_token: float | None
    t_end: float | None
    #: (byte offset in ``response``, monotonic receive time) of each chunk read
    response_marks: list[tuple[int, float]] = dataclasses.field(default_factory=list)

    @property
    def request_line(self) -> str:
        return self.request.split(b"\r\n", 1)[0].decode("latin-1")

    @property
    def method(self) -> str:
        return self.request_line.split(" ", 1)[0]

    @property
    def path(self) -> str:
        parts = self.request_line.split(" ")
        return parts[1] if len(parts) > 1 else ""

    def head_and_body(self) -> tuple[bytes, bytes]:
        head, _, body = self.request.partition(b"\r\n\r\n")
        return head, body


def _headers(head: bytes) -> dict[str, str]:
    out = {}
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        out[name.strip().lower().decode("latin-1")] = value.strip().decode("latin-1")
    return out


def _chunked_end(data: bytes, start: int) -> int | None:
    """Offset just past a chunked body starting at ``start``, or None if incomplete."""
    i = start
    while True:
        eol = data.find(b"\r\n", i)
        if eol < 0:
            return None
        size = int(data[i:eol].split(b";", 1)[0].strip() or b"0", 16)
        i = eol + 2
        if size == 0:
            end = data.find(b"\r\n", i)  # trailers end with an empty line
            while end >= 0 and end != i:
                i = end + 2
                end = data.find(b"\r\n", i)
            return None if end < 0 else end + 2
        i += size + 2
        if i > len(data):
            return None


def body_pieces(raw: bytes) -> Iterator[tuple[bytes, int]]:
    """The body of a raw HTTP message, chunked framing removed, piece by piece, each with the
    offset in ``raw`` it starts at (to find when it arrived)."""
    head, _, _ = raw.partition(b"\r\n\r\n")
    start = len(head) + 4
    if not re.search(rb"(?im)^transfer-encoding:\s*chunked", head):
        yield raw[start:], start
        return
    i = start
    while i < len(raw):
        eol = raw.find(b"\r\n", i)
        if eol < 0:
            return
        size = int(raw[i:eol].split(b";", 1)[0].strip() or b"0", 16)
        if size == 0:
            return
        yield raw[eol + 2 : eol + 2 + size], eol + 2
        i = eol + 2 + size + 2


def _split_requests(data: bytes) -> list[tuple[int, int]]:
    out = []
    i = 0
    while i < len(data):
        sep = data.find(b"\r\n\r\n", i)
        if sep < 0:
            break
        h = _headers(data[i:sep])
        body = sep + 4
        if "chunked" in h.get("transfer-encoding", "").lower():
            end = _chunked_end(data, body) or len(data)
        else:
            end = body + int(h.get("content-length", "0") or 0)
        out.append((i, min(end, len(data))))
        i = end
    return out


def _split_responses(data: bytes, methods: list[str]) -> list[tuple[int, int]]:
    out = []
    i = 0
    for method in methods:
        if i >= len(data):
            break
        sep = data.find(b"\r\n\r\n", i)
        if sep < 0:
            out.append((i, len(data)))
            break
        status_line = data[i : data.find(b"\r\n", i)]
        status = int(status_line.split(b" ")[1]) if len(status_line.split(b" ")) > 1 else 0
        h = _headers(data[i:sep])
        body = sep + 4
        if method == "HEAD" or status in (204, 304) or 100 <= status < 200:
            end = body
        elif "chunked" in h.get("transfer-encoding", "").lower():
            end = _chunked_end(data, body) or len(data)
        elif "content-length" in h:
            end = body + int(h["content-length"])
        else:
            end = len(data)
        out.append((i, min(end, len(data))))
        i = end
    return out


class SessionTap:
    """Listening on ``url``, forwarding to ``target_port``; :meth:`exchanges` splits what went by."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self._conns: list[tuple[_Side, _Side]] = []
        self._sockets: list[socket.socket] = []
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
            sides = (_Side(), _Side())
            with self._lock:
                self._conns.append(sides)
                self._sockets += [client, upstream]
            pipes = [
                threading.Thread(target=self._pipe, args=(src, dst, keep), daemon=True)
                for src, dst, keep in ((client, upstream, sides[0]), (upstream, client, sides[1]))
            ]
            for p in pipes:
                p.start()
            threading.Thread(target=self._close_after, args=(pipes, client, upstream), daemon=True).start()

    @staticmethod
    def _close_after(pipes: list[threading.Thread], *socks: socket.socket) -> None:
        for p in pipes:
            p.join()
        for sock in socks:
            sock.close()

    def close(self) -> None:
        """Stop listening and close every connection still open."""
        self._server.close()
        with self._lock:
            socks = list(self._sockets)
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.close()

    def _pipe(self, src: socket.socket, dst: socket.socket, keep: _Side) -> None:
        try:
            while data := src.recv(65536):
                t = time.monotonic()
                with self._lock:
                    keep.add(data, t)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

    def exchanges(self) -> list[Exchange]:
        """Every request/response pair seen so far, in the order the requests were sent."""
        with self._lock:
            conns = [
                (_Side(bytearray(a.data), list(a.marks)), _Side(bytearray(b.data), list(b.marks)))
                for a, b in self._conns
            ]
        out = []
        for req_side, resp_side in conns:
            reqs = _split_requests(bytes(req_side.data))
            methods = [bytes(req_side.data[a:b]).split(b" ", 1)[0].decode("latin-1") for a, b in reqs]
            resps = _split_responses(bytes(resp_side.data), methods)
            for k, (a, b) in enumerate(reqs):
                request = bytes(req_side.data[a:b])
                t_sent = req_side.time_at(a)
                t_req_end = req_side.time_at(max(a, b - 1))
                if k < len(resps):
                    ra, rb = resps[k]
                    response = bytes(resp_side.data[ra:rb])
                    t_fb: float | None = resp_side.time_at(ra)
                    t_end: float | None = resp_side.time_at(max(ra, rb - 1))
                    body_at = response.find(b"\r\n\r\n") + 4
                    m = _TOKEN.search(response, body_at)
                    t_tok = resp_side.time_at(ra + m.start()) if m else None
                    marks = [(off - ra, t) for off, t in resp_side.marks if ra <= off < rb]
                    if not marks or marks[0][0] != 0:  # began inside a chunk read with the previous response
                        marks.insert(0, (0, resp_side.time_at(ra)))
                else:
                    response, t_fb, t_end, t_tok, marks = b"", None, None, None, []
                out.append(Exchange(request, response, t_sent, t_req_end, t_fb, t_tok, t_end, marks))
        out.sort(key=lambda e: e.t_sent)
        return out


T = TypeVar("T", bound=SessionTap)


def session_tap(target_port: int, kind: type[T] = SessionTap) -> contextlib.AbstractContextManager[T]:  # type: ignore[assignment]
    t = kind(target_port)
    return serving(t, t._accept, t.close)
