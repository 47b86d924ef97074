"""Truth checks: name what a server (or another tool) gets wrong, with the evidence.

Pure functions over finished records. `check_record` looks at one record;
`find_serialized` at a set of records that overlapped in time on one upstream;
`prefill_scaling` at a run with prompts of several sizes. Every threshold is a field of
`Thresholds` (config key `detectors:`), documented in docs/ANOMALIES.md.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple, get_args

from mlxproxy.core.claims import audit
from mlxproxy.core.meter import Measurement
from mlxproxy.core.native import DIALECT_APIS
from mlxproxy.core.openai import GENERATION_ENDPOINTS, parse_context_limit
from mlxproxy.core.record import OK_OUTCOMES, Record, TokensSource
from mlxproxy.core.stats import percentile
from mlxproxy.core.text import clip
from mlxproxy.core.tools import TOOL_FINISH

__all__ = [
    "Thresholds",
    "Anomaly",
    "AnomalyKind",
    "ANOMALY_KINDS",
    "check_record",
    "find_serialized",
    "find_abandoned",
    "check_markup",
    "prefill_scaling",
    "findings",
    "verdict",
    "is_burst",
    "Verdict",
    "Measured",
    "Stalls",
    "estimated_tokens",
    "streamed_band",
    "trusted_count",
    "prefill_judgeable",
    "uncached_prompt_tokens",
    "MOSTLY_CACHED",
    "stall_stats",
    "check_tools",
    "fmt_number",
]

AnomalyKind = Literal[
    "usage_mismatch",
    "phantom_speed",
    "usage_missing",
    "non_incremental_stream",
    "stall",
    "context_limit",
    "missing_finish",
    "stream_error",
    "duplicate_content",
    "dual_reasoning_fields",
    "unreported_length",
    "silent_prefill",
    "serialized",
    "superlinear_prefill",
    "tool_call_in_content",
    "invalid_tool_arguments",
    "tool_call_finish_mismatch",
    "prefix_cache_miss",
    "prompt_prefix_changed",
    "truncated_tool_call",
    "generation_after_disconnect",
    "reasoning_in_content",
    "reasoning_only",
    "cached_tokens_unreported",
    "cached_tokens_claimed_cold",
    "speed_claim_mismatch",
]
ANOMALY_KINDS: tuple[AnomalyKind, ...] = get_args(AnomalyKind)


@dataclass(frozen=True)
class Thresholds:
    """Detector thresholds (units in the names). Defaults are chosen to stay silent on
    every healthy server style in docs/WIRE.md#what-each-server-sends while catching each benchmark pathology."""

    usage_min_tokens: int = 16  # below this many tokens the usage checks do not judge
    usage_extra_tokens: int = 3  # EOS and think-control tokens a server may count but not stream
    usage_ratio: float = 2.0  # reported / streamed-estimate above this: usage_mismatch
    phantom_ratio: float = 3.0  # ... above this (and enough tokens): phantom_speed
    phantom_min_tokens: int = 20
    chars_per_token: float = 4.0  # streamed-token estimate for coarse chunks: chars / this
    max_chars_per_token: float = 24.0  # no real text averages more per token: chars / this is a floor
    tokenizer_tolerance: float = 0.10  # a tokenizer recount may miss the generated count by this fraction
    tool_call_tokens: int = 24  # tokens per tool call that no recount sees (markup a parser strips)
    burst_min_tokens: int = 20
    burst_fraction: float = 0.05  # all tokens within this fraction of the response time...
    burst_min_tps: float = 10000.0  # ...at a rate no local decoder reaches: non_incremental_stream
    tokens_per_event_max: float = 8.0
    stall_factor: float = 10.0  # a gap this many times the stream's median gap...
    stall_min_s: float = 1.0  # ...and at least this long is a stall
    stall_min_gaps: int = 5
    cyclic_cv_max: float = 0.25  # stall spacing this regular (coefficient of variation) is cyclic
    silent_prefill_s: float = 120.0  # no byte at all this long after the headers
    serialized_min_wait_s: float = 1.0  # waited this long for another stream (> 2 admission slices of 0.5 s)
    abandoned_min_wait_s: float = 1.0  # generation_after_disconnect: a TTFT at least this long...
    abandoned_ttft_factor: float = 5.0  # ...and this many times its usual TTFT on the upstream
    superlinear_factor: float = 3.0  # prefill tok/s this many times lower at the largest prompt
    superlinear_min_size_ratio: float = 4.0
    prefix_min_tokens: int = 1024  # a reusable prefix (or a thrown-away one) this long is judged
    prefix_miss_ratio: float = 0.5  # cached_tokens below this fraction of the reusable prefix: prefix_cache_miss
    cache_timing_min_s: float = 0.05  # a hit must save this much prefill for TTFT to judge the cache
    speed_claim_ratio: float = 2.0  # a server's own tok/s this many times off its recomputation: speed_claim_mismatch
    speed_claim_min_s: float = 0.05  # a decode claim is judged over at least this much streaming...
    speed_claim_min_tokens: int = 8  # ...and at least this many tokens


@dataclass(frozen=True, slots=True)
class Anomaly:
    kind: AnomalyKind
    evidence: str


