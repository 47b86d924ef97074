"""Conversation identity and the cache verdict on what real agents send from turn to turn
(issue 36), from the recorded single requests of tests/fixtures/clients/ changed exactly as
the recorded multi-turn sessions of the same versions changed them (diffed from the
recordings in tests/fixtures/sessions/: Claude Code 2.1.332 and Codex 0.171.0 against vllm-mlx 0.6.0, Aider 0.86.2 against
mlx_lm.server 0.32.2), answered with real recorded streams and scripted times:

- Claude Code moves its `cache_control` breakpoint to the newest message and re-sends the
  previous newest one as a plain string; with its billing line, `cch=`, `cc_prompt_id=` and
  `cc_turn_index=` change at system line 1 every turn (vllm-mlx strips the line: HIT).
- Aider inserts the restored history before its fixed "I am not sharing any files..."/"Ok."
  pair and drops the format reminder from the previous newest user message.
- Codex extends its input; vllm-mlx hits (its log: HIT reusing 15,028 tokens) and reports
  `cached_tokens` 0.
"""

from __future__ import annotations

import copy
from typing import Any

import orjson
import pytest

from mlxproxy.core.analyze import finish_checked
from mlxproxy.core.cachecheck import PrefixIndex
from mlxproxy.core.detect import Thresholds
from mlxproxy.core.meter import RequestMeter
from mlxproxy.core.openai import parse_request
from mlxproxy.core.record import Record
from support import FIXTURES, read_fixture

TH = Thresholds()
REAL2 = FIXTURES / "real2"
FINDINGS = {"prefix_cache_miss", "prompt_prefix_changed", "cached_tokens_unreported", "cached_tokens_claimed_cold"}


def client_body(name: str) -> dict[str, Any]:
    raw = read_fixture(f"clients/{name}.req")
    body = raw.split(b"\r\n\r\n", 1)[1] if b"\r\n\r\n" in raw else raw.split(b"\n\n", 1)[1]
    return orjson.loads(body)


def events(name: str, replace: tuple[bytes, bytes] | None = None) -> list[bytes]:
    raw = (REAL2 / name).read_bytes()
    if replace is not None:
        assert replace[0] in raw
        raw = raw.replace(*replace)
    return [e + b"\n\n" for e in raw.split(b"\n\n") if e.strip()]


def finish(index: PrefixIndex, path: str, body: dict, stream: list[bytes], ttft: float, rid: str) -> Record:
    info, _ = parse_request("POST", path, orjson.dumps(body))
    m = RequestMeter(info, request_id=rid, upstream="u", t_start=0.0, started_at=0.0)
    m.response_started(0.005, 200, "text/event-stream")
    for i, e in enumerate(stream):
        m.feed(e, ttft + 0.001 * i)
    return finish_checked(m, ttft + 0.001 * len(stream) + 0.01, TH, prefixes=index)


def findings(r: Record) -> set[str]:
    return ({r.reprefill_cause} - {None}) | (set(r.anomalies) & FINDINGS)


# -- Claude Code on vllm-mlx's Messages endpoint (no prompt tokens in its stream) -----------

BILLING = (
    "x-anthropic-billing-header: cc_version=2.1.332.0b8; cc_entrypoint=sdk-cli; cch={cch:05x}; "
    "cc_prompt_id=7978f4a7-9cda-40d4-94c9-{k:012d}; cc_turn_origin=sdk; cc_prompt_index=0; cc_turn_index={k};"
)


