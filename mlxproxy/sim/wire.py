"""Bytes on the wire, per server style: pure functions of their arguments.

A style object formats one response (`WireContext` fixes its id, model echo, creation time and
endpoint). The base `Style` is the OpenAI reference format (compact JSON, role chunk with
`content: ""`, usage only with `include_usage` as a `choices: []` chunk); `DetailErrors` is the
base of the FastAPI servers whose own errors are `{"detail": ...}`. `wire_servers.py` and
`wire_vllm.py` hold one subclass per real MLX server, following
docs/WIRE.md#what-each-server-sends and tests/fixtures/{wire,real}; `styles.py` names them all (`style_class`, `style_for`). The
dependencies run one way: this module imports neither of those. Styles that use spaced JSON
(`json.dumps` defaults, ASCII escapes) override `dumps`.

Stream methods return the exact bytes to write at that moment: `open_stream` (with the
headers), `progress` (prefill comment), `piece` (one token), `finish` (everything after the
last token), `idle_comment`, `stream_error` (bytes plus how the response ends).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import orjson

SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]
DONE = b"data: [DONE]\n\n"


def sse(payload: bytes) -> bytes:
    """One SSE event: `data: <payload>` and a blank line (LF only, as every server sends)."""
    return b"data: " + payload + b"\n\n"


def comment(text: str) -> bytes:
    """One SSE comment line and a blank line."""
    return b": " + text.encode("utf-8") + b"\n\n"


def dumps_compact(obj: Any) -> bytes:
    """Compact JSON, raw UTF-8 (pydantic `model_dump_json`, orjson)."""
    return orjson.dumps(obj)


def dumps_spaced(obj: Any) -> bytes:
    """`json.dumps` defaults: `", "` and `": "` separators, non-ASCII as \\u escapes."""
    return json.dumps(obj).encode("ascii")


@dataclass(frozen=True)
class WireContext:
    """What stays fixed for one response."""

    response_id: str
    model: str
    created: int
    endpoint: str = "chat"  # "chat" or "completions"
    include_usage: bool = False
    stream_options_without_include_usage: bool = False


@dataclass(frozen=True)
class UsageReport:
    """Usage numbers and the server's timing claims (wall seconds) for one answer."""

    prompt_tokens: int
    completion_tokens: int
    reasoning_tokens: int = 0
    reasoning_chars: int = 0
    total_chars: int = 0
    ttft_s: float | None = None  # the timing claims, in wall seconds
    decode_s: float | None = None
    total_s: float | None = None
    n_visible: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prompt cache

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


def hex_id(seed: str, n_chars: int) -> str:
    """A deterministic lowercase hex string of `n_chars` derived from `seed`."""
    out = ""
    counter = 0
    while len(out) < n_chars:
        out += hashlib.sha256(f"{seed}|{counter}".encode()).hexdigest()
        counter += 1
    return out[:n_chars]


def uuid_like(seed: str) -> str:
    """A uuid4-shaped deterministic string."""
    h = hex_id(seed, 32)
    return f"{h[:8]}-{h[8:12]}-4{h[13:16]}-8{h[17:20]}-{h[20:32]}"


ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    429: "rate_limit_error",
}


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


