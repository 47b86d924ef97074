"""Ctrl-C twice during `bench` and `replay`, through a real terminal (tmux): the command exits
quietly with the first Ctrl-C's result (its summary and "interrupted" line, exit 130), with no
traceback, in 10 of 10 runs, the second Ctrl-C coming 0 to 300 ms after the first (issue 40)."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from mlxproxy.edge.runner import ServerThread
from mlxproxy.sim.app import create_app as create_sim
from support import REPO

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux (apt-get install tmux)")

DELAYS_S = (0.0, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.0, 0.03)


class Terminal:
    """A tmux session on a server of its own (its own socket name), killed at the end."""

    def __init__(self) -> None:
        self.name = f"mlxproxy-test-{uuid.uuid4().hex[:8]}"
        self.tmux("new-session", "-d", "-s", "t", "-x", "220", "-y", "100", "bash --norc --noprofile")

    def tmux(self, *args: str) -> str:
        return subprocess.run(["tmux", "-L", self.name, *args], capture_output=True, text=True, timeout=20).stdout

    def type(self, line: str) -> None:
        self.tmux("send-keys", "-t", "t", line, "Enter")

    def screen(self) -> str:
        return self.tmux("capture-pane", "-p", "-t", "t", "-S", "-1000")

    def close(self) -> None:
        self.tmux("kill-server")


def _wait(pred, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)  # (readiness polling)
    return False


def test_a_second_ctrl_c_exits_quietly_with_the_first_ones_result(tmp_path: Path) -> None:
    sim = create_sim("healthy", decode_tps=20.0)  # slow enough that requests are in flight when Ctrl-C comes
    term = Terminal()
    try:
        with ServerThread(sim) as srv:
            python = shlex.quote(sys.executable)
            env = f"PYTHONPATH={shlex.quote(str(REPO))} MLXPROXY_STACK={os.environ.get('MLXPROXY_STACK', '')}"
            commands = {
                "bench": f"--target {srv.url} --prompt-tokens 100 --max-tokens 64 --repeat 50 --batch 4",
                "replay": f"builtin:agent --target {srv.url} --mode concurrency --concurrency 4 --repeat 50",
            }
            for run, delay in enumerate(DELAYS_S):
                command = "bench" if run % 2 == 0 else "replay"
                rc = tmp_path / f"rc{run}"
                term.type("clear; trap true INT")  # (the shell survives Ctrl-C and runs the echo)
                assert _wait(lambda: "mlxproxy" not in term.screen(), 10)
                term.tmux("clear-history", "-t", "t")
                term.type(f"{env} {python} -m mlxproxy {command} {commands[command]}; echo $? > {rc}")
                assert _wait(lambda: any(f"{n} in flight" in term.screen() for n in range(1, 9)), 60), term.screen()
                term.tmux("send-keys", "-t", "t", "C-c")
                time.sleep(delay)
                term.tmux("send-keys", "-t", "t", "C-c")
                assert _wait(lambda rc=rc: rc.exists() and rc.read_text().strip() != "", 60), term.screen()
                screen = term.screen()
                seen = f"run {run} ({command}, second Ctrl-C {delay * 1000:g} ms after the first):\n{screen}"
                assert rc.read_text().strip() == "130", seen
                assert "Traceback" not in screen and "never retrieved" not in screen, seen
                assert "KeyboardInterrupt" not in screen, seen
                assert "interrupted" in screen and "mlxproxy: interrupted\n" not in screen, (
                    seen
                )  # the command's own line
                summary = "interrupted after" if command == "bench" else "mlxproxy: interrupted"
                assert summary in screen, seen
    finally:
        term.close()
