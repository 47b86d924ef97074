"""The load generator's stall watch names each event-loop stall's cause and where the loop was."""

from __future__ import annotations

import asyncio
import time

from mlxproxy.load.run.stalls import StallWatch


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _nap(seconds: float) -> None:
    time.sleep(seconds)


def _watched(block: object) -> list:
    async def main() -> list:
        watch = StallWatch(0.05)
        task = asyncio.ensure_future(watch.run())
        await asyncio.sleep(0.05)
        block(0.3)  # type: ignore[operator]
        await asyncio.sleep(0.05)
        task.cancel()
        return watch.stalls

    return asyncio.run(main())


def test_a_long_callback_is_the_generators_own_code_and_named() -> None:
    stalls = _watched(_spin)
    assert len(stalls) == 1 and stalls[0].late_s >= 0.2
    s = stalls[0]
    # on a host too busy to give the process the CPU it spun for, the watch says so instead
    assert s.cause in ("callbacks", "no-cpu"), s.text()
    if s.cause == "callbacks":
        assert "_spin" in s.where and "_spin" in s.text()


def test_a_blocking_call_in_the_loop_is_told_from_a_busy_host() -> None:
    (s,) = _watched(_nap)
    assert s.cause in ("blocked", "no-cpu") and s.cpu_s < s.late_s / 3, s.text()
    assert "_nap" in s.where


def test_a_stall_under_the_cli_runner_is_the_event_loops_own_code() -> None:
    """Under `mlxproxy.edge.runner.run_async` (uvloop: its loop is C, with no Python frame), the
    loop thread's innermost Python frame while the loop polls or reads sockets is run_async: that
    is the event loop's own code, not a callback of the generator's."""
    from mlxproxy.load.run.stalls import Stall

    loop = Stall(
        0.0, 0.066, 0.034, 3, 0.0, (), 0.0, "runner.py:run_async < generator.py:_run < generator.py:stall_hunt"
    )
    assert loop.in_loop and "in the event loop's own code" in loop.text() and "run_async" not in loop.text()
    code = Stall(0.0, 0.066, 0.034, 3, 0.0, (), 0.0, "client.py:send < shapes.py:one < runner.py:run_async")
    assert not code.in_loop and "in client.py:send" in code.text()
