"""Open-loop arrival schedules and the load generator's own limit.

Arrival schedules (`--rate R --arrival constant|poisson --seed N`): request i is due at
`offsets[i]` seconds from the start of the step, whatever the server does (open loop).
`constant` spaces requests exactly 1/R apart; `poisson` draws independent exponential gaps
of mean 1/R from a seeded generator, so a run can be repeated exactly.

The load generator measures its own lateness (schedule lag: actual send time - due time)
and says when it, rather than the server, was the limit: when the lag's p99 exceeds both
`GENERATOR_LAG_S` (25 ms) and a quarter of the mean gap, or when it sent under 95 % of the
schedule's own rate, the requests did not go out as asked and the figures describe the
generator, not the server. Each request's own lag is also kept on its record
(`schedule_lag_s`): the SLO and capacity figures of an open loop count it as part of the
request's latency (the request waited that long in the generator), so a generator that falls
behind a saturated server cannot make the server look fast (coordinated omission).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

from mlxproxy.load.data.summary import JSONObject, Summary, json_float

__all__ = [
    "ARRIVALS",
    "arrival_offsets",
    "ramp_offsets",
    "GENERATOR_LAG_S",
    "generator_note",
    "sent_rate",
    "schedule",
]

ARRIVALS = ("constant", "poisson")
GENERATOR_LAG_S = 0.025  # schedule lag p99 above this and above ...
GENERATOR_LAG_SHARE = 0.25  # ... this share of the mean gap (1/R): the generator was the limit
GENERATOR_RATE_SHARE = 0.95  # or it sent under this share of the schedule's own rate


def arrival_offsets(n: int, rate: float, arrival: str = "constant", seed: int = 0) -> list[float]:
    """Due times (seconds from the step's start) of `n` requests at `rate` requests/s."""
    if not rate > 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate!r}")
    if arrival == "constant":
        return [i / rate for i in range(n)]
    if arrival != "poisson":
        raise ValueError(f"unknown arrival {arrival!r}; choose one of {', '.join(ARRIVALS)}")
    rng = random.Random(seed)
    out, t = [], 0.0
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def ramp_offsets(rate: float, ramp_s: float, arrival: str = "constant", seed: int = 0) -> list[float]:
    """Due times of a ramp: the arrival rate rising linearly from 0 to `rate` over `ramp_s`
    seconds (about rate * ramp_s / 2 requests). Arrivals are those of a unit-rate schedule
    (evenly spaced, or Poisson from `seed`) mapped through the inverse of the ramp's
    cumulative rate, Lambda(t) = rate * t**2 / (2 * ramp_s)."""
    if not ramp_s > 0:
        return []
    total = rate * ramp_s / 2.0
    if arrival == "constant":
        units = [float(i) for i in range(int(total))]
    else:
        rng = random.Random(seed + 1)  # not the measured schedule's draws
        units, s = [], rng.expovariate(1.0)
        while s < total:
            units.append(s)
            s += rng.expovariate(1.0)
    return [math.sqrt(2.0 * ramp_s * u / rate) for u in units]


def schedule(
    n: int, rate: float, arrival: str = "constant", seed: int = 0
) -> tuple[list[float], dict[str, float | str | int | None]]:
    """`arrival_offsets` and the group params that describe them (`scheduled_rate`: the
    schedule's own rate, which a short Poisson schedule makes differ from `rate`)."""
    offs = arrival_offsets(n, rate, arrival, seed)
    return offs, {"rate": rate, "arrival": arrival, "seed": seed, "scheduled_rate": sent_rate(offs)}


def sent_rate(send_times: Sequence[float]) -> float | None:
    """Requests/s actually sent: (n - 1) / (last send - first send)."""
    ts = sorted(send_times)
    if len(ts) < 2 or ts[-1] <= ts[0]:
        return None
    return (len(ts) - 1) / (ts[-1] - ts[0])


def generator_note(label: str, summary: Summary, params: JSONObject | None = None) -> str | None:
    """One line on the load generator's schedule lag; says when the generator, rather than
    the server, was the limit. None when the group had no schedule."""
    lag = summary.stat("schedule_lag_s")
    if lag is None or not lag.count:
        return None
    params = params or {}
    rate, scheduled = json_float(params.get("rate")), json_float(params.get("scheduled_rate"))
    achieved = summary.figure("sent_rate")
    p50, p99 = lag.p50 or 0.0, lag.p99 or 0.0
    limit = max(GENERATOR_LAG_S, GENERATOR_LAG_SHARE / rate) if rate else GENERATOR_LAG_S
    head = f"{label}: schedule lag p50 {p50 * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms"
    if scheduled and achieved:
        head += f"; sent {achieved:.2f} req/s, scheduled {scheduled:.2f}"
    why = []
    if p99 > limit:
        why.append(f"lag p99 over {limit * 1000:.0f} ms")
    if scheduled and achieved and achieved < GENERATOR_RATE_SHARE * scheduled:
        why.append(f"sent under {GENERATOR_RATE_SHARE:.0%} of the scheduled rate")
    if why:
        return (
            head + f": the load generator, not the server, was the limit ({', '.join(why)}); these figures do"
            " not describe the server at the load asked"
        )
    return head + " (the load generator kept to its schedule)"