# what the per-request checks read: a finished meter's measurement, or a record (earlier ones,
# records read back from files, the tests' own)
Measured = Measurement | Record
Stalls = tuple[list[int], list[float]]  # `stall_stats`: the stalls' gap indices and lengths


def _dur(seconds: float) -> str:
    """A duration with a unit that suits it: "0.17 ms", "42 ms", "2.48 s"."""
    if abs(seconds) < 0.001:
        return f"{seconds * 1000:.2f} ms"
    if abs(seconds) < 1:
        return f"{seconds * 1000:.0f} ms"
    return f"{seconds:.2f} s"


def _fmt(x: float) -> str:
    if x >= 100:
        return f"{x:.0f}"
    if x >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}" if x >= 0.1 else f"{x:.3g}"


fmt_number = _fmt  # the evidence's number format, for the other checks (core.cachecheck)


def estimated_tokens(
    r: Measured, chars: int | None, th: Thresholds, *, nonascii_chars: int = 0, nonascii_bytes: int = 0
) -> int | None:
    """Output tokens actually streamed, best guess (the middle of `streamed_band`): the
    tokenizer's count when there is one, else the generated events, or the text's estimate
    when that is more (servers that send several tokens per event): ASCII characters /
    chars_per_token plus one token per two UTF-8 bytes of other characters."""
    return streamed_band(r, chars, th, nonascii_chars=nonascii_chars, nonascii_bytes=nonascii_bytes)[1]


def streamed_band(
    r: Measured, chars: int | None, th: Thresholds, *, nonascii_chars: int = 0, nonascii_bytes: int = 0
) -> tuple[int, int, int] | tuple[None, None, None]:
    """(low, estimate, high): the output tokens a stream can have carried, given what it
    shows. A usage count outside [low, high] (each widened by `usage_extra_tokens`) cannot
    be explained by the estimate's error (docs/METRICS.md, "Estimates and their error").

    - low: every generated event carries at least one token. When the stream is
      consistent with one token per event (at least as many events as the usage counts,
      less `usage_extra_tokens`, and at most `max_chars_per_token` characters per event)
      the events are the count and low is E. Otherwise (coarse chunks) low is also at
      least T / (1 + tokenizer_tolerance) with a tokenizer count T, else chars /
      max_chars_per_token: re-encoding text need not give back the generated tokens
      (non-canonical splits re-encode to more, or fewer, tokens).
    - estimate: T, else max(E, ASCII chars / chars_per_token + non-ASCII UTF-8 bytes / 2).
    - high: with T, T * (1 + tokenizer_tolerance); else usage_ratio x the estimate (text
      down to 2 characters, or one byte, per token); never below E; plus
      `tool_call_tokens` per tool call (markup a server's parser strips).
    """
    events = r.completion_tokens_counted
    if events is None:
        return None, None, None
    tools = r.tool_calls * th.tool_call_tokens
    tok = r.completion_tokens_tokenizer
    rep = r.completion_tokens_reported
    one_per_event = (
        rep is not None
        and events >= rep - th.usage_extra_tokens
        and (chars or 0) <= th.max_chars_per_token * max(events, 1)
    )
    if tok is not None:
        low = events if one_per_event else max(events, math.floor(tok / (1.0 + th.tokenizer_tolerance)))
        est = max(events, tok)
        return low, est, max(est, math.ceil(tok * (1.0 + th.tokenizer_tolerance)) + tools)
    est = low = events
    if chars:
        ascii_chars = max(chars - nonascii_chars, 0)
        est = max(events, math.ceil(ascii_chars / th.chars_per_token + nonascii_bytes / 2.0))
        if not one_per_event:
            low = max(events, math.ceil(chars / th.max_chars_per_token))
    return low, est, math.floor(th.usage_ratio * est) + tools


def stall_stats(r: Measured, th: Thresholds) -> tuple[list[int], list[float]]:
    """Indices (gap i is between events i and i+1) and lengths of the stalls."""
    offs = r.event_offsets_s
    gaps = [b - a for a, b in zip(offs, offs[1:])]
    if len(gaps) < th.stall_min_gaps:
        return [], []
    med = percentile(sorted(gaps), 50) or 0.0
    floor = max(th.stall_factor * med, th.stall_min_s)
    idx = [i for i, g in enumerate(gaps) if g > floor]
    return idx, [gaps[i] for i in idx]


def _cyclic(idx: list[int], th: Thresholds) -> float | None:
    """The stall period in events when stalls recur regularly (>= 3 stalls), else None. Gaps
    back to back (one event between them) are one stall, however many gaps it spans: a
    server that paused once, with a token or two in the middle, is not cyclic."""
    idx = [i for k, i in enumerate(idx) if k == 0 or idx[k - 1] < i - 1]  # where each stall starts
    if len(idx) < 3:
        return None
    spacing = [b - a for a, b in zip(idx, idx[1:])]
    mean = sum(spacing) / len(spacing)
    if mean <= 0:
        return None
    sd = math.sqrt(sum((s - mean) ** 2 for s in spacing) / len(spacing))
    return mean if sd / mean <= th.cyclic_cv_max else None


