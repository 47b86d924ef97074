"""The status line of replay and bench: figures from scripted clocks and a fake client; the
real command under a pseudo-terminal."""

from __future__ import annotations

import io
import os
import pty
import re
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mlxproxy.edge.runner import ServerThread
from mlxproxy.load.output import progress as prog
from mlxproxy.load.output.progress import PLAIN_EVERY_S, Progress, say, status_line
from mlxproxy.sim.app import create_app as create_sim
from support import ENV, REPO, captured_chats, write_capture


class FakeClient:
    def __init__(self) -> None:
        self.in_flight = 0
        self.finished_count = 0
        self.tokens = 0

    def tokens_received(self) -> int:
        return self.tokens


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class TtyIO(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_status_line_says_what_each_figure_is() -> None:
    assert (
        status_line("bench local", 12, 40, 2, 431.4, 37.9)
        == "bench local: 12/40 requests, 2 in flight, 431 tok/s now, 0:37"
    )
    assert (
        status_line("sweep s: 4 streams", 3, None, 4, None, 3725)
        == "sweep s: 4 streams: 3 requests, 4 in flight, 1:02:05"
    )


def test_the_rate_is_over_the_last_five_seconds_and_counts_requests_from_the_phase() -> None:
    client, clock = FakeClient(), Clock()
    p = Progress("replay s", 10, client=client, out=io.StringIO(), tty=False, clock=clock)
    assert p.rate(clock()) is None  # one sample: no rate yet
    for _ in range(20):  # 100 tok/s for 10 s, sampled every 0.5 s
        clock.t += 0.5
        client.tokens += 50
        p.rate(clock())
    client.tokens += 1000  # a burst of 1,000 tokens in the last half second
    clock.t += 0.5
    assert abs(p.rate(clock()) - (450 + 1000) / 5.0) < 1e-9  # the window holds 5 s, not the 10.5 s since the start
    client.finished_count, client.in_flight = 7, 3
    assert "7/10 requests, 3 in flight" in p.part(clock())
    p.phase("sweep s: 2 streams")
    client.finished_count = 9
    assert p.part(clock()).startswith("sweep s: 2 streams: 2 requests, 3 in flight")


def test_off_a_terminal_a_plain_line_every_30_seconds_and_none_for_short_runs() -> None:
    out, clock = io.StringIO(), Clock()
    p = Progress("bench s", 5, client=FakeClient(), out=out, tty=False, clock=clock)
    board = prog._Board(out, tty=False)
    board.runs.append(p)
    for _ in range(int(PLAIN_EVERY_S / 0.5) - 1):
        clock.t += 0.5
        p.turn(board, clock())
    assert out.getvalue() == ""  # 29.5 s: nothing yet
    for _ in range(int(PLAIN_EVERY_S / 0.5) * 2):  # to 89.5 s: lines at 30 and 60 s
        clock.t += 0.5
        p.turn(board, clock())
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and lines[0] == "mlxproxy: bench s: 0/5 requests, 0 in flight, 0 tok/s now, 0:30"
    assert "\r" not in out.getvalue()


def test_on_a_terminal_one_redrawn_line_shared_by_parallel_runs_and_lines_said_go_above_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    out, clock = TtyIO(), Clock()
    a = Progress("bench a", 4, client=FakeClient(), out=out, tty=True, clock=clock)
    b = Progress("bench b", 4, client=FakeClient(), out=out, tty=True, clock=clock)
    board = prog._board(out, True)
    board.runs += [a, b]
    a.rate(clock()), b.rate(clock())  # as start() does: the first sample
    try:
        clock.t += 0.5
        a.turn(board, clock())
        b.turn(board, clock())  # not the first run: samples, draws nothing
        assert out.getvalue() == "\r\x1b[Kbench a: 0/4 requests, 0 in flight, 0 tok/s now, 0:00 | " + (
            "bench b: 0/4 requests, 0 in flight, 0 tok/s now, 0:00"
        )
        say("sweep a: 1 stream: 3/3 ok", out)
        assert out.getvalue().endswith("0:00\r\x1b[Kmlxproxy: sweep a: 1 stream: 3/3 ok\n")
        monkeypatch.setenv("COLUMNS", "41")  # a narrow terminal: the line is cut to fit, never wrapped
        a.turn(board, clock())
        assert out.getvalue().endswith("\r\x1b[Kbench a: 0/4 requests, 0 in flight, 0...")
    finally:
        prog._boards.pop(id(out), None)


def test_replay_on_a_terminal_shows_the_status_line(tmp_path: Path) -> None:
    """The real command with stderr on a pseudo-terminal: the line is drawn while the run goes
    and its last state stays, ended by a newline, before the table."""
    cap = write_capture(tmp_path / "c.jsonl", captured_chats(3, max_tokens=40))
    with ServerThread(create_sim("healthy", speed=1)) as sim:  # 40 tokens at 50 tok/s: ~0.8 s each
        main, child = pty.openpty()
        proc = subprocess.Popen(
            [sys.executable, "-m", "mlxproxy", "replay", str(cap), "--target", f"s={sim.url}", "--mode", "sequential"],
            stdout=subprocess.PIPE,
            stderr=child,
            env={**ENV, "COLUMNS": "200"},
            cwd=REPO,
        )
        os.close(child)
        seen = b""
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            ready, _, _ = select.select([main], [], [], 1.0)
            if ready:
                try:
                    chunk = os.read(main, 4096)
                except OSError:  # the child side closed: the command ended
                    break
                if not chunk:
                    break
                seen += chunk
            elif proc.poll() is not None:
                break
        stdout, _ = proc.communicate(timeout=60)
        os.close(main)
    assert proc.returncode == 0, seen[-800:]
    text = seen.decode()
    drawn = [part for part in text.split("\r\x1b[K") if part.startswith("replay s: ")]
    assert drawn, text[-800:]
    assert re.fullmatch(r"replay s: 3/3 requests, 0 in flight, [\d,]+ tok/s now, \d+:\d\d", drawn[-1].rstrip()), drawn[
        -1
    ]
    assert any(" tok/s now" in d for d in drawn) and b"ok/req" in stdout