def claude_turns(n: int, *, billing: bool, first: str | None = None) -> list[dict]:
    """Claude Code's requests of an `n`-turn `claude -p` / `claude -c -p` session, as recorded:
    each turn the previous newest message comes back as a plain string and the newest one
    carries the `cache_control` breakpoint; the assistant's answer has a thinking block."""
    body = client_body("claude_code_2.1.332_messages")
    if first is not None:  # another session (or a replay's run: its nonce in the first user message)
        body["messages"][0]["content"][-1]["text"] = first
    out = []
    for k in range(1, n + 1):
        b = copy.deepcopy(body)
        if billing:
            b["system"][0]["text"] = BILLING.format(cch=(0x95842 * k) % 0xFFFFF, k=k)
        out.append(b)
        newest = body["messages"][-1]
        blocks = newest["content"]
        if isinstance(blocks, list) and len(blocks) == 1:  # re-sent as a plain string, unmarked
            newest["content"] = blocks[0]["text"]
        body["messages"] += [
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "\nA short answer will do.\n", "signature": ""},
                    {"type": "text", "text": f"Hi! (answer {k})"},
                ],
            },
            {
                "role": "user",
                "content": [{"type": "text", "text": f"say hi again {k}", "cache_control": {"type": "ephemeral"}}],
            },
        ]
    return out


def claude_session(ttfts: list[float], *, billing: bool, index: PrefixIndex | None = None, first=None) -> list[Record]:
    index = index if index is not None else PrefixIndex()
    stream = events("anthropic_messages_vllm_mlx_text.sse")
    bodies = claude_turns(len(ttfts), billing=billing, first=first)
    return [
        finish(index, "/v1/messages", b, stream, t, f"{first or 'c'}{k}") for k, (b, t) in enumerate(zip(bodies, ttfts))
    ]


def test_claude_code_is_one_conversation_and_its_hits_are_no_finding() -> None:
    # recorded TTFTs of claude-code_2.1.332 on vllm-mlx: a cold 1.94 s, then hits of 0.41, 0.29, 0.31 s
    recs = claude_session([1.94, 0.41, 0.29, 0.31], billing=False)
    assert [r.turn for r in recs] == [1, 2, 3, 4] and len({r.conversation_id for r in recs}) == 1
    assert all(r.prefix_diverged_at is None for r in recs)  # the moved marker and the string changed nothing
    assert not [findings(r) for r in recs if findings(r)]
    # no prompt tokens in the stream: counted by the proxy (no tokenizer here: characters / 4)
    assert all(r.prompt_tokens is None and r.prompt_tokens_source == "chars" for r in recs)
    assert recs[0].prompt_tokens_counted > 10_000 and recs[1].prefix_reusable_tokens == recs[0].prompt_tokens_counted
    assert {r.prefix_tokens_source for r in recs[1:]} == {"chars"}  # an estimate, and said so
    assert all("suggests a hit" in r.cache_evidence for r in recs[1:])
    assert "cold ≈ 1.9" in recs[1].cache_evidence


def test_claude_code_billing_line_neutralized_or_lost() -> None:
    # vllm-mlx strips the billing line before caching: HIT every turn (recorded 1.32, 0.26, 0.21, 0.22 s)
    recs = claude_session([1.32, 0.26, 0.21, 0.22], billing=True)
    assert [r.turn for r in recs] == [1, 2, 3, 4] and len({r.conversation_id for r in recs}) == 1
    for r in recs[1:]:
        assert r.reprefill_cause == "volatile_span" and r.reprefill_lost_s == 0.0
        assert r.reprefill_at.startswith("system line 1: a-a-a-a: a_a=9.9.999.<x:3>; a_a=a-a; a=")
        assert "neutralized, 0 s lost" in r.cache_evidence and not set(r.anomalies) & FINDINGS
    assert recs[-1].conversation_lost_s == 0.0
    # a server that does not strip it prefills everything again: a loss with its seconds
    recs = claude_session([1.32, 1.33, 1.34], billing=True)
    for r in recs[1:]:
        assert r.reprefill_cause == "volatile_span" and 1.0 < r.reprefill_lost_s <= r.ttft_s
        assert "suggests a re-prefill" in r.cache_evidence
        assert "prompt_prefix_changed" in r.anomalies
    assert recs[-1].conversation_lost_s == pytest.approx(sum(r.reprefill_lost_s for r in recs[1:]))