def check_record(
    r: Measured,
    th: Thresholds,
    *,
    chars: int | None = None,
    nonascii_chars: int = 0,
    nonascii_bytes: int = 0,
    headers_to_first_byte_s: float | None = None,
    stalls: tuple[list[int], list[float]] | None = None,
) -> list[Anomaly]:
    """The anomalies of one finished request. `chars` is the number of generated
    characters streamed (content + reasoning + tool names and arguments), when known;
    `nonascii_chars` of them are not ASCII and take `nonascii_bytes` bytes in UTF-8.
    `stalls`: `stall_stats` of `r`, when the caller has them already. A refused prompt is
    read from `r`'s outcome and error text (a finished meter's `Measurement` says so itself:
    `findings`)."""
    refused = r.outcome == "context_limit" or (r.outcome == "stream_error" and parse_context_limit(r.error)[0])
    return _record_checks(r, th, refused, chars, nonascii_chars, nonascii_bytes, headers_to_first_byte_s, stalls)


def _record_checks(
    r: Measured,
    th: Thresholds,
    refused: bool,
    chars: int | None,
    nonascii_chars: int,
    nonascii_bytes: int,
    headers_to_first_byte_s: float | None,
    stalls: Stalls | None,
) -> list[Anomaly]:
    """`check_record`, told whether the prompt was refused as too long (`refused`)."""
    out = _failure_checks(r, th, refused, headers_to_first_byte_s)
    if r.outcome not in OK_OUTCOMES:
        return out
    cut_call = _usage_checks(r, th, out, chars, nonascii_chars, nonascii_bytes)
    if r.event_offsets_s:  # streamed events: their pace (a body that was not streamed has none)
        _burst_check(r, th, out)
        _stall_check(r, th, out, stall_stats(r, th) if stalls is None else stalls)
    _length_check(r, th, out, chars, cut_call)
    if r.server_claims:
        for evidence in audit(r, th.speed_claim_ratio, th.speed_claim_min_s, th.speed_claim_min_tokens):
            out.append(Anomaly("speed_claim_mismatch", evidence))
            break  # one of each kind (the first disagreeing figure)
    return out


def _failure_checks(r: Measured, th: Thresholds, refused: bool, headers_to_first_byte_s: float | None) -> list[Anomaly]:
    """What any request can show, ok or not: a refused prompt, an error in a stream, a stream
    without finish, doubled reasoning fields, a replayed answer, a long silence after the headers."""
    out: list[Anomaly] = []
    add = out.append
    sse = r.completion_tokens_counted is not None
    # context limit: an HTTP 400/413 or an in-stream error saying the prompt is too long
    if refused:
        if r.context_prompt_tokens is not None and r.context_limit_tokens is not None:
            ev = f"prompt of {r.context_prompt_tokens} tokens refused: the limit is {r.context_limit_tokens} tokens"
        elif r.context_limit_tokens is not None:
            ev = f"prompt refused: the limit is {r.context_limit_tokens} tokens"
        else:
            ev = f"prompt refused as too long: {clip(r.error or '', 160)}"
        add(Anomaly("context_limit", f"HTTP {r.status}: {ev}"))
    if r.outcome == "stream_error":
        add(
            Anomaly(
                "stream_error",
                f"error object inside a {r.status} stream: {clip(r.error or '', 160)}"
                + (f" (followed by finish_reason {r.finish_reason!r})" if r.finish_reason else ""),
            )
        )
    if sse and r.outcome == "truncated":
        add(
            Anomaly(
                "missing_finish",
                f"stream ended {_end_event(r)}after {r.generated_events} generated events without any finish_reason",
            )
        )
    if r.dual_reasoning_events:
        add(
            Anomaly(
                "dual_reasoning_fields",
                f"{r.dual_reasoning_events} deltas carried both `reasoning` and "
                "`reasoning_content`: a client summing both counts every reasoning token twice",
            )
        )
    if r.duplicate_content:
        add(Anomaly("duplicate_content", "a final chunk repeated the whole answer already streamed"))
    if headers_to_first_byte_s is not None and headers_to_first_byte_s > th.silent_prefill_s:
        add(
            Anomaly(
                "silent_prefill",
                f"{_fmt(headers_to_first_byte_s)} s without a single byte after the headers "
                f"(limit {_fmt(th.silent_prefill_s)} s): clients with idle timeouts give up",
            )
        )
    return out


