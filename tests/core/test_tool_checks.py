"""Tool-call checks (issue 17, item 4): `tool_call_in_content`, `invalid_tool_arguments`,
`tool_call_finish_mismatch`. Real recordings (LiteLLM relaying a scripted upstream, and
the real OpenCode request with 10 tools), fed whole, byte by byte and at random cuts, with
scripted timestamps; broken variants are the same recordings with one thing changed."""

from __future__ import annotations

import orjson
import pytest

from mlxproxy.core.analyze import finish_checked
from mlxproxy.core.detect import ANOMALY_KINDS, Thresholds
from mlxproxy.core.meter import RequestMeter
from mlxproxy.core.openai import parse_request
from mlxproxy.core.record import Record
from mlxproxy.core.tools import MAX_ARGUMENT_CHARS, ToolSpec, call_problem, find_markup, parse_tools
from support import FIXTURES, read_fixture, splits

TH = Thresholds()
TOOL_KINDS = {"tool_call_in_content", "invalid_tool_arguments", "tool_call_finish_mismatch"}


def recorded_request(name: str) -> bytes:
    return orjson.dumps(orjson.loads((FIXTURES / "real2" / name).read_bytes())["body"])


WEATHER_REQ = recorded_request("chat_litellm_tool_calls.request.json")
PLAIN_REQ = b'{"model":"m","stream":true,"stream_options":{"include_usage":true}}'


def opencode_request() -> bytes:
    raw = read_fixture("clients/opencode_1.18.33_main_with_tools.req")
    return raw.split(b"\r\n\r\n", 1)[1] if b"\r\n\r\n" in raw else raw.split(b"\n\n", 1)[1]


def run(
    req: bytes,
    parts: list[bytes],
    *,
    path: str = "/v1/chat/completions",
    ctype: str = "text/event-stream",
    status: int = 200,
) -> tuple[RequestMeter, Record]:
    info, _ = parse_request("POST", path, req)
    m = RequestMeter(info, request_id="r", upstream="u", t_start=0.0, started_at=0.0)
    m.response_started(0.01, status, ctype)
    t = 0.1
    for p in parts:
        m.feed(p, t)
        t += 0.01
    return m, finish_checked(m, t, TH)


def all_ways(req: bytes, body: bytes, **kw) -> list[Record]:
    return [run(req, parts, **kw)[1] for parts in splits(body)]


def sse(*objs) -> bytes:
    return b"".join(b"data: " + orjson.dumps(o) + b"\n\n" for o in objs) + b"data: [DONE]\n\n"


def call_chunks(name: str, args: list[str], finish: str = "tool_calls") -> bytes:
    first = {
        "choices": [
            {
                "index": 0,
                "delta": {
                    "tool_calls": [
                        {"index": 0, "id": "call_1", "type": "function", "function": {"name": name, "arguments": ""}}
                    ]
                },
            }
        ]
    }
    rest = [
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": a}}]}}]} for a in args
    ]
    fin = {"choices": [{"index": 0, "delta": {}, "finish_reason": finish}]}
    usage = {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 12, "total_tokens": 21}}
    return sse(first, *rest, fin, usage)


def test_anomaly_kinds_are_precreated() -> None:
    assert TOOL_KINDS <= set(ANOMALY_KINDS)


def test_request_tools_parsed_in_all_three_shapes() -> None:
    chat = {"tools": [{"type": "function", "function": {"name": "a", "parameters": {"required": ["x"]}}}]}
    resp = {"tools": [{"type": "function", "name": "b", "parameters": {"required": ["y", 3]}}]}
    anth = {"tools": [{"name": "c", "input_schema": {"type": "object", "required": ["z"]}}]}
    assert parse_tools(chat) == (ToolSpec("a", ("x",)),)
    assert parse_tools(resp) == (ToolSpec("b", ("y",)),)
    assert parse_tools(anth) == (ToolSpec("c", ("z",)),)
    assert parse_tools({"tools": []}) is None and parse_tools({}) is None
    info, _ = parse_request("POST", "/v1/chat/completions", opencode_request())
    assert info.tools is not None and len(info.tools) == 10
    assert ToolSpec("bash", ("command",)) in info.tools


