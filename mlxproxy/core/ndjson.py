"""Incremental newline-delimited JSON decoder (Ollama's `application/x-ndjson` streams).

Sans-I/O, with the SSE decoder's interface (`feed(data) -> items`, `close()`,
`safe_offset`), so the meter drives either the same way: each complete line becomes an
`SSEEvent` whose `data` is the line's text (one JSON value per line: Ollama's
`server/routes.go::streamResponse` writes `json.Marshal(val)` and a `\\n`). Lines are split
on LF bytes (a CR before it is dropped) and each complete line is decoded as UTF-8 on its
own, so a read boundary anywhere, inside a multi-byte character included, changes nothing.
Blank lines are skipped. An unterminated last line is dropped at `close()` (a body cut
mid-line is a truncated stream, as an SSE event cut mid-way is).

Items carry `start` and `end`: the stream offsets (bytes from the start of the body) of the
line and just past its newline. Bounded memory: a line longer than `max_line_bytes` is
dropped (its bytes still counted by the caller, which forwards everything) and reported
once as `SSEProtocolError`; the decoder never holds more than `max_line_bytes` of partial
line and skips an over-long one in time linear in its length.
"""

from __future__ import annotations

from mlxproxy.core.sse import DEFAULT_MAX_LINE_BYTES, SSEEvent, SSEItem, SSEProtocolError

__all__ = ["NDJSONDecoder"]

_LF = 0x0A


class NDJSONDecoder:
    """Feed bytes, get one `SSEEvent` per JSON line. One instance per response body."""

    __slots__ = ("max_line_bytes", "_buf", "_base", "_discarding")

    def __init__(self, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES) -> None:
        if max_line_bytes < 1:
            raise ValueError("max_line_bytes must be >= 1")
        self.max_line_bytes = max_line_bytes
        self._buf = b""  # the partial line held (never more than max_line_bytes)
        self._base = 0  # stream offset of _buf's first byte
        self._discarding = False  # inside a line already reported as too long

    @property
    def safe_offset(self) -> int:
        """Offset of the first byte not yet part of a returned item (the held partial line)."""
        return self._base

    def feed(self, data: bytes) -> list[SSEItem]:
        out: list[SSEItem] = []
        if not data:
            return out
        pos = 0
        n = len(data)
        while pos < n:
            nl = data.find(b"\n", pos)
            if self._discarding:
                if nl < 0:
                    self._base += n - pos
                    return out
                self._base += nl + 1 - pos
                self._discarding = False
                pos = nl + 1
                continue
            if nl < 0:
                rest = data[pos:]
                if len(self._buf) + len(rest) > self.max_line_bytes:
                    self._too_long(self._base + len(self._buf) + len(rest), out)
                    self._base += len(self._buf) + len(rest)
                    self._buf = b""
                    self._discarding = True
                else:
                    self._buf += rest
                return out
            line = self._buf + data[pos:nl] if self._buf else data[pos:nl]
            start = self._base
            end = start + len(line) + 1
            self._buf = b""
            self._base = end
            pos = nl + 1
            if line.endswith(b"\r"):
                line = line[:-1]
            if len(line) > self.max_line_bytes:
                self._too_long(end, out)
                continue
            if line.strip():
                out.append(SSEEvent(line.decode("utf-8", "replace"), end, start=start))
        return out

    def close(self) -> list[SSEItem]:
        """End of body: an unterminated last line is dropped (the body was cut)."""
        self._base += len(self._buf)
        self._buf = b""
        self._discarding = False
        return []

    def _too_long(self, end: int, out: list[SSEItem]) -> None:
        out.append(SSEProtocolError(f"NDJSON line longer than {self.max_line_bytes} bytes", end))
