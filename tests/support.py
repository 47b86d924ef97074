"""What tests share besides fixtures: the recorded fixtures' location, the ways a parser is fed,
readiness polling and a port nothing listens on. Import it as `from support import ...`
(`tests/` is on pytest's `pythonpath`); `conftest.py` keeps only pytest fixtures."""

from __future__ import annotations

import random
import socket
import time
from collections.abc import Callable
from pathlib import Path

#: the tests folder, the repository and the byte-exact fixtures, wherever a test file sits
TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
FIXTURES = TESTS / "fixtures"


def read_fixture(rel: str) -> bytes:
    """The bytes of `tests/fixtures/<rel>`."""
    return (FIXTURES / rel).read_bytes()


def splits(data: bytes, seed: int = 0, tries: int = 8) -> list[list[bytes]]:
    """The ways every parser test feeds a body: whole, byte by byte, and at random cuts."""
    ways = [[data], [data[i : i + 1] for i in range(len(data))]]
    rng = random.Random(seed)
    for _ in range(tries):
        k = rng.randint(1, max(1, min(20, len(data) - 1)))
        cuts = sorted(rng.sample(range(1, len(data)), k)) if len(data) > 1 else []
        parts, prev = [], 0
        for c in cuts + [len(data)]:
            parts.append(data[prev:c])
            prev = c
        ways.append(parts)
    return ways


def wait_for(pred: Callable[[], object], timeout_s: float = 5.0) -> bool:
    """Poll `pred` until true or the deadline (readiness polling, never a measurement)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.005)
    return False


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def fast_stack_installed() -> bool:
    """Whether uvloop and httptools import (the `fast` server stack)."""
    try:
        import httptools  # noqa: F401
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True
