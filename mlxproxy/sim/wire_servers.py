"""One `Style` per real MLX server, following docs/WIRE.md#what-each-server-sends and the fixtures.

This module: mlx_lm.server, mlx-openai-server, mlx-omni-server, mlx-vlm; the vllm-mlx
lineage (vllm-mlx, Rapid-MLX, oMLX) is in `wire_vllm.py`.

Deliberate simplifications (docs/WIRE.md#the-simulators-styles; the body bytes follow the
servers, these do not): every style is served
over HTTP/1.1 by uvicorn (mlx_lm.server speaks HTTP/1.0 and ends the body at connection
close); `created` stays fixed within a response; ids are deterministic per request.
"""

from __future__ import annotations

from typing import Any

from mlxproxy.sim.wire import (
    DONE,
    JSON_HEADERS,
    DetailErrors,
    Style,
    UsageReport,
    comment,
    detail_validation_error,
    dumps_spaced,
    error_type,
    hex_id,
    sse,
    uuid_like,
)


class MlxLmStyle(Style):
    """mlx_lm.server: spaced JSON, role in every delta, `reasoning`, `: keepalive P/T` comments."""

    name = "mlx-lm"
    fingerprint = "0.32.2-0.32.4-mlxproxy-sim"

    @classmethod
    def make_id(cls, seed: str, endpoint: str = "chat") -> str:
        return ("chatcmpl-" if endpoint == "chat" else "cmpl-") + uuid_like(seed)

    def dumps(self, obj: Any) -> bytes:
        return dumps_spaced(obj)

    def stream_headers(self) -> list[tuple[bytes, bytes]]:
        return [
            (b"content-type", b"text/event-stream"),
            (b"cache-control", b"no-cache"),
            (b"access-control-allow-origin", b"*"),
            (b"access-control-allow-methods", b"*"),
            (b"access-control-allow-headers", b"*"),
        ]

    def _envelope(self, obj_name: str, choices: list[Any], **extra: Any) -> bytes:
        obj = {
            "id": self.ctx.response_id,
            "system_fingerprint": self.fingerprint,
            "object": obj_name,
            "model": self.ctx.model,
            "created": self.ctx.created,
            "choices": choices,
            **extra,
        }
        return self.dumps(obj)

    def _stream_chunk(self, finish: str | None, delta: dict[str, Any] | None, text: str | None) -> bytes:
        if self.ctx.endpoint == "chat":
            choice = {"index": 0, "finish_reason": finish, "delta": {"role": "assistant", **(delta or {})}}
            return sse(self._envelope("chat.completion.chunk", [choice]))
        choice = {"index": 0, "finish_reason": finish, "text": text or ""}
        return sse(self._envelope("text_completion", [choice]))

    def open_stream(self) -> bytes:
        return b""

    def progress(self, processed_tokens: int, total_tokens: int) -> bytes:
        return comment(f"keepalive {processed_tokens}/{total_tokens}")

    def piece(self, kind: str, text: str, rate_tps: float | None = None) -> bytes:
        field = "reasoning" if kind == "reasoning" else "content"
        return self._stream_chunk(None, {field: text}, text)

    def usage_obj(self, usage: UsageReport) -> dict[str, Any]:
        return {
            "prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
        }

    def finish(self, reason: str, usage: UsageReport, last: tuple[str, str] | None = None) -> bytes:
        out = self._stream_chunk(reason, None, "")
        if self.ctx.stream_options_without_include_usage:
            return out  # KeyError in the real server: the connection closes here (see truncates_after_finish)
        if self.ctx.include_usage:
            out += sse(self._envelope("chat.completion", [], usage=self.usage_obj(usage)))
        return out + DONE

    @property
    def truncates_after_finish(self) -> bool:
        """`stream_options: {}` makes mlx_lm.server raise KeyError after the finish chunk."""
        return self.ctx.stream_options_without_include_usage

    def stream_error(self, message: str, reason: str, usage: UsageReport) -> tuple[bytes, str]:
        return b"", "close"

    def nonstream_body(self, reasoning: str, content: str, reason: str, usage: UsageReport) -> bytes:
        if self.ctx.endpoint == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": content or None}
            if reasoning:
                message["reasoning"] = reasoning
            choice: dict[str, Any] = {"index": 0, "finish_reason": reason, "message": message}
            return self._envelope("chat.completion", [choice], usage=self.usage_obj(usage))
        choice = {"index": 0, "finish_reason": reason, "text": reasoning + content}
        return self._envelope("text_completion", [choice], usage=self.usage_obj(usage))

    def error_body(self, status: int, message: str) -> bytes:
        return self.dumps({"error": message})

    def not_found(self) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        return 404, list(JSON_HEADERS), b"Not Found"

    def validation_error(self, field_name: str, body: Any) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        return self.error(404, f"'{field_name}'")