def test_tools_read_once_per_list_give_each_list_its_own_specs() -> None:
    """The latest tools list is read once (an agent declares the same tools every turn); an equal
    list gives the same specs, and a list that differs anywhere that is read gives its own, also
    right after an equal one and with the key order changed."""
    import copy

    def body(name: str, required: list[object]) -> dict[str, object]:
        params = {"type": "object", "properties": {"x": {"minimum": 1}}, "required": required}
        return {"tools": [{"type": "function", "function": {"name": name, "parameters": params}}]}

    first = body("a", ["x"])
    assert parse_tools(first) == (ToolSpec("a", ("x",)),)
    assert parse_tools(copy.deepcopy(first)) == (ToolSpec("a", ("x",)),)  # equal: the specs read before
    assert parse_tools(body("b", ["x"])) == (ToolSpec("b", ("x",)),)  # another name
    assert parse_tools(body("b", ["x", "y"])) == (ToolSpec("b", ("x", "y")),)  # another required key
    assert parse_tools(body("b", [1])) == (ToolSpec("b", ()),)  # `[1] == [True]`: neither is a name
    assert parse_tools(body("b", [True])) == (ToolSpec("b", ()),)
    reordered = {"tools": [{"function": {"parameters": {"required": ["z"]}, "name": "b"}, "type": "function"}]}
    assert parse_tools(reordered) == (ToolSpec("b", ("z",)),)
    assert parse_tools({"tools": [{"name": "c", "input_schema": {"required": ["z"]}}]}) == (ToolSpec("c", ("z",)),)
    assert parse_tools(first) == (ToolSpec("a", ("x",)),)


def test_structured_call_recording_is_silent_and_valid() -> None:
    for r in all_ways(WEATHER_REQ, read_fixture("real2/chat_litellm_tool_calls.sse")):
        assert r.outcome == "ok" and r.tool_calls == 1 and r.tool_calls_valid == 1
        assert not TOOL_KINDS & set(r.anomalies), r.anomaly_evidence


def test_markup_in_content_recording_fires_tool_call_in_content() -> None:
    for r in all_ways(WEATHER_REQ, read_fixture("real2/chat_litellm_toolmarkup_in_content.sse")):
        assert r.tool_calls == 0 and r.tool_calls_valid == 0 and r.finish_reason == "stop"
        assert "tool_call_in_content" in r.anomalies
        assert "<tool_call>" in r.anomaly_evidence["tool_call_in_content"]
        assert "invalid_tool_arguments" not in r.anomalies and "tool_call_finish_mismatch" not in r.anomalies


def test_the_same_markup_without_tools_offered_is_not_judged() -> None:
    _, r = run(PLAIN_REQ, [read_fixture("real2/chat_litellm_toolmarkup_in_content.sse")])
    assert r.tool_calls_valid is None and not TOOL_KINDS & set(r.anomalies)


def test_broken_json_arguments_fire_invalid_tool_arguments() -> None:
    body = read_fixture("real2/chat_litellm_tool_calls.sse").replace(b'"arguments":"\\"}"', b'"arguments":"\\""')
    assert body != read_fixture("real2/chat_litellm_tool_calls.sse")
    for r in all_ways(WEATHER_REQ, body):
        assert r.tool_calls == 1 and r.tool_calls_valid == 0
        assert "invalid_tool_arguments" in r.anomalies
        assert "not valid JSON" in r.anomaly_evidence["invalid_tool_arguments"]


def test_missing_required_and_undeclared_name_fire_invalid_tool_arguments() -> None:
    _, r = run(WEATHER_REQ, [call_chunks("get_weather", ['{"town":', ' "Paris"}'])])
    assert "invalid_tool_arguments" in r.anomalies and "'city'" in r.anomaly_evidence["invalid_tool_arguments"]
    _, r = run(WEATHER_REQ, [call_chunks("get_wether", ['{"city": "Paris"}'])])
    assert "invalid_tool_arguments" in r.anomalies and "did not declare" in r.anomaly_evidence["invalid_tool_arguments"]
    assert r.tool_calls_valid == 0


