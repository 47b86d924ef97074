"""The capture file: JSON Lines, one finished request a line, written off the hot path.

Line format (version `CAPTURE_VERSION`): the record's keys (see `Record.to_dict`) plus
`v`, `method`, `path`, `request` (the request body as JSON) or `request_b64` (when it is
not JSON), `request_headers` / `response_headers` (secrets redacted), `offset_s` (from
the start of the capture) and `event_offsets_ms` (each generated event from t_start).
`response_text`/`reasoning_text` only with `capture_responses`. With `capture_prompts:
false` message texts are replaced by their lengths (`{"content_chars": N}`).

Durability: records go through a bounded queue to a writer thread that writes each line
with one unbuffered write (at the OS once written, so a `kill -9` loses only what is still
queued); a full queue drops the record and counts it (never slows a stream). A file that
cannot be opened or written (disk full, read-only path) is logged once, every record it
loses is counted, and the writer keeps trying, so it recovers when space comes back; a
partially written line is cut off again, so the file only ever holds whole lines. A torn
last line left by a crash is cut off when the file is opened for appending, and a reader
skips one with a warning.
"""

from __future__ import annotations

import base64
import errno
import logging
import os
import queue
import stat
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from mlxproxy import __version__
from mlxproxy.core.record import Record
from mlxproxy.errors import CaptureFormatError, ConfigError
from mlxproxy.headers import DEFAULT_REDACT, REDACTED

__all__ = [
    "CAPTURE_VERSION",
    "DEFAULT_REDACT",
    "Exchange",
    "CaptureWriter",
    "CapturedRequest",
    "read_capture",
    "redact_headers",
    "MIGRATIONS",
]

log = logging.getLogger("mlxproxy")

CAPTURE_VERSION = 1
_STOP = object()


@dataclass(frozen=True, slots=True)
class Exchange:
    """What the capture needs beyond the record: the request as the client sent it."""

    body: bytes
    request_headers: list[tuple[bytes, bytes]]
    response_headers: list[tuple[bytes, bytes]] = field(default_factory=list)


def redact_headers(headers: Iterable[tuple[bytes, bytes]], names: frozenset[str]) -> list[list[str]]:
    out = []
    for k, v in headers:
        key = k.decode("latin-1")
        out.append([key, REDACTED if key.lower() in names else v.decode("latin-1")])
    return out


def _strip_prompts(obj: Any) -> Any:
    """Message texts replaced by their lengths (privacy mode)."""
    obj = dict(obj)
    msgs = obj.get("messages")
    if isinstance(msgs, list):
        new = []
        for m in msgs:
            if isinstance(m, dict):
                m = dict(m)
                c = m.pop("content", None)
                if isinstance(c, str):
                    m["content_chars"] = len(c)
                elif isinstance(c, list):
                    m["content_chars"] = sum(len(p.get("text", "")) for p in c if isinstance(p, dict))
            new.append(m)
        obj["messages"] = new
    if isinstance(obj.get("prompt"), str):
        obj["prompt_chars"] = len(obj.pop("prompt"))
    # Anthropic Messages `system`; OpenAI Responses `instructions` and `input`
    for key in ("system", "instructions"):
        if key in obj and obj[key] is not None:
            obj[f"{key}_chars"] = _text_chars(obj.pop(key))
    inp = obj.get("input")
    if isinstance(inp, str):
        obj["input_chars"] = len(obj.pop("input"))
    elif isinstance(inp, list):
        items = []
        for it in inp:
            if isinstance(it, dict):
                it = dict(it)
                n = sum(
                    _text_chars(it.pop(k)) for k in ("content", "output", "arguments", "text", "summary") if k in it
                )
                it["content_chars"] = n
            items.append(it)
        obj["input"] = items
    return obj


def _text_chars(v: Any) -> int:
    """Characters of text in a string, or in a list of parts with `text`."""
    if isinstance(v, str):
        return len(v)
    if isinstance(v, list):
        return sum(len(p["text"]) if isinstance(p, dict) and isinstance(p.get("text"), str) else 0 for p in v)
    return 0


