"""The cache doctor's three fixed cases (issue 28): a hidden cache hit (vllm-mlx 0.6.0 reports
no cached_tokens) must not yield a prefill rate; requests of two endpoint families and models
are two conversations; `cache_hit_ratio` never exceeds 1 (the last one: test_prefix.py's
recorded three-turn conversations). Then the honesty checks and re-prefill causes, each on
scripted timestamps."""

from __future__ import annotations

import orjson
import pytest
from prometheus_client import CollectorRegistry

from mlxproxy.core.analyze import finish_checked
from mlxproxy.core.cachecheck import CacheFacts, PrefixIndex, check_turn
from mlxproxy.core.detect import Thresholds
from mlxproxy.core.fixes import FIXES
from mlxproxy.core.meter import RequestMeter
from mlxproxy.core.openai import parse_request
from mlxproxy.core.prefix import Change, Match
from mlxproxy.core.record import Record
from mlxproxy.proxy.metrics import ProxyMetrics
from support import FIXTURES

TH = Thresholds()
REAL = FIXTURES / "real"
REAL2 = FIXTURES / "real2"
SYSTEM = "You are a weather assistant. Keep answers short and factual.\n" * 80  # ~4,800 characters


def vllm_mlx_events(prompt_tokens: int, cached: int | None = None) -> list[bytes]:
    """vllm-mlx 0.6.0's recorded chat stream (300 tokens), its usage set to `prompt_tokens`
    (and `cached_tokens` when given; vllm-mlx itself never reports it)."""
    raw = (REAL / "vllm_mlx_chat_stream_300tok.sse").read_bytes()
    usage = b'"usage":{"prompt_tokens":%d,"completion_tokens":300,"total_tokens":%d' % (
        prompt_tokens,
        prompt_tokens + 300,
    )
    if cached is not None:
        usage += b',"prompt_tokens_details":{"cached_tokens":%d}' % cached
    raw = raw.replace(b'"usage":{"prompt_tokens":20,"completion_tokens":300,"total_tokens":320', usage)
    return [e + b"\n\n" for e in raw.split(b"\n\n") if e.strip()]


def turn(
    index: PrefixIndex,
    rid: str,
    messages: list,
    prompt_tokens: int,
    ttft: float,
    *,
    cached: int | None = None,
    model: str = "tiny-qwen3",
    extra: dict | None = None,
) -> Record:
    body = orjson.dumps({"model": model, "stream": True, "messages": messages, **(extra or {})})
    info, _ = parse_request("POST", "/v1/chat/completions", body)
    m = RequestMeter(info, request_id=rid, upstream="u", t_start=0.0, started_at=0.0)
    m.response_started(0.005, 200, "text/event-stream")
    events = vllm_mlx_events(prompt_tokens, cached)
    for i, e in enumerate(events):
        m.feed(e, ttft + 0.005 * (i - 1))  # the first event is the role chunk
    return finish_checked(m, ttft + 0.005 * len(events), TH, prefixes=index)


def conversation(n: int) -> list[list]:
    """The message lists of an agent's first `n` turns (each resends everything so far)."""
    msgs: list = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Weather in Paris?"}]
    out = [msgs]
    for k in range(1, n):
        msgs = msgs + [{"role": "assistant", "content": f"answer {k}"}, {"role": "user", "content": f"and {k}?"}]
        out.append(msgs)
    return out


def exported_prefill(records: list[Record]) -> float:
    registry = CollectorRegistry()
    metrics = ProxyMetrics(registry)
    for r in records:
        metrics.on_record(r)
    return (
        registry.get_sample_value("mlxproxy_prefill_tokens_per_second_count", {"upstream": "u", "model": "tiny-qwen3"})
        or 0
    )


