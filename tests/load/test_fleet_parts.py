"""The bookkeeping every fleet shares (`mlxproxy.load.fleet.parts.gather_parts`), on parts whose
answers the test gives: the parts' progress summed into the client's while they run, their results
merged and counted once, the first failure raised, and on a cancel each part stopped, what had
finished kept, a failed part and one that does not stop each said in one line. The transports'
own runs (threads, processes, a Dask cluster) are in test_stream_threads.py and test_workers.py."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from mlxproxy.edge.runner import run_async
from mlxproxy.load.fleet import parts as parts_mod
from mlxproxy.load.fleet.cluster import _Task
from mlxproxy.load.fleet.parts import gather_parts
from mlxproxy.load.fleet.segment import SegmentResult, WorkersError
from mlxproxy.load.run.client import MeasuringClient
from support import ok_record


def result(index: int, n: int) -> SegmentResult:
    records = tuple(ok_record(id=f"w{index}-{i}", t_start_mono=10.0 + i) for i in range(n))
    return SegmentResult(index, "h", 100 + index, records, 10.0, (), {}, {}, {}, (), 0.1, 1.0)


class FakePart:
    """A part whose answer the test sets."""

    def __init__(self, figures: tuple[int, int, int] = (0, 0, 0)) -> None:
        self.answer: asyncio.Future[SegmentResult] = asyncio.get_running_loop().create_future()
        self._figures = figures
        self.ended = False

    def figures(self) -> tuple[int, int, int]:
        return self._figures

    def lost(self) -> str:
        self.ended = True
        return "part did not stop: ended"


def test_progress_is_summed_while_running_and_the_results_counted_once_each() -> None:
    async def go() -> tuple[tuple[int, int, int], int, list[str], int, int]:
        async with MeasuringClient("http://127.0.0.1:9") as client:
            a, b = FakePart((2, 1, 30)), FakePart((3, 2, 40))
            ticks = 0

            def tick() -> None:
                nonlocal ticks
                ticks += 1

            run = asyncio.ensure_future(gather_parts([a, b], _nothing, client, 0.0, tick))
            await asyncio.sleep(0)  # the gather is waiting for the answers
            during = (client.finished_count, client.in_flight, client.tokens_received())
            a.answer.set_result(result(0, 2))
            b.answer.set_result(result(1, 3))
            fleet = await run
            return during, len(fleet.records), [r.id for r in client.finished], ticks, client.finished_count

    during, merged, finished, ticks, count_after = run_async(go())
    assert during == (5, 3, 70)
    assert merged == 5 and ticks == 5 and count_after == 5  # the parts' progress no longer counted after
    assert sorted(finished) == ["w0-0", "w0-1", "w1-0", "w1-1", "w1-2"]


def test_the_first_failed_part_is_the_runs_error_at_once() -> None:
    async def go() -> tuple[list[Any], bool]:
        async with MeasuringClient("http://127.0.0.1:9") as client:
            a, b = FakePart(), FakePart()  # `a` never answers: the error does not wait for it
            run = asyncio.ensure_future(gather_parts([a, b], _nothing, client, 0.0, None))
            b.answer.set_exception(WorkersError("load worker 1 failed: boom"))
            with pytest.raises(WorkersError, match="^load worker 1 failed: boom$"):
                await asyncio.wait_for(run, 5)
            return list(client.finished), client.elsewhere is None

    assert run_async(go()) == ([], True)


def test_a_cancel_stops_the_parts_and_keeps_what_they_had_finished(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(parts_mod, "STOP_WAIT_S", 0.2)

    async def go() -> tuple[list[str], list[bool], int]:
        async with MeasuringClient("http://127.0.0.1:9") as client:
            done, stopped, failed, deaf = FakePart(), FakePart(), FakePart(), FakePart()
            stops = 0

            async def stop() -> None:  # what a transport does: the stopped parts answer with what they had
                nonlocal stops
                stops += 1
                stopped.answer.set_result(result(1, 2))
                failed.answer.set_exception(WorkersError("load worker 2 failed: boom"))

            parts = [done, stopped, failed, deaf]
            run = asyncio.ensure_future(gather_parts(parts, stop, client, 0.0, None))
            done.answer.set_result(result(0, 1))
            await asyncio.sleep(0.05)  # the whole answer is in; the others still run
            run.cancel()
            with pytest.raises(asyncio.CancelledError):
                await run
            return sorted(r.id for r in client.finished), [p.ended for p in parts], stops

    finished, ended, stops = run_async(go())
    assert finished == ["w0-0", "w1-0", "w1-1"] and stops == 1
    assert ended == [False, False, False, True]  # only the part that did not answer was ended
    err = capsys.readouterr().err
    assert "mlxproxy: part did not stop: ended\n" in err and "mlxproxy: load worker 2 failed: boom\n" in err
    assert "Ctrl-C: 3 finished requests kept from 2 load workers" in err


def test_a_dask_tasks_failure_is_one_line_naming_the_worker() -> None:
    class Scheduler:
        async def gather(self, future: Any) -> Any:
            raise ValueError("the task broke")

    async def go() -> None:
        task = _Task(Scheduler(), object(), 1, "tcp://10.0.0.6:40000")
        with pytest.raises(WorkersError, match=r"^load worker 1 \(tcp://10.0.0.6:40000\) failed: the task broke$"):
            await task.answer

    run_async(go())


async def _nothing() -> None:
    return None
