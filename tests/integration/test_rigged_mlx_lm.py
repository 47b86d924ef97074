"""The rigged models (``rigged.py``) proven on the real ``mlx_lm.server``, through ``mlxproxy serve``.

Both builds (the ~40-token ``write_file`` call, and the short ``get_time`` call) answer as
rigged whatever the prompt: a structured tool call with the exact arguments, 16 words then EOS,
``<think>...</think>`` then the answer, the endless loop up to ``max_tokens``. Through the proxy
(the model's ``tokenizer.json`` configured, so the recounts run), mlx_lm.server raises no anomaly
on any of them: it counts the EOS of a natural stop (16 + 1 = ``max_tokens`` 17 is no cut) and
sends a whole tool call as one delta (no burst), and the recount sees the call's arguments.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from .peers import SERVER_CPUS, cpu_affinity, mlxproxy_serve, require_mlx
from .rigged import (
    LOOP,
    REASONING_ANSWER,
    REASONING_THOUGHT,
    SHORT_TOOL_ARGUMENTS,
    TOOL_ARGUMENTS,
    WORDS,
    WORDS_N,
    RiggedModel,
    build_rigged_model,
)
from .tinymodel import MODEL_NAME

pytestmark = pytest.mark.integration

require_mlx()

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": "A tool.",
            "parameters": {
                "type": "object",
                "properties": {k: {"type": "string"} for k in keys},
                "required": list(keys),
            },
        },
    }
    for name, keys in (("write_file", ("path", "content")), ("get_time", ("zone",)))
]


@pytest.fixture(scope="module", params=["long", "short"])
def rigged(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[RiggedModel, Any]]:
    """(the rigged model, a running proxy in front of mlx_lm.server serving it)."""
    from .tinymodel import mlx_lm_server

    rig = build_rigged_model(
        tmp_path_factory.mktemp(f"rig-{request.param}") / "model", short_tool_call=request.param == "short"
    )
    with contextlib.ExitStack() as stack:
        with cpu_affinity(SERVER_CPUS):
            url = stack.enter_context(mlx_lm_server(rig.path, max_tokens=64))
        px = stack.enter_context(mlxproxy_serve(url, {"tokenizer": str(Path(rig.path) / "tokenizer.json")}))
        yield rig, px


def chat(px: Any, **body: Any) -> tuple[dict[str, Any], list[dict[str, Any]], str]:
    """(the final object or the usage chunk, the stream's chunks, the proxy's request id)."""
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hello there."}], **body}
    with httpx.Client(trust_env=False, timeout=60.0) as http:
        r = http.post(px.url + "/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    rid = r.headers["x-mlxproxy-request-id"]
    if not body.get("stream"):
        return r.json(), [], rid
    chunks = [json.loads(ln[6:]) for ln in r.text.splitlines() if ln.startswith("data: {")]
    last = next((c for c in reversed(chunks) if c.get("usage")), {})
    return last, chunks, rid


def deltas(chunks: list[dict[str, Any]], key: str) -> str:
    return "".join((ch.get("delta") or {}).get(key) or "" for c in chunks for ch in c.get("choices") or [])


def no_anomalies(px: Any, rid: str) -> None:
    rec = px.record(rid)
    assert rec.outcome == "ok", rec
    assert rec.anomalies == (), rec.anomaly_evidence


@pytest.mark.parametrize("stream", [True, False])
def test_rigged_tool_call(rigged: tuple[RiggedModel, Any], stream: bool) -> None:
    rig, px = rigged
    args = TOOL_ARGUMENTS if "write_file" in rig.tool_call else SHORT_TOOL_ARGUMENTS
    name = "write_file" if "write_file" in rig.tool_call else "get_time"
    extra = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
    last, chunks, rid = chat(px, tools=TOOLS, **extra)
    if stream:
        calls = [
            tc
            for c in chunks
            for ch in c.get("choices") or []
            for tc in (ch.get("delta") or {}).get("tool_calls") or []
        ]
        finish = [ch["finish_reason"] for c in chunks for ch in c.get("choices") or [] if ch.get("finish_reason")]
    else:
        calls = last["choices"][0]["message"]["tool_calls"]
        finish = [last["choices"][0]["finish_reason"]]
    assert [c["function"]["name"] for c in calls] == [name]
    assert json.loads(calls[0]["function"]["arguments"]) == args
    assert finish == ["tool_calls"]
    assert last["usage"]["completion_tokens"] == rig.tool_tokens + 1  # the call, then EOS
    assert (rig.tool_tokens > 30) == (name == "write_file")  # ~40 tokens, or a short one
    no_anomalies(px, rid)


def test_rigged_natural_stop_at_max_tokens(rigged: tuple[RiggedModel, Any]) -> None:
    rig, px = rigged
    last, chunks, rid = chat(px, max_tokens=WORDS_N + 1, stream=True, stream_options={"include_usage": True})
    assert deltas(chunks, "content") == WORDS and rig.words_tokens == WORDS_N
    assert last["usage"]["completion_tokens"] == WORDS_N + 1  # mlx_lm.server counts the EOS
    no_anomalies(px, rid)


def test_rigged_reasoning(rigged: tuple[RiggedModel, Any]) -> None:
    _, px = rigged
    last, chunks, rid = chat(
        px,
        messages=[{"role": "user", "content": "Please think first."}],
        stream=True,
        stream_options={"include_usage": True},
    )
    assert deltas(chunks, "reasoning") == REASONING_THOUGHT
    assert deltas(chunks, "content") == REASONING_ANSWER
    no_anomalies(px, rid)


def test_rigged_loop_runs_to_max_tokens(rigged: tuple[RiggedModel, Any]) -> None:
    _, px = rigged
    last, chunks, rid = chat(
        px,
        messages=[{"role": "user", "content": "Count forever."}],
        max_tokens=30,
        stream=True,
        stream_options={"include_usage": True},
    )
    words = LOOP.split()
    assert deltas(chunks, "content").split() == (words * 3)[:30]
    assert last["usage"]["completion_tokens"] == 30
    assert px.record(rid).finish_reason == "length"
    no_anomalies(px, rid)