def test_a_hidden_cache_hit_has_no_prefill_rate_and_is_named() -> None:
    """vllm-mlx 0.6.0: turn 1 cold (1,201 tokens in 0.186 s, 6,455 tok/s), turn 2 a hit in
    21 ms with no cached_tokens: 1,227 / 0.021 = 58,000 tok/s was a fiction."""
    index = PrefixIndex()
    m1, m2 = conversation(2)
    t1 = turn(index, "t1", m1, 1201, 0.186)
    t2 = turn(index, "t2", m2, 1227, 0.021)
    assert t1.prefill_tps == pytest.approx(1201 / 0.186)
    assert (t2.conversation_id, t2.turn, t2.cached_tokens) == ("t1", 2, None)
    assert t2.prefill_tps is None
    assert "cached_tokens_unreported" in t2.anomalies and "prefix_cache_miss" not in t2.anomalies
    ev = t2.anomaly_evidence["cached_tokens_unreported"]
    assert "no cached_tokens" in ev and "this conversation's first turn" in ev
    assert t2.reprefill_cause is None
    assert exported_prefill([t1, t2]) == 1  # turn 1 only
    # the same turn 2 prefilled cold (TTFT as turn 1's): a miss; its rate is honest and kept
    index = PrefixIndex()
    turn(index, "c1", m1, 1201, 0.186)
    cold = turn(index, "c2", m2, 1227, 0.19)
    assert cold.prefill_tps == pytest.approx(1227 / 0.19)
    assert "prefix_cache_miss" in cold.anomalies and "cached_tokens_unreported" not in cold.anomalies
    assert cold.reprefill_cause == "cache_evicted" and 0.15 < cold.reprefill_lost_s <= 0.19
    # a server that says cached_tokens 0 on the hit: the same anomaly, and no prefill rate
    index = PrefixIndex()
    turn(index, "z1", m1, 1201, 0.186, cached=0)
    zero = turn(index, "z2", m2, 1227, 0.021, cached=0)
    assert "cached_tokens_unreported" in zero.anomalies and "prefix_cache_miss" not in zero.anomalies
    assert zero.prefill_tps is None and "cached_tokens 0" in zero.anomaly_evidence["cached_tokens_unreported"]


def test_a_claimed_cache_that_prefilled_cold() -> None:
    index = PrefixIndex()
    m1, m2 = conversation(2)
    turn(index, "t1", m1, 1201, 0.186)
    t2 = turn(index, "t2", m2, 1227, 0.19, cached=1200)
    assert "cached_tokens_claimed_cold" in t2.anomalies and "prefix_cache_miss" not in t2.anomalies
    assert "claims 1200 of 1227" in t2.anomaly_evidence["cached_tokens_claimed_cold"]
    assert t2.prefill_tps == pytest.approx(1227 / 0.19)  # all of it was prefilled
    index = PrefixIndex()
    turn(index, "h1", m1, 1201, 0.186)
    hit = turn(index, "h2", m2, 1227, 0.02, cached=1200)
    assert not {"cached_tokens_claimed_cold", "cached_tokens_unreported", "prefix_cache_miss"} & set(hit.anomalies)
    assert 0.99 <= hit.cache_hit_ratio <= 1.0 and hit.reprefill_cause is None


def recorded(name: str, model: str | None = None, extra: list | None = None) -> tuple[str, bytes]:
    rq = orjson.loads((REAL2 / f"{name}.request.json").read_bytes())
    if model is not None:
        rq["body"]["model"] = model
    rq["body"]["messages"] += extra or []
    return rq["request_line"].split()[1], orjson.dumps(rq["body"])


def replay(index: PrefixIndex, name: str, rid: str, model: str | None = None, extra: list | None = None) -> Record:
    path, body = recorded(name, model, extra)
    info, _ = parse_request("POST", path, body)
    m = RequestMeter(info, request_id=rid, upstream="u", t_start=0.0, started_at=0.0)
    m.response_started(0.01, 200, "text/event-stream")
    m.feed((REAL2 / f"{name}.sse").read_bytes(), 0.3)
    return finish_checked(m, 0.4, TH, prefixes=index)


@pytest.mark.parametrize("model", [None, "tiny-other"])
def test_a_messages_request_and_a_chat_request_are_two_conversations(model: str | None) -> None:
    """Same first user message and tool name, but /v1/messages then /v1/chat/completions (of
    the same or another model): two conversations, no `tools char 0` divergence."""
    index = PrefixIndex()
    a = replay(index, "anthropic_messages_litellm_tool_use", "a")
    later = [{"role": "assistant", "content": "Let me check."}, {"role": "user", "content": "And in Rome?"}]
    b = replay(index, "chat_litellm_tool_calls", "b", model, later)  # its message list extends a's
    assert (a.conversation_id, a.turn) == ("a", 1)
    assert (b.conversation_id, b.turn, b.prefix_diverged_at, b.reprefill_cause) == ("b", 1, None, None)
    assert len(index) == 2


