"""The `ollama` and `lm-studio` profiles write the shapes of the recordings in
tests/fixtures/native/ (built from each server's source and docs: README there): every JSON
object the simulator sends has the key order, fields and value types of one in the recording."""

from __future__ import annotations

import json

import orjson
import pytest

from mlxproxy.sim.engine import Arrival, plan
from mlxproxy.sim.faults import Faults
from mlxproxy.sim.profiles import get_profile
from mlxproxy.sim.render import Renderer, Start
from mlxproxy.sim.request import parse_request, plan_output
from mlxproxy.sim.styles import style_class
from mlxproxy.sim.wire import WireContext
from support import FIXTURES

NATIVE = FIXTURES / "native"


def skeleton(obj: object) -> object:
    if isinstance(obj, dict):
        return {k: skeleton(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [skeleton(obj[0])] if obj else []
    return "number" if isinstance(obj, (int, float)) and not isinstance(obj, bool) else type(obj).__name__


def shapes(body: bytes) -> set[str]:
    """The skeleton of every JSON object in an NDJSON body or in an event stream's data lines."""
    out = set()
    for line in body.splitlines():
        text = line[6:] if line.startswith(b"data: {") else line if line.startswith(b"{") else None
        if text:
            out.add(json.dumps(skeleton(json.loads(text))))
    return out


def render(profile_name: str, endpoint: str, body: dict, **knobs: object) -> tuple[list[object], bytes]:
    profile = get_profile(profile_name, **knobs)
    req = parse_request(body, endpoint, profile)
    out = plan_output(req, profile)
    cls = style_class(profile.wire)
    ctx = WireContext(cls.make_id("t", endpoint), "m", 1767225600, endpoint, req.include_usage)
    r = Renderer(cls(ctx), profile, out, req.prompt_tokens, stream=req.stream, faults=Faults(), admitted_s=0.0)
    if out.tool_name:
        r.style.tool_name = out.tool_name
    writes: list[object] = []
    for ev in plan(profile, [Arrival("a", 0.0, req.prompt_tokens, out.n_engine_tokens)]):
        writes += r.on_event(ev)
    return writes, b"".join(w for w in writes if isinstance(w, bytes))


MSGS = [{"role": "user", "content": "Why is the sky blue?"}]


@pytest.mark.parametrize(
    ("profile", "endpoint", "body", "fixture", "knobs"),
    [
        (
            "ollama",
            "ollama_chat",
            {"model": "m", "messages": MSGS},
            "ollama_chat_stream.ndjson",
            {"reasoning_share": 0.0},
        ),
        ("ollama", "ollama_chat", {"model": "m", "messages": MSGS, "think": True}, "ollama_chat_thinking.ndjson", {}),
        ("ollama", "ollama_generate", {"model": "m", "prompt": "Why?"}, "ollama_generate_stream.ndjson", {}),
        (
            "ollama",
            "chat",
            {"model": "m", "messages": MSGS, "stream": True, "stream_options": {"include_usage": True}},
            "ollama_openai_stream_timings.sse",
            {"reasoning_share": 0.0},
        ),
        (
            "ollama",
            "messages",
            {"model": "m", "max_tokens": 8, "messages": MSGS, "stream": True},
            "ollama_messages_stream.sse",
            {"reasoning_share": 0.0},
        ),
        (
            "lm-studio",
            "chat",
            {"model": "m", "messages": MSGS, "stream": True},
            "lmstudio_v0_chat_stream.sse",
            {"reasoning_share": 0.0},
        ),
        (
            "lm-studio",
            "lmstudio_chat",
            {"model": "m", "input": "Why?", "stream": True},
            "lmstudio_v1_chat_stream.sse",
            {},
        ),
    ],
)
def test_stream_shapes_match_the_recordings(profile: str, endpoint: str, body: dict, fixture: str, knobs: dict) -> None:
    writes, data = render(profile, endpoint, body, **knobs)
    start = next(w for w in writes if isinstance(w, Start))
    ctype = dict(start.headers)[b"content-type"]
    assert ctype.startswith(b"application/x-ndjson" if fixture.endswith(".ndjson") else b"text/event-stream")
    ours, theirs = shapes(data), shapes((NATIVE / fixture).read_bytes())
    assert ours <= theirs, sorted(ours - theirs)
    assert len(ours) >= min(len(theirs), 3)


def test_ollama_streams_by_default_and_answers_whole_when_asked_not_to() -> None:
    _, data = render("ollama", "ollama_chat", {"model": "m", "messages": MSGS, "options": {"num_predict": 5}})
    lines = [orjson.loads(x) for x in data.splitlines()]
    assert len(lines) == 6 and lines[-1]["done"] is True and lines[-1]["done_reason"] == "length"
    assert lines[-1]["eval_count"] == 5
    writes, data = render("ollama", "ollama_chat", {"model": "m", "messages": MSGS, "stream": False})
    obj = orjson.loads(data)
    assert obj["done"] is True and obj["message"]["content"] and obj["message"]["thinking"]


def test_ollama_tool_call_arrives_whole() -> None:
    tools = [
        {
            "type": "function",
            "function": {"name": "get_weather", "parameters": {"type": "object", "required": ["city"]}},
        }
    ]
    _, data = render("ollama", "ollama_chat", {"model": "m", "messages": MSGS, "tools": tools})
    lines = [orjson.loads(x) for x in data.splitlines()]
    (call_line,) = [ln for ln in lines if ln["message"].get("tool_calls")]
    assert call_line["message"]["tool_calls"][0]["function"] == {
        "index": 0,
        "name": "get_weather",
        "arguments": {"city": "x"},
    }
    assert lines[-1]["done_reason"] == "stop"


@pytest.mark.parametrize(("knob", "whole"), [("whole-prompt", True), ("", False)])
def test_the_speed_claims_knob(knob: str, whole: bool) -> None:
    """whole-prompt: Ollama's prompt count includes the cached tokens, its duration only the prefilled ones."""
    profile = get_profile("ollama", speed_claims=knob)
    req = parse_request({"model": "m", "messages": MSGS}, "ollama_chat", profile)
    out = plan_output(req, profile)
    ctx = WireContext("id", "m", 0, "ollama_chat")
    r = Renderer(style_class("ollama")(ctx), profile, out, 100, stream=True, faults=Faults(), admitted_s=0.0)
    r.cached_tokens = 90
    r.style.speed_claims = knob  # type: ignore[attr-defined]  # (the app sets it from the profile)
    data = b"".join(
        w
        for ev in plan(profile, [Arrival("a", 0.0, 10, out.n_engine_tokens)])
        for w in r.on_event(ev)
        if isinstance(w, bytes)
    )
    final = orjson.loads(data.splitlines()[-1])
    assert final["prompt_eval_cached_count"] == 90
    assert final["prompt_eval_count"] == (100 if whole else 10)
    assert final["prompt_eval_duration"] == pytest.approx(10 / profile.prefill_tps * 1e9, rel=0.01)
