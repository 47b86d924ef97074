"""A closed loop's streams (and a sessions step's conversations) sent from a thread each
(`mlxproxy.load.fleet.threads.Threads`, what the commands use without --workers): every stream
on a thread of its own with its own client, all requests back once, the connection cap kept by
one loop where it is below the streams, and a cancel keeping what had finished."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

import orjson
import pytest

from mlxproxy.core.record import Record
from mlxproxy.edge.runner import ServerThread, run_async
from mlxproxy.load.fleet import threads
from mlxproxy.load.fleet.segment import WorkersError
from mlxproxy.load.fleet.threads import STREAM_THREADS, Threads, streams_fleet
from mlxproxy.load.fleet.workers import Workers
from mlxproxy.load.run.client import MeasuringClient, PreparedRequest, Timed
from mlxproxy.load.run.runner import ONE_PROCESS, send
from mlxproxy.load.run.shapes import ClosedLoop, Load
from mlxproxy.sim.app import create_app as create_sim
from support import Answered, cancel_after_some


def chat(i: int) -> PreparedRequest:
    body = orjson.dumps(
        {"model": "m", "stream": True, "max_tokens": 6, "messages": [{"role": "user", "content": f"{i}"}]}
    )
    return PreparedRequest("POST", "/v1/chat/completions", body)


def _sent_from(monkeypatch: pytest.MonkeyPatch) -> list[threading.Thread]:
    """The thread each segment ran on, in the order they started (the objects, kept: an ended
    thread's `get_ident` is given to the next thread started, which on a busy host can be a
    stream that started after another had sent all its requests)."""
    seen: list[threading.Thread] = []
    real = threads.run_part

    async def spy(seg: Any, measured: Any = None) -> Any:
        seen.append(threading.current_thread())
        return await real(seg, measured)

    monkeypatch.setattr(threads, "run_part", spy)
    return seen


def test_each_stream_of_a_closed_loop_is_sent_from_a_thread_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _sent_from(monkeypatch)
    ticks = 0

    def tick() -> None:
        nonlocal ticks
        ticks += 1

    async def go(url: str) -> tuple[Timed, list[Record]]:
        async with MeasuringClient(url) as client:
            timed = await send(ClosedLoop(3), Load([chat(i) for i in range(30)]), client, fleet=Threads(), tick=tick)
            return timed, list(client.finished)

    with ServerThread(create_sim("healthy", speed=20.0)) as sim:
        timed, finished = run_async(go(sim.url))
    assert len(seen) == 3 and len(set(seen)) == 3 and threading.current_thread() not in seen
    assert len(timed.records) == 30 and all(r.outcome == "ok" for r in timed.records)
    assert sorted(r.id for r in finished) == sorted(r.id for r in timed.records)  # each once, as the client's
    assert ticks == 30
    assert max(r.concurrency for r in timed.records) == 1  # each thread's client: its own stream in flight
    starts = [r.t_start_mono for r in timed.records]
    assert starts == sorted(starts)  # one clock, in send order (the warm-up is the first of each stream)


def test_a_connection_cap_below_the_streams_keeps_them_on_one_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _sent_from(monkeypatch)

    async def go(url: str) -> Timed:
        async with MeasuringClient(url, max_connections=2) as client:
            return await send(ClosedLoop(3), Load([chat(i) for i in range(12)]), client, fleet=Threads())

    with ServerThread(create_sim("healthy", speed=20.0)) as sim:
        timed = run_async(go(sim.url))
    assert seen == []  # not split: the cap is one process's, and its queue one
    assert len(timed.records) == 12 and all(r.outcome == "ok" for r in timed.records)


def test_a_cancel_stops_every_thread_and_keeps_what_had_finished() -> None:
    reqs = [chat(i) for i in range(200)]

    async def go(url: str) -> tuple[int, list[Record], int]:
        async with MeasuringClient(url) as client:
            return await cancel_after_some(client, send(ClosedLoop(3), Load(reqs), client, fleet=Threads()))

    with ServerThread(create_sim("healthy", speed=1.0, decode_tps=20.0)) as sim:
        seen, finished, in_flight = run_async(go(sim.url))
    assert 4 <= seen <= len(finished) < len(reqs) and in_flight == 0
    assert len({r.id for r in finished}) == len(finished) and all(r.outcome == "ok" for r in finished)
    assert not [t for t in threading.enumerate() if t.name.startswith("mlxproxy-stream-")]


def test_streams_get_threads_unless_workers_are_given() -> None:
    assert streams_fleet(ONE_PROCESS) is STREAM_THREADS
    given = Workers(2)
    assert streams_fleet(given) is given
    assert Counter(type(streams_fleet(f)).__name__ for f in (ONE_PROCESS, Workers(1))) == {"Threads": 2}


@pytest.mark.parametrize("mode", ["concurrency", "sessions"])
def test_replay_sends_closed_loops_and_conversations_from_threads_unless_given_workers(mode: str) -> None:
    from mlxproxy.load.commands.replay import ReplayOptions, replay_plan
    from mlxproxy.load.commands.sweep_options import SweepOptions

    sweep = SweepOptions()
    for swept in (None, sweep):
        assert replay_plan(ReplayOptions(mode=mode, sweep=swept)).test.fleet is STREAM_THREADS  # type: ignore[attr-defined]
        given = Workers(2)
        assert replay_plan(ReplayOptions(mode=mode, sweep=swept, workers=given)).test.fleet is given  # type: ignore[attr-defined]
    # an open loop is not a closed one: its requests are due at their times, from the fleet given
    assert replay_plan(ReplayOptions(mode="rate", rate=2.0)).test.fleet is ONE_PROCESS  # type: ignore[attr-defined]


def test_bench_sends_its_sweep_from_threads_unless_given_workers() -> None:
    from mlxproxy.load.commands.bench import BenchOptions, StreamsSweep, bench_plan
    from mlxproxy.load.commands.sweep_options import SweepOptions

    def sweep_sender(opts: BenchOptions) -> object:
        (test,) = (t for t in bench_plan(opts).tests if isinstance(t, StreamsSweep))
        return test.sender

    assert sweep_sender(BenchOptions(sweep=SweepOptions())) is STREAM_THREADS
    given = Workers(2)
    assert sweep_sender(BenchOptions(sweep=SweepOptions(), workers=given)) is given


def test_a_failed_stream_thread_is_one_line_and_stops_the_others(monkeypatch: pytest.MonkeyPatch) -> None:
    """One thread's failure is the run's (`WorkersError`, one line) as soon as it happens: the
    other streams are stopped, not left to send their ~20 s of requests, and no thread is left."""
    real = threads.run_part

    async def second_breaks(seg: Any, measured: Any = None) -> Any:
        if seg.index == 1:
            raise RuntimeError("the stream broke")
        return await real(seg, measured)

    monkeypatch.setattr(threads, "run_part", second_breaks)
    app = Answered(create_sim("healthy", speed=1.0, decode_tps=20.0))
    reqs = [chat(i) for i in range(200)]  # ~0.3 s each on 3 streams: ~20 s if never stopped

    async def go(url: str) -> list[Record]:
        async with MeasuringClient(url) as client:
            with pytest.raises(WorkersError, match=r"^a stream's thread failed: RuntimeError: the stream broke$"):
                await send(ClosedLoop(3), Load(reqs), client, fleet=Threads())
            return list(client.finished)

    with ServerThread(app) as sim:
        finished = run_async(go(sim.url))
    assert finished == [] and app.done < 20
    assert not [t for t in threading.enumerate() if t.name.startswith("mlxproxy-stream-")]
