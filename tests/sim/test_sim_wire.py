"""The simulator's pure layers: request rules, faults syntax, wire shapes against the fixtures, rendering."""

from __future__ import annotations

import json

import pytest

from mlxproxy.sim.engine import Arrival, Finish, Headers, Token, plan
from mlxproxy.sim.faults import MIDDLE, Faults, parse_faults
from mlxproxy.sim.profiles import PROFILES, WIRE_STYLES, coerce_knob, get_profile
from mlxproxy.sim.render import MALFORMED, Close, Renderer, Stall, Start, context_message
from mlxproxy.sim.request import RequestError, count_prompt_tokens, parse_request, plan_output
from mlxproxy.sim.styles import STYLES, style_class
from mlxproxy.sim.wire import WireContext


def chat_body(content: str = "hi", **extra: object) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": content}], **extra}


# -- request rules --------------------------------------------------------------------------


def test_prompt_token_rule() -> None:
    p = PROFILES["healthy"]
    assert count_prompt_tokens(0) == 1
    assert count_prompt_tokens(4) == 1
    assert count_prompt_tokens(5) == 2
    assert parse_request(chat_body("x" * 400), "chat", p).prompt_tokens == 100
    parts = {
        "model": "m",
        "messages": [
            {"role": "system", "content": "abcd"},
            {"role": "user", "content": [{"type": "text", "text": "efgh"}, {"type": "image_url"}]},
        ],
    }
    assert parse_request(parts, "chat", p).prompt_tokens == 2
    assert parse_request({"prompt": "x" * 41}, "completions", p).prompt_tokens == 11
    assert parse_request({"prompt": [1, 2, 3]}, "completions", p).prompt_tokens == 3
    assert parse_request(chat_body(), "chat", p, prompt_tokens_header="52000").prompt_tokens == 52000


def test_request_fields_and_errors() -> None:
    p = PROFILES["healthy"]
    req = parse_request(
        chat_body(stream=True, stream_options={"include_usage": True}, max_completion_tokens=7, seed=3), "chat", p
    )
    assert (req.stream, req.include_usage, req.max_tokens, req.seed) == (True, True, 7, 3)
    assert parse_request(chat_body(stream_options={}), "chat", p).stream_options_without_include_usage
    with pytest.raises(RequestError) as err:
        parse_request({"model": "m"}, "chat", p)
    assert err.value.missing_field == "messages"
    with pytest.raises(RequestError):
        parse_request(chat_body(max_tokens=0), "chat", p)
    with pytest.raises(RequestError):
        parse_request(chat_body(), "chat", p, prompt_tokens_header="many")


def test_output_plan_is_deterministic_and_follows_max_tokens() -> None:
    p = get_profile("vllm-mlx")
    req = parse_request(chat_body(max_tokens=20), "chat", p)
    a, b = plan_output(req, p, app_seed=1), plan_output(req, p, app_seed=1)
    assert a == b and a.n_visible == 20 and a.finish_reason == "length"
    assert a.n_reasoning == 18  # floor(0.9 * 20): a long reasoning stream, a short answer
    assert plan_output(req, p, app_seed=2).pieces != a.pieces
    seeded = parse_request(chat_body("other prompt", max_tokens=20, seed=5), "chat", p)
    assert (
        plan_output(seeded, p).pieces
        == plan_output(parse_request(chat_body(max_tokens=20, seed=5), "chat", p), p).pieces
    )
    default = plan_output(parse_request(chat_body(), "chat", p), p)
    assert default.n_visible == p.default_output_tokens and default.finish_reason == "stop"
    capped = plan_output(parse_request(chat_body(max_tokens=32000), "chat", p), p)
    assert capped.n_visible == p.max_output_tokens and capped.finish_reason == "stop"
    mean_chars = sum(len(x) for x in default.pieces) / default.n_visible
    assert mean_chars <= 4.0  # like real tokens: a chars/4 estimate never exceeds the pieces


def test_eos_is_counted_by_mlx_lm_only_on_stop() -> None:
    p = PROFILES["mlx-lm"]
    stop = plan_output(parse_request(chat_body(), "chat", p), p)
    assert stop.n_engine_tokens == stop.n_visible + 1
    length = plan_output(parse_request(chat_body(max_tokens=5), "chat", p), p)
    assert length.n_engine_tokens == 5


