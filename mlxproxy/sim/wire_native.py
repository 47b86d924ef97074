"""Ollama's and LM Studio's wire formats, native and compatible ([WIRE.md](WIRE.md#ollama-and-lm-studio)).

`OllamaStyle` writes `/api/chat` and `/api/generate` as NDJSON lines (`api/types.go`,
`server/routes.go`), its OpenAI-compatible chunks (`openai/openai.go`: `fp_ollama`, reasoning
as `reasoning`) with the llama.cpp-style `timings` on the final chunk, and its
Anthropic-compatible Messages events (`anthropic/anthropic.go`). `LmStudioStyle` writes
`/api/v1/chat` events and the `stats` of `/api/v0/*` (lmstudio-ai/docs, `1_developer/2_rest/`).
The profile knob `speed_claims` picks what the servers' own speed figures say: "" (the truth)
or "whole-prompt" (Ollama since 0.33.3: the prompt count includes the cached tokens while the
duration covers only the prefilled ones, `llm/llama_server.go`).
"""

from __future__ import annotations

import json
from typing import Any

import orjson

from mlxproxy.sim.wire import DONE, SSE_HEADERS, Style, UsageReport, WireContext, sse

__all__ = ["OllamaStyle", "LmStudioStyle", "NDJSON_HEADERS"]

NDJSON_HEADERS = [(b"content-type", b"application/x-ndjson")]
_CREATED_AT = "2026-12-06T14:00:00.000000000Z"


def named(event: str, payload: bytes) -> bytes:
    """One SSE event with an `event:` line (Anthropic Messages, LM Studio's v1 chat)."""
    return b"event: " + event.encode() + b"\n" + sse(payload)


class _Native(Style):
    """What the two servers share: tool calls gathered and sent whole at the end."""

    native_endpoints: frozenset[str] = frozenset()
    # no `"usage": null` on every chunk (Ollama's `Usage *Usage` is omitempty; LM Studio's
    # recorded chunks have none)
    null_usage = False
    speed_claims = ""  # set from the profile by the app

    def _decode_s(self, u: UsageReport) -> float:
        return u.decode_s or 0.0

    def __init__(self, ctx: WireContext) -> None:
        super().__init__(ctx)
        self._args: list[str] = []
        self._role_sent = False

    def chunk_fingerprint(self) -> str:
        return self.ctx.model

    def open_stream(self) -> bytes:
        return b""  # no role-only chunk: the role rides on the first token's delta

    def _prompt_claim(self, u: UsageReport) -> int:
        """The prompt count the server's speed figures divide (the knob `speed_claims`)."""
        return u.prompt_tokens if self.speed_claims == "whole-prompt" else u.prompt_tokens - u.cached_tokens


