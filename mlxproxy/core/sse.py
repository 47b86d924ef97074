"""Incremental Server-Sent Events decoder (WHATWG HTML, "event stream interpretation").

Sans-I/O: `feed(data)` takes whatever bytes arrived and returns the items completed by
them; `close()` ends the stream. Lines are split on bytes (CR, LF or CRLF, including a CR
at the end of one read and its LF at the start of the next) and each complete line is
decoded as UTF-8 on its own, so a character split across reads is never mangled.

Items carry `end`: the stream offset (bytes from the start of the body) just past the
line that completed them. The proxy uses it to cut exact byte spans out of a stream.

Bounded memory: a line longer than `max_line_bytes`, or an event whose lines (comments
inside it included) add up to more than that, is dropped together with the rest of its
event (the proxy still forwards every byte; it never depends on this decoder) and reported
once as `SSEProtocolError`. Whatever it is fed, the decoder holds at most `max_line_bytes`
of partial line and `max_line_bytes` of open event (so `safe_offset` never lags the input
by more than twice that), and skips an over-long line in time linear in its length.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SSEEvent", "SSEComment", "SSEProtocolError", "SSEItem", "SSEDecoder", "DEFAULT_MAX_LINE_BYTES"]

DEFAULT_MAX_LINE_BYTES = 4 * 1024 * 1024

_CR = 0x0D
_LF = 0x0A


@dataclass(slots=True)
class SSEEvent:
    """A dispatched event. `data` joins multiple `data:` lines with "\\n". Not frozen, only
    because a frozen dataclass's `__init__` costs twice as much and one is made per event:
    nothing changes an event once made."""

    data: str
    end: int
    event: str = ""
    id: str | None = None
    retry: int | None = None
    start: int = 0


@dataclass(frozen=True, slots=True)
class SSEComment:
    """A `:` line (keep-alive or prefill progress); `text` is without the colon and one leading space."""

    text: str
    end: int


@dataclass(frozen=True, slots=True)
class SSEProtocolError:
    """Bytes the decoder could not keep: a line longer than the bound."""

    reason: str
    end: int


SSEItem = SSEEvent | SSEComment | SSEProtocolError


class SSEDecoder:
    """Feed bytes, get events. One instance per response body."""

    __slots__ = (
        "max_line_bytes",
        "_buf",
        "_base",
        "_skip_lf",
        "_discarding",
        "_data",
        "_event",
        "_last_id",
        "_retry",
        "_event_start",
        "_first_line",
        "_open",
        "_skip_event",
        "_idle",
    )

    def __init__(self, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES) -> None:
        self.max_line_bytes = max_line_bytes
        self._buf = b""
        self._base = 0  # stream offset of self._buf[0]
        self._skip_lf = False  # the previous read ended in CR: a leading LF belongs to it
        self._discarding = False  # inside an over-long line, already reported
        self._data: list[str] = []
        self._event = ""
        self._last_id: str | None = None
        self._retry: int | None = None
        self._event_start = 0
        self._first_line = True
        self._open = False  # a field line of the next event was seen
        self._skip_event = False  # the current event was dropped: ignore its lines up to the blank line
        self._idle = True  # none of the five above is set: no line or event open (kept by `_feed_general`, `close`)

    def feed(self, data: bytes) -> list[SSEItem]:
        """Consume `data`; return the items it completed (possibly none). Never raises."""
        # what nearly every server sends, reads of whole single-line data events, is recognised
        # in one place (`data_payloads`); each event is then built directly, exactly as `_line`
        # + `_dispatch` would build it (an event spans "data: " + its data + the blank line)
        start, end, last_id = self._event_start, self._base, self._last_id
        payloads = self.data_payloads(data)
        if payloads is None:
            return self._feed_general(data)
        out: list[SSEItem] = []
        for p in payloads:
            end += len(p) + 8
            out.append(SSEEvent(p.decode("utf-8", "replace"), end, "", last_id, None, start))
            start = end
        return out

    def data_payloads(self, data: bytes) -> list[bytes] | None:
        """For a read that is nothing but whole single-line data events, `data: X\\n\\n` (no CR,
        within the line bound), arriving while no line or event is open: each event's data,
        undecoded, with the decoder advanced exactly as `feed` would advance it (`feed` would
        return one `SSEEvent` per payload, its `data` the payload decoded as UTF-8 with
        replacement). Anything else: None, and nothing is consumed (use `feed`). A handful of
        C calls per read, no per-line Python: what nearly every chat stream sends."""
        n = len(data)
        if (
            not self._idle
            or n < 8  # (the shortest: "data: " and the two newlines)
            or n > self.max_line_bytes
            or data[-1] != _LF  # (indexing, not a slice: no bytes object made per read)
            or data[-2] != _LF
            or data[:6] != b"data: "
            # (`partition`, a C call taking its one argument as is, costs less than `find`,
            # whose arguments are parsed at each call: ~500 instructions a test, per read)
            or data.partition(b"\r")[1]
        ):
            return None
        head, _, tail = data.partition(b"\n")
        if tail == b"\n":  # the first newline is the one before the last: one event (the usual read)
            payloads = [head[6:]]
        else:
            # data == b"data: " + b"\n\ndata: ".join(payloads) + b"\n\n"; the newline count
            # says that no payload holds one (each event is one data line and its blank line)
            payloads = data[6:-2].split(b"\n\ndata: ")
            if data.count(b"\n") != 2 * len(payloads):
                return None
        self._first_line = False  # the first line began with "data: ", so it held no BOM
        self._base = self._event_start = self._base + n
        return payloads

    def _feed_general(self, data: bytes) -> list[SSEItem]:
        """`feed` for any input: the standard's line and event rules, byte by byte."""
        out: list[SSEItem] = []
        if data:
            self._feed_lines(data, out)
            self._idle = not (self._buf or self._skip_lf or self._discarding or self._open or self._skip_event)
        return out

    def _feed_lines(self, data: bytes, out: list[SSEItem]) -> None:
        if self._skip_lf:
            self._skip_lf = False
            if data[0] == _LF:
                data = data[1:]
                self._base += 1
                if not self._open:  # the LF ended a blank or comment line: the next event starts after it
                    self._event_start = max(self._event_start, self._base)
                if not data:
                    return
        if self._discarding:  # inside an over-long line: skip to its end without buffering
            data = self._skip_rest_of_line(data)
            if not data:
                return
        buf = self._buf + data if self._buf else data
        n = len(buf)
        start = 0
        base = self._base
        if b"\r" not in buf:
            find = buf.find
            while True:
                i = find(b"\n", start)
                if i < 0:
                    break
                self._line(buf, start, i, base + i + 1, out)
                start = i + 1
        else:
            while start < n:
                i_lf = buf.find(b"\n", start)
                i_cr = buf.find(b"\r", start)
                if i_lf < 0 and i_cr < 0:
                    break
                if i_cr < 0 or (0 <= i_lf < i_cr):
                    i, nxt = i_lf, i_lf + 1
                elif i_cr + 1 < n:
                    i = i_cr
                    nxt = i_cr + 2 if buf[i_cr + 1] == _LF else i_cr + 1
                else:  # CR is the last byte: its LF may come with the next read
                    i, nxt = i_cr, i_cr + 1
                    self._skip_lf = True
                self._line(buf, start, i, base + nxt, out)
                start = nxt
        rest = buf[start:] if start else buf
        if len(rest) > self.max_line_bytes:
            self._too_long("line", base + start + self.max_line_bytes + 1, out)
            self._discarding = True
            self._base = base + n
            self._buf = b""
            return
        self._base = base + start
        self._buf = rest

    @property
    def safe_offset(self) -> int:
        """Stream offset up to which every byte belongs to a complete line outside any
        open event: bytes before it can be forwarded without splitting an event."""
        return self._event_start if self._open else self._base

    def close(self) -> list[SSEItem]:
        """End of body: a last line without a line end and a last event without a blank
        line are still dispatched (lenient, so a truncated stream is still measured)."""
        out: list[SSEItem] = []
        if self._buf and not self._discarding:
            buf = self._buf
            self._line(buf, 0, len(buf), self._base + len(buf), out)
        self._buf = b""
        self._discarding = False
        if self._data:
            self._dispatch(self._base, out)
        self._skip_event = False
        self._idle = not (self._open or self._skip_lf)
        return out

    # -- internals -------------------------------------------------------------------

    def _skip_rest_of_line(self, data: bytes) -> bytes:
        """Drop `data` up to and including the end of the over-long line; return the rest."""
        i_lf = data.find(b"\n")
        i_cr = data.find(b"\r", 0, i_lf if i_lf >= 0 else len(data))
        i = i_cr if i_cr >= 0 else i_lf
        if i < 0:
            self._base += len(data)
            return b""
        nxt = i + 1
        if i == i_cr:
            if nxt == len(data):
                self._skip_lf = True  # its LF may come with the next read
            elif data[nxt] == _LF:
                nxt += 1
        self._discarding = False
        self._base += nxt
        return data[nxt:]

    def _too_long(self, what: str, end: int, out: list[SSEItem]) -> None:
        """Report a line or event over the bound and forget the event it belongs to; the
        event's remaining lines are ignored up to its blank line."""
        out.append(SSEProtocolError(f"{what} longer than {self.max_line_bytes} bytes", end))
        self._data = []
        self._event = ""
        self._retry = None
        self._open = False
        self._skip_event = True

    def _line(self, buf: bytes, start: int, stop: int, end: int, out: list[SSEItem]) -> None:
        if start == stop:
            self._dispatch(end, out)
            return
        if stop - start > self.max_line_bytes:
            self._too_long("line", self._base + start + self.max_line_bytes + 1, out)
            return
        if self._open and end - self._event_start > self.max_line_bytes:  # every byte since the event began is held
            self._too_long("event", end, out)
        line = buf[start:stop].decode("utf-8", "replace")
        if self._first_line:
            self._first_line = False
            if line.startswith("\ufeff"):
                line = line[1:]
                if not line:  # the BOM alone: a blank line
                    self._dispatch(end, out)
                    return
        if line[0] == ":":
            text = line[1:]
            out.append(SSEComment(text[1:] if text.startswith(" ") else text, end))
            if not self._data:  # a comment before any data line is not part of the next event
                self._event_start = end
            return
        if self._skip_event:
            return
        colon = line.find(":")
        if colon < 0:
            field, value = line, ""
        else:
            field = line[:colon]
            value = line[colon + 1 :]
            if value.startswith(" "):
                value = value[1:]
        self._open = True
        if field == "data":
            self._data.append(value)
        elif field == "event":
            self._event = value
        elif field == "id":
            if "\x00" not in value:
                self._last_id = value
        elif field == "retry":
            if value.isascii() and value.isdigit() and len(value) <= 18:  # int() refuses > 4300 digits
                self._retry = int(value)
        # other field names are ignored, as the standard says

    def _dispatch(self, end: int, out: list[SSEItem]) -> None:
        if self._data:
            out.append(
                SSEEvent(
                    "\n".join(self._data),
                    end,
                    self._event,
                    self._last_id,
                    self._retry,
                    self._event_start,
                )
            )
            self._data = []
        self._event = ""
        self._retry = None
        self._event_start = end
        self._open = False
        self._skip_event = False
