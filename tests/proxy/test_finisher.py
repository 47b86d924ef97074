"""The Finisher: finishing work runs after forwarding, one step per event-loop turn, in order."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator

import pytest

from mlxproxy.proxy.finisher import Finisher


def _stepped(log: list[str], name: str, steps: int) -> Iterator[None]:
    for k in range(steps):
        log.append(f"{name}{k}")
        if k < steps - 1:
            yield


async def _turns(log: list[str], n: int) -> None:
    """Mark `n` event-loop turns in `log`: a callback that runs once per turn (it schedules
    itself again, as the finisher does)."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def mark(k: int) -> None:
        log.append(f"turn{k}")
        if k + 1 < n:
            loop.call_soon(mark, k + 1)
        else:
            done.set_result(None)

    loop.call_soon(mark, 0)
    await done


def _two_queued(log: list[str]) -> Finisher[str]:
    """A started finisher (inside a running loop) with "a" (3 steps) and "b" (2 steps) queued."""
    fin: Finisher[str] = Finisher()
    fin.start()
    fin.submit(lambda name, t: _stepped(log, name, 3), "a", 0.0)
    fin.submit(lambda name, t: _stepped(log, name, 2), "b", 0.0)
    return fin


def test_steps_interleave_with_the_loop_and_items_finish_in_order() -> None:
    async def main() -> list[str]:
        log: list[str] = []
        fin = _two_queued(log)
        fin.submit(lambda name, t: log.append(name), "c", 0.0)  # work done at once (no steps)
        assert fin.pending == 3
        await _turns(log, 8)
        assert fin.pending == 0
        return log

    log = asyncio.run(main())
    work = [x for x in log if not x.startswith("turn")]
    assert work == ["a0", "a1", "a2", "b0", "b1", "c"]  # each item to its end before the next
    # no two steps in one loop turn: a turn of the loop's own came between every two
    for first, second in zip(work, work[1:]):
        assert any(x.startswith("turn") for x in log[log.index(first) + 1 : log.index(second)]), (first, second, log)


def test_stop_finishes_the_paused_item_and_the_queue_and_later_work_runs_at_once() -> None:
    async def main() -> list[str]:
        log: list[str] = []
        fin = _two_queued(log)
        await _turns(log, 1)  # "a" has begun, and is paused
        fin.stop()
        assert fin.pending == 0
        fin.submit(lambda name, t: _stepped(log, name, 2), "c", 0.0)
        return [x for x in log if not x.startswith("turn")]

    assert asyncio.run(main()) == ["a0", "a1", "a2", "b0", "b1", "c0", "c1"]


def test_a_step_that_fails_is_logged_and_the_next_item_still_runs(caplog: pytest.LogCaptureFixture) -> None:
    def failing(name: str, t: float) -> Iterator[None]:
        yield
        raise RuntimeError("a bug in a check")

    async def main() -> list[str]:
        log: list[str] = []
        fin: Finisher[str] = Finisher()
        fin.start()
        fin.submit(failing, "a", 0.0)
        fin.submit(lambda name, t: _stepped(log, name, 2), "b", 0.0)
        await _turns(log, 5)
        return [x for x in log if not x.startswith("turn")]

    with caplog.at_level(logging.ERROR, logger="mlxproxy"):
        assert asyncio.run(main()) == ["b0", "b1"]
    assert [r.getMessage() for r in caplog.records] == ["finishing a record failed"]
