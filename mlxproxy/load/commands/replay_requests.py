"""What `mlxproxy replay` sends: the captured requests selected and prepared again, the
capture's conversations, and the built-in agent session (`builtin:agent`).

Documented rewrites of the captured request body (nothing else changes):
  - streaming chat and text completions get `stream_options.include_usage: true` (so usage
    can be checked; Anthropic Messages and OpenAI Responses streams always carry usage);
  - `--model NAME` replaces `model`;
  - the nonce (on by default; `--no-nonce` turns it off) prefixes the first message (or
    the prompt, or a Responses `input`) with `[nonce <hex>] `, a new one for every request sent (the baseline and
    the waves of `--batch`, every repeat), so no prompt cache can serve the request;
  - a privacy capture (`capture_prompts: false`) has only message lengths: each message is
    sent as filler text of its recorded length.
Captured headers are sent again except redacted ones and hop-by-hop ones; `--api-key-env`
supplies the target's key.
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from mlxproxy.capture import CapturedRequest, captured_chat
from mlxproxy.core.openai import GENERATION_ENDPOINTS, endpoint_of, inject_include_usage
from mlxproxy.headers import REDACTED
from mlxproxy.load.commands.common import filler_text
from mlxproxy.load.run.client import PreparedRequest
from mlxproxy.load.run.shapes import Turn

__all__ = [
    "ReplaySource",
    "Rewrites",
    "select",
    "prepare",
    "split_sessions",
    "captured_think_s",
    "BUILTIN_AGENT",
    "synthetic_agent_session",
    "generation_mix",
]


@dataclass(frozen=True)
class Rewrites:
    """The documented rewrites of a captured body besides usage: `--model`, and the nonce."""

    model: str | None = None
    nonce: bool = True


def select(
    caps: Sequence[CapturedRequest], filters: Sequence[tuple[str, str]], limit: int | None
) -> list[CapturedRequest]:
    """Captured requests matching every `key=glob` filter (keys: model, endpoint, path, outcome)."""
    out = []
    for c in caps:
        values = {
            "model": c.record.model or "",
            "endpoint": c.record.endpoint,
            "path": c.path,
            "outcome": c.record.outcome,
        }
        if all(fnmatch.fnmatchcase(values.get(k, ""), pat) for k, pat in filters):
            out.append(c)
    return out[:limit] if limit is not None else out


def _marked(m: dict[str, Any], nonce: str) -> dict[str, Any]:
    """A message (or Responses input item) whose text begins with `nonce`."""
    m = dict(m)
    c = m.get("content")
    if isinstance(c, str):
        m["content"] = nonce + c
    elif isinstance(c, list) and c and isinstance(c[0], dict) and isinstance(c[0].get("text"), str):
        m["content"] = [{**c[0], "text": nonce + c[0]["text"]}, *c[1:]]
    return m


def _marked_list(items: list[Any], nonce: str) -> list[Any]:
    out = [_marked(items[0], nonce), *items[1:]]
    user = next((i for i, m in enumerate(out) if isinstance(m, dict) and m.get("role") == "user"), None)
    if user:
        out[user] = _marked(out[user], nonce)
    return out


def _with_nonce(obj: dict[str, Any], nonce: str) -> None:
    """`nonce` at the start of the prompt (so no cache holds any of it) and, where the first
    message is not the user's (a system prompt), at the start of the first user message too:
    a conversation is known by its first user message, so two runs of the same captured
    conversation stay two conversations (never one that seems to restart its prompt)."""
    msgs = obj.get("messages")
    if isinstance(msgs, list) and msgs and isinstance(msgs[0], dict):
        obj["messages"] = _marked_list(msgs, nonce)
    elif isinstance(obj.get("prompt"), str):
        obj["prompt"] = nonce + obj["prompt"]
    elif isinstance(obj.get("input"), str):  # OpenAI Responses
        obj["input"] = nonce + obj["input"]
    elif isinstance(obj.get("input"), list) and obj["input"] and isinstance(obj["input"][0], dict):
        obj["input"] = _marked_list(obj["input"], nonce)


def _refilled(items: list[Any], fill: Callable[[dict[str, Any], int], None]) -> list[Any] | None:
    """`items` with each one a privacy capture cut to `content_chars` given its text back by `fill`
    (None where there is none)."""
    if not any(isinstance(it, dict) and "content_chars" in it for it in items):
        return None
    out = []
    for it in items:
        if isinstance(it, dict) and "content_chars" in it:
            n = int(it["content_chars"])
            it = {k: v for k, v in it.items() if k != "content_chars"}
            fill(it, n)
        out.append(it)
    return out


def _fill_message(m: dict[str, Any], n: int) -> None:
    m["content"] = filler_text(n)


def _fill_input_item(it: dict[str, Any], n: int) -> None:  # OpenAI Responses `input` items
    if it.get("type") == "function_call_output":
        it["output"] = filler_text(n)
    elif it.get("type") == "function_call":
        it["arguments"] = "{}"
    else:
        it["content"] = filler_text(n)


def _unprivate(obj: dict[str, Any]) -> dict[str, Any]:
    """A privacy capture's message lengths turned back into filler text of that length."""
    msgs = obj.get("messages")
    if isinstance(msgs, list) and (new := _refilled(msgs, _fill_message)) is not None:
        obj = {**obj, "messages": new}
    for key in ("prompt", "system", "instructions", "input"):  # Messages `system`, Responses `instructions`/`input`
        if f"{key}_chars" in obj and key not in obj:
            n = int(obj[f"{key}_chars"])
            obj = {k: v for k, v in obj.items() if k != f"{key}_chars"}
            obj[key] = filler_text(n)
    inp = obj.get("input")
    if isinstance(inp, list) and (items := _refilled(inp, _fill_input_item)) is not None:
        obj = {**obj, "input": items}
    return obj


