"""The coding agents' own endpoints, live: Anthropic Messages (``/v1/messages``, what Claude Code
sends) and OpenAI Responses (``/v1/responses``, what Codex sends) through ``mlxproxy serve`` to
each live server that speaks them, driven with the real ``anthropic`` and ``openai`` SDKs.

vllm-mlx 0.6.0 (simple and ``--continuous-batching``) serves ``/v1/messages`` (with
``/v1/messages/count_tokens``) and ``/v1/responses``; mlx-openai-server 1.6.3 and 1.8.1 serve
``/v1/responses`` only. All serve the rigged tiny model (``rigged.py``), whose answer is fixed by
the kind of request. For each server and API: streamed and non-streamed answers, a tool call, a
thinking answer, an answer cut by the token limit, a two-turn conversation (the prefix tracker),
a client that leaves mid-stream, a request refused while the server is busy, and the bytes
forwarded faithfully; for Messages, count_tokens forwarded untouched.

Every record is checked: TTFT is the first text/thinking/tool delta (the generated events the
proxy counted are exactly the deltas the SDK saw, so ``message_start``, ``response.created`` and
the like are not among them), token counts and stop reasons are the server's, a prompt size the
stream never reports is ``None`` (vllm-mlx's Anthropic stream), and the anomalies are asserted
equal to :data:`EXPECTED`: what each server really does wrong, nothing else.

A server whose venv ``.ci/install-servers`` did not make, or that does not start, is skipped with
the reason (pytest ``-ra`` prints it).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from .live_servers import LiveServer, proxied_live_server
from .peers import ProxyProcess, require_mlx, wait_for
from .rigged import REASONING_ANSWER, REASONING_THOUGHT, TOOL_ARGUMENTS, WORDS, RiggedModel

pytestmark = pytest.mark.integration

require_mlx("the rigged model is built with it")

openai = pytest.importorskip("openai", reason="the OpenAI SDK is part of the [test] extra: pip install -e '.[test]'")
anthropic = pytest.importorskip(
    "anthropic", reason="the Anthropic SDK is part of the [test] extra: pip install -e '.[test]'"
)

#: the APIs each live server speaks besides chat completions
APIS: dict[str, tuple[str, ...]] = {
    "vllm-mlx": ("messages", "responses"),
    "vllm-mlx-cb": ("messages", "responses"),
    "mlx-openai-server": ("responses",),
    "mlx-openai-server-1.8": ("responses",),
}
SERVERS = tuple(APIS)

#: The anomalies each (server, api, case) must raise, and nothing else (docs/VERIFIED.md).
EXPECTED: dict[tuple[str, str], dict[str, frozenset[str]]] = {(s, a): {} for s, apis in APIS.items() for a in apis}
for _v in ("vllm-mlx", "vllm-mlx-cb"):
    for _api in ("messages", "responses"):
        # --reasoning-parser qwen3 streams an answer without <think> as thinking/reasoning only
        EXPECTED[_v, _api].update(words_stream=frozenset({"reasoning_only"}), turn_stream=frozenset({"reasoning_only"}))
    # its Anthropic stream says end_turn whatever stopped it (max_tokens included)
    EXPECTED[_v, "messages"].update(cut_stream=frozenset({"unreported_length", "reasoning_only"}))
    # (its Responses stream names the cut, max_output_tokens, so reasoning cut short is no finished answer)
for _m in ("mlx-openai-server", "mlx-openai-server-1.8"):
    # 1.6.3 and 1.8.1 drop a think-less answer from their Responses stream (with --reasoning-parser
    # the content-only chunk matches no branch of the stream writer): nothing streamed, usage 17
    # (non-streamed, the answer is there)
    EXPECTED[_m, "responses"].update(
        words_stream=frozenset({"usage_mismatch"}), turn_stream=frozenset({"usage_mismatch"})
    )
#: 1.6.3 keeps generating after a client left, one request at a time: the next one waits. 1.8.1
#: batches: the next request is not kept waiting
EXPECTED["mlx-openai-server", "responses"].update(after_disconnect=frozenset({"generation_after_disconnect"}))


#: Servers that refuse a request while they are still busy instead of queueing it. vllm-mlx 0.6.0's
#: simple engine admits one generation at a time and by default fails fast (its
#: ``VLLM_MLX_SIMPLE_ENGINE_LOCK_ADMISSION=fail_fast``: "SimpleEngine serialized route is busy"),
#: and after a client leaves it goes on until its disconnect poll (every 0.5 s) notices: measured
#: busy 0.02-0.65 s after the proxy closed the stream. A request sent in that window is refused
#: (HTTP 500, or an error event / a cut stream once the 200 has gone out):
#: ``test_a_refusal_while_busy_is_recorded_as_a_failure``.
FAIL_FAST = frozenset({"vllm-mlx"})


def expected(live: Live, api: str, case: str) -> frozenset[str]:
    return EXPECTED[live.name, api].get(case, frozenset())


@dataclasses.dataclass
class Live:
    name: str
    server: LiveServer
    proxy: ProxyProcess
    rig: RiggedModel

    def free(self) -> bool:
        """The server takes a request now (a one-token chat completion sent direct, not through
        the proxy, so no record of it enters the proxy's judgement)."""
        body = {"model": self.server.model, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
        with self.http() as http:
            return http.post(self.server.url + "/v1/chat/completions", json=body).status_code == 200

    def http(self) -> httpx.Client:
        return httpx.Client(trust_env=False, timeout=120.0)

    def anthropic(self, direct: bool = False) -> Any:
        return anthropic.Anthropic(
            base_url=self.server.url if direct else self.proxy.url,
            api_key="dummy",
            max_retries=0,
            timeout=120.0,
            # this SDK brings its own HTTP library (no httpx.Client): its default client, no env proxies
            http_client=anthropic.DefaultHttpxClient(trust_env=False),
        )

    def openai(self, direct: bool = False) -> Any:
        return openai.OpenAI(
            base_url=(self.server.url if direct else self.proxy.url) + "/v1",
            api_key="dummy",
            max_retries=0,
            timeout=120.0,
            http_client=self.http(),
        )


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> RiggedModel:
    from .rigged import build_rigged_model

    return build_rigged_model(tmp_path_factory.mktemp("rigged") / "model")


@pytest.fixture(scope="module", params=SERVERS)
def live(request: pytest.FixtureRequest, rig: RiggedModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    name = request.param
    log = tmp_path_factory.mktemp(f"{name}-log") / "server.log"
    with proxied_live_server(name, rig.path, log) as (server, proxy):
        yield Live(name, server, proxy, rig)


@pytest.fixture(params=["messages", "responses"])
def api(request: pytest.FixtureRequest, live: Live) -> str:
    if request.param not in APIS[live.name]:
        pytest.skip(f"{live.name} does not serve /v1/{request.param}")
    return str(request.param)


# -- what the client saw, through each SDK ------------------------------------------------

TOOL_SCHEMA = {
    "type": "object",
    "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
    "required": ["path", "content"],
}
ANTHROPIC_TOOLS = [{"name": "write_file", "description": "Write a text file.", "input_schema": TOOL_SCHEMA}]
RESPONSES_TOOLS = [
    {"type": "function", "name": "write_file", "description": "Write a text file.", "parameters": TOOL_SCHEMA}
]


@dataclasses.dataclass
class Seen:
    text: str = ""
    thinking: str = ""
    tools: list[tuple[str, Any]] = dataclasses.field(default_factory=list)  # (name, arguments as an object)
    deltas: int = 0  # text, thinking and tool-input deltas received
    stop: str | None = None
    input_tokens: int | None = None
    output_tokens: int | None = None
    request_id: str | None = None


def ask(live: Live, api: str, *, stream: bool, prompt: Any, max_tokens: int = 64, tools: bool = False) -> Seen:
    """One request through the proxy with the API's own SDK; what the client got."""
    if api == "messages":
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        body: dict[str, Any] = {"model": live.server.model, "max_tokens": max_tokens, "messages": messages}
        if tools:
            body["tools"] = ANTHROPIC_TOOLS
        return _messages(live.anthropic(), body, stream)
    body = {"model": live.server.model, "max_output_tokens": max_tokens, "input": prompt}
    if tools:
        body["tools"] = RESPONSES_TOOLS
    return _responses(live.openai(), body, stream)


def _messages(client: Any, body: dict[str, Any], stream: bool) -> Seen:
    raw = client.messages.with_raw_response.create(stream=stream, **body)
    seen = Seen(request_id=raw.headers.get("x-mlxproxy-request-id"))
    if not stream:
        msg = raw.parse()
        for block in msg.content:
            if block.type == "text":
                seen.text += block.text
            elif block.type == "thinking":
                seen.thinking += block.thinking
            elif block.type == "tool_use":
                seen.tools.append((block.name, block.input))
        seen.stop, seen.input_tokens, seen.output_tokens = (
            msg.stop_reason,
            msg.usage.input_tokens,
            msg.usage.output_tokens,
        )
        return seen
    tool_input: dict[int, list[Any]] = {}
    for ev in raw.parse():
        if ev.type == "message_start":
            seen.input_tokens = ev.message.usage.input_tokens
        elif ev.type == "content_block_start" and ev.content_block.type == "tool_use":
            tool_input[ev.index] = [ev.content_block.name, ""]
        elif ev.type == "content_block_delta":
            seen.deltas += 1
            d = ev.delta
            if d.type == "text_delta":
                seen.text += d.text
            elif d.type == "thinking_delta":
                seen.thinking += d.thinking
            elif d.type == "input_json_delta":
                tool_input[ev.index][1] += d.partial_json
        elif ev.type == "message_delta":
            seen.stop = ev.delta.stop_reason
            seen.output_tokens = ev.usage.output_tokens
            seen.input_tokens = ev.usage.input_tokens if ev.usage.input_tokens is not None else seen.input_tokens
    seen.tools = [(name, json.loads(args)) for name, args in tool_input.values()]
    return seen


def _responses(client: Any, body: dict[str, Any], stream: bool) -> Seen:
    raw = client.responses.with_raw_response.create(stream=stream, **body)
    seen = Seen(request_id=raw.headers.get("x-mlxproxy-request-id"))
    if not stream:
        _response_state(seen, raw.parse())
        return seen
    for ev in raw.parse():
        if ev.type == "response.output_text.delta":
            seen.deltas += 1
            seen.text += ev.delta
        elif ev.type in ("response.reasoning_text.delta", "response.reasoning_summary_text.delta"):
            seen.deltas += 1
            seen.thinking += ev.delta
        elif ev.type == "response.function_call_arguments.delta":
            seen.deltas += 1
        elif ev.type in ("response.completed", "response.incomplete"):
            text, thinking = seen.text, seen.thinking
            _response_state(seen, ev.response)
            seen.text, seen.thinking = text, thinking  # what was streamed, not the final copy
    return seen


def _response_state(seen: Seen, resp: Any) -> None:
    for item in resp.output:
        if item.type == "message":
            seen.text += "".join(getattr(c, "text", "") for c in item.content)
        elif item.type == "reasoning":
            # the thought as content (vllm-mlx) or as a summary, or both with the same text (mlx-openai-server)
            seen.thinking += "".join(c.text for c in (item.content or [])) or "".join(c.text for c in item.summary)
        elif item.type == "function_call":
            seen.tools.append((item.name, json.loads(item.arguments)))
    inc = resp.incomplete_details
    seen.stop = inc.reason if inc is not None and inc.reason else resp.status
    if resp.usage is not None:
        seen.input_tokens, seen.output_tokens = resp.usage.input_tokens, resp.usage.output_tokens


def record_of(live: Live, seen: Seen) -> Any:
    assert seen.request_id, "the proxy names every request in x-mlxproxy-request-id"
    return live.proxy.record(seen.request_id)


def timeline(live: Live, request_id: str) -> Any:
    """The captured record of ``request_id`` (with its event times)."""
    return wait_for(lambda: next((r for r in live.proxy.captured() if r.id == request_id), None), 10.0)


def check_record(live: Live, api: str, seen: Seen, case: str, *, stream: bool) -> Any:
    """The record agrees with what the client saw; its anomalies are exactly the expected ones."""
    rec = record_of(live, seen)
    assert rec.outcome == "ok", rec
    assert rec.endpoint == api and rec.stream is stream
    assert rec.finish_reason == seen.stop
    assert rec.completion_tokens_reported == seen.output_tokens
    # a prompt size the server never sent is not reported, never 0 (vllm-mlx's Anthropic stream)
    assert rec.prompt_tokens == (seen.input_tokens or None)
    if stream:
        # the generated events are the deltas the client saw: TTFT is the first of them, not
        # message_start / response.created, which come first and carry no token
        assert rec.generated_events == seen.deltas, rec
        if seen.deltas:
            offsets = timeline(live, rec.id).event_offsets_s  # kept in the capture, not in /streams
            assert (
                len(offsets) == seen.deltas
                and rec.ttft_s == pytest.approx(offsets[0], abs=1e-6)
                and rec.ttft_s >= rec.ttfb_s
            )
        else:
            assert rec.ttft_s is None
    kinds = frozenset(rec.anomalies)
    assert kinds == expected(live, api, f"{case}_{'stream' if stream else 'nonstream'}"), rec.anomaly_evidence
    if not kinds & {"usage_mismatch", "phantom_speed"}:
        assert (rec.completion_tokens, rec.tokens_source) == (seen.output_tokens, "usage")  # the trusted count
    return rec


STREAMED = pytest.mark.parametrize("stream", [True, False], ids=["stream", "nonstream"])


@STREAMED
def test_words(live: Live, api: str, stream: bool) -> None:
    """The rigged 16 words: wherever the server puts them (vllm-mlx streams them as thinking)."""
    seen = ask(live, api, stream=stream, prompt="Say the words.")
    got = (seen.text or seen.thinking).strip()
    if expected(live, api, "words_stream" if stream else "words_nonstream") & {"usage_mismatch"}:
        assert got == ""  # the server dropped them (the record says so)
    else:
        assert got == WORDS
    assert seen.output_tokens in (16, 17)
    assert seen.stop == {"messages": "end_turn", "responses": "completed"}[api]
    check_record(live, api, seen, "words", stream=stream)


@STREAMED
def test_thinking(live: Live, api: str, stream: bool) -> None:
    """``<think>...</think>`` then the answer: thinking and text apart, both metered."""
    seen = ask(live, api, stream=stream, prompt="Please think: is it sunny?")
    assert seen.thinking.strip() == REASONING_THOUGHT.strip()
    assert seen.text.strip() == REASONING_ANSWER.strip()
    rec = check_record(live, api, seen, "think", stream=stream)
    if stream:
        assert rec.reasoning_tokens_counted and rec.ttfc_s is not None and rec.ttfc_s >= rec.ttft_s, rec
        if rec.ttfc_s == rec.ttft_s:
            # The thought and the answer reached the proxy in one read: mlx-openai-server 1.6.3
            # sometimes writes this short answer in one burst (after the words requests before it,
            # in every run of this file; straight from the server too: 15 deltas within 1.6 ms).
            # Then the content starts at the instant the thinking does, and the timeline must show
            # that burst: several events at the first event's time.
            offsets = timeline(live, rec.id).event_offsets_s
            print(f"\n{live.name} {api}: thought and answer in one burst, event offsets {offsets}")
            assert offsets.count(offsets[0]) >= 2, offsets


@STREAMED
def test_tool_call(live: Live, api: str, stream: bool) -> None:
    """The rigged write_file call comes back as a structured call with the rigged arguments."""
    seen = ask(live, api, stream=stream, prompt="Save my fruit list.", tools=True)
    assert seen.tools == [("write_file", TOOL_ARGUMENTS)], seen
    assert seen.stop == {"messages": "tool_use", "responses": "completed"}[api]
    rec = check_record(live, api, seen, "tool", stream=stream)
    assert (rec.tool_calls, rec.tool_calls_valid) == (1, 1)


@STREAMED
def test_cut_by_the_token_limit(live: Live, api: str, stream: bool) -> None:
    """The endless answer cut at 10 tokens: the stop reason as the server said it, and the
    anomaly where a stream hides the cut (vllm-mlx's Anthropic stream says end_turn)."""
    seen = ask(live, api, stream=stream, prompt="Count forever.", max_tokens=10)
    assert seen.output_tokens == 10
    rec = check_record(live, api, seen, "cut", stream=stream)
    assert rec.max_tokens == 10


def test_two_turns(live: Live, api: str) -> None:
    """A second turn that repeats the first and its answer: the prefix tracker sees one
    conversation, turn 2, with the first turn's prompt reusable."""
    nonce = f"Conversation {live.name} {api}: say the words."
    first = ask(live, api, stream=True, prompt=nonce)
    answer = (first.text or first.thinking).strip() or WORDS
    turns = [
        {"role": "user", "content": nonce},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "Again, the words."},
    ]
    second = ask(live, api, stream=True, prompt=turns)
    r1 = check_record(live, api, first, "turn", stream=True)
    r2 = check_record(live, api, second, "turn", stream=True)
    assert r1.turn == 1 and r2.turn == 2 and r2.conversation_id == r1.conversation_id, (r1, r2)
    assert r2.prefix_reusable_tokens and r2.prefix_reusable_tokens > 0, r2


def test_count_tokens_forwarded_untouched(live: Live, api: str) -> None:
    """``/v1/messages/count_tokens`` is no generation: the server's answer, byte for byte, and
    no latency or token figures in its record."""
    if api != "messages":
        pytest.skip("count_tokens is part of the Messages API")
    body = {"model": live.server.model, "messages": [{"role": "user", "content": "Say the words."}]}
    with live.http() as http:
        direct = http.post(live.server.url + "/v1/messages/count_tokens", json=body)
        proxied = http.post(live.proxy.url + "/v1/messages/count_tokens", json=body)
    assert direct.status_code == proxied.status_code == 200
    assert proxied.content == direct.content and json.loads(proxied.content)["input_tokens"] > 0
    sdk = live.anthropic().messages.count_tokens(model=live.server.model, messages=body["messages"])
    assert sdk.input_tokens == json.loads(direct.content)["input_tokens"]
    rec = live.proxy.record(proxied.headers["x-mlxproxy-request-id"])
    assert (rec.outcome, rec.endpoint, rec.ttft_s, rec.completion_tokens, rec.anomalies) == (
        "ok",
        "other",
        None,
        None,
        (),
    )


def test_client_leaves_mid_stream(live: Live, api: str) -> None:
    """A client that reads a few events of a long stream and leaves: ``client_disconnect``; the
    next request shows whether the server went on generating for nobody."""
    for _ in range(3):  # the upstream's usual TTFT, for comparison
        ask(live, api, stream=True, prompt="Please think: is it sunny?")
    path = "/v1/messages" if api == "messages" else "/v1/responses"
    limit = {"messages": "max_tokens", "responses": "max_output_tokens"}[api]
    body = {"model": live.server.model, limit: 4000, "stream": True}
    body.update(
        {"messages": [{"role": "user", "content": "Count forever."}]}
        if api == "messages"
        else {"input": "Count forever."}
    )
    # leave after the second event: vllm-mlx has started generating then, and mlx-openai-server
    # 1.6.3 streams nothing of this answer before its end (see EXPECTED)
    with live.http() as http, http.stream("POST", live.proxy.url + path, json=body) as resp:
        gone_id = resp.headers["x-mlxproxy-request-id"]
        events = 0
        for line in resp.iter_lines():
            events += line.startswith("data: ")
            if events >= 2:
                break
    gone = live.proxy.record(gone_id)
    assert gone.outcome == "client_disconnect", gone
    assert frozenset(gone.anomalies) <= {"usage_missing"}, gone.anomaly_evidence
    if live.name in FAIL_FAST:
        # it refuses rather than delays a request while it winds the abandoned one down (the
        # refusal is recorded as a failure: the test below): the next request is sent once a
        # direct probe is served, and must then carry no anomaly
        wait_for(live.free, timeout_s=30.0)
    nxt = ask(live, api, stream=True, prompt="Please think: is it sunny?")
    rec = record_of(live, nxt)
    assert frozenset(rec.anomalies) == expected(live, api, "after_disconnect"), rec.anomaly_evidence


def test_a_refusal_while_busy_is_recorded_as_a_failure(live: Live, api: str) -> None:
    """A server that refuses a request while it generates another (:data:`FAIL_FAST`): with a long
    stream held open direct, each request through the proxy is refused, and its record says so in
    the form the API gives it. vllm-mlx 0.6.0: a streamed Messages answer ends in an ``error``
    event (``stream_error``), a streamed Responses answer stops after ``response.in_progress``
    (``truncated``: ``missing_finish`` with no end event), a non-streamed one is an HTTP 500."""
    if live.name not in FAIL_FAST:
        pytest.skip(f"{live.name} queues or batches a second request")
    path = f"/v1/{api}"
    limit = {"messages": "max_tokens", "responses": "max_output_tokens"}[api]
    ask_body: dict[str, Any] = {"model": live.server.model, limit: 16}
    ask_body.update(
        {"messages": [{"role": "user", "content": "Say the words."}]}
        if api == "messages"
        else {"input": "Say the words."}
    )
    hold = {
        "model": live.server.model,
        "max_tokens": 3000,
        "stream": True,
        "messages": [{"role": "user", "content": "Count forever."}],
    }
    records = {}
    with live.http() as http, live.http() as held_client:
        with held_client.stream("POST", live.server.url + "/v1/chat/completions", json=hold) as held:
            lines = held.iter_lines()
            for line in lines:
                if line.startswith("data: "):
                    break  # the first event: the engine is generating now
            for stream in (True, False):
                resp = http.post(live.proxy.url + path, json={**ask_body, "stream": stream})
                records[stream] = (resp.status_code, live.proxy.record(resp.headers["x-mlxproxy-request-id"]))
            for _ in lines:  # the held answer to its end: it was generated, not cut
                pass
    wait_for(live.free, timeout_s=30.0)
    (s_status, streamed), (n_status, whole) = records[True], records[False]
    assert s_status == 200, streamed  # the refusal comes inside the stream
    if api == "messages":
        assert streamed.outcome == "stream_error" and streamed.error, streamed
        assert set(streamed.anomalies) == {"stream_error"}, streamed.anomaly_evidence
    else:
        assert streamed.outcome == "truncated" and streamed.generated_events == 0, streamed
        assert set(streamed.anomalies) == {"missing_finish"}, streamed.anomaly_evidence
        assert "without an end-of-stream event" in streamed.anomaly_evidence["missing_finish"]
    assert n_status == whole.status == 500 and whole.outcome == "http_error", whole


# -- faithful bytes -----------------------------------------------------------------------

_NORMALISE = [
    (re.compile(r'"(id|item_id|created_at|created|call_id)":\s*("[^"]*"|\d+)'), r'"\1":"*"'),
    (re.compile(r'"(msg|resp|rs|fc|call|toolu)_[0-9A-Za-z_]+'), r'"\1_*'),
    (re.compile(r'"(input_tokens|cached_tokens|total_tokens)":\s*\d+'), r'"\1":"*"'),
]


def normalised(body: bytes) -> list[str]:
    """Events (or a JSON body) with ids, timestamps and cache-dependent prompt counts masked."""
    out = []
    for block in body.decode().split("\n\n"):
        lines = [ln for ln in block.split("\n") if ln and not ln.startswith(":")]
        if lines:
            text = "\n".join(lines)
            for pattern, repl in _NORMALISE:
                text = pattern.sub(repl, text)
            out.append(text)
    return out


@pytest.mark.parametrize("case", ["words", "think", "tool"])
@STREAMED
def test_bytes_forwarded_faithfully(live: Live, api: str, stream: bool, case: str) -> None:
    """The same request direct and through the proxy: the same bytes once ids, timestamps and
    cache-dependent prompt counts are masked (the proxy injects nothing into these APIs)."""
    prompt = {"words": "Say the words.", "think": "Please think: is it sunny?", "tool": "Save my fruit list."}[case]
    if api == "messages":
        body: dict[str, Any] = {
            "model": live.server.model,
            "max_tokens": 64,
            "messages": [{"role": "user", "content": prompt}],
        }
        if case == "tool":
            body["tools"] = ANTHROPIC_TOOLS
    else:
        body = {"model": live.server.model, "max_output_tokens": 64, "input": prompt}
        if case == "tool":
            body["tools"] = RESPONSES_TOOLS
    body["stream"] = stream
    with live.http() as http:
        direct = http.post(live.server.url + f"/v1/{api}", json=body)
        proxied = http.post(live.proxy.url + f"/v1/{api}", json=body)
    assert direct.status_code == proxied.status_code == 200
    assert normalised(proxied.content) == normalised(direct.content)
    assert proxied.headers["content-type"] == direct.headers["content-type"]