def test_a_repeat_and_another_model_start_new_conversations() -> None:
    index = PrefixIndex()
    m1, m2 = conversation(2)
    turn(index, "t1", m1, 1201, 0.186)
    again = turn(index, "again", m1, 1201, 0.186)  # the same request once more: a repeat
    assert (again.conversation_id, again.turn) == ("again", 1)
    other = turn(index, "o", m1, 1201, 0.186, model="other")  # another model, same messages
    assert (other.conversation_id, other.turn) == ("o", 1)
    # another model that extends the message list continues: nothing of it is reusable
    switched = turn(index, "s", m2, 1227, 0.19, model="big-model")
    assert switched.turn == 2 and switched.reprefill_cause == "model_changed"
    assert switched.reprefill_at.endswith(" -> big-model") and switched.prefix_reusable_tokens == 0
    assert "prompt_prefix_changed" in switched.anomalies


def agent(system_of, tools_of=None, messages_of=None, n: int = 4, cached_of=None) -> list[Record]:
    """`n` turns of a scripted agent on a server whose prompt cache works (cached_tokens as
    reported by `cached_of(turn, previous prompt)`, default: the previous prompt whole)."""
    index = PrefixIndex()
    out: list[Record] = []
    prompt = 1200
    for k in range(1, n + 1):
        msgs = [{"role": "system", "content": system_of(k)}] + conversation(k)[-1][1:]
        if messages_of is not None:
            msgs = messages_of(k, msgs)
        extra = {"tools": tools_of(k)} if tools_of is not None else None
        cached = (cached_of or (lambda k, p: 0 if k == 1 else p))(k, prompt)
        new = prompt + 26 if k > 1 else prompt
        ttft = (new - cached) / 6455 + 0.005
        out.append(turn(index, f"t{k}", msgs, new, ttft, cached=cached, extra=extra))
        prompt = new
    return out


def header(k: int) -> str:
    return f"x-anthropic-billing-header: cc_version=2.1.37; cch={k * 0x1F3A5:05x};\n" + SYSTEM


def test_each_cause_is_named_with_its_place() -> None:
    volatile = agent(header, cached_of=lambda k, p: 0 if k == 1 else 3)
    assert [r.reprefill_cause for r in volatile] == [None] + ["volatile_span"] * 3
    assert volatile[1].reprefill_at == "messages[0].content line 1: a-a-a-a: a_a=9.9.99; a=<hex:5>;"
    assert all(r.reprefill_lost_s > 0 for r in volatile[1:])
    assert volatile[-1].conversation_lost_s == pytest.approx(sum(r.reprefill_lost_s for r in volatile[1:]))
    clean = agent(lambda k: SYSTEM)
    assert [r.reprefill_cause for r in clean] == [None] * 4 and not any(r.anomalies for r in clean)
    changed = agent(lambda k: SYSTEM if k < 3 else SYSTEM.upper(), cached_of=lambda k, p: 0 if k in (1, 3) else p)
    assert [r.reprefill_cause for r in changed] == [None, None, "system_changed", None]

    def tool(name: str, desc: str = "does it") -> dict:
        return {"type": "function", "function": {"name": name, "description": desc, "parameters": {}}}

    tools = [tool("read"), tool("grep"), tool("edit")]
    cold_from_3 = lambda k, p: 0 if k == 1 or k >= 3 else p  # noqa: E731 (the server's answer to a changed prefix)
    reordered = agent(lambda k: SYSTEM, tools_of=lambda k: tools if k != 3 else tools[::-1], cached_of=cold_from_3)
    assert [r.reprefill_cause for r in reordered] == [None, None, "tools_changed", "tools_changed"]
    assert reordered[2].reprefill_at == "tools order"
    edited = agent(
        lambda k: SYSTEM,
        tools_of=lambda k: tools if k < 3 else [tools[0], tool("grep", "new"), tools[2]],
        cached_of=lambda k, p: 0 if k in (1, 3) else p,
    )
    assert edited[2].reprefill_at == "tools: grep changed"

    def compact(k: int, msgs: list) -> list:
        return msgs if k != 4 else [msgs[0], msgs[1], {"role": "assistant", "content": "summary"}, *msgs[-3:]]

    compacted = agent(lambda k: SYSTEM, messages_of=compact, cached_of=lambda k, p: 0 if k in (1, 4) else p)
    assert [r.reprefill_cause for r in compacted] == [None, None, None, "history_rewritten"]
    assert compacted[3].turn == 4 and compacted[3].reprefill_at.startswith("messages[2]")


