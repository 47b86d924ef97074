"""What the native APIs of Ollama and LM Studio mean (sans-I/O), beside `core.apis`.

Each decoded line or event becomes an `ApiEvent`, as Anthropic Messages and OpenAI Responses
events do (`core.apis`), so the meter, the checks and the cache doctor treat all of them
alike ([WIRE.md](WIRE.md#ollama-and-lm-studio)):

- **Ollama** `/api/chat` and `/api/generate` (`api/types.go`: `ChatResponse`,
  `GenerateResponse`, `Metrics`): one JSON object per NDJSON line; `message.content` /
  `response` is the answer, `message.thinking` / `thinking` the reasoning, `tool_calls` whole
  calls (arguments an object). The `done: true` line ends the answer with `done_reason` and
  the usage: `prompt_eval_count` (the whole prompt: `llm/llama_server.go` adds the cached
  `cache_n`), `prompt_eval_cached_count`, `eval_count`, and durations in nanoseconds, kept
  as the server's claims (`ollama`). A line `{"error": "..."}` is an error.
- **LM Studio** `/api/v1/chat` (its REST API docs, "Streaming events"): SSE events with a
  `type`; `message.delta` / `reasoning.delta` carry `content`, `tool_call.arguments` a whole
  call, `error` an error object, `chat.end` the result with `stats` (the usage and its speed
  claims, `stats`). It sends no stop reason: `chat.end` is finish `end`.

`dialect_event`, `dialect_usage` and `dialect_body` dispatch by endpoint over these and the
two of `core.apis` (one `Dialect` each, in `DIALECTS`): the one hook the meter calls.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from mlxproxy.core.apis import (
    STREAM_APIS,
    ApiEvent,
    blocks,
    messages_body,
    messages_event,
    messages_usage,
    responses_body,
    responses_event,
    responses_usage,
)
from mlxproxy.core.openai import error_message

__all__ = [
    "NATIVE_APIS",
    "DIALECT_APIS",
    "OLLAMA_CLAIM_KEYS",
    "ollama_event",
    "ollama_usage",
    "lmstudio_event",
    "lmstudio_usage",
    "dialect_event",
    "dialect_usage",
    "dialect_body",
    "Dialect",
    "DIALECTS",
]

NATIVE_APIS = ("ollama_chat", "ollama_generate", "lmstudio_chat")
#: every endpoint whose events follow a dialect here rather than the chat-completions rules
DIALECT_APIS = (*STREAM_APIS, *NATIVE_APIS)
#: the figures of Ollama's final line kept as its claims (durations in nanoseconds)
OLLAMA_CLAIM_KEYS = (
    "total_duration",
    "load_duration",
    "prompt_eval_count",
    "prompt_eval_cached_count",
    "prompt_eval_duration",
    "eval_count",
    "eval_duration",
)


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _str(v: Any) -> str | None:
    return v if isinstance(v, str) else None


def _args(v: Any) -> str:
    """Tool arguments as JSON text (the native APIs send an object)."""
    if isinstance(v, str):
        return v
    return "" if v is None else orjson.dumps(v).decode()


def _ollama_calls(tcs: Any) -> tuple[tuple[int, str | None, str, str], ...]:
    out: list[tuple[int, str | None, str, str]] = []
    if not isinstance(tcs, list):
        return ()
    for pos, tc in enumerate(tcs):
        if not isinstance(tc, dict):
            continue
        fn = tc.get("function")
        fn = fn if isinstance(fn, dict) else {}
        idx = _int(fn.get("index"))
        out.append(
            (pos if idx is None else idx, _str(tc.get("id")), _str(fn.get("name")) or "", _args(fn.get("arguments")))
        )
    return tuple(out)


def ollama_event(obj: dict[str, Any]) -> ApiEvent:
    """One line of an Ollama `/api/chat` or `/api/generate` stream (or a whole non-streamed
    answer: the same object with `done: true`)."""
    ev = ApiEvent()
    if obj.get("error"):
        ev.error = error_message(obj) or "error"
        return ev
    msg = obj.get("message")
    if isinstance(msg, dict):  # /api/chat
        ev.content = _str(msg.get("content")) or ""
        ev.reasoning = _str(msg.get("thinking")) or ""
        ev.calls = _ollama_calls(msg.get("tool_calls"))
    else:  # /api/generate
        ev.content = _str(obj.get("response")) or ""
        ev.reasoning = _str(obj.get("thinking")) or ""
        ev.calls = _ollama_calls(obj.get("tool_calls"))
    if obj.get("done") is True:
        ev.terminal = True
        # Go omits a zero figure (`omitempty`): on the final line a missing count is 0
        ev.finish = _str(obj.get("done_reason")) or "stop"
        claims = {k: obj[k] for k in OLLAMA_CLAIM_KEYS if _int(obj.get(k)) is not None}
        ev.claims = {"ollama": claims}
        ev.usage = claims
        ev.usage_final = True
    return ev


def ollama_usage(raw: dict[str, Any]) -> dict[str, Any]:
    """Ollama's counts in chat names: `prompt_eval_count` is the whole prompt (cached tokens
    included), `prompt_eval_cached_count` the cached share, `eval_count` the output."""
    out: dict[str, Any] = {}
    prompt = _int(raw.get("prompt_eval_count"))
    if prompt is not None:
        out["prompt_tokens"] = prompt
    cached = _int(raw.get("prompt_eval_cached_count"))
    if cached is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    out["completion_tokens"] = _int(raw.get("eval_count")) or 0
    return out


def lmstudio_event(obj: dict[str, Any]) -> ApiEvent:
    """One event of an LM Studio `/api/v1/chat` stream."""
    ev = ApiEvent()
    kind = obj.get("type")
    if kind == "message.delta":
        ev.content = _str(obj.get("content")) or ""
    elif kind == "reasoning.delta":
        ev.reasoning = _str(obj.get("content")) or ""
    elif kind == "tool_call.arguments":
        ev.calls = ((0, None, _str(obj.get("tool")) or "", _args(obj.get("arguments"))),)
    elif kind == "error" or (kind is None and obj.get("error")):
        ev.error = error_message(obj) or "error event"
    elif kind == "chat.end":
        r = obj.get("result")
        if isinstance(r, dict):
            _lmstudio_result(ev, r)
        ev.finish = "end"
        ev.terminal = True
    return ev


def _lmstudio_result(ev: ApiEvent, r: dict[str, Any]) -> None:
    stats = r.get("stats")
    if isinstance(stats, dict):
        ev.usage = stats
        ev.usage_final = True
        ev.claims = {"stats": stats}


def lmstudio_usage(stats: dict[str, Any]) -> dict[str, Any]:
    """LM Studio's v1 `stats` in chat names."""
    out: dict[str, Any] = {}
    if _int(stats.get("input_tokens")) is not None:
        out["prompt_tokens"] = stats["input_tokens"]
    if _int(stats.get("total_output_tokens")) is not None:
        out["completion_tokens"] = stats["total_output_tokens"]
    if _int(stats.get("reasoning_output_tokens")) is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": stats["reasoning_output_tokens"]}
    return out