def test_claude_code_sessions_and_replay_runs_stay_apart() -> None:
    index = PrefixIndex()
    a = claude_session([1.9, 0.3, 0.3], billing=False, index=index, first="[nonce 0a1b2c] say hi")
    b = claude_session([1.9, 0.3, 0.3], billing=False, index=index, first="[nonce 3d4e5f] say hi")
    assert {r.conversation_id for r in a} == {"[nonce 0a1b2c] say hi0"}
    assert {r.conversation_id for r in b} == {"[nonce 3d4e5f] say hi0"}
    assert [r.turn for r in a + b] == [1, 2, 3, 1, 2, 3]
    # the same request again (a retry, bench's identical requests) is a conversation of its own
    first = claude_turns(1, billing=False)[0]
    again, twice = (
        finish(index, "/v1/messages", first, events("anthropic_messages_vllm_mlx_text.sse"), 1.9, rid)
        for rid in ("x", "y")
    )
    assert (again.turn, twice.turn, twice.conversation_id) == (1, 1, "y")


# -- Aider on mlx_lm.server ------------------------------------------------------------------


def aider_turns(prompts: list[str]) -> list[dict]:
    """Aider's requests with `--restore-chat-history`, as recorded: the reminder appended to the
    newest user message is dropped on the next turn, and that turn's history goes in before
    the fixed "I am not sharing any files..."/"Ok." pair."""
    base = client_body("aider_0.86.2_chat")
    msgs = base["messages"]
    reminder = msgs[-1]["content"].split("\n\n", 1)[1]
    fixed = msgs[5:7]
    assert fixed[0]["content"].startswith("I am not sharing any files")
    history: list[dict] = []
    out = []
    for k, p in enumerate(prompts, 1):
        out.append(
            {**base, "messages": msgs[:5] + history + fixed + [{"role": "user", "content": f"{p}\n\n{reminder}"}]}
        )
        history = history + [
            {"role": "user", "content": f"{p}  \n"},
            {"role": "assistant", "content": f"It is sunny ({k})."},
        ]
    return out


def chat_stream(prompt: int, cached: int) -> list[bytes]:
    return events(
        "chat_mlx_lm_server_cache_turn1.sse",
        (
            b'"prompt_tokens": 1201, "completion_tokens": 16, "total_tokens": 1217, "prompt_tokens_details": {"cached_tokens": 0}',
            b'"prompt_tokens": %d, "completion_tokens": 16, "total_tokens": %d, "prompt_tokens_details": {"cached_tokens": %d}'
            % (prompt, prompt + 16, cached),
        ),
    )


def test_aider_restored_history_is_one_conversation_rewritten_at_the_insert() -> None:
    # recorded on mlx_lm.server: prompt 1347/1381/1416 tokens, cached 0/853/879 (exactly the
    # common token prefix), TTFT 0.129/0.035/0.044 s
    index = PrefixIndex()
    bodies = aider_turns(["say hi", "and again", "once more"])
    usage = [(1347, 0, 0.129), (1381, 853, 0.035), (1416, 879, 0.044)]
    recs = [
        finish(index, "/v1/chat/completions", b, chat_stream(p, c), t, f"a{k}")
        for k, (b, (p, c, t)) in enumerate(zip(bodies, usage))
    ]
    assert [r.turn for r in recs] == [1, 2, 3] and len({r.conversation_id for r in recs}) == 1
    assert [r.reprefill_cause for r in recs] == [None, "history_rewritten", "history_rewritten"]
    assert [r.reprefill_at for r in recs[1:]] == ["messages[5].content char 0", "messages[7].content char 0"]
    assert recs[1].prefix_reusable_tokens == 853 and recs[1].cache_evidence.startswith("cached_tokens 853: ~494")
    assert 0 < recs[1].reprefill_lost_s <= recs[1].ttft_s
    # another Aider session (the same fixed messages, another request) stays apart
    other = finish(index, "/v1/chat/completions", aider_turns(["fix the parser"])[0], chat_stream(1350, 0), 0.13, "o")
    assert (other.conversation_id, other.turn) == ("o", 1)