def test_finish_stop_with_a_call_fires_finish_mismatch() -> None:
    body = read_fixture("real2/chat_litellm_tool_calls.sse").replace(
        b'"finish_reason":"tool_calls"', b'"finish_reason":"stop"'
    )
    assert b'"finish_reason":"stop"' in body
    for r in all_ways(WEATHER_REQ, body):
        assert r.tool_calls_valid == 1 and "tool_call_finish_mismatch" in r.anomalies
        assert "'stop'" in r.anomaly_evidence["tool_call_finish_mismatch"]
    # the reverse: finish tool_calls with no call at all
    _, r = run(
        WEATHER_REQ,
        [
            sse(
                {"choices": [{"index": 0, "delta": {"content": "Sure."}}]},
                {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
            )
        ],
    )
    assert (
        "tool_call_finish_mismatch" in r.anomalies
        and "no structured" in r.anomaly_evidence["tool_call_finish_mismatch"]
    )


def test_a_call_cut_by_the_token_limit_is_not_a_finish_mismatch() -> None:
    _, r = run(WEATHER_REQ, [call_chunks("get_weather", ['{"city": "Pa'], finish="length")])
    assert "tool_call_finish_mismatch" not in r.anomalies and "invalid_tool_arguments" in r.anomalies


def test_opencode_request_with_ten_tools_and_correct_calls_is_silent() -> None:
    req = opencode_request()
    two = sse(
        {"choices": [{"index": 0, "delta": {"content": "Let me look."}}]},
        {
            "choices": [
                {
                    "index": 0,
                    "delta": {
                        "tool_calls": [
                            {"index": 0, "id": "c1", "type": "function", "function": {"name": "read", "arguments": ""}}
                        ]
                    },
                }
            ]
        },
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"filePath":'}}]}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": ' "/a.py"}'}}]}}]},
        {
            "choices": [
                {
                    "index": 0,
                    "delta": {
                        "tool_calls": [
                            {
                                "index": 1,
                                "id": "c2",
                                "type": "function",
                                "function": {"name": "bash", "arguments": '{"command": "ls", "description": "list"}'},
                            }
                        ]
                    },
                }
            ]
        },
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
        {"choices": [], "usage": {"prompt_tokens": 9000, "completion_tokens": 30, "total_tokens": 9030}},
    )
    for r in all_ways(req, two):
        assert r.tool_calls == 2 and r.tool_calls_valid == 2
        assert not TOOL_KINDS & set(r.anomalies), r.anomaly_evidence
    # plain prose about the tools (their names in backticks) is no markup
    prose = sse(
        {"choices": [{"index": 0, "delta": {"content": 'I would use `bash` or `read` with {"a": 1}.'}}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
    )
    _, r = run(req, [prose])
    assert r.tool_calls_valid == 0 and not TOOL_KINDS & set(r.anomalies), r.anomaly_evidence


@pytest.mark.parametrize(
    "text,label",
    [
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', "Hermes"),
        (
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>",
            "Hermes",
        ),
        ("<function=get_weather>\n<parameter=city>Paris</parameter></function>", "<function=NAME>"),
        ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}', "python_tag"),
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]', "Mistral"),
        ('{"name": "get_weather", "parameters": {"city": "Paris"}}', "JSON object naming"),
        ('Calling now: {"name": "get_weather", "arguments": {"city": "Paris"}}', "JSON object naming"),
    ],
)
def test_markups_found(text: str, label: str) -> None:
    found = find_markup(text, (ToolSpec("get_weather", ("city",)),))
    assert found is not None and label in found


@pytest.mark.parametrize(
    "text",
    [
        "The weather in Paris is sunny.",
        '{"name": "Alice", "arguments": {"x": 1}}',  # a JSON object, but not naming a declared tool
        "Use the get_weather tool with a city argument.",
    ],
)
def test_no_markup_in_ordinary_answers(text: str) -> None:
    assert find_markup(text, (ToolSpec("get_weather", ("city",)),)) is None


def test_markup_from_the_responses_and_chat_recordings_also_found_in_its_function_style() -> None:
    spec = (ToolSpec("get_weather", ("city",)),)
    assert call_problem(spec, "get_weather", "") is not None  # {} lacks the required city
    assert call_problem((ToolSpec("now"),), "now", "") is None  # no parameters: empty arguments are {}
    assert call_problem(spec, "get_weather", '["Paris"]') is not None