def _lmstudio_body(obj: dict[str, Any]) -> tuple[list[ApiEvent], dict[str, Any] | None]:
    evs: list[ApiEvent] = []
    for i, item in blocks(obj, "output"):
        t, text = item.get("type"), _str(item.get("content"))
        if t == "message" and text:
            evs.append(ApiEvent(content=text))
        elif t == "reasoning" and text:
            evs.append(ApiEvent(reasoning=text))
        elif t == "tool_call":
            evs.append(ApiEvent(calls=((i, None, _str(item.get("tool")) or "", _args(item.get("arguments"))),)))
    fin = ApiEvent(finish="end")
    _lmstudio_result(fin, obj)
    usage = lmstudio_usage(fin.usage) if fin.usage is not None else None
    fin.usage = None
    evs.append(fin)
    return evs, usage


def _ollama_body(obj: dict[str, Any]) -> tuple[list[ApiEvent], dict[str, Any] | None]:
    ev = ollama_event(obj)
    usage = ollama_usage(ev.usage) if ev.usage is not None else None
    ev.usage = None
    return [ev], usage


@dataclass(frozen=True, slots=True)
class Dialect:
    """How one endpoint's answers read: each decoded event (or NDJSON line, the `unit`) as an
    `ApiEvent`, the usage reported so far in chat names, a non-streamed answer as events."""

    event: Callable[[dict[str, Any]], ApiEvent]
    usage: Callable[[dict[str, Any], bool], dict[str, Any]]  # (every usage object merged, a final report?)
    body: Callable[[dict[str, Any]], tuple[list[ApiEvent], dict[str, Any] | None]]
    unit: str = "event"


_OLLAMA = Dialect(ollama_event, lambda raw, final: ollama_usage(raw), _ollama_body, "line")
#: endpoint -> its dialect (any other native endpoint reads as Ollama's)
DIALECTS: dict[str, Dialect] = {
    "messages": Dialect(messages_event, messages_usage, messages_body),
    "responses": Dialect(responses_event, lambda raw, final: responses_usage(raw), responses_body),
    "lmstudio_chat": Dialect(lmstudio_event, lambda raw, final: lmstudio_usage(raw), _lmstudio_body),
    "ollama_chat": _OLLAMA,
    "ollama_generate": _OLLAMA,
}


def dialect_event(api: str, obj: Any) -> ApiEvent:
    """One decoded event (or NDJSON line) of endpoint `api` (one of `DIALECT_APIS`)."""
    dialect = DIALECTS.get(api, _OLLAMA)
    if not isinstance(obj, dict):
        return ApiEvent(error=f"{dialect.unit} is not a JSON object")
    return dialect.event(obj)


def dialect_usage(api: str, raw: dict[str, Any], final: bool) -> dict[str, Any]:
    """The usage reported so far (`raw`: every usage object of the stream merged) in chat names."""
    return DIALECTS.get(api, _OLLAMA).usage(raw, final)


def dialect_body(api: str, obj: dict[str, Any]) -> tuple[list[ApiEvent], dict[str, Any] | None]:
    """A non-streamed answer of endpoint `api` as events and its usage in chat names."""
    return DIALECTS.get(api, _OLLAMA).body(obj)
