"""The A/B loop of the callgrind benchmarks: one benchmark upstream (`upstream.py`), each
source tree measured against it in turn, a line printed per tree as it is measured.

`instructions.py` counts the proxy's instructions per request this way, and
`generator_instructions.py` the load generator's; `generator.py` starts its upstream here too.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
from collections.abc import Callable, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))


def start_upstream(rate: float | None = None) -> tuple[subprocess.Popen[str], int]:
    """`upstream.py` on a free port, streaming `rate` tokens/s (None: its default), and its port."""
    argv = [sys.executable, os.path.join(HERE, "upstream.py"), "--port", "0"]
    if rate is not None:
        argv += ["--rate", f"{rate:g}"]
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    ready, _, _ = select.select([p.stdout], [], [], 15)
    line = p.stdout.readline() if ready else ""
    if not line.startswith("READY "):
        p.kill()
        raise SystemExit(f"benchmark upstream did not start: {line!r}")
    return p, int(line.split()[1])


def count_each_tree(
    srcs: Sequence[str],
    measure: Callable[[str, int], dict[str, float]],
    figure: Callable[[float], str],
    rate: float | None = None,
) -> None:
    """Each tree of `srcs` measured by `measure(src, upstream_port)` against one upstream: a line
    "SRC: instructions per WHAT: FIGURE, ..." each, `figure` writing a count; the upstream
    stopped at the end, also when a measurement fails."""
    up, port = start_upstream(rate)
    try:
        for src in srcs:
            res = measure(src, port)
            print(f"{src}: instructions per " + ", ".join(f"{k}: {figure(v)}" for k, v in res.items()), flush=True)
    finally:
        up.kill()
        up.wait(10)