def test_a_huge_model_name_is_bounded_in_reprefill_at() -> None:
    index = PrefixIndex()
    m1, m2 = conversation(2)
    turn(index, "t1", m1, 1201, 0.186)
    r = turn(index, "t2", m2, 1227, 0.19, model="x" * 100_000 + "\n")
    assert r.reprefill_cause == "model_changed" and len(r.reprefill_at) < 150 and "\n" not in r.reprefill_at


def test_a_reprefill_costs_its_lost_tokens_at_the_upstreams_cold_rate() -> None:
    """Aider 0.86.2 on mlx_lm.server 0.32.2 (``tests/fixtures/sessions/aider_0.86.2__mlx-lm``):
    turn 1 prefilled 1,347 tokens cold in 0.654 s (2,060 tok/s); turn 4 rewrote the history at
    messages[9], cached 913 of 1,448 (exactly the common prefix), so 503 of the previous prompt's
    1,416 tokens were prefilled again, in a TTFT of 0.305 s. The server measured the loss as
    0.208 s (that TTFT minus the same prompt's warm 0.097 s). The TTFT's share (0.305 x 503 / 535
    = 0.287 s) charges the lost tokens with a fixed cost no hit in this session could fit; 503
    tokens at the upstream's cold rate (0.244 s) is the tighter bound, within 20% of the measure."""
    first_rate = 1347 / 0.654
    r = Record(
        id="t4", started_at=0.0, upstream="u", model="m", endpoint="chat", stream=True, status=200, outcome="ok",
        ttft_s=0.305, prompt_tokens=1448, cached_tokens=913,
    )  # fmt: skip
    m = Match(
        "t1", 4, "t3", 1416, previous_chars=1416 * 4, shared_chars=913 * 4, extends=False,
        diverged_at="messages[9].content char 0", previous_end_s=0.0,
        change=Change("history_rewritten", "messages[9].content char 0"), cold_prefill_tps=first_rate,
    )  # fmt: skip
    v = check_turn(r, m, CacheFacts(cold_rate=first_rate), TH)
    assert v.reprefill is not None and (v.reprefill.cause, v.reprefill.lost_tokens) == ("history_rewritten", 503)
    assert v.lost_s == pytest.approx(503 / first_rate)
    measured = 0.305 - 0.097
    assert abs(v.lost_s - measured) <= 0.2 * measured
    # without a cold rate to go by, the TTFT's share is all there is
    alone = check_turn(r, m._replace(cold_prefill_tps=None), CacheFacts(), TH)
    assert alone.lost_s == pytest.approx(0.305 * 503 / 535)


PASTE = "A long document the user pasted into the conversation, line after line.\n" * 560  # ~40,000 characters
AGENT_SYSTEM = SYSTEM * 8  # ~9,600 tokens: an agent's system prompt and tools (OpenCode's ~17,000)


def pasted(n: int, first: str = "Summarize this:") -> list[list]:
    """An agent's first `n` turns after a user pasted a document (~10,000 tokens of messages past
    a ~9,600-token system prompt), each turn extending the previous."""
    msgs: list = [{"role": "system", "content": AGENT_SYSTEM}, {"role": "user", "content": f"{first}\n\n{PASTE}"}]
    out = [msgs]
    for k in range(1, n):
        msgs = msgs + [{"role": "assistant", "content": f"answer {k}"}, {"role": "user", "content": f"and {k}?"}]
        out.append(msgs)
    return out


def tokens_of(messages: list) -> int:
    return sum(len(m["content"]) for m in messages) // 4


RATE = 8000.0  # tok/s cold
FIXED = 0.05  # a hit's fixed cost


def extended_turns(index: PrefixIndex, keeps: str, first: str = "Summarize this:", rid: str = "p") -> list[Record]:
    """Three turns of `pasted` on a server that keeps the conversation (`keeps` "conversation":
    each turn prefills only its new tokens) or only the system prompt ("system": everything
    after it is prefilled again); vllm-mlx-like usage (prompt tokens, no cached_tokens)."""
    out = []
    system = len(AGENT_SYSTEM) // 4
    previous = 0
    for k, msgs in enumerate(pasted(3, first)):
        whole = tokens_of(msgs)
        if k == 0:
            ttft = whole / RATE
        elif keeps == "system":
            ttft = FIXED + (whole - system) / RATE
        else:
            ttft = FIXED + (whole - previous) / RATE
        out.append(turn(index, f"{rid}{k}", msgs, whole, ttft))
        previous = whole
    return out


