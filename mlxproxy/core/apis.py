"""What Anthropic Messages and OpenAI Responses stream events mean (sans-I/O).

Each decoded `data:` JSON value becomes an `ApiEvent`: the generated text it carries
(answer, reasoning, tool-call input), a tool call it opens or closes, a finish reason, a
usage report, an error, and whether it ends the stream. The meter applies these exactly as
it applies chat-completion chunks, so TTFT, gaps, tokens and the checks mean one thing
for all three APIs (docs/METRICS.md). Usage is normalised to the chat names
(`prompt_tokens`, `completion_tokens`, `prompt_tokens_details.cached_tokens`,
`completion_tokens_details.reasoning_tokens`) by `messages_usage` / `responses_usage`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import orjson

from mlxproxy.core.openai import error_message

__all__ = [
    "ApiEvent",
    "messages_event",
    "responses_event",
    "messages_usage",
    "responses_usage",
    "messages_body",
    "responses_body",
    "blocks",
    "STREAM_APIS",
]

STREAM_APIS = ("messages", "responses")


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


@dataclass(slots=True)
class ApiEvent:
    content: str = ""
    reasoning: str = ""
    tool_index: int | None = None  # the call this event's tool fields belong to
    tool_id: str | None = None
    tool_name: str | None = None
    tool_args: str = ""  # streamed input/arguments (a generated event)
    tool_final_args: str | None = None  # the whole arguments, sent again at the end (not generated)
    finish: str | None = None
    usage: dict[str, Any] | None = None  # raw usage object of this event
    usage_final: bool = False  # this usage is a report (message_delta, the response's final state)
    error: str | None = None
    terminal: bool = False
    # whole tool calls this event carries, each (index, id, name, JSON arguments): the native
    # APIs send a call in one piece (Ollama's `tool_calls`, LM Studio's `tool_call.arguments`)
    calls: tuple[tuple[int, str | None, str, str], ...] = ()
    claims: dict[str, Any] | None = None  # the server's own figures about itself (rule 13): kept apart

    @property
    def generated(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_args or self.calls)


def messages_event(obj: dict[str, Any]) -> ApiEvent:
    """One Anthropic Messages stream event (`type` inside the data decides; the `event:`
    line repeats it)."""
    ev = ApiEvent()
    kind = obj.get("type")
    if kind == "content_block_delta":
        d = obj.get("delta")
        if isinstance(d, dict):
            dk = d.get("type")
            if dk == "text_delta" and isinstance(d.get("text"), str):
                ev.content = d["text"]
            elif dk == "thinking_delta" and isinstance(d.get("thinking"), str):
                ev.reasoning = d["thinking"]
            elif dk == "input_json_delta" and isinstance(d.get("partial_json"), str):
                ev.tool_index = _int(obj.get("index"))
                ev.tool_args = d["partial_json"]
    elif kind == "content_block_start":
        b = obj.get("content_block")
        if isinstance(b, dict) and b.get("type") in ("tool_use", "server_tool_use"):
            ev.tool_index = _int(obj.get("index"))
            ev.tool_id = b.get("id") if isinstance(b.get("id"), str) else None
            ev.tool_name = b.get("name") if isinstance(b.get("name"), str) else ""
            inp = b.get("input")
            if isinstance(inp, dict) and inp:  # a whole input sent at once (not streamed)
                ev.tool_final_args = orjson.dumps(inp).decode()
        elif isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str):
            ev.content = b["text"]  # normally "": some servers put text here
    elif kind == "message_start":
        m = obj.get("message")
        if isinstance(m, dict) and isinstance(m.get("usage"), dict):
            ev.usage = m["usage"]
    elif kind == "message_delta":
        d = obj.get("delta")
        if isinstance(d, dict) and isinstance(d.get("stop_reason"), str) and d["stop_reason"]:
            ev.finish = d["stop_reason"]
        if isinstance(obj.get("usage"), dict):
            ev.usage = obj["usage"]
            ev.usage_final = True
    elif kind == "message_stop":
        ev.terminal = True
    elif kind == "error" or "error" in obj:
        ev.error = error_message(obj) or "error event"
    return ev


def messages_usage(raw: dict[str, Any], final: bool) -> dict[str, Any]:
    """Anthropic usage in chat names. `input_tokens` excludes cache reads and writes, so the
    prompt is their sum; a prompt of 0 means "not reported" (message_start placeholders).
    `output_tokens` counts only from a final report (message_delta)."""
    out: dict[str, Any] = {}
    inp = _int(raw.get("input_tokens"))
    read = _int(raw.get("cache_read_input_tokens")) or 0
    write = _int(raw.get("cache_creation_input_tokens")) or 0
    if inp is not None and inp + read + write > 0:
        out["prompt_tokens"] = inp + read + write
        if _int(raw.get("cache_read_input_tokens")) is not None:  # absent: the server says nothing about a cache
            out["prompt_tokens_details"] = {"cached_tokens": read}
    if final and _int(raw.get("output_tokens")) is not None:
        out["completion_tokens"] = raw["output_tokens"]
    for k, v in raw.items():
        if k not in ("input_tokens", "output_tokens", "cache_read_input_tokens"):
            out[k] = v  # cache_creation_input_tokens and the rest: kept as claims
    return out


def responses_event(obj: dict[str, Any]) -> ApiEvent:
    """One OpenAI Responses stream event."""
    ev = ApiEvent()
    kind = obj.get("type")
    if not isinstance(kind, str):
        if obj.get("error"):
            ev.error = error_message(obj) or "error"
        return ev
    delta = obj.get("delta")
    if kind in ("response.output_text.delta", "response.refusal.delta"):
        if isinstance(delta, str):
            ev.content = delta
    elif kind in ("response.reasoning_text.delta", "response.reasoning_summary_text.delta"):
        if isinstance(delta, str):
            ev.reasoning = delta
    elif kind in ("response.function_call_arguments.delta", "response.custom_tool_call_input.delta"):
        if isinstance(delta, str):
            ev.tool_index = _int(obj.get("output_index"))
            ev.tool_args = delta
    elif kind in ("response.output_item.added", "response.output_item.done"):
        item = obj.get("item")
        if isinstance(item, dict) and item.get("type") in ("function_call", "custom_tool_call"):
            ev.tool_index = _int(obj.get("output_index"))
            ev.tool_id = item.get("call_id") if isinstance(item.get("call_id"), str) else None
            ev.tool_name = item.get("name") if isinstance(item.get("name"), str) else ""
            args = item.get("arguments", item.get("input"))
            # only the finished item's arguments are the whole call: vllm-mlx's `added` already
            # carries them, then streams them again as one delta (they would count twice)
            if kind == "response.output_item.done" and isinstance(args, str) and args:
                ev.tool_final_args = args
    elif kind in ("response.completed", "response.incomplete", "response.failed"):
        r = obj.get("response")
        if isinstance(r, dict):
            _final_state(ev, r)
        ev.terminal = True
    elif kind == "error":
        ev.error = error_message(obj) or "error event"
    return ev


def _final_state(ev: ApiEvent, r: dict[str, Any]) -> None:
    status = r.get("status")
    inc = r.get("incomplete_details")
    if isinstance(inc, dict) and isinstance(inc.get("reason"), str) and inc["reason"]:
        ev.finish = inc["reason"]  # e.g. max_output_tokens (vllm-mlx says so under response.completed)
    elif isinstance(status, str) and status:
        ev.finish = status
    if status == "failed" or r.get("error"):
        ev.error = error_message(r) or "response failed"
    if isinstance(r.get("usage"), dict):
        ev.usage = r["usage"]
        ev.usage_final = True


def responses_usage(raw: dict[str, Any]) -> dict[str, Any]:
    """Responses usage in chat names (`input_tokens` includes cached ones, as in chat)."""
    out: dict[str, Any] = {}
    inp = _int(raw.get("input_tokens"))
    if inp is not None:
        out["prompt_tokens"] = inp
    itd = raw.get("input_tokens_details")
    if isinstance(itd, dict) and _int(itd.get("cached_tokens")) is not None:
        out["prompt_tokens_details"] = {"cached_tokens": itd["cached_tokens"]}
    if _int(raw.get("output_tokens")) is not None:
        out["completion_tokens"] = raw["output_tokens"]
    otd = raw.get("output_tokens_details")
    if isinstance(otd, dict) and _int(otd.get("reasoning_tokens")) is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": otd["reasoning_tokens"]}
    for k, v in raw.items():
        if k not in ("input_tokens", "output_tokens", "input_tokens_details", "output_tokens_details", "total_tokens"):
            out[k] = v
    return out


def blocks(obj: dict[str, Any], key: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """A non-streamed answer's blocks (the objects in its list `key`: `content`, `output`),
    each with its position; none when `key` holds no list."""
    items = obj.get(key)
    if isinstance(items, list):
        for i, item in enumerate(items):
            if isinstance(item, dict):
                yield i, item


def messages_body(obj: dict[str, Any]) -> tuple[list[ApiEvent], dict[str, Any] | None]:
    """A non-streamed Messages response as events (text, thinking, tool_use blocks) and
    its usage in chat names."""
    evs: list[ApiEvent] = []
    for i, b in blocks(obj, "content"):
        if b.get("type") == "text" and isinstance(b.get("text"), str):
            evs.append(ApiEvent(content=b["text"]))
        elif b.get("type") == "thinking" and isinstance(b.get("thinking"), str):
            evs.append(ApiEvent(reasoning=b["thinking"]))
        elif b.get("type") in ("tool_use", "server_tool_use"):
            inp = b.get("input")
            evs.append(
                ApiEvent(
                    tool_index=i,
                    tool_id=b.get("id") if isinstance(b.get("id"), str) else None,
                    tool_name=b.get("name") if isinstance(b.get("name"), str) else "",
                    tool_args=orjson.dumps(inp).decode() if inp is not None else "",
                )
            )
    fin = ApiEvent(finish=obj["stop_reason"] if isinstance(obj.get("stop_reason"), str) else None)
    evs.append(fin)
    usage = messages_usage(obj["usage"], True) if isinstance(obj.get("usage"), dict) else None
    return evs, usage


def responses_body(obj: dict[str, Any]) -> tuple[list[ApiEvent], dict[str, Any] | None]:
    """A non-streamed Response as events (message text, reasoning, function calls) and
    its usage in chat names."""
    evs: list[ApiEvent] = []
    for i, item in blocks(obj, "output"):
        t = item.get("type")
        if t == "message" and isinstance(item.get("content"), list):
            for part in item["content"]:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    evs.append(ApiEvent(content=part["text"]))
        elif t == "reasoning":
            for key in ("content", "summary"):
                for part in item.get(key) or ():
                    if isinstance(part, dict) and isinstance(part.get("text"), str):
                        evs.append(ApiEvent(reasoning=part["text"]))
        elif t in ("function_call", "custom_tool_call"):
            args = item.get("arguments", item.get("input"))
            evs.append(
                ApiEvent(
                    tool_index=i,
                    tool_id=item.get("call_id") if isinstance(item.get("call_id"), str) else None,
                    tool_name=item.get("name") if isinstance(item.get("name"), str) else "",
                    tool_args=args if isinstance(args, str) else "",
                )
            )
    fin = ApiEvent()
    _final_state(fin, obj)
    evs.append(fin)
    return evs, (responses_usage(fin.usage) if fin.usage is not None else None)
