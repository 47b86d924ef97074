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
        asyncio.run(refresh([up], retry_s=60))  # evidence younger than asked: not probed again
        assert up.reach.reachable is False
        asyncio.run(refresh([up], max_age_s=0.0))
        assert up.reach.reachable is True and up.reach.last_error is not None  # the last error is kept
        view = up.reach.view()
        assert view["reachable"] is True and view["last_error_at"] > 1.7e9


def test_healthz_turns_degraded_while_an_upstream_is_unreachable_and_back_to_ok() -> None:
    import httpx

    from support import proxy, wait_for

    port = closed_port()
    with proxy(f"http://127.0.0.1:{port}") as (url, _app):

        def status() -> str:
            return str(httpx.get(f"{url}/healthz", timeout=5).json()["status"])

        body = httpx.get(f"{url}/healthz", timeout=5).json()
        assert body["status"] == "degraded" and body["upstreams"][0]["reachable"] is False
        with ServerThread(create_sim("healthy"), port=port):
            assert wait_for(lambda: status() == "ok", timeout_s=5.0)  # re-probed within RETRY_EVERY_S
        reply = httpx.get(f"{url}/healthz", timeout=5)
        assert reply.status_code == 200  # the proxy itself runs: health checks that restart it stay quiet
        # (its evidence is fresh for PROBE_EVERY_S; a request that cannot connect is evidence at once)
        assert (
            httpx.post(f"{url}/v1/chat/completions", json={"model": "m", "messages": []}, timeout=5).status_code == 502
        )
        assert status() == "degraded"
