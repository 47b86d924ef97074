"""Several load-generator processes (`--workers N`) and a Dask cluster (`--cluster`): the
segments together are exactly the schedule asked for, every figure is computed over the union
of the workers' raw records, a conversation stays on one worker, and a cluster of two worker
processes on loopback gives the figures two local workers give."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import orjson
import pytest

from mlxproxy.core.record import Record
from mlxproxy.core.stats import percentile
from mlxproxy.edge.runner import ServerThread, run_async
from mlxproxy.load.commands.replay import run_sessions
from mlxproxy.load.commands.replay_requests import ReplaySource
from mlxproxy.load.data.arrivals import arrival_offsets
from mlxproxy.load.fleet.local import _run_stoppable, run_local
from mlxproxy.load.fleet.merge import FleetTimed, merge
from mlxproxy.load.fleet.segment import ClientSpec, Segment, SegmentResult, WorkersError
from mlxproxy.load.fleet.workers import Workers
from mlxproxy.load.run.client import MeasuringClient, PreparedRequest, Timed
from mlxproxy.load.run.plan import plan_closed, plan_due, plan_sessions
from mlxproxy.load.run.runner import send
from mlxproxy.load.run.shapes import ClosedLoop, Load, OpenLoop, Shape, Tick, Turn
from mlxproxy.sim.app import create_app as create_sim
from support import Answered, cancel_after_some, captured_chat, cli

RATE, N, SEED = 60.0, 90, 11


def chat(i: int) -> PreparedRequest:
    body = {"model": "m", "stream": True, "max_tokens": 6, "messages": [{"role": "user", "content": f"hello {i}"}]}
    return PreparedRequest("POST", "/v1/chat/completions", orjson.dumps(body), (("content-type", "application/json"),))


async def _open_loop(url: str, workers: Workers) -> Timed:
    async with MeasuringClient(url) as client:
        return await run_shape(workers, OpenLoop(RATE, "poisson", SEED), client, [chat(i) for i in range(N)])


async def run_shape(workers: Workers, shape: Shape, client: MeasuringClient, reqs: Sequence[PreparedRequest]) -> Timed:
    return await send(shape, Load(reqs), client, fleet=workers)


def due_times(timed: Timed) -> list[float]:
    """Each request's due time (send time less its schedule lag), from the first one."""
    due = sorted(r.t_start_mono - timed.lag_by_id[r.id] for r in timed.records)
    return [d - due[0] for d in due]


def test_plans_split_the_schedule_into_disjoint_segments_whose_union_is_the_whole() -> None:
    reqs = [PreparedRequest("POST", "/p", b"", offset_s=o) for o in arrival_offsets(50, 10.0, "poisson", 3)]
    parts = plan_due(reqs, 3)
    assert sorted(r.offset_s for p in parts for r in p) == sorted(r.offset_s for r in reqs)
    assert [len(p) for p in parts] == [17, 17, 16]
    closed = plan_closed(reqs, 5, 2)
    assert [s for s, _ in closed] == [3, 2]  # streams 0, 2, 4 and 1, 3
    assert sum(len(rs) for _, rs in closed) == 50 and [len(rs) for _, rs in closed] == [30, 20]
    assert len(plan_closed(reqs, 2, 4)) == 2  # never a worker without a stream
    runs = [[Turn(r)] for r in reqs[:7]]
    sess = plan_sessions(runs, 3, 2)
    assert [(s, ids) for s, _, ids in sess] == [(2, [0, 2, 3, 5, 6]), (1, [1, 4])]


