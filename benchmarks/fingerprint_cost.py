"""Instructions per call of the prompt's part of finishing a record, in-process, on the
agent-shaped body (`bodies.py`: 50 messages, 10 tools, 57 kB), counted by valgrind's callgrind:
the same N calls are run with N=50 and N=0 (the same bodies parsed and imports done in both),
and the difference divided by N.

    python benchmarks/fingerprint_cost.py [SRC ...]    # default: this repository

SRC is a folder holding an `mlxproxy/` package (e.g. `git archive main | tar -x -C /tmp/main`).
What is counted, each call on a freshly parsed copy of the same body (an agent's turns repeat
their prefix; the benchmark's requests are the same conversation every time):

  * `fingerprint`: `prefix.fingerprint` without a memo (all a SRC without `PieceMemo` has);
  * `repeat`: with a warm memo (`PrefixIndex().memo`): a turn whose parts were all seen;
  * `first`: with a new memo per call: a conversation's first turn, every part new;
  * `turn`: what `finish_checked` does with the prompt: `fingerprint` (with the index's memo,
    where the SRC has one), `find_turn` over the index, `PrefixIndex.add`.

Needs valgrind; about a minute per SRC.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
CALLS = 50
WHAT = ("fingerprint", "repeat", "first", "turn")


def _child(src: str, what: str, n: int) -> None:
    sys.path.insert(0, src)
    sys.path.insert(1, HERE)
    import orjson
    from bodies import chat_body

    from mlxproxy.core import prefix
    from mlxproxy.core.cachecheck import PrefixIndex

    if what in ("repeat", "first") and not hasattr(prefix, "PieceMemo"):
        return
    raw = chat_body(False, 16, "agent")
    bodies = [orjson.loads(raw) for _ in range(CALLS + 1)]
    index = PrefixIndex()
    memo = getattr(index, "memo", None)

    def one(obj: object, k: int) -> None:
        if what == "fingerprint":
            prefix.fingerprint("chat", obj, "m")
        elif what == "repeat":
            prefix.fingerprint("chat", obj, "m", memo=memo)
        elif what == "first":
            prefix.fingerprint("chat", obj, "m", memo=prefix.PieceMemo())
        else:
            pp = (
                prefix.fingerprint("chat", obj, "m", None, memo)
                if memo is not None
                else prefix.fingerprint("chat", obj, "m")
            )
            match = prefix.find_turn(index.latest, pp, obj)
            index.add(pp, match, f"r{k}", 14000, float(k))

    one(bodies[-1], -1)  # warm: the memo, the index
    for k in range(n):
        one(bodies[k], k)


def _count(src: str, what: str, n: int, workdir: str) -> int:
    out = os.path.join(workdir, "callgrind.out")
    argv = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable, __file__]
    run = subprocess.run([*argv, "--child", src, what, str(n)], capture_output=True, text=True, check=True)
    found = re.search(r"Collected : (\d+)", run.stderr)
    if found is None:
        raise RuntimeError(f"no callgrind total in: {run.stderr[-500:]}")
    return int(found.group(1))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", nargs="*", default=[REPO], help="folders holding an mlxproxy/ package")
    ap.add_argument("--child", nargs=3, metavar=("SRC", "WHAT", "N"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        _child(os.path.abspath(args.child[0]), args.child[1], int(args.child[2]))
        return 0
    with tempfile.TemporaryDirectory() as workdir:
        for src in args.src:
            figures = []
            for what in WHAT:
                per = (_count(src, what, CALLS, workdir) - _count(src, what, 0, workdir)) / CALLS
                figures.append(f"{what}: {per / 1e6:.2f} M" if per > 10_000 else f"{what}: n/a")
            print(f"{src}: instructions per call, " + ", ".join(figures), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
