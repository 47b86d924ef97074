"""One `Style` per real MLX server, copied from docs/WIRE.md and the recorded fixtures.

Deliberate simplifications (the body bytes are copied; these are not): every style is served
over HTTP/1.1 by uvicorn (mlx_lm.server speaks HTTP/1.0 and ends the body at connection
close); `created` stays fixed within a response; ids are deterministic per request.
"""

from __future__ import annotations

from typing import Any

from mlxproxy.sim.wire import (
    DONE,
    SSE_HEADERS,
    Style,
    UsageReport,
    comment,
    dumps_spaced,
    error_type,
    hex_id,
    sse,
    uuid_like,
)

JSON = [(b"content-type", b"application/json")]


class _DetailErrors(Style):
    """FastAPI servers whose own errors are `{"detail": ...}` (vllm-mlx, Rapid-MLX, mlx-vlm, omni)."""

    def error_body(self, status: int, message: str) -> bytes:
        return self.dumps({"detail": message})

    def validation_error(self, field_name: str, body: Any) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        detail = [{"type": "missing", "loc": ["body", field_name], "msg": "Field required", "input": body}]
        return 422, JSON, self.dumps({"detail": detail})


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
        return [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
                (b"access-control-allow-origin", b"*"), (b"access-control-allow-methods", b"*"),
                (b"access-control-allow-headers", b"*")]

    def _envelope(self, obj_name: str, choices: list[Any], **extra: Any) -> bytes:
        obj = {"id": self.ctx.response_id, "system_fingerprint": self.fingerprint, "object": obj_name,
               "model": self.ctx.model, "created": self.ctx.created, "choices": choices, **extra}
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
        return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
                "total_tokens": usage.total_tokens, "prompt_tokens_details": {"cached_tokens": 0}}

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
        return 404, JSON, b"Not Found"

    def validation_error(self, field_name: str, body: Any) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        return self.error(404, f"'{field_name}'")


class MlxOpenAIServerStyle(Style):
    """mlx-openai-server: spaced JSON, `chatcmpl_` ids, role-only first chunk, usage always on finish."""

    name = "mlx-openai-server"
    supports_completions = False

    @classmethod
    def make_id(cls, seed: str, endpoint: str = "chat") -> str:
        return "chatcmpl_" + hex_id(seed, 32)

    def dumps(self, obj: Any) -> bytes:
        return dumps_spaced(obj)

    def stream_headers(self) -> list[tuple[bytes, bytes]]:
        return [(b"cache-control", b"no-cache"), (b"connection", b"keep-alive"), (b"x-accel-buffering", b"no"),
                (b"content-type", b"text/event-stream; charset=utf-8")]

    def _chunk(self, choices: list[Any], **extra: Any) -> bytes:
        obj = {"id": self.ctx.response_id, "choices": choices, "created": self.ctx.created,
               "model": self.ctx.model, "object": "chat.completion.chunk", **extra,
               "request_id": "req-" + self.ctx.response_id[-8:]}
        return sse(self.dumps(obj))

    def open_stream(self) -> bytes:
        return self._chunk([{"delta": {"role": "assistant"}, "index": 0}])

    def piece(self, kind: str, text: str, rate_tps: float | None = None) -> bytes:
        delta = {"role": "assistant", "reasoning_content": text} if kind == "reasoning" else {"content": text, "role": "assistant"}
        return self._chunk([{"delta": delta, "index": 0}])

    def usage_obj(self, usage: UsageReport) -> dict[str, Any]:
        return {"prompt_tokens": usage.prompt_tokens, "total_tokens": usage.total_tokens,
                "completion_tokens": usage.completion_tokens, "prompt_tokens_details": {"cached_tokens": 0}}

    def finish(self, reason: str, usage: UsageReport, last: tuple[str, str] | None = None) -> bytes:
        # Never "length": the server only ever says stop (or tool_calls).
        return self._chunk([{"delta": {}, "finish_reason": "stop", "index": 0}], usage=self.usage_obj(usage)) + DONE

    def stream_error(self, message: str, reason: str, usage: UsageReport) -> tuple[bytes, str]:
        err = sse(self.dumps({"error": {"message": message, "type": "server_error", "param": None, "code": "500"}}))
        return err + self.finish("stop", usage), "end"

    def message(self, reasoning: str, content: str) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning:
            msg["reasoning_content"] = reasoning
        return msg

    def nonstream_body(self, reasoning: str, content: str, reason: str, usage: UsageReport) -> bytes:
        choice = {"finish_reason": "stop", "index": 0, "message": self.message(reasoning, content)}
        obj = {"id": self.ctx.response_id, "choices": [choice], "created": self.ctx.created, "model": self.ctx.model,
               "object": "chat.completion", "usage": self.usage_obj(usage)}
        return self.dumps(obj)

    def error_body(self, status: int, message: str) -> bytes:
        return self.dumps({"error": {"message": message, "type": error_type(status), "param": None, "code": str(status)}})

    def not_found(self) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        return 404, JSON, self.dumps({"detail": "Not Found"})

    def validation_error(self, field_name: str, body: Any) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        return _DetailErrors.validation_error(self, field_name, body)  # type: ignore[arg-type]