class Style:
    """The OpenAI reference format (profile `healthy`, `phantom-usage`)."""

    name = "openai"
    id_prefix = "chatcmpl-"
    keepalive_comment = comment("keepalive")
    finish_on_last_token = False  # the last token's chunk also carries finish_reason (vllm-mlx)
    supports_completions = True
    has_health = True
    null_usage = True  # with include_usage, every chunk says `"usage": null` (OpenAI's reference)
    reasoning_key = "reasoning_content"  # the answer message's reasoning member (some servers: `reasoning`)
    refusal_member = True  # the answer message has OpenAI's `"refusal": null`

    def __init__(self, ctx: WireContext) -> None:
        self.ctx = ctx
        self.tool_name = ""  # set by the app for a plan that calls a tool
        self._tool_started = False

    @classmethod
    def make_id(cls, seed: str, endpoint: str = "chat") -> str:
        prefix = cls.id_prefix if endpoint == "chat" else "cmpl-"
        return prefix + hex_id(seed, 24)

    def dumps(self, obj: Any) -> bytes:
        return dumps_compact(obj)

    # -- stream ------------------------------------------------------------------------------

    def stream_headers(self) -> list[tuple[bytes, bytes]]:
        return list(SSE_HEADERS)

    def chunk_fingerprint(self) -> str | None:
        """The chunks' `system_fingerprint`."""
        return None

    def _chunk(self, choices: list[Any], **extra: Any) -> bytes:
        chat = self.ctx.endpoint == "chat"
        obj: dict[str, Any] = {
            "id": self.ctx.response_id,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": self.ctx.created,
            "model": self.ctx.model,
        }
        if chat:
            obj["system_fingerprint"] = self.chunk_fingerprint()
        obj["choices"] = choices
        if self.ctx.include_usage and self.null_usage:
            obj["usage"] = None
        obj.update(extra)
        return sse(self.dumps(obj))

    def _choice(self, delta: dict[str, Any] | None, text: str | None, finish: str | None) -> dict[str, Any]:
        if self.ctx.endpoint == "chat":
            return {"index": 0, "delta": delta or {}, "logprobs": None, "finish_reason": finish}
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}

    def open_stream(self) -> bytes:
        if self.ctx.endpoint != "chat":
            return b""
        return self._chunk([self._choice({"role": "assistant", "content": "", "refusal": None}, None, None)])

    def progress(self, processed_tokens: int, total_tokens: int) -> bytes:
        return b""

    def idle_comment(self) -> bytes:
        return self.keepalive_comment

    def delta(self, kind: str, text: str) -> dict[str, Any]:
        if kind == "tool":  # a structured tool call's arguments fragment; the first names the tool
            call: dict[str, Any] = {"index": 0, "function": {"arguments": text}}
            if not self._tool_started:
                self._tool_started = True
                call = {
                    "index": 0,
                    "id": "call_" + self.ctx.response_id[-12:],
                    "type": "function",
                    "function": {"name": self.tool_name, "arguments": text},
                }
            return {"tool_calls": [call]}
        return {"reasoning_content" if kind == "reasoning" else "content": text}

    def piece(self, kind: str, text: str, rate_tps: float | None = None) -> bytes:
        return self._chunk([self._choice(self.delta(kind, text), text, None)])

    def usage_obj(self, usage: UsageReport) -> dict[str, Any]:
        return {
            "prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
        }

    def finish(self, reason: str, usage: UsageReport, last: tuple[str, str] | None = None) -> bytes:
        out = self._chunk([self._choice({}, "", reason)])
        if self.ctx.include_usage:
            out += self._chunk([], usage=self.usage_obj(usage))
        return out + DONE

    def stream_error(self, message: str, reason: str, usage: UsageReport) -> tuple[bytes, str]:
        """Bytes of a mid-stream failure and the ending: "end" (complete the body) or "close"."""
        err = {"error": {"message": message, "type": "server_error", "param": None, "code": None}}
        return sse(self.dumps(err)), "end"

    # -- non-stream --------------------------------------------------------------------------

    def nonstream_prefix(self) -> bytes:
        """Bytes sent with the headers before the body is known (oMLX's leading space)."""
        return b""

    def message(self, reasoning: str, content: str) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if self.refusal_member:
            msg["refusal"] = None
        if reasoning:
            msg[self.reasoning_key] = reasoning
        return msg

    def nonstream_body(self, reasoning: str, content: str, reason: str, usage: UsageReport) -> bytes:
        if self.ctx.endpoint == "chat":
            choice = {
                "index": 0,
                "message": self.message(reasoning, content),
                "logprobs": None,
                "finish_reason": reason,
            }
            obj = {
                "id": self.ctx.response_id,
                "object": "chat.completion",
                "created": self.ctx.created,
                "model": self.ctx.model,
                "choices": [choice],
                "usage": self.usage_obj(usage),
                "system_fingerprint": None,
            }
        else:
            choice = {"index": 0, "text": reasoning + content, "logprobs": None, "finish_reason": reason}
            obj = {
                "id": self.ctx.response_id,
                "object": "text_completion",
                "created": self.ctx.created,
                "model": self.ctx.model,
                "choices": [choice],
                "usage": self.usage_obj(usage),
            }
        return self.dumps(obj)

    # -- errors and small endpoints ----------------------------------------------------------

    def error_body(self, status: int, message: str) -> bytes:
        return self.dumps({"error": {"message": message, "type": error_type(status), "param": None, "code": None}})

    def error(self, status: int, message: str) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        """A complete error response (status, headers, body) in this style."""
        return status, [(b"content-type", b"application/json")], self.error_body(status, message)

    def validation_error(self, field_name: str, body: Any) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        """A missing required field."""
        return self.error(400, f"'{field_name}' is a required property")

    def not_found(self) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        return self.error(404, "Not Found")

    def models_body(self, model: str, created: int, max_context_tokens: int | None) -> bytes:
        entry: dict[str, Any] = {"id": model, "object": "model", "created": created, "owned_by": "mlxproxy-sim"}
        return self.dumps({"object": "list", "data": [entry]})

    def health_body(self) -> bytes:
        return self.dumps({"status": "ok"})


JSON_HEADERS = [(b"content-type", b"application/json")]


def detail_validation_error(style: Style, field_name: str, body: Any) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """A missing required field as FastAPI/pydantic reports it: 422 with a `detail` list."""
    detail = [{"type": "missing", "loc": ["body", field_name], "msg": "Field required", "input": body}]
    return 422, list(JSON_HEADERS), style.dumps({"detail": detail})


class DetailErrors(Style):
    """FastAPI servers whose own errors are `{"detail": ...}` (vllm-mlx, Rapid-MLX, mlx-vlm, omni)."""

    def error_body(self, status: int, message: str) -> bytes:
        return self.dumps({"detail": message})

    def validation_error(self, field_name: str, body: Any) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        return detail_validation_error(self, field_name, body)