def _usage_checks(
    r: Measured, th: Thresholds, out: list[Anomaly], chars: int | None, nonascii_chars: int, nonascii_bytes: int
) -> bool:
    """Does the stream explain the server's count? Adds to `out`; True when a tool call was cut
    by the token limit and withheld (`truncated_tool_call`)."""
    add = out.append
    sse = r.completion_tokens_counted is not None
    rep = r.completion_tokens_reported
    low, est, high = (
        streamed_band(r, chars, th, nonascii_chars=nonascii_chars, nonascii_bytes=nonascii_bytes)
        if sse
        else (None, None, None)
    )
    if sse and rep is None and (r.usage_requested or r.usage_injected):
        add(Anomaly("usage_missing", "usage was asked for (stream_options.include_usage) but the stream carried none"))
    elif sse and rep is None and r.endpoint in ("messages", "responses"):
        add(Anomaly("usage_missing", f"the {r.endpoint} stream reported no output_tokens (this API always should)"))
    elif not sse and rep is None and r.endpoint in GENERATION_ENDPOINTS and r.status == 200:
        add(Anomaly("usage_missing", "the response carried no usage object"))
    cut_call = est is not None and _cut_tool_call(r, est, th)
    if cut_call:
        # tools offered, the token limit reached, no call came back and usage counts tokens the stream
        # lacks: the server's tool parser held back the unfinished call and dropped it. The tokens were
        # generated (not a phantom rate), and an agent gets an empty answer. Judged at any size.
        add(
            Anomaly(
                "truncated_tool_call",
                f"usage says {rep} output tokens but {est} were streamed, finish "
                f"{r.finish_reason!r} at max_tokens {r.max_tokens} with tools offered and no tool call back: "
                "a tool call cut by the token limit that the server's tool parser held back and never sent",
            )
        )
    if (
        rep is not None
        and est is not None
        and low is not None
        and high is not None
        and max(rep, est) >= th.usage_min_tokens
    ):
        _count_checks(r, th, out, chars, rep, (low, est, high), cut_call)
    return cut_call


def _count_checks(
    r: Measured,
    th: Thresholds,
    out: list[Anomaly],
    chars: int | None,
    rep: int,
    band: tuple[int, int, int],
    cut_call: bool,
) -> None:
    """`usage_mismatch` (the reported count outside what the stream allows) and `phantom_speed`
    (a count the stream cannot have carried), for a count large enough to judge."""
    add = out.append
    low, est, high = band
    tok = r.completion_tokens_tokenizer
    if rep > high + th.usage_extra_tokens or low > rep + th.usage_extra_tokens:
        seen = (
            f"tokenizer count {tok}"
            if tok is not None
            else f"{est} streamed ({r.generated_events} events{f', {chars} chars' if chars else ''})"
        )
        add(
            Anomaly(
                "usage_mismatch",
                f"usage says {rep} output tokens, {seen}; the stream allows {low}..{high} (+{th.usage_extra_tokens})",
            )
        )
    window = None
    if r.event_offsets_s and len(r.event_offsets_s) >= 2:
        window = r.event_offsets_s[-1] - r.event_offsets_s[0]
    base = est + r.tool_calls * th.tool_call_tokens
    if rep >= th.phantom_min_tokens and rep > th.phantom_ratio * base and not cut_call:
        if window and window > 0:
            implied = (rep - 1) / window
            real = max(est - 1, 1) / window
            add(
                Anomaly(
                    "phantom_speed",
                    f"usage says {rep} tokens, {est} streamed in {_fmt(window)} s: "
                    f"{_fmt(implied)} tok/s would be implausible (streamed rate {_fmt(real)} tok/s)",
                )
            )
        else:
            add(Anomaly("phantom_speed", f"usage says {rep} tokens but only {est} were streamed"))


def _burst_check(r: Measured, th: Thresholds, out: list[Anomaly]) -> None:
    """Burst at the end: no incremental streaming (judged on the count the speeds will use)."""
    # A stream with tool calls is not judged: servers' tool parsers send a whole call as one
    # delta by design (mlx_lm.server, vllm-mlx, mlx-openai-server), however incremental the rest.
    n_out = trusted_count(r, [a.kind for a in out])[0]
    sse = r.completion_tokens_counted is not None
    if sse and not r.tool_calls and n_out is not None and n_out >= th.burst_min_tokens and r.duration_s:
        window = (r.event_offsets_s[-1] - r.event_offsets_s[0]) if r.event_offsets_s else 0.0
        rate = math.inf if window <= 0 else (n_out - 1) / window
        tpe = n_out / r.generated_events if r.generated_events else math.inf
        if (window < th.burst_fraction * r.duration_s and rate > th.burst_min_tps) or tpe > th.tokens_per_event_max:
            ttft = r.ttft_s or 0.0
            e2e = r.e2e_s or r.duration_s
            out.append(
                Anomaly(
                    "non_incremental_stream",
                    f"{n_out} tokens in {r.generated_events} events arrived "
                    f"within {window * 1000:.1f} ms; TTFT {_fmt(ttft)} s is {100 * ttft / e2e:.0f}% of E2E "
                    f"{_fmt(e2e)} s",
                )
            )


def _stall_check(r: Measured, th: Thresholds, out: list[Anomaly], stalls: tuple[list[int], list[float]]) -> None:
    """Stalls during decode (`stalls`: `stall_stats` of `r`)."""
    idx, lengths = stalls
    if idx:
        period = _cyclic(idx, th)
        total = sum(lengths)
        ev = f"{len(idx)} gap{'s' if len(idx) != 1 else ''} over {_fmt(max(th.stall_min_s, 0))} s and {_fmt(th.stall_factor)}x the median gap, {_fmt(total)} s in all, longest {_fmt(max(lengths))} s"
        if period is not None:
            ev += f"; cyclic: every ~{period:.0f} events"
        out.append(Anomaly("stall", ev))


