"""What a simulated server reads from a request, and what it will answer: pure functions.

Prompt tokens are counted by one documented rule, so a test can know `usage.prompt_tokens`
before sending: the text of every message (string contents and `text` parts; for
`/v1/completions`, the prompt strings) is concatenated and
`prompt_tokens = max(1, ceil(characters / chars_per_token))` (4 characters a token by
default). A token-id prompt counts one token per id. The `X-Sim-Prompt-Tokens: N` request
header replaces the count (to simulate a 50k-token prompt without sending 200 KB).

Output: `max_tokens` (or `max_completion_tokens`) tokens when the request gives it, capped at
the profile's `max_output_tokens`; otherwise `default_output_tokens`. The finish reason is
`length` exactly when the request's own limit was reached, else `stop`. The text is one
short word per token (" the", " café"), drawn from a RNG seeded by the app seed and the request's
`seed` (or, without one, a hash of the prompt), so the same request gives the same text.
"""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass
from typing import Any

import orjson

from mlxproxy.core.tools import parse_tools
from mlxproxy.sim.profiles import Profile

# Short words, so a piece averages under 4 characters like a real token (a streamed-token
# estimate of characters / 4 then never exceeds the number of pieces); a few are non-ASCII.
CONTENT_WORDS = (
    "the of and to in is it you was for on are as his at be or one had by but not all we can use an "
    "she do how if up out so her him has two go see no way my who its now day did get may ok yes far "
    "new old big sun red set run end top mid low per via café über naïve"
).split()
REASONING_WORDS = "hmm let me see ok so the user for a list wait no yes then it not now".split()