class OllamaStyle(_Native):
    name = "ollama"
    refusal_member = False
    reasoning_key = "reasoning"
    native_endpoints = frozenset({"ollama_chat", "ollama_generate", "messages"})

    # -- native NDJSON -------------------------------------------------------------------------

    def _native(self) -> bool:
        return self.ctx.endpoint in ("ollama_chat", "ollama_generate")

    def chunk_fingerprint(self) -> str:
        return "fp_ollama"

    def _choice(self, delta: dict[str, Any] | None, text: str | None, finish: str | None) -> dict[str, Any]:
        if self.ctx.endpoint == "chat":  # `ChunkChoice`: logprobs omitted when empty
            return {"index": 0, "delta": delta or {}, "finish_reason": finish}
        return {"text": text or "", "index": 0, "finish_reason": finish}

    def stream_headers(self) -> list[tuple[bytes, bytes]]:
        return list(NDJSON_HEADERS) if self._native() else list(SSE_HEADERS)

    def _line(self, content: str = "", thinking: str = "", calls: list[Any] | None = None, **final: Any) -> bytes:
        obj: dict[str, Any] = {"model": self.ctx.model, "created_at": _CREATED_AT}
        if self.ctx.endpoint == "ollama_chat":
            msg: dict[str, Any] = {"role": "assistant", "content": content}
            if thinking:
                msg["thinking"] = thinking
            if calls:
                msg["tool_calls"] = calls
            obj["message"] = msg
        else:
            obj["response"] = content
            if thinking:
                obj["thinking"] = thinking
        obj["done"] = bool(final)
        if final and self.ctx.endpoint == "ollama_generate":  # `GenerateResponse`: the context after done_reason
            final = {"done_reason": final.pop("done_reason"), "context": [151644, 872, 198], **final}
        obj.update(final)
        if calls and self.ctx.endpoint == "ollama_generate":
            obj["tool_calls"] = calls
        return self.dumps(obj) + b"\n"

    def _metrics(self, reason: str, u: UsageReport) -> dict[str, Any]:
        ns = 1_000_000_000
        ttft = u.ttft_s or 0.0
        decode = self._decode_s(u)
        n = u.completion_tokens
        eval_s = decode * n / (n - 1) if n > 1 else decode
        out: dict[str, Any] = {"done_reason": reason if reason != "tool_calls" else "stop"}
        out["total_duration"] = int((u.total_s or 0.0) * ns)
        out["load_duration"] = 250_000
        out["prompt_eval_count"] = self._prompt_claim(u)
        if u.cached_tokens:
            out["prompt_eval_cached_count"] = u.cached_tokens
        out["prompt_eval_duration"] = int(ttft * ns)
        out["eval_count"] = n
        out["eval_duration"] = int(eval_s * ns)
        return out

    def _calls(self) -> list[Any]:
        args = "".join(self._args)
        try:
            parsed: Any = json.loads(args)
        except ValueError:
            parsed = args
        return [
            {
                "id": "call_" + self.ctx.response_id[-8:],
                "function": {"index": 0, "name": self.tool_name, "arguments": parsed},
            }
        ]

    # -- stream --------------------------------------------------------------------------------

    def open_stream(self) -> bytes:
        if self._native():
            return b""
        if self.ctx.endpoint == "messages":
            start = {
                "type": "message_start",
                "message": {
                    "id": "msg_" + self.ctx.response_id[-24:],
                    "type": "message",
                    "role": "assistant",
                    "model": self.ctx.model,
                    "content": [],
                    "usage": {"input_tokens": 0, "output_tokens": 0},
                },
            }
            return named("message_start", self.dumps(start))
        return b""

    def delta(self, kind: str, text: str) -> dict[str, Any]:
        # `toChunk`: the role only on the first chunk; `content` kept even when "" (an `any`)
        d = {"content": "", "reasoning": text} if kind == "reasoning" else super().delta(kind, text)
        if not self._role_sent:
            self._role_sent = True
            return {"role": "assistant", **d}
        return d

    def piece(self, kind: str, text: str, rate_tps: float | None = None) -> bytes:
        if kind == "tool":  # Ollama parses the call whole and sends it at once
            self._args.append(text)
            return b""
        if self._native():
            return self._line(content=text if kind == "content" else "", thinking=text if kind == "reasoning" else "")
        if self.ctx.endpoint == "messages":
            return self._messages_piece(kind, text)
        return super().piece(kind, text, rate_tps)

    _block = -1
    _block_kind = ""

    def _messages_piece(self, kind: str, text: str) -> bytes:
        out = b""
        if kind != self._block_kind:
            if self._block >= 0:
                out += named("content_block_stop", self.dumps({"type": "content_block_stop", "index": self._block}))
            self._block += 1
            self._block_kind = kind
            block = {"type": "thinking", "thinking": ""} if kind == "reasoning" else {"type": "text", "text": ""}
            out += named(
                "content_block_start",
                self.dumps({"type": "content_block_start", "index": self._block, "content_block": block}),
            )
        delta = (
            {"type": "thinking_delta", "thinking": text}
            if kind == "reasoning"
            else {"type": "text_delta", "text": text}
        )
        return out + named(
            "content_block_delta", self.dumps({"type": "content_block_delta", "index": self._block, "delta": delta})
        )

    def _timings(self, u: UsageReport) -> dict[str, Any]:
        prompt_n = self._prompt_claim(u)
        prompt_ms = (u.ttft_s or 0.0) * 1000
        n = u.completion_tokens
        predicted_ms = self._decode_s(u) * 1000 * (n / (n - 1) if n > 1 else 1)
        return {
            "cache_n": u.cached_tokens,
            "prompt_n": prompt_n,
            "prompt_ms": round(prompt_ms, 3),
            "prompt_per_second": round(prompt_n / prompt_ms * 1000, 3) if prompt_ms > 0 else 0.0,
            "predicted_n": n,
            "predicted_ms": round(predicted_ms, 3),
            "predicted_per_second": round(n / predicted_ms * 1000, 3) if predicted_ms > 0 else 0.0,
        }

    def finish(self, reason: str, usage: UsageReport, last: tuple[str, str] | None = None) -> bytes:
        calls = self._calls() if self._args else None
        if self._native():
            out = self._line(calls=calls) if calls else b""
            return out + self._line(**self._metrics(reason, usage))
        if self.ctx.endpoint == "messages":
            out = b""
            if calls:
                out += self._tool_use_events(calls[0])
            elif self._block >= 0:
                out += named("content_block_stop", self.dumps({"type": "content_block_stop", "index": self._block}))
            stop = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}.get(reason, reason)
            delta = {
                "type": "message_delta",
                "delta": {"stop_reason": stop},
                "usage": {"input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens},
            }
            return out + named("message_delta", self.dumps(delta)) + named("message_stop", b'{"type":"message_stop"}')
        out = b""
        if calls:
            call = {
                "index": 0,
                "id": calls[0]["id"],
                "type": "function",
                "function": {"name": self.tool_name, "arguments": "".join(self._args)},
            }
            out += self._chunk([self._choice({"role": "assistant", "tool_calls": [call]}, "", None)])
        out += self._chunk([self._choice({}, "", reason)])
        if self.ctx.include_usage:
            u = self.usage_obj(usage)
            out += self._chunk([], usage=u, timings=self._timings(usage))
        return out + DONE

    def _tool_use_events(self, call: dict[str, Any]) -> bytes:
        self._block += 1
        i = self._block
        block = {"type": "tool_use", "id": call["id"], "name": self.tool_name, "input": {}}
        args = "".join(self._args)
        return (
            named(
                "content_block_start", self.dumps({"type": "content_block_start", "index": i, "content_block": block})
            )
            + named(
                "content_block_delta",
                self.dumps(
                    {
                        "type": "content_block_delta",
                        "index": i,
                        "delta": {"type": "input_json_delta", "partial_json": args},
                    }
                ),
            )
            + named("content_block_stop", self.dumps({"type": "content_block_stop", "index": i}))
        )

    def usage_obj(self, usage: UsageReport) -> dict[str, Any]:
        out = super().usage_obj(usage)
        del out["completion_tokens_details"]  # (its `Usage` has no reasoning count)
        return out

    def stream_error(self, message: str, reason: str, usage: UsageReport) -> tuple[bytes, str]:
        if self._native():
            return self.dumps({"error": message}) + b"\n", "end"
        return super().stream_error(message, reason, usage)

    # -- non-stream ----------------------------------------------------------------------------

    def nonstream_body(self, reasoning: str, content: str, reason: str, usage: UsageReport) -> bytes:
        if self.tool_name and not self._args:  # not streamed: the plan's text is the call's arguments
            self._args, content = [content], ""
        calls = self._calls() if self._args else None
        if self._native():
            return self._line(content, reasoning, calls, **self._metrics(reason, usage))[:-1]
        if self.ctx.endpoint == "messages":
            blocks: list[dict[str, Any]] = []
            if reasoning:
                blocks.append({"type": "thinking", "thinking": reasoning})
            if calls:
                blocks.append(
                    {
                        "type": "tool_use",
                        "id": calls[0]["id"],
                        "name": self.tool_name,
                        "input": calls[0]["function"]["arguments"],
                    }
                )
            else:
                blocks.append({"type": "text", "text": content})
            stop = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}.get(reason, reason)
            obj = {
                "id": "msg_" + self.ctx.response_id[-24:],
                "type": "message",
                "role": "assistant",
                "model": self.ctx.model,
                "content": blocks,
                "stop_reason": stop,
                "usage": {"input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens},
            }
            return self.dumps(obj)
        return super().nonstream_body(reasoning, content, reason, usage)

    def error_body(self, status: int, message: str) -> bytes:
        if self._native():
            return self.dumps({"error": message})
        return super().error_body(status, message)

    def not_found(self) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        return 404, [(b"content-type", b"text/plain")], b"404 page not found"

    def models_body(self, model: str, created: int, max_context_tokens: int | None) -> bytes:
        entry = {"id": model, "object": "model", "created": created, "owned_by": "library"}
        return self.dumps({"object": "list", "data": [entry]})

    def native_get(self, path: str, model: str) -> bytes | None:
        """Ollama's own GET routes that answer without the model (`/api/tags`, `/api/ps`,
        `/api/version`); None for any other path."""
        if path == "/api/tags":
            entry = {"name": model, "model": model, "modified_at": _CREATED_AT, "size": 5_200_000_000,
                     "digest": "0" * 64, "details": {"format": "gguf", "family": "qwen3"}}  # fmt: skip
            return self.dumps({"models": [entry]})
        if path == "/api/ps":
            return self.dumps({"models": []})
        if path == "/api/version":
            return self.dumps({"version": "0.35.1"})
        return None


class LmStudioStyle(_Native):
    name = "lm-studio"
    native_endpoints = frozenset({"lmstudio_chat"})

    def _stats(self, reason: str, u: UsageReport) -> dict[str, Any]:
        n = u.completion_tokens
        decode = self._decode_s(u)
        return {
            "tokens_per_second": (n - 1) / decode if decode > 0 and n > 1 else 0.0,
            "time_to_first_token": round(u.ttft_s or 0.0, 3),
            "generation_time": round(decode, 3),
            "stop_reason": {"stop": "eosFound", "length": "maxPredictedTokensReached"}.get(reason, reason),
        }

    def open_stream(self) -> bytes:
        if self.ctx.endpoint == "lmstudio_chat":
            start = named("chat.start", self.dumps({"type": "chat.start", "model_instance_id": self.ctx.model}))
            return start + self._ev("prompt_processing.start")
        return b""

    _kind = ""

    def delta(self, kind: str, text: str) -> dict[str, Any]:
        return {"role": "assistant", **super().delta(kind, text)} if kind != "tool" else super().delta(kind, text)

    def piece(self, kind: str, text: str, rate_tps: float | None = None) -> bytes:
        if self.ctx.endpoint != "lmstudio_chat":
            return super().piece(kind, text, rate_tps)
        out = b""
        if kind != self._kind:
            if self._kind:
                out += self._ev(f"{self._kind}.end")
            else:
                out += self._ev("prompt_processing.end")
            self._kind = "reasoning" if kind == "reasoning" else "message"
            out += self._ev(f"{self._kind}.start")
        return out + named(f"{self._kind}.delta", self.dumps({"type": f"{self._kind}.delta", "content": text}))

    def _ev(self, kind: str) -> bytes:
        return named(kind, self.dumps({"type": kind}))

    def _result(self, reasoning: str, content: str, u: UsageReport) -> dict[str, Any]:
        output: list[dict[str, Any]] = []
        if reasoning:
            output.append({"type": "reasoning", "content": reasoning})
        output.append({"type": "message", "content": content})
        n = u.completion_tokens
        decode = self._decode_s(u)
        return {
            "model_instance_id": self.ctx.model,
            "output": output,
            "stats": {
                "input_tokens": u.prompt_tokens,
                "total_output_tokens": n,
                "reasoning_output_tokens": u.reasoning_tokens,
                "tokens_per_second": (n - 1) / decode if decode > 0 and n > 1 else 0.0,
                "time_to_first_token_seconds": round(u.ttft_s or 0.0, 3),
            },
            "response_id": "resp_" + self.ctx.response_id[-24:],
        }

    def finish(self, reason: str, usage: UsageReport, last: tuple[str, str] | None = None) -> bytes:
        if self.ctx.endpoint == "lmstudio_chat":
            out = self._ev(f"{self._kind}.end") if self._kind else b""
            end = {"type": "chat.end", "result": self._result("", "", usage)}
            return out + named("chat.end", self.dumps(end))
        out = self._chunk([self._choice({}, "", reason)], stats=self._stats(reason, usage))
        if self.ctx.include_usage:
            out += self._chunk([], usage=self.usage_obj(usage))
        return out + DONE

    def nonstream_body(self, reasoning: str, content: str, reason: str, usage: UsageReport) -> bytes:
        if self.ctx.endpoint == "lmstudio_chat":
            return self.dumps(self._result(reasoning, content, usage))
        body = super().nonstream_body(reasoning, content, reason, usage)
        obj = orjson.loads(body)
        obj["stats"] = self._stats(reason, usage)
        return self.dumps(obj)