class CaptureWriter:
    """A record observer that appends to a capture file from a background thread."""

    name = "capture"

    def __init__(
        self,
        path: str | Path,
        *,
        keep_responses: bool = False,
        keep_prompts: bool = True,
        redact: Iterable[str] = (),
        queue_size: int = 10000,
        queue_bytes: int = 64 * 1024 * 1024,
        t0_mono: float | None = None,
        on_drop: Callable[[], None] | None = None,
        on_error: Callable[[], None] | None = None,
    ) -> None:
        """Raises `ConfigError` when `path` is a symlink, not a regular file, or an existing
        file that is not a capture: the proxy never appends to (or cuts) a file it did not
        write. Any other problem opening it (a path under a file, no permission, a full
        disk) is logged once and retried."""
        self.path = Path(path)
        self.keep_responses = keep_responses
        self.keep_prompts = keep_prompts
        self.redact = DEFAULT_REDACT | {h.lower() for h in redact}
        self.t0_mono = time.perf_counter() if t0_mono is None else t0_mono
        self.dropped = 0
        self.written = 0
        self.write_errors = 0
        self._on_drop = on_drop
        self._on_error = on_error
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=queue_size)
        self.queue_bytes = queue_bytes
        self.queued_bytes = 0  # estimated memory held by queued records
        self._bytes_lock = threading.Lock()
        self._reported = False
        self._file: Any = None
        try:
            self._file = self._open()
        except OSError as exc:  # reported now; the writer thread keeps trying
            self._report(exc)
        self._thread = threading.Thread(target=self._run, name="mlxproxy-capture", daemon=True)
        self._thread.start()

    def on_record(self, record: Record) -> None:
        self.on_exchange(record, None)

    def on_exchange(self, record: Record, exchange: Exchange | None) -> None:
        size = _held_bytes(record, exchange)
        with self._bytes_lock:
            # one record larger than the whole budget still goes through an empty queue
            fits = not self.queued_bytes or self.queued_bytes + size <= self.queue_bytes
            if fits:
                self.queued_bytes += size
        if fits:
            try:
                self._queue.put_nowait((record, exchange, size))
                return
            except queue.Full:
                with self._bytes_lock:
                    self.queued_bytes -= size
        self.dropped += 1
        if self._on_drop is not None:
            self._on_drop()

    def line_for(self, record: Record, exchange: Exchange | None) -> bytes:
        d = record.to_dict(timeline=True)
        if not self.keep_responses:
            d.pop("response_text", None)
            d.pop("reasoning_text", None)
        d["v"] = CAPTURE_VERSION
        d["offset_s"] = round(record.t_start_mono - self.t0_mono, 6)
        if exchange is not None:
            body = exchange.body
            obj: Any = None
            if body[:1] in (b"{", b"[", b" ", b"\n"):
                try:
                    obj = orjson.loads(body)
                except orjson.JSONDecodeError:
                    obj = None
            if isinstance(obj, dict):
                d["request"] = obj if self.keep_prompts else _strip_prompts(obj)
            elif body:
                d["request_b64"] = base64.b64encode(body).decode() if self.keep_prompts else None
                d["request_bytes"] = len(body)
            d["request_headers"] = redact_headers(exchange.request_headers, self.redact)
            d["response_headers"] = redact_headers(exchange.response_headers, self.redact)
        return orjson.dumps(d) + b"\n"

    def _open(self) -> Any:
        """Open the file for appending, first cutting off a torn last line (a crash while
        it was written), so that every line after it stays readable."""
        for parent in self.path.parents:
            if parent.exists() or parent.is_symlink():
                if not parent.is_dir():  # an unwritable path: reported and retried, as documented
                    raise NotADirectoryError(errno.ENOTDIR, f"{str(parent)!r} is a file, not a directory")
                break
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # owner-only when created: a capture holds prompts, which may hold secrets; read
        # access to find a torn end; never through a symlink
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600)
        except OSError as exc:
            if exc.errno == errno.ELOOP or self.path.is_symlink():
                raise ConfigError(f"capture path {str(self.path)!r} is a symlink; give the file itself") from None
            if exc.errno == errno.EISDIR:
                raise ConfigError(f"capture path {str(self.path)!r} is not a regular file (a directory)") from None
            raise
        f = open(fd, "a+b", buffering=0)  # closed by close()
        try:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise ConfigError(f"capture path {str(self.path)!r} is not a regular file")
            os.set_blocking(f.fileno(), True)
            size = st.st_size
            if size and not _looks_like_capture(f.fileno(), size):
                raise ConfigError(
                    f"capture path {str(self.path)!r} holds a file that is not an mlxproxy capture; "
                    "refusing to append to it (choose a new file)"
                )
            if st.st_mode & 0o077:
                try:
                    os.fchmod(f.fileno(), 0o600)
                    log.warning(
                        "capture %s was readable by others (mode %o): now 0600, as it holds prompts",
                        self.path,
                        stat.S_IMODE(st.st_mode),
                    )
                except OSError:
                    log.warning(
                        "capture %s is readable by others (mode %o) and could not be set to 0600; it holds prompts",
                        self.path,
                        stat.S_IMODE(st.st_mode),
                    )
            keep = _end_of_last_line(f.fileno(), size)
            if keep < size:
                os.ftruncate(f.fileno(), keep)
                log.warning(
                    "capture %s ended with a torn line (%d bytes, a crash while writing it): cut off",
                    self.path,
                    size - keep,
                )
        except BaseException:
            f.close()
            raise
        return f

    def _report(self, exc: BaseException) -> None:
        if not self._reported:
            self._reported = True
            log.error(
                "capture to %s failed (%s); further failures are only counted (mlxproxy_capture_errors_total)",
                self.path,
                exc,
            )

    def _write_line(self, line: bytes) -> None:
        """Append `line` whole or not at all: a short write is continued, and after an
        error (disk full) the part already written is cut off again."""
        if self._file is None:
            self._file = self._open()
        fd = self._file.fileno()
        start = os.fstat(fd).st_size
        view = memoryview(line)
        try:
            while view:
                n = self._file.write(view)  # unbuffered: at the OS at once
                if not n:
                    raise OSError(errno.EIO, "the capture file accepted no bytes")
                view = view[n:]
        except BaseException:
            try:
                os.ftruncate(fd, start)
            except OSError:
                pass
            raise

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                self._queue.task_done()
                return
            record, exchange, size = item
            try:
                self._write_line(self.line_for(record, exchange))
                self.written += 1
            except Exception as exc:  # disk full, read-only path, ...: never block or kill streams
                self.write_errors += 1
                if self._on_error is not None:
                    self._on_error()
                self._report(exc)
            finally:
                del record, exchange, item
                with self._bytes_lock:
                    self.queued_bytes -= size
                self._queue.task_done()

    def flush(self) -> None:
        """Block until every record queued so far is written (or failed)."""
        if self._thread.is_alive():
            self._queue.join()

    def close(self, timeout_s: float = 10.0) -> None:
        """Write what is queued, then close the file. Safe to call twice."""
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join(timeout_s)
        if self._file is not None:
            self._file.close()


