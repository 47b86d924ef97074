"""Pooled latency percentiles over several `run.py --json` files: an A/B finer than one run.

One `run.py` run reports, per target, the median over its rounds of each round's percentile
minus the direct run's. On a shared 2-core machine that figure moves by a tenth of a
millisecond from run to run for the same code, so differences of tens of µs need more: this
pools every sample of every round of every file per target, and prints the median over the
files of each file's pooled p10, p50, p90, p99 and mean (and the mean added to direct). Give
two copies of the same code as two targets (`--extra-proxy a=DIR --extra-proxy b=COPY`) to see
the noise between processes, which no number of rounds averages away.

    for i in 1 2 3 4; do
      python benchmarks/run.py --stack fast --only seq --only ttft --rounds 12 --litellm '' \\
        --no-nginx --no-floor --no-capture --extra-proxy old=/tmp/old --json /tmp/ab-$i.json
    done
    python benchmarks/pooled.py /tmp/ab-*.json
"""

from __future__ import annotations

import argparse
import json
import statistics

from run import pct  # the same percentile as run.py's figures

KEYS = {"seq": "lat", "ttft": "ttft"}  # scenario -> the per-round sample list in run.py's JSON


def pooled(path: str, scenario: str) -> dict[str, dict[str, float]]:
    """Per target of one file: its pooled percentiles (ms) and mean added to direct."""
    with open(path) as f:
        runs = json.load(f)["scenarios"].get(scenario)
    if not runs:
        return {}
    key = KEYS[scenario]
    direct = [x for r in runs["direct"] for x in r.get(key, [])]
    base = statistics.mean(direct) if direct else 0.0
    out: dict[str, dict[str, float]] = {}
    for name, rounds in runs.items():
        xs = sorted(x * 1e3 for r in rounds for x in r.get(key, []))
        if not xs:
            continue
        mean = statistics.mean(xs)
        out[name] = {
            "p10": pct(xs, 10),
            "p50": pct(xs, 50),
            "p90": pct(xs, 90),
            "p99": pct(xs, 99),
            "mean": mean,
            "added mean": mean - base * 1e3,
            "n": float(len(xs)),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", help="run.py --json outputs of repeated runs with the same targets")
    a = ap.parse_args()
    for scenario in KEYS:
        per_file = [p for p in (pooled(f, scenario) for f in a.files) if p]
        if not per_file:
            continue
        names = [n for n in per_file[0] if all(n in p for p in per_file)]
        print(f"{scenario} (ms; median over {len(per_file)} files of each file's pooled figure)")
        fields = ("p10", "p50", "p90", "p99", "mean", "added mean")
        print(f"  {'target':<12}" + "".join(f"{k:>11}" for k in fields) + "  samples/file")
        for n in names:
            row = "".join(f"{statistics.median(p[n][k] for p in per_file):11.3f}" for k in fields)
            print(f"  {n:<12}{row}  {int(statistics.median(p[n]['n'] for p in per_file))}")


if __name__ == "__main__":
    main()
