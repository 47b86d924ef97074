"""A scripted coding agent: the client half of the simulator's prompt-cache scenarios.

An `Agent` builds each turn's chat request the way coding agents do (a long system prompt,
declared tools, the whole conversation resent with the last answer and a new message) and
can inject, by knob, each client-side cause of a re-prefill (docs/METRICS.md, "Re-prefill
causes"): `volatile_header` (a per-request header line with a hex value at the front of the
system prompt, like Claude Code's `cch=` attribution), `reorder_tools_at` (from that turn on
the tools are declared in reverse order), `compact_at` (at that turn the history before the
previous exchange is replaced by a summary), `system_change_at` (from that turn on a reminder
line is inserted in the middle of the system prompt, as agents move their nudges),
`switch_model_at` (from that turn on the request names `switch_model`, extending the message
list as usual).
The server-side causes are the simulator's own knobs: `cache_drop` (eviction) and
`cache_report` (`hidden`, `claimed-cold`). Pure: no I/O; a test or tool sends the bodies.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Agent", "AgentKnobs"]

_RULES = (
    "Follow the repository's conventions. Run the tests before and after every change. Keep each "
    "change small and explain it in the commit message. Never touch generated files."
)
_REMINDER = (
    "Reminder: the plan changed. Finish the step in progress, run the tests, and report back "
    "before starting the next one."
)
_TOOLS = ("read_file", "grep", "edit_file", "run_tests")


@dataclass(frozen=True)
class AgentKnobs:
    """What the agent does wrong (all off: a well-behaved agent)."""

    volatile_header: bool = False
    reorder_tools_at: int | None = None
    compact_at: int | None = None
    system_change_at: int | None = None
    switch_model_at: int | None = None
    switch_model: str = "m-other"


@dataclass
class Agent:
    """One conversation. `request(turn)` gives turn `turn`'s body (turns count from 1, in
    order); `answered(text)` adds the server's answer before the next turn."""

    task: str
    model: str = "m"
    knobs: AgentKnobs = AgentKnobs()
    system_lines: int = 60
    max_tokens: int = 6
    messages: list[dict[str, Any]] = field(default_factory=list)
    _answer: str | None = None

    def _system(self, turn: int) -> str:
        lines = [f"Rule {i}: {_RULES}" for i in range(1, self.system_lines + 1)]
        at = self.knobs.system_change_at
        if at is not None and turn >= at:
            lines.insert(len(lines) // 2, _REMINDER)
        body = "You are a coding agent.\n" + "\n".join(lines)
        if not self.knobs.volatile_header:
            return body
        value = hashlib.sha256(f"{self.task}|{turn}".encode()).hexdigest()[:5]
        return f"x-anthropic-billing-header: cc_version=2.1.37; cch={value};\n" + body

    def _tools(self, turn: int) -> list[dict[str, Any]]:
        tools = [
            {
                "type": "function",
                "function": {
                    "name": name,
                    "description": f"The agent's {name} tool.",
                    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
                },
            }
            for name in _TOOLS
        ]
        at = self.knobs.reorder_tools_at
        return tools[::-1] if at is not None and turn >= at else tools

    def answered(self, text: str) -> None:
        self._answer = text

    def request(self, turn: int) -> dict[str, Any]:
        if turn == 1:
            self.messages = [{"role": "user", "content": self.task}]
        else:
            last = self.messages[-1]
            new = [{"role": "assistant", "content": self._answer or ""}, {"role": "user", "content": f"step {turn}"}]
            if turn == self.knobs.compact_at and len(self.messages) > 2:
                summary = {"role": "assistant", "content": f"(summary of {len(self.messages) - 2} earlier messages)"}
                self.messages = [self.messages[0], summary, last, *new]
            else:
                self.messages = self.messages + new
        at = self.knobs.switch_model_at
        return {
            "model": self.knobs.switch_model if at is not None and turn >= at else self.model,
            "stream": True,
            "max_tokens": self.max_tokens,
            "stream_options": {"include_usage": True},
            "tools": self._tools(turn),
            "messages": [{"role": "system", "content": self._system(turn)}, *self.messages],
        }
