"""The capture file: JSON Lines, one finished request a line, written off the hot path.

Line format (version `CAPTURE_VERSION`): the record's keys (see `Record.to_dict`) plus
`v`, `method`, `path`, `request` (the request body as JSON) or `request_b64` (when it is
not JSON), `request_headers` / `response_headers` (secrets redacted), `offset_s` (from
the start of the capture) and `event_offsets_ms` (each generated event from t_start).
`response_text`/`reasoning_text` only with `capture_responses`. With `capture_prompts:
false` message texts are replaced by their lengths (`{"content_chars": N}`).

The proxy writes it with `mlxproxy.proxy.capture_writer.CaptureWriter` (a background thread,
never slowing a stream; whole lines only); replay reads it here (`read_capture`, `iter_capture`),
skipping a torn last line with a warning, and migrates older line versions (`MIGRATIONS`).
"""

from __future__ import annotations

import base64
import logging
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from mlxproxy import __version__
from mlxproxy.core.record import Record
from mlxproxy.errors import CaptureFormatError
from mlxproxy.headers import DEFAULT_REDACT, REDACTED

__all__ = [
    "CAPTURE_VERSION",
    "DEFAULT_REDACT",
    "Exchange",
    "capture_line",
    "looks_like_capture",
    "end_of_last_line",
    "iter_capture",
    "CapturedRequest",
    "read_capture",
    "redact_headers",
    "MIGRATIONS",
]

log = logging.getLogger("mlxproxy")

CAPTURE_VERSION = 1


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


def capture_line(
    record: Record,
    exchange: Exchange | None,
    *,
    t0_mono: float,
    keep_responses: bool = False,
    keep_prompts: bool = True,
    redact: frozenset[str] = DEFAULT_REDACT,
) -> bytes:
    """One capture line (with its newline): `record`, and `exchange` (the request) when given;
    `offset_s` counts from `t0_mono`, the start of the capture."""
    d = record.to_dict(timeline=True)
    if not keep_responses:
        d.pop("response_text", None)
        d.pop("reasoning_text", None)
    d["v"] = CAPTURE_VERSION
    d["offset_s"] = round(record.t_start_mono - t0_mono, 6)
    if exchange is not None:
        body = exchange.body
        obj: Any = None
        if body[:1] in (b"{", b"[", b" ", b"\n"):
            try:
                obj = orjson.loads(body)
            except orjson.JSONDecodeError:
                obj = None
        if isinstance(obj, dict):
            d["request"] = obj if keep_prompts else _strip_prompts(obj)
        elif body:
            d["request_b64"] = base64.b64encode(body).decode() if keep_prompts else None
            d["request_bytes"] = len(body)
        d["request_headers"] = redact_headers(exchange.request_headers, redact)
        d["response_headers"] = redact_headers(exchange.response_headers, redact)
    return orjson.dumps(d) + b"\n"


def looks_like_capture(fd: int, size: int) -> bool:
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


def end_of_last_line(fd: int, size: int, block: int = 1 << 16) -> int:
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


def chat_record(rid: str, *, started_at: float, upstream: str, model: str, duration_s: float | None = None) -> Record:
    """The record of a streaming chat completion that went well, for a capture built rather than recorded."""
    return Record(
        id=rid,
        started_at=started_at,
        upstream=upstream,
        model=model,
        endpoint="chat_completions",
        stream=True,
        status=200,
        outcome="ok",
        method="POST",
        path="/v1/chat/completions",
        duration_s=duration_s,
    )


def captured_chat(
    rid: str, request: dict[str, Any], *, upstream: str, started_at: float, offset_s: float, duration_s: float | None
) -> CapturedRequest:
    """A streaming chat completion that went well, as a capture file holds it (its model: the request's)."""
    rec = chat_record(rid, started_at=started_at, upstream=upstream, model=request["model"], duration_s=duration_s)
    return CapturedRequest(
        record=rec, method="POST", path=rec.path, offset_s=offset_s, request=request, request_bytes=None, raw={}
    )


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
