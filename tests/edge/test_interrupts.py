"""`run_async` (how `bench` and `replay` run their client): a second Ctrl-C while the first
one's clean-up runs raises nothing inside the loop, so no task ends with a KeyboardInterrupt that
is "never retrieved", and the run ends with the first one's result. Deterministic: the two
SIGINTs come from a thread while a task burns CPU inside one step (where a KeyboardInterrupt
raised in the loop lands) and the clean-up takes 0.4 s. The same through a real terminal:
tests/e2e/test_ctrl_c_tmux.py."""

from __future__ import annotations

import subprocess
import sys

from support import ENV

SCRIPT = r"""
import asyncio, os, signal, sys, threading, time
from mlxproxy.edge.runner import run_async

async def busy():
    while True:
        t = time.perf_counter()
        while time.perf_counter() - t < 0.05:
            pass
        await asyncio.sleep(0)

async def main():
    asyncio.get_running_loop().create_task(busy())
    try:
        await asyncio.sleep(30)
    except asyncio.CancelledError:
        print("first result", flush=True)
        t = time.perf_counter()
        while time.perf_counter() - t < 0.4:
            await asyncio.sleep(0.01)
        print("cleaned up", flush=True)
        raise

def kick():
    time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.15)
    os.kill(os.getpid(), signal.SIGINT)

threading.Thread(target=kick, daemon=True).start()
try:
    run_async(main(), sys.argv[1])
except KeyboardInterrupt:
    print("interrupted", flush=True)
"""


def test_a_second_ctrl_c_during_the_clean_up_raises_nothing_inside_the_loop(stack: str) -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT, stack], capture_output=True, text=True, timeout=60, env=ENV)
    assert out.stdout.split() == ["first", "result", "cleaned", "up", "interrupted"], out.stdout + out.stderr
    assert out.stderr == "", out.stderr  # (before: "Task exception was never retrieved ... KeyboardInterrupt")
