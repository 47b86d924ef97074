"""Client naming and side requests (core/clients.py) on the real requests of each CLI."""

from __future__ import annotations

import orjson
import pytest

from mlxproxy.core.clients import SIDE_REQUESTS, ClientInfo, classify, client_name
from support import FIXTURES


def _request(name: str) -> tuple[list[tuple[bytes, bytes]], str, str, dict[str, object] | None]:
    """A recorded request's headers (lower-cased names, as ASGI gives them), method, path
    (without its query, as the proxy sees it) and parsed body."""
    head, _, body = (FIXTURES / "clients" / f"{name}.req").read_bytes().partition(b"\r\n\r\n")
    first, *lines = head.split(b"\r\n")
    method, target, _ = first.decode().split(" ")
    headers = [(k.strip().lower(), v.strip()) for k, _, v in (line.partition(b":") for line in lines)]
    obj = orjson.loads(body) if body.strip() else None
    return headers, method, target.split("?", 1)[0], obj


@pytest.mark.parametrize(
    ("name", "client", "side"),
    [
        ("claude_code_2.1.332_messages", "Claude Code 2.1.332", None),
        ("codex_0.171.0_responses", "Codex 0.171.0", None),
        ("opencode_1.18.33_main_with_tools", "OpenCode 1.18.33", None),
        ("opencode_1.18.33_title", "OpenCode 1.18.33", "title"),
        ("aider_0.86.2_chat", "Aider", None),
        ("openai_python_sdk_stream", "OpenAI Python SDK 3.57.0", None),
        ("qwen-code_0.24.4_chat", "Qwen Code 0.24.4", None),
        ("qwen-code_0.24.4_memory", "Qwen Code 0.24.4", "memory"),
        ("llm_0.36_chat", "OpenAI Python SDK 3.63.0", None),  # LLM: the SDK's headers, nothing of its own
    ],
)
def test_real_requests_named(name: str, client: str, side: str | None) -> None:
    """Each CLI's real request bytes name it; OpenCode's title request and Qwen Code's memory
    extraction subagent are side requests; Aider, which sends the OpenAI SDK's headers unchanged,
    is named from its fixed prompts."""
    headers, method, path, obj = _request(name)
    assert classify(headers, method, path, obj) == ClientInfo(client, side)  # type: ignore[arg-type]