def aider_rewrite(index: PrefixIndex, ttft: float = 0.6) -> Record:
    """Aider-like: turn 2 inserts the history before its fixed pair (a rewrite past the system
    prompt), ~3,000 tokens of the previous prompt after the change; its TTFT re-prefills them."""
    example = [{"role": "user", "content": "Change the greeting."}, {"role": "assistant", "content": "Ok, I will."}]
    fixed = [{"role": "user", "content": "I am not sharing any files."}, {"role": "assistant", "content": "Ok."}]
    ask = "Explain the weather models in detail.\n" + "Some context line.\n" * 600
    one = [{"role": "system", "content": SYSTEM}, *example, *fixed, {"role": "user", "content": ask}]
    two = [
        {"role": "system", "content": SYSTEM},
        *example,
        {"role": "user", "content": ask},
        {"role": "assistant", "content": "It is sunny."},
        *fixed,
        {"role": "user", "content": "again"},
    ]
    turn(index, "a1", one, tokens_of(one), tokens_of(one) / RATE)
    return turn(index, "a2", two, tokens_of(two), ttft)


def test_a_cache_that_keeps_only_the_system_prompt_is_learned_from_extended_turns() -> None:
    """vllm-mlx 0.6.0 (default SimpleEngine: `System KV cache HIT ... prefilling N new`) re-prefills
    every message after the system prompt: the extended turns' TTFT grows with the conversation.
    The first turn that shows it names no cause (one turn cannot tell such a cache from an eviction
    that left the system part); from the second on, the loss is `cache_system_only`: the messages a
    cache of the conversation would have reused, at the cold rate, with the server's fix, and no
    alarm (nothing failed: the server never keeps them)."""
    index = PrefixIndex()
    recs = extended_turns(index, "system")
    assert [r.turn for r in recs] == [1, 2, 3]
    for r in recs[1:]:
        assert "only the system part was reused" in r.cache_evidence, r.cache_evidence
        assert "prefix_cache_miss" not in r.anomalies
        # the hidden hit of the ~1,200-token system part: usage reports the prompt, no cached_tokens
        assert "cached_tokens_unreported" in r.anomalies
        assert "the cache reused ~" in r.anomaly_evidence["cached_tokens_unreported"]
    first, second = recs[1:]
    assert first.reprefill_cause is None and first.reprefill_lost_s is None
    assert "the first turn on this upstream to show it" in first.cache_evidence
    assert (second.reprefill_cause, second.reprefill_at) == ("cache_system_only", None)
    messages = tokens_of(pasted(3)[1]) - len(AGENT_SYSTEM) // 4  # the previous prompt past the system part
    assert second.reprefill_lost_s == pytest.approx(messages / RATE, rel=0.05)
    assert second.conversation_lost_s == pytest.approx(second.reprefill_lost_s)
    assert "2 turns on this upstream that extended their conversation, this one included" in second.cache_evidence
    assert second.reprefill_fix == FIXES["cache_system_only"] and "--continuous-batching" in second.reprefill_fix
    facts = index.facts()
    assert (facts.reach, facts.reach_turns) == ("system", 2)
    # a hit's fixed cost was fitted against the system part's hit, not against a whole-prefix hit
    assert facts.fixed_s == pytest.approx(FIXED, abs=0.02)
    # then a history rewrite past the system prompt costs nothing on this server, and says why
    rewrite = aider_rewrite(index)
    assert rewrite.reprefill_cause == "history_rewritten" and rewrite.reprefill_lost_s == 0.0
    assert "reused only the system prompt on 2 earlier turns" in rewrite.cache_evidence
    assert "cost nothing here (0 s lost)" in rewrite.cache_evidence
    assert not {"prompt_prefix_changed", "prefix_cache_miss"} & set(rewrite.anomalies)


def test_on_a_system_only_cache_a_rewrite_that_looks_like_a_hit_is_priced_by_the_reach() -> None:
    """A rewrite's TTFT below a hit of the whole previous prompt (its cold turn 1 measured slow on a
    loaded machine: live, Aider's 0.06 s against ~0.12 s cold) on a server known to keep the system
    prompt only: it cannot have reused past the change, so the reach says why it cost 0 s, not
    "neutralized"."""
    index = PrefixIndex()
    extended_turns(index, "system")
    rewrite = aider_rewrite(index, ttft=0.02)
    assert rewrite.reprefill_cause == "history_rewritten" and rewrite.reprefill_lost_s == 0.0
    assert "reused only the system prompt on 2 earlier turns" in rewrite.cache_evidence, rewrite.cache_evidence
    assert "neutralized" not in rewrite.cache_evidence


