"""The suite's pytest fixtures. Shared helper functions live in `support.py`."""

from __future__ import annotations

import pytest

# FIXTURES, closed_port, splits and wait_for stay importable from here for test files written before
# support.py existed (branches merged later); tests/test_architecture.py names any file that does.
from support import FIXTURES, closed_port, fast_stack_installed, read_fixture, splits, wait_for  # noqa: F401


@pytest.fixture
def fixture_bytes():
    return read_fixture


@pytest.fixture(params=["plain", "fast"])
def stack(request, monkeypatch):
    """Run the test on both server stacks: `plain` (asyncio + h11, what a platform without
    uvloop/httptools wheels gets) and `fast` (uvloop + httptools, the default install).
    Every server the test starts through mlxproxy.edge.runner picks it up from MLXPROXY_STACK."""
    if request.param == "fast" and not fast_stack_installed():
        pytest.skip("the fast stack needs uvloop and httptools installed")
    monkeypatch.setenv("MLXPROXY_STACK", request.param)
    return request.param
