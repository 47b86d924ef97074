"""The proxy's capture writer: an observer that appends each finished request to a capture
file (the format: `mlxproxy/capture.py`) from a background thread, off the hot path.

Durability: records go through a bounded queue to a writer thread that writes each line
with one unbuffered write (at the OS once written, so a `kill -9` loses only what is still
queued); a full queue drops the record and counts it (never slows a stream). A file that
cannot be opened or written (disk full, read-only path) is logged once, every record it
loses is counted, and the writer keeps trying, so it recovers when space comes back; a
partially written line is cut off again, so the file only ever holds whole lines. A torn
last line left by a crash is cut off when the file is opened for appending.
"""

from __future__ import annotations

import errno
import logging
import os
import queue
import stat
import threading
import time
from collections.abc import Callable, Iterable
from io import FileIO
from pathlib import Path

from mlxproxy.capture import DEFAULT_REDACT, Exchange, capture_line, end_of_last_line, looks_like_capture
from mlxproxy.core.record import Record
from mlxproxy.errors import ConfigError

__all__ = ["CaptureWriter"]

log = logging.getLogger("mlxproxy")

_STOP = None  # queued by `close`: the writer thread ends


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
        self._queue: queue.Queue[tuple[Record, Exchange | None, int] | None] = queue.Queue(maxsize=queue_size)
        self.queue_bytes = queue_bytes
        self.queued_bytes = 0  # estimated memory held by queued records
        self._bytes_lock = threading.Lock()
        self._reported = False
        self._file: FileIO | None = None
        try:
            self._file = self._open()
        except OSError as exc:  # reported now; the writer thread keeps trying
            self._report(exc)
        self._thread = threading.Thread(target=self._run, name="mlxproxy-capture", daemon=True)
        self._thread.start()

    def on_record(self, record: Record, exchange: Exchange | None = None) -> None:
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
        return capture_line(
            record,
            exchange,
            t0_mono=self.t0_mono,
            keep_responses=self.keep_responses,
            keep_prompts=self.keep_prompts,
            redact=self.redact,
        )

    def _open(self) -> FileIO:
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
            if size and not looks_like_capture(f.fileno(), size):
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
            keep = end_of_last_line(f.fileno(), size)
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
