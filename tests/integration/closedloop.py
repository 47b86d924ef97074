"""An independent closed-loop client, to check `mlxproxy`'s capacity answers against: its own
code (threads and `http.client`, nothing of `mlxproxy.load`), its own prompts, its own
statistics. N streams each send their requests one after another; each stream's first request
is dropped as warm-up; a step's TTFT p95 is over the rest (at least `MIN_JUDGED`, and at least
`MIN_PER_STREAM` from each stream).

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
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

MIN_JUDGED = 30  # requests judged per step, past the warm-up
#: requests judged per stream at least. Above the server's prompt concurrency the streams drift
#: apart and end apart: a step's last requests are sent with fewer streams in flight, and a short
#: step judges many of them. Against the live tier's mlx_lm.server (prompt concurrency 8) at 10
#: streams, 3 a stream past the warm-up: a median 17 % (up to 37 %) of the judged requests were
#: sent after the last moment all 10 were in flight (their TTFT p50 0.16 s, 0.36 s before it);
#: TTFT p95 0.47-0.69 s, held 0.5 s in 8 of 14 runs (on the requests sent before that moment: 0
#: of 14). 5 a stream: 8 %, 0.56-0.70 s, 0 of 14; mlxproxy bench (6 a stream a round): 4 %,
#: 0.56-0.68 s, 0 of 14 (runs alternated back to back; issue 37, test_capacity_live.py's
#: docstring). At 8 streams, which end together, the count changed nothing.
MIN_PER_STREAM = 5


@dataclass
class Step:
    streams: int
    ttft_p95_s: float
    aggregate_tps: float
    judged: int
    first_turns_p95_s: float | None = None  # a sessions step's first turns, not judged


def _p95(values: list[float]) -> float:
    xs = sorted(values)
    pos = (len(xs) - 1) * 0.95
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _prompt(words: int) -> str:
    nonce = os.urandom(6).hex()  # no request finds another's prompt in the server's cache
    return f"{nonce} " + " ".join(f"item{(i * 7919) % 1000} {nonce[i % 12]}" for i in range(words))


def one_request(
    url: str, words: int, max_tokens: int, messages: list[dict[str, str]] | None = None
) -> tuple[float, float, int]:
    """(TTFT, E2E, output tokens) of one streamed chat request (`messages`, or one user message
    of `words` fresh words)."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
    body = json.dumps(
        {
            "model": "default_model",
            "messages": messages or [{"role": "user", "content": _prompt(words)}],
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


def _together(run: Callable[[], None], n: int, errors: list[BaseException], what: str) -> None:
    """`run` in `n` threads at once, to their end; the first error raised again."""
    threads = [threading.Thread(target=run) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"{n} {what}: {errors[0]!r}")


def step(url: str, streams: int, words: int, max_tokens: int) -> Step:
    per_stream = 1 + max(MIN_PER_STREAM, math.ceil(MIN_JUDGED / streams))  # the first of each stream: warm-up
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
        except BaseException as exc:
            errors.append(exc)

    _together(run, streams, errors, "streams")
    ttfts = [r[0] for r in got]
    agg = streams * sum(r[2] for r in got) / sum(r[1] for r in got)
    return Step(streams, _p95(ttfts), agg, len(got))


def _search(measure, slo_s: float, start: int, most: int) -> tuple[int, list[Step]]:  # type: ignore[no-untyped-def]
    """The most streams (or sessions) whose TTFT p95 met the SLO, below the first that broke it:
    from `start` up while steps hold, or, when `start` already breaks, down until one holds (so
    a scan near an earlier answer takes a few steps, not all of them)."""
    steps: list[Step] = []
    n = max(1, start)
    s = measure(n)
    steps.append(s)
    if s.ttft_p95_s > slo_s:
        while n > 1:
            n -= 1
            s = measure(n)
            steps.append(s)
            if s.ttft_p95_s <= slo_s:
                return n, steps
        return 0, steps
    while n < most:
        s = measure(n + 1)
        steps.append(s)
        if s.ttft_p95_s > slo_s:
            break
        n += 1
    return n, steps


def capacity(
    url: str, slo_ttft_p95_s: float, words: int, max_tokens: int, start: int = 1, most: int = 16
) -> tuple[int, list[Step]]:
    """The most streams whose TTFT p95 met the SLO before the first that broke it (`_search`)."""
    return _search(lambda n: step(url, n, words, max_tokens), slo_ttft_p95_s, start, most)


def sessions_run(
    url: str, at_once: int, turns: list[list[dict[str, str]]], think_s: float, max_tokens: int
) -> list[tuple[int, float, float, int]]:
    """`at_once` conversations at once, each its `turns` (the messages of each turn) in order,
    `think_s` between a turn's end and the next: (turn, TTFT, E2E, tokens) of every turn."""
    got: list[tuple[int, float, float, int]] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def run() -> None:
        nonce = os.urandom(6).hex()  # each conversation its own, as the tool's replay does
        try:
            for i, msgs in enumerate(turns):
                if i:
                    time.sleep(think_s)
                first = [{**msgs[0], "content": f"[{nonce}] {msgs[0]['content']}"}, *msgs[1:]]
                r = one_request(url, 0, max_tokens, first)
                with lock:
                    got.append((i, *r))
        except BaseException as exc:
            errors.append(exc)

    _together(run, at_once, errors, "sessions")
    return got


def sessions_capacity(
    url: str,
    slo_ttft_p95_s: float,
    turns: list[list[dict[str, str]]],
    think_s: float,
    max_tokens: int,
    start: int = 1,
    most: int = 16,
) -> tuple[int, list[Step]]:
    """The most conversations at once whose TTFT p95 over their later turns met the SLO before
    the first that broke it (`_search`). Each conversation's first turn is dropped as its
    warm-up, as each stream's first request is in `step`: its whole prompt is uncached and every
    conversation of a step starts it at once, a burst no steady state of that many agents has
    (`first_turns_p95_s` keeps its p95 apart); a step of fewer than `MIN_JUDGED` later turns runs
    its conversations again until it has that many."""

    def measure(n: int) -> Step:
        got: list[tuple[int, float, float, int]] = []
        while sum(1 for r in got if r[0]) < MIN_JUDGED:
            got += sessions_run(url, n, turns, think_s, max_tokens)
        later = [r for r in got if r[0]]
        agg = n * sum(r[3] for r in later) / sum(r[2] for r in later)
        first = _p95([r[1] for r in got if not r[0]])
        return Step(n, _p95([r[1] for r in later]), agg, len(later), first)

    return _search(measure, slo_ttft_p95_s, start, most)


if __name__ == "__main__":
    url, slo, words, mt = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    t = time.perf_counter()
    best, steps = capacity(url, slo, words, mt)
    for s in steps:
        print(f"{s.streams}: ttft p95 {s.ttft_p95_s:.3f} s, agg {s.aggregate_tps:.0f} tok/s, n={s.judged}")
    print(f"capacity {best} ({time.perf_counter() - t:.0f} s)")
