"""A conversation's think time runs from its previous response's end, as its record clocks it, not
from when the client had finished checking that record (issue 37: on a busy host that CPU,
serialized over a sessions step's threads, spread the sends of turns that ended together, and
mlx_lm.server left the late ones a whole batch behind). No sockets and no timing: a scripted
client whose records ended `CHECK_S` before it returned them, and the waits the shape asks for."""

from __future__ import annotations

import asyncio
import time

import pytest

from mlxproxy.core.record import Record
from mlxproxy.load.run import shapes
from mlxproxy.load.run.client import PreparedRequest
from mlxproxy.load.run.shapes import Load, Sessions, Turn
from support import ok_record

THINK_S = 0.2
CHECK_S = 0.05  # the client's work on a record after its response ended


class Scripted:
    """Answers each request at once with a record whose response ended `CHECK_S` ago."""

    def __init__(self) -> None:
        self.finished: list[Record] = []

    async def send(self, req: PreparedRequest, *, fresh_connection: bool = False) -> Record:
        end = time.perf_counter() - CHECK_S
        r = ok_record(id=f"r{len(self.finished)}", ttft_s=0.01, duration_s=0.1, t_start_mono=end - 0.1)
        self.finished.append(r)
        return r


def test_the_think_time_runs_from_the_responses_end(monkeypatch: pytest.MonkeyPatch) -> None:
    waits: list[float] = []

    async def sleep(s: float) -> None:
        waits.append(s)

    monkeypatch.setattr(shapes.asyncio, "sleep", sleep)
    req = PreparedRequest("POST", "/v1/chat/completions", b"{}")
    runs = [[Turn(req), Turn(req, THINK_S), Turn(req, THINK_S)] for _ in range(2)]
    timed = asyncio.run(Sessions(2).send(Scripted(), Load(runs=runs)))  # type: ignore[arg-type]
    assert len(timed.records) == 6 and len(waits) == 4, waits
    # each wait is the think time less the time since the response ended (CHECK_S, and the
    # scripted client's few microseconds)
    assert all(THINK_S - CHECK_S - 0.02 < w <= THINK_S - CHECK_S for w in waits), waits
