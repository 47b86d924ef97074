"""Bounds for figures measured against wall-clock truth on a shared machine.

A loaded machine (a 2-core CI runner, a CPU hog beside the tests) delivers events late,
never early: latencies (TTFT) grow and rates (tok/s) fall, by tens of percent when a
busy neighbour holds a core. A late first event can also shorten a rate's window, so
rates get a little room upwards too. The bounds are ratios to the truth, wide on the
side load pushes to and narrow on the other, where a real measurement bug would show.
"""

from __future__ import annotations

#: a latency may be up to this much longer than the truth on a loaded machine
LATE = 0.5
#: a rate may be up to this much lower than the truth on a loaded machine
SLOW = 0.30
#: how far the other way a correct measurement may land (clock and scheduling granularity)
EARLY = 0.10


def latency_ok(measured: float | None, truth: float) -> bool:
    return measured is not None and truth * (1 - EARLY) <= measured <= truth * (1 + LATE)


def rate_ok(measured: float | None, truth: float) -> bool:
    return measured is not None and truth * (1 - SLOW) <= measured <= truth * (1 + EARLY)