def prepare(c: CapturedRequest, rewrites: Rewrites, nonce: str | None = None) -> PreparedRequest:
    """The request to send for one captured request, with only the documented rewrites.
    `nonce`: this marker instead of a new one (the turns of one replayed session share one,
    so each turn can reuse the prompt cache of the turns before it, as in real use)."""
    headers = tuple(
        (k, v) for k, v in (c.raw.get("request_headers") or []) if v != REDACTED
    )  # hop-by-hop: loadgen drops
    if c.request is None:
        return PreparedRequest(c.method, c.path, c.request_bytes or b"", headers, c.offset_s, c.record.id)
    obj = _unprivate(c.request)
    if rewrites.model is not None:
        obj = {**obj, "model": rewrites.model}
    if rewrites.nonce:
        obj = dict(obj)
        _with_nonce(obj, nonce or f"[nonce {os.urandom(6).hex()}] ")
    body = orjson.dumps(obj)
    if obj.get("stream") is True and endpoint_of(c.path) in ("chat_completions", "completions"):
        # Messages and Responses streams always report usage (and reject stream_options)
        so = obj.get("stream_options")
        if not (isinstance(so, dict) and so.get("include_usage")):
            body = inject_include_usage(body, obj)
    return PreparedRequest(c.method, c.path, body, headers, c.offset_s, c.record.id, label=c.record.id)


def _first_user(obj: dict[str, Any]) -> bytes | None:
    msgs = obj.get("messages")
    if not isinstance(msgs, list):
        return None
    first = next((m for m in msgs if isinstance(m, dict) and m.get("role") == "user"), None)
    if first is None:
        return None
    return orjson.dumps({k: first.get(k) for k in ("content", "content_chars")}, option=orjson.OPT_SORT_KEYS)


def split_sessions(caps: Sequence[CapturedRequest]) -> list[list[CapturedRequest]]:
    """A capture split into conversations, in the order they began: the requests whose
    first user message is the same, while their message lists keep growing (a list that
    does not grow starts a new conversation: the same task begun again). A request without
    a message list is a conversation of its own."""
    sessions: list[list[CapturedRequest]] = []
    open_by_key: dict[bytes, int] = {}
    for c in sorted(caps, key=lambda c: c.offset_s):
        key = _first_user(c.request) if c.request is not None else None
        n = len(c.request["messages"]) if key is not None and c.request is not None else 0
        i = open_by_key.get(key) if key is not None else None
        if i is not None and n > len(sessions[i][-1].request["messages"]):  # type: ignore[index]
            sessions[i].append(c)
            continue
        sessions.append([c])
        if key is not None:
            open_by_key[key] = len(sessions) - 1
    return sessions


def captured_think_s(prev: CapturedRequest, c: CapturedRequest) -> float:
    """Seconds between the end of `prev`'s response and the start of `c`, as captured."""
    return max(0.0, c.offset_s - (prev.offset_s + (prev.record.duration_s or 0.0)))


BUILTIN_AGENT = "builtin:agent"