class MlxOpenAIServerStyle(Style):
    """mlx-openai-server: spaced JSON, `chatcmpl_` ids, role-only first chunk, usage always on finish."""

    name = "mlx-openai-server"
    refusal_member = False
    supports_completions = False

    @classmethod
    def make_id(cls, seed: str, endpoint: str = "chat") -> str:
        return "chatcmpl_" + hex_id(seed, 32)

    def dumps(self, obj: Any) -> bytes:
        return dumps_spaced(obj)

    def stream_headers(self) -> list[tuple[bytes, bytes]]:
        return [
            (b"cache-control", b"no-cache"),
            (b"connection", b"keep-alive"),
            (b"x-accel-buffering", b"no"),
            (b"content-type", b"text/event-stream; charset=utf-8"),
        ]

    def _chunk(self, choices: list[Any], **extra: Any) -> bytes:
        obj = {
            "id": self.ctx.response_id,
            "choices": choices,
            "created": self.ctx.created,
            "model": self.ctx.model,
            "object": "chat.completion.chunk",
            **extra,
            "request_id": "req-" + self.ctx.response_id[-8:],
        }
        return sse(self.dumps(obj))

    def open_stream(self) -> bytes:
        return self._chunk([{"delta": {"role": "assistant"}, "index": 0}])

    def piece(self, kind: str, text: str, rate_tps: float | None = None) -> bytes:
        delta = (
            {"role": "assistant", "reasoning_content": text}
            if kind == "reasoning"
            else {"content": text, "role": "assistant"}
        )
        return self._chunk([{"delta": delta, "index": 0}])

    def usage_obj(self, usage: UsageReport) -> dict[str, Any]:
        return {
            "prompt_tokens": usage.prompt_tokens,
            "total_tokens": usage.total_tokens,
            "completion_tokens": usage.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
        }

    def finish(self, reason: str, usage: UsageReport, last: tuple[str, str] | None = None) -> bytes:
        # Never "length": the server only ever says stop (or tool_calls).
        return self._chunk([{"delta": {}, "finish_reason": "stop", "index": 0}], usage=self.usage_obj(usage)) + DONE

    def stream_error(self, message: str, reason: str, usage: UsageReport) -> tuple[bytes, str]:
        err = sse(self.dumps({"error": {"message": message, "type": "server_error", "param": None, "code": "500"}}))
        return err + self.finish("stop", usage), "end"

    def nonstream_body(self, reasoning: str, content: str, reason: str, usage: UsageReport) -> bytes:
        choice = {"finish_reason": "stop", "index": 0, "message": self.message(reasoning, content)}
        obj = {
            "id": self.ctx.response_id,
            "choices": [choice],
            "created": self.ctx.created,
            "model": self.ctx.model,
            "object": "chat.completion",
            "usage": self.usage_obj(usage),
        }
        return self.dumps(obj)

    def error_body(self, status: int, message: str) -> bytes:
        return self.dumps(
            {"error": {"message": message, "type": error_type(status), "param": None, "code": str(status)}}
        )

    def not_found(self) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        return 404, list(JSON_HEADERS), self.dumps({"detail": "Not Found"})

    def validation_error(self, field_name: str, body: Any) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        return detail_validation_error(self, field_name, body)


class MlxOmniServerStyle(DetailErrors):
    """mlx-omni-server: spaced JSON, reasoning as plain content, finish_reason repeated with usage."""

    name = "mlx-omni-server"
    refusal_member = False
    reasoning_key = "reasoning"
    supports_completions = False
    requires_model = True  # pydantic: a missing `model` is a 422

    @classmethod
    def make_id(cls, seed: str, endpoint: str = "chat") -> str:
        return "chatcmpl-" + hex_id(seed, 10)

    def dumps(self, obj: Any) -> bytes:
        return dumps_spaced(obj)

    def stream_headers(self) -> list[tuple[bytes, bytes]]:
        return [
            (b"cache-control", b"no-cache"),
            (b"connection", b"keep-alive"),
            (b"content-type", b"text/event-stream; charset=utf-8"),
        ]

    def _chunk_of(self, choice: dict[str, Any], **extra: Any) -> bytes:
        obj = {
            "id": self.ctx.response_id,
            "object": "chat.completion.chunk",
            "created": self.ctx.created,
            "model": self.ctx.model,
            "choices": [choice],
            **extra,
        }
        return sse(self.dumps(obj))

    def open_stream(self) -> bytes:
        return b""

    def piece(self, kind: str, text: str, rate_tps: float | None = None) -> bytes:
        return self._chunk_of({"index": 0, "delta": {"role": "assistant", "content": text}})

    def usage_obj(self, usage: UsageReport) -> dict[str, Any]:
        return {
            "prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens,
        }

    def finish(self, reason: str, usage: UsageReport, last: tuple[str, str] | None = None) -> bytes:
        choice = {"index": 0, "delta": {"role": "assistant"}, "finish_reason": "stop"}
        out = self._chunk_of(choice)
        if self.ctx.include_usage:
            out += self._chunk_of(choice, usage=self.usage_obj(usage))
        return out + DONE

    def stream_error(self, message: str, reason: str, usage: UsageReport) -> tuple[bytes, str]:
        return b"", "close"

    def nonstream_body(self, reasoning: str, content: str, reason: str, usage: UsageReport) -> bytes:
        choice = {"index": 0, "message": self.message(reasoning, content), "finish_reason": reason}
        obj = {
            "id": self.ctx.response_id,
            "object": "chat.completion",
            "created": self.ctx.created,
            "model": self.ctx.model,
            "choices": [choice],
            "usage": self.usage_obj(usage),
        }
        return self.dumps(obj)


