"""The per-request meter: bytes and timestamps in, one `Record` out.

Sans-I/O: every method takes the time as an argument (seconds from one monotonic clock,
e.g. `time.perf_counter()` in the shells, scripted floats in tests). The proxy, replay,
bench and the tests all drive this class, so every figure means one thing everywhere
(definitions: docs/METRICS.md).

Lifecycle: `RequestMeter(...)` at t_start → `upstream_sent(t)` → `response_started(t,
status, content_type)` → `feed(data, t)` per body read (or `feed_stripping`, which also
removes the usage event the proxy injected, in two halves `strip` and `feed_forwarded` for a shell
that forwards in between) → `finish(t_end)` → `Record`. `stop()` ends the
parsing early (a metering bug: the bytes are still counted). The state changes only through
these methods; the attributes are read by the checks (`core.analyze`) and the shells' views.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, TypedDict

import orjson

from mlxproxy.core.apis import (
    STREAM_APIS,
    ApiEvent,
    messages_body,
    messages_event,
    messages_usage,
    responses_body,
    responses_event,
    responses_usage,
)
from mlxproxy.core.openai import (
    GENERATION_ENDPOINTS,
    RequestInfo,
    classify_chunk,
    error_message,
    parse_context_limit,
    plain_delta,
)
from mlxproxy.core.record import Outcome, Record, TokensSource, rate_figures, uncached_tokens
from mlxproxy.core.sse import SSEComment, SSEDecoder, SSEEvent, SSEItem, SSEProtocolError
from mlxproxy.core.strip import UsageStripper
from mlxproxy.core.tools import MAX_ARGUMENT_CHARS, MAX_TOOLS, call_problem, find_markup

__all__ = ["RequestMeter"]

_PROGRESS = re.compile(r"(\d{1,18})\s*/\s*(\d{1,18})")  # bounded: int() refuses huge digit runs
_STD_USAGE_KEYS = frozenset(
    {"prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details", "completion_tokens_details"}
)
MAX_BUFFERED_BODY_BYTES = 16 * 1024 * 1024  # non-stream and error bodies are parsed up to this size


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


class _TokenFields(TypedDict):
    prompt_tokens: int | None
    cached_tokens: int | None
    completion_tokens_reported: int | None
    reasoning_tokens_reported: int | None
    completion_tokens_counted: int | None
    completion_tokens_tokenizer: int | None
    completion_tokens: int | None
    tokens_source: TokensSource | None
    server_claims: dict[str, Any]


class _TimeFields(TypedDict):
    ttfb_s: float | None
    ttft_s: float | None
    ttfc_s: float | None
    e2e_s: float | None
    headers_s: float | None
    duration_s: float
    tail_after_done_s: float | None
    tpot_s: float | None
    decode_tps: float | None
    wall_tps: float | None
    prefill_tps: float | None


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
        self.request = request
        self.request_id = request_id
        self.upstream = upstream
        self.t_start = t_start
        self.started_at = started_at
        self.usage_injected = usage_injected
        self.concurrency = concurrency
        self.tags = tags
        self.keep_text = keep_text
        self._max_line_bytes = max_line_bytes
        self.t_upstream_sent: float | None = None
        self.t_headers: float | None = None
        self.t_first_byte: float | None = None
        self.t_last_byte: float | None = None
        self.t_first_token: float | None = None
        self.t_first_content: float | None = None
        self.t_last_token: float | None = None
        self.t_done: float | None = None
        self.status: int | None = None
        self.sse = False
        self.decoder: SSEDecoder | None = None
        self.bytes_out = 0
        self._body = bytearray()
        self._body_overflow = False
        self._done = False  # [DONE] (or the API's terminal event) seen, or metering stopped
        self.failure: Exception | None = None  # what stopped the metering early (`fail`)
        self.events = 0
        self.generated_events = 0
        self.reasoning_events = 0
        self.content_events = 0
        self.comments = 0
        self.event_times: list[float] = []
        self.finish_reason: str | None = None
        self.finish_reasons_seen = 0
        self.usage: dict[str, Any] | None = None
        self.usage_reports = 0
        self.stream_error: str | None = None
        self.protocol_error: str | None = None
        self.dual_reasoning_events = 0
        self.duplicate_content = False
        self.prefill_progress: tuple[int, int] | None = None
        self.claims: dict[str, Any] = {}
        self.content_parts: list[str] = []
        self._content_chars = 0
        self.reasoning_parts: list[str] = []
        self.tool_calls: dict[int, dict[str, str]] = {}
        self._tool_args_over: dict[int, int] = {}
        # Anthropic Messages / OpenAI Responses: their events follow core.apis, not the chat rules
        self._api = request.endpoint if request.endpoint in STREAM_APIS else None
        self._api_raw_usage: dict[str, Any] = {}
        self._api_final_usage = False  # characters of arguments past MAX_ARGUMENT_CHARS, per call

    @property
    def done(self) -> bool:
        """True once the stream's end event arrived or metering was stopped: nothing more is parsed."""
        return self._done

    # -- inputs ----------------------------------------------------------------------

    def stop(self) -> None:
        """Parse nothing more (body bytes are still counted); the record is built from what was seen."""
        self._done = True

    def fail(self, exc: Exception) -> None:
        """The meter raised `exc` (a bug): stop metering and keep why (`failure`)."""
        if self.failure is None:
            self.failure = exc
        self._done = True

    def upstream_sent(self, t: float) -> None:
        self.t_upstream_sent = t

    def response_started(self, t: float, status: int, content_type: str | None) -> None:
        """Status line and headers arrived. An `text/event-stream` body is parsed as SSE."""
        self.t_headers = t
        self.status = status
        if status < 400 and content_type and content_type.lower().startswith("text/event-stream"):
            self.sse = True
            self.decoder = SSEDecoder(self._max_line_bytes) if self._max_line_bytes else SSEDecoder()

    def feed(self, data: bytes, t: float) -> None:
        """A body read of `data` arrived at `t` (stamped on arrival, before any parsing)."""
        if not data:
            return
        decoder = self.decoder
        if decoder is not None:
            self.feed_decoded(len(data), () if self._done else decoder.feed(data), t)
            return
        self.feed_decoded(len(data), (), t)
        if not self._body_overflow:
            if len(self._body) + len(data) > MAX_BUFFERED_BODY_BYTES:
                self._body_overflow = True
                self._body.clear()
            else:
                self._body += data

    def feed_stripping(self, data: bytes, t: float, stripper: UsageStripper) -> bytes:
        """`feed` for a stream whose usage event was injected by the caller: returns the bytes
        to forward now, without that event (`stripper` holds back an event still open). Never
        raises: a metering failure is kept (`fail`) and the held bytes and the rest pass unchanged.
        (`strip` then `feed_forwarded`: a shell that forwards in between keeps the metering off
        the client's path.)"""
        out, items = self.strip(data, stripper)
        self.feed_forwarded(data, items, t)
        return out

    def strip(self, data: bytes, stripper: UsageStripper) -> tuple[bytes, Sequence[SSEItem] | None]:
        """The first half of `feed_stripping`: decode a read of `data` (SSE framing only, no
        JSON) and return the bytes to forward now, without the injected usage event, and the
        decoded items for `feed_forwarded` (None: nothing decoded, it meters `data` itself).
        Never raises: a decoding failure is kept (`fail`) and the held bytes and the rest pass
        unchanged."""
        decoder = self.decoder
        if self._done or decoder is None:
            return stripper.flush() + data, None
        try:
            items = decoder.feed(data)
            return stripper.process(data, items, decoder.safe_offset), items
        except Exception as exc:  # forward what is held and the rest unmetered
            self.fail(exc)
            return stripper.flush() + data, ()

    def feed_forwarded(self, data: bytes, items: Sequence[SSEItem] | None, t: float) -> None:
        """Meter a read of `data` that arrived at `t` and has been forwarded: `items` are what
        `strip` decoded of it, or None to decode it here (`feed`). Never raises: a metering
        failure is kept (`fail`)."""
        try:
            if items is None:
                self.feed(data, t)
            else:
                self.feed_decoded(len(data), items, t)
        except Exception as exc:
            self.fail(exc)

    def feed_decoded(self, nbytes: int, items: Sequence[SSEItem], t: float) -> None:
        """Like `feed`, for a caller that already ran this meter's `decoder` on the bytes."""
        if nbytes:
            if self.t_first_byte is None:
                self.t_first_byte = t
            self.t_last_byte = t
            self.bytes_out += nbytes
        if items and not self._done:
            self.feed_items(items, t)

    def feed_items(self, items: Sequence[SSEItem], t: float) -> None:
        for item in items:
            if self._done:
                return
            if isinstance(item, SSEEvent):
                self._event(item.data, t)
            elif isinstance(item, SSEComment):
                self.comments += 1
                m = _PROGRESS.search(item.text)
                if m:
                    self.prefill_progress = (int(m.group(1)), int(m.group(2)))
            elif isinstance(item, SSEProtocolError):
                self.protocol_error = self.protocol_error or item.reason

    def _event(self, data: str, t: float) -> None:
        self.events += 1
        if data.startswith("[DONE]"):
            self._done = True
            self.t_done = t
            return
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            self.protocol_error = self.protocol_error or "invalid JSON in a data: line"
            return
        tool_calls: Sequence[dict[str, Any]] = ()
        has_tool: object  # truthy when the event carries (part of) a tool call
        if self._api is not None:
            ev = messages_event(obj) if self._api == "messages" else responses_event(obj)
            self._api_event(ev, t)
            if not ev.generated:
                return
            content, reasoning, has_tool = ev.content, ev.reasoning, ev.tool_args
        else:
            plain = plain_delta(obj)
            if plain is not None:  # the common chunk: classify_chunk would say Delta(content, reasoning), nothing else
                content, reasoning = plain
            else:
                d = classify_chunk(obj)  # (repeats the plain_delta test: only on the few other chunks)
                if d.error is not None:
                    self.stream_error = self.stream_error or d.error
                if d.usage is not None:
                    self.usage = d.usage
                    self.usage_reports += 1
                if d.claims:
                    self.claims.update(d.claims)
                if d.finish_reasons:
                    self.finish_reasons_seen += len(d.finish_reasons)
                    if self.finish_reason is None:
                        self.finish_reason = d.finish_reasons[0]
                if d.dual_reasoning:
                    self.dual_reasoning_events += 1
                if not d.generated:
                    return
                content = d.content or d.text
                reasoning = d.reasoning
                tool_calls = d.tool_calls
            if (
                content
                and self.content_events >= 2
                and len(content) == self._content_chars
                and content == "".join(self.content_parts)
            ):  # joined only when the lengths agree: linear overall
                self.duplicate_content = True  # a terminal chunk replaying the whole answer
                return
            has_tool = tool_calls
        # one generated event (a token on per-token servers), of any API; kept inline: this
        # runs for every event of every stream
        self.generated_events += 1
        self.event_times.append(t)
        if self.t_first_token is None:
            self.t_first_token = t
        if self.t_first_content is None and (content or has_tool):
            self.t_first_content = t
        self.t_last_token = t
        if content:
            self.content_events += 1
            self.content_parts.append(content)
            self._content_chars += len(content)
        if reasoning:
            self.reasoning_events += 1
            self.reasoning_parts.append(reasoning)
        for tc in tool_calls:
            self._tool_call(tc)

    def _api_event(self, ev: ApiEvent, t: float | None) -> None:
        """A Messages or Responses event (`t` None: part of a non-streamed body)."""
        if ev.error is not None:
            self.stream_error = self.stream_error or ev.error
        if ev.usage is not None:
            if ev.usage_final:
                self.usage_reports += 1
            if self._api == "messages":
                self._api_raw_usage.update(ev.usage)
                self._api_final_usage = self._api_final_usage or ev.usage_final
                self.usage = messages_usage(self._api_raw_usage, self._api_final_usage)
            else:
                self.usage = responses_usage(ev.usage)
        if ev.finish is not None:
            self.finish_reasons_seen += 1
            if self.finish_reason is None:
                self.finish_reason = ev.finish
        idx = ev.tool_index if ev.tool_index is not None else 0
        if ev.tool_name is not None or ev.tool_id is not None:
            self._call_part(idx, ev.tool_id, ev.tool_name, None)
        if ev.generated:
            if t is None:  # (a streamed event's text and times are kept by `_event`)
                if ev.content:
                    self.content_parts.append(ev.content)
                if ev.reasoning:
                    self.reasoning_parts.append(ev.reasoning)
            if ev.tool_args:
                self._call_part(idx, None, None, ev.tool_args)
        if ev.tool_final_args is not None:
            slot = self.tool_calls.get(idx)
            if slot is None or (not slot["arguments"] and idx not in self._tool_args_over):
                self._call_part(idx, None, None, ev.tool_final_args)  # sent whole, never streamed
        if ev.terminal and t is not None:
            self._done = True
            self.t_done = t

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
        slot = self.tool_calls.get(idx)
        if slot is None:
            if len(self.tool_calls) >= 4 * MAX_TOOLS:
                return
            slot = self.tool_calls[idx] = {"id": "", "name": "", "arguments": ""}
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

    def tool_problems(self) -> list[str]:
        """Why each structured call is unusable (empty when all are fine or no tools were offered)."""
        tools = self.request.tools
        if tools is None:
            return []
        out = []
        for idx, slot in sorted(self.tool_calls.items()):
            p = call_problem(tools, slot["name"], slot["arguments"], truncated=idx in self._tool_args_over)
            if p is not None:
                out.append(p)
        return out

    def tool_markup(self) -> str | None:
        """Tool-call markup in the streamed content (evidence), when the request offered tools."""
        if self.request.tools is None:
            return None
        return find_markup(self.content_text, self.request.tools)

    # -- outputs ---------------------------------------------------------------------

    @property
    def content_text(self) -> str:
        return "".join(self.content_parts)

    @property
    def reasoning_text(self) -> str:
        return "".join(self.reasoning_parts)

    @property
    def tool_call_text(self) -> str:
        """The tool calls' names and arguments as streamed (what any recount must include)."""
        return "".join(t["name"] + t["arguments"] for t in self.tool_calls.values())

    @property
    def generated_text(self) -> str:
        """All generated text streamed: reasoning, content, tool-call names and arguments."""
        return self.reasoning_text + self.content_text + self.tool_call_text

    @property
    def generated_chars(self) -> int:
        """Characters of generated text streamed (content, reasoning, tool names and arguments)."""
        return (
            sum(map(len, self.content_parts))
            + sum(map(len, self.reasoning_parts))
            + sum(len(t["arguments"]) + len(t["name"]) for t in self.tool_calls.values())
            + sum(self._tool_args_over.values())
        )

    def silent_after_headers_s(self, t_end: float) -> float | None:
        """How long the body stayed silent after the headers (to the first byte, or to
        the end when no byte came). None before headers."""
        if self.t_headers is None:
            return None
        first = self.t_first_byte if self.t_first_byte is not None else t_end
        return first - self.t_headers

    def finish(
        self,
        t_end: float,
        *,
        outcome: Outcome | None = None,
        error: str | None = None,
        tokenizer_tokens: int | None = None,
    ) -> Record:
        """Close the body and compute the record. `outcome` overrides the classification
        for transport failures seen by the shell (`upstream_unreachable`,
        `upstream_timeout`, `client_disconnect`). `tokenizer_tokens` is a tokenizer's
        count of the generated text, when the caller has one."""
        if self.decoder is not None and not self._done:
            self.feed_items(self.decoder.close(), self.t_last_byte if self.t_last_byte is not None else t_end)
        body_obj: Any = None
        if self.decoder is None and self._body and not self._body_overflow:
            try:
                body_obj = orjson.loads(bytes(self._body))
            except orjson.JSONDecodeError:
                body_obj = None
        err_msg = error
        ctx: tuple[bool, int | None, int | None] = (False, None, None)
        st = self.status
        if st is not None and st >= 400:
            err_msg = err_msg or error_message(body_obj) or _text_snippet(self._body)
            ctx = parse_context_limit(err_msg) if st in (400, 413, 422) else ctx
        elif self.stream_error:
            err_msg = err_msg or self.stream_error
            ctx = parse_context_limit(self.stream_error)
        if self.decoder is None and isinstance(body_obj, dict) and st is not None and st < 400:
            self._absorb_body(body_obj)
        if outcome is None:
            outcome = self._classify(body_obj, ctx[0])
        if err_msg is None and outcome == "protocol_error":
            err_msg = self.protocol_error or "response body is not valid JSON"
        return self._record(t_end, outcome, err_msg, ctx, tokenizer_tokens)

    def _absorb_body(self, obj: dict[str, Any]) -> None:
        """A non-stream JSON response: usage, finish reason, error and (kept) text."""
        if self._api is not None and obj.get("type") != "error" and not obj.get("error"):
            evs, usage = messages_body(obj) if self._api == "messages" else responses_body(obj)
            if usage is not None:
                self.usage = usage
                self.usage_reports += 1
            for ev in evs:
                ev.usage = None
                self._api_event(ev, None)
            return
        if isinstance(obj.get("usage"), dict):
            self.usage = obj["usage"]
            self.usage_reports += 1
        msg = obj.get("error")
        if msg:
            self.stream_error = error_message(obj)
        choices = obj.get("choices")
        if isinstance(choices, list) and choices and isinstance(choices[0], dict):
            ch = choices[0]
            if isinstance(ch.get("finish_reason"), str):
                self.finish_reason = ch["finish_reason"]
                self.finish_reasons_seen += 1
            m = ch.get("message")
            if isinstance(m, dict):
                if isinstance(m.get("content"), str):
                    self.content_parts.append(m["content"])
                r = m.get("reasoning_content") or m.get("reasoning")
                if isinstance(r, str):
                    self.reasoning_parts.append(r)
                if isinstance(m.get("tool_calls"), list):
                    for tc in m["tool_calls"]:
                        if isinstance(tc, dict):
                            self._tool_call(tc)
            elif isinstance(ch.get("text"), str):
                self.content_parts.append(ch["text"])

    def _classify(self, body_obj: Any, context_limit: bool) -> Outcome:
        st = self.status
        if st is None:
            return "upstream_unreachable"
        if st >= 400:
            return "context_limit" if context_limit else "http_error"
        if self.stream_error:
            return "stream_error"
        if self.decoder is not None:
            if self.protocol_error:
                return "protocol_error"
            if self.finish_reason is not None:
                return "ok" if self._done else "ok_no_done"
            return "truncated"
        if self.request.endpoint in GENERATION_ENDPOINTS and self.request.json_body:
            if body_obj is None and not self._body_overflow:
                return "protocol_error"
        return "ok"

    def _record(
        self,
        t_end: float,
        outcome: Outcome,
        err: str | None,
        ctx: tuple[bool, int | None, int | None],
        tokenizer_tokens: int | None,
    ) -> Record:
        tokens = self._token_fields(tokenizer_tokens)
        times = self._time_fields(t_end, tokens["completion_tokens"], tokens["prompt_tokens"], tokens["cached_tokens"])
        request = self.request
        return Record(
            id=self.request_id,
            started_at=self.started_at,
            upstream=self.upstream,
            model=request.model,
            endpoint=request.endpoint,
            stream=request.stream,
            status=self.status,
            outcome=outcome,
            method=request.method,
            path=request.path,
            **times,
            **tokens,
            reasoning_tokens_counted=self.reasoning_events if self.decoder is not None else None,
            usage_reports=self.usage_reports,
            usage_requested=request.usage_requested,
            usage_injected=self.usage_injected,
            max_tokens=request.max_tokens,
            events=self.events,
            generated_events=self.generated_events,
            comments=self.comments,
            finish_reason=self.finish_reason,
            finish_reasons_seen=self.finish_reasons_seen,
            tool_calls=len(self.tool_calls),
            tool_calls_valid=(None if request.tools is None else len(self.tool_calls) - len(self.tool_problems())),
            error=None if err is None else err[:500],
            context_prompt_tokens=ctx[1],
            context_limit_tokens=ctx[2],
            prefill_progress=self.prefill_progress,
            concurrency=self.concurrency,
            tags=self.tags,
            bytes_out=self.bytes_out,
            event_offsets_s=tuple(t - self.t_start for t in self.event_times),
            t_start_mono=self.t_start,
            dual_reasoning_events=self.dual_reasoning_events,
            duplicate_content=self.duplicate_content,
            response_text=self.content_text if self.keep_text else None,
            reasoning_text=self.reasoning_text if self.keep_text else None,
        )

    def _token_fields(self, tokenizer_tokens: int | None) -> _TokenFields:
        """The record's token counts: what `usage` reported, what was streamed, a tokenizer's
        count, and the provisional trusted count (the usage checks in core.detect may still
        overrule it), with the server's extra usage keys kept as claims."""
        usage = self.usage or {}
        ptd = usage.get("prompt_tokens_details")
        cached = _int(ptd.get("cached_tokens")) if isinstance(ptd, dict) else None
        if cached is None:
            cached = _int(usage.get("cached_tokens"))
        reported = _int(usage.get("completion_tokens"))
        ctd = usage.get("completion_tokens_details")
        extra = {k: v for k, v in usage.items() if k not in _STD_USAGE_KEYS}
        claims = dict(self.claims)
        if extra:
            claims["usage"] = extra
        counted = self.generated_events if self.decoder is not None else None
        source: TokensSource | None
        if reported is not None:
            n_out, source = reported, "usage"
        elif tokenizer_tokens is not None:
            n_out, source = tokenizer_tokens, "tokenizer"
        elif counted is not None:
            n_out, source = counted, "stream"
        else:
            n_out, source = None, None
        return {
            "prompt_tokens": _int(usage.get("prompt_tokens")),
            "cached_tokens": cached,
            "completion_tokens_reported": reported,
            "reasoning_tokens_reported": _int(ctd.get("reasoning_tokens")) if isinstance(ctd, dict) else None,
            "completion_tokens_counted": counted,
            "completion_tokens_tokenizer": tokenizer_tokens,
            "completion_tokens": n_out,
            "tokens_source": source,
            "server_claims": claims,
        }

    def _time_fields(self, t_end: float, n_out: int | None, prompt: int | None, cached: int | None) -> _TimeFields:
        """The record's times (seconds from the start) and the rates derived from them."""
        t0 = self.t_start

        def rel(t: float | None) -> float | None:
            return None if t is None else t - t0

        ttft = rel(self.t_first_token)
        duration = t_end - t0
        e2e = rel(self.t_last_token) if self.t_last_token is not None else duration
        # wall tok/s stops at [DONE] (or the API's terminal event): a body kept open after it is
        # not the client's wait (SDKs stop reading there); the tail is reported on its own
        done_at = rel(self.t_done)
        tail = max(duration - done_at, 0.0) if done_at is not None else None
        tpot, decode, wall = rate_figures(
            n_out, ttft if self.t_last_token is not None else None, e2e, duration - (tail or 0.0)
        )
        uncached = uncached_tokens(prompt, cached)
        return {
            "ttfb_s": rel(self.t_first_byte),
            "ttft_s": ttft,
            "ttfc_s": rel(self.t_first_content),
            "e2e_s": e2e,
            "headers_s": rel(self.t_headers),
            "duration_s": duration,
            "tail_after_done_s": tail,
            "tpot_s": tpot,
            "decode_tps": decode,
            "wall_tps": wall,
            # None when nothing was prefilled
            "prefill_tps": uncached / ttft if uncached and ttft is not None and ttft > 0 else None,
        }


def _text_snippet(body: bytearray) -> str | None:
    if not body:
        return None
    return bytes(body[:300]).decode("utf-8", "replace").strip() or None