def _held_bytes(record: Record, exchange: Exchange | None) -> int:
    """A rough upper estimate of the memory a queued record holds."""
    n = 1024 + 40 * len(record.event_offsets_s) + len(record.response_text or "") + len(record.reasoning_text or "")
    if exchange is not None:
        n += len(exchange.body) + sum(len(k) + len(v) + 64 for k, v in exchange.request_headers)
        n += sum(len(k) + len(v) + 64 for k, v in exchange.response_headers)
    return n


def _looks_like_capture(fd: int, size: int) -> bool:
    """Does an existing file hold capture lines? Its first line must be a JSON object with
    a format version `v`; a first line not whole within 1 MiB (a crash during the first
    write, or a long prompt) must at least start like one."""
    head = os.pread(fd, min(size, 1 << 20), 0)
    end = head.find(b"\n")
    if end < 0:  # one torn line, or a first line longer than what was read
        return head.startswith(b'{"id":')
    try:
        first = orjson.loads(head[:end])
    except orjson.JSONDecodeError:
        return False
    return isinstance(first, dict) and isinstance(first.get("v"), int)


def _end_of_last_line(fd: int, size: int, block: int = 1 << 16) -> int:
    """The offset just past the last newline of the file (0 when it has none)."""
    pos = size
    while pos > 0:
        start = max(0, pos - block)
        data = os.pread(fd, pos - start, start)
        i = data.rfind(b"\n")
        if i >= 0:
            return start + i + 1
        pos = start
    return 0


