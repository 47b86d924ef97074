"""The start ramp of a sweep's closed-loop and sessions steps (docs/METRICS.md, "Start ramp"):
streams start one after another over a window, never in one instant; each stream's first request
is its warm-up; a fleet keeps every stream's own start; the sweep's window is the median TTFT of
its lightest step. A scripted client (no sockets): it answers after a fixed time."""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest

from mlxproxy.core.record import Record
from mlxproxy.load.data.results import Group
from mlxproxy.load.run.client import PreparedRequest, Timed
from mlxproxy.load.run.plan import stagger
from mlxproxy.load.run.shapes import ClosedLoop, Load, Sessions, Turn
from mlxproxy.load.run.sweep import run_sweep

ANSWER_S = 0.1


class ScriptedClient:
    """Answers every request after `ANSWER_S`, with a record of when it was sent."""

    def __init__(self) -> None:
        self.ids = itertools.count()

    async def send(self, req: PreparedRequest, fresh_connection: bool = False) -> Record:
        t0 = time.perf_counter()
        await asyncio.sleep(ANSWER_S)
        return record(f"r{next(self.ids)}", t0, ttft=ANSWER_S / 2, e2e=ANSWER_S)


def record(id_: str, started: float, ttft: float, e2e: float) -> Record:
    return Record(
        id=id_, started_at=1000.0 + started, upstream="t", model="m", endpoint="chat_completions", stream=True,
        status=200, outcome="ok", ttft_s=ttft, e2e_s=e2e, duration_s=e2e, completion_tokens_reported=8,
        t_start_mono=started,
    )  # fmt: skip


def requests(n: int) -> list[PreparedRequest]:
    return [PreparedRequest("POST", "/v1/chat/completions", b"{}") for _ in range(n)]


def test_stagger_spreads_starts_evenly_over_the_window_and_none_without_one() -> None:
    assert stagger(4, 0.2) == pytest.approx((0.0, 0.05, 0.1, 0.15))
    assert stagger(3, 0.0) == (0.0, 0.0, 0.0)
    assert stagger(1, 5.0) == (0.0,)


def test_a_staggered_closed_loop_starts_each_stream_at_its_offset_and_marks_its_first_request() -> None:
    shape = ClosedLoop(4).spread(0.06)  # the window shorter than a request, as one TTFT is
    client = ScriptedClient()
    t0 = time.perf_counter()
    out = asyncio.run(shape.send(client, Load(requests(12))))  # type: ignore[arg-type]
    firsts = sorted((r for r in out.records if r.id in out.firsts), key=lambda r: r.t_start_mono)
    assert len(firsts) == 4
    for offset, r in zip(shape.starts, firsts):
        assert r.t_start_mono - t0 >= offset - 0.002  # never before its start
    # the streams did not start in one instant: the last began most of the window after the first
    assert firsts[-1].t_start_mono - firsts[0].t_start_mono >= 0.03
    # every stream's first request is sent before any stream's second
    assert max(r.t_start_mono for r in firsts) <= min(r.t_start_mono for r in out.records if r.id not in out.firsts)


def test_a_fleet_keeps_each_streams_and_slots_own_start() -> None:
    loop = ClosedLoop(5, stagger(5, 1.0))
    parts = loop.split(Load(requests(10)), 2)
    assert [p.starts for p, _ in parts] == [pytest.approx((0.0, 0.4, 0.8)), pytest.approx((0.2, 0.6))]  # type: ignore[attr-defined]
    runs = [[Turn(r)] for r in requests(6)]
    sess = Sessions(3, stagger(3, 0.3)).split(Load(runs=runs), 2)
    assert [p.starts for p, _ in sess] == [pytest.approx((0.0, 0.2)), pytest.approx((0.1,))]  # type: ignore[attr-defined]


def test_the_sweeps_window_is_the_lightest_steps_median_ttft() -> None:
    seen: list[tuple[int, float]] = []

    async def step(n: float, window_s: float) -> tuple[Timed, dict[str, object]]:
        k = int(n)
        seen.append((k, window_s))
        ttft = 0.05 if k == 1 else 0.01 * k  # breaks the 0.1 s SLO past 10
        recs = [record(f"{k}-{len(seen)}-{i}", i * 0.1, ttft, 0.1) for i in range(max(30, 3 * k))]
        return Timed(records=recs), {}

    out: list[Group] = []
    asyncio.run(run_sweep(step, [], {"ttft_p95": 0.1}, target="t", params={}, out=out, min_s=0.0))  # type: ignore[arg-type]
    assert seen[0] == (1, 0.0)  # the first step, one stream, starts at once
    assert all(w == 0.05 for k, w in seen if k > 1)  # every later step: step 1's median TTFT
    assert all(g.params.get("start_spread_s") == 0.05 for g in out if g.params["step"] != 1)
