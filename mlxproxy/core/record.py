"""The one record a finished request yields, and the outcome names.

Units are in the names (`_s` seconds, `_tps` tokens per second). `None` always means
"not observed" (no token streamed, no usage reported, ...), never zero. Records carry no
prompt or completion text unless `response_text` was asked for (capture opt-in).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, Literal, get_args

from mlxproxy.core.clients import NO_CLIENT, ClientInfo, SideRequest
from mlxproxy.core.openai import Endpoint, uncached_tokens, whole_prompt_tokens
from mlxproxy.core.prefix import Cause

__all__ = [
    "Record",
    "MEASURED_FIELDS",
    "CHECKED_FIELDS",
    "checked_record",
    "Outcome",
    "OUTCOMES",
    "OK_OUTCOMES",
    "TokensSource",
    "TOKENS_SOURCES",
    "PromptTokensSource",
    "PROMPT_TOKENS_SOURCES",
    "rate_figures",
    "uncached_tokens",
    "wall_window_s",
]

Outcome = Literal[
    "ok",
    "ok_no_done",
    "truncated",
    "stream_error",
    "http_error",
    "context_limit",
    "upstream_unreachable",
    "upstream_timeout",
    "client_disconnect",
    "protocol_error",
]
OUTCOMES: tuple[Outcome, ...] = get_args(Outcome)
OK_OUTCOMES: frozenset[Outcome] = frozenset({"ok", "ok_no_done"})
# Where a record's trusted `completion_tokens` came from (docs/METRICS.md, "Trusted token count").
TokensSource = Literal["usage", "tokenizer", "stream"]
TOKENS_SOURCES: tuple[TokensSource, ...] = get_args(TokensSource)
# Where the prompt size the cache doctor used came from (docs/METRICS.md, "Prompt-prefix tracking").
PromptTokensSource = Literal["usage", "tokenizer", "chars"]
PROMPT_TOKENS_SOURCES: tuple[PromptTokensSource, ...] = get_args(PromptTokensSource)


def rate_figures(
    n_out: int | None, ttft_s: float | None, e2e_s: float | None, duration_s: float | None
) -> tuple[float | None, float | None, float | None]:
    """(tpot_s, decode_tps, wall_tps) of `n_out` output tokens: the decode window runs from
    the first to the last generated event (`ttft_s` to `e2e_s`), the wall time is `duration_s`."""
    tpot = decode = wall = None
    if n_out is not None and n_out >= 2 and ttft_s is not None and e2e_s is not None:
        window = e2e_s - ttft_s
        if window > 0:
            tpot = window / (n_out - 1)
            decode = (n_out - 1) / window
    if n_out is not None and duration_s is not None and duration_s > 0:
        wall = n_out / duration_s
    return tpot, decode, wall


def wall_window_s(duration_s: float | None, tail_after_done_s: float | None) -> float | None:
    """The time wall tok/s divides by: to the end-of-stream event ([DONE]) when there was
    one (an SDK stops reading there), else the whole request."""
    if duration_s is None:
        return None
    return duration_s - (tail_after_done_s or 0.0)


@dataclass(frozen=True, slots=True)
class Record:
    """Everything measured about one request (definitions: docs/METRICS.md)."""

    id: str
    started_at: float  # wall clock, seconds since the epoch
    upstream: str
    model: str | None
    endpoint: Endpoint
    stream: bool
    status: int | None
    outcome: Outcome
    method: str = "POST"
    path: str = ""
    # intervals from t_start, seconds
    ttfb_s: float | None = None
    ttft_s: float | None = None
    ttfc_s: float | None = None
    e2e_s: float | None = None
    headers_s: float | None = None
    duration_s: float | None = None  # t_end - t_start
    tail_after_done_s: float | None = None  # body kept open after [DONE] (wall_tps stops at [DONE]); None: no [DONE]
    tpot_s: float | None = None
    decode_tps: float | None = None
    wall_tps: float | None = None
    prefill_tps: float | None = None
    # tokens
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens_reported: int | None = None
    reasoning_tokens_reported: int | None = None
    completion_tokens_counted: int | None = None
    reasoning_tokens_counted: int | None = None
    completion_tokens_tokenizer: int | None = None
    # the trusted output count every speed uses, and where it came from (TOKENS_SOURCES)
    completion_tokens: int | None = None
    tokens_source: TokensSource | None = None
    usage_reports: int = 0
    usage_requested: bool = False  # by the client
    usage_injected: bool = False  # by the proxy
    max_tokens: int | None = None
    events: int = 0  # SSE data events
    generated_events: int = 0
    comments: int = 0
    finish_reason: str | None = None
    finish_reasons_seen: int = 0
    tool_calls: int = 0
    tool_calls_valid: int | None = None  # structured calls usable as streamed; None: the request offered no tools
    # prompt-prefix tracking (core.prefix): None when the request was not tracked or continued nothing
    conversation_id: str | None = None
    turn: int | None = None
    prefix_reusable_tokens: int | None = None
    # "usage" (the earlier turn's prompt_tokens), "tokenizer" or "chars" (the proxy's count of it), "cached"
    prefix_tokens_source: str | None = None
    prefix_diverged_at: str | None = None
    cache_hit_ratio: float | None = None
    prefill_wasted_s: float | None = None  # TTFT lost to a prefix_cache_miss (estimate)
    # the cache doctor (core.cachecheck): why this turn re-prefilled part of the previous prompt
    reprefill_cause: Cause | None = None
    reprefill_at: str | None = None  # where, e.g. "system line 1: a-a: a=<hex:5>;" or "tools: grep changed"
    reprefill_lost_s: float | None = None  # prefill seconds the re-prefill cost (estimate)
    conversation_lost_s: float | None = None  # the conversation's re-prefill seconds so far, this turn included
    cache_evidence: str | None = None  # what the cache verdict rests on: the server's cached count or the TTFT
    # the prompt's size where the server reported none (vllm-mlx's Messages stream): counted by
    # the proxy, with a tokenizer ("tokenizer") or as characters / 4 ("chars"); "usage" when reported
    prompt_tokens_counted: int | None = None
    prompt_tokens_source: PromptTokensSource | None = None
    reprefill_fix: str | None = None  # the fix users apply for reprefill_cause, one line (core.fixes)
    # who sent it (core.clients): the client named from its headers, and the kind of side request
    client: str | None = None
    side_request: SideRequest | None = None  # e.g. "title": kept out of conversations
    anomalies: tuple[str, ...] = ()
    anomaly_evidence: dict[str, str] = field(default_factory=dict)
    error: str | None = None
    context_prompt_tokens: int | None = None
    context_limit_tokens: int | None = None
    prefill_progress: tuple[int, int] | None = None  # last (processed, total) keep-alive comment
    server_claims: dict[str, Any] = field(default_factory=dict)
    concurrency: int = 1  # requests in flight to this upstream when this one started
    tags: tuple[str, ...] = ()  # e.g. ("replay",)
    bytes_out: int = 0  # response body bytes received from upstream
    # timeline, for capture/replay and cross-request analysis
    event_offsets_s: tuple[float, ...] = ()  # each generated event, from t_start
    t_start_mono: float = 0.0  # monotonic clock of t_start (comparable within one process)
    dual_reasoning_events: int = 0
    duplicate_content: bool = False
    stall_count: int = 0
    stall_total_s: float = 0.0
    response_text: str | None = None
    reasoning_text: str | None = None

    @property
    def n_out(self) -> int | None:
        """Output tokens every speed uses: the trusted `completion_tokens`. Records written
        before it existed (no `tokens_source`) fall back to reported, else counted."""
        if self.tokens_source is not None:
            return self.completion_tokens
        if self.completion_tokens_reported is not None:
            return self.completion_tokens_reported
        return self.completion_tokens_counted

    @property
    def usage_untrusted(self) -> bool:
        """The server reported usage but the speeds do not use it (the stream contradicted it)."""
        return (
            self.completion_tokens_reported is not None
            and self.tokens_source is not None
            and self.tokens_source != "usage"
        )

    @property
    def uncached_prompt_tokens(self) -> int | None:
        """The prompt tokens the server prefilled (`uncached_tokens`), as a `Measurement` has them."""
        return uncached_tokens(self.prompt_tokens, self.cached_tokens)

    @property
    def whole_prompt_tokens(self) -> int | None:
        """Every prompt token, cached or not (`whole_prompt_tokens`), as a `Measurement` has them."""
        return whole_prompt_tokens(self.prompt_tokens, self.cached_tokens)

    @property
    def t_end_mono(self) -> float:
        return self.t_start_mono + (self.duration_s or 0.0)

    def evolve(self, **changes: Any) -> Record:
        """A copy with `changes` applied, like `dataclasses.replace` without re-running
        `__init__`: on this 65-field frozen record that is 3x cheaper, and finishing a record
        copies it once per request on the event loop. Unknown names raise AttributeError."""
        new = object.__new__(Record)
        for name in _FIELD_NAMES:
            _setattr(new, name, getattr(self, name))
        for name, value in changes.items():
            _setattr(new, name, value)
        return new

    def event_gaps_s(self) -> list[float]:
        offs = self.event_offsets_s
        return [b - a for a, b in zip(offs, offs[1:])]

    def to_dict(self, *, timeline: bool = False) -> dict[str, Any]:
        """JSON-ready dict. The per-event timeline and texts only when `timeline`."""
        # a shallow copy: dataclasses.asdict deep-copies every float of the timeline, which
        # cost ~1 ms per record of 500 events (a blocked event loop for /streams, the capture)
        d = {name: getattr(self, name) for name in _FIELD_NAMES}
        d["anomaly_evidence"] = dict(self.anomaly_evidence)
        d["server_claims"] = copy.deepcopy(self.server_claims)
        d["anomalies"] = list(self.anomalies)
        d["tags"] = list(self.tags)
        if self.prefill_progress is not None:
            d["prefill_progress"] = list(self.prefill_progress)
        d.pop("t_start_mono")
        offs = d.pop("event_offsets_s")
        if timeline:
            d["event_offsets_ms"] = [round(o * 1000.0, 3) for o in offs]
        else:
            d.pop("response_text")
            d.pop("reasoning_text")
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Record:
        """Inverse of `to_dict` (unknown keys ignored; used by capture and report readers)."""
        names = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        if "event_offsets_ms" in d:
            kw["event_offsets_s"] = tuple(float(x) / 1000.0 for x in d["event_offsets_ms"])
        for key in ("anomalies", "tags", "event_offsets_s"):
            if key in kw:
                kw[key] = tuple(kw[key])
        if kw.get("prefill_progress") is not None:
            kw["prefill_progress"] = tuple(kw["prefill_progress"])
        return cls(**kw)


_FIELD_NAMES = tuple(f.name for f in fields(Record))
_setattr = object.__setattr__  # how a frozen dataclass sets its own fields


# What the checks decide (`core.detect.verdict`, the conversation's prefix checks); each has a
# default. Every other field is measured by the meter: `RequestMeter.finish`'s `Measurement`
# begins with them (`MEASURED_FIELDS`), in this order.
CHECKED_FIELDS = (
    "tpot_s",
    "decode_tps",
    "wall_tps",
    "completion_tokens",
    "tokens_source",
    "conversation_id",
    "turn",
    "prefix_reusable_tokens",
    "prefix_tokens_source",
    "prefix_diverged_at",
    "cache_hit_ratio",
    "prefill_wasted_s",
    "reprefill_cause",
    "reprefill_at",
    "reprefill_lost_s",
    "conversation_lost_s",
    "cache_evidence",
    "prompt_tokens_counted",
    "prompt_tokens_source",
    "reprefill_fix",
    "client",
    "side_request",
    "anomalies",
    "anomaly_evidence",
    "stall_count",
    "stall_total_s",
)
MEASURED_FIELDS = tuple(name for name in _FIELD_NAMES if name not in CHECKED_FIELDS)
# measured fields the conversation's checks may correct: `prefill_tps` is withdrawn (None) or
# recomputed over the prefilled tokens when the cache's evidence says the server reused part of
# the prompt without reporting it (core.cachecheck)
_CONVERSATION_CORRECTS = frozenset({"prefill_tps"})
# the checked fields' defaults (`anomaly_evidence`, a fresh dict each time, is always given)
_CHECKED_DEFAULTS = {
    f.name: f.default for f in fields(Record) if f.name in CHECKED_FIELDS and f.default is not dataclasses.MISSING
}
if set(CHECKED_FIELDS) - set(_CHECKED_DEFAULTS) != {"anomaly_evidence"}:  # pragma: no cover - caught at import
    raise ImportError("every checked field of Record but anomaly_evidence needs a plain default")


def checked_record(
    measured: tuple[Any, ...],
    *,
    completion_tokens: int | None,
    tokens_source: TokensSource | None,
    anomalies: tuple[str, ...],
    anomaly_evidence: dict[str, str],
    stall_count: int,
    stall_total_s: float,
    conversation: dict[str, Any] | None = None,
    error: str | None = None,
    client: ClientInfo = NO_CLIENT,
) -> Record:
    """The one `Record` of a finished request, built once: `measured` (a `Measurement`: its
    first fields are `MEASURED_FIELDS`, in order) completed with the checks' verdict, the speeds
    of the trusted count `completion_tokens`, and `error` when given (the measured one scrubbed
    of secrets). Set by plain stores on a `_Building` record that then becomes a `Record` (a
    frozen record's `__init__`, or `object.__setattr__` per field, would cost ~30 times as much,
    on the event loop, once per request); unknown conversation fields raise AttributeError."""
    new: Any = _new(_Building)
    _fill(new, measured)
    if conversation:
        for name, value in conversation.items():
            if name not in _CHECKED_DEFAULTS and name not in _CONVERSATION_CORRECTS:
                raise AttributeError(f"{name!r} is not a conversation field of Record")
            _setattr(new, name, value)
    if error is not None:
        new.error = error
    if client is not NO_CLIENT:  # who sent it (core.clients): the checked defaults say None
        new.client = client.name
        new.side_request = client.side
    new.tpot_s, new.decode_tps, new.wall_tps = rate_figures(
        completion_tokens, new.ttft_s, new.e2e_s, wall_window_s(new.duration_s, new.tail_after_done_s)
    )
    # the verdict's fields, in one assignment
    new.completion_tokens, new.tokens_source, new.anomalies, new.anomaly_evidence = (
        completion_tokens,
        tokens_source,
        anomalies,
        anomaly_evidence,
    )
    new.stall_count, new.stall_total_s = stall_count, stall_total_s
    new.__class__ = Record  # frozen from here on: the very `Record` that `Record(...)` gives
    record: Record = new
    return record


class _Building(Record):
    """A `Record` while `checked_record` fills it: the same slots (it adds none, so an instance
    can become a `Record` by `__class__` assignment), without the frozen `__setattr__`. Its
    fields are then set by plain attribute stores, which the interpreter does in a few dozen
    instructions each, where `object.__setattr__` on a frozen record costs ~1,300 (its argument
    tuple, the type lookup): 76 of them were ~100 k instructions per request."""

    __slots__ = ()
    # the generic C setter (both names: they share one type slot), so that plain stores are slot writes
    __setattr__ = object.__setattr__
    __delattr__ = object.__delattr__


_new = object.__new__


def _filler() -> Callable[[Any, tuple[Any, ...]], None]:
    """`fill(new, measured)`: the measured fields from `measured` (a `Measurement`, whose first
    fields are `MEASURED_FIELDS`) and every checked field's default, by plain attribute stores
    (a function written once for these names: a loop would need `setattr`)."""
    measured = ", ".join(f"new.{name}" for name in MEASURED_FIELDS)
    checked = ", ".join(f"new.{name}" for name in _CHECKED_DEFAULTS)
    source = f"def fill(new, measured):\n    {measured}, *_ = measured\n    {checked}, = defaults\n"
    scope: dict[str, Any] = {"defaults": tuple(_CHECKED_DEFAULTS.values())}
    exec(source, scope)  # (names from the dataclass's own fields only)
    fill: Callable[[Any, tuple[Any, ...]], None] = scope["fill"]
    return fill


_fill = _filler()