class MlxVlmStyle(DetailErrors):
    """mlx-vlm: every delta field present (nulls), both reasoning fields, per-chunk timings."""

    name = "mlx-vlm"
    supports_completions = False

    @classmethod
    def make_id(cls, seed: str, endpoint: str = "chat") -> str:
        return "chatcmpl-" + uuid_like(seed)

    def _timed_chunk(self, choices: list[Any], usage: Any, timings: dict[str, Any]) -> bytes:
        obj = {
            "id": self.ctx.response_id,
            "object": "chat.completion.chunk",
            "created": self.ctx.created,
            "model": self.ctx.model,
            "choices": choices,
            "usage": usage,
            "timings": timings,
        }
        return sse(self.dumps(obj))

    @staticmethod
    def _full_delta(content: str | None = None, reasoning: str | None = None) -> dict[str, Any]:
        return {
            "role": "assistant",
            "content": content,
            "reasoning_content": reasoning,
            "reasoning": reasoning,
            "tool_calls": None,
            "tool_call_id": None,
            "name": None,
        }

    def open_stream(self) -> bytes:
        return b""

    def piece(self, kind: str, text: str, rate_tps: float | None = None) -> bytes:
        delta = self._full_delta(reasoning=text) if kind == "reasoning" else self._full_delta(content=text)
        choice = {"index": 0, "finish_reason": None, "delta": delta, "logprobs": None}
        rate = round(rate_tps, 1) if rate_tps is not None else None
        return self._timed_chunk([choice], None, {"predicted_per_second": rate})

    def finish(self, reason: str, usage: UsageReport, last: tuple[str, str] | None = None) -> bytes:
        decode = usage.decode_s or 0.0
        rate = round((usage.n_visible - 1) / decode, 1) if decode > 0 else None
        choice = {"index": 0, "finish_reason": reason, "delta": self._full_delta(), "logprobs": None}
        out = self._timed_chunk([choice], None, {"predicted_per_second": rate})
        if self.ctx.include_usage:
            ttft = usage.ttft_s or 0.0
            timings = {
                "prompt_n": usage.prompt_tokens,
                "cache_n": 0,
                "predicted_n": usage.completion_tokens,
                "prompt_ms": round(ttft * 1000, 1),
                "prompt_per_token_ms": round(ttft * 1000 / max(usage.prompt_tokens, 1), 2),
                "prompt_per_second": round(usage.prompt_tokens / ttft, 1) if ttft else None,
                "predicted_ms": round(decode * 1000, 1),
                "predicted_per_token_ms": round(decode * 1000 / max(usage.n_visible - 1, 1), 2),
                "predicted_per_second": rate,
                "peak_memory": 19.8,
                "draft_kind": None,
                "draft_rounds": None,
                "draft_n": None,
                "draft_n_accepted": None,
            }
            usage_obj = {
                "prompt_tokens": usage.prompt_tokens,
                "completion_tokens": usage.completion_tokens,
                "total_tokens": usage.total_tokens,
                "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
            }
            out += self._timed_chunk([], usage_obj, timings)
        return out + DONE

    def stream_error(self, message: str, reason: str, usage: UsageReport) -> tuple[bytes, str]:
        return sse(self.dumps({"error": message})), "end"  # a plain string, and no [DONE]

    def nonstream_body(self, reasoning: str, content: str, reason: str, usage: UsageReport) -> bytes:
        message = {
            "role": "assistant",
            "content": content,
            "reasoning_content": reasoning or None,
            "reasoning": reasoning or None,
            "tool_calls": None,
        }
        choice = {"index": 0, "finish_reason": reason, "message": message, "logprobs": None}
        usage_obj = {
            "prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
        }
        return self.dumps(
            {
                "id": self.ctx.response_id,
                "object": "chat.completion",
                "created": self.ctx.created,
                "model": self.ctx.model,
                "choices": [choice],
                "usage": usage_obj,
            }
        )
