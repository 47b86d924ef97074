"""Capacity a user can rerun, against a real ``mlx_lm.server`` on CPU (issue 37, "Done when").

Five runs of ``mlxproxy bench --sweep auto`` agree within one step or 15 % (the larger), and each
lies within the range an independent closed-loop client (``closedloop.py``: its own threads,
``http.client`` and statistics, each stream's first request dropped, >= 30 requests a step)
measures right before and right after it, widened by the same allowance; the same for
``mlxproxy replay --mode sessions --sweep auto`` on a captured five-turn agent conversation. The
machine is shared and busy: that noise is what the answers must hold against. Every run's figures
are printed (``-s`` shows them).

Lean on purpose (a small prompt cache-free workload, 32-token answers, ``--step-time 2``): the
tier's cost is printed at the end of each test (about 9 minutes for both).

Marked ``slow``, out of the default run, while issue 37 is open: it costs 9-9.5 minutes (over the
6 a CI tier may take), and on a busy 2-core machine (load average 2-7) it held in one of three
whole runs (2026-12-06, with the answer's two steps measured twice, 2a0b409): bench answered
8, 7, 7, 7, 7 (client 8-9), 8, 6, 8, 8, 7 (client 7-8: the 6 failed) and 7, 8, 8, 8, 8 (client
8-9); sessions 9, 8, 9, 9, 9 (client 10: the 8 failed), 9, 9, 9, 10, 9 (client 7-10) and
9, 9, 9, 9, 9 (client 10). Both misses are the tool's synchronized sends against mlx_lm.server's
admission of new prompts (about seven at a time; the rest wait for the next round): the bench's
phase-locked streams split a 7-stream wave 2 + 5, the five waiting 0.52-0.58 s, where the
client's threads, a few ms apart, saw 0.36-0.40 s; a sessions step starts its conversations in
the same millisecond, so 2-3 of ten first turns wait ~1.1 s and set the p95 of 50 turns. Run it
with ``python -m pytest -m slow -s tests/integration/test_capacity_live.py``.

Spreading the streams' starts over one TTFT alone (tried 2026-12-06 evening, load average 3-12,
three whole runs, all failed; taken out again, docs/METRICS.md "Why the streams start at once")
did not help: bench 3, 4, 4, 6, 8 / 5, 4, 8, 4, 8 / 7, 8, 4, 4, 5 against clients of 4-8; on
that server the first stream is admitted alone and the others wait its round (in a sessions
step S-1 of S first turns, 0.45-0.65 s), and where the streams stand after the first round is
the server's grouping either way. Without the ramp, in the same hour, two whole runs: bench
6, 6, 6, 4, 6 (client 6-8: the 4 failed) and 6, 8, 8, 8, 5 (client 5-8: the 6 and the 5 off the
median), sessions 8, 7, 8, 9, 8 (client 5-10) and 10, 8, 9, 9, 9 (client 8-10): both held.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from . import closedloop
from .tinymodel import mlx_unavailable_reason

pytestmark = [pytest.mark.integration, pytest.mark.slow]

_REASON = mlx_unavailable_reason()
if _REASON is not None:
    pytest.skip(f"mlx stack unavailable: {_REASON}", allow_module_level=True)

#: runs of each sweep (MLXPROXY_CAPACITY_RUNS to change it for a quicker look)
RUNS = int(os.environ.get("MLXPROXY_CAPACITY_RUNS", "5"))
SLO_S = 0.5  # TTFT p95: about 4-5 streams on this server (a small capacity keeps the tier lean)
PROMPT_TOKENS = 578  # the workload; the independent client's prompts: 80 words = ~577 tokens
WORDS = 80
MAX_TOKENS = 32


def allowance(v: float) -> float:
    """One step or 15 %, the larger."""
    return max(1.0, 0.15 * v)


def _tool(args: list[str], out: Path) -> dict:
    res = subprocess.run(
        [sys.executable, "-m", "mlxproxy", *args, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=400,
        stdin=subprocess.DEVNULL,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    cap = next(iter(json.loads(out.read_text())["capacity"].values()))
    verdict = res.stdout.split("\nCapacity (", 1)[-1].split("\n", 1)[-1]  # the verdict, wrapped to 100 columns
    line = " ".join(verdict.split("\n\n")[0].split("\ns: ")[0].split())
    return {"value": cap["max_concurrency"], "interval": cap.get("interval"), "line": line, "cap": cap}


def _judge(label: str, runs: list[dict]) -> list[str]:
    """Every run printed; the failures, in words."""
    values = [r["value"] for r in runs]
    med = statistics.median(values)
    fails = []
    for i, r in enumerate(runs, 1):
        lo, hi = min(r["before"], r["after"]), max(r["before"], r["after"])
        print(
            f"{label} run {i}: {r['value']} (interval {r['interval']}), independent client before {r['before']}, "
            f"after {r['after']}; {r['line']}"
        )
        if not lo - allowance(lo) <= r["value"] <= hi + allowance(hi):
            fails.append(f"run {i}: {r['value']} outside the independent client's {lo}-{hi} (+- one step / 15 %)")
        if abs(r["value"] - med) > allowance(med):
            fails.append(f"run {i}: {r['value']} disagrees with the runs' median {med:g} (+- one step / 15 %)")
    print(f"{label}: runs {values}, median {med:g}, spread {min(values)}-{max(values)}")
    return fails


def test_bench_sweep_auto_agrees_with_itself_and_an_independent_client(mlx_server: str, tmp_path: Path) -> None:
    t0 = time.monotonic()
    before, steps = closedloop.capacity(mlx_server, SLO_S, WORDS, MAX_TOKENS)
    print("independent:", [(s.streams, round(s.ttft_p95_s, 3)) for s in steps])
    runs = []
    for i in range(RUNS):
        r = _tool(
            [
                "bench", "--target", f"s={mlx_server}", "--sweep", "auto", "--slo", f"ttft_p95={SLO_S:g}s",
                "--prompt-tokens", str(PROMPT_TOKENS), "--max-tokens", str(MAX_TOKENS), "--step-time", "2",
                "--sweep-budget", "90",
            ],
            tmp_path / f"bench{i}.json",
        )  # fmt: skip
        after, steps = closedloop.capacity(mlx_server, SLO_S, WORDS, MAX_TOKENS, start=max(1, before - 1))
        print("independent:", [(s.streams, round(s.ttft_p95_s, 3)) for s in steps])
        runs.append({**r, "before": before, "after": after})
        before = after
    fails = _judge("bench", runs)
    print(f"bench tier: {time.monotonic() - t0:.0f} s")
    assert not fails, "\n".join(fails)


def _conversation() -> list[list[dict[str, str]]]:
    """A five-turn coding-agent conversation: a system prompt, then each turn adds the
    assistant's tool call and the tool's output (the messages of each turn)."""
    words = " ".join(f"rule{i}" for i in range(60))
    msgs = [
        {"role": "system", "content": f"You are a coding agent. Follow these rules: {words}"},
        {"role": "user", "content": "fix the failing test in the parser module"},
    ]
    turns = []
    for t in range(5):
        turns.append([dict(m) for m in msgs])
        output = " ".join(f"line{t}_{i}" for i in range(25))
        msgs += [
            {"role": "assistant", "content": f"running step {t}"},
            {"role": "user", "content": f"tool output {t}: {output}"},
        ]
    return turns


def _capture(path: Path, turns: list[list[dict[str, str]]]) -> Path:
    from support import captured_chat, write_capture

    chats = [
        captured_chat(f"t{i}", msgs, started_at=10.0 + i, offset_s=float(i), duration_s=0.5, max_tokens=MAX_TOKENS)
        for i, msgs in enumerate(turns)
    ]
    return write_capture(path, chats)


SESSION_SLO_S = 0.5
THINK_S = 0.2


def test_replay_sessions_sweep_auto_agrees_with_itself_and_an_independent_client(
    mlx_server: str, tmp_path: Path
) -> None:
    t0 = time.monotonic()
    turns = _conversation()
    cap = _capture(tmp_path / "agent.jsonl", turns)
    before, steps = closedloop.sessions_capacity(mlx_server, SESSION_SLO_S, turns, THINK_S, MAX_TOKENS)
    print("independent:", [(s.streams, round(s.ttft_p95_s, 3), s.judged) for s in steps])
    runs = []
    for i in range(RUNS):
        r = _tool(
            [
                "replay", str(cap), "--target", f"s={mlx_server}", "--mode", "sessions", "--sweep", "auto",
                "--slo", f"ttft_p95={SESSION_SLO_S:g}s", "--think-time", str(THINK_S), "--model", "default_model",
                "--sweep-budget", "90",
            ],
            tmp_path / f"replay{i}.json",
        )  # fmt: skip
        after, steps = closedloop.sessions_capacity(
            mlx_server, SESSION_SLO_S, turns, THINK_S, MAX_TOKENS, start=max(1, before - 1)
        )
        print("independent:", [(s.streams, round(s.ttft_p95_s, 3), s.judged) for s in steps])
        runs.append({**r, "before": before, "after": after})
        before = after
    fails = _judge("sessions", runs)
    print(f"sessions tier: {time.monotonic() - t0:.0f} s")
    assert not fails, "\n".join(fails)
