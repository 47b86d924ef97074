"""Finish a meter into a checked record: the one path the proxy, replay and bench share."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from mlxproxy.core.detect import (
    Anomaly,
    Thresholds,
    check_markup,
    check_prefix,
    check_record,
    check_tools,
    find_abandoned,
    find_serialized,
    stall_stats,
    with_anomalies,
)
from mlxproxy.core.meter import RequestMeter
from mlxproxy.core.prefix import PrefixIndex, fingerprint
from mlxproxy.core.record import OK_OUTCOMES, Outcome, Record

__all__ = ["finish_checked"]


def finish_checked(
    meter: RequestMeter,
    t_end: float,
    th: Thresholds,
    *,
    outcome: Outcome | None = None,
    error: str | None = None,
    earlier: Sequence[Record] = (),
    count_tokens: Callable[[str], int] | None = None,
    prefixes: PrefixIndex | None = None,
) -> Record:
    """`meter.finish` plus the per-record truth checks and, against `earlier` records
    of the same process, the serialized-batching check. `count_tokens` (a tokenizer)
    makes the usage check exact; a failing tokenizer is ignored. `prefixes` (this
    upstream's prompt-prefix index) adds the conversation fields and the prefix checks,
    and remembers this request's prompt fingerprints."""
    text = meter.generated_text if meter.decoder is not None else None  # tool-call names and arguments too
    tok = _count(count_tokens, text) if meter.generated_events else None
    record = meter.finish(t_end, outcome=outcome, error=error, tokenizer_tokens=tok)
    chars, nonascii_chars, nonascii_bytes = _text_sizes(text)
    stalls = stall_stats(record, th)
    found = check_record(
        record,
        th,
        chars=chars,
        nonascii_chars=nonascii_chars,
        nonascii_bytes=nonascii_bytes,
        headers_to_first_byte_s=meter.silent_after_headers_s(t_end),
        stalls=stalls,
    )
    if record.tool_calls_valid is not None:
        found.extend(check_tools(record, meter.tool_problems(), meter.tool_markup() if not record.tool_calls else None))
    if meter.decoder is not None:
        found.extend(check_markup(record, meter.content_text))
    burst = any(a.kind == "non_incremental_stream" for a in found)  # token times say nothing about progress then
    ser = find_serialized(record, earlier, th) if earlier and not burst else None
    if ser is not None:
        found.append(ser)
    gone = find_abandoned(record, earlier, th) if earlier else None
    if gone is not None:
        found.append(gone)
    info = meter.request
    pp = fingerprint(info.endpoint, info.prompt_obj) if prefixes is not None and info.prompt_obj is not None else None
    fields: dict[str, Any] = {}
    if prefixes is not None and pp is not None:
        fields = _conversation(record, pp, prefixes, th, t_end, burst, found)
    return with_anomalies(record, found, th, stalls=stalls, **fields)  # completes `record` in place


def _count(count_tokens: Callable[[str], int] | None, text: str | None) -> int | None:
    """A tokenizer's count of `text`; None without one, or when it fails (never loses the record)."""
    if count_tokens is None or text is None:
        return None
    try:
        return count_tokens(text)
    except Exception:  # a tokenizer problem must not lose the record
        return None


def _text_sizes(text: str | None) -> tuple[int | None, int, int]:
    """What the usage check needs of the streamed text: its characters (None when not streamed),
    the non-ASCII ones, and their UTF-8 bytes (scripts that take more tokens per character)."""
    if not text:
        return (None if text is None else 0), 0, 0
    chars = len(text)
    ascii_chars = len(text.encode("ascii", "ignore"))
    nonascii = chars - ascii_chars
    return chars, nonascii, (len(text.encode("utf-8", "surrogatepass")) - ascii_chars if nonascii else 0)


def _conversation(
    record: Record,
    pp: Any,
    prefixes: PrefixIndex,
    th: Thresholds,
    t_end: float,
    burst: bool,
    found: list[Anomaly],
) -> dict[str, Any]:
    """The prefix checks against this upstream's earlier prompts (appended to `found`), the
    record's `conversation_id` and `turn`, and this prompt remembered (when it was served)."""
    fields: dict[str, Any] = {}
    match = prefixes.match(pp)
    if match is not None:
        fields, more = check_prefix(record, match, prefixes.prefill_rate(), th)
        found.extend(more)
    if record.outcome in OK_OUTCOMES:
        cid, turn = prefixes.add(pp, match, record.id, record.prompt_tokens, t_end)
        if (
            turn == 1
            and not record.cached_tokens
            and record.prefill_tps
            and not burst
            and (record.prompt_tokens or 0) >= th.prefix_min_tokens
        ):
            prefixes.cold_prefill_tps.append(record.prefill_tps)
    elif match is not None:
        cid, turn = match.conversation_id, match.turn
    else:
        cid, turn = None, None
    fields.update(conversation_id=cid, turn=turn)
    return fields