def test_profiles_validate_and_coerce() -> None:
    assert get_profile("healthy", decode_tps=10).decode_tps == 10.0
    with pytest.raises(ValueError, match="unknown profile"):
        get_profile("nope")
    with pytest.raises(ValueError, match="decode_tps"):
        get_profile("healthy", decode_tps=0)
    with pytest.raises(ValueError, match="unknown profile knob"):
        get_profile("healthy", bogus=1)
    assert coerce_knob("stall_every_tokens", "none") is None
    assert coerce_knob("serial", "yes") is True
    with pytest.raises(ValueError):
        coerce_knob("decode_tps", "fast")
    assert set(PROFILES) == {
        "healthy",
        "mlx-lm",
        "mlx-openai-server",  # today's release (1.8)
        "mlx-openai-server@1.6",  # the old one-at-a-time default
        "mlx-omni-server",
        "vllm-mlx",
        "rapid-mlx",
        "omlx",
        "mlx-vlm",
        "ollama",
        "lm-studio",
        "phantom-usage",
    }
    assert PROFILES["mlx-openai-server@1.6"].serial and not PROFILES["mlx-openai-server"].serial


# -- faults ---------------------------------------------------------------------------------


def test_fault_syntax() -> None:
    f = parse_faults("stall=2.5@3, malformed, http-error=503 ,reset-mid-stream@7")
    assert f == Faults(http_error=503, reset_at=7, malformed_at=MIDDLE, stall=(2.5, 3))
    assert parse_faults("") == Faults() and not parse_faults(None).any
    assert parse_faults("reset-before-headers").reset_before_headers
    assert Faults.at(MIDDLE, 10) == 5 and Faults.at(40, 10) == 9 and Faults.at(None, 10) is None
    for bad in ("explode", "http-error=200", "stall=abc", "stall=-1", "malformed@x"):
        with pytest.raises(ValueError):
            parse_faults(bad)


# -- wire shapes against the fixtures -------------------------------------------------------


