"""What OpenAI-compatible requests, chunks and error bodies mean (docs/WIRE.md#rules-the-core-applies).

Pure functions over already-decoded JSON values (and request bytes); no I/O. Servers
disagree about nearly everything, so every rule here reacts to what is on the wire, never
to a server's name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import orjson

from mlxproxy.core.tools import ToolSpec, parse_tools

__all__ = [
    "CLAIM_KEYS",
    "Endpoint",
    "ENDPOINTS",
    "GENERATION_ENDPOINTS",
    "USAGE_INJECTABLE",
    "CONVERSATION_ENDPOINTS",
    "RequestInfo",
    "Delta",
    "endpoint_of",
    "parse_request",
    "inject_include_usage",
    "classify_chunk",
    "plain_delta",
    "is_injected_usage_chunk",
    "error_message",
    "parse_context_limit",
    "uncached_tokens",
    "whole_prompt_tokens",
]

#: where a body or chunk carries a server's figures about itself (llama.cpp-style `timings`,
#: Rapid-MLX's `metrics`, LM Studio's v0 `stats`): kept as claims, audited by `core.claims`
CLAIM_KEYS = ("timings", "metrics", "stats")

Endpoint = Literal[
    "chat_completions",
    "completions",
    "messages",
    "responses",
    "ollama_chat",
    "ollama_generate",
    "lmstudio_chat",
    "embeddings",
    "models",
    "other",
]
ENDPOINTS: tuple[Endpoint, ...] = get_args(Endpoint)
#: the endpoints that generate text (streamed or not): the ones with latency and token figures
GENERATION_ENDPOINTS: frozenset[Endpoint] = frozenset(
    {"chat_completions", "completions", "messages", "responses", "ollama_chat", "ollama_generate", "lmstudio_chat"}
)
#: the endpoints whose prompt is a conversation (fingerprinted, followed by the cache doctor)
CONVERSATION_ENDPOINTS: frozenset[Endpoint] = frozenset({"chat_completions", "messages", "responses", "ollama_chat"})
#: native paths (Ollama, LM Studio) and their endpoint; everything else under /api/ is not metered
_NATIVE_PATHS: dict[str, Endpoint] = {
    "/api/chat": "ollama_chat",
    "/api/generate": "ollama_generate",
    "/api/v1/chat": "lmstudio_chat",
}
#: where `stream_options.include_usage` exists, so the proxy may inject it
USAGE_INJECTABLE: frozenset[Endpoint] = frozenset({"chat_completions", "completions"})


def endpoint_of(path: str) -> Endpoint:
    """The bounded `endpoint` label for a request path (query string excluded)."""
    p = path.rstrip("/")
    native = _NATIVE_PATHS.get(p)
    if native is not None:
        return native
    if p.endswith("/chat/completions"):
        return "chat_completions"
    if p.endswith("/completions"):
        return "completions"
    if p.endswith("/messages"):
        return "messages"
    if p.endswith("/responses"):
        return "responses"
    if p.endswith("/embeddings"):
        return "embeddings"
    if p.endswith("/models") or "/models/" in p:
        return "models"
    return "other"


@dataclass(frozen=True, slots=True)
class RequestInfo:
    """What the meter needs to know about a request. `None` means the body did not say."""

    method: str
    path: str
    endpoint: Endpoint
    model: str | None = None
    stream: bool = False
    max_tokens: int | None = None
    usage_requested: bool = False  # the client itself asked for stream_options.include_usage
    json_body: bool = False  # the body parsed as a JSON object
    # the parsed body of a chat, Messages or Responses request, held only while the request is
    # metered so its prompt can be fingerprinted off the request path (core.analyze); never in a record
    prompt_obj: dict[str, Any] | None = field(default=None, repr=False, compare=False)
    # the parsed body, read for `tools` when the request is finished (off the request path)
    body_obj: dict[str, Any] | None = field(default=None, repr=False, compare=False)
    tools_parsed: tuple[tuple[ToolSpec, ...] | None] | None = field(default=None, repr=False, compare=False)

    @property
    def tools(self) -> tuple[ToolSpec, ...] | None:
        """The function tools the request declared (names and required keys only); None: no
        tools offered. Parsed at the first read (the meter's `finish`, after the response), not
        while the request is being forwarded."""
        parsed = self.tools_parsed
        if parsed is None:
            parsed = (parse_tools(self.body_obj) if self.body_obj is not None else None,)
            object.__setattr__(self, "tools_parsed", parsed)
        return parsed[0]


def parse_request(method: str, path: str, body: bytes) -> tuple[RequestInfo, dict[str, Any] | None]:
    """Read the fields that matter from a request body. Never raises: a body that is not a
    JSON object gives a `RequestInfo` with defaults and `None` for the parsed object."""
    endpoint = endpoint_of(path)
    obj: Any = None
    if body and body.lstrip()[:1] == b"{":
        try:
            obj = orjson.loads(body)
        except orjson.JSONDecodeError:
            obj = None
    if not isinstance(obj, dict):
        return RequestInfo(method, path, endpoint), None
    model = obj.get("model")
    max_tokens = obj.get("max_completion_tokens", obj.get("max_tokens", obj.get("max_output_tokens")))
    options = obj.get("options")
    if max_tokens is None and isinstance(options, dict):
        max_tokens = options.get("num_predict")  # Ollama's native limit
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0:
        max_tokens = None  # a negative limit means "no limit" (LM Studio's -1, Ollama's num_predict -1)
    # Ollama's native API streams unless told otherwise; every other one only when asked
    stream = (
        obj.get("stream") is not False if endpoint in ("ollama_chat", "ollama_generate") else obj.get("stream") is True
    )
    so = obj.get("stream_options")
    usage_requested = isinstance(so, dict) and bool(so.get("include_usage"))
    return (
        RequestInfo(
            method,
            path,
            endpoint,
            model=model if isinstance(model, str) else None,
            stream=stream,
            max_tokens=max_tokens,
            usage_requested=usage_requested,
            json_body=True,
            prompt_obj=obj if endpoint in CONVERSATION_ENDPOINTS else None,
            body_obj=obj,
        ),
        obj,
    )


def inject_include_usage(body: bytes, obj: dict[str, Any]) -> bytes:
    """The body with `stream_options.include_usage: true`, changed as little as possible.

    With no `stream_options` key the member is spliced in before the final `}` so every
    other byte stays as the client sent it; otherwise the object is re-serialised with the
    client's other `stream_options` keys kept. Never produces an empty `stream_options`
    (mlx_lm.server raises on `{}`).
    """
    if "stream_options" not in obj:
        end = body.rstrip()
        if end.endswith(b"}"):
            inner = end[:-1].rstrip()
            sep = b"" if inner.endswith(b"{") else b","
            return inner + sep + b'"stream_options":{"include_usage":true}}' + body[len(end) :]
    new = dict(obj)
    so = obj.get("stream_options")
    new["stream_options"] = {**(so if isinstance(so, dict) else {}), "include_usage": True}
    return orjson.dumps(new)


def is_injected_usage_chunk(data: str) -> bool:
    """True for the usage-only event (`choices: []` with a usage object) that asking for
    `include_usage` adds; used to strip it for clients that did not ask for it."""
    if '"usage"' not in data or "choices" not in data:
        return False
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        return False
    return isinstance(obj, dict) and obj.get("choices") == [] and isinstance(obj.get("usage"), dict)


@dataclass(slots=True)
class Delta:
    """What one decoded chunk (an SSE `data:` JSON value) carries.

    `content`/`reasoning`/`text` are the generated strings of this chunk ("" when none);
    `reasoning` is `reasoning_content`, else `reasoning`, never both summed.
    """

    content: str = ""
    reasoning: str = ""
    text: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    error: str | None = None
    dual_reasoning: bool = False
    claims: dict[str, Any] | None = None

    @property
    def generated(self) -> bool:
        return bool(self.content or self.reasoning or self.text or self.tool_calls)


def plain_delta(obj: Any) -> tuple[str, str] | None:
    """`(content, reasoning)` of a plain text chunk (the bulk of every stream), else `None`.

    Plain: one choice whose delta holds non-empty text in exactly one of `content`,
    `reasoning_content` and `reasoning` (the reasoning ones otherwise absent or null, a
    `content` otherwise anything falsy), and no tool calls; no finish reason, `text`,
    error, usage, timings or metrics (absent or null). For such a chunk `classify_chunk`
    gives exactly `Delta(content, reasoning)`, so callers may skip building it.
    Deliberately narrow: anything else is `None` and goes through the general rules."""
    if type(obj) is not dict:
        return None
    choices = obj.get("choices")
    if type(choices) is not list or len(choices) != 1:
        return None
    ch = choices[0]
    if type(ch) is not dict:
        return None
    delta = ch.get("delta")
    if type(delta) is not dict:
        return None
    # `k in d and d[k] is not None`: most of these members are absent, and `in` is the cheapest test
    if (
        ("finish_reason" in ch and ch["finish_reason"] is not None)
        or ("text" in ch and ch["text"] is not None)
        or ("usage" in obj and obj["usage"] is not None)
        or ("error" in obj and obj["error"] is not None)
        or ("timings" in obj and obj["timings"] is not None)
        or ("metrics" in obj and obj["metrics"] is not None)
        or ("stats" in obj and obj["stats"] is not None)
    ):
        return None
    c = delta.get("content")
    if type(c) is str and c and len(delta) == 1:  # {"content": "..."}: nothing else to look at
        return (c, "")
    if "tool_calls" in delta and delta["tool_calls"] is not None:
        return None
    rc = delta.get("reasoning_content")
    r = delta.get("reasoning")
    if c:  # content: plain only as text and without reasoning (falsy content is no text, whatever its type)
        return (c, "") if type(c) is str and rc is None and r is None else None
    if r is None:
        return ("", rc) if type(rc) is str and rc else None
    if rc is None:
        return ("", r) if type(r) is str and r else None
    return None


def classify_chunk(obj: Any) -> Delta:
    """Interpret one decoded chunk of a chat or text completion stream.

    Role-only, empty and `null` deltas generate nothing. `usage` may ride on any chunk.
    An `error` member (object or string) is reported whatever else the chunk holds.
    """
    plain = plain_delta(obj)
    if plain is not None:
        return Delta(*plain)
    return _classify_general(obj)


def _classify_general(obj: Any) -> Delta:
    """`classify_chunk` for any chunk: every rule, no shortcut."""
    d = Delta()
    if not isinstance(obj, dict):
        d.error = "chunk is not a JSON object"
        return d
    err = obj.get("error")
    if err:
        d.error = error_message(obj) or "error"
    usage = obj.get("usage")
    if isinstance(usage, dict):
        d.usage = usage
    if not obj.keys().isdisjoint(CLAIM_KEYS):  # (most chunks carry none: one test, not three)
        for key in CLAIM_KEYS:
            v = obj.get(key)
            if isinstance(v, dict):
                if d.claims is None:
                    d.claims = {}
                d.claims[key] = v
    choices = obj.get("choices")
    if not isinstance(choices, list):
        return d
    for ch in choices:
        if not isinstance(ch, dict):
            continue
        fr = ch.get("finish_reason")
        if isinstance(fr, str) and fr:
            d.finish_reasons.append(fr)
        text = ch.get("text")
        if isinstance(text, str) and text:
            d.text += text
        delta = ch.get("delta")
        if not isinstance(delta, dict):
            continue
        c = delta.get("content")
        if isinstance(c, str) and c:
            d.content += c
        rc = delta.get("reasoning_content")
        r = delta.get("reasoning")
        if isinstance(rc, str) and rc:
            d.reasoning += rc
            if isinstance(r, str) and r:
                d.dual_reasoning = True
        elif isinstance(r, str) and r:
            d.reasoning += r
        tc = delta.get("tool_calls")
        if isinstance(tc, list) and tc:
            d.tool_calls.extend(t for t in tc if isinstance(t, dict))
    return d


def error_message(obj: Any) -> str | None:
    """The human message of an error body in any of the shapes servers use:
    `{"error": {"message": ...}}`, `{"error": "text"}`, `{"detail": "text"}`,
    `{"detail": [{"msg": ...}]}`, `{"message": ...}`. `None` when there is none."""
    if not isinstance(obj, dict):
        return None
    err = obj.get("error")
    if isinstance(err, dict):
        msg = err.get("message")
        return str(msg) if msg is not None else orjson.dumps(err).decode()
    if isinstance(err, str) and err:
        return err
    if err:
        return "An error occurred during streaming"
    detail = obj.get("detail")
    if isinstance(detail, str):
        return detail
    if isinstance(detail, list) and detail:
        parts = [str(x.get("msg", x)) if isinstance(x, dict) else str(x) for x in detail]
        return "; ".join(parts)
    msg = obj.get("message")
    if isinstance(msg, str):
        return msg
    return None


_CTX_PATTERNS = (
    # oMLX: "Prompt too long: 51587 tokens exceeds max context window of 32768 tokens"
    re.compile(
        r"(?P<prompt>\d{1,18}) tokens exceeds? (?:the )?max(?:imum)? context (?:window|length) of (?P<limit>\d{1,18})",
        re.I,
    ),
    # vLLM / OpenAI: "This model's maximum context length is 32768 tokens. However, you requested 40000 tokens"
    re.compile(
        r"maximum context length is (?P<limit>\d{1,18}) tokens.*?(?:requested|resulted in|contains?) (?P<prompt>\d{1,18}) tokens",
        re.I | re.S,
    ),
    re.compile(r"maximum context length is (?P<limit>\d{1,18}) tokens", re.I),
    re.compile(r"(?:prompt|input)[^.]{0,40}?(?:too long|exceeds?)[^.]{0,60}?context", re.I),
    re.compile(r"context (?:window|length)[^.]{0,40}?exceed", re.I),
    # llama.cpp: "request (4476 tokens) exceeds the available context size (4096 tokens)"
    re.compile(
        r"\((?P<prompt>\d{1,18}) tokens\) exceeds? the available context size \((?P<limit>\d{1,18}) tokens\)", re.I
    ),
    # mlx-vlm 0.7.10 (HTTP 400 {"detail": ...}): "Protected conversation exceeds the available context budget."
    re.compile(r"exceeds? the available context (?:budget|size)", re.I),
    re.compile(r"context[_ ]length[_ ]exceeded", re.I),
)


def parse_context_limit(message: str | None) -> tuple[bool, int | None, int | None]:
    """(is_context_limit, prompt_tokens, limit_tokens) read from an error message."""
    if not message:
        return False, None, None
    for pat in _CTX_PATTERNS:
        m = pat.search(message)
        if m:
            g = m.groupdict()
            prompt = int(g["prompt"]) if g.get("prompt") else None
            limit = int(g["limit"]) if g.get("limit") else None
            return True, prompt, limit
    return False, None, None


def whole_prompt_tokens(prompt: int | None, cached: int | None) -> int | None:
    """All prompt tokens, cached or not (a server's `prompt_tokens` may leave the cached ones
    out: `uncached_tokens`). None without prompt_tokens."""
    if prompt is None:
        return None
    return max(prompt, (uncached_tokens(prompt, cached) or 0) + (cached or 0))


def uncached_tokens(prompt: int | None, cached: int | None) -> int | None:
    """The prompt tokens a server really prefilled. Usually prompt_tokens - cached_tokens;
    but `cached_tokens > prompt_tokens` can only mean the server's prompt_tokens already
    leaves the cached ones out (mlx-openai-server: prompt_tokens 1, cached_tokens 41), so
    prompt_tokens is the uncached count. None without prompt_tokens."""
    if prompt is None:
        return None
    if cached is None or cached <= 0:
        return max(prompt, 0)
    return prompt if cached > prompt else prompt - cached
