"""``mlxproxy replay --batch 2`` against a caching server measures prefill, not the cache.

The session's real ``mlx_lm.server`` keeps a prompt cache and reports
``usage.prompt_tokens_details.cached_tokens``. A capture of two requests is replayed
through the real CLI:

* by default every request sent carries its own nonce (the baseline, each wave, each
  repeat), so the waves are uncached (``cached_tokens`` at most the chat template's
  shared prefix) and the speedup lies within the spread of ``mlxproxy bench`` on the same
  server;
* with ``--no-nonce`` the captured bytes go out again, the server serves them from its
  cache, and ``replay`` says so in a warning (and ``--compare`` shows ``cached_tokens``).
  Before the fix, ``--nonce`` sent the baseline's bytes again in the waves: that is what
  the ``--no-nonce`` half shows the server then does.

Skipped, with the reason, where the mlx stack does not import.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

from mlxproxy.capture import capture_line, chat_record
from mlxproxy.core.record import Record
from mlxproxy.load.commands.bench import BenchOptions, bench_targets
from mlxproxy.load.data.targets import Target
from mlxproxy.load.output.report import aggregate_tps

from .peers import REPO, loopback_env, median, require_mlx
from .tinymodel import MODEL_NAME

pytestmark = pytest.mark.integration

require_mlx()

#: long replies (see test_proxy_mlx_lm.py: two 1000-token replies always share a batch)
MAX_TOKENS = 1000
PROMPT_WORDS = 30  # ~350 prompt tokens: prefill of many steps, and a cache that matters
REPEAT = 2
ROUNDS = 2
PROMPT_TOKENS = 350  # bench's prompt size: about the captured prompts' (checked in the output)
#: the replay's speedup vs the spread of bench's per-wave speedups: mlx_lm.server admits the
#: second request at once or at its next time budget, which moves a wave's speedup by
#: ~10-30% on a shared machine
SPREAD_MARGIN = 0.25


def _capture(path: Path) -> None:
    lines = []
    for i in range(2):
        text = f"question {i}: " + " ".join(f"item{j} fox jumps" for j in range(PROMPT_WORDS))
        rec = chat_record(f"cap{i}", started_at=1.0 + i, upstream="mlx-lm", model=MODEL_NAME)
        d = orjson.loads(capture_line(rec, None, t0_mono=0.0))
        d["path"] = "/v1/chat/completions"
        d["request"] = {
            "model": MODEL_NAME,
            "stream": True,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "messages": [{"role": "user", "content": text}],
        }
        lines.append(orjson.dumps(d))
    path.write_bytes(b"\n".join(lines) + b"\n")


def _replay(capture: Path, url: str, out: Path, *extra: str) -> tuple[dict[str, Any], str]:
    env = loopback_env(PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "mlxproxy",
            "replay",
            str(capture),
            "--target",
            f"mlx-lm={url}",
            "--batch",
            "2",
            "--repeat",
            str(REPEAT),
            "--json",
            str(out),
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    return orjson.loads(out.read_bytes()), res.stderr


def _groups(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {g["name"]: g for g in doc["groups"]}


def test_replay_batch_waves_are_uncached_and_match_bench(mlx_server: str, tmp_path: Path, record_property: Any) -> None:
    capture = tmp_path / "capture.jsonl"
    _capture(capture)

    # 1. --no-nonce: the same bytes again; the server's cache serves them, and replay says so
    doc, stderr = _replay(capture, mlx_server, tmp_path / "cached.json", "--no-nonce", "--compare")
    waves = _groups(doc)["batch 2"]["records"]
    cached_share = [r["cached_tokens"] / r["prompt_tokens"] for r in waves]
    assert all(r["outcome"] == "ok" for r in waves)
    assert median(cached_share) > 0.5, cached_share  # the premise: this server caches prompts
    assert "served mostly from the prompt cache" in stderr and "drop --no-nonce" in stderr
    assert (
        "cached_replayed"
        in subprocess.run(
            [sys.executable, "-m", "mlxproxy", "report", str(tmp_path / "cached.json")],
            capture_output=True,
            text=True,
            timeout=60,
            env=loopback_env(PYTHONPATH=str(REPO)),
        ).stdout
    )

    # 2. the default: a nonce per request sent, baseline and waves uncached; and 3. bench on
    #    the same server, same prompt size and reply length, rounds interleaved so a shared
    #    machine's load drifts over both alike
    replay_speedups: list[float] = []
    bench_speedups: list[float] = []
    for i in range(ROUNDS):
        for side in ("replay", "bench") if i % 2 == 0 else ("bench", "replay"):
            if side == "replay":
                doc, stderr = _replay(capture, mlx_server, tmp_path / f"fresh{i}.json")
                groups = _groups(doc)
                assert "served mostly from the prompt cache" not in stderr
                sent = groups["single"]["records"] + groups["batch 2"]["records"]
                assert len(sent) == 2 * 2 * REPEAT and all(r["outcome"] == "ok" for r in sent)
                for r in sent:  # at most the chat template's shared prefix before the nonce
                    assert r["cached_tokens"] is not None and r["cached_tokens"] <= 0.15 * r["prompt_tokens"], r
                replay_speedups += _wave_speedups(
                    groups["single"]["summary"]["wall_tps"]["p50"], groups["batch 2"]["records"]
                )
                prompt_tokens = int(median([r["prompt_tokens"] for r in sent]))
            else:
                opts = BenchOptions(
                    prompt_tokens=(PROMPT_TOKENS,), max_tokens=MAX_TOKENS, repeat=REPEAT, batch=2, model=MODEL_NAME
                )
                (res,) = asyncio.run(bench_targets([Target("mlx-lm", mlx_server, 300.0)], opts))
                assert res.error is None, res.error
                bg = {g.name: g for g in res.groups}
                for r in bg["double"].records:
                    assert (r.record.cached_tokens or 0) <= 0.15 * (r.record.prompt_tokens or 1), r
                bench_speedups += _wave_speedups(
                    bg["single"].summary.wall_tps.p50, [r.to_dict() for r in bg["double"].records]
                )
    lo, hi = min(bench_speedups), max(bench_speedups)
    replay_speedup = median(replay_speedups)
    print(
        f"\nreplay --batch 2 per-wave speedups {', '.join(f'{s:.2f}' for s in replay_speedups)}x (prompt {prompt_tokens} "
        f"tokens); bench {', '.join(f'{s:.2f}' for s in bench_speedups)}x; cached share without nonce p50 "
        f"{median(cached_share):.2f}"
    )
    record_property("replay_speedup_p50", round(replay_speedup, 3))
    record_property("bench_speedups", [round(s, 3) for s in bench_speedups])
    assert lo * (1 - SPREAD_MARGIN) <= replay_speedup <= hi * (1 + SPREAD_MARGIN), (replay_speedups, bench_speedups)


def _wave_speedups(single_wall_tps: float, records: list[dict[str, Any]]) -> list[float]:
    """Each wave's aggregate tok/s over one request alone (how the summaries' speedup is made)."""
    recs = [Record.from_dict(r) for r in records]
    return [aggregate_tps(recs[i : i + 2]) / single_wall_tps for i in range(0, len(recs), 2)]
