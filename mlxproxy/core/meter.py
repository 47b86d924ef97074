"""The per-request meter: bytes and timestamps in, one frozen `Measurement` out.

Sans-I/O: every method takes the time as an argument (seconds from one monotonic clock,
e.g. `time.perf_counter()` in the shells, scripted floats in tests). The proxy, replay,
bench and the tests all drive this class, so every figure means one thing everywhere
(definitions: docs/METRICS.md).

Lifecycle: `RequestMeter(...)` at t_start → `upstream_sent(t)` → `response_started(t,
status, content_type)` → `feed(data, t)` per body read (or, for a stream whose usage event
the proxy injected, `strip(data, stripper)` before forwarding the read and
`feed_forwarded(data, items, t)` after) → `finish(t_end)` → `Measurement`. `stop()` ends
the parsing early, `fail(exc)` when metering raised (a bug: the bytes are still counted).
Like h11's `Connection`, the state changes only through these methods and is read through a
few read-only properties; `snapshot(now)` is a request's figures so far (`/streams`, the
live page), `finish` the frozen measurement the checks (`core.detect.findings`) and the
record (`core.record.checked_record`) are made from.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import orjson

from mlxproxy.core.apis import ApiEvent
from mlxproxy.core.native import DIALECT_APIS, dialect_body, dialect_event, dialect_usage
from mlxproxy.core.ndjson import NDJSONDecoder
from mlxproxy.core.openai import (
    CLAIM_KEYS,
    GENERATION_ENDPOINTS,
    Endpoint,
    RequestInfo,
    classify_chunk,
    error_message,
    parse_context_limit,
    plain_delta,
    uncached_tokens,
)
from mlxproxy.core.record import MEASURED_FIELDS, Outcome
from mlxproxy.core.sse import SSEComment, SSEDecoder, SSEEvent, SSEItem, SSEProtocolError
from mlxproxy.core.strip import UsageStripper
from mlxproxy.core.tools import MAX_ARGUMENT_CHARS, MAX_TOOLS, ToolSpec, call_problem, find_markup

__all__ = ["RequestMeter", "Measurement", "Snapshot"]

_PROGRESS = re.compile(r"(\d{1,18})\s*/\s*(\d{1,18})")  # bounded: int() refuses huge digit runs
_STD_USAGE_KEYS = frozenset(
    {"prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details", "completion_tokens_details"}
)
# a chunk holding any of these is no plain content chunk (`_feed_payloads`): `_chunk` reads them
_NOT_PLAIN = frozenset(("usage", "error", *CLAIM_KEYS))
MAX_BUFFERED_BODY_BYTES = 16 * 1024 * 1024  # non-stream and error bodies are parsed up to this size

# a chat stream's plain chunks differ from one another in their text and, on some servers, in
# numbers (`created` each second, a timestamp per event): `_Template`, `_template`
_DIGITS_AS_ZERO = bytes.maketrans(b"123456789", b"000000000")
# the digit runs of an envelope (`_template`): a number's integer part (group 1) must not gain a
# leading zero and, no longer than 20 digits and with no exponent (group 2), it stays finite (a
# run inside a string only makes the test stricter)
_NUMBER = re.compile(rb"([0-9]+)(?:\.[0-9]+)?([eE][+-]?[0-9]+)?")
_KEY_END = re.compile(rb'"\s*:')
_PROBE = ("mlxproxy-probe", "mlxproxy-probe-2")


class _Template(NamedTuple):
    """A plain chunk's bytes around its one text string (`_template`): a payload that starts
    with `prefix` and ends with `suffix` (or does so with every digit read as 0, where the
    digits may vary, and no number gains a leading zero at `leads`) and holds one JSON string
    between them is the same chunk with another text."""

    prefix: bytes  # up to and including the string's opening quote
    suffix: bytes  # from the string's closing quote on
    masked_prefix: bytes | None  # the two with every digit 0 (None: the digits may not vary)
    masked_suffix: bytes | None
    start: int  # the string's offset in a payload (its opening quote)
    tail: int  # the string ends this far before a payload's end
    leads: tuple[int, ...]  # offsets (negative: from the end) of multi-digit integer parts' first digit
    reasoning: bool  # the text is the reasoning (`reasoning_content` or `reasoning`), else the content


def _template(payload: bytes, text: str, reasoning: bool) -> _Template | None:
    """The template of `payload`, a plain chunk whose one text is `text` (`plain_delta`),
    or None when its text string cannot be told apart for sure. The text's JSON string is found
    as orjson writes it (once in the payload, the envelope around it free of backslashes), and a
    probe proves it is the text: the payload with another string there must be the same plain
    chunk with that text. Then any JSON string there gives the same chunk with its text, since
    every other byte is the same; and so does any change of digits in the envelope that keeps
    each number a JSON number (no leading zero), where no object key holds a digit: a digit is
    no JSON syntax, a number's value is read by no rule of a plain chunk, and string values
    outside the text are not read either (`plain_delta`: `None` tests, types and key names)."""
    needle = orjson.dumps(text)
    i = payload.find(needle)
    if i < 0 and not text.isascii():  # (Python's json writes "\\u00e9" where orjson writes UTF-8)
        needle = json.dumps(text).encode()
        i = payload.find(needle)
    if i < 0 or payload.find(needle, i + 1) >= 0:
        return None
    j = i + len(needle)
    prefix, suffix = payload[: i + 1], payload[j - 1 :]
    if b"\\" in prefix or b"\\" in suffix:
        return None
    probe = _PROBE[text == _PROBE[0]]
    try:
        probed = orjson.loads(prefix + probe.encode() + suffix)
    except orjson.JSONDecodeError:
        return None
    if plain_delta(probed) != (("", probe) if reasoning else (probe, "")):
        return None
    leads: list[int] = []
    masked_prefix, masked_suffix = prefix.translate(_DIGITS_AS_ZERO), suffix.translate(_DIGITS_AS_ZERO)
    digits = masked_prefix != prefix or masked_suffix != suffix  # (none: the exact test is the test)
    for part, base in ((prefix[:-1], 0), (suffix[1:], 1 - len(suffix))):
        for m in _NUMBER.finditer(part) if digits else ():
            if len(m[1]) > 20 or m[2] is not None:
                digits = False
                break
            # a run in an object key, whose next quote (no escapes here) ends the key (conservative:
            # after a number, the next quote opens a string, which a colon seldom begins)
            q = part.find(b'"', m.end())
            if q >= 0 and _KEY_END.match(part, q):
                digits = False
                break
            if len(m[1]) > 1 and m[1][0] != 48:  # (one that begins with 0 is inside a string)
                leads.append(base + m.start(1))
    masked = digits
    return _Template(
        prefix,
        suffix,
        masked_prefix if masked else None,
        masked_suffix if masked else None,
        len(prefix) - 1,
        len(suffix) - 1,
        tuple(leads) if masked else (),
        reasoning,
    )


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


class Measurement(NamedTuple):
    """What a finished meter saw, frozen: the record's measured figures (its first fields,
    `core.record.MEASURED_FIELDS`, same names and meaning as `Record`'s), then the evidence
    the truth checks need and no record keeps (the generated text's size, the streamed
    content, the unusable tool calls, the silence after the headers). The checks and the
    trusted token count run on it (`core.detect.findings`, `verdict`), and the one `Record` is made of it
    (`core.record.checked_record`)."""

    id: str
    started_at: float
    upstream: str
    model: str | None
    endpoint: Endpoint
    stream: bool
    status: int | None
    outcome: Outcome
    method: str
    path: str
    ttfb_s: float | None
    ttft_s: float | None
    ttfc_s: float | None
    e2e_s: float | None
    headers_s: float | None
    duration_s: float | None
    tail_after_done_s: float | None
    prefill_tps: float | None
    prompt_tokens: int | None
    cached_tokens: int | None
    completion_tokens_reported: int | None
    reasoning_tokens_reported: int | None
    completion_tokens_counted: int | None
    reasoning_tokens_counted: int | None
    completion_tokens_tokenizer: int | None
    usage_reports: int
    usage_requested: bool
    usage_injected: bool
    max_tokens: int | None
    events: int
    generated_events: int
    comments: int
    finish_reason: str | None
    finish_reasons_seen: int
    tool_calls: int
    tool_calls_valid: int | None
    error: str | None
    context_prompt_tokens: int | None
    context_limit_tokens: int | None
    prefill_progress: tuple[int, int] | None
    server_claims: dict[str, Any]
    concurrency: int
    tags: tuple[str, ...]
    bytes_out: int
    event_offsets_s: tuple[float, ...]
    t_start_mono: float
    dual_reasoning_events: int
    duplicate_content: bool
    response_text: str | None
    reasoning_text: str | None
    # evidence for the checks (not record fields)
    generated_chars: int | None  # characters of generated text streamed (None: not a stream)
    nonascii_chars: int  # ... of them not ASCII
    nonascii_bytes: int  # ... and their UTF-8 bytes
    content_text: str  # the answer's content, as streamed or in the body
    tool_problems: tuple[str, ...]  # why each structured call is unusable
    tool_markup: str | None  # tool-call markup found in the content (tools offered, no structured call)
    silent_after_headers_s: float | None  # headers to the first body byte (or to the end); None: no headers
    # what the wire's figures and error text mean, read once here (`core.openai`) for the checks
    context_refused: bool  # the prompt was refused as too long (HTTP, or an error event saying so)
    uncached_prompt_tokens: int | None  # the prompt tokens the server prefilled (`openai.uncached_tokens`)
    whole_prompt_tokens: int | None  # every prompt token, cached or not (prompt_tokens may leave cached ones out)


if Measurement._fields[: len(MEASURED_FIELDS)] != MEASURED_FIELDS:  # pragma: no cover - caught at import
    raise ImportError(
        "Measurement's first fields must be core.record.MEASURED_FIELDS, in order: a new Record field is "
        "either measured (add it to Measurement) or decided by the checks (add it to record.CHECKED_FIELDS)"
    )


_new_measurement = tuple.__new__  # (a NamedTuple is a tuple: its fields, in order)


class Snapshot(NamedTuple):
    """A request in flight, as far as it got (`RequestMeter.snapshot`): seconds, no text."""

    id: str
    upstream: str
    model: str | None
    endpoint: Endpoint
    stream: bool
    status: int | None
    age_s: float
    ttft_s: float | None
    tokens_so_far: int
    tokens_per_s: float | None  # generated events per second from the first to the last so far
    idle_s: float  # since the last body byte (or the start)
    prefill_progress: tuple[int, int] | None
    concurrency: int


class RequestMeter:
    """Measures one request. Not thread-safe; one instance per request."""

    def __init__(
        self,
        request: RequestInfo,
        *,
        request_id: str,
        upstream: str,
        t_start: float,
        started_at: float,
        usage_injected: bool = False,
        concurrency: int = 1,
        tags: tuple[str, ...] = (),
        keep_text: bool = False,
        max_line_bytes: int | None = None,
    ) -> None:
        self._request = request
        self._request_id = request_id
        self._upstream = upstream
        self._t_start = t_start
        self._started_at = started_at
        self._usage_injected = usage_injected
        self._concurrency = concurrency
        self._tags = tags
        self._keep_text = keep_text
        self._max_line_bytes = max_line_bytes
        self._t_upstream_sent: float | None = None
        self._t_headers: float | None = None
        self._t_first_byte: float | None = None
        self._t_last_byte: float | None = None
        self._t_first_content: float | None = None
        self._t_done: float | None = None
        self._status: int | None = None
        self._sse = False
        self._decoder: SSEDecoder | NDJSONDecoder | None = None
        self._chat: SSEDecoder | None = None  # the decoder, when a chat stream's events can take the fast path
        self._payloads: list[bytes] | None = None  # what `strip` decoded for `feed_forwarded`, undecoded
        self._bytes_out = 0
        self._body = bytearray()
        self._body_overflow = False
        self._done = False  # [DONE] (or the API's terminal event) seen, or metering stopped
        self._failure: Exception | None = None  # what stopped the metering early (`fail`)
        self._events = 0
        self._reasoning_events = 0
        self._comments = 0
        # when each generated event arrived: their count is the generated events, the first is
        # the first token, the last the last one (one append per event, nothing else kept)
        self._event_times: list[float] = []
        self._finish_reason: str | None = None
        self._finish_reasons_seen = 0
        self._usage: dict[str, Any] | None = None
        self._usage_reports = 0
        self._stream_error: str | None = None
        self._protocol_error: str | None = None
        self._dual_reasoning_events = 0
        self._duplicate_content = False
        self._prefill_progress: tuple[int, int] | None = None
        self._claims: dict[str, Any] = {}
        self._content_parts: list[str] = []  # (in a stream: one per content event)
        self._content_chars = 0
        self._reasoning_parts: list[str] = []
        self._tool_calls: dict[int, dict[str, str]] = {}
        self._tool_args_over: dict[int, int] = {}
        # Anthropic Messages, OpenAI Responses, Ollama and LM Studio's native APIs: their events
        # follow a dialect (core.apis, core.native), not the chat rules
        self._api = request.endpoint if request.endpoint in DIALECT_APIS else None
        self._api_raw_usage: dict[str, Any] = {}
        self._api_final_usage = False  # characters of arguments past MAX_ARGUMENT_CHARS, per call
        # a chat stream's plain chunks, matched without parsing them (`_template`): the last
        # template learned, and how often one was learned and used (learning stops where none is used)
        self._template: _Template | None = None
        self._templates_learned = 0
        self._template_hits = 0

    # -- the read-only surface ---------------------------------------------------------

    @property
    def request(self) -> RequestInfo:
        return self._request

    @property
    def request_id(self) -> str:
        return self._request_id

    @property
    def upstream(self) -> str:
        return self._upstream

    @property
    def t_start(self) -> float:
        return self._t_start

    @property
    def started_at(self) -> float:
        return self._started_at

    @property
    def sse(self) -> bool:
        """The response is an event stream (known once `response_started`)."""
        return self._sse

    @property
    def done(self) -> bool:
        """True once the stream's end event arrived or metering was stopped: nothing more is parsed."""
        return self._done

    @property
    def stream_error(self) -> str | None:
        """The first error event the stream carried, if any."""
        return self._stream_error

    @property
    def failure(self) -> Exception | None:
        """What stopped the metering early (`fail`), if anything."""
        return self._failure

    @property
    def generated_events(self) -> int:
        """Generated events (tokens, on per-token servers) so far."""
        return len(self._event_times)

    def snapshot(self, now: float) -> Snapshot:
        """The request's figures so far, at `now` (a request in flight: `/streams`, the live page)."""
        times = self._event_times
        tokens = len(times)
        first = times[0] if times else None
        tps = None
        if tokens >= 2 and times[-1] > times[0]:
            tps = (tokens - 1) / (times[-1] - times[0])
        t0 = self._t_start
        request = self._request
        return Snapshot(
            id=self._request_id,
            upstream=self._upstream,
            model=request.model,
            endpoint=request.endpoint,
            stream=request.stream,
            status=self._status,
            age_s=now - t0,
            ttft_s=None if first is None else first - t0,
            tokens_so_far=tokens,
            tokens_per_s=tps,
            idle_s=now - (self._t_last_byte if self._t_last_byte is not None else t0),
            prefill_progress=self._prefill_progress,
            concurrency=self._concurrency,
        )

    # -- inputs ----------------------------------------------------------------------

    def stop(self) -> None:
        """Parse nothing more (body bytes are still counted); the record is built from what was seen."""
        self._done = True

    def fail(self, exc: Exception) -> None:
        """The meter raised `exc` (a bug): stop metering and keep why (`failure`)."""
        if self._failure is None:
            self._failure = exc
        self._done = True

    def upstream_sent(self, t: float) -> None:
        self._t_upstream_sent = t

    def response_started(self, t: float, status: int, content_type: str | None) -> None:
        """Status line and headers arrived. A `text/event-stream` body is parsed as SSE, an
        `application/x-ndjson` one of a dialect API (Ollama's) as JSON lines (`core.ndjson`)."""
        self._t_headers = t
        self._status = status
        ct = content_type.lower() if content_type and status < 400 else ""
        if ct.startswith("text/event-stream"):
            self._sse = True
            self._decoder = SSEDecoder(self._max_line_bytes) if self._max_line_bytes else SSEDecoder()
            if self._api is None:
                self._chat = self._decoder
        elif ct.startswith(("application/x-ndjson", "application/jsonl")) and self._api is not None:
            self._sse = True  # a stream: one JSON line per item (Ollama), decoded to the same items
            self._decoder = NDJSONDecoder(self._max_line_bytes) if self._max_line_bytes else NDJSONDecoder()

    def feed(self, data: bytes, t: float) -> None:
        """A body read of `data` arrived at `t` (stamped on arrival, before any parsing)."""
        if not data:
            return
        chat = self._chat
        if chat is not None and not self._done:
            try:
                payloads = chat.data_payloads(data)
            except Exception:  # (a decoder bug) the read still arrived: count it, then say so
                self._feed_decoded(len(data), (), t)
                raise
            if payloads is not None:
                self._feed_payloads(payloads, len(data), t)
                return
        decoder = self._decoder
        if decoder is not None:
            try:
                items = () if self._done else decoder.feed(data)
            except Exception:  # (a decoder bug) the read still arrived: count it, then say so
                self._feed_decoded(len(data), (), t)
                raise
            self._feed_decoded(len(data), items, t)
            return
        self._feed_decoded(len(data), (), t)
        if not self._body_overflow:
            if len(self._body) + len(data) > MAX_BUFFERED_BODY_BYTES:
                self._body_overflow = True
                self._body.clear()
            else:
                self._body += data

    def strip(self, data: bytes, stripper: UsageStripper) -> tuple[bytes, Sequence[SSEItem] | None]:
        """For a stream whose usage event the caller injected, before it forwards a read: decode it of `data` (SSE framing only, no
        JSON) and return the bytes to forward now, without the injected usage event, and the
        decoded items for `feed_forwarded` (None: it meters `data` itself, undecoded, or a read
        of whole data events none of which is the usage event, whose data this meter keeps
        for the `feed_forwarded` that follows: `SSEDecoder.data_payloads`). Never raises: a decoding failure is kept (`fail`) and the held bytes and the rest pass
        unchanged."""
        chat = self._chat
        decoder = self._decoder
        if self._done or decoder is None:
            return stripper.flush() + data, None
        try:
            if chat is not None and (payloads := stripper.pass_whole(data, chat)) is not None:
                self._payloads = payloads  # whole events, none the usage event: their JSON after forwarding
                return data, None
            items = decoder.feed(data)
            return stripper.process(data, items, decoder.safe_offset), items
        except Exception as exc:  # forward what is held and the rest unmetered
            self.fail(exc)
            return stripper.flush() + data, ()

    def feed_forwarded(self, data: bytes, items: Sequence[SSEItem] | None, t: float) -> bool:
        """Meter a read of `data` that arrived at `t` and has been forwarded: `items` are what
        `strip` decoded of it, or None to decode it here (`feed`). Never raises: a metering
        failure is kept (`fail`). Returns whether the metering has failed (here or in `strip`)."""
        try:
            if items is None:
                payloads = self._payloads
                if payloads is None:
                    self.feed(data, t)
                else:
                    self._payloads = None
                    self._feed_payloads(payloads, len(data), t)
            else:
                self._feed_decoded(len(data), items, t)
        except Exception as exc:
            self.fail(exc)
        return self._failure is not None

    def _feed_decoded(self, nbytes: int, items: Sequence[SSEItem], t: float) -> None:
        """`feed` of `nbytes` whose SSE items this meter's decoder already gave (`items`)."""
        if nbytes:
            if self._t_first_byte is None:
                self._t_first_byte = t
            self._t_last_byte = t
            self._bytes_out += nbytes
        if items and not self._done:
            self._feed_items(items, t)

    def _feed_items(self, items: Sequence[SSEItem], t: float) -> None:
        for item in items:
            if self._done:
                return
            if isinstance(item, SSEEvent):
                self._event(item.data, t)
            elif isinstance(item, SSEComment):
                self._comments += 1
                m = _PROGRESS.search(item.text)
                if m:
                    self._prefill_progress = (int(m.group(1)), int(m.group(2)))
            elif isinstance(item, SSEProtocolError):
                self._protocol_error = self._protocol_error or item.reason

    def _feed_payloads(self, payloads: list[bytes], nbytes: int, t: float) -> None:
        """A read of `nbytes` holding a chat stream's events, their data undecoded
        (`SSEDecoder.data_payloads`): what `_feed_decoded` and `_event` do with them, the plain
        content chunk (nearly every event) inline, and where it matches the last plain chunk's
        template (`_template`) from its text string alone, unparsed. A payload that is not valid
        UTF-8 and JSON, `[DONE]` among them, goes to `_event` decoded, as the general path gives
        it (`orjson.loads` of valid UTF-8 bytes and of their text agree)."""
        if self._t_first_byte is None:
            self._t_first_byte = t
        self._t_last_byte = t
        self._bytes_out += nbytes
        loads = orjson.loads
        times = self._event_times
        parts = self._content_parts
        tpl = self._template
        for p in payloads:
            text = None
            if tpl is not None:
                prefix, suffix, masked_prefix, masked_suffix, start, tail, leads, reasoning = tpl
                if (p.startswith(prefix) and p.endswith(suffix)) or (
                    masked_prefix is not None
                    and (masked := p.translate(_DIGITS_AS_ZERO)).startswith(masked_prefix)
                    and masked.endswith(masked_suffix)  # type: ignore[arg-type]
                ):
                    for k in leads:
                        if p[k] == 48:  # a leading zero ("0"): no JSON number
                            break
                    else:
                        # the last plain chunk with another text (`_template`): parse only its string
                        try:
                            text = loads(p[start : len(p) - tail])
                        except orjson.JSONDecodeError:  # (not one JSON string there: the general rules)
                            pass
                if text:
                    self._template_hits += 1
                    if reasoning:  # what `_chunk` does with ("", text)
                        self._events += 1
                        times.append(t)
                        self._reasoning_events += 1
                        self._reasoning_parts.append(text)
                        continue
            if not text:
                try:
                    obj = loads(p)
                except orjson.JSONDecodeError:
                    self._event(p.decode("utf-8", "replace"), t)
                    if self._done:
                        return
                    continue
                # the plain content chunk, `{"choices": [{"delta": {"content": "..."}}]}` with no
                # finish reason, usage, error or claims (absent or null), tested by lookups that
                # raise on any other shape (cheaper than type tests): `_chunk` would do exactly
                # this with it (a `text` beside non-empty content changes nothing there)
                try:
                    (ch,) = obj["choices"]
                    delta = ch["delta"]
                    text = delta["content"]
                except (KeyError, TypeError, ValueError):
                    text = None
                if not (
                    type(text) is str
                    and text
                    and len(delta) == 1
                    and ch.get("finish_reason") is None
                    and obj.keys().isdisjoint(_NOT_PLAIN)
                ):
                    self._events += 1
                    self._chunk(obj, t, p)
                    tpl = self._template
                    continue
                if self._templates_learned <= 2 + (self._template_hits >> 4):
                    tpl = self._learn(p, text, False)
            # a plain content chunk's text (of the template, or parsed)
            self._events += 1
            if len(parts) >= 2 and len(text) == self._content_chars and text == "".join(parts):
                self._duplicate_content = True  # a terminal chunk replaying the whole answer
                continue
            times.append(t)
            if self._t_first_content is None:
                self._t_first_content = t
            parts.append(text)
            self._content_chars += len(text)

    def _event(self, data: str, t: float) -> None:
        self._events += 1
        if data.startswith("[DONE]"):
            self._done = True
            self._t_done = t
            return
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            self._protocol_error = self._protocol_error or "invalid JSON in a data: line"
            return
        self._chunk(obj, t)

    def _learn(self, payload: bytes, text: str, reasoning: bool) -> _Template | None:
        """Learn the template of a plain chunk (`_template`) for the ones that follow, in place
        of the last one (kept when this chunk gives none). Learning stops where templates are
        learned and not used: at most 3, and one more per 16 events that used one."""
        self._templates_learned += 1
        tpl = _template(payload, text, reasoning)
        if tpl is not None:
            self._template = tpl
        return self._template

    def _chunk(self, obj: Any, t: float, payload: bytes | None = None) -> None:
        """One event's parsed JSON (counted by the caller); `payload`: its bytes, where a plain
        chunk may teach the template (`_feed_payloads`)."""
        tool_calls: Sequence[dict[str, Any]] = ()
        has_tool: object  # truthy when the event carries (part of) a tool call
        if self._api is not None:
            ev = dialect_event(self._api, obj)
            self._api_event(ev, t)
            if not ev.generated:
                return
            content, reasoning, has_tool = ev.content, ev.reasoning, ev.tool_args or ev.calls
        else:
            plain = plain_delta(obj)
            if plain is not None:  # the common chunk: classify_chunk would say Delta(content, reasoning), nothing else
                content, reasoning = plain
                if payload is not None and self._templates_learned <= 2 + (self._template_hits >> 4):
                    self._learn(payload, content or reasoning, not content)
            else:
                d = classify_chunk(obj)  # (repeats the plain_delta test: only on the few other chunks)
                if d.error is not None:
                    self._stream_error = self._stream_error or d.error
                if d.usage is not None:
                    self._usage = d.usage
                    self._usage_reports += 1
                if d.claims:
                    self._claims.update(d.claims)
                if d.finish_reasons:
                    self._finish_reasons_seen += len(d.finish_reasons)
                    if self._finish_reason is None:
                        self._finish_reason = d.finish_reasons[0]
                if d.dual_reasoning:
                    self._dual_reasoning_events += 1
                if not d.generated:
                    return
                content = d.content or d.text
                reasoning = d.reasoning
                tool_calls = d.tool_calls
            if (
                content
                and len(self._content_parts) >= 2
                and len(content) == self._content_chars
                and content == "".join(self._content_parts)
            ):  # joined only when the lengths agree: linear overall
                self._duplicate_content = True  # a terminal chunk replaying the whole answer
                return
            has_tool = tool_calls
        # one generated event (a token on per-token servers), of any API; kept inline: this
        # runs for every event of every stream
        self._event_times.append(t)
        if self._t_first_content is None and (content or has_tool):
            self._t_first_content = t
        if content:
            self._content_parts.append(content)
            self._content_chars += len(content)
        if reasoning:
            self._reasoning_events += 1
            self._reasoning_parts.append(reasoning)
        for tc in tool_calls:
            self._tool_call(tc)

    def _api_event(self, ev: ApiEvent, t: float | None) -> None:
        """An event of a dialect API (`core.native.DIALECT_APIS`; `t` None: part of a non-streamed body)."""
        if ev.error is not None:
            self._stream_error = self._stream_error or ev.error
        if ev.usage is not None and self._api is not None:
            if ev.usage_final:
                self._usage_reports += 1
            if self._api == "messages":  # its usage comes in parts (message_start, message_delta)
                self._api_raw_usage.update(ev.usage)
            else:
                self._api_raw_usage = ev.usage
            self._api_final_usage = self._api_final_usage or ev.usage_final
            self._usage = dialect_usage(self._api, self._api_raw_usage, self._api_final_usage)
        if ev.claims:
            self._claims.update(ev.claims)
        for call in ev.calls:  # whole calls (the native APIs)
            self._call_part(*call)
        if ev.finish is not None:
            self._finish_reasons_seen += 1
            if self._finish_reason is None:
                self._finish_reason = ev.finish
        idx = ev.tool_index if ev.tool_index is not None else 0
        if ev.tool_name is not None or ev.tool_id is not None:
            self._call_part(idx, ev.tool_id, ev.tool_name, None)
        if ev.generated:
            if t is None:  # (a streamed event's text and times are kept by `_event`)
                if ev.content:
                    self._content_parts.append(ev.content)
                if ev.reasoning:
                    self._reasoning_parts.append(ev.reasoning)
            if ev.tool_args:
                self._call_part(idx, None, None, ev.tool_args)
        if ev.tool_final_args is not None:
            slot = self._tool_calls.get(idx)
            if slot is None or (not slot["arguments"] and idx not in self._tool_args_over):
                self._call_part(idx, None, None, ev.tool_final_args)  # sent whole, never streamed
        if ev.terminal and t is not None:
            self._done = True
            self._t_done = t

    def _tool_call(self, tc: dict[str, Any]) -> None:
        idx = _int(tc.get("index"))
        idx = 0 if idx is None else idx
        fn = tc.get("function")
        if isinstance(fn, dict):
            self._call_part(idx, tc.get("id"), fn.get("name"), fn.get("arguments"))
        else:
            self._call_part(idx, tc.get("id"), None, None)

    def _call_part(self, idx: int, call_id: Any, name: Any, arguments: Any) -> None:
        """A structured call (or a piece of one) at position `idx`: arguments accumulate,
        kept up to MAX_ARGUMENT_CHARS per call (the rest only counted)."""
        slot = self._tool_calls.get(idx)
        if slot is None:
            if len(self._tool_calls) >= 4 * MAX_TOOLS:
                return
            slot = self._tool_calls[idx] = {"id": "", "name": "", "arguments": ""}
        if isinstance(call_id, str):
            slot["id"] = call_id[:256]
        if isinstance(name, str) and name:
            slot["name"] = name[:256]
        if isinstance(arguments, str) and arguments:
            room = MAX_ARGUMENT_CHARS - len(slot["arguments"])
            if len(arguments) <= room:
                slot["arguments"] += arguments
            else:
                slot["arguments"] += arguments[: max(room, 0)]
                self._tool_args_over[idx] = self._tool_args_over.get(idx, 0) + len(arguments) - max(room, 0)

    # -- the measurement ---------------------------------------------------------------

    def finish(
        self,
        t_end: float,
        *,
        outcome: Outcome | None = None,
        error: str | None = None,
        count_tokens: Callable[[str], int] | None = None,
    ) -> Measurement:
        """Close the body and measure: the frozen `Measurement` of this request. `outcome`
        overrides the classification for transport failures seen by the shell
        (`upstream_unreachable`, `upstream_timeout`, `client_disconnect`). `count_tokens` (a
        tokenizer) counts the generated text streamed; a failing one is ignored."""
        decoder = self._decoder
        if decoder is not None and not self._done:
            self._feed_items(decoder.close(), self._t_last_byte if self._t_last_byte is not None else t_end)
        body_obj: Any = None
        if decoder is None and self._body and not self._body_overflow:
            try:
                body_obj = orjson.loads(bytes(self._body))
            except orjson.JSONDecodeError:
                body_obj = None
        stream_error = self._stream_error  # (in the stream: a body's own error is absorbed next)
        st = self._status
        if decoder is None and isinstance(body_obj, dict) and st is not None and st < 400:
            self._absorb_body(body_obj)
        return self._measurement(t_end, body_obj, stream_error, outcome, error, count_tokens)

    def _absorb_body(self, obj: dict[str, Any]) -> None:
        """A non-stream JSON response: usage, finish reason, error and (kept) text."""
        if self._api is not None and obj.get("type") != "error" and not obj.get("error"):
            evs, usage = dialect_body(self._api, obj)
            if usage is not None:
                self._usage = usage
                self._usage_reports += 1
            for ev in evs:
                ev.usage = None
                self._api_event(ev, None)
            return
        if isinstance(obj.get("usage"), dict):
            self._usage = obj["usage"]
            self._usage_reports += 1
        if not obj.keys().isdisjoint(CLAIM_KEYS):  # (most bodies have none: one test, not three)
            for key in CLAIM_KEYS:  # a server's figures about itself (LM Studio's v0 `stats`, `timings`)
                if isinstance(obj.get(key), dict):
                    self._claims[key] = obj[key]
        msg = obj.get("error")
        if msg:
            self._stream_error = error_message(obj)
        choices = obj.get("choices")
        if isinstance(choices, list) and choices and isinstance(choices[0], dict):
            ch = choices[0]
            if isinstance(ch.get("finish_reason"), str):
                self._finish_reason = ch["finish_reason"]
                self._finish_reasons_seen += 1
            m = ch.get("message")
            if isinstance(m, dict):
                if isinstance(m.get("content"), str):
                    self._content_parts.append(m["content"])
                r = m.get("reasoning_content") or m.get("reasoning")
                if isinstance(r, str):
                    self._reasoning_parts.append(r)
                if isinstance(m.get("tool_calls"), list):
                    for tc in m["tool_calls"]:
                        if isinstance(tc, dict):
                            self._tool_call(tc)
            elif isinstance(ch.get("text"), str):
                self._content_parts.append(ch["text"])

    def _classify(self, body_obj: Any) -> Outcome:
        """The outcome the response shows (a refused prompt is told apart by its error text)."""
        st = self._status
        if st is None:
            return "upstream_unreachable"
        if st >= 400:
            return "http_error"
        if self._stream_error:
            return "stream_error"
        if self._decoder is not None:
            if self._protocol_error:
                return "protocol_error"
            if self._finish_reason is not None:
                return "ok" if self._done else "ok_no_done"
            return "truncated"
        if self._request.endpoint in GENERATION_ENDPOINTS and self._request.json_body:
            if body_obj is None and not self._body_overflow:
                return "protocol_error"
        return "ok"

    def _generated(self, count_tokens: Callable[[str], int] | None, tools: tuple[ToolSpec, ...] | None) -> _Generated:
        """What was generated: the texts, a tokenizer's recount, the text's sizes for the usage
        check and why each structured tool call is unusable (`tools`: the request's)."""
        content = "".join(self._content_parts)
        reasoning = "".join(self._reasoning_parts)
        calls = self._tool_calls
        # what any recount must include: reasoning, content, the tool calls' names and arguments
        text = (
            reasoning + content + "".join(c["name"] + c["arguments"] for c in calls.values())
            if self._decoder is not None
            else None
        )
        tokenizer = _count(count_tokens, text) if self._event_times else None
        chars, nonascii_chars, nonascii_bytes = _text_sizes(text)
        if chars is not None and self._tool_args_over:  # arguments past the bound were streamed too
            chars += sum(self._tool_args_over.values())
        problems: tuple[str, ...] = ()
        if tools is not None and calls:
            over = self._tool_args_over
            found = (
                call_problem(tools, slot["name"], slot["arguments"], truncated=idx in over)
                for idx, slot in sorted(calls.items())
            )
            problems = tuple(p for p in found if p is not None)
        return _Generated(content, reasoning, tokenizer, chars, nonascii_chars, nonascii_bytes, problems)

    def _usage_figures(self) -> _Usage:
        """The usage's counts, and its other keys kept as the server's claims."""
        usage = self._usage or {}
        ptd = usage.get("prompt_tokens_details")
        cached = _int(ptd.get("cached_tokens")) if isinstance(ptd, dict) else None
        if cached is None:
            cached = _int(usage.get("cached_tokens"))
        prompt = _int(usage.get("prompt_tokens"))
        ctd = usage.get("completion_tokens_details")
        claims = dict(self._claims)
        extra = {k: v for k, v in usage.items() if k not in _STD_USAGE_KEYS}
        if extra:
            claims["usage"] = extra
        return _Usage(
            prompt,
            cached,
            _int(usage.get("completion_tokens")),
            _int(ctd.get("reasoning_tokens")) if isinstance(ctd, dict) else None,
            claims,
            uncached_tokens(prompt, cached),
        )

    def _failure_figures(
        self, body_obj: Any, stream_error: str | None, outcome: Outcome | None, error: str | None
    ) -> _Failure:
        """The outcome, the error text and whether (and by how much) the prompt was refused as
        too long (`core.openai.parse_context_limit`)."""
        st = self._status
        classified = outcome is None  # (not the shell's: "http_error" may turn out a "context_limit" below)
        if outcome is None:
            outcome = self._classify(body_obj)
        err = error
        ctx: tuple[bool, int | None, int | None] = (False, None, None)
        parsed: str | None = None  # the text `ctx` was read from
        if st is not None and st >= 400:
            err = err or error_message(body_obj) or _text_snippet(self._body)
            if st in (400, 413, 422):
                ctx, parsed = parse_context_limit(err), err
            if ctx[0] and classified:
                outcome = "context_limit"
        elif stream_error:
            err = err or stream_error
            ctx, parsed = parse_context_limit(stream_error), stream_error
        if err is None and outcome == "protocol_error":
            err = self._protocol_error or "response body is not valid JSON"
        err = None if err is None else err[:500]
        # a refused prompt: the outcome says so, or an in-stream error's text (the record's own
        # error text, so a record read back is judged alike: `core.detect.check_record`)
        refused = outcome == "context_limit" or (
            outcome == "stream_error"
            and (ctx[0] if parsed is not None and parsed == err else parse_context_limit(err)[0])
        )
        return _Failure(outcome, err, refused, ctx[1], ctx[2])

    def _measurement(
        self,
        t_end: float,
        body_obj: Any,
        stream_error: str | None,
        outcome: Outcome | None,
        error: str | None,
        count_tokens: Callable[[str], int] | None,
    ) -> Measurement:
        """The measurement: the meter's own times and counts, with what was generated
        (`_generated`), what the usage says (`_usage_figures`) and how the request ended
        (`_failure_figures`), each decided once."""
        request = self._request
        tools = request.tools  # (a property: read once)
        gen = self._generated(count_tokens, tools)
        use = self._usage_figures()
        end = self._failure_figures(body_obj, stream_error, outcome, error)
        calls = self._tool_calls
        sse = self._decoder is not None
        t0 = self._t_start
        times = self._event_times
        ttft = times[0] - t0 if times else None
        duration = t_end - t0
        # wall tok/s stops at [DONE] (or the API's terminal event): a body kept open after it is
        # not the client's wait (SDKs stop reading there); the tail is reported on its own
        tail = None if self._t_done is None else max(duration - (self._t_done - t0), 0.0)
        headers = self._t_headers
        uncached, prompt, cached = use.uncached, use.prompt, use.cached
        first_byte = self._t_first_byte
        prefill = uncached / ttft if uncached and ttft is not None and ttft > 0 else None  # None: none prefilled
        silent = None if headers is None else (first_byte if first_byte is not None else t_end) - headers
        # positional, in `Measurement`'s field order (each line names its field: a test reads them),
        # built by `tuple.__new__`: a NamedTuple called with 60 keywords cost ~6 us per request
        return _new_measurement(
            Measurement,
            (
                self._request_id,  # id
                self._started_at,  # started_at
                self._upstream,  # upstream
                request.model,  # model
                request.endpoint,  # endpoint
                request.stream,  # stream
                self._status,  # status
                end.outcome,  # outcome
                request.method,  # method
                request.path,  # path
                None if self._t_first_byte is None else self._t_first_byte - t0,  # ttfb_s
                ttft,  # ttft_s
                None if self._t_first_content is None else self._t_first_content - t0,  # ttfc_s
                times[-1] - t0 if times else duration,  # e2e_s
                None if headers is None else headers - t0,  # headers_s
                duration,  # duration_s
                tail,  # tail_after_done_s
                prefill,  # prefill_tps
                prompt,  # prompt_tokens
                cached,  # cached_tokens
                use.completion,  # completion_tokens_reported
                use.reasoning,  # reasoning_tokens_reported
                len(times) if sse else None,  # completion_tokens_counted
                self._reasoning_events if sse else None,  # reasoning_tokens_counted
                gen.tokenizer,  # completion_tokens_tokenizer
                self._usage_reports,  # usage_reports
                request.usage_requested,  # usage_requested
                self._usage_injected,  # usage_injected
                request.max_tokens,  # max_tokens
                self._events,  # events
                len(times),  # generated_events
                self._comments,  # comments
                self._finish_reason,  # finish_reason
                self._finish_reasons_seen,  # finish_reasons_seen
                len(calls),  # tool_calls
                None if tools is None else len(calls) - len(gen.problems),  # tool_calls_valid
                end.error,  # error
                end.context_prompt_tokens,  # context_prompt_tokens
                end.context_limit_tokens,  # context_limit_tokens
                self._prefill_progress,  # prefill_progress
                use.claims,  # server_claims
                self._concurrency,  # concurrency
                self._tags,  # tags
                self._bytes_out,  # bytes_out
                tuple([t - t0 for t in times]),  # event_offsets_s (a list first: a generator costs more per item)
                t0,  # t_start_mono
                self._dual_reasoning_events,  # dual_reasoning_events
                self._duplicate_content,  # duplicate_content
                gen.content if self._keep_text else None,  # response_text
                gen.reasoning if self._keep_text else None,  # reasoning_text
                gen.chars,  # generated_chars
                gen.nonascii_chars,  # nonascii_chars
                gen.nonascii_bytes,  # nonascii_bytes
                gen.content,  # content_text
                gen.problems,  # tool_problems
                find_markup(gen.content, tools) if tools is not None and not calls else None,  # tool_markup
                silent,  # silent_after_headers_s
                end.refused,  # context_refused
                uncached,  # uncached_prompt_tokens
                None if prompt is None else max(prompt, (uncached or 0) + (cached or 0)),  # whole_prompt_tokens
            ),
        )