class RequestError(Exception):
    """The request is unusable; `status` is the HTTP status a server of this style answers."""

    def __init__(self, status: int, message: str, *, missing_field: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.missing_field = missing_field


@dataclass(frozen=True)
class SimRequest:
    """The parts of an OpenAI request body the simulator uses."""

    endpoint: str  # "chat" or "completions"
    model: str | None
    stream: bool
    include_usage: bool
    stream_options_without_include_usage: bool
    max_tokens: int | None
    seed: int | None
    prompt_text: str
    prompt_tokens: int
    tool: tuple[str, tuple[str, ...]] | None = None  # the first declared function tool: (name, required keys)


@dataclass(frozen=True)
class OutputPlan:
    """What the simulated model will answer to one request."""

    pieces: tuple[str, ...]  # one text piece per visible token
    n_reasoning: int  # the first n_reasoning pieces are reasoning, the rest answer
    finish_reason: str  # "stop" or "length"
    n_engine_tokens: int  # tokens the engine generates (visible + a silent EOS when counted)
    tool_name: str | None = None  # set: every piece is a structured tool call's arguments fragment

    @property
    def n_visible(self) -> int:
        return len(self.pieces)

    @property
    def reasoning_text(self) -> str:
        return "".join(self.pieces[: self.n_reasoning])

    @property
    def content_text(self) -> str:
        return "".join(self.pieces[self.n_reasoning :])


def count_prompt_tokens(text_chars: int, chars_per_token: float = 4.0) -> int:
    """max(1, ceil(text_chars / chars_per_token))."""
    return max(1, math.ceil(text_chars / chars_per_token))


#: endpoints whose prompt is a message list (the chat rules: tools, reasoning share)
CHAT_LIKE = frozenset({"chat", "ollama_chat", "messages"})


def _message_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part.get("text", "") for part in content if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return ""


def _int_field(body: dict[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(400, f"{key} must be an integer, got {value!r}")
    return value


def parse_request(
    body: dict[str, Any], endpoint: str, profile: Profile, prompt_tokens_header: str | None = None
) -> SimRequest:
    """Read an OpenAI chat or completions body; raises RequestError for an unusable one."""
    if not isinstance(body, dict):
        raise RequestError(400, "request body must be a JSON object")
    prompt_ids = 0
    if endpoint == "lmstudio_chat" and isinstance(body.get("input"), str):
        body = {**body, "prompt": body["input"]}
    if endpoint in CHAT_LIKE:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError(400, "messages must be a non-empty list", missing_field="messages")
        texts = [_message_text(m.get("content")) for m in messages if isinstance(m, dict)]
        tools = body.get("tools")
        if isinstance(tools, list) and tools:  # rendered after the system prompt, as Qwen's template does
            at = 1 if isinstance(messages[0], dict) and messages[0].get("role") == "system" else 0
            texts.insert(at, orjson.dumps(tools).decode())
        text = "".join(texts)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            text = prompt
        elif isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
            text = "".join(prompt)
        elif isinstance(prompt, list) and all(isinstance(p, int) for p in prompt):
            text, prompt_ids = "", len(prompt)
        else:
            raise RequestError(400, "prompt must be a string or a list", missing_field="prompt")
    prompt_tokens = prompt_ids or count_prompt_tokens(len(text), profile.chars_per_token)
    if prompt_tokens_header is not None:
        try:
            prompt_tokens = int(prompt_tokens_header)
        except ValueError:
            raise RequestError(400, f"X-Sim-Prompt-Tokens must be an integer, got {prompt_tokens_header!r}") from None
        if prompt_tokens < 1:
            raise RequestError(400, "X-Sim-Prompt-Tokens must be >= 1")
    max_tokens = _int_field(body, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = _int_field(body, "max_tokens")
    if max_tokens is None:
        max_tokens = _int_field(body, "max_output_tokens")
    opts = body.get("options")
    if max_tokens is None and isinstance(opts, dict):
        max_tokens = _int_field(opts, "num_predict")  # Ollama's native limit
    if max_tokens == -1:
        max_tokens = None  # "no limit": Ollama's num_predict -1, LM Studio's max_tokens -1
    if max_tokens is not None and max_tokens < 1:
        raise RequestError(400, f"max_tokens must be >= 1, got {max_tokens}")
    options = body.get("stream_options")
    model = body.get("model")
    specs = parse_tools(body) if endpoint in CHAT_LIKE else None
    return SimRequest(
        endpoint=endpoint,
        model=model if isinstance(model, str) and model else None,
        # Ollama's native API streams unless told otherwise
        stream=bool(body.get("stream", endpoint in ("ollama_chat", "ollama_generate"))),
        include_usage=isinstance(options, dict) and bool(options.get("include_usage")),
        stream_options_without_include_usage=isinstance(options, dict) and "include_usage" not in options,
        max_tokens=max_tokens,
        seed=_int_field(body, "seed"),
        prompt_text=text,
        prompt_tokens=prompt_tokens,
        tool=(specs[0].name, specs[0].required) if specs else None,
    )


def plan_output(req: SimRequest, profile: Profile, app_seed: int = 0) -> OutputPlan:
    """The deterministic answer to `req` (see the module docstring for the rules)."""
    if profile.tool_call_style and req.tool is not None:
        return _tool_plan(req.tool, profile.tool_call_style)
    if req.max_tokens is not None:
        n_visible = min(req.max_tokens, profile.max_output_tokens)
        finish = "length" if n_visible == req.max_tokens else "stop"
    else:
        n_visible = min(profile.default_output_tokens, profile.max_output_tokens)
        finish = "stop"
    n_reasoning = 0
    if req.endpoint in CHAT_LIKE and profile.reasoning_share > 0 and n_visible > 1:
        n_reasoning = min(n_visible - 1, int(n_visible * profile.reasoning_share))
    if req.seed is not None:
        material = f"{app_seed}|seed|{req.seed}"
    else:
        material = f"{app_seed}|prompt|{hashlib.sha256(req.prompt_text.encode('utf-8', 'replace')).hexdigest()}"
    rng = random.Random(material)
    pieces = []
    for i in range(n_visible):
        words = REASONING_WORDS if i < n_reasoning else CONTENT_WORDS
        word = rng.choice(words)
        first_of_part = i == 0 or i == n_reasoning
        pieces.append(word.capitalize() if first_of_part else " " + word)
    eos = 1 if profile.usage_counts_eos and finish == "stop" else 0
    return OutputPlan(tuple(pieces), n_reasoning, finish, n_visible + eos)


def _tool_plan(tool: tuple[str, tuple[str, ...]], style: str) -> OutputPlan:
    """A call to the request's first declared tool, every required key set to "x", in the
    profile's `tool_call_style`: `structured` (tool_calls deltas, finish tool_calls),
    `markup` (Hermes `<tool_call>` text in content, finish stop: a server without a tool
    parser), `invalid-json` (structured, arguments missing their closing brace)."""
    name, required = tool
    args = "{" + ", ".join(f'"{k}": "x"' for k in required) + "}"
    if style == "invalid-json":
        args = args[:-1]
    if style == "markup":
        text = f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'
        pieces = tuple(text[i : i + 6] for i in range(0, len(text), 6))
        return OutputPlan(pieces, 0, "stop", len(pieces))
    pieces = tuple(args[i : i + 4] for i in range(0, len(args), 4)) or ("{}",)
    return OutputPlan(pieces, 0, "tool_calls", len(pieces), tool_name=name)


def reported_completion_tokens(plan: OutputPlan, profile: Profile) -> int:
    """`usage.completion_tokens` as the simulated server reports it."""
    return int(round(plan.n_engine_tokens * profile.usage_multiplier))
