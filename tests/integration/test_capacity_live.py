"""Capacity a user can rerun, against a real ``mlx_lm.server`` on CPU (issue 37, "Done when").

Five runs of ``mlxproxy bench --sweep auto`` agree within one step or 15 % (the larger), and each
lies within the range an independent closed-loop client (``closedloop.py``: its own threads,
``http.client`` and statistics, each stream's first request dropped, >= 30 requests a step)
measures right before and right after it, widened by the same allowance; the same for
``mlxproxy replay --mode sessions --sweep auto`` on a captured five-turn agent conversation. The
machine is shared and busy: that noise is what the answers must hold against. Every run's figures
are printed (``-s`` shows them).

Lean on purpose (a small prompt cache-free workload, 32-token answers, ``--step-time 2``): the
tier's cost is printed at the end of each test (about 10 minutes for both).

Marked ``slow``, out of the default run: it costs about 10 minutes, over the 6 a CI tier may
take. Run it with ``python -m pytest -m slow -s tests/integration/test_capacity_live.py`` (its
record below: the whole runs, and where the tool and the client parted).

2026-12-07 (issue 37, f7217f4): the tool's closed-loop streams and a sessions step's
conversations each send from a thread of their own (docs/METRICS.md, "Why each stream has a
thread of its own"). Measured first at fixed concurrency against this server: on one event loop
a busy host delayed the streams' sends together, mlx_lm.server (a batch takes the requests queued
when it starts) left the late part of 19-40 % of the 7-stream waves a whole batch behind, and the
7-stream TTFT p95 was 0.40-0.53 s in 13 of 16 runs where this file's client measured 0.34-0.40 s;
with a thread per stream no wave split (0.34-0.36 s). Five whole runs since, the last two held
whole (the first three at load average 3-7, the lead's full suite and other helpers running, the
first with bench run 1 still on one event loop; the last two at 1.2-2.8): bench 8, 7, 7, 8, 8
(client 8-9), 8, 8, 8, 8, 8 (client 7-9), 6, 7, 8, 8, 8 (client 8-9: the 6 failed; its 7- and
8-stream steps each had one whole wave slow, 0.60-0.73 s, none split: the host's, in the minute
the client measured 0.38-0.48 s at 7), 8, 8, 8, 8, 8 (client 8-9) and 8, 8, 8, 8, 8 (client
8-9); sessions 9, 9, 10, 9, 9 (client 7-10: the 10 failed, client 8 and 8), 8, 7, 9, 9, 7
(client 7-10: the last 7 failed, client 10 and 9), 8, 8, 9, 10, 10 (client 7-10), 10, 10, 9,
10, 10 (client 10) and 10, 10, 10, 9, 10 (client 10). A sessions step above the server's
prompt concurrency (8) leaves K-8 first turns a whole batch (~1.1 s) behind, whoever sends
them: at 10 sessions two such of 50 turns keep the p95 under the SLO, three break it, so the
sessions answer moves between 8 and 10 with how the first turns' burst is admitted, for the tool
and this client alike (its own scans moved 7 -> 10 a minute apart).

2026-12-07, later (issue 37): a sessions step judges each conversation's turns after its first
(the first turns, whole prompts sent at once, reported apart), and this file's client drops
each conversation's first turn likewise; a closed-loop measurement that broke the SLO with a
whole wave slow is taken again; a turn's think time runs from the response's end. Before it, one
whole run at load average 1.4-5.3 held: bench 8, 8, 8, 8, 8 (client 8-9), sessions 10, 9, 10,
9, 10 (client 3-10: its 4-session step at 0.57 s, 10, 8-10, 8-9, 7-9). With the later-turn
judgment (not yet the think time; the first slow-wave rule), load 4-7 with this helper's unit
tests alongside: bench 9, 6, 8, 8, 8 (client 8-10, 8-10, 8, 8, 8-9: the 6 failed; its 7-stream
step's first look had every wave at 0.44-0.60 s, its 8-stream step's third three at 0.63-0.65 s
between waves of 0.38 s, where their other looks took 0.28-0.35 s), sessions 10, 10, 8, 9, 9
(client 10 in five scans of six, 8 in the last: the 8 failed). As now, load 2-4 with the unit
tests alongside for its first half: bench 8, 8, 8, 8, 8 (client 5-8, 8-9, 8-9, 8-9, 8-9),
sessions 7, 10, 10, 10, 10 (client 5-10, 10, 10, 10, 7-10: the 7 failed the runs' agreement; its
8-session step had one look of three with turns 3-4 at 0.49-0.65 s where the others took
0.20-0.33 s, and a step measured several times is judged on every look's requests together; the
client's scan just before answered 5, its 4-session step at 0.42 s). Two more whole runs as now:
at load 2-3, bench 8, 8, 8, 9, 9 (client 10, 8-10, 8, 8-9, 9: the first 8 failed against the
client's 10 and 10, its interval 8-9), sessions 10, 10, 10, 10, 10 (client 9-10); at load 0.5-2.5
with the unit tests alongside, held whole: bench 8, 9, 9, 8, 8 (client 8, 8, 8-10, 8-10, 8),
sessions 10, 10, 10, 10, 10 (client 7-10, 10, 10, 10, 9-10). On the later turns the
sessions answer is 10 with a margin on both sides (in the client's scans of these two runs, 10
sessions 0.33-0.47 s, 11 sessions 0.52-1.37 s), where the first turns' burst had put 9-10 on the
SLO's edge.

On the merged tree (b052f90), nothing else running but one CPU-bound process (a busy loop, load
average 1.4-2.7), one whole run held: bench 8, 8, 8, 8, 8 (intervals 8-9, the last 8-11 "not
refined; at 10, a whole wave was slow from its first token"; client 9-9, 9-10, 10-9, 9-8, 8-8),
sessions 10 x 5 (client 10 before and after each), 637 s.

2026-12-07, 06:47-08:22 UTC (issue 37): this file prints the tool's own retakes ("... measuring it
again"); a sessions look that broke the SLO beside a look that held, with a whole wave slower than
the same turns there, is taken again (7cc7921). Nine whole runs, load average 0.4-3.5 (the lead
and another helper working; this helper's unit tests alongside in the first and third): one before
the change held; eight on it held in six. Sessions held in all nine (10 in 44 of 45 runs, 9 once,
client 9-10 but a 4 once, a 6.9 s step of its own); the new retake fired once (at 11 sessions,
beside a look that held at 0.499 s; the retake broke, answer 10), the stall retake in most runs.
Both failures were bench runs answering 8 (interval 8-9, their 9-stream step at 0.50-0.51 s) where
the client said 10 before and after (runs 4 and 7, load 1.2-2.3). Over the 45 bench runs, the
client's scans and the tool's steps agree at 8 streams (TTFT p95 median 0.392 s / 0.388 s) and 9
(0.508 / 0.515 s); at 10 the client's held in 10 of 17 scans (median 0.492 s) and the tool's in
none of 31 (0.563-0.634 s), the client measuring 10 only after its 9 held.

Before (2026-12-06, one event loop, 2a0b409): one of three whole runs held: bench 8, 7, 7, 7, 7
(client 8-9), 8, 6, 8, 8, 7 (client 7-8: the 6 failed) and 7, 8, 8, 8, 8 (client 8-9); sessions
9, 8, 9, 9, 9 (client 10: the 8 failed), 9, 9, 9, 10, 9 (client 7-10) and 9, 9, 9, 9, 9 (client
10). Spreading the streams' starts over one TTFT (three whole runs, all failed; taken out again,
docs/METRICS.md "Why the streams start at once") made it worse: bench 3, 4, 4, 6, 8 / 5, 4, 8, 4,
8 / 7, 8, 4, 4, 5 against clients of 4-8.

2026-12-07, 09:44-09:56 UTC (issue 37): where the tool and the client part, at fixed concurrency
against one server started as here: ``mlxproxy bench --concurrency N`` with this file's options
and this file's client (3 requests judged a stream at 10) alternated back to back with the same
client judged on 5 and on 9 a stream, 7 rounds a series, load average 0.4-3.4. At 8 streams all
agree (TTFT p95 0.33-0.39 s). At 10: the client 0.47-0.69 s (median 0.50 and 0.49 in two series,
held in 8 of 14), on 5 a stream 0.56-0.70 s (0 of 14), on 9 a stream 0.61-0.63 s (0 of 7), the
tool 0.56-0.68 s (0 of 14); paired, tool - client +0.09 and +0.08 s, tool - client on 5 a stream
+0.02 and -0.03 s. At 9 (one series): the client 0.39-0.55 s (5 of 7), on 5 a stream 0.49-0.61 s
(2 of 7), on 9 a stream 0.51-0.56 s (0 of 7), the tool 0.46-0.53 s (5 of 7). Nothing in how the
tool sends moved it: its request body sent from the client's code read as the client (-0.02 s at
10) and the tool sending the client's model name as the tool; its generator took 0.6-1.1 ms more CPU
a request than the client (2.9-3.6 against 1.9-2.5 ms, on the client's core) while the server's
CPU a request was 1.9-2.6 ms lower under it (55-62 ms). The client's short step did: above the
server's prompt concurrency (8) the streams drift apart and end apart, and at 10 a median 17 %
(up to 37 %) of the client's judged requests were sent after the last moment all 10 streams were
in flight (TTFT p50 0.16 s, 0.36 s before it); judged on the requests before it, the client held
in 0 of 14. That tail was 4 % of the tool's requests, 8 % of the client's on 5 a stream. The
client now judges at least 5 requests a stream (``closedloop.MIN_PER_STREAM``). Two whole runs
on it, 09:58-10:20 UTC, load average 1.0-3.1 (others at work on the host), both held: bench 9,
9, 8, 9, 9 (client 8-8, 8-8, 8-9, 9-9, 9-8), sessions 10 x 5 (client 10), 597 s; bench 9, 8, 8, 8,
9 (client 8-9, 9-8, 8-8, 8-9, 9-8), sessions 10 x 5 (client 10), 612 s. The client's 10-stream
steps broke in all 4 of its scans that reached them (0.56-0.75 s); its 9-stream steps held in 4 of
12 (0.48-0.65 s), the tool's answer was 9 in 6 of 10 runs. A third whole run, on the merged
tree (ac0980f: the proxy's own transport, the load generator's client sharing its dialer),
10:43-10:53 UTC, load average 0.3 at its start and nothing else at work, held: bench 9, 9, 8, 8, 8 (client
8-9, 9-8, 8-9, 9-8, 8-8; run 5's interval 8-11: its 9- and 10-stream steps within the noise of
the SLO), sessions 10 x 5 (client 10), 605 s.
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
    for line in res.stderr.splitlines():  # the sweep's own retakes: whether one fired, and why
        if "measuring it again" in line:
            print("  tool:", line.split("mlxproxy: ", 1)[-1])
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


def _first(s: closedloop.Step) -> float | None:
    """A sessions step's first turns' TTFT p95 (not judged), rounded for the printout."""
    return None if s.first_turns_p95_s is None else round(s.first_turns_p95_s, 3)


SESSION_SLO_S = 0.5
THINK_S = 0.2


def test_replay_sessions_sweep_auto_agrees_with_itself_and_an_independent_client(
    mlx_server: str, tmp_path: Path
) -> None:
    t0 = time.monotonic()
    turns = _conversation()
    cap = _capture(tmp_path / "agent.jsonl", turns)
    before, steps = closedloop.sessions_capacity(mlx_server, SESSION_SLO_S, turns, THINK_S, MAX_TOKENS)
    print("independent:", [(s.streams, round(s.ttft_p95_s, 3), s.judged, _first(s)) for s in steps])
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
        print("independent:", [(s.streams, round(s.ttft_p95_s, 3), s.judged, _first(s)) for s in steps])
        runs.append({**r, "before": before, "after": after})
        before = after
    fails = _judge("sessions", runs)
    print(f"sessions tier: {time.monotonic() - t0:.0f} s")
    assert not fails, "\n".join(fails)