def test_huge_arguments_are_bounded_and_not_judged() -> None:
    big = '{"city": "' + "x" * (MAX_ARGUMENT_CHARS + 1000)
    parts = [call_chunks("get_weather", [big[i : i + 50_000] for i in range(0, len(big), 50_000)])]
    m, r = run(WEATHER_REQ, parts)
    assert r.tool_calls_valid == 1 and "invalid_tool_arguments" not in r.anomalies
    info, _ = parse_request("POST", "/v1/chat/completions", WEATHER_REQ)
    m = RequestMeter(info, request_id="r", upstream="u", t_start=0.0, started_at=0.0)
    m.response_started(0.01, 200, "text/event-stream")
    m.feed(parts[0], 0.1)
    kept: list[str] = []
    measured = m.finish(0.2, count_tokens=lambda text: kept.append(text) or 1)
    assert kept == ["get_weather" + big[:MAX_ARGUMENT_CHARS]]  # the arguments are kept up to the bound
    assert measured.generated_chars == len("get_weather") + len(big)  # the usage check still sees every character


def test_nonstream_chat_with_tool_calls_is_checked() -> None:
    body = orjson.dumps(
        {
            "choices": [
                {
                    "index": 0,
                    "finish_reason": "stop",
                    "message": {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{"}}
                        ],
                    },
                }
            ],
            "usage": {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10},
        }
    )
    _, r = run(WEATHER_REQ.replace(b'"stream":true', b'"stream":false'), [body], ctype="application/json")
    assert {"invalid_tool_arguments", "tool_call_finish_mismatch"} <= set(r.anomalies)


def test_tool_call_metric_by_outcome_and_anomaly_counters() -> None:
    from prometheus_client import CollectorRegistry

    from mlxproxy.proxy.metrics import ProxyMetrics

    reg = CollectorRegistry()
    pm = ProxyMetrics(reg)
    pm.request_started("u", "scripted-tools")
    _, good = run(WEATHER_REQ, [read_fixture("real2/chat_litellm_tool_calls.sse")])
    _, bad = run(WEATHER_REQ, [call_chunks("get_weather", ['{"city":'])])
    _, plain = run(PLAIN_REQ, [call_chunks("get_weather", ['{"city":'])])  # no tools offered: not judged
    for r in (good, bad, plain):
        pm.on_record(r)
    lab = {"upstream": "u", "model": "scripted-tools"}
    assert reg.get_sample_value("mlxproxy_tool_calls_total", {**lab, "outcome": "valid"}) == 1
    assert reg.get_sample_value("mlxproxy_tool_calls_total", {**lab, "outcome": "invalid"}) == 1
    assert reg.get_sample_value("mlxproxy_anomalies_total", {**lab, "kind": "invalid_tool_arguments"}) == 1
    assert reg.get_sample_value("mlxproxy_anomalies_total", {**lab, "kind": "tool_call_in_content"}) == 0


# -- the simulator's tool-call styles, through the proxy ------------------------------------


@pytest.mark.parametrize(
    "style,fires",
    [
        ("structured", set()),
        ("markup", {"tool_call_in_content"}),
        ("invalid-json", {"invalid_tool_arguments"}),
    ],
)
def test_simulator_tool_call_styles_through_the_proxy(style: str, fires: set) -> None:
    import httpx

    from mlxproxy.config import build_config
    from mlxproxy.edge.runner import ServerThread
    from mlxproxy.proxy.app import create_app
    from mlxproxy.sim.app import create_app as create_sim
    from support import wait_for

    with ServerThread(create_sim("healthy", speed=50, tool_call_style=style)) as sim:
        app = create_app(build_config(None, upstream_url=sim.url, log_requests=False))
        with ServerThread(app) as proxy, httpx.Client(timeout=30) as c:
            recs = []
            for req in (opencode_request(), WEATHER_REQ):
                with c.stream(
                    "POST",
                    proxy.url + "/v1/chat/completions",
                    content=req,
                    headers={"content-type": "application/json"},
                ) as r:
                    b"".join(r.iter_bytes())
                    rid = r.headers["x-mlxproxy-request-id"]
                assert wait_for(lambda: any(x.id == rid for x in app.recent.records))  # noqa: B023
                recs.append(next(x for x in app.recent.records if x.id == rid))
    for r in recs:
        assert r.outcome == "ok" and set(r.anomalies) == fires, r.anomaly_evidence
        assert r.tool_calls == (0 if style == "markup" else 1)
        assert r.tool_calls_valid == (1 if style == "structured" else 0)
        assert r.finish_reason == ("stop" if style == "markup" else "tool_calls")