# -- Codex on vllm-mlx's Responses endpoint (cached_tokens always 0) --------------------------


def codex_turns(n: int) -> list[dict]:
    body = client_body("codex_0.171.0_responses")
    out = []
    for k in range(1, n + 1):
        out.append(copy.deepcopy(body))
        body["input"] += [
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": f"Hi ({k})."}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": f"again {k}"}]},
        ]
    return out


def test_codex_hits_with_zero_cached_are_unreported_never_evicted() -> None:
    # recorded: cold 0.76 s for 15,376 tokens, then hits of 0.18, 0.13, 0.25 s, usage cached 0 each time
    index = PrefixIndex()
    prompts = [(15376, 0.76), (15421, 0.177), (15467, 0.13), (15510, 0.247), (15550, 0.45)]
    recs = []
    for k, (body, (p, t)) in enumerate(zip(codex_turns(len(prompts)), prompts)):
        stream = events("openai_responses_vllm_mlx_text.sse", (b'"input_tokens":35,', b'"input_tokens":%d,' % p))
        recs.append(finish(index, "/v1/responses", body, stream, t, f"x{k}"))
    assert [r.turn for r in recs] == [1, 2, 3, 4, 5] and all(r.cached_tokens == 0 for r in recs)
    for r in recs[1:4]:
        assert "cached_tokens_unreported" in r.anomalies and r.reprefill_cause is None, r.cache_evidence
        assert r.cache_evidence.startswith("TTFT ") and "suggests a hit (cold ≈ 0.7" in r.cache_evidence
    # a slow hit (0.45 s: between a hit and a cold prefill): nothing is named, and the 0 this
    # server reports on every hit is no evidence of an eviction
    assert findings(recs[4]) == set() and "tells neither" in recs[4].cache_evidence
    assert not any(r.reprefill_cause == "cache_evicted" or "prefix_cache_miss" in r.anomalies for r in recs)


# -- Qwen Code 0.24.4 on mlx_lm.server (recorded: its shape kept, its long texts shortened) -----

QWEN_SYSTEM = "\n".join(f"You are Qwen Code, rule {i}: keep the change small." for i in range(60))
MEMORY_SYSTEM = "\n".join(f"You are now acting as the managed memory extraction subagent, rule {i}." for i in range(40))
DATE = "<system-reminder>\nThe current date is: Sunday, December 6, 2026.\n</system-reminder>"
SKILLS = "<system-reminder>\nThe following skills are available.\n\n- review: review a change\n</system-reminder>"


def qwen_turns(prompts: list[str]) -> list[tuple[dict, dict]]:
    """Each CLI turn: the main request (its date reminder on the newest user message only; the
    one it was on before is sent without it), then the memory subagent's request: the same
    messages plus an extraction instruction, under its own system prompt and tools."""
    tools = [{"type": "function", "function": {"name": n, "parameters": {}}} for n in ("read_file", "edit", "shell")]
    memory_tools = tools[:1] + [{"type": "function", "function": {"name": "write_file", "parameters": {}}}]
    said: list[dict] = []
    out = []
    for k, p in enumerate(prompts, 1):
        newest = {
            "role": "user",
            "content": [{"type": "text", "text": t} for t in ([SKILLS] if k == 1 else []) + [DATE, p]],
        }
        main = {
            "model": "m",
            "stream": True,
            "tools": tools,
            "messages": [{"role": "system", "content": QWEN_SYSTEM}, *said, newest],
        }
        memory = {
            "model": "m",
            "stream": True,
            "tools": memory_tools,
            "messages": [
                {"role": "system", "content": MEMORY_SYSTEM},
                *said,
                newest,
                {"role": "assistant", "content": f"Done ({k})."},
                {"role": "user", "content": "Scan the recent conversation and update durable managed memory."},
            ],
        }
        out.append((main, memory))
        texts = ([SKILLS] if k == 1 else []) + [p]
        said = said + [
            {"role": "user", "content": [{"type": "text", "text": t} for t in texts]},
            {"role": "assistant", "content": f"Done ({k})."},
        ]
    return out


