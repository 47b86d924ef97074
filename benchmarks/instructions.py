"""Instructions per proxied request, counted by valgrind's callgrind: an A/B that a busy
machine cannot blur.

Timings on a shared 2-core machine move by tens of percent with the neighbours' load; the
number of instructions the proxy executes for the same requests does not (two runs of the
same code agree within about 1%). This runs `python -m mlxproxy serve` from each SRC folder
under callgrind against `benchmarks/upstream.py`, warms it up, then counts, with the
counters zeroed before and dumped after each phase:

  * 300 sequential non-streaming requests (16 tokens): instructions per request;
  * 10 sequential streams of 100 events at 50 tok/s (`--rate`): instructions per stream;
  * the same two (100 and 10) with the agent-shaped body (`bodies.py`: 50 messages, 10 tools,
    57 kB, the same conversation every time, as an agent's turns repeat their prefix).

    python benchmarks/instructions.py [SRC ...]     # default: this repository

SRC is a folder holding an `mlxproxy/` package (e.g. `git archive <commit> mlxproxy | tar -x
-C /tmp/old`), or `floor`: `floor.py`, the same server stack and upstream client forwarding
bytes with no work of its own, so the figures split into the stack's and the proxy's own. Everything the proxy process does in a phase is counted, its timers included
(the event-loop lag monitor ticks 20 times a second). Under valgrind a phase lasts ~50 times
longer than it would natively, so those timers weigh far more per request than they do in a
real run. A third phase therefore measures the idle process for 2 s, and each figure is also
printed "net of idle": the phase's count minus the idle rate times the phase's duration.
Needs valgrind (Debian: `apt-get install valgrind`); takes a few minutes per SRC.
"""

from __future__ import annotations

import argparse
import glob
import http.client
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from bodies import chat_body  # noqa: E402
from treecount import count_each_tree  # noqa: E402

NON_STREAM = chat_body(False, 16)
STREAM = chat_body(True, 100)
AGENT_NON_STREAM = chat_body(False, 16, "agent")
AGENT_STREAM = chat_body(True, 100, "agent")
FLOOR = "floor"
PHASES = (
    ("non-stream request", NON_STREAM, 300),
    ("stream of 100 events", STREAM, 10),
    ("agent-shaped non-stream request", AGENT_NON_STREAM, 100),
    ("agent-shaped stream of 100 events", AGENT_STREAM, 10),
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(port: int, proc: subprocess.Popen, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the proxy exited with {proc.returncode} before answering")
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            c.request("GET", "/healthz")
            c.getresponse().read()
            return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"the proxy did not answer /healthz within {timeout_s:g} s")


def send(conn: http.client.HTTPConnection, body: bytes, n: int) -> None:
    for _ in range(n):
        try:
            conn.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
            r = conn.getresponse()
        except (BrokenPipeError, ConnectionResetError, http.client.RemoteDisconnected):
            # the server closed the idle keep-alive connection (uvicorn's 5 s, which a callgrind
            # dump on a busy machine can outlast): once more on a new one
            conn.close()
            conn.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
            r = conn.getresponse()
        r.read()
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status} through the proxy")


def total_instructions(path: str) -> int:
    with open(path) as f:
        for line in f:
            if line.startswith(("summary:", "totals:")):
                return int(line.split()[1])
    raise RuntimeError(f"no instruction total in {path}")


def measure(src: str, up_port: int, workdir: str) -> dict[str, float]:
    port = free_port()
    out = os.path.join(workdir, "callgrind.out")
    env = dict(os.environ, PYTHONPATH=src)
    if src == FLOOR:  # the stack alone (floor.py): what any proxy built this way costs
        server = [os.path.join(HERE, "floor.py"), "--upstream", f"http://127.0.0.1:{up_port}", "--port", str(port)]
        env, src = dict(os.environ), HERE
    else:
        server = ["-m", "mlxproxy", "serve", "--upstream", f"http://127.0.0.1:{up_port}", "--port", str(port)]
        server += ["--log-level", "warning"]
    argv = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable, *server]
    with open(os.path.join(workdir, "valgrind.log"), "w") as log:
        proc = subprocess.Popen(argv, env=env, cwd=src, stdout=subprocess.DEVNULL, stderr=log)
    try:
        wait_healthy(port, proc)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        send(conn, NON_STREAM, 40)  # warm-up: imports, caches, the upstream pool
        send(conn, STREAM, 4)
        send(conn, AGENT_NON_STREAM, 4)
        time.sleep(1.0)  # the finisher drains (not a measurement: the counters are zeroed next)

        def phase(work: Callable[[], None]) -> tuple[int, float]:
            """(instructions, seconds) of the proxy process while `work` runs, then 1 s more."""
            subprocess.run(["callgrind_control", "-z", str(proc.pid)], check=True, capture_output=True)
            t0 = time.monotonic()
            work()
            time.sleep(1.0)  # let the last records be finished before the dump
            before = set(glob.glob(out + "*"))
            subprocess.run(["callgrind_control", "-d", str(proc.pid)], check=True, capture_output=True)
            seconds = time.monotonic() - t0
            dumps = sorted(set(glob.glob(out + "*")) - before, key=os.path.getmtime)
            return total_instructions(dumps[-1]), seconds

        # what the process does with no request at all (its timers), per second
        idle, idle_s = phase(lambda: time.sleep(2.0))
        per_s = idle / idle_s
        result = {"idle per second": per_s}
        for name, body, n in PHASES:
            total, seconds = phase(lambda: send(conn, body, n))  # noqa: B023 (called at once)
            result[name] = total / n
            result[name + ", net of idle"] = (total - per_s * seconds) / n
        return result
    finally:
        proc.terminate()
        proc.wait(60)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="Instructions per proxied request under callgrind (A/B on a busy machine)."
    )
    ap.add_argument(
        "src",
        nargs="*",
        default=[REPO],
        help=f"folders holding an mlxproxy package (default: this repository), or {FLOOR!r}: the stack alone (floor.py)",
    )
    ap.add_argument(
        "--rate",
        type=float,
        default=50.0,
        help="the upstream's tokens per second per stream (default 50: the proxy, ~50x slower under "
        "callgrind, keeps up with its events; compare SRCs measured in one run: between runs the "
        "stream figures of the same code moved by up to 8%% with the machine's load)",
    )
    args = ap.parse_args(argv)
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        print("instructions.py: valgrind is not installed (Debian: apt-get install valgrind)", file=sys.stderr)
        return 2
    for src in args.src:
        if src != FLOOR and not os.path.isdir(os.path.join(src, "mlxproxy")):
            print(f"instructions.py: {src} holds no mlxproxy/ package", file=sys.stderr)
            return 2

    def one(src: str, up_port: int) -> dict[str, float]:
        with tempfile.TemporaryDirectory(prefix="mlxproxy-instr-") as workdir:
            return measure(src if src == FLOOR else os.path.abspath(src), up_port, workdir)

    count_each_tree(args.src, one, lambda v: f"{v / 1e6:.3f} M", rate=args.rate)
    return 0


if __name__ == "__main__":
    sys.exit(main())