def test_a_cache_that_keeps_the_conversation_prices_the_rewrite() -> None:
    index = PrefixIndex()
    recs = extended_turns(index, "conversation")
    assert all("suggests a hit" in r.cache_evidence for r in recs[1:])
    assert index.facts().reach == "conversation"
    rewrite = aider_rewrite(index)
    assert rewrite.reprefill_cause == "history_rewritten"
    assert rewrite.reprefill_lost_s is not None and rewrite.reprefill_lost_s > 0.2
    assert "uncertain" not in rewrite.cache_evidence


def test_without_evidence_of_the_cache_the_rewrites_seconds_are_uncertain() -> None:
    """Aider alone on a server that reports no cached_tokens: its TTFT shows the re-prefill, but
    not whether the server would have reused the history (a prefix cache) or never does (a
    system-prompt cache): no confident figure, both bounds said."""
    rewrite = aider_rewrite(PrefixIndex())
    assert rewrite.reprefill_cause == "history_rewritten" and rewrite.reprefill_lost_s is None
    ev = rewrite.cache_evidence
    assert "the seconds are uncertain" in ev and "0 s where it keeps only the system prompt" in ev
    assert rewrite.conversation_lost_s == 0.0


def test_a_short_message_part_or_a_hits_fixed_cost_teaches_nothing() -> None:
    """A hit whose TTFT is its fixed cost (0.41 s on vllm-mlx) must not read as a re-prefill of a
    short message part: the reach is judged only where the messages take REACH_MIN_S to prefill."""
    index = PrefixIndex()
    m1, m2, m3 = conversation(3)  # a ~1,200-token system prompt, a few short messages
    turn(index, "s1", m1, 1201, 1201 / RATE)
    turn(index, "s2", m2, 1227, 0.41)
    turn(index, "s3", m3, 1250, 0.40)
    assert index.facts().reach is None


def test_a_slow_turn_on_a_known_system_only_cache_is_no_eviction() -> None:
    """Once an upstream has shown it keeps the system prompt only, an extended turn whose TTFT is
    nearer a cold prefill than a hit of the system part tells nothing about the system part (its
    share is small against a noisy cold rate): no `cache_evicted`. On an upstream not known so, the
    same TTFT is no eviction either where a hit of the system part would predict more than half a
    cold prefill (here ~0.51 of it: the TTFT cannot tell the two), and is one where the system part
    is most of the prompt (a hit of it predicts ~0.34 of a cold prefill)."""
    index = PrefixIndex()
    extended_turns(index, "system")
    assert index.facts().reach == "system"
    msgs = pasted(2, first="Now this:")
    whole = [tokens_of(m) for m in msgs]
    turn(index, "q0", msgs[0], whole[0], whole[0] / RATE)
    slow = turn(index, "q1", msgs[1], whole[1], whole[1] / RATE)  # all of it prefilled again, it seems
    assert not {"prefix_cache_miss", "cached_tokens_unreported"} & set(slow.anomalies)
    assert "tells neither whether the system part" in slow.cache_evidence
    # the messages were prefilled again all the same: that loss is named, at the cold rate
    assert slow.reprefill_cause == "cache_system_only"
    messages = whole[0] - len(AGENT_SYSTEM) // 4
    assert slow.reprefill_lost_s == pytest.approx(messages / RATE, rel=0.05)
    fresh = PrefixIndex()
    turn(fresh, "f0", msgs[0], whole[0], whole[0] / RATE)
    told = turn(fresh, "f1", msgs[1], whole[1], whole[1] / RATE)
    assert told.reprefill_cause is None and not {"prefix_cache_miss", "cache_evicted"} & set(told.anomalies)
    assert "too near a cold prefill" in told.cache_evidence and "no eviction named" in told.cache_evidence
    assert "the first turn on this upstream to show it" in told.cache_evidence
    big = [[{"role": "system", "content": AGENT_SYSTEM * 2}, *m[1:]] for m in msgs]
    whole = [tokens_of(m) for m in big]
    fresh = PrefixIndex()
    turn(fresh, "b0", big[0], whole[0], whole[0] / RATE)
    evicted = turn(fresh, "b1", big[1], whole[1], whole[1] / RATE)
    assert evicted.reprefill_cause == "cache_evicted" and "prefix_cache_miss" in evicted.anomalies
    assert "suggests the whole prompt was prefilled again" in evicted.cache_evidence


