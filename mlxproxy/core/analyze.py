"""Finish a meter into a checked record: the one path the proxy, replay and bench share."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from mlxproxy.core.detect import Thresholds, check_record, check_tools, find_serialized, with_anomalies
from mlxproxy.core.meter import RequestMeter
from mlxproxy.core.record import Record

__all__ = ["finish_checked"]


def finish_checked(meter: RequestMeter, t_end: float, th: Thresholds, *, outcome: str | None = None,
                   error: str | None = None, earlier: Sequence[Record] = (),
                   count_tokens: Callable[[str], int] | None = None) -> Record:
    """`meter.finish` plus the per-record truth checks and, against `earlier` records
    of the same process, the serialized-batching check. `count_tokens` (a tokenizer)
    makes the usage check exact; a failing tokenizer is ignored."""
    tok = None
    text = meter.generated_text if meter.decoder is not None else None  # tool-call names and arguments too
    if count_tokens is not None and meter.generated_events and text is not None:
        try:
            tok = count_tokens(text)
        except Exception:  # a tokenizer problem must not lose the record
            tok = None
    record = meter.finish(t_end, outcome=outcome, error=error, tokenizer_tokens=tok)
    chars = nonascii_chars = nonascii_bytes = 0
    if text:
        chars = len(text)
        ascii_chars = len(text.encode("ascii", "ignore"))
        nonascii_chars = chars - ascii_chars
        if nonascii_chars:
            nonascii_bytes = len(text.encode("utf-8", "surrogatepass")) - ascii_chars
    found = check_record(record, th, chars=chars if text is not None else None, nonascii_chars=nonascii_chars,
                         nonascii_bytes=nonascii_bytes, headers_to_first_byte_s=meter.silent_after_headers_s(t_end))
    if record.tool_calls_valid is not None:
        found.extend(check_tools(record, meter.tool_problems(), meter.tool_markup() if not record.tool_calls else None))
    burst = any(a.kind == "non_incremental_stream" for a in found)  # token times say nothing about progress then
    ser = find_serialized(record, earlier, th) if earlier and not burst else None
    if ser is not None:
        found.append(ser)
    return with_anomalies(record, found, th)
