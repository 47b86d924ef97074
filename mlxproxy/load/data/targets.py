"""What `bench` measured of each target: the target, its prompt-size calibration and its groups
(`TargetResult`), read by the bench report and built again from a result file."""

from __future__ import annotations

from dataclasses import dataclass, field

from mlxproxy.load.data.results import Group

__all__ = ["Calibration", "Target", "TargetResult"]


@dataclass(frozen=True)
class Target:
    """A server to measure and how the client reaches it: its timeout, API key and the most
    connections one process opens to it (`--max-connections`; None: the client's default)."""

    name: str
    url: str
    timeout_s: float = 1800.0
    api_key: str | None = None
    max_connections: int | None = None


@dataclass
class Calibration:
    """prompt_tokens ~= intercept + slope * chars, fitted on the target's own usage."""

    slope: float = 0.25
    intercept: float = 0.0
    source: str = "assumed 4 chars/token (the target reported no usage)"

    def chars_for(self, tokens: int) -> int:
        return max(1, int(round((tokens - self.intercept) / self.slope)))


@dataclass
class TargetResult:
    target: Target
    model: str | None = None
    calibration: Calibration = field(default_factory=Calibration)
    groups: list[Group] = field(default_factory=list)
    error: str | None = None