class MlxOmniServerStyle(_DetailErrors):
    """mlx-omni-server: spaced JSON, reasoning as plain content, finish_reason repeated with usage."""

    name = "mlx-omni-server"
    supports_completions = False
    requires_model = True  # pydantic: a missing `model` is a 422

    @classmethod
    def make_id(cls, seed: str, endpoint: str = "chat") -> str:
        return "chatcmpl-" + hex_id(seed, 10)

    def dumps(self, obj: Any) -> bytes:
        return dumps_spaced(obj)

    def stream_headers(self) -> list[tuple[bytes, bytes]]:
        return [(b"cache-control", b"no-cache"), (b"connection", b"keep-alive"),
                (b"content-type", b"text/event-stream; charset=utf-8")]

    def _chunk(self, choice: dict[str, Any], **extra: Any) -> bytes:
        obj = {"id": self.ctx.response_id, "object": "chat.completion.chunk", "created": self.ctx.created,
               "model": self.ctx.model, "choices": [choice], **extra}
        return sse(self.dumps(obj))

    def open_stream(self) -> bytes:
        return b""

    def piece(self, kind: str, text: str, rate_tps: float | None = None) -> bytes:
        return self._chunk({"index": 0, "delta": {"role": "assistant", "content": text}})

    def usage_obj(self, usage: UsageReport) -> dict[str, Any]:
        return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
                "total_tokens": usage.total_tokens}

    def finish(self, reason: str, usage: UsageReport, last: tuple[str, str] | None = None) -> bytes:
        choice = {"index": 0, "delta": {"role": "assistant"}, "finish_reason": "stop"}
        out = self._chunk(choice)
        if self.ctx.include_usage:
            out += self._chunk(choice, usage=self.usage_obj(usage))
        return out + DONE

    def stream_error(self, message: str, reason: str, usage: UsageReport) -> tuple[bytes, str]:
        return b"", "close"

    def message(self, reasoning: str, content: str) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning:
            msg["reasoning"] = reasoning
        return msg

    def nonstream_body(self, reasoning: str, content: str, reason: str, usage: UsageReport) -> bytes:
        choice = {"index": 0, "message": self.message(reasoning, content), "finish_reason": reason}
        obj = {"id": self.ctx.response_id, "object": "chat.completion", "created": self.ctx.created,
               "model": self.ctx.model, "choices": [choice], "usage": self.usage_obj(usage)}
        return self.dumps(obj)


