"""The load generator's own event-loop stalls, and what caused each.

A stall is a tick of a 10 ms timer that fired late by more than a threshold. While a stall lasts,
every response the generator is reading waits too: its TTFT and E2E grow by the stall, not by
anything the server did. Each stall is put down to one cause:

- `gc`: the cyclic garbage collector ran for most of it, in CPU time (`gc.callbacks` time each
  collection; a collection the OS switched out midway is the host's, not the collector's);
- `no-cpu`: the process got little CPU during it (`time.process_time` advanced by under a third
  of the stall) and the operating system switched it out meanwhile (involuntary context
  switches): it ran other work, the host is busy; nothing in the generator can fix that, only a
  quieter host or a core of its own;
- `blocked`: little CPU and no such switch: the loop's thread waited in a blocking call;
- `callbacks`: the process was busy in its own code for most of it (a long callback: parsing,
  finishing records, logging...). `where` names the code: a watcher thread samples the loop
  thread's stack while the loop is late, and keeps the innermost frames seen most often.

Used by the sweep (`mlxproxy.load.run.sweep`: a step that stalled is measured again) and by
`benchmarks/generator.py --stalls`.
"""

from __future__ import annotations

import asyncio
import gc
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

__all__ = ["Stall", "StallWatch", "TICK_S"]

#: the watch's timer period
TICK_S = 0.01


@dataclass(frozen=True, slots=True)
class Stall:
    """One stall: when it ended (`perf_counter`), how late the tick was, what ran meanwhile."""

    at: float
    late_s: float
    cpu_s: float  # this process's CPU time over the tick
    preempted: int  # the process's involuntary context switches over the tick (the OS ran other work)
    gc_s: float  # time in the cyclic collector over the tick
    gc_generations: tuple[int, ...]
    gc_cpu_s: float = 0.0  # the process's CPU time in the cyclic collector over the tick
    where: str = ""  # the loop thread's code seen most often while it was late (file:function, innermost first)

    @property
    def cause(self) -> str:
        if self.gc_cpu_s >= 0.5 * self.late_s:  # the collector's CPU, not its wall time (it may be switched out)
            return "gc"
        if self.cpu_s < self.late_s / 3:
            # switched out, or asleep in the loop's own poll and woken late: the host was busy
            return "no-cpu" if self.preempted or self.in_loop else "blocked"
        return "callbacks"

    @property
    def in_loop(self) -> bool:
        """The loop's thread was in the event loop's own code, no Python callback on its stack
        (uvloop's C: polling, the transports' reads and writes, timers)."""
        return not self.where or self.where.split(" < ")[0] in _LOOP_FRAMES

    def text(self) -> str:
        gens = ",".join(str(g) for g in self.gc_generations)
        extra = {
            "gc": f"the garbage collector ran {self.gc_s * 1000:.0f} ms ({self.gc_cpu_s * 1000:.0f} ms of CPU,"
            f" generation {gens})",
            "no-cpu": f"the process got {self.cpu_s * 1000:.0f} ms of CPU: the host ran other work",
            "blocked": "the loop's thread waited in a blocking call",
            "callbacks": f"the generator's own code ran {self.cpu_s * 1000:.0f} ms"
            + (f" (gc {self.gc_s * 1000:.0f} ms)" if self.gc_s else ""),
        }[self.cause]
        if self.cause != "no-cpu" and self.in_loop:
            extra += ", in the event loop's own code (polling, socket reads and writes, timers)"
        elif self.where and self.cause != "no-cpu":
            extra += f", in {self.where}"
        return f"{self.late_s * 1000:.0f} ms stall: {self.cause}: {extra}"


#: innermost frames that are the event loop itself, not a callback it runs: asyncio's, and
#: `mlxproxy.edge.runner.run_async`, under which uvloop's loop runs in C with no Python frame of
#: its own (a 10-minute hunt put 23 stalls "in runner.py:run_async" on the generator's code)
_LOOP_FRAMES = frozenset(
    {"runners.py:run", "base_events.py:run_forever", "base_events.py:_run_once", "runner.py:run_async"}
)


def _preempted() -> int:
    """This process's involuntary context switches so far (0 where the platform has no count)."""
    try:
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_nivcsw)
    except (ImportError, OSError):
        return 0


class StallWatch:
    """Watches this process's event loop while `run()` is awaited (cancel it to stop): every tick
    later than `threshold_s` is kept in `stalls`, with its cause."""

    def __init__(self, threshold_s: float) -> None:
        self.threshold_s = threshold_s
        self._ticked = time.perf_counter()
        self._seen: dict[str, int] = {}
        self.stalls: list[Stall] = []
        self.lags: list[float] = []  # every tick's lateness (seconds)
        self._gc: list[tuple[float, float, int, float]] = []  # (start, end, generation, CPU seconds)
        self._gc_start = self._gc_cpu = 0.0

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        t, c = time.perf_counter(), time.process_time()
        if phase == "start":
            self._gc_start, self._gc_cpu = t, c
        else:
            self._gc.append((self._gc_start, t, int(info.get("generation", -1)), c - self._gc_cpu))
            if len(self._gc) > 4096:
                del self._gc[:2048]

    def _sample(self, loop_thread: int, stop: threading.Event) -> None:
        """While the loop is late by over half the threshold, sample its thread's stack every
        5 ms (the innermost frames, most often seen wins)."""
        while not stop.wait(0.005):
            if time.perf_counter() - self._ticked < max(TICK_S + self.threshold_s / 2, 0.02):
                continue
            frame = sys._current_frames().get(loop_thread)
            names: list[str] = []
            while frame is not None and len(names) < 3:
                code = frame.f_code
                names.append(f"{os.path.basename(code.co_filename)}:{code.co_name}")
                frame = frame.f_back
            if names:
                key = " < ".join(names)
                self._seen[key] = self._seen.get(key, 0) + 1

    async def run(self) -> None:
        gc.callbacks.append(self._on_gc)
        stop = threading.Event()
        self._ticked = time.perf_counter()
        sampler = threading.Thread(target=self._sample, args=(threading.get_ident(), stop), daemon=True)
        sampler.start()
        try:
            while True:
                t0, c0, v0 = time.perf_counter(), time.process_time(), _preempted()
                self._ticked, self._seen = t0, {}
                await asyncio.sleep(TICK_S)
                t1, c1 = time.perf_counter(), time.process_time()
                late = max(0.0, t1 - t0 - TICK_S)
                self.lags.append(late)
                if late > self.threshold_s:
                    spans = [(max(a, t0), min(b, t1), g, cpu) for a, b, g, cpu in self._gc if b > t0 and a < t1]
                    where = max(self._seen, key=lambda k: self._seen[k]) if self._seen else ""
                    gens = tuple(sorted({g for _, _, g, _ in spans}))
                    gc_s = sum(b - a for a, b, _, _ in spans)
                    gc_cpu = sum(cpu for *_, cpu in spans)
                    self.stalls.append(Stall(t1, late, c1 - c0, _preempted() - v0, gc_s, gens, gc_cpu, where))
        finally:
            stop.set()
            gc.callbacks.remove(self._on_gc)