# -- reading ----------------------------------------------------------------------------

# Migrations from older line formats: MIGRATIONS[n] turns a version-n line into version n+1.
MIGRATIONS: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {}


@dataclass(frozen=True)
class CapturedRequest:
    """One line of a capture file."""

    record: Record
    method: str
    path: str
    offset_s: float
    request: dict[str, Any] | None
    request_bytes: bytes | None  # the body when it was not JSON
    raw: dict[str, Any]

    def body(self) -> bytes:
        if self.request is not None:
            return orjson.dumps(self.request)
        return self.request_bytes or b""


def _migrate(d: dict[str, Any], where: str) -> dict[str, Any]:
    v = d.get("v")
    if not isinstance(v, int) or isinstance(v, bool):
        raise CaptureFormatError(f"{where}: no capture format version ('v'); is this an mlxproxy capture file?")
    if v > CAPTURE_VERSION:
        raise CaptureFormatError(
            f"{where}: capture format version {v} is newer than this mlxproxy ({__version__}) "
            f"reads (up to {CAPTURE_VERSION}); upgrade mlxproxy"
        )
    while v < CAPTURE_VERSION:
        step = MIGRATIONS.get(v)
        if step is None:
            raise CaptureFormatError(f"{where}: capture format version {v} is not supported (no migration to {v + 1})")
        d = step(d)
        v += 1
        d["v"] = v
    return d


def iter_capture(
    path: str | Path,
    warn: Callable[[str], None] | None = None,
    *,
    skip_bad: bool = False,
    skipped: list[str] | None = None,
) -> Iterator[CapturedRequest]:
    """The requests of a capture file, oldest first. A torn last line (a crash while it
    was written) is skipped with a warning; any other bad line is a `CaptureFormatError`,
    unless `skip_bad`: then it is skipped and its reason appended to `skipped`."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise CaptureFormatError(f"cannot read capture file {str(p)!r}: {exc.strerror or exc}") from exc
    lines = data.split(b"\n")
    last = len(lines) - 1
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        where = f"{p}:{i + 1}"
        try:
            d = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            if i == last:  # no newline after it: the writer was stopped mid-line
                (warn or log.warning)(f"{where}: skipped a torn last line ({len(line)} bytes)")
                continue
            bad: CaptureFormatError | None = CaptureFormatError(f"{where}: not a JSON line ({exc})")
        else:
            bad = None
        try:
            if bad is not None:
                raise bad
            yield _captured(d, where)
        except CaptureFormatError as exc:
            if not skip_bad:
                raise
            if skipped is not None:
                skipped.append(str(exc))


def _captured(d: Any, where: str) -> CapturedRequest:
    if not isinstance(d, dict):
        raise CaptureFormatError(f"{where}: a capture line must be a JSON object")
    d = _migrate(d, where)
    req = d.get("request")
    b64 = d.get("request_b64")
    try:
        record = Record.from_dict(d)
    except TypeError as exc:
        raise CaptureFormatError(f"{where}: missing record fields ({exc})") from exc
    return CapturedRequest(
        record=record,
        method=str(d.get("method", "POST")),
        path=str(d.get("path", "")),
        offset_s=float(d.get("offset_s", 0.0)),
        request=req if isinstance(req, dict) else None,
        request_bytes=base64.b64decode(b64) if isinstance(b64, str) else None,
        raw=d,
    )


def read_capture(
    path: str | Path,
    warn: Callable[[str], None] | None = None,
    *,
    skip_bad: bool = False,
    skipped: list[str] | None = None,
) -> list[CapturedRequest]:
    return list(iter_capture(path, warn, skip_bad=skip_bad, skipped=skipped))
