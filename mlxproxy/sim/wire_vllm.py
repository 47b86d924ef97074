"""Styles of the vllm-mlx lineage: vllm-mlx, its fork Rapid-MLX, and oMLX (same chunk shapes).

Following docs/WIRE.md#what-each-server-sends and tests/fixtures/{wire,real}; see `wire_servers.py` for the
simplifications shared by every style.
"""

from __future__ import annotations

from typing import Any

from mlxproxy.sim.wire import DONE, DetailErrors, Style, UsageReport, comment, hex_id, sse


class VllmMlxStyle(DetailErrors):
    """vllm-mlx: compact JSON with nulls, role-only first chunk, usage on the last token and again."""

    name = "vllm-mlx"
    refusal_member = False
    keepalive_comment = comment("heartbeat")
    finish_on_last_token = True
    per_chunk_completion_ids = True

    @classmethod
    def make_id(cls, seed: str, endpoint: str = "chat") -> str:
        return ("chatcmpl-" if endpoint == "chat" else "cmpl-") + hex_id(seed, 8)

    def _chunk(self, choices: list[Any], usage: Any = None, **extra: Any) -> bytes:
        chat = self.ctx.endpoint == "chat"
        response_id = self.ctx.response_id
        if not chat and self.per_chunk_completion_ids:
            self._n = getattr(self, "_n", 0) + 1
            response_id = "cmpl-" + hex_id(f"{self.ctx.response_id}|{self._n}", 8)
        obj = {
            "id": response_id,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": self.ctx.created,
            "model": self.ctx.model,
            "choices": choices,
            "usage": usage,
        }
        if chat:
            obj["generation_metadata"] = None
        obj.update(extra)  # (vllm-mlx's own streams pass none)
        return sse(self.dumps(obj))

    def _choice(self, delta: dict[str, Any] | None, text: str | None, finish: str | None) -> dict[str, Any]:
        if self.ctx.endpoint == "chat":
            return {"index": 0, "delta": delta or {}, "finish_reason": finish}
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}

    def open_stream(self) -> bytes:
        return self._chunk([self._choice({"role": "assistant"}, None, None)]) if self.ctx.endpoint == "chat" else b""

    def usage_obj(self, usage: UsageReport) -> dict[str, Any]:
        return {
            "prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens,
        }

    def finish(self, reason: str, usage: UsageReport, last: tuple[str, str] | None = None) -> bytes:
        kind, text = last if last is not None else ("content", "")
        delta = self.delta(kind, text) if last is not None else {}
        out = self._chunk([self._choice(delta, text, reason)], usage=self.usage_obj(usage))
        if self.ctx.include_usage:
            out += self._chunk([], usage=self.usage_obj(usage))
        return out + DONE

    def stream_error(self, message: str, reason: str, usage: UsageReport) -> tuple[bytes, str]:
        return DONE, "end"  # the exception is logged and swallowed: only [DONE]

    def nonstream_body(self, reasoning: str, content: str, reason: str, usage: UsageReport) -> bytes:
        if self.ctx.endpoint != "chat":
            return Style.nonstream_body(self, reasoning, content, reason, usage)
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

    def health_body(self) -> bytes:
        return self.dumps({"status": "healthy"})


class RapidMlxStyle(VllmMlxStyle):
    """Rapid-MLX fast path: no finish_reason/usage keys on token chunks, usage only on request."""

    name = "rapid-mlx"
    keepalive_comment = comment("keepalive")
    finish_on_last_token = False

    def stream_headers(self) -> list[tuple[bytes, bytes]]:
        return [
            (b"cache-control", b"no-cache, no-transform"),
            (b"x-accel-buffering", b"no"),
            (b"content-type", b"text/event-stream; charset=utf-8"),
        ]

    def _chunk(self, choices: list[Any], usage: Any = None, **extra: Any) -> bytes:
        chat = self.ctx.endpoint == "chat"
        obj: dict[str, Any] = {
            "id": self.ctx.response_id,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": self.ctx.created,
            "model": self.ctx.model,
            "choices": choices,
            **extra,
        }
        if usage is not None:
            obj["usage"] = usage
        return sse(self.dumps(obj))

    def _choice(self, delta: dict[str, Any] | None, text: str | None, finish: str | None) -> dict[str, Any]:
        choice: dict[str, Any] = (
            {"index": 0, "delta": delta or {}} if self.ctx.endpoint == "chat" else {"index": 0, "text": text or ""}
        )
        if finish is not None:
            choice["finish_reason"] = finish
        return choice

    def usage_obj(self, usage: UsageReport) -> dict[str, Any]:
        obj: dict[str, Any] = {
            "prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens,
        }
        if usage.reasoning_chars:  # estimated from the character ratio, as the real server does
            estimate = round(usage.completion_tokens * usage.reasoning_chars / max(usage.total_chars, 1))
            obj["completion_tokens_details"] = {"reasoning_tokens": estimate}
        return obj

    def finish(self, reason: str, usage: UsageReport, last: tuple[str, str] | None = None) -> bytes:
        metrics = {
            "time_to_first_token_ms": (usage.ttft_s or 0.0) * 1000.0,
            "mean_itl_ms": (usage.decode_s or 0.0) * 1000.0 / max(usage.n_visible - 1, 1),
        }
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
        return [
            (b"x-accel-buffering", b"no"),
            (b"cache-control", b"no-cache"),
            (b"content-type", b"text/event-stream; charset=utf-8"),
        ]

    def open_stream(self) -> bytes:
        return self.keepalive_comment + super().open_stream()

    def usage_obj(self, usage: UsageReport) -> dict[str, Any]:
        ttft, decode, total = usage.ttft_s or 0.0, usage.decode_s or 0.0, usage.total_s or 0.0
        return {
            "prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens,
            "cached_tokens": usage.cached_tokens,
            "time_to_first_token": round(ttft, 2),
            "total_time": round(total, 2),
            "prompt_eval_duration": round(ttft, 2),
            "generation_duration": round(decode, 2),
            "prompt_tokens_per_second": round(usage.prompt_tokens / ttft, 2) if ttft else 0.0,
            "generation_tokens_per_second": round(usage.completion_tokens / decode, 2) if decode else 0.0,
        }

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
        plain = {
            "prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens,
        }
        if self.ctx.endpoint != "chat":
            choice: dict[str, Any] = {"index": 0, "text": reasoning + content, "finish_reason": reason}
            obj_name = "text_completion"
        else:
            choice = {"index": 0, "message": self.message(reasoning, content), "finish_reason": reason}
            obj_name = "chat.completion"
        return self.dumps(
            {
                "id": self.ctx.response_id,
                "object": obj_name,
                "created": self.ctx.created,
                "model": self.ctx.model,
                "choices": [choice],
                "usage": plain,
            }
        )

    def error_body(self, status: int, message: str) -> bytes:
        return Style.error_body(self, status, message)

    def validation_error(self, field_name: str, body: Any) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        return self.error(422, f"body.{field_name}: Field required")

    def health_body(self) -> bytes:
        return Style.health_body(self)

    def models_body(self, model: str, created: int, max_context_tokens: int | None) -> bytes:
        entry = {
            "id": model,
            "object": "model",
            "created": created,
            "owned_by": "omlx",
            "capabilities": {"max_tokens": max_context_tokens},
        }
        return self.dumps({"object": "list", "data": [entry]})