def _length_check(r: Measured, th: Thresholds, out: list[Anomaly], chars: int | None, cut_call: bool) -> None:
    """A natural finish reason although the generated count reached max_tokens."""
    rep = r.completion_tokens_reported
    if r.finish_reason in ("stop", "end_turn", "completed") and r.max_tokens is not None and rep is not None:
        n, seen = _generated_count(r, chars, th)
        if cut_call:  # nothing of the cut call was streamed, and a cut call has no EOS: usage is the count
            n, seen = rep, f"usage {rep} (a withheld tool call, no EOS)"
        if n >= r.max_tokens:
            out.append(
                Anomaly(
                    "unreported_length",
                    f"finish_reason {r.finish_reason!r} although {seen} reached "
                    f"max_tokens {r.max_tokens} (usage {rep})",
                )
            )


def _cut_tool_call(r: Measured, est: int, th: Thresholds) -> bool:
    """Tools were offered, the token limit ended the response (a limit finish reason, or
    usage at `max_tokens`: mlx-openai-server says `stop`), no structured call came back, and
    usage counts more than `usage_extra_tokens` tokens beyond what the stream carried."""
    rep = r.completion_tokens_reported
    if r.tool_calls_valid is None or r.tool_calls or rep is None or rep <= est + th.usage_extra_tokens:
        return False
    return r.finish_reason in _LIMIT_FINISH or (r.max_tokens is not None and rep >= r.max_tokens)


def _generated_count(r: Measured, chars: int | None, th: Thresholds) -> tuple[int, str]:
    """The tokens the model generated, without the end-of-sequence token that many servers
    count in usage (mlx_lm.server, mlx-openai-server, Rapid-MLX, mlx-vlm: 20 words + EOS =
    21): the stream's events when they are one per token, else the tokenizer's recount
    of the stream, else usage less `usage_extra_tokens` (the EOS and control tokens a server may
    count but not stream), and for a non-streamed body usage less one."""
    rep = r.completion_tokens_reported or 0
    events = r.completion_tokens_counted
    if events is None:
        return rep - 1, f"usage {rep} (less a possible EOS)"
    one_per_event = events >= rep - th.usage_extra_tokens and (chars or 0) <= th.max_chars_per_token * max(events, 1)
    if one_per_event:  # exact: a re-encoded text may count one more or less
        return events, f"{events} streamed tokens"
    if r.completion_tokens_tokenizer is not None:
        return r.completion_tokens_tokenizer, f"{r.completion_tokens_tokenizer} streamed tokens (tokenizer recount)"
    return rep - th.usage_extra_tokens, f"usage {rep} (less {th.usage_extra_tokens} uncounted control tokens)"


# finish reasons that legitimately end a response with tool calls cut short (the token limit)
_LIMIT_FINISH = frozenset({"length", "max_tokens", "max_output_tokens"})


def check_tools(r: Measured, problems: Sequence[str], markup: str | None) -> list[Anomaly]:
    """The tool-call checks of a request that offered tools (`r.tool_calls_valid` is not
    None), judged on complete responses only. `problems` are the unusable structured
    calls (`tools.call_problem`), `markup` the tool-call markup found in the content."""
    out: list[Anomaly] = []
    if r.tool_calls_valid is None or r.outcome not in OK_OUTCOMES:
        return out
    if r.tool_calls == 0 and markup is not None:
        out.append(
            Anomaly(
                "tool_call_in_content",
                f"no structured tool call came back, but the content carries {markup}"
                f" (finish {r.finish_reason!r}): the server's tool parser is missing or wrong",
            )
        )
    if problems:
        out.append(
            Anomaly(
                "invalid_tool_arguments",
                f"{len(problems)} of {r.tool_calls} tool calls unusable: " + "; ".join(problems[:3]),
            )
        )
    expected = TOOL_FINISH.get(r.endpoint)
    fr = r.finish_reason
    if expected is not None and fr is not None:
        if r.tool_calls and fr != expected and fr not in _LIMIT_FINISH:
            out.append(
                Anomaly(
                    "tool_call_finish_mismatch",
                    f"{r.tool_calls} structured tool calls but finish reason "
                    f"{fr!r}, not {expected!r}: clients that wait for {expected!r} never run them",
                )
            )
        elif not r.tool_calls and fr == expected:
            out.append(
                Anomaly(
                    "tool_call_finish_mismatch", f"finish reason {expected!r} but no structured tool call came back"
                )
            )
    return out


# reasoning markup a server's reasoning parser should have taken out of the content: an answer
# that opens with a reasoning block, or the end of one anywhere (Qwen3's template opens the block
# in the prompt); a `<think>` mentioned mid-answer is not judged
_THINK = re.compile(r"^\s*(?:<think>|<\|channel\|>analysis|<\|begin_of_thought\|>)|</think>|<\|end_of_thought\|>")
_SCAN_CHARS = 64 * 1024


