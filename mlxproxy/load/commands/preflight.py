"""A target is reached before a run starts, with bench's own first request (GET /v1/models,
`bench_requests.discover_model`), so a replay against a target with nothing listening is one line at
once instead of a whole schedule of failed requests."""

from __future__ import annotations

from mlxproxy.load.commands.bench_requests import discover_model
from mlxproxy.load.commands.common import fail, run_async, unreachable_message
from mlxproxy.load.run.client import MeasuringClient


async def reach(url: str, *, name: str, api_key: str | None, timeout_s: float) -> str | None:
    """None when `url` answers (an HTTP error is an answer: a server is there), else the
    one-line reason it cannot be reached."""
    async with MeasuringClient(url, name=name, api_key=api_key, timeout_s=timeout_s) as client:
        try:
            await discover_model(client)
        except Exception as exc:
            return unreachable_message(url, exc)
    return None


def require_reachable(url: str, *, name: str, api_key: str | None, timeout_s: float) -> None:
    """Exit 1 with the one-line reason, before anything is measured, when `url` cannot be reached."""
    reason = run_async(reach(url, name=name, api_key=api_key, timeout_s=timeout_s))
    if reason is not None:
        fail(reason, 1)
