"""Who sent a request, and whether it is a side request (sans-I/O: headers, method, path and
the parsed body in, a `ClientInfo` out).

The client is named from its request headers (`User-Agent` and the like), e.g. Claude Code's
`claude-cli/2.1.332 (external, sdk-cli)` -> "Claude Code 2.1.332", Codex's
`codex_exec/0.171.0 (...)` -> "Codex 0.171.0", `opencode/1.18.33 ai-sdk/...` ->
"OpenCode 1.18.33", `QwenCode/0.24.4 (linux; x64)` -> "Qwen Code 0.24.4", an SDK's
`OpenAI/Python 2.20.0` -> "OpenAI Python SDK 2.20.0". Aider sends the OpenAI SDK's headers
unchanged: it is named from its fixed prompts ("Aider"); LLM (`llm` 0.36) sends them too and
nothing in its body names it: it shows as the SDK. Any other
`product/version` User-Agent is shown as "product version"; none: `None`.

A side request is one an agent sends beside the conversation: a title (OpenCode's title
generator), a token count (`/v1/messages/count_tokens`), a probe (`HEAD` or `GET` outside the
generation endpoints, e.g. Claude Code's `HEAD /api/hello`), a quota check (Claude Code's
one-token "quota" request), Aider's chat summary and commit message, Qwen Code's memory
extraction subagent (the conversation's history sent again under its own system prompt: linked,
it would pass for a turn of the conversation). Side requests are kept
out of conversation linking and turn numbering (`core.analyze.finish_checked`). The rules and
the names: docs/METRICS.md ("Clients and side requests").
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any, Literal, NamedTuple, get_args

__all__ = ["ClientInfo", "SideRequest", "SIDE_REQUESTS", "classify", "client_name", "NO_CLIENT"]

#: what kind of side request a request is (docs/METRICS.md, "Clients and side requests")
SideRequest = Literal["title", "count_tokens", "probe", "quota", "summary", "commit_message", "memory"]
SIDE_REQUESTS: tuple[SideRequest, ...] = get_args(SideRequest)


class ClientInfo(NamedTuple):
    """Who sent a request (`None`: the headers do not say) and what side request it is
    (`None`: a turn of a conversation, or an ordinary request)."""

    name: str | None = None
    side: SideRequest | None = None


NO_CLIENT = ClientInfo()

# User-Agent product -> public name; the version follows when the User-Agent has one
_PRODUCTS = {
    "claude-cli": "Claude Code",
    "claude-code": "Claude Code",
    "codex_exec": "Codex",
    "codex_cli_rs": "Codex",
    "codex-tui": "Codex",
    "codex_vscode": "Codex",
    "opencode": "OpenCode",
    "openai/python": "OpenAI Python SDK",
    "openai/js": "OpenAI JS SDK",
    "anthropic/python": "Anthropic Python SDK",
    "anthropic/js": "Anthropic JS SDK",
    "aider": "Aider",
    "crush": "Crush",
    "goose": "Goose",
    "qwen-code": "Qwen Code",
    "qwencode": "Qwen Code",
    "gemini-cli": "Gemini CLI",
    "llm": "LLM",
    "continue": "Continue",
    "cline": "Cline",
    "kilo-code": "Kilo Code",
    "roo-code": "Roo Code",
    "mlxproxy": "mlxproxy",
}
# `product/version`, the product possibly two words joined by a slash (`OpenAI/Python 2.20.0`)
_UA = re.compile(r"\s*([A-Za-z][\w.\-]*(?:/[A-Za-z][\w\-]*)?)[/ ]v?(\d[\w.\-+]*)")
_UA_PRODUCT = re.compile(r"\s*([A-Za-z][\w.\-]*)")
_MAX_NAME = 64
_names: dict[str, str | None] = {}  # User-Agent -> name (bounded: a client sends one or two)
_MAX_CACHED = 256

# Aider speaks through the OpenAI SDK (litellm) with its headers unchanged: its fixed prompts name it
_AIDER_MARKS = (
    "Act as an expert software developer",
    "I am not sharing any files that you can edit",
    "I switched to a new code base.",
)
_AIDER_SUMMARY = "*Briefly* summarize this partial conversation about programming"
_AIDER_COMMIT = "one-line Git commit messages"
_TITLE_MARKS = (
    "You are a title generator",  # OpenCode
    "Generate a concise, sentence-case title",  # Claude Code
    "Please write a 5-10 word title",  # Claude Code (earlier versions)
)
_QUOTA = re.compile(r"(?:\[nonce [0-9a-f]+\] )?quota")  # (a replay's nonce before it allowed)
# Qwen Code's memory extraction subagent: the conversation's history under another system prompt
_MEMORY_MARKS = ("You are now acting as the managed memory extraction subagent",)
_HEAD_CHARS = 400
# the system prompts that make a request a side request (looked for in its first _HEAD_CHARS)
_MARK_KINDS: dict[str, SideRequest] = {
    **dict.fromkeys(_TITLE_MARKS, "title"),
    _AIDER_SUMMARY: "summary",
    _AIDER_COMMIT: "commit_message",
    **dict.fromkeys(_MEMORY_MARKS, "memory"),
}
_MARK_CHARS = 160  # the marks begin a system prompt (Aider's commit mark: within its first line)
_SYSTEM_ROLES = ("system", "developer")
_PROBE_METHODS = frozenset({"HEAD", "OPTIONS"})
_GENERATION_TAILS = ("/chat/completions", "/completions", "/messages", "/responses", "/embeddings")


def client_name(user_agent: str) -> str | None:
    """The public name of the client a `User-Agent` names (e.g. "Claude Code 2.1.332"), or None."""
    cached = _names.get(user_agent, _MISSING)
    if cached is not _MISSING:
        return cached  # type: ignore[return-value]
    name = _name_of(user_agent)
    if len(_names) < _MAX_CACHED:
        _names[user_agent] = name
    return name


_MISSING = object()
_TURNS: dict[str, ClientInfo] = {}  # client name -> ClientInfo(name): a turn's answer, made once


def _name_of(ua: str) -> str | None:
    m = _UA.match(ua)
    if m is not None:
        product, version = m.group(1), m.group(2)
    else:
        p = _UA_PRODUCT.match(ua)
        if p is None:
            return None
        product, version = p.group(1), ""
    known = _PRODUCTS.get(product.lower())
    if known is None and "/" in product:  # `Foo/Bar 1.0`: the product is Foo
        product = product.split("/", 1)[0]
        known = _PRODUCTS.get(product.lower())
    name = f"{known or product} {version}".strip()
    return name[:_MAX_NAME] if name.isprintable() else None


def _text(v: Any) -> str:
    """The first text of a content value (a string, or a list of text blocks)."""
    if isinstance(v, str):
        return v[:_HEAD_CHARS]
    if isinstance(v, list):
        for block in v:
            if isinstance(block, dict) and isinstance(block.get("text"), str):
                return str(block["text"])[:_HEAD_CHARS]
            if isinstance(block, str):
                return block[:_HEAD_CHARS]
    return ""


def _system_head(body: dict[str, Any]) -> tuple[str, list[Any]]:
    """(the start of the system text, the message list): a Messages `system`, a Responses
    `instructions`, or a leading system/developer message."""
    items = body.get("messages")
    if type(items) is list:  # chat (its system prompt a message) or Messages (a `system`)
        v = body.get("system")
        if v is not None:
            return _text(v), items
        m = items[0] if items else None
        if type(m) is dict and m.get("role") in _SYSTEM_ROLES:
            return _text(m.get("content")), items
        return "", items
    inp = body.get("input")
    items = inp if isinstance(inp, list) else [{"role": "user", "content": inp}] if isinstance(inp, str) else []
    v = body.get("instructions")
    if v is None and items and type(items[0]) is dict and items[0].get("role") in _SYSTEM_ROLES:
        v = items[0].get("content")
    return (_text(v) if v is not None else ""), items


def _side_of_body(body: dict[str, Any], system: str, items: list[Any]) -> SideRequest | None:
    if system:
        head = system[:_MARK_CHARS]
        for mark, kind in _MARK_KINDS.items():
            if mark in head:
                return kind
    if body.get("max_tokens") == 1 and len(items) == 1 and isinstance(items[0], dict):
        user = _text(items[0].get("content"))
        if _QUOTA.fullmatch(user.strip().lower()) is not None:
            return "quota"  # Claude Code's quota check
    return None


def _is_aider(system: str, items: list[Any]) -> bool:
    if system.startswith(_AIDER_MARKS[0]):
        return True
    for m in items[:12]:
        if isinstance(m, dict) and m.get("role") == "user":
            c = m.get("content")
            if isinstance(c, str) and c.startswith(_AIDER_MARKS[1:]):
                return True
    return False


def classify(
    headers: Iterable[tuple[bytes | str, bytes | str]], method: str, path: str, body: dict[str, Any] | None
) -> ClientInfo:
    """Who sent this request and whether it is a side request. `headers`: the request headers
    as sent (names in any case, bytes or text); `path` without or with its query string;
    `body`: the parsed JSON body (None: none, or not a JSON object). Never raises."""
    ua = ""
    for k, v in headers:  # (ASGI's names are lower-case bytes; a replay's are text in any case)
        if k == b"user-agent" or (type(k) is str and len(k) == 10 and k.lower() == "user-agent"):
            ua = v.decode("latin-1") if isinstance(v, bytes) else v
            break
    client = client_name(ua) if ua else None
    p = path.split("?", 1)[0].rstrip("/") if "?" in path or path.endswith("/") else path
    side: SideRequest | None = None
    if method != "POST":
        m = method.upper()
        if m in _PROBE_METHODS or (m == "GET" and not p.endswith(_GENERATION_TAILS)):
            side = "probe"
    if p.endswith("/count_tokens"):
        side = "count_tokens"
    elif side is None and type(body) is dict:
        system, items = _system_head(body)
        side = _side_of_body(body, system, items)
        if (
            client is not None
            and client.startswith("OpenAI Python SDK")
            and (side in ("summary", "commit_message") or _is_aider(system, items))
        ):
            client = "Aider"
    if side is None:
        return NO_CLIENT if client is None else _unnamed_side(client)
    return ClientInfo(client, side)


def _unnamed_side(client: str) -> ClientInfo:
    """`ClientInfo(client)`, one per client name (most requests are a client's turns)."""
    info = _TURNS.get(client)
    if info is None:
        info = ClientInfo(client)
        if len(_TURNS) < _MAX_CACHED:
            _TURNS[client] = info
    return info
