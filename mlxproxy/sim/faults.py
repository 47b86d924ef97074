"""Fault switches: the `X-Sim-Fault` request header and the profile's `faults` knob.

Syntax: a comma-separated list of faults, each `name[=value][@token]`:

| fault | effect |
|---|---|
| `http-error=CODE` | answer at once with HTTP CODE (400-599) and the style's error body |
| `reset-before-headers` | reset the TCP connection without sending anything |
| `reset-mid-stream[@K]` | reset the connection just before token K is sent |
| `malformed[@K]` | send `data: ` + invalid JSON and invalid UTF-8 just before token K, then go on |
| `stall=SECONDS[@K]` | pause SECONDS of wall time (not scaled by `--speed`) before token K; later tokens shift |
| `stream-error[@K]` | the style's own mid-stream error ending just before token K |

K is a 0-based index into the visible tokens; without `@K` it is the middle one
(`n_visible // 2`). `@0` puts the fault before the first token (a stall there is a silent
prefill). The request header, when present, replaces the profile's `faults`. `parse_faults`
raises ValueError with one clear sentence for anything else.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

MIDDLE = -1  # "@K" not given: the middle visible token


@dataclass(frozen=True)
class Faults:
    """Parsed faults; `None` fields are off. Token positions may be MIDDLE (resolve with `at`)."""

    http_error: int | None = None
    reset_before_headers: bool = False
    reset_at: int | None = None
    malformed_at: int | None = None
    stall: tuple[float, int] | None = None  # its seconds and token position, given together
    stream_error_at: int | None = None

    @staticmethod
    def at(position: int | None, n_visible: int) -> int | None:
        """The token index a position means for an answer of `n_visible` tokens (None = off)."""
        if position is None:
            return None
        index = n_visible // 2 if position == MIDDLE else position
        return min(index, max(n_visible - 1, 0))

    @property
    def any(self) -> bool:
        return self != Faults()


def _position(name: str, at: str | None) -> int:
    if at is None:
        return MIDDLE
    try:
        index = int(at)
    except ValueError:
        raise ValueError(f"fault {name!r}: the token after '@' must be an integer, got {at!r}") from None
    if index < 0:
        raise ValueError(f"fault {name!r}: the token after '@' must be >= 0, got {index}")
    return index


def parse_faults(text: str | None) -> Faults:
    """Parse the fault syntax above; empty or None gives no faults."""
    faults = Faults()
    for raw in (text or "").split(","):
        item = raw.strip()
        if not item:
            continue
        head, _, at = item.partition("@")
        name, _, value = head.partition("=")
        name, value = name.strip().lower(), value.strip()
        at_value = at.strip() if "@" in item else None
        if name == "http-error":
            try:
                code = int(value)
            except ValueError:
                code = 0
            if not 400 <= code <= 599:
                raise ValueError(f"fault 'http-error' needs a status code 400-599, e.g. http-error=503; got {item!r}")
            faults = replace(faults, http_error=code)
        elif name == "reset-before-headers":
            faults = replace(faults, reset_before_headers=True)
        elif name == "reset-mid-stream":
            faults = replace(faults, reset_at=_position(name, at_value))
        elif name == "malformed":
            faults = replace(faults, malformed_at=_position(name, at_value))
        elif name == "stream-error":
            faults = replace(faults, stream_error_at=_position(name, at_value))
        elif name == "stall":
            try:
                seconds = float(value)
            except ValueError:
                seconds = -1.0
            if not (math.isfinite(seconds) and seconds >= 0):
                raise ValueError(f"fault 'stall' needs seconds >= 0, e.g. stall=2.5@3; got {item!r}")
            faults = replace(faults, stall=(seconds, _position(name, at_value)))
        else:
            raise ValueError(
                f"unknown fault {name!r}; use http-error=CODE, reset-before-headers, reset-mid-stream[@K], "
                "malformed[@K], stall=SECONDS[@K] or stream-error[@K]"
            )
    return faults
