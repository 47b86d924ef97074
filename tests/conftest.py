from __future__ import annotations

import random
import socket
import time
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"


def read_fixture(rel: str) -> bytes:
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


@pytest.fixture
def fixture_bytes():
    return read_fixture


def wait_for(pred, timeout_s: float = 5.0) -> bool:
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


def _fast_stack_installed() -> bool:
    try:
        import httptools  # noqa: F401
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(params=["plain", "fast"])
def stack(request, monkeypatch):
    """Run the test on both server stacks: `plain` (asyncio + h11, what a platform without
    uvloop/httptools wheels gets) and `fast` (uvloop + httptools, the default install).
    Every server the test starts through mlxproxy.runner picks it up from MLXPROXY_STACK."""
    if request.param == "fast" and not _fast_stack_installed():
        pytest.skip("the fast stack needs uvloop and httptools installed")
    monkeypatch.setenv("MLXPROXY_STACK", request.param)
    return request.param