class VllmMlxStyle(_DetailErrors):
    """vllm-mlx: compact JSON with nulls, role-only first chunk, usage on the last token and again."""

    name = "vllm-mlx"
    keepalive_comment = comment("heartbeat")
    finish_on_last_token = True
    per_chunk_completion_ids = True

    @classmethod
    def make_id(cls, seed: str, endpoint: str = "chat") -> str:
        return ("chatcmpl-" if endpoint == "chat" else "cmpl-") + hex_id(seed, 8)

    def _chunk(self, choices: list[Any], usage: Any = None) -> bytes:
        chat = self.ctx.endpoint == "chat"
        response_id = self.ctx.response_id
        if not chat and self.per_chunk_completion_ids:
            self._n = getattr(self, "_n", 0) + 1
            response_id = "cmpl-" + hex_id(f"{self.ctx.response_id}|{self._n}", 8)
        obj = {"id": response_id, "object": "chat.completion.chunk" if chat else "text_completion",
               "created": self.ctx.created, "model": self.ctx.model, "choices": choices, "usage": usage}
        if chat:
            obj["generation_metadata"] = None
        return sse(self.dumps(obj))

    def _choice(self, delta: dict[str, Any] | None, text: str | None, finish: str | None) -> dict[str, Any]:
        if self.ctx.endpoint == "chat":
            return {"index": 0, "delta": delta or {}, "finish_reason": finish}
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}

    def open_stream(self) -> bytes:
        return self._chunk([self._choice({"role": "assistant"}, None, None)]) if self.ctx.endpoint == "chat" else b""

    def usage_obj(self, usage: UsageReport) -> dict[str, Any]:
        return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
                "total_tokens": usage.total_tokens}

    def finish(self, reason: str, usage: UsageReport, last: tuple[str, str] | None = None) -> bytes:
        kind, text = last if last is not None else ("content", "")
        delta = self.delta(kind, text) if last is not None else {}
        out = self._chunk([self._choice(delta, text, reason)], usage=self.usage_obj(usage))
        if self.ctx.include_usage:
            out += self._chunk([], usage=self.usage_obj(usage))
        return out + DONE

    def stream_error(self, message: str, reason: str, usage: UsageReport) -> tuple[bytes, str]:
        return DONE, "end"  # the exception is logged and swallowed: only [DONE]

    def message(self, reasoning: str, content: str) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning:
            msg["reasoning_content"] = reasoning
        return msg

    def nonstream_body(self, reasoning: str, content: str, reason: str, usage: UsageReport) -> bytes:
        if self.ctx.endpoint != "chat":
            return Style.nonstream_body(self, reasoning, content, reason, usage)
        choice = {"index": 0, "message": self.message(reasoning, content), "finish_reason": reason}
        obj = {"id": self.ctx.response_id, "object": "chat.completion", "created": self.ctx.created,
               "model": self.ctx.model, "choices": [choice], "usage": self.usage_obj(usage)}
        return self.dumps(obj)

    def health_body(self) -> bytes:
        return self.dumps({"status": "healthy"})


class RapidMlxStyle(VllmMlxStyle):
    """Rapid-MLX fast path: no finish_reason/usage keys on token chunks, usage only on request."""

    name = "rapid-mlx"
    keepalive_comment = comment("keepalive")
    finish_on_last_token = False

    def stream_headers(self) -> list[tuple[bytes, bytes]]:
        return [(b"cache-control", b"no-cache, no-transform"), (b"x-accel-buffering", b"no"),
                (b"content-type", b"text/event-stream; charset=utf-8")]

    def _chunk(self, choices: list[Any], usage: Any = None, **extra: Any) -> bytes:
        chat = self.ctx.endpoint == "chat"
        obj: dict[str, Any] = {"id": self.ctx.response_id, "object": "chat.completion.chunk" if chat else "text_completion",
                               "created": self.ctx.created, "model": self.ctx.model, "choices": choices, **extra}
        if usage is not None:
            obj["usage"] = usage
        return sse(self.dumps(obj))

    def _choice(self, delta: dict[str, Any] | None, text: str | None, finish: str | None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "delta": delta or {}} if self.ctx.endpoint == "chat" else {"index": 0, "text": text or ""}
        if finish is not None:
            choice["finish_reason"] = finish
        return choice

    def usage_obj(self, usage: UsageReport) -> dict[str, Any]:
        obj: dict[str, Any] = {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
                               "total_tokens": usage.total_tokens}
        if usage.reasoning_chars:  # estimated from the character ratio, as the real server does
            estimate = round(usage.completion_tokens * usage.reasoning_chars / max(usage.total_chars, 1))
            obj["completion_tokens_details"] = {"reasoning_tokens": estimate}
        return obj

    def finish(self, reason: str, usage: UsageReport, last: tuple[str, str] | None = None) -> bytes:
        metrics = {"time_to_first_token_ms": (usage.ttft_s or 0.0) * 1000.0,
                   "mean_itl_ms": (usage.decode_s or 0.0) * 1000.0 / max(usage.n_visible - 1, 1)}
        out = self._chunk([self._choice({}, "", reason)], metrics=metrics)
        if self.ctx.include_usage:
            out += self._chunk([], usage=self.usage_obj(usage))
        return out + DONE

    def stream_error(self, message: str, reason: str, usage: UsageReport) -> tuple[bytes, str]:
        err = {"error": {"message": message, "type": "server_error", "param": None, "code": None}}
        return sse(self.dumps(err)) + DONE, "end"


