"""proxy/reach.py: a dead upstream is unreachable with its reason, a live one reachable, and
the evidence is refreshed once it is older than asked (the upstream came up meanwhile)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from mlxproxy.edge.runner import ServerThread
from mlxproxy.proxy.reach import Reach, refresh
from mlxproxy.sim.app import create_app as create_sim
from support import closed_port


@dataclass
class Up:
    base: str
    reach: Reach = field(default_factory=Reach)


def test_reach_follows_the_upstream_coming_up() -> None:
    port = closed_port()
    up = Up(f"http://127.0.0.1:{port}")
    assert up.reach.reachable is None
    asyncio.run(refresh([up]))
    assert up.reach.reachable is False and "ConnectionRefusedError" in (up.reach.last_error or "")
    with ServerThread(create_sim("healthy"), port=port):
        asyncio.run(refresh([up]))  # evidence younger than 5 s: not probed again
        assert up.reach.reachable is False
        asyncio.run(refresh([up], max_age_s=0.0))
        assert up.reach.reachable is True and up.reach.last_error is not None  # the last error is kept
        view = up.reach.view()
        assert view["reachable"] is True and view["last_error_at"] > 1.7e9