def skeleton(obj: object) -> object:
    if isinstance(obj, dict):
        return {k: skeleton(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [skeleton(obj[0])] if obj else []
    return type(obj).__name__


def data_shapes(body: bytes) -> set[str]:
    return {
        json.dumps(skeleton(json.loads(block[6:]))) for block in body.split(b"\n\n") if block.startswith(b"data: {")
    }


def render(profile_name: str, body: dict, endpoint: str = "chat", faults: Faults = Faults(), **overrides: object):
    profile = get_profile(profile_name, **overrides)
    req = parse_request(body, endpoint, profile)
    out = plan_output(req, profile)
    cls = style_class(profile.wire)
    ctx = WireContext(
        cls.make_id("t", endpoint),
        "m",
        1767225600,
        endpoint,
        req.include_usage,
        req.stream and req.stream_options_without_include_usage,
    )
    renderer = Renderer(cls(ctx), profile, out, req.prompt_tokens, stream=req.stream, faults=faults, admitted_s=0.0)
    writes = list(renderer.before_admission())
    if not renderer.done:
        for ev in plan(profile, [Arrival("a", 0.0, req.prompt_tokens, out.n_engine_tokens)]):
            writes += renderer.on_event(ev)
    return writes, out


def body_of(writes) -> bytes:
    return b"".join(w for w in writes if isinstance(w, bytes))


@pytest.mark.parametrize(
    "profile_name, fixture, include_usage, overrides",
    [
        ("healthy", "wire/01_openai_reference_include_usage.sse", True, {}),
        ("mlx-lm", "real/mlx_lm_server_stream_usage.sse", True, {"reasoning_share": 0.0}),
        ("mlx-openai-server", "wire/03_mlx_openai_server.sse", False, {}),
        ("mlx-omni-server", "wire/05_mlx_omni_server_include_usage.sse", True, {}),
        ("vllm-mlx", "real/vllm_mlx_chat_stream_300tok.sse", True, {"reasoning_share": 0.0}),
        ("rapid-mlx", "real/rapid_mlx_chat_stream_usage.sse", True, {"reasoning_share": 0.0}),
        ("omlx", "wire/09_omlx_keepalive_usage_timings.sse", True, {}),
        ("mlx-vlm", "wire/13_mlx_vlm_nulls_dual_reasoning_timings.sse", True, {}),
    ],
)
def test_stream_shapes_match_the_fixtures(fixture_bytes, profile_name, fixture, include_usage, overrides) -> None:
    """Every chunk we send has the key order, null fields and value types of a chunk in the fixture."""
    body = chat_body(
        stream=True, max_tokens=6, **({"stream_options": {"include_usage": True}} if include_usage else {})
    )
    writes, _ = render(profile_name, body, **overrides)
    ours, theirs = data_shapes(body_of(writes)), data_shapes(fixture_bytes(fixture))
    assert ours <= theirs, sorted(ours - theirs)
    assert len(ours) >= min(len(theirs) - 1, 3)


def test_every_profile_wire_name_has_one_style() -> None:
    """The registry and the profiles' list of wire names agree, and each class answers to its name."""
    assert sorted(STYLES) == sorted(WIRE_STYLES)
    assert all(style_class(name).name == name for name in WIRE_STYLES)
    with pytest.raises(KeyError):
        style_class("no-such-server")


def test_json_spacing_per_style() -> None:
    body = chat_body(stream=True, max_tokens=3)
    for name in ("mlx-lm", "mlx-openai-server", "mlx-omni-server"):
        data = body_of(render(name, body)[0])
        assert b'"id": "' in data and b'"choices": [' in data
    for name in ("healthy", "vllm-mlx", "rapid-mlx", "omlx", "mlx-vlm"):
        data = body_of(render(name, body)[0])
        assert b'": ' not in data and b'", "' not in data


def test_mlx_lm_keepalive_progress_and_usage_chunk() -> None:
    writes, out = render("mlx-lm", chat_body("x" * 20480, stream=True, stream_options={"include_usage": True}))
    data = body_of(writes)
    assert data.startswith(b": keepalive 2048/5120\n\n: keepalive 4096/5120\n\n: keepalive 5120/5120\n\ndata: ")
    usage = json.loads(data.split(b"\n\n")[-3][6:])
    assert usage["object"] == "chat.completion" and usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == out.n_visible + 1  # the EOS
    assert b'"reasoning": ' in data and b"reasoning_content" not in data
    assert data.endswith(b"data: [DONE]\n\n")


def test_mlx_lm_stream_options_without_include_usage_truncates() -> None:
    writes, _ = render("mlx-lm", chat_body(stream=True, max_tokens=3, stream_options={}))
    assert isinstance(writes[-1], Close) and not writes[-1].reset
    assert b"[DONE]" not in body_of(writes)


def test_usage_placement_per_style() -> None:
    no_usage = chat_body(stream=True, max_tokens=4)
    for name in ("healthy", "mlx-lm", "mlx-omni-server", "rapid-mlx", "omlx", "mlx-vlm"):
        assert b'"usage": {' not in body_of(render(name, no_usage)[0]).replace(b'"usage":{', b'"usage": {'), name
    for name in ("mlx-openai-server", "vllm-mlx"):
        assert body_of(render(name, no_usage)[0]).replace(b'"usage":{', b'"usage": {').count(b'"usage": {') == 1, name
    twice = body_of(render("vllm-mlx", chat_body(stream=True, max_tokens=4, stream_options={"include_usage": True}))[0])
    assert twice.count(b'"usage":{') == 2
    omni = body_of(
        render("mlx-omni-server", chat_body(stream=True, max_tokens=4, stream_options={"include_usage": True}))[0]
    )
    assert omni.count(b'"finish_reason": "stop"') == 2


def test_mlx_openai_server_never_says_length() -> None:
    data = body_of(render("mlx-openai-server", chat_body(stream=True, max_tokens=4))[0])
    assert b'"finish_reason": "stop"' in data and b"length" not in data


def test_phantom_usage_reports_a_multiple() -> None:
    writes, out = render("phantom-usage", chat_body(stream=True, max_tokens=10, stream_options={"include_usage": True}))
    usage = json.loads(body_of(writes).split(b"\n\n")[-3][6:])["usage"]
    assert usage["completion_tokens"] == 4 * out.n_visible == 40


def test_burst_at_end_sends_everything_in_one_write() -> None:
    writes, out = render("rapid-mlx", chat_body(stream=True, max_tokens=8), burst_at_end=True)
    chunks = [w for w in writes if isinstance(w, bytes) and w]
    assert len(chunks) == 2  # the role chunk at the headers, then one burst
    assert chunks[1].count(b"data: ") == out.n_visible + 2  # tokens, finish, [DONE]


def test_context_limit_body_is_omlx_exact(fixture_bytes) -> None:
    writes, _ = render("omlx", chat_body("x" * (4 * 51587)))
    start, body = writes[0], writes[1]
    assert isinstance(start, Start) and start.status == 400
    expected = fixture_bytes("wire/10_omlx_context_400.http").split(b"\r\n\r\n", 1)[-1].split(b"\n\n", 1)[-1]
    assert body == expected.strip()
    assert context_message(51587, 32768) in body.decode()


def test_completions_stream() -> None:
    writes, out = render(
        "healthy", {"model": "m", "prompt": "hello", "stream": True, "max_tokens": 3}, endpoint="completions"
    )
    events = [json.loads(b[6:]) for b in body_of(writes).split(b"\n\n") if b.startswith(b"data: {")]
    assert all(e["object"] == "text_completion" for e in events)
    assert "".join(e["choices"][0]["text"] for e in events) == "".join(out.pieces)
    vllm = body_of(
        render("vllm-mlx", {"model": "m", "prompt": "hello", "stream": True, "max_tokens": 3}, endpoint="completions")[
            0
        ]
    )
    ids = {json.loads(b[6:])["id"] for b in vllm.split(b"\n\n") if b.startswith(b"data: {")}
    assert len(ids) >= 3  # a new id on every chunk


def test_nonstream_bodies() -> None:
    writes, out = render("vllm-mlx", chat_body(max_tokens=10))
    start, body = writes[0], writes[1]
    assert isinstance(start, Start) and (b"content-length", str(len(body)).encode()) in start.headers
    msg = json.loads(body)["choices"][0]["message"]
    assert msg["reasoning_content"] == out.reasoning_text and msg["content"] == out.content_text
    omlx, _ = render("omlx", chat_body(max_tokens=4))
    assert omlx[1] == b" " and json.loads(body_of(omlx))["usage"]["completion_tokens"] == 4


def test_faults_render_as_writes() -> None:
    body = chat_body(stream=True, max_tokens=6)
    writes, _ = render("healthy", body, faults=parse_faults("stall=1.5@2, malformed@3, reset-mid-stream@4"))
    assert Stall(1.5) in writes and MALFORMED in writes
    assert writes[-1] == Close(reset=True)
    assert body_of(writes).count(b'"content":"') == 1 + 4  # role chunk + tokens 0..3
    assert render("healthy", body, faults=parse_faults("reset-before-headers"))[0] == [Close(reset=True)]
    err, _ = render("mlx-openai-server", body, faults=parse_faults("http-error=503"))
    assert err[0].status == 503 and json.loads(err[1])["error"]["code"] == "503"


@pytest.mark.parametrize(
    "name, has_error_event, has_done, closes",
    [
        ("healthy", True, False, False),
        ("mlx-lm", False, False, True),
        ("mlx-openai-server", True, True, False),
        ("mlx-omni-server", False, False, True),
        ("vllm-mlx", False, True, False),
        ("omlx", True, True, False),
        ("mlx-vlm", True, False, False),
    ],
)
def test_stream_error_shape_per_style(name: str, has_error_event: bool, has_done: bool, closes: bool) -> None:
    writes, _ = render(name, chat_body(stream=True, max_tokens=6), faults=parse_faults("stream-error@2"))
    data = body_of(writes)
    assert (b'"error"' in data) == has_error_event
    assert (b"[DONE]" in data) == has_done
    assert isinstance(writes[-1], Close) == closes


def test_renderer_ignores_events_after_done() -> None:
    profile = PROFILES["healthy"]
    req = parse_request(chat_body(stream=True, max_tokens=2), "chat", profile)
    out = plan_output(req, profile)
    r = Renderer(
        style_class("openai")(WireContext("id", "m", 1)), profile, out, 1, stream=True, faults=Faults(), admitted_s=0
    )
    assert isinstance(r.on_event(Headers("a", 0.0))[0], Start)
    r.on_event(Token("a", 1.0, 0))
    r.on_event(Token("a", 2.0, 1))
    assert r.on_event(Finish("a", 2.0, 2)) and r.done
    assert r.on_event(Token("a", 3.0, 2)) == []
    assert r.usage().ttft_s == 1.0 and r.usage().decode_s == 1.0