class _Generated(NamedTuple):
    """What a response generated (`RequestMeter._generated`)."""

    content: str
    reasoning: str
    tokenizer: int | None  # a tokenizer's count of the generated text
    chars: int | None  # characters streamed (None: not a stream)
    nonascii_chars: int
    nonascii_bytes: int
    problems: tuple[str, ...]  # why each structured tool call is unusable


class _Usage(NamedTuple):
    """What a response's usage reports (`RequestMeter._usage_figures`)."""

    prompt: int | None
    cached: int | None
    completion: int | None
    reasoning: int | None
    claims: dict[str, Any]  # the server's claims, its other usage keys among them
    uncached: int | None  # the prompt tokens the server prefilled (`openai.uncached_tokens`)


class _Failure(NamedTuple):
    """How a request ended (`RequestMeter._failure_figures`)."""

    outcome: Outcome
    error: str | None
    refused: bool  # the prompt was refused as too long
    context_prompt_tokens: int | None
    context_limit_tokens: int | None


def _count(count_tokens: Callable[[str], int] | None, text: str | None) -> int | None:
    """A tokenizer's count of `text`; None without one, or when it fails (never loses the record)."""
    if count_tokens is None or text is None:
        return None
    try:
        return count_tokens(text)
    except Exception:  # a tokenizer problem must not lose the record
        return None


def _text_sizes(text: str | None) -> tuple[int | None, int, int]:
    """What the usage check needs of the streamed text: its characters (None when not streamed),
    the non-ASCII ones, and their UTF-8 bytes (scripts that take more tokens per character)."""
    if not text:
        return (None if text is None else 0), 0, 0
    chars = len(text)
    ascii_chars = len(text.encode("ascii", "ignore"))
    nonascii = chars - ascii_chars
    return chars, nonascii, (len(text.encode("utf-8", "surrogatepass")) - ascii_chars if nonascii else 0)


def _text_snippet(body: bytearray) -> str | None:
    if not body:
        return None
    return bytes(body[:300]).decode("utf-8", "replace").strip() or None