def test_merge_rebases_each_workers_clock_and_keeps_every_raw_sample() -> None:
    def rec(rid: str, t: float, ttft: float) -> Record:
        return Record(
            id=rid, started_at=0.0, upstream="u", model="m", endpoint="chat_completions", stream=True, status=200,
            outcome="ok", method="POST", path="/p", t_start_mono=t, ttft_s=ttft,
        )  # fmt: skip

    # worker 0's clock read 100.0 at the shared start, worker 1's 5000.0; this process's 10.0
    a = SegmentResult(0, "h0", 1, (rec("a", 100.5, 0.1), rec("b", 101.0, 0.3)), 100.0, (0.001, 0.002),
                      {"a": 0.001, "b": 0.002}, {}, {}, (), 0.2, 1.0)  # fmt: skip
    b = SegmentResult(1, "h1", 2, (rec("c", 5000.25, 0.2),), 5000.0, (0.03,), {"c": 0.03}, {}, {}, (), 0.9, 1.0)
    fleet = merge([b, a], 10.0)
    assert [(r.id, round(r.t_start_mono, 6)) for r in fleet.records] == [("c", 10.25), ("a", 10.5), ("b", 11.0)]
    assert sorted(fleet.lag_s) == [0.001, 0.002, 0.03]
    assert fleet.worker_of == {"a": 0, "b": 0, "c": 1}
    slow = fleet.workers[1]
    assert slow.lag_p99_s == 0.03 and slow.cpu_share == 0.9
    assert slow.problems() == ["CPU 90% of a core", "schedule lag p99 30.0 ms over 25 ms"]
    assert fleet.workers[0].problems() == []


def test_one_and_three_workers_send_the_same_seeded_poisson_schedule() -> None:
    offsets = arrival_offsets(N, RATE, "poisson", SEED)
    with ServerThread(create_sim("healthy", speed=20.0)) as sim:
        one = run_async(_open_loop(sim.url, Workers(1)))
        three = run_async(_open_loop(sim.url, Workers(3)))
    assert isinstance(three, FleetTimed) and not isinstance(one, FleetTimed)
    assert [w.requests for w in three.workers] == [30, 30, 30]
    for timed in (one, three):
        assert len(timed.records) == N and all(r.outcome == "ok" for r in timed.records)
        # every request went out at its due time of the one schedule (the lag apart)
        due = due_times(timed)
        worst = max(abs(d - o) for d, o in zip(due, offsets))
        assert worst < 0.02, worst
        assert len(timed.lag_s) == N
    # the send times of the two runs are the same set, within the lag of each
    s1 = sorted(r.t_start_mono for r in one.records)
    s3 = sorted(r.t_start_mono for r in three.records)
    lag = max(one.lag_s) + max(three.lag_s)
    assert max(abs((a - s1[0]) - (b - s3[0])) for a, b in zip(s1, s3)) <= lag + 0.02


def test_bench_with_three_workers_reports_percentiles_of_the_union_of_raw_records(tmp_path: Path) -> None:
    out = tmp_path / "b.json"
    with ServerThread(create_sim("healthy", speed=20.0)) as sim:
        res = cli(
            "bench", "--target", f"sim={sim.url}", "--prompt-tokens", "50", "--repeat", "1", "--max-tokens", "6",
            "--rate", "60", "--arrival", "poisson", "--seed", "5", "--requests", "90", "--workers", "3",
            "--json", str(out),
        )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "3 load workers (0: 30 req" in res.stderr
    group = next(g for g in json.loads(out.read_text())["groups"] if g["kind"] == "rate")
    rows, summ = group["records"], group["summary"]
    assert len(rows) == 90 and summ["requests"] == 90
    per = summ["workers"]["per_worker"]
    assert [w["requests"] for w in per] == [30, 30, 30] and len({w["pid"] for w in per}) == 3
    for key in ("ttft_s", "e2e_s"):
        vals = sorted(r[key] for r in rows if r[key] is not None)
        for q in (50, 90, 99):
            assert summ[key][f"p{q}"] == pytest.approx(percentile(vals, q), abs=1e-9), (key, q)
    lags = sorted(r["schedule_lag_s"] for r in rows)
    assert summ["schedule_lag_s"]["p99"] == pytest.approx(percentile(lags, 99), abs=1e-9)


