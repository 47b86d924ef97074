"""The requests being forwarded, held in one place.

A request enters when its upstream admitted it (`Upstream.admit`, whose count is the
request's `concurrency`) and leaves when its last byte has been forwarded or it failed, not
when its record is done: a keep-alive client sends its next request while the proxy still
finishes the previous record. This registry is the one source of the `in flight` figures:
the upstream's count (released here), the `mlxproxy_requests_in_flight` gauge, `/healthz`
and the live view of `/streams` (`RequestMeter.snapshot`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mlxproxy.core.meter import Snapshot

if TYPE_CHECKING:
    from mlxproxy.proxy.metrics import ProxyMetrics
    from mlxproxy.proxy.relay import Flow

__all__ = ["InFlight"]


class InFlight:
    """The forwarded requests in flight, by record id."""

    __slots__ = ("_flows", "_metrics")

    def __init__(self, metrics: ProxyMetrics) -> None:
        self._flows: dict[str, tuple[Flow, str]] = {}
        self._metrics = metrics

    def enter(self, flow: Flow, model_label: str) -> None:
        """`flow` (already admitted by its upstream) is being forwarded."""
        self._flows[flow.meter.request_id] = (flow, model_label)
        self._metrics.request_started(flow.upstream.name, model_label)

    def leave(self, flow: Flow) -> None:
        """`flow` is done forwarding: it leaves its upstream's count and the gauge. Idempotent."""
        entry = self._flows.pop(flow.meter.request_id, None)
        if entry is not None:
            flow.upstream.leave()
            self._metrics.request_ended(flow.upstream.name, entry[1])

    def __len__(self) -> int:
        return len(self._flows)

    def snapshots(self, now: float) -> list[Snapshot]:
        """Each request in flight as far as it got, at `now`."""
        return [flow.meter.snapshot(now) for flow, _ in list(self._flows.values())]