def test_claude_code_side_requests() -> None:
    """Claude Code's count_tokens, its `HEAD /api/hello` probe and its one-token quota check
    are side requests, with the same client name as its turns."""
    headers, _, _, obj = _request("claude_code_2.1.332_messages")
    assert classify(headers, "POST", "/v1/messages/count_tokens", obj) == ("Claude Code 2.1.332", "count_tokens")
    assert classify(headers, "HEAD", "/api/hello", None) == ("Claude Code 2.1.332", "probe")
    quota = {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "quota"}]}
    assert classify(headers, "POST", "/v1/messages", quota) == ("Claude Code 2.1.332", "quota")
    # a one-token request that is not the quota check stays a turn
    hi = {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    assert classify(headers, "POST", "/v1/messages", hi).side is None


def test_aider_side_requests() -> None:
    headers, _, path, _ = _request("aider_0.86.2_chat")
    summary = {
        "messages": [
            {"role": "system", "content": "*Briefly* summarize this partial conversation about programming.\n..."},
            {"role": "user", "content": "# USER\nhi"},
        ]
    }
    commit = {
        "messages": [
            {
                "role": "system",
                "content": "You are an expert software engineer that generates concise, "
                "one-line Git commit messages based on the provided diffs.",
            },
            {"role": "user", "content": "diff --git a/x b/x"},
        ]
    }
    assert classify(headers, "POST", path, summary) == ("Aider", "summary")
    assert classify(headers, "POST", path, commit) == ("Aider", "commit_message")


@pytest.mark.parametrize(
    ("ua", "name"),
    [
        ("claude-cli/2.1.332 (external, sdk-cli)", "Claude Code 2.1.332"),
        ("codex_exec/0.171.0 (Debian 12.0.0; x86_64) xterm (codex_exec; 0.171.0)", "Codex 0.171.0"),
        ("codex_cli_rs/0.50.0 (Mac OS 15.1.0; arm64)", "Codex 0.50.0"),
        ("opencode/1.18.33 ai-sdk/provider-utils/4.0.23 runtime/bun/1.3.14", "OpenCode 1.18.33"),
        ("OpenAI/Python 2.20.0", "OpenAI Python SDK 2.20.0"),
        ("OpenAI/JS 5.1.0", "OpenAI JS SDK 5.1.0"),
        ("Anthropic/Python 0.70.0", "Anthropic Python SDK 0.70.0"),
        ("curl/8.5.0", "curl 8.5.0"),
        ("python-requests/2.32.3", "python-requests 2.32.3"),
        ("SomeAgent", "SomeAgent"),
        ("", None),
        ("   ", None),
    ],
)
def test_user_agents(ua: str, name: str | None) -> None:
    assert client_name(ua) == name


def test_no_headers_no_body() -> None:
    """No User-Agent: no name; a body that is not an object, or odd shapes, never raise."""
    assert classify([], "POST", "/v1/chat/completions", None) == ClientInfo()
    assert classify([(b"user-agent", b"x/1")], "POST", "/v1/chat/completions", {"messages": 3}) == ("x 1", None)
    odd = {"messages": [1, None, {"role": "user", "content": [{"type": "image"}]}], "input": 5, "system": {}}
    assert classify([], "POST", "/v1/messages", odd) == ClientInfo()
    assert classify([], "GET", "/v1/models", None).side == "probe"
    assert classify([], "POST", "/v1/responses", {"input": "Generate a title"}).side is None
    assert set(SIDE_REQUESTS) >= {"title", "count_tokens", "probe", "quota"}


def test_a_side_request_takes_no_turn() -> None:
    """Through the shared finishing path: OpenCode's title request between two turns of its
    conversation is named and marked, gets no conversation fields, and the next turn is turn 2
    of the conversation (the title request neither linked nor remembered)."""
    from mlxproxy.core.analyze import finish_checked
    from mlxproxy.core.cachecheck import PrefixIndex
    from mlxproxy.core.detect import Thresholds
    from mlxproxy.core.meter import RequestMeter
    from mlxproxy.core.openai import parse_request

    index = PrefixIndex()
    main_headers, method, path, main = _request("opencode_1.18.33_main_with_tools")
    title_headers, _, _, title = _request("opencode_1.18.33_title")
    assert main is not None and title is not None
    later = {
        **main,
        "messages": [*main["messages"], {"role": "assistant", "content": "hi"}, {"role": "user", "content": "go on"}],
    }  # type: ignore[list-item]

    def finish(rid: str, headers: list[tuple[bytes, bytes]], body: dict[str, object]):  # type: ignore[no-untyped-def]
        info, _ = parse_request(method, path, orjson.dumps(body))
        m = RequestMeter(info, request_id=rid, upstream="u", t_start=0.0, started_at=0.0)
        m.response_started(0.01, 200, "text/event-stream")
        m.feed(b'data: {"choices":[{"delta":{"content":"ok"},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n', 0.2)
        return finish_checked(
            m, 0.3, Thresholds(), prefixes=index, client=classify(headers, method, path, info.prompt_obj)
        )

    first = finish("a", main_headers, main)
    side = finish("t", title_headers, title)
    second = finish("b", main_headers, later)
    assert (first.client, first.side_request, first.conversation_id, first.turn) == ("OpenCode 1.18.33", None, "a", 1)
    assert (side.client, side.side_request, side.conversation_id, side.turn) == (
        "OpenCode 1.18.33",
        "title",
        None,
        None,
    )
    assert (second.conversation_id, second.turn) == ("a", 2)
    assert len(index) == 1
    assert second.to_dict()["client"] == "OpenCode 1.18.33" and side.to_dict()["side_request"] == "title"


def test_qwen_code_memory_subagent_is_no_turn() -> None:
    """Qwen Code 0.24.4 sends, after each turn, its memory extraction subagent: the turn's
    history again under another system prompt and tools (real bytes, recorded on mlx_lm.server).
    Main's core linked it as turn 2 of the conversation with a bogus `tools_changed`; the
    conversation rule now keeps another agent's prompt apart (a one-turn conversation of its
    own), and marked `memory` it is no conversation at all: no id, no turn."""
    from mlxproxy.core.analyze import finish_checked
    from mlxproxy.core.cachecheck import PrefixIndex
    from mlxproxy.core.clients import NO_CLIENT
    from mlxproxy.core.detect import Thresholds
    from mlxproxy.core.meter import RequestMeter
    from mlxproxy.core.openai import parse_request

    def run(classified: bool) -> list[tuple[str | None, str | None, int | None, str | None]]:
        index = PrefixIndex()
        out = []
        for k, name in enumerate(("qwen-code_0.24.4_chat", "qwen-code_0.24.4_memory")):
            headers, method, path, body = _request(name)
            info, _ = parse_request(method, path, orjson.dumps(body))
            m = RequestMeter(info, request_id=f"r{k}", upstream="u", t_start=10.0 * k, started_at=0.0)
            m.response_started(10.0 * k + 0.01, 200, "text/event-stream")
            m.feed(
                b'data: {"choices":[{"delta":{"content":"ok"},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n',
                10.0 * k + 0.2,
            )
            client = classify(headers, method, path, info.prompt_obj) if classified else NO_CLIENT
            r = finish_checked(m, 10.0 * k + 0.3, Thresholds(), prefixes=index, client=client)
            out.append((r.side_request, r.conversation_id, r.turn, r.reprefill_cause))
        return out

    assert run(classified=False) == [(None, "r0", 1, None), (None, "r1", 1, None)]
    assert run(classified=True) == [(None, "r0", 1, None), ("memory", None, None, None)]


def test_system_prompt_places() -> None:
    """The marks are looked for where each API keeps its system prompt: a Messages `system`
    (text or blocks), a Responses `instructions` or leading developer item, a chat system message."""
    title = "You are a title generator. You output ONLY a thread title."
    for body in (
        {"system": [{"type": "text", "text": title}], "messages": [{"role": "user", "content": "x"}]},
        {"system": title, "messages": [{"role": "user", "content": "x"}]},
        {"instructions": title, "input": "x"},
        {"input": [{"role": "developer", "content": title}, {"role": "user", "content": "x"}]},
        {"messages": [{"role": "system", "content": [{"type": "text", "text": title}]}]},
    ):
        assert classify([], "POST", "/v1/x", body).side == "title", body
    # a system message that is not the first does not count (Claude Code sends one after the user's)
    assert (
        classify(
            [], "POST", "/v1/x", {"messages": [{"role": "user", "content": "x"}, {"role": "system", "content": title}]}
        ).side
        is None
    )