def test_a_short_message_part_as_slow_as_cold_is_no_eviction_where_a_system_hit_tells_nothing() -> None:
    """Messages past the system part too short for the TTFT to show how far the cache reached (under
    `REACH_MIN_S` at the cold rate), but more than half the prompt: a TTFT as slow as a cold prefill
    is what a hit of the ~1,200-token system part gives too (~0.6 of cold), so no eviction is named;
    with no system part to reuse, the same TTFT is one."""
    ask = {"role": "user", "content": "Explain this.\n" + "Some context line.\n" * 500}
    one = [{"role": "system", "content": SYSTEM}, ask]
    two = [*one, {"role": "assistant", "content": "Sure."}, {"role": "user", "content": "more"}]
    index = PrefixIndex()
    turn(index, "m0", one, tokens_of(one), tokens_of(one) / RATE)
    slow = turn(index, "m1", two, tokens_of(two), tokens_of(two) / RATE)
    assert slow.reprefill_cause is None and "prefix_cache_miss" not in slow.anomalies, slow.cache_evidence
    assert "suggests a re-prefill" in slow.cache_evidence and "too near a cold prefill" in slow.cache_evidence
    bare = [one[1:], two[1:]]
    index = PrefixIndex()
    turn(index, "n0", bare[0], tokens_of(bare[0]), tokens_of(bare[0]) / RATE)
    evicted = turn(index, "n1", bare[1], tokens_of(bare[1]), tokens_of(bare[1]) / RATE)
    assert evicted.reprefill_cause == "cache_evicted" and "prefix_cache_miss" in evicted.anomalies


def test_a_server_that_counts_its_system_only_hits_names_the_loss_from_its_counts() -> None:
    """A server that reports `cached_tokens` and keeps only the system prompt: each extended turn
    counts the system part cached, no more. The first such turn is an eviction as before (one turn
    cannot tell); once two have shown it, the count names `cache_system_only` (no alarm), the lost
    tokens the reusable ones past the count, whatever the TTFT."""
    index = PrefixIndex()
    system = len(AGENT_SYSTEM) // 4
    msgs = pasted(4)
    whole = [tokens_of(m) for m in msgs]
    turn(index, "c0", msgs[0], whole[0], whole[0] / RATE, cached=0)
    first = turn(index, "c1", msgs[1], whole[1], FIXED + (whole[1] - system) / RATE, cached=system)
    assert first.reprefill_cause == "cache_evicted" and "prefix_cache_miss" in first.anomalies
    for k in (2, 3):
        rec = turn(index, f"c{k}", msgs[k], whole[k], FIXED + (whole[k] - system) / RATE, cached=system)
        assert rec.reprefill_cause == "cache_system_only" and "prefix_cache_miss" not in rec.anomalies
        assert rec.cache_evidence.startswith(f"cached_tokens {system} of ~")
        assert "the system part (~" in rec.cache_evidence and "this one included" in rec.cache_evidence
        assert rec.reprefill_lost_s == pytest.approx((whole[k - 1] - system) / RATE, rel=0.05)


def test_a_slow_second_turn_that_shows_the_system_only_cache_is_no_eviction() -> None:
    """A turn as slow as a cold prefill (a loaded machine: 2.61 s against 2.54 s cold, vllm-mlx
    logging its usual hit of the system part) right after one turn showed the cache keeping the
    system prompt only: with it, two turns show that, so it is `cache_system_only`, no alarm."""
    index = PrefixIndex()
    system = len(AGENT_SYSTEM) // 4
    msgs = pasted(3)
    whole = [tokens_of(m) for m in msgs]
    turn(index, "s0", msgs[0], whole[0], whole[0] / RATE)
    first = turn(index, "s1", msgs[1], whole[1], FIXED + (whole[1] - system) / RATE)
    assert first.reprefill_cause is None and "only the system part was reused" in first.cache_evidence
    slow = turn(index, "s2", msgs[2], whole[2], 1.03 * whole[2] / RATE)
    assert slow.reprefill_cause == "cache_system_only" and "prefix_cache_miss" not in slow.anomalies
    assert "tells neither whether the system part" in slow.cache_evidence