def test_a_conversation_stays_on_one_worker() -> None:
    def messages(c: int, t: int) -> list[dict]:  # turn t of conversation c: the list grows
        msgs = [{"role": "user", "content": f"task {c}"}]
        for k in range(t):
            msgs += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": f"more {k}"}]
        return msgs

    convs = [
        [captured_chat(f"c{c}t{t}", messages(c, t), offset_s=c * 0.01 + t, duration_s=0.01) for t in range(3)]
        for c in range(6)
    ]
    caps = [c for conv in convs for c in conv]

    async def go(url: str) -> tuple[Timed, dict]:
        async with MeasuringClient(url) as client:
            timed, where, _ = await run_sessions(client, ReplaySource(caps), 4, 6, think_time=0.01, fleet=Workers(2))
            return timed, where

    with ServerThread(create_sim("healthy", speed=20.0)) as sim:
        timed, where = run_async(go(sim.url))
    assert isinstance(timed, FleetTimed) and len(timed.records) == 18
    by_session: dict[int, list[Record]] = {}
    for r in timed.records:
        by_session.setdefault(where[r.id].session, []).append(r)
    assert sorted(by_session) == list(range(6))
    for recs in by_session.values():
        assert len({timed.worker_of[r.id] for r in recs}) == 1
        # its turns went out in order, each after the one before it ended
        ordered = sorted(recs, key=lambda r: r.t_start_mono)
        assert [where[r.id].turn for r in ordered] == [0, 1, 2]
        assert all(b.t_start_mono >= a.t_end_mono for a, b in zip(ordered, ordered[1:]))
    assert {timed.worker_of[r.id] for r in timed.records} == {0, 1}


def test_closed_loop_streams_are_split_across_workers() -> None:
    async def go(url: str) -> Timed:
        async with MeasuringClient(url) as client:
            return await run_shape(Workers(2), ClosedLoop(3), client, [chat(i) for i in range(30)])

    with ServerThread(create_sim("healthy", speed=20.0)) as sim:
        timed = run_async(go(sim.url))
    assert isinstance(timed, FleetTimed)
    assert [w.requests for w in timed.workers] == [20, 10]  # streams 0, 2 and stream 1
    assert max(r.concurrency for r in timed.records) <= 2  # each worker's own streams in flight


# -- a Dask cluster on loopback ------------------------------------------------------------------


def _dask(*args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL
    )


@contextmanager
def _dask_cluster(tmp_path: Path) -> Iterator[str]:
    """A Dask scheduler and two worker processes (one thread each) on loopback: its address."""
    try:
        from distributed import Client
    except ImportError:
        print("skipped: the [cluster] extra (distributed) is not installed")
        pytest.skip("the [cluster] extra (distributed) is not installed: pip install -e '.[cluster]'")
    sched_file = tmp_path / "scheduler.json"
    sched = _dask("distributed.cli.dask_scheduler", "--host", "127.0.0.1", "--port", "0", "--no-dashboard",
                  "--scheduler-file", str(sched_file))  # fmt: skip
    procs = [sched]
    try:
        deadline = time.monotonic() + 60
        while not sched_file.exists() and time.monotonic() < deadline and sched.poll() is None:
            time.sleep(0.05)  # readiness poll, not a measurement
        assert sched_file.exists(), "the Dask scheduler did not start"
        address = json.loads(sched_file.read_text())["address"]
        for _ in range(2):  # two "hosts": a worker process each, one thread each
            procs.append(_dask("distributed.cli.dask_worker", address, "--nthreads", "1", "--no-dashboard",
                               "--host", "127.0.0.1"))  # fmt: skip
        with Client(address, timeout=30) as c:
            c.wait_for_workers(2, timeout=60)
        yield address
    finally:
        for p in procs[::-1]:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


def test_a_dask_cluster_of_two_worker_processes_gives_the_figures_of_two_local_workers(tmp_path: Path) -> None:
    with _dask_cluster(tmp_path) as address, ServerThread(create_sim("healthy", speed=20.0)) as sim:
        local = run_async(_open_loop(sim.url, Workers(2)))
        cluster = run_async(_open_loop(sim.url, Workers(cluster=address)))
    assert isinstance(cluster, FleetTimed) and cluster.cluster == address
    assert [w.requests for w in cluster.workers] == [w.requests for w in local.workers] == [45, 45]
    assert len({w.pid for w in cluster.workers}) == 2 and os.getpid() not in {w.pid for w in cluster.workers}
    offsets = arrival_offsets(N, RATE, "poisson", SEED)
    for timed in (local, cluster):
        assert len(timed.records) == N and all(r.outcome == "ok" for r in timed.records)
        assert max(abs(d - o) for d, o in zip(due_times(timed), offsets)) < 0.02

    def p50(timed: Timed, key: str) -> float:
        v = percentile(sorted(x for r in timed.records if (x := getattr(r, key)) is not None), 50)
        assert v is not None
        return v

    # the simulator's timing is scripted: the same schedule gives the same figures, within noise
    for key in ("e2e_s", "decode_tps"):
        assert p50(cluster, key) == pytest.approx(p50(local, key), rel=0.35), key


