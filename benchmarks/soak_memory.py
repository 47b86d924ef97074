"""Memory of `mlxproxy serve` over a long run of tests/e2e/test_soak.py's mix of requests and faults.

    python benchmarks/soak_memory.py [--batches 4] [--size 5000] [--census]
    MLXPROXY_STACK=plain python benchmarks/soak_memory.py

The proxy runs in a child process with probes on signals (SIGUSR1: resident memory, pymalloc
blocks, objects the cyclic GC tracks, glibc's heap; SIGUSR2: the same before and after
`malloc_trim(0)`; SIGHUP: one collection with DEBUG_SAVEALL and what it found, by type). After a
1,000-request warm-up the mix is sent in batches, each batch followed by a probe, so the curve
shows whether memory keeps growing, and `--census` shows what cyclic garbage (if any) was left.
Prints one line per probe; `benchmarks/README.md`, "Memory over a long run", has the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def child(argv: list[str]) -> None:
    """`python -m mlxproxy ARGV` with the probes installed (runs in the proxy's process)."""
    import ctypes
    import gc
    import runpy
    from collections import Counter

    libc = ctypes.CDLL("libc.so.6")

    class Mallinfo2(ctypes.Structure):
        _fields_ = [
            (n, ctypes.c_size_t)
            for n in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()
        ]

    libc.mallinfo2.restype = Mallinfo2
    out = os.environ["SOAK_MEMORY_OUT"]

    def write(text: str) -> None:
        with open(out, "a") as f:
            f.write(text + "\n")

    def rss_kib() -> int:
        return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS"))

    def probe(tag: str) -> None:
        mi = libc.mallinfo2()
        write(
            f"{tag}: RSS {rss_kib()} KiB, pymalloc blocks {sys.getallocatedblocks()}, GC-tracked objects "
            f"{len(gc.get_objects())}, malloc in use {mi.uordblks // 1024} KiB, free {mi.fordblks // 1024} KiB"
        )

    def trim(sig: int, frame: object) -> None:
        probe("before malloc_trim")
        libc.malloc_trim(0)
        probe("after malloc_trim ")

    def census(sig: int, frame: object) -> None:
        gc.set_debug(gc.DEBUG_SAVEALL)
        n = gc.collect()
        kinds = Counter(type(o).__qualname__ for o in gc.garbage)
        gc.garbage.clear()
        gc.set_debug(0)
        write(f"cyclic garbage: {n} objects" + "".join(f"\n  {v:6d} {k}" for k, v in kinds.most_common(15)))

    signal.signal(signal.SIGUSR1, lambda s, f: probe("probe"))
    signal.signal(signal.SIGUSR2, trim)
    signal.signal(signal.SIGHUP, census)
    sys.argv = ["mlxproxy", *argv]
    runpy.run_module("mlxproxy", run_name="__main__", alter_sys=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--size", type=int, default=5000, help="requests per batch")
    ap.add_argument(
        "--census", action="store_true", help="what cyclic garbage is left after the warm-up and at the end"
    )
    args = ap.parse_args()
    sys.path[:0] = [str(REPO / "tests"), str(REPO / "tests" / "e2e"), str(REPO)]
    import test_soak as mix

    import support

    tmp = Path(tempfile.mkdtemp())
    out = tmp / "probes.txt"
    out.touch()
    sim = support.start(["sim", "--profile", "healthy", "--port", "0", "--speed", "200", "--seed", "1"], "listening on")
    cfg = tmp / "proxy.yaml"
    cfg.write_text(
        f"port: 0\nlog_requests: false\ntimeouts:\n  read_s: 1.0\nupstreams:\n  - name: sim\n    url: {sim.url}\n"
    )
    env = {**os.environ, "SOAK_MEMORY_OUT": str(out)}
    argv = [sys.executable, __file__, "--child", "serve", "--config", str(cfg), "--log-level", "warning"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    assert proc.stdout is not None
    lines: list[str] = []
    for line in proc.stdout:
        lines.append(line)
        if "listening on" in line:
            url = "http://127.0.0.1:" + line.split("http://127.0.0.1:")[1].split("/")[0].split()[0]
            break
    else:
        sys.exit("the proxy did not start:\n" + "".join(lines))
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()  # type: ignore[arg-type]
    print(f"stack: {os.environ.get('MLXPROXY_STACK', 'fast (default)')}, Python {sys.version.split()[0]}")

    def ask(tag: str, sig: signal.Signals = signal.SIGUSR1) -> None:
        size = out.stat().st_size
        print(f"{tag}:", flush=True)
        proc.send_signal(sig)
        deadline = time.monotonic() + 10
        while out.stat().st_size == size and time.monotonic() < deadline:  # readiness polling
            time.sleep(0.05)
        time.sleep(0.2)  # a census or a trim writes two lines
        print("  " + out.read_text()[size:].rstrip().replace("\n", "\n  "), flush=True)

    try:
        assert not asyncio.run(mix.drive(url, mix.plan(1000, 1)))
        mix.settle(url)
        ask("after a warm-up of 1000")
        if args.census:
            ask("census", signal.SIGHUP)
        total = 0
        for b in range(args.batches):
            t = time.monotonic()
            problems = asyncio.run(mix.drive(url, mix.plan(args.size, 100 + b)))
            mix.settle(url)
            total += args.size
            ask(f"after {total} more ({args.size / (time.monotonic() - t):.0f} req/s, {len(problems)} problems)")
        ask("end", signal.SIGUSR2)
        if args.census:
            ask("census", signal.SIGHUP)
    finally:
        proc.terminate()
        proc.wait(10)
        sim.stop()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2:])
    else:
        main()
