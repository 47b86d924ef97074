"""An independent closed-loop client, to check `mlxproxy`'s capacity answers against: its own
code (threads and `http.client`, nothing of `mlxproxy.load`), its own prompts, its own
statistics. N streams each send their requests one after another; each stream's first request
is dropped as warm-up; a step's TTFT p95 is over the rest (at least `MIN_JUDGED`).

Run as a script to print one scan: ``python -m tests.integration.closedloop URL``.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import sys
import threading
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

MIN_JUDGED = 30  # requests judged per step, past the warm-up


@dataclass
class Step:
    streams: int
    ttft_p95_s: float
    aggregate_tps: float
    judged: int


def _p95(values: list[float]) -> float:
    xs = sorted(values)
    pos = (len(xs) - 1) * 0.95
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _prompt(words: int) -> str:
    nonce = os.urandom(6).hex()  # no request finds another's prompt in the server's cache
    return f"{nonce} " + " ".join(f"item{(i * 7919) % 1000} {nonce[i % 12]}" for i in range(words))


def one_request(url: str, words: int, max_tokens: int) -> tuple[float, float, int]:
    """(TTFT, E2E, output tokens) of one streamed chat request."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
    body = json.dumps(
        {
            "model": "default_model",
            "messages": [{"role": "user", "content": _prompt(words)}],
            "max_tokens": max_tokens,
            "stream": True,
        }
    )
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:200]!r}")
    ttft = None
    tokens = 0
    for raw in resp:
        line = raw.strip()
        if not line.startswith(b"data:") or line == b"data: [DONE]":
            continue
        chunk = json.loads(line[5:])
        for choice in chunk.get("choices") or ():
            if (choice.get("delta") or {}).get("content"):
                tokens += 1
                if ttft is None:
                    ttft = time.perf_counter() - t0
    e2e = time.perf_counter() - t0
    conn.close()
    return (ttft if ttft is not None else e2e), e2e, tokens


def step(url: str, streams: int, words: int, max_tokens: int) -> Step:
    per_stream = 1 + math.ceil(MIN_JUDGED / streams)  # the first of each stream is the warm-up
    got: list[tuple[float, float, int]] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def run() -> None:
        try:
            for i in range(per_stream):
                r = one_request(url, words, max_tokens)
                if i:
                    with lock:
                        got.append(r)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"{streams} streams: {errors[0]!r}")
    ttfts = [r[0] for r in got]
    agg = streams * sum(r[2] for r in got) / sum(r[1] for r in got)
    return Step(streams, _p95(ttfts), agg, len(got))


def capacity(url: str, slo_ttft_p95_s: float, words: int, max_tokens: int, most: int = 16) -> tuple[int, list[Step]]:
    """The most streams, counting up from 1, whose TTFT p95 met the SLO before the first that broke it."""
    steps: list[Step] = []
    best = 0
    for n in range(1, most + 1):
        s = step(url, n, words, max_tokens)
        steps.append(s)
        if s.ttft_p95_s > slo_ttft_p95_s:
            break
        best = n
    return best, steps


if __name__ == "__main__":
    url, slo, words, mt = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    t = time.perf_counter()
    best, steps = capacity(url, slo, words, mt)
    for s in steps:
        print(f"{s.streams}: ttft p95 {s.ttft_p95_s:.3f} s, agg {s.aggregate_tps:.0f} tok/s, n={s.judged}")
    print(f"capacity {best} ({time.perf_counter() - t:.0f} s)")