def test_workers_and_cluster_options_say_what_is_wrong_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    import mlxproxy.load.fleet.workers as workers_mod

    for bad in ("0", "two"):
        res = cli("replay", "builtin:agent", "--target", "http://127.0.0.1:9", "--workers", bad)
        assert res.returncode == 2 and "'--workers'" in res.stderr and "or auto" in res.stderr
    monkeypatch.setattr(workers_mod, "cluster_available", lambda: False)
    with pytest.raises(workers_mod.WorkersError, match=r"pip install 'mlxproxy\[cluster\]'"):
        workers_mod.workers_for(1, "tcp://10.0.0.5:8786")
    assert workers_mod.workers_for(3, None) == Workers(3)


def test_replay_sessions_with_two_workers_from_the_command_line(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    with ServerThread(create_sim("healthy", speed=50.0)) as sim:
        res = cli(
            "replay", "builtin:agent", "--target", sim.url, "--sessions", "3", "--repeat", "2", "--think-time", "0",
            "--workers", "2", "--json", str(out),
        )  # fmt: skip
        seq = cli("replay", "builtin:agent", "--target", sim.url, "--mode", "sequential", "--workers", "2")
    assert res.returncode == 0, res.stderr
    group = json.loads(out.read_text())["groups"][0]
    assert group["kind"] == "sessions" and len(group["records"]) == 18  # 3 conversation runs x 6 turns
    assert [w["requests"] for w in group["summary"]["workers"]["per_worker"]] == [12, 6]  # runs 0, 2 and 1
    assert sorted({r["session"] for r in group["records"]}) == [0, 1, 2]
    assert seq.returncode == 0 and "do not apply to sequential: it sends from one process" in seq.stderr


def test_the_bottleneck_line_says_whether_a_worker_ran_out_of_cpu_or_waited_for_it() -> None:
    from mlxproxy.load.fleet.merge import WorkerFigures, workers_line

    busy = WorkerFigures(0, "a", 1, 100, 0.002, 0.95, 1.0)
    late = WorkerFigures(1, "b", 2, 100, 0.08, 0.3, 1.0)
    fine = WorkerFigures(2, "c", 3, 100, 0.002, 0.3, 1.0)
    assert workers_line([fine]) == "1 load worker (2: 100 req, lag p99 2.0 ms, CPU 30%)"
    assert workers_line([busy, fine]).endswith("worker 0 (a): CPU 95% of a core: add workers or hosts")
    assert "worker 1 (b): schedule lag p99 80.0 ms over 25 ms: it was late without using its core" in workers_line(
        [late, fine], "tcp://x:8786"
    )


# -- Ctrl-C: the workers stop and send back what they measured -----------------------------------


def test_a_stopped_worker_sends_back_the_records_it_finished_and_reports_its_count() -> None:
    """The worker's side, in this process: progress reports arrive on the pipe while it runs
    (every REPORT_EVERY_S, never one per request); a `stop` cancels the run and the answer is
    the records finished so far, each once, no request in flight among them."""
    reqs = tuple(chat(i) for i in range(200))  # ~0.3 s each on 2 streams: ~30 s if never stopped
    reports: list[tuple[int, int, int]] = []
    with ServerThread(create_sim("healthy", speed=1.0, decode_tps=20.0)) as sim:
        seg = Segment(0, ClientSpec.of(MeasuringClient(sim.url)), ClosedLoop(2), Load(reqs), start_at=time.time())
        mine, theirs = multiprocessing.Pipe()

        def parent() -> None:  # what `_run_local` does: read the reports, stop after a few records
            while True:
                what, figures = mine.recv()
                assert what == "count"
                reports.append(figures)
                if figures[0] >= 4:
                    mine.send("stop")
                    return

        t = threading.Thread(target=parent)
        t.start()
        what, res = run_async(_run_stoppable(seg, theirs))
        t.join(10)
    assert what == "stopped" and isinstance(res, SegmentResult)
    assert reports[-1][0] >= 4 and len(reports) < 60  # periodic, not one per request
    assert reports[-1][0] <= len(res.records) < len(reqs)
    assert len({r.id for r in res.records}) == len(res.records)
    assert all(r.outcome == "ok" for r in res.records)  # whole answers: none was cut by the stop
    fleet = merge([res], time.perf_counter())  # the partial result merges as a whole one does
    assert sorted(r.id for r in fleet.records) == sorted(r.id for r in res.records)
    assert [w.requests for w in fleet.workers] == [len(res.records)]


def test_ctrl_c_during_a_run_of_two_workers_keeps_every_record_they_finished() -> None:
    """The parent's side, with two worker processes: the progress line's count moves while they
    run (their reports), a cancel stops them, and every record either had finished is counted
    as the client's, each once, before the cancel goes on; nothing is left in flight."""
    reqs = [chat(i) for i in range(200)]

    async def go(url: str) -> tuple[int, list[Record], int]:
        async with MeasuringClient(url) as client:
            return await cancel_after_some(client, run_shape(Workers(2), ClosedLoop(2), client, reqs))

    with ServerThread(create_sim("healthy", speed=1.0, decode_tps=20.0)) as sim:
        seen, finished, in_flight = run_async(go(sim.url))
    assert 4 <= seen <= len(finished) < len(reqs) and in_flight == 0
    assert len({r.id for r in finished}) == len(finished)
    assert all(r.outcome == "ok" for r in finished)


def test_ctrl_c_during_a_cluster_run_keeps_every_record_its_tasks_finished(tmp_path: Path) -> None:
    """A cancelled cluster run sets its Dask Event; each task stops and returns the records it
    had finished, counted as the client's, each once, before the cancel goes on."""
    reqs = [chat(i) for i in range(200)]  # ~0.3 s each on one stream a worker: ~30 s if never stopped
    app = Answered(create_sim("healthy", speed=1.0, decode_tps=20.0))

    async def go(url: str, address: str) -> tuple[int, list[Record]]:
        async with MeasuringClient(url) as client:
            run = asyncio.ensure_future(run_shape(Workers(cluster=address), ClosedLoop(2), client, reqs))
            while app.done < 6 and not run.done():
                await asyncio.sleep(0.05)  # waiting for the server's answers, not measuring
            seen = app.done
            run.cancel()
            with pytest.raises(asyncio.CancelledError):
                await run
            return seen, list(client.finished)

    with _dask_cluster(tmp_path) as address, ServerThread(app) as sim:
        seen, finished = run_async(go(sim.url, address))
    # one stream a worker, one request at a time: of the answers sent before the cancel, only
    # each stream's last may not have been recorded yet
    assert seen - 2 <= len(finished) < len(reqs)
    assert len({r.id for r in finished}) == len(finished) and all(r.outcome == "ok" for r in finished)


@dataclass(frozen=True, slots=True)
class Breaks(Shape):
    """A shape whose sending fails (in the worker process that unpickles it)."""

    async def send(self, client: MeasuringClient, load: Load, tick: Tick = None, start: float | None = None) -> Timed:
        raise RuntimeError("the shape broke")


def test_a_failed_load_worker_is_one_line_and_ends_the_others() -> None:
    """A worker's failure is the run's (`WorkersError`, one line naming the worker) as soon as it
    arrives: the other worker is ended, not left to send its ~60 s of requests."""
    app = Answered(create_sim("healthy", speed=1.0, decode_tps=20.0))
    reqs = tuple(chat(i) for i in range(200))  # ~0.3 s each on one stream

    async def go(url: str) -> list[Record]:
        async with MeasuringClient(url) as client:
            spec = ClientSpec.of(client)
            segments = [Segment(0, spec, ClosedLoop(1), Load(reqs)), Segment(1, spec, Breaks(), Load(()))]
            with pytest.raises(WorkersError, match=r"^load worker 1 failed: RuntimeError: the shape broke$"):
                await run_local(segments, client, None)
            return list(client.finished)

    with ServerThread(app) as sim:
        finished = run_async(go(sim.url))
    assert finished == [] and app.done < 20
    assert not multiprocessing.active_children()
