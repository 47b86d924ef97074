"""Instructions per request of the load generator's client, counted by valgrind's callgrind:
the A/B of `generator.py` that a busy machine cannot blur (issue 39).

`generator.py` times `mlxproxy.load.run.client.MeasuringClient` (its raw HTTP/1.1 transport,
every response metered and checked) in wall-clock and CPU seconds, which move by tens of
percent with the neighbours' load on a shared machine. This runs the same client side from
each SRC folder under callgrind, against `benchmarks/upstream.py` in its own process (not under
valgrind), sending as `generator.py` parts 1 and 2 do (each tree's own API: `load.run.runner.send`,
or `load.workers.run_shape` in trees before the load package became subpackages), on the stack's
event loop (`mlxproxy.edge.runner.run_async`), and counts with the counters zeroed before and
dumped after each phase (`callgrind_control` on its own pid, the event loop kept turning
meanwhile so valgrind takes the command):

  * idle: the client's loop with nothing to send for 1 s, plus the zero and dump themselves
    (the loop polls every 5 ms while `callgrind_control` runs): the phases' fixed part, a
    fraction of a percent of each of the others;
  * an open loop of `--requests` non-streaming requests (8 tokens) at `--rate` req/s:
    instructions per request;
  * an open loop of `--streams` streams of 100 events (upstream at 100 tok/s) at
    `--stream-rate` req/s: instructions per stream and per event received.

    python benchmarks/generator_instructions.py [SRC ...]   # default: this repository

SRC is a folder holding an `mlxproxy/` package (`git archive <commit> mlxproxy | tar -x -C DIR`).
Under callgrind the client runs ~50 times slower, so the rates are low (defaults 40 req/s and
4 streams/s, ~4 in flight) for it to keep up; at 2,000 req/s natively one loop wake-up serves
several requests, here about one each, so the figures are the per-request work without that
batching. Instructions are not lag: they say nothing of `generator.py`'s schedule lag targets.
Needs valgrind; a few minutes per SRC.
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from generator import _body, set_rate  # noqa: E402
from instructions import total_instructions  # noqa: E402
from treecount import count_each_tree  # noqa: E402


async def _control(cmd: str) -> None:
    """`callgrind_control cmd` on this process, the loop turning (valgrind takes the command
    while it runs code; a process blocked in a wait would leave it pending)."""
    p = subprocess.Popen(["callgrind_control", cmd, str(os.getpid())], stdout=subprocess.DEVNULL)
    while p.poll() is None:
        await asyncio.sleep(0.005)
    if p.returncode:
        raise RuntimeError(f"callgrind_control {cmd} failed ({p.returncode})")


def _child(src: str, port: int, out: str, args: argparse.Namespace) -> None:
    """Under callgrind: warm up, then each phase between a zero and a dump; one JSON line per
    phase on stdout (its name, requests, events received, dump file)."""
    sys.path.insert(0, src)
    from mlxproxy.edge.runner import run_async

    try:  # after issue 39: load/run/...
        from mlxproxy.load.run.client import MeasuringClient, PreparedRequest
        from mlxproxy.load.run.runner import send
        from mlxproxy.load.run.shapes import Load, OpenLoop

        async def send_open(client: Any, rate: float, reqs: list[Any]) -> Any:
            return await send(OpenLoop(rate, "constant"), Load(reqs), client)

    except ImportError:  # before (25449ca): load/client.py, load/workers.py
        from mlxproxy.load.client import MeasuringClient, PreparedRequest  # type: ignore[no-redef]
        from mlxproxy.load.shapes import OpenLoop  # type: ignore[no-redef]
        from mlxproxy.load.workers import Workers, run_shape

        async def send_open(client: Any, rate: float, reqs: list[Any]) -> Any:
            return await run_shape(Workers(1), OpenLoop(rate, "constant"), client, reqs)

    def reqs(stream: bool, n: int) -> list[Any]:
        body = _body(stream, 100 if stream else 8)
        return [
            PreparedRequest("POST", "/v1/chat/completions", body, (("content-type", "application/json"),))
            for _ in range(n)
        ]

    async def main() -> None:
        async with MeasuringClient(f"http://127.0.0.1:{port}", timeout_s=600.0) as client:

            async def phase(name: str, rate: float, batch: list[Any]) -> None:
                before = set(glob.glob(out + "*"))
                await _control("-z")
                if batch:
                    timed = await send_open(client, rate, batch)
                    ok = [r for r in timed.records if r.outcome in ("ok", "ok_no_done")]
                    events = sum(r.generated_events for r in ok)
                else:
                    await asyncio.sleep(1.0)
                    ok, events = [], 0
                await _control("-d")
                dumps = sorted(set(glob.glob(out + "*")) - before, key=os.path.getmtime)
                line = {"phase": name, "requests": len(batch), "ok": len(ok), "events": events, "dump": dumps[-1]}
                print(json.dumps(line), flush=True)

            set_rate(port, 0.0)
            await send_open(client, args.rate, reqs(False, 40))  # warm-up: imports, pool, caches
            set_rate(port, 100.0)
            await send_open(client, args.stream_rate, reqs(True, 4))
            await phase("idle", 0.0, [])
            set_rate(port, 0.0)
            await phase("non-stream", args.rate, reqs(False, args.requests))
            set_rate(port, 100.0)
            await phase("stream", args.stream_rate, reqs(True, args.streams))

    run_async(main())


def measure(src: str, port: int, args: argparse.Namespace) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="mlxproxy-geninstr-") as workdir:
        out = os.path.join(workdir, "callgrind.out")
        argv = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable, __file__]
        argv += ["--child", src, "--port", str(port), "--out", out]
        argv += ["--rate", f"{args.rate:g}", "--requests", str(args.requests)]
        argv += ["--stream-rate", f"{args.stream_rate:g}", "--streams", str(args.streams)]
        env = dict(os.environ, PYTHONPATH=src, PYTHONHASHSEED="0")
        with open(os.path.join(workdir, "valgrind.log"), "w") as log:
            run = subprocess.run(argv, env=env, cwd=src, stdout=subprocess.PIPE, stderr=log, text=True, timeout=3600)
        if run.returncode:
            with open(os.path.join(workdir, "valgrind.log")) as f:
                raise RuntimeError(f"{src}: the client exited with {run.returncode}: {f.read()[-800:]}")
        phases = {p["phase"]: p for p in map(json.loads, run.stdout.splitlines())}
        if args.keep:
            for p in phases.values():
                shutil.copy(p["dump"], os.path.join(args.keep, f"{os.path.basename(src)}.{p['phase']}.callgrind"))
        idle = total_instructions(phases["idle"]["dump"])
        res: dict[str, float] = {"idle per second": float(idle)}
        ns, st = phases["non-stream"], phases["stream"]
        for p in (ns, st):
            if p["ok"] != p["requests"]:
                raise RuntimeError(f"{src}: {p['phase']}: {p['ok']} of {p['requests']} requests ok")
        res["non-stream request"] = total_instructions(ns["dump"]) / ns["requests"]
        streamed = total_instructions(st["dump"])
        res["stream of 100 events"] = streamed / st["requests"]
        res["streamed event"] = streamed / st["events"]
        return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Instructions per request of the load generator's client under callgrind.")
    ap.add_argument("src", nargs="*", default=[REPO], help="folders holding an mlxproxy package (default: this repo)")
    ap.add_argument("--rate", type=float, default=40.0, help="non-streaming requests/s (default 40)")
    ap.add_argument("--requests", type=int, default=400, help="non-streaming requests counted (default 400)")
    ap.add_argument("--stream-rate", type=float, default=4.0, help="streams started per second (default 4)")
    ap.add_argument("--streams", type=int, default=40, help="streams of 100 events counted (default 40)")
    ap.add_argument("--keep", default=None, help="copy each phase's callgrind dump into this folder")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        _child(args.child, args.port, args.out, args)
        return 0
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        print(
            "generator_instructions.py: valgrind is not installed (Debian: apt-get install valgrind)", file=sys.stderr
        )
        return 2
    for src in args.src:
        if not os.path.isdir(os.path.join(src, "mlxproxy")):
            print(f"generator_instructions.py: {src} holds no mlxproxy/ package", file=sys.stderr)
            return 2
    count_each_tree(args.src, lambda src, port: measure(os.path.abspath(src), port, args), lambda v: f"{v / 1e3:.1f} k")
    return 0


if __name__ == "__main__":
    sys.exit(main())
