"""Tool calls: what a request declared, and whether what came back is a usable call.

Pure functions, no I/O. The meter keeps only what these checks need: the declared tool
names and their schemas' required keys (read from the request, never the prompt), and
each structured call's name and arguments, bounded by `MAX_ARGUMENT_CHARS`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import orjson

__all__ = [
    "ToolSpec",
    "parse_tools",
    "call_problem",
    "find_markup",
    "MARKUPS",
    "MAX_TOOLS",
    "MAX_ARGUMENT_CHARS",
    "TOOL_FINISH",
]

MAX_TOOLS = 256  # tools kept from one request (more are ignored, as if undeclared: never judged)
MAX_NAME_CHARS = 128
MAX_REQUIRED = 64
MAX_ARGUMENT_CHARS = 256 * 1024  # a call's arguments kept for the JSON check; longer ones are not judged
MARKUP_SCAN_CHARS = 64 * 1024  # content scanned for tool-call markup (its start and end)

#: the finish reason that goes with structured tool calls, per endpoint (Responses has none)
TOOL_FINISH = {"chat_completions": "tool_calls", "completions": "tool_calls", "messages": "tool_use"}


@dataclass(frozen=True, slots=True)
class ToolSpec:
    name: str
    required: tuple[str, ...] = ()


def _spec(name: Any, params: Any) -> ToolSpec | None:
    if not isinstance(name, str) or not name or len(name) > MAX_NAME_CHARS:
        return None
    req: tuple[str, ...] = ()
    if isinstance(params, dict) and isinstance(params.get("required"), list):
        req = tuple(k for k in params["required"][:MAX_REQUIRED] if isinstance(k, str) and len(k) <= MAX_NAME_CHARS)
    return ToolSpec(name, req)


def parse_tools(obj: Any) -> tuple[ToolSpec, ...] | None:
    """The function tools a request body declared, in any of the three API shapes:
    chat `{"type":"function","function":{"name","parameters"}}`, Responses
    `{"type":"function","name","parameters"}`, Anthropic `{"name","input_schema"}`.
    `None` when the request offered no tools (absent, not a list, or empty)."""
    if not isinstance(obj, dict):
        return None
    tools = obj.get("tools")
    if not isinstance(tools, list) or not tools:
        return None
    last = _last[0]
    if last is not None and last[0] == tools:  # (the same answer: see `_last`)
        return last[1]
    out: list[ToolSpec] = []
    for t in tools[:MAX_TOOLS]:
        if not isinstance(t, dict):
            continue
        fn = t.get("function")
        if isinstance(fn, dict):
            s = _spec(fn.get("name"), fn.get("parameters"))
        elif "input_schema" in t:
            s = _spec(t.get("name"), t.get("input_schema"))
        else:
            s = _spec(t.get("name"), t.get("parameters"))
        if s is not None:
            out.append(s)
    specs = tuple(out)
    _last[0] = (tools, specs)
    return specs


# the latest tools list read and what it was read into: an agent declares the same tools on
# every turn, and a list equal (`==`) to it reads the same (what is read: which items are
# dicts and lists, which keys they hold, and strings, all of which `==` tells apart exactly),
# so it is read once per conversation, not once per request (a one-item list, replaced whole:
# a reader in a worker thread sees a pair)
_last: list[tuple[list[Any], tuple[ToolSpec, ...]] | None] = [None]


def call_problem(tools: Iterable[ToolSpec], name: str, arguments: str, *, truncated: bool = False) -> str | None:
    """Why a structured call cannot be executed as streamed, or None when it can.
    Empty arguments count as `{}` (servers send that for tools without parameters)."""
    specs = {t.name: t for t in tools}
    shown = repr(name[:60])
    if name not in specs:
        return (
            f"call to {shown}, which the request did not declare (declared: {', '.join(sorted(specs)[:8]) or 'none'})"
        )
    if truncated:
        return None  # too long to keep: not judged
    text = arguments.strip() or "{}"
    try:
        args = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        return f"{shown} arguments are not valid JSON ({str(exc).split(':')[0][:60]}): {arguments[:80]!r}"
    if not isinstance(args, dict):
        return f"{shown} arguments are JSON but not an object: {arguments[:80]!r}"
    missing = [k for k in specs[name].required if k not in args]
    if missing:
        return f"{shown} arguments lack required {', '.join(repr(k) for k in missing[:5])}"
    return None


# Markup that means "a tool call" in the chat templates of common open models. A server
# without (or with the wrong) tool parser streams it as plain text.
MARKUPS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("Qwen/Hermes <tool_call>", re.compile(r"<tool_call>")),
    ("<function=NAME> (Qwen3-Coder, Llama 3.1 custom)", re.compile(r"<function=[\w.\-]+>")),
    ("Llama 3.1 <|python_tag|>", re.compile(r"<\|python_tag\|>")),
    ("Mistral [TOOL_CALLS]", re.compile(r"\[TOOL_CALLS\]")),
    ("DeepSeek <｜tool▁calls▁begin｜>", re.compile(r"<｜tool▁calls?▁begin｜>")),
    ("Kimi <|tool_calls_section_begin|>", re.compile(r"<\|tool_calls?_section_begin\|>")),
    ("Gemma/FunctionGemma <start_function_call>", re.compile(r"<start_function_call>")),
)
_NAME_PAIR = re.compile(r'"name"\s*:\s*"([^"\\]{1,128})"')
_ARGS_KEY = re.compile(r'"(?:arguments|parameters)"\s*:\s*\{')


def find_markup(text: str, tools: Iterable[ToolSpec]) -> str | None:
    """What tool-call markup `text` carries, as evidence, or None: one of `MARKUPS`, or a
    JSON object with `"name": "<a declared tool>"` and an `arguments`/`parameters` object
    (Llama 3.x JSON calls, Hermes without tags). Only the first and last
    `MARKUP_SCAN_CHARS` characters are scanned."""
    if not text:
        return None
    if len(text) > 2 * MARKUP_SCAN_CHARS:
        text = text[:MARKUP_SCAN_CHARS] + "\n" + text[-MARKUP_SCAN_CHARS:]
    for label, pat in MARKUPS:
        m = pat.search(text)
        if m:
            return f"{label} at char {m.start()}: {text[m.start() : m.start() + 80]!r}"
    names = {t.name for t in tools}
    if "{" in text and names:
        for m in _NAME_PAIR.finditer(text):
            if m.group(1) in names and _ARGS_KEY.search(text):
                start = text.rfind("{", 0, m.start())
                start = m.start() if start < 0 else start
                return (
                    f"JSON object naming the declared tool {m.group(1)!r} at char {start}: {text[start : start + 80]!r}"
                )
    return None