def check_markup(r: Measured, content: str) -> list[Anomaly]:
    """Reasoning in the wrong field, judged on complete streams: `reasoning_in_content`
    when the streamed `content` carries reasoning markup (`<think>`, `</think>`, ...) that
    a reasoning parser should have moved to the reasoning field; `reasoning_only` when a
    stream that ended on its own (not at the token limit) carried reasoning but no content
    and no tool call, so a client shows no answer (TTFC never set): a parser that takes a
    think-less answer for reasoning (vllm-mlx `--reasoning-parser qwen3`). Tool-call markup
    in content is `check_tools`'s `tool_call_in_content`."""
    out: list[Anomaly] = []
    if r.outcome not in OK_OUTCOMES or r.completion_tokens_counted is None:
        return out
    if content:
        text = content if len(content) <= 2 * _SCAN_CHARS else content[:_SCAN_CHARS] + "\n" + content[-_SCAN_CHARS:]
        # every alternative of `_THINK` holds "<": a text without one (most answers) cannot
        # match, and `in` finds that out far faster than the pattern tried at every position
        m = _THINK.search(text) if "<" in text else None
        if m:
            out.append(
                Anomaly(
                    "reasoning_in_content",
                    f"the streamed content carries reasoning markup {m.group(0)!r} "
                    f"at char {m.start()}: {text[max(m.start() - 20, 0) : m.start() + 60]!r}; clients show "
                    "the model's reasoning as its answer (no reasoning parser, or the wrong one)",
                )
            )
    elif (
        r.reasoning_tokens_counted
        and r.ttfc_s is None
        and not r.tool_calls
        and r.finish_reason is not None
        and r.finish_reason not in _LIMIT_FINISH
    ):
        out.append(
            Anomaly(
                "reasoning_only",
                f"{r.reasoning_tokens_counted} reasoning events and no content or tool "
                f"call, finish {r.finish_reason!r}: the whole answer was streamed as reasoning, so a client "
                "shows none (TTFC never set)",
            )
        )
    return out


UNTRUSTING = frozenset({"usage_mismatch", "phantom_speed"})  # usage that fired these is never used


def trusted_count(r: Measured, kinds: Iterable[str]) -> tuple[int | None, TokensSource | None]:
    """The output count speeds use, and its source: the server's usage when the stream
    agrees with it (neither `usage_mismatch` nor `phantom_speed` among `kinds`), else the
    local tokenizer's count when there is one, else the streamed (events) count."""
    bad = any(k in UNTRUSTING for k in kinds)
    if r.completion_tokens_reported is not None and not bad:
        return r.completion_tokens_reported, "usage"
    if r.completion_tokens_tokenizer is not None:
        return r.completion_tokens_tokenizer, "tokenizer"
    if r.completion_tokens_counted is not None:
        return r.completion_tokens_counted, "stream"
    if r.completion_tokens_reported is not None:  # a JSON body: nothing to check usage against
        return r.completion_tokens_reported, "usage"
    return None, None


def findings(m: Measurement, th: Thresholds, earlier: Sequence[Record] = ()) -> tuple[list[Anomaly], Stalls]:
    """Every per-request check of one finished request's measurement `m` (the truth checks,
    the tool and markup checks), and against `earlier` records of the same process the
    serialized-batching and abandoned-generation checks; with `m`'s stalls (`stall_stats`)."""
    stalls = stall_stats(m, th)
    found = _record_checks(
        m,
        th,
        m.context_refused,
        m.generated_chars,
        m.nonascii_chars,
        m.nonascii_bytes,
        m.silent_after_headers_s,
        stalls,
    )
    if m.tool_calls_valid is not None:
        found.extend(check_tools(m, m.tool_problems, m.tool_markup))
    if m.completion_tokens_counted is not None:
        found.extend(check_markup(m, m.content_text))
    if earlier:
        ser = None if is_burst(found) else find_serialized(m, earlier, th)
        if ser is not None:
            found.append(ser)
        gone = find_abandoned(m, earlier, th)
        if gone is not None:
            found.append(gone)
    return found, stalls


def is_burst(found: Iterable[Anomaly]) -> bool:
    """The stream came in one burst (`non_incremental_stream`): its token times say nothing about progress."""
    return any(a.kind == "non_incremental_stream" for a in found)


class Verdict(NamedTuple):
    """What the checks decided about one measurement (`verdict`): the record's checked fields."""

    completion_tokens: int | None  # the trusted output count every speed uses
    tokens_source: TokensSource | None
    anomalies: tuple[str, ...]
    anomaly_evidence: dict[str, str]
    stall_count: int
    stall_total_s: float


def verdict(m: Measurement, found: Iterable[Anomaly], stalls: Stalls) -> Verdict:
    """The checks' verdict on `m`: the anomalies `found` (one of each kind, the first one's
    evidence), its stall figures, and the trusted output count (usage unless a check found it
    untrue: `trusted_count`)."""
    kinds: list[str] = []
    evidence: dict[str, str] = {}
    for a in found:
        if a.kind not in evidence:
            kinds.append(a.kind)
            evidence[a.kind] = a.evidence
    n, source = trusted_count(m, kinds)
    idx, lengths = stalls
    return Verdict(n, source, tuple(kinds), evidence, len(idx), sum(lengths))


def _decode_window(r: Measured) -> tuple[float, float] | None:
    if not r.event_offsets_s:
        return None
    return r.t_start_mono + r.event_offsets_s[0], r.t_start_mono + r.event_offsets_s[-1]