class OmlxStyle(RapidMlxStyle):
    """oMLX: `: keep-alive` first, OpenAI error bodies, usage with timing claims, leading spaces."""

    name = "omlx"
    keepalive_comment = comment("keep-alive")

    def stream_headers(self) -> list[tuple[bytes, bytes]]:
        return [(b"x-accel-buffering", b"no"), (b"cache-control", b"no-cache"),
                (b"content-type", b"text/event-stream; charset=utf-8")]

    def open_stream(self) -> bytes:
        return self.keepalive_comment + super().open_stream()

    def usage_obj(self, usage: UsageReport) -> dict[str, Any]:
        ttft, decode, total = usage.ttft_s or 0.0, usage.decode_s or 0.0, usage.total_s or 0.0
        return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
                "total_tokens": usage.total_tokens, "cached_tokens": 0,
                "time_to_first_token": round(ttft, 2), "total_time": round(total, 2),
                "prompt_eval_duration": round(ttft, 2), "generation_duration": round(decode, 2),
                "prompt_tokens_per_second": round(usage.prompt_tokens / ttft, 2) if ttft else 0.0,
                "generation_tokens_per_second": round(usage.completion_tokens / decode, 2) if decode else 0.0}

    def finish(self, reason: str, usage: UsageReport, last: tuple[str, str] | None = None) -> bytes:
        out = self._chunk([self._choice({}, "", reason)])
        if self.ctx.include_usage:
            out += self._chunk([], usage=self.usage_obj(usage))
        return out + DONE

    def stream_error(self, message: str, reason: str, usage: UsageReport) -> tuple[bytes, str]:
        return sse(self.dumps({"error": {"message": message, "type": "server_error"}})) + DONE, "end"

    def nonstream_prefix(self) -> bytes:
        return b" "

    def nonstream_body(self, reasoning: str, content: str, reason: str, usage: UsageReport) -> bytes:
        plain = {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
                 "total_tokens": usage.total_tokens}
        if self.ctx.endpoint != "chat":
            choice: dict[str, Any] = {"index": 0, "text": reasoning + content, "finish_reason": reason}
            obj_name = "text_completion"
        else:
            choice = {"index": 0, "message": self.message(reasoning, content), "finish_reason": reason}
            obj_name = "chat.completion"
        return self.dumps({"id": self.ctx.response_id, "object": obj_name, "created": self.ctx.created,
                           "model": self.ctx.model, "choices": [choice], "usage": plain})

    def error_body(self, status: int, message: str) -> bytes:
        return Style.error_body(self, status, message)

    def validation_error(self, field_name: str, body: Any) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        return self.error(422, f"body.{field_name}: Field required")

    def models_body(self, model: str, created: int, max_context_tokens: int | None) -> bytes:
        entry = {"id": model, "object": "model", "created": created, "owned_by": "omlx",
                 "capabilities": {"max_tokens": max_context_tokens}}
        return self.dumps({"object": "list", "data": [entry]})


