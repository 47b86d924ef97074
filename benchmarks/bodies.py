"""Request bodies the benchmarks send: the small one ("Say hello.") and an agent-shaped one, the
shape coding agents really send: 50 messages (a system prompt, then user turns, assistant tool
calls and tool results) and 10 tools, about 80 kB. The system prompt and the 10 tool
definitions are OpenCode's, as recorded (`tests/fixtures/clients/opencode_1.18.33_main_with_tools.req`);
the conversation after them is made up, deterministically (the same bytes every run)."""

from __future__ import annotations

import json
import os
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
RECORDED = os.path.join(os.path.dirname(HERE), "tests", "fixtures", "clients", "opencode_1.18.33_main_with_tools.req")
SMALL = [{"role": "user", "content": "Say hello."}]
AGENT_MESSAGES = 50


def _recorded() -> dict[str, Any]:
    with open(RECORDED, "rb") as f:
        raw = f.read()
    return json.loads(raw.split(b"\r\n\r\n", 1)[1])


def agent_conversation(messages: int = AGENT_MESSAGES) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(messages, tools): the recorded system prompt and tools, then a made-up session of
    reading, editing and testing files, `messages` messages in all."""
    rec = _recorded()
    tools = rec["tools"]
    out: list[dict[str, Any]] = [rec["messages"][0]]
    code = "".join(f"    def step_{i}(self, value):\n        return value * {i} + self.offset\n\n" for i in range(30))
    turn = 0
    while len(out) < messages:
        n = turn
        kind = ("read", "bash", "edit")[n % 3]
        if len(out) % 8 == 1:
            out.append({"role": "user", "content": f"Step {n}: the test test_step_{n} fails; find out why and fix it."})
            continue
        call = {
            "id": f"call_{n:04d}",
            "type": "function",
            "function": {
                "name": kind,
                "arguments": json.dumps(
                    {"filePath": f"src/app/module_{n}.py"}
                    if kind != "bash"
                    else {"command": f"python -m pytest -q tests/test_module_{n}.py", "description": "run the tests"}
                ),
            },
        }
        out.append({"role": "assistant", "content": f"Looking at module_{n}.", "tool_calls": [call]})
        if len(out) < messages:
            result = (
                f"<file>\nclass Module{n}:\n{code}</file>"
                if kind == "read"
                else f"F.\n=== FAILURES ===\ntest_step_{n}: assert {n} == {n + 1}\n1 failed, 1 passed in 0.02s"
                if kind == "bash"
                else "Edit applied successfully."
            )
            out.append({"role": "tool", "tool_call_id": call["id"], "content": result})
        turn += 1
    return out[:messages], tools


def chat_body(stream: bool, tokens: int, shape: str = "small") -> bytes:
    """The body of a chat request: `shape` "small" (one short user message) or "agent"."""
    obj: dict[str, Any] = {"model": "bench", "max_tokens": tokens}
    if shape == "agent":
        obj["messages"], obj["tools"] = agent_conversation()
    elif shape == "small":
        obj["messages"] = SMALL
    else:
        raise ValueError(f"unknown body shape {shape!r}")
    if stream:
        obj["stream"] = True
    return json.dumps(obj).encode()


if __name__ == "__main__":
    body = chat_body(True, 100, "agent")
    d = json.loads(body)
    print(f"agent body: {len(body)} bytes, {len(d['messages'])} messages, {len(d['tools'])} tools")
