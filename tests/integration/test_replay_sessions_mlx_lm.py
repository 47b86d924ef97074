"""Replayed agent sessions are separate conversations to the proxy's prefix tracker, against a
real ``mlx_lm.server`` (issue 27, "Done when").

``mlxproxy replay builtin:agent --sessions 2 --repeat 3 --think-time 1`` through ``mlxproxy
serve``: three runs of the bundled six-turn coding-agent conversation, two at a time. Each run
has its own nonce, which also marks its first user message (a conversation's key), so no run
is taken for the continuation of another: zero ``prompt_prefix_changed`` and zero
``prefix_cache_miss`` on this healthy, caching server, while every later turn of a run is
tracked as continuing its own conversation. Before the fix, the runs (which share their first
user message) were merged into one conversation up to "turn 13".

Skipped, with the reason, where the mlx stack does not import.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from mlxproxy.core.record import Record

from .peers import REPO, loopback_env, mlxproxy_serve, require_mlx, wait_for

pytestmark = pytest.mark.integration

require_mlx()

PREFIX_KINDS = {"prompt_prefix_changed", "prefix_cache_miss"}


def test_replayed_agent_sessions_raise_no_prefix_anomaly(mlx_server: str, tmp_path: Path) -> None:
    out = tmp_path / "sessions.json"
    with mlxproxy_serve(mlx_server) as proxy:
        res = subprocess.run(
            [
                sys.executable,
                "-m",
                "mlxproxy",
                "replay",
                "builtin:agent",
                "--target",
                f"p={proxy.url}",
                "--sessions",
                "2",
                "--repeat",
                "3",
                "--think-time",
                "1",
                "--json",
                str(out),
            ],  # fmt: skip
            capture_output=True,
            text=True,
            timeout=900,
            env=loopback_env(),
            stdin=subprocess.DEVNULL,
            cwd=REPO,
        )
        assert res.returncode == 0, res.stderr[-2000:]

        def finished() -> list[Record] | None:
            rs = proxy.records()
            return rs if len(rs) >= 18 else None

        records = wait_for(finished, 30.0)
    (g,) = orjson.loads(out.read_bytes())["groups"]
    assert g["summary"]["sessions"]["count"] == 3 and len(g["records"]) == 18
    assert all(r["outcome"] in ("ok", "ok_no_done") for r in g["records"]), [r["outcome"] for r in g["records"]]
    replayed = [r for r in records if r.path == "/v1/chat/completions"]
    assert len(replayed) == 18
    found = {k: [r.anomaly_evidence.get(k) for r in replayed if k in r.anomalies] for k in PREFIX_KINDS}
    assert found == {k: [] for k in PREFIX_KINDS}
    # each run's turns 2-6 continue that run, never another: 3 x 5 continuations
    continued = [r for r in replayed if r.prefix_reusable_tokens]
    assert len(continued) == 15, [(r.id, r.prefix_reusable_tokens) for r in replayed]
