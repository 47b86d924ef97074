"""Prompt-prefix tracking against a real ``mlx_lm.server`` (issue 17, "Done when").

A 3-turn agent-style conversation through ``mlxproxy serve``: turn 2 resends turn 1 plus
the answer and a new message, turn 3 the same again with a changed system prompt. The proxy's
records (read back from ``/streams``) show the server's own ``cached_tokens`` next to
``prefix_reusable_tokens``; turn 2 is a hit, turn 3 names ``messages[0]`` as the place the
client changed. ``prefix_min_tokens`` is lowered to 200 so a few hundred prompt tokens
(fast on CPU) are enough to judge.

Skipped, with the reason, where the mlx stack does not import.
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from .peers import mlxproxy_serve, nonce_prompt, require_mlx
from .tinymodel import MODEL_NAME

pytestmark = pytest.mark.integration

require_mlx()


def _turn(proxy: Any, messages: list[dict[str, str]]) -> tuple[Any, str]:
    body = {
        "model": MODEL_NAME,
        "stream": True,
        "max_tokens": 8,
        "temperature": 0,
        "stream_options": {"include_usage": True},
        "messages": messages,
    }
    with proxy.http.stream("POST", proxy.url + "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        raw = b"".join(r.iter_bytes())
        rid = r.headers["x-mlxproxy-request-id"]
    text = ""
    for block in raw.split(b"\n\n"):
        if block.startswith(b"data: {"):
            obj = orjson.loads(block[6:])
            for ch in obj.get("choices") or []:
                text += (ch.get("delta") or {}).get("content") or ""
    return proxy.record(rid), text


def test_three_turns_show_cached_next_to_reusable_and_name_the_changed_system_prompt(
    mlx_server: str, record_property: Any
) -> None:
    system = nonce_prompt(40)  # ~460 tokens; the nonce keeps other tests' prompts out of the cache
    with mlxproxy_serve(mlx_server, {"detectors": {"prefix_min_tokens": 200}}) as proxy:
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": "List three colours."}]
        t1, a1 = _turn(proxy, msgs)
        msgs += [{"role": "assistant", "content": a1}, {"role": "user", "content": "And three more."}]
        t2, a2 = _turn(proxy, msgs)
        msgs += [{"role": "assistant", "content": a2}, {"role": "user", "content": "And three last ones."}]
        changed = [{"role": "system", "content": "Today is Monday. " + system}] + msgs[1:]
        t3, _ = _turn(proxy, changed)
    figures = [
        (
            r.turn,
            r.prompt_tokens,
            r.cached_tokens,
            r.prefix_reusable_tokens,
            r.cache_hit_ratio,
            r.prefix_diverged_at,
            list(r.anomalies),
        )
        for r in (t1, t2, t3)
    ]
    record_property("turns", figures)
    print("\n(turn, prompt, cached, reusable, hit ratio, diverged at, anomalies):", *figures, sep="\n  ")
    assert t1.prompt_tokens > 300 and (t1.turn, t2.turn, t3.turn) == (1, 2, 3)
    assert t1.conversation_id == t2.conversation_id == t3.conversation_id == t1.id
    # turn 2 extends turn 1: all of turn 1's prompt is reusable, and mlx_lm.server reused it
    # (and turn 1's answer: its own cached count is then the reusable figure)
    assert t2.prefix_diverged_at is None and t2.prefix_reusable_tokens >= t1.prompt_tokens
    assert t2.cached_tokens is not None and t2.cache_hit_ratio is not None and 0.9 <= t2.cache_hit_ratio <= 1.0
    assert not {"prefix_cache_miss", "prompt_prefix_changed"} & set(t2.anomalies), t2.anomaly_evidence
    # turn 3 changed the system prompt: the client's change is named, and the server could reuse ~nothing
    assert t3.prefix_diverged_at is not None and t3.prefix_diverged_at.startswith("messages[0].content")
    assert "prompt_prefix_changed" in t3.anomalies and "messages[0]" in t3.anomaly_evidence["prompt_prefix_changed"]
    assert t3.cached_tokens is not None and t3.cached_tokens < 0.2 * t2.prompt_tokens
    assert "prefix_cache_miss" not in t3.anomalies and t3.reprefill_cause == "system_changed"
