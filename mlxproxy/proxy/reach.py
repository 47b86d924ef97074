"""Whether each upstream can be reached: a TCP connection is tried when `serve` starts (it
warns about each one that refuses), again when `/healthz` is asked and the last evidence is
older than `PROBE_EVERY_S` (`RETRY_EVERY_S` for an upstream last seen unreachable), and a forwarded request that could not connect counts as evidence
too. Nothing here runs per request on the forwarding path: a request that fails to connect
calls `Reach.saw` from its error branch only."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence
from contextlib import suppress
from typing import Protocol, TypeGuard
from urllib.parse import urlsplit

from mlxproxy.core.text import clip

__all__ = [
    "Reach",
    "HasReach",
    "has_reach",
    "probe",
    "refresh",
    "PROBE_TIMEOUT_S",
    "PROBE_EVERY_S",
    "RETRY_EVERY_S",
]

PROBE_TIMEOUT_S = 1.0  # a loopback or LAN server that accepts connections answers in far less
PROBE_EVERY_S = 5.0  # /healthz polled often (the live page: every 5 s) connects at most this often
RETRY_EVERY_S = 1.0  # ... and an upstream last seen unreachable at most this often (its return shows soon)


class Reach:
    """The latest evidence about one upstream: `reachable` (None before the first check) and
    the last connection error seen, kept after the upstream recovers, with its wall time."""

    __slots__ = ("reachable", "last_error", "last_error_at", "checked_mono")

    def __init__(self) -> None:
        self.reachable: bool | None = None
        self.last_error: str | None = None
        self.last_error_at: float | None = None
        self.checked_mono = -math.inf

    def saw(self, error: str | None) -> None:
        """A connection attempt ended: None when it connected, else why not."""
        self.checked_mono = time.monotonic()
        self.reachable = error is None
        if error is not None:
            self.last_error, self.last_error_at = error, round(time.time(), 3)

    def view(self) -> dict[str, object]:
        """`/healthz`' keys for this upstream."""
        return {"reachable": self.reachable, "last_error": self.last_error, "last_error_at": self.last_error_at}


class HasReach(Protocol):
    """An upstream as this module probes it (`proxy.upstream.Upstream` is one)."""

    base: str
    reach: Reach


class NamedReach(HasReach, Protocol):
    name: str


def has_reach(upstream: object) -> TypeGuard[HasReach]:
    """Whether `upstream` keeps its reachability (a `Reach`)."""
    return isinstance(getattr(upstream, "reach", None), Reach)


async def probe(base: str, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """None when a TCP connection to `base`'s host and port opens within `timeout_s`, else
    why not, in one line."""
    parts = urlsplit(base)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(parts.hostname, port), timeout_s)
    except asyncio.TimeoutError:
        return f"no connection within {timeout_s:g} s"
    except OSError as exc:
        return clip(f"{type(exc).__name__}: {exc.strerror or exc}", 200)
    writer.close()
    with suppress(OSError):
        await writer.wait_closed()
    return None


async def refresh(
    upstreams: Sequence[HasReach], max_age_s: float = PROBE_EVERY_S, retry_s: float = RETRY_EVERY_S
) -> None:
    """Probe, at once, every upstream whose last evidence is older than `max_age_s` (or than
    `retry_s`, when it was last seen unreachable: `/healthz` turns back to `ok` soon after it returns)."""
    now = time.monotonic()
    retry = min(max_age_s, retry_s)
    due = [u for u in upstreams if now - u.reach.checked_mono >= (retry if u.reach.reachable is False else max_age_s)]
    for u, error in zip(due, await asyncio.gather(*(probe(u.base) for u in due))):
        u.reach.saw(error)


def start_warnings(upstreams: Sequence[NamedReach]) -> list[str]:
    """Probe every upstream now (before the server's own loop runs) and return one warning
    line per upstream that cannot be reached."""
    asyncio.run(refresh(upstreams, max_age_s=0.0))
    return [
        f"upstream '{u.name}' at {u.base} is unreachable ({u.reach.last_error}); requests to it get "
        "HTTP 502 until it answers (see /healthz)"
        for u in upstreams
        if u.reach.reachable is False
    ]