def _busy_span(a: Record) -> tuple[float, float] | None:
    """(first token, end) of a stream the server was generating, on the
    monotonic clock: a complete incremental stream to its last token; a `client_disconnect`
    from its first token (else its arrival) until the proxy closed the connection, the
    moment a server that honours disconnects stops. None for anything else."""
    if a.outcome in OK_OUTCOMES:
        if "non_incremental_stream" in a.anomalies:  # its token times say nothing about progress
            return None
        w = _decode_window(a)
        return w
    if a.outcome == "client_disconnect":
        w = _decode_window(a)
        return (w[0] if w is not None else a.t_start_mono), a.t_end_mono
    return None


def find_serialized(later: Measured, earlier: Sequence[Record], th: Thresholds) -> Anomaly | None:
    """Whether `later` waited for another request on the same upstream instead of
    progressing with it: while it waited for its first token, the other stream went on for
    at least `serialized_min_wait_s`, and that stream had ended (its last token, or its
    client gone) before `later`'s first token came. Arrival order does not matter: a
    request that arrived first but was served second is caught as well as the usual case.
    `earlier` are the records finished before `later` (one clock, one process).

    `serialized_min_wait_s` (1 s) is two of mlx_lm.server's 0.5 s decode slices: that
    server batches, but admits a new request only between slices, so a request arriving
    near the end of another stream can wait up to a slice for it to end; that is not serial."""
    w = _decode_window(later)
    if w is None or later.outcome not in OK_OUTCOMES:
        return None
    b_start, b_first = later.t_start_mono, w[0]
    if b_first - b_start < th.serialized_min_wait_s:
        # another stream can have run at most this long while `later` waited (it ended by
        # b_first): nothing to find, and no scan of `earlier` (most records end here)
        return None
    for a in earlier:
        if a is later or a.id == later.id or a.upstream != later.upstream:
            continue
        span = _busy_span(a)
        if span is None:
            continue
        a_first, a_end = span
        waited_during = a_end - max(b_start, a.t_start_mono)  # a ran while `later` had no token yet
        if a_end > b_first or waited_during < th.serialized_min_wait_s:
            continue
        after = f"its first token came {_dur(b_first - a_end)} after"
        if a.outcome == "client_disconnect":
            ev = (
                f"arrived {_dur(abs(b_start - a.t_start_mono))} {'after' if a.t_start_mono <= b_start else 'before'} "
                f"request {a.id} and waited while that one generated for {_dur(waited_during)} until its client left; "
                f"{after} the server stopped (the disconnect): the two never progressed together"
            )
        elif a.t_start_mono <= b_start:
            ev = (
                f"arrived {_dur(b_start - a.t_start_mono)} after request {a.id}, whose stream still had "
                f"{_dur(a_end - b_start)} to go, but {after} that stream's last: it waited for the rest of "
                "another stream instead of progressing with it"
            )
        else:
            ev = (
                f"arrived {_dur(a.t_start_mono - b_start)} before request {a.id} but was served after it: it waited "
                f"while the whole of that stream ({a.generated_events} events over {_dur(a_end - a_first)}) "
                f"was generated, and {after} that stream's last"
            )
        return Anomaly("serialized", ev)
    return None


def _expected_ttft(r: Measured, others: Sequence[Record]) -> tuple[float | None, str]:
    """What `r`'s TTFT would usually be on this upstream, from its other finished requests:
    their median TTFT, or `r`'s own uncached prompt at their best prefill rate when that is
    longer (a long prompt is slow on its own). (None, "") when they show neither."""
    ok = [o for o in others if o.outcome in OK_OUTCOMES]
    ttfts = sorted(o.ttft_s for o in ok if o.ttft_s is not None)
    median = percentile(ttfts, 50) if ttfts else None
    rates = [o.prefill_tps for o in ok if o.prefill_tps and prefill_judgeable(o)]
    own = r.uncached_prompt_tokens
    prefill = own / max(rates) if rates and own else None
    if prefill is not None and (median is None or prefill > median):
        return prefill, f"{own} uncached prompt tokens at this upstream's best {_fmt(max(rates))} tok/s prefill"
    if median is not None:
        return median, "the median TTFT here"
    return None, ""