def synthetic_agent_session(turns: int = 6, think_s: float = 1.5, max_tokens: int = 256) -> list[CapturedRequest]:
    """A small made-up coding-agent conversation, for `replay builtin:agent` when there is no
    capture: a ~1,500-token system prompt with tool definitions, a task, then turns that each
    add the assistant's tool call and the tool's result (~800 tokens of file or test output),
    so the prompt grows as an agent's does; `think_s` between a response's end and the next
    turn stands for the tool running. Each turn is recorded as lasting 4 s. Deterministic."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": name,
                "description": desc,
                "parameters": {"type": "object", "properties": {"arg": {"type": "string"}}, "required": ["arg"]},
            },
        }
        for name, desc in (
            ("read_file", "Read a file of the repository."),
            ("run_tests", "Run the test suite."),
            ("edit_file", "Replace a range of lines in a file."),
        )
    ]
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent working in a Python repository. " + filler_text(6000)},
        {"role": "user", "content": "The test tests/test_parser.py::test_nested fails; find out why and fix it."},
    ]
    out: list[CapturedRequest] = []
    offset = 0.0
    for i in range(turns):
        body = {
            "model": "default_model",
            "stream": True,
            "max_tokens": max_tokens,
            "temperature": 0,
            "messages": [dict(m) for m in messages],
            "tools": tools,
        }
        rid = f"agent-turn-{i + 1}"
        out.append(captured_chat(rid, body, upstream="synthetic", started_at=offset, offset_s=offset, duration_s=4.0))
        tool = ("read_file", "run_tests", "edit_file")[i % 3]
        call_id = f"call_{i + 1}"
        messages.append(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": tool, "arguments": f'{{"arg": "step {i + 1}"}}'},
                    }
                ],
            }
        )
        messages.append({"role": "tool", "tool_call_id": call_id, "content": filler_text(3200)})
        offset += 4.0 + think_s
    return out


def generation_mix(caps: Sequence[CapturedRequest]) -> list[CapturedRequest]:
    """What a sweep sends: the generation requests of the capture (not `GET /v1/models`)."""
    return [c for c in caps if c.request is not None and endpoint_of(c.path) in GENERATION_ENDPOINTS]


@dataclass(frozen=True)
class ReplaySource:
    """What a replay sends: the captured requests `repeat` times, prepared anew for every phase
    with the `rewrites` (with the nonce on, the baseline, each wave size and each repeat send
    prompts no cache has seen)."""

    caps: Sequence[CapturedRequest]
    rewrites: Rewrites = Rewrites()
    repeat: int = 1

    def fresh(self) -> list[PreparedRequest]:
        return [prepare(c, self.rewrites) for _ in range(self.repeat) for c in self.caps]

    def first(self, k: int) -> list[PreparedRequest]:
        """The first `k` captured requests, once (a warm-up)."""
        return [prepare(c, self.rewrites) for c in self.caps[:k]]

    def cycled(self, k: int, caps: Sequence[CapturedRequest] | None = None) -> list[PreparedRequest]:
        """`k` requests: the captured ones (or `caps`) in order, cycled."""
        caps = self.caps if caps is None else caps
        return [prepare(caps[i % len(caps)], self.rewrites) for i in range(k)]

    def mix(self) -> list[CapturedRequest]:
        """What a sweep sends at every step: the capture's generation requests, `repeat` times."""
        mix = generation_mix(self.caps)
        if not mix:
            raise ValueError(
                "a sweep needs generation requests (chat, completions, messages, responses); none selected"
            )
        return [c for _ in range(self.repeat) for c in mix]

    def conversations(self, runs: int, think_time: float | None) -> list[list[Turn]]:
        """`runs` conversation runs (the capture's conversations in order, cycled), each with a
        nonce of its own and each turn's think time (`think_time`, else as captured)."""
        convs = split_sessions(self.caps)
        return [self._conversation(convs[i % len(convs)], think_time) for i in range(runs)]

    def _conversation(self, conv: Sequence[CapturedRequest], think_time: float | None) -> list[Turn]:
        nonce = f"[nonce {os.urandom(6).hex()}] " if self.rewrites.nonce else None
        turns = []
        for ti, c in enumerate(conv):
            think = 0.0
            if ti:
                think = think_time if think_time is not None else captured_think_s(conv[ti - 1], c)
            turns.append(Turn(prepare(c, self.rewrites, nonce), think))
        return turns
