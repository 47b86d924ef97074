"""The burst shape: `size` requests due together every `every_s` seconds, sent by the one
runner from this process or split over workers like any due-time shape."""

from __future__ import annotations

import orjson

from mlxproxy.edge.runner import ServerThread, run_async
from mlxproxy.load.run.client import MeasuringClient, PreparedRequest, Timed
from mlxproxy.load.run.runner import send
from mlxproxy.load.run.shapes import Burst, Load
from mlxproxy.sim.app import create_app as create_sim


def chat(i: int) -> PreparedRequest:
    body = {"model": "m", "stream": True, "max_tokens": 4, "messages": [{"role": "user", "content": f"hi {i}"}]}
    return PreparedRequest("POST", "/v1/chat/completions", orjson.dumps(body), (("content-type", "application/json"),))


def test_burst_due_times_step_every_interval_and_split_into_a_disjoint_whole() -> None:
    shape = Burst(3, 0.5)
    due = shape.due(Load([chat(i) for i in range(8)]))
    assert [r.offset_s for r in due.requests] == [0.0, 0.0, 0.0, 0.5, 0.5, 0.5, 1.0, 1.0]
    parts = shape.split(Load([chat(i) for i in range(8)]), 3)
    assert len(parts) == 3 and all(isinstance(s, type(parts[0][0])) for s, _ in parts)
    assert sorted(r.offset_s for _, load in parts for r in load.requests) == [r.offset_s for r in due.requests]
    assert [len(load.requests) for _, load in parts] == [3, 3, 2]
    assert Burst(0, 1.0).due(Load([chat(0), chat(1)])).requests[1].offset_s == 1.0  # size 0 counts as 1


def test_bursts_go_out_together_and_a_step_apart() -> None:
    async def go(url: str) -> Timed:
        async with MeasuringClient(url) as client:
            return await send(Burst(4, 0.3), Load([chat(i) for i in range(12)]), client)

    with ServerThread(create_sim("healthy", speed=50.0)) as sim:
        timed = run_async(go(sim.url))
    assert len(timed.records) == 12 and all(r.outcome == "ok" for r in timed.records)
    assert len(timed.lag_s) == 12 and all(lag >= 0 for lag in timed.lag_s)
    # each request's due time is its send time less its lag: three steps of four, 0.3 s apart
    due = sorted(r.t_start_mono - timed.lag_by_id[r.id] for r in timed.records)
    steps = [round(d - due[0], 2) for d in due]
    assert steps == [0.0] * 4 + [0.3] * 4 + [0.6] * 4
