"""Sweeps: closed-loop or open-loop steps run one after another until the server saturates or
breaks the SLO (`--sweep`), each step's group judged against the SLO as it finishes."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from mlxproxy.load.progress import Progress
from mlxproxy.load.report import summarize_records
from mlxproxy.load.results import Group
from mlxproxy.load.schedules import (
    MAX_AUTO_CONCURRENCY,
    MIN_PER_STREAM,
    RATE_UNIT,
    arrival_offsets,
    judge,
    ramp_offsets,
    step_figures,
    step_label,
    stop_reason,
)

__all__ = ["run_sweep", "open_loop_step", "closed_loop_step"]


async def run_sweep(
    step: Callable[[Any], Awaitable[tuple[Any, dict[str, dict[str, Any]]]]],
    steps: Sequence[float],
    slo: dict[str, float],
    *,
    target: str,
    params: dict[str, Any],
    out: list[Group],
    say: Callable[[str], None] | None = None,
    unit: str = "streams",
    progress: Progress | None = None,
) -> None:
    """Closed-loop steps at each concurrency of `steps` (empty: doubling from 1 until
    saturation). `step(concurrency)` runs one step and returns its `Timed` and extra keys
    per record id (e.g. a session's turn). Each step's group is appended to `out` as it
    finishes; `say` gets one line per step; `progress` shows each step as a phase. `unit`: what runs concurrently (streams, sessions)."""
    auto = not steps
    done: list[dict[str, Any]] = []
    i, conc = 0, 1
    while True:
        if not auto:
            if i >= len(steps):
                break
            conc = steps[i]
        if progress is not None:
            progress.phase(f"sweep {target}: {step_label(conc, unit)}")
        timed, extra = await step(conc)
        records = []
        for r in timed.records:
            d = r.to_dict(timeline=True)
            d["source_id"] = timed.source_ids.get(r.id)
            d.update(extra.get(r.id, {}))
            records.append(d)
        label = {"streams": "concurrency", RATE_UNIT: "rate"}.get(unit, unit)
        key = "rate" if unit == RATE_UNIT else "concurrency"
        summary = summarize_records(
            timed.records,
            lag_s=timed.lag_s or None,
            send_times=[r.t_start_mono for r in timed.records] if timed.lag_s else None,
        )
        g = Group(
            f"sweep {conc:g}",
            target,
            f"{label} {conc:g}" + ("/s" if unit == RATE_UNIT else ""),
            "sweep_step",
            {**params, key: conc, "step": conc, "sweep": True, "auto": auto, "unit": unit},
            summary.updated(judge(records, slo)),
            tuple(records),
        )
        out.append(g)
        done.append(step_figures(g))
        st = done[-1]
        if say:
            say(
                f"sweep {target}: {step_label(conc, unit)}: {st['ok']}/{st['requests']} ok, aggregate "
                f"{st['aggregate_tps'] or 0.0:.1f} tok/s, goodput {st['goodput']['share'] or 0.0:.0%}, SLO "
                + ("held" if st["slo_met"] else "broken: " + st["problem"])
            )
        i += 1
        if auto:
            if stop_reason(done) or conc >= MAX_AUTO_CONCURRENCY:
                break
            conc *= 2


def open_loop_step(
    client: Any, make: Callable[[int], list[Any]], n: int, arrival: str = "constant", seed: int = 0, ramp_s: float = 0.0
) -> Callable[[float], Awaitable[Any]]:
    """A sweep step of `n` requests made by `make(n)`, sent in an open loop at the step's rate
    (after an unmeasured ramp of `ramp_s` seconds up to it)."""

    async def step(rate: float) -> tuple[Any, dict[str, dict[str, Any]]]:
        ramp = ramp_offsets(rate, ramp_s, arrival, seed)
        return await client.run_open_loop(
            make(n), arrival_offsets(n, rate, arrival, seed), ramp=(make(len(ramp)), ramp, ramp_s) if ramp else None
        ), {}

    return step


def closed_loop_step(client: Any, make: Callable[[int], list[Any]], per_stream: int) -> Callable[[int], Awaitable[Any]]:
    """A sweep step of `concurrency` streams sending `concurrency * per_stream` (at least
    MIN_PER_STREAM each) requests made by `make(n)`."""
    per = max(per_stream, MIN_PER_STREAM)

    async def step(conc: int) -> tuple[Any, dict[str, dict[str, Any]]]:
        return await client.run_closed_loop(make(conc * per), conc), {}

    return step
