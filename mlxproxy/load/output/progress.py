"""How far a run has got, on stderr, while `replay` and `bench` measure.

On a terminal one status line is redrawn twice a second: what runs now (the target, the step of
a sweep), requests finished (of how many, where known), requests in flight, the aggregate
tokens/s the client received over the last 5 seconds, and the time so far. Targets measured in
parallel share the line. Anywhere else (a CI log, a pipe) the same line is printed as plain
text every 30 seconds, from 30 seconds on, so that short runs print nothing and long ones show
they are alive. Lines said meanwhile (a sweep's step verdicts) are printed above the status
line, never through it.

The figures come from the measuring client (`ClientView`): its finished records, the requests
in flight and the tokens received so far (those of requests still streaming included), so the
rate moves while long answers stream instead of jumping when they end.
"""

from __future__ import annotations

import asyncio
import shutil
import sys
import time
from collections import deque
from collections.abc import Callable
from typing import Protocol, TextIO

__all__ = ["ClientView", "Progress", "say", "status_line"]

#: redraw period on a terminal; plain-line period elsewhere; the window of the tokens/s figure
TTY_EVERY_S = 0.5
PLAIN_EVERY_S = 30.0
WINDOW_S = 5.0


class ClientView(Protocol):
    """What the progress line reads from a measuring client."""

    @property
    def in_flight(self) -> int: ...

    @property
    def finished_count(self) -> int: ...

    def tokens_received(self) -> int: ...


def _clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def status_line(
    label: str, done: int, total: int | None, in_flight: int | None, tps: float | None, elapsed_s: float
) -> str:
    """One target's part of the status line, e.g.
    `bench local: 12/40 requests, 2 in flight, 431 tok/s now, 0:37` (tok/s: all tokens received
    over the last WINDOW_S seconds, streams in flight included)."""
    parts = [f"{done}/{total} requests" if total else f"{done} request{'' if done == 1 else 's'}"]
    if in_flight is not None:
        parts.append(f"{in_flight} in flight")
    if tps is not None:
        parts.append(f"{tps:,.0f} tok/s now")
    parts.append(_clock(elapsed_s))
    return f"{label}: " + ", ".join(parts)


class _Board:
    """The status line of one output stream, shared by the runs that print on it."""

    def __init__(self, out: TextIO, tty: bool) -> None:
        self.out, self.tty = out, tty
        self.runs: list[Progress] = []
        self.shown = False  # a status line is on the terminal, not yet ended by a newline

    def line(self, now: float) -> str:
        return " | ".join(p.part(now) for p in self.runs)

    def draw(self, now: float) -> None:
        text = self.line(now)  # samples every run's rate
        if self.tty:
            width = shutil.get_terminal_size((100, 24)).columns - 1
            if len(text) > width:
                text = text[: max(0, width - 3)] + "..."
            self.out.write("\r\x1b[K" + text)
            self.shown = True
        else:
            self.out.write(f"mlxproxy: {text}\n")
        self.out.flush()

    def clear(self) -> None:
        if self.shown:
            self.out.write("\r\x1b[K")
            self.out.flush()
            self.shown = False


_boards: dict[int, _Board] = {}


def _board(out: TextIO, tty: bool) -> _Board:
    b = _boards.get(id(out))
    if b is None or b.out is not out:
        b = _boards[id(out)] = _Board(out, tty)
    return b


def say(line: str, out: TextIO | None = None) -> None:
    """Print `mlxproxy: line` on stderr above the status line (which is redrawn at its next turn)."""
    out = out or sys.stderr
    b = _boards.get(id(out))
    if b is not None and b.out is out:
        b.clear()
    out.write(f"mlxproxy: {line}\n")
    out.flush()


class Progress:
    """The progress of one target's run; calling it counts a finished request (for a run
    without a client to read). `start()` begins the periodic drawing (inside the event loop),
    `close()` ends it. `enabled`: None draws on a terminal and prints plain lines elsewhere;
    False draws nothing."""

    def __init__(
        self,
        label: str,
        total: int | None,
        enabled: bool | None = None,
        client: ClientView | None = None,
        *,
        out: TextIO | None = None,
        tty: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.out = out or sys.stderr
        self.tty = self.out.isatty() if tty is None else tty
        self.enabled = enabled is not False
        self.client = client
        self.clock = clock
        self.t0 = clock()
        self.ticks = 0
        self.label, self.total = label, total
        self._base = self._finished()
        self._samples: deque[tuple[float, int]] = deque()
        self._task: asyncio.Task[None] | None = None
        self._last_plain = self.t0

    def _finished(self) -> int:
        return self.client.finished_count if self.client is not None else self.ticks

    def __call__(self) -> None:
        self.ticks += 1

    def phase(self, label: str, total: int | None = None) -> None:
        """A new part of the run (a sweep's step): its own label and count."""
        self.label, self.total, self._base = label, total, self._finished()

    def rate(self, now: float) -> float | None:
        """Tokens/s received over the last WINDOW_S seconds (None before two samples)."""
        if self.client is None:
            return None
        tokens = self.client.tokens_received()
        self._samples.append((now, tokens))
        while len(self._samples) > 2 and self._samples[1][0] <= now - WINDOW_S:
            self._samples.popleft()
        t_then, tok_then = self._samples[0]
        return (tokens - tok_then) / (now - t_then) if now > t_then else None

    def part(self, now: float) -> str:
        in_flight = self.client.in_flight if self.client is not None else None
        done = self._finished() - self._base
        return status_line(self.label, done, self.total, in_flight, self.rate(now), now - self.t0)

    def start(self) -> None:
        if not self.enabled:
            return
        board = _board(self.out, self.tty)
        board.runs.append(self)
        self.rate(self.clock())  # the first sample, so the first drawn rate has a base
        self._task = asyncio.get_running_loop().create_task(self._run(board))

    async def _run(self, board: _Board) -> None:
        while True:
            await asyncio.sleep(TTY_EVERY_S)
            self.turn(board, self.clock())

    def turn(self, board: _Board, now: float) -> None:
        """One turn of the timer: every run samples its rate; the first run of the board
        draws the shared line (on a terminal every turn, elsewhere every PLAIN_EVERY_S)."""
        first = bool(board.runs) and board.runs[0] is self
        if first and (self.tty or now - self._last_plain >= PLAIN_EVERY_S):
            board.draw(now)
            self._last_plain = now
        else:
            self.rate(now)

    def close(self) -> None:
        if self._task is None:
            return
        self._task.cancel()
        self._task = None
        board = _board(self.out, self.tty)
        if self.tty and board.runs and board.runs[0] is self:
            board.draw(self.clock())  # the final figures stay on screen
            self.out.write("\n")
            self.out.flush()
            board.shown = False
        board.runs.remove(self)
