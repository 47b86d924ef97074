"""How late the proxy's own event loop runs: the delay no per-request figure can see.

While the loop is busy (another stream's events, a garbage collection, finishing a big
record, a slow log handler), a request that has already reached the proxy's socket waits
unread, and a token that has reached it waits unforwarded. Neither wait is inside the
record's `ttft_s` or `mlxproxy_proxy_overhead_seconds`, yet the client waits through both.
`LoopLagMonitor` asks the loop to call it back every `interval_s` and observes how much
later than asked the callback ran into `mlxproxy_event_loop_lag_seconds`: when that
histogram's upper buckets fill, the proxy itself, not the server, is slowing clients down.
Cost: one timer callback per interval (20 per second by default).
"""

from __future__ import annotations

import asyncio
import time

from prometheus_client import CollectorRegistry, Histogram

__all__ = ["LoopLagMonitor", "LAG_BUCKETS"]

# uvloop's timers have millisecond resolution: lags under ~1 ms are not resolved there
LAG_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class LoopLagMonitor:
    """Observe the event loop's lag every `interval_s` while started."""

    def __init__(self, registry: CollectorRegistry, interval_s: float = 0.05) -> None:
        self.interval_s = interval_s
        self.histogram = Histogram(
            "mlxproxy_event_loop_lag_seconds",
            "How much later than scheduled the proxy's event loop ran a timer callback "
            f"(sampled every {interval_s:g} s).",
            buckets=LAG_BUCKETS,
            registry=registry,
        )
        self.max_lag_s = 0.0  # the largest lag seen since start (also in /healthz)
        self._handle: asyncio.TimerHandle | None = None
        self._due = 0.0

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._due = time.perf_counter() + self.interval_s
        self._handle = loop.call_later(self.interval_s, self._tick, loop)

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        t = time.perf_counter()
        lag = max(0.0, t - self._due)
        self.histogram.observe(lag)
        if lag > self.max_lag_s:
            self.max_lag_s = lag
        self._due = t + self.interval_s
        self._handle = loop.call_later(self.interval_s, self._tick, loop)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