class MlxVlmStyle(_DetailErrors):
    """mlx-vlm: every delta field present (nulls), both reasoning fields, per-chunk timings."""

    name = "mlx-vlm"
    supports_completions = False

    @classmethod
    def make_id(cls, seed: str, endpoint: str = "chat") -> str:
        return "chatcmpl-" + uuid_like(seed)

    def _chunk(self, choices: list[Any], usage: Any, timings: dict[str, Any]) -> bytes:
        obj = {"id": self.ctx.response_id, "object": "chat.completion.chunk", "created": self.ctx.created,
               "model": self.ctx.model, "choices": choices, "usage": usage, "timings": timings}
        return sse(self.dumps(obj))

    @staticmethod
    def _full_delta(content: str | None = None, reasoning: str | None = None) -> dict[str, Any]:
        return {"role": "assistant", "content": content, "reasoning_content": reasoning, "reasoning": reasoning,
                "tool_calls": None, "tool_call_id": None, "name": None}

    def open_stream(self) -> bytes:
        return b""

    def piece(self, kind: str, text: str, rate_tps: float | None = None) -> bytes:
        delta = self._full_delta(reasoning=text) if kind == "reasoning" else self._full_delta(content=text)
        choice = {"index": 0, "finish_reason": None, "delta": delta, "logprobs": None}
        rate = round(rate_tps, 1) if rate_tps is not None else None
        return self._chunk([choice], None, {"predicted_per_second": rate})

    def finish(self, reason: str, usage: UsageReport, last: tuple[str, str] | None = None) -> bytes:
        decode = usage.decode_s or 0.0
        rate = round((usage.n_visible - 1) / decode, 1) if decode > 0 else None
        choice = {"index": 0, "finish_reason": reason, "delta": self._full_delta(), "logprobs": None}
        out = self._chunk([choice], None, {"predicted_per_second": rate})
        if self.ctx.include_usage:
            ttft = usage.ttft_s or 0.0
            timings = {"prompt_n": usage.prompt_tokens, "cache_n": 0, "predicted_n": usage.completion_tokens,
                       "prompt_ms": round(ttft * 1000, 1),
                       "prompt_per_token_ms": round(ttft * 1000 / max(usage.prompt_tokens, 1), 2),
                       "prompt_per_second": round(usage.prompt_tokens / ttft, 1) if ttft else None,
                       "predicted_ms": round(decode * 1000, 1),
                       "predicted_per_token_ms": round(decode * 1000 / max(usage.n_visible - 1, 1), 2),
                       "predicted_per_second": rate, "peak_memory": 19.8, "draft_kind": None,
                       "draft_rounds": None, "draft_n": None, "draft_n_accepted": None}
            usage_obj = {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
                         "total_tokens": usage.total_tokens, "prompt_tokens_details": {"cached_tokens": 0}}
            out += self._chunk([], usage_obj, timings)
        return out + DONE

    def stream_error(self, message: str, reason: str, usage: UsageReport) -> tuple[bytes, str]:
        return sse(self.dumps({"error": message})), "end"  # a plain string, and no [DONE]

    def nonstream_body(self, reasoning: str, content: str, reason: str, usage: UsageReport) -> bytes:
        message = {"role": "assistant", "content": content, "reasoning_content": reasoning or None,
                   "reasoning": reasoning or None, "tool_calls": None}
        choice = {"index": 0, "finish_reason": reason, "message": message, "logprobs": None}
        usage_obj = {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
                     "total_tokens": usage.total_tokens, "prompt_tokens_details": {"cached_tokens": 0}}
        return self.dumps({"id": self.ctx.response_id, "object": "chat.completion", "created": self.ctx.created,
                           "model": self.ctx.model, "choices": [choice], "usage": usage_obj})


SERVER_STYLES: dict[str, type[Style]] = {
    cls.name: cls
    for cls in (MlxLmStyle, MlxOpenAIServerStyle, MlxOmniServerStyle, VllmMlxStyle, RapidMlxStyle, OmlxStyle, MlxVlmStyle)
}

__all__ = ["SERVER_STYLES", "SSE_HEADERS"]