def find_abandoned(later: Measured, earlier: Sequence[Record], th: Thresholds) -> Anomaly | None:
    """Generation that went on after its client left. An earlier request on the same
    upstream ended in `client_disconnect`, and `later`'s first token came at least
    `abandoned_min_wait_s` after that client left, with a TTFT at least
    `abandoned_min_wait_s` and `abandoned_ttft_factor` times what it would usually be
    (`_expected_ttft`: without that yardstick nothing is judged). When the abandoned request
    had a `max_tokens` and a streamed rate, `later` must have arrived while it would still
    have been generating; and no request that arrived after the client left may have been
    served promptly (under `abandoned_min_wait_s`) before `later`'s first token: that
    would show the server had stopped. A server that stops on disconnect serves `later`
    at once."""
    if later.outcome not in OK_OUTCOMES or later.ttft_s is None:
        return None
    b_start, ttft = later.t_start_mono, later.ttft_s
    if ttft < th.abandoned_min_wait_s:
        return None
    same = [r for r in earlier if r.upstream == later.upstream and r is not later and r.id != later.id]
    expected, basis = _expected_ttft(later, same)
    if expected is None or ttft < th.abandoned_ttft_factor * expected:
        return None
    b_first = b_start + ttft
    for a in same:
        if a.outcome != "client_disconnect":
            continue
        left = a.t_end_mono
        waited = b_first - left  # how long `later` still waited for its first token after the client left
        if waited < th.abandoned_min_wait_s:
            continue
        if any(
            o.outcome in OK_OUTCOMES
            and o.ttft_s is not None
            and o.t_start_mono >= left
            and o.t_start_mono + o.ttft_s < b_first
            and o.ttft_s < th.abandoned_min_wait_s
            for o in same
        ):
            continue  # served promptly in between: the server was free
        window = a.event_offsets_s[-1] - a.event_offsets_s[0] if len(a.event_offsets_s) >= 2 else 0.0
        if a.max_tokens is not None and window > 0:
            rate = (len(a.event_offsets_s) - 1) / window
            run_on = max(a.max_tokens - a.generated_events, 0) / rate  # how long it would have gone on
            if b_start >= left + run_on:
                continue
            would = (
                f"left at event {a.generated_events} of max_tokens {a.max_tokens} (up to {_dur(run_on)} more "
                f"at its {_fmt(rate)} events/s)"
            )
        else:
            would = f"left at event {a.generated_events}" + ("" if a.max_tokens else " (no max_tokens)")
        return Anomaly(
            "generation_after_disconnect",
            f"TTFT {_dur(ttft)} ({_dur(expected)} expected from {basis}): "
            f"the first token came {_dur(waited)} after the client of request {a.id} {would}: the server "
            "kept generating for a client that had gone",
        )
    return None


def _end_event(r: Measurement | Record) -> str:
    """How a stream without a finish ended, for evidence: with its end-of-stream event (the
    time of which `tail_after_done_s` counts from) or without one (cut short)."""
    if r.tail_after_done_s is None:
        return "without an end-of-stream event "
    return "with its end-of-stream event " if r.endpoint in DIALECT_APIS else "with [DONE] "


def overlap_ratio(records: Sequence[Record]) -> float | None:
    """Fraction of the union of the records' decode windows during which at least two
    streams were emitting tokens (~1 with batching, ~0 when served one at a time)."""
    windows = [w for w in (_decode_window(r) for r in records) if w is not None and w[1] > w[0]]
    if len(windows) < 2:
        return None
    points = sorted([(s, 1) for s, _ in windows] + [(e, -1) for _, e in windows])
    union = both = 0.0
    depth = 0
    prev = points[0][0]
    for t, d in points:
        if depth >= 1:
            union += t - prev
        if depth >= 2:
            both += t - prev
        depth += d
        prev = t
    return both / union if union > 0 else None


#: a prompt with more than this fraction of its tokens served from the prompt cache has no
#: prefill rate worth judging: its TTFT measures the cache
MOSTLY_CACHED = 0.5


def uncached_prompt_tokens(r: Record) -> int | None:
    """The prompt tokens the server really processed: prompt_tokens minus cached_tokens, or
    prompt_tokens itself when cached_tokens exceeds it (`openai.uncached_tokens`)."""
    if not r.prompt_tokens:
        return None
    return r.uncached_prompt_tokens


def prefill_judgeable(r: Record) -> bool:
    """Whether this record's prefill rate (uncached prompt tokens / TTFT) means anything:
    a successful stream that was incremental (the first token was not held back with the
    rest) and whose prompt was not mostly served from the cache."""
    if r.outcome not in OK_OUTCOMES or r.prefill_tps is None or not r.prompt_tokens:
        return False
    if "non_incremental_stream" in r.anomalies:
        return False
    uncached = r.uncached_prompt_tokens or 0
    whole = max(r.prompt_tokens, uncached + (r.cached_tokens or 0))  # prompt_tokens may leave cached ones out
    return whole - uncached <= MOSTLY_CACHED * whole


def prefill_scaling(records: Iterable[Record], th: Thresholds) -> Anomaly | None:
    """Superlinear prefill: the median prefill tok/s at the largest prompt size is far
    below the best median at any size at least `superlinear_min_size_ratio` times
    smaller. (With linear prefill plus a fixed cost, tok/s only rises with size.)
    Sizes are uncached prompt tokens; records whose prefill cannot be judged (mostly
    cached, non-incremental stream: `prefill_judgeable`) are left out."""
    by_size: dict[int, list[float]] = {}
    for r in records:
        if prefill_judgeable(r) and r.prefill_tps is not None:
            by_size.setdefault(uncached_prompt_tokens(r) or 0, []).append(r.prefill_tps)
    by_size.pop(0, None)
    if len(by_size) < 2:
        return None
    med = {size: percentile(sorted(v), 50) or 0.0 for size, v in by_size.items()}
    hi = max(med)
    smaller = [s for s in med if s * th.superlinear_min_size_ratio <= hi]
    if not smaller or med[hi] <= 0:
        return None
    best = max(smaller, key=lambda s: med[s])
    if med[best] / med[hi] > th.superlinear_factor:
        return Anomaly(
            "superlinear_prefill",
            f"prefill {_fmt(med[best])} tok/s at {best} prompt tokens but {_fmt(med[hi])} tok/s at "
            f"{hi}: each prompt token costs {med[best] / med[hi]:.1f}x more at the larger size",
        )
    return None