def test_qwen_code_main_conversation_and_its_memory_subagent_are_two() -> None:
    index = PrefixIndex()
    recs = []
    for k, (main, memory) in enumerate(qwen_turns(["say hi", "and again", "once more"]), 1):
        recs.append(
            finish(index, "/v1/chat/completions", main, chat_stream(9000 + 30 * k, 0 if k == 1 else 8800), 0.3, f"m{k}")
        )
        recs.append(
            finish(
                index, "/v1/chat/completions", memory, chat_stream(7000 + 30 * k, 0 if k == 1 else 6800), 0.3, f"s{k}"
            )
        )
    main, memory = recs[0::2], recs[1::2]
    assert {r.conversation_id for r in main} == {"m1"} and [r.turn for r in main] == [1, 2, 3]
    assert {r.conversation_id for r in memory} == {"s1"} and [r.turn for r in memory] == [1, 2, 3]
    # the date reminder taken off the previous newest message: a small rewrite where it was
    assert main[1].prefix_diverged_at.startswith("messages[1].content char ")


# -- the recorded sessions (tests/fixtures/sessions) as a proxy sees them, many at once -------


def test_two_hundred_healthy_recorded_requests_raise_nothing() -> None:
    """The recorded sessions whose truth names no cause and no anomaly, each run 7 times in a
    row and interleaved turn by turn with the other sessions on the same server, through one
    index per server (as one proxy sees them): every run is one conversation of its own, its
    turns numbered as recorded, side requests apart, and no cause or cache finding anywhere."""
    from sessions import load_sessions, meter_for, rigged_token_counter

    def healthy(s) -> bool:
        want = [ex.expected for ex in s.exchanges if ex.generation and ex.expected]
        return bool(want) and all(not e.get("cause") and not e.get("must_name") for e in want)

    groups: dict[str, list] = {}
    for s in load_sessions():
        if healthy(s):
            groups.setdefault(s.name.split("__")[1], []).append(s)
    count = rigged_token_counter()
    seen = 0
    for group in groups.values():
        index = PrefixIndex()
        for run in range(7):
            runs = [[ex for ex in s.exchanges if ex.generation and ex.upstream_response is not None] for s in group]
            got: dict[tuple[str, int], Record] = {}
            for step in range(max(len(r) for r in runs)):
                for s, exchanges in zip(group, runs):
                    if step < len(exchanges):
                        ex = exchanges[step]
                        m, end = meter_for(s, ex)
                        rec = finish_checked(m, end, TH, prefixes=index, count_tokens=count if m.sse else None)
                        got[(s.name, ex.n)] = rec
                        seen += 1
            for s, exchanges in zip(group, runs):
                turns = [(ex.expected, got[(s.name, ex.n)]) for ex in exchanges]
                main = {r.conversation_id for e, r in turns if e.get("role") == "turn"}
                assert len(main) == 1, (s.name, run, [(r.conversation_id, r.turn) for _, r in turns])
                assert [r.turn for e, r in turns if e.get("role") == "turn"] == [
                    e["turn"] for e, _ in turns if e.get("role") == "turn"
                ], s.name
                assert all(r.conversation_id not in main for e, r in turns if e.get("role") == "side"), s.name
                assert not [(s.name, r.turn, findings(r), r.cache_evidence) for _, r in turns if findings(r)]
    assert seen >= 200 and len(groups) >= 2, (seen, list(groups))
