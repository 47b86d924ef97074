"""The result file's types: a run's groups of requests, their summaries and the file itself.

A result file (`replay`/`bench --json`, read by `report`) is JSON:
`{"mlxproxy_result": 1, "kind", "version", "created_at", "groups": [Group...], "verdicts": {target: text},
...}`. Each type here is frozen and converts with `to_dict`/`from_dict` like `Record`; `to_dict`
of what `from_dict` read gives the same keys in the same order, so a file read and written again
is the same bytes. Keys this version does not know are kept (in `extra`) and written back.

A group says what it measured with its `kind` (`GroupKind`); files written before groups had
one get it from their name and parameters once, in `legacy_kind`, and nowhere else.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal, TypeAlias, TypedDict, get_args

from mlxproxy import __version__
from mlxproxy.core.record import Record

__all__ = [
    "RESULT_VERSION",
    "GroupKind",
    "GROUP_KINDS",
    "ResultKind",
    "Stat",
    "AnomalyCount",
    "Summary",
    "Breach",
    "SloVerdict",
    "Goodput",
    "Judgment",
    "Group",
    "ResultFile",
    "legacy_kind",
    "JSONValue",
    "JSONObject",
    "json_float",
    "SessionTurn",
    "RunRecord",
    "Wave",
    "FailedRequest",
    "SessionsFigures",
    "TargetFacts",
    "CompareRow",
]

#: a JSON value as a result file holds it: the sections this version keeps for writing back
#: without reading every key of (a group's parameters, a summary's optional sections, a file's
#: other top-level keys, a row's unknown keys)
JSONValue: TypeAlias = str | int | float | bool | None | Sequence["JSONValue"] | Mapping[str, "JSONValue"]
JSONObject: TypeAlias = Mapping[str, JSONValue]


def json_float(v: JSONValue) -> float | None:
    """`v` as a number (an int stays an int), None for anything else (absent, null, text, ...)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return v


def _json_int(v: JSONValue) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) else 0


def _json_str(v: JSONValue) -> str | None:
    return v if isinstance(v, str) else None


def _json_object(v: JSONValue) -> JSONObject:
    return v if isinstance(v, Mapping) else {}


def _json_objects(v: JSONValue) -> list[JSONObject]:
    if isinstance(v, str) or not isinstance(v, Sequence):
        return []
    return [x for x in v if isinstance(x, Mapping)]


#: the result file format's version (`mlxproxy_result`); files of a newer one are refused
RESULT_VERSION = 1

#: what a group measured:
#: single: every one-at-a-time request of a run (bench: all prompt sizes; replay --mode batch: the capture);
#: single_size: bench's one-at-a-time requests at one prompt size (`single N`);
#: baseline: bench's requests alone between the waves; wave: requests released together (bench
#: `double`/`xN`, replay `batch N`); rate: one open-loop test; sweep_step: one step of a sweep;
#: replay: one replay mode's requests (recorded, sequential, concurrency); sessions: replayed
#: conversations; interrupted: what a cancelled replay finished
GroupKind = Literal[
    "single", "single_size", "baseline", "wave", "rate", "sweep_step", "replay", "sessions", "interrupted"
]
GROUP_KINDS: tuple[str, ...] = get_args(GroupKind)
ResultKind = Literal["bench", "replay"]


@dataclass(frozen=True, slots=True)
class Stat:
    """Order statistics of one figure over a group's requests (`mlxproxy.core.stats.summarize`)."""

    count: int = 0
    mean: float | None = None
    min: float | None = None
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None
    max: float | None = None

    def to_dict(self) -> dict[str, int | float | None]:
        return {
            "count": self.count,
            "mean": self.mean,
            "min": self.min,
            "p50": self.p50,
            "p90": self.p90,
            "p99": self.p99,
            "max": self.max,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> Stat:
        d = d or {}
        return cls(
            int(d.get("count") or 0),
            d.get("mean"),
            d.get("min"),
            d.get("p50"),
            d.get("p90"),
            d.get("p99"),
            d.get("max"),
        )

    @classmethod
    def from_json(cls, v: JSONValue) -> Stat:
        """A `Stat` from an optional section's value (its numbers only; anything else reads as absent)."""
        d = _json_object(v)
        return cls(
            _json_int(d.get("count")),
            json_float(d.get("mean")),
            json_float(d.get("min")),
            json_float(d.get("p50")),
            json_float(d.get("p90")),
            json_float(d.get("p99")),
            json_float(d.get("max")),
        )


@dataclass(frozen=True, slots=True)
class AnomalyCount:
    """How many of a group's requests showed one anomaly kind, with the first one's evidence."""

    count: int
    evidence: str = ""

    def to_dict(self) -> dict[str, int | str]:
        return {"count": self.count, "evidence": self.evidence}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> AnomalyCount:
        return cls(int(d.get("count") or 0), str(d.get("evidence") or ""))


@dataclass(frozen=True, slots=True)
class Breach:
    """One threshold a step missed: the percentile's `key` (`ttft_p95`), its `value` and the `threshold`."""

    key: str
    value: float
    threshold: float

    def to_json(self) -> dict[str, JSONValue]:
        return {"key": self.key, "value": self.value, "threshold": self.threshold}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Breach:
        return cls(str(d["key"]), float(d["value"]), float(d["threshold"]))


@dataclass(frozen=True, slots=True)
class SloVerdict:
    """Whether a step held the SLO (`summary.slo` in result files): every percentile within its
    threshold, no failed request and at least one success."""

    met: bool
    breaches: tuple[Breach, ...] = ()
    errors: int = 0
    values: Mapping[str, float | None] = field(default_factory=dict)
    thresholds: Mapping[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, JSONValue]:
        return {
            "met": self.met,
            "breaches": [b.to_json() for b in self.breaches],
            "errors": self.errors,
            "values": dict(self.values),
            "thresholds": dict(self.thresholds),
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> SloVerdict:
        return cls(
            bool(d.get("met")),
            tuple(Breach.from_json(b) for b in d.get("breaches") or ()),
            int(d.get("errors") or 0),
            dict(d.get("values") or {}),
            dict(d.get("thresholds") or {}),
        )


@dataclass(frozen=True, slots=True)
class Goodput:
    """The requests of a step that succeeded and met every threshold themselves (`summary.goodput`):
    how many, of how many, their share and their rate per second of the step's wall time."""

    good: int
    requests: int
    share: float | None = None
    rate: float | None = None

    def to_json(self) -> dict[str, JSONValue]:
        return {"good": self.good, "requests": self.requests, "share": self.share, "rate": self.rate}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Goodput:
        return cls(int(d.get("good") or 0), int(d.get("requests") or 0), d.get("share"), d.get("rate"))


@dataclass(frozen=True, slots=True)
class Judgment:
    """A step judged against an SLO (`judge`): its verdict and its goodput."""

    slo: SloVerdict
    goodput: Goodput

    def to_json(self) -> dict[str, JSONValue]:
        """The summary keys it sets in a result file: `{"slo": ..., "goodput": ...}`."""
        return {"slo": self.slo.to_json(), "goodput": self.goodput.to_json()}


_STATS = ("ttft_s", "ttfc_s", "e2e_s", "wall_tps", "decode_tps", "tpot_s", "prefill_tps", "cached_tokens")
_FIXED = (
    "requests",
    "ok",
    "outcomes",
    *_STATS,
    "reasoning",
    "aggregate_tps",
    "speedup",
    "overlap",
    "anomalies",
    "untrusted_usage",
)


@dataclass(frozen=True, slots=True)
class Summary:
    """A group's headline figures (`mlxproxy.load.output.report.summarize_records`). The sections only
    some groups have (bench's per-wave figures, an SLO judgment, replayed sessions, ...) are
    in `extra`, in the order they were added, read through the properties below."""

    requests: int
    ok: int
    outcomes: Mapping[str, int]
    ttft_s: Stat
    ttfc_s: Stat
    e2e_s: Stat
    wall_tps: Stat
    decode_tps: Stat
    tpot_s: Stat
    prefill_tps: Stat
    cached_tokens: Stat
    reasoning: bool = False
    aggregate_tps: float | None = None
    speedup: float | None = None
    overlap: float | None = None
    anomalies: Mapping[str, AnomalyCount] = field(default_factory=dict)
    untrusted_usage: int = 0
    extra: JSONObject = field(default_factory=dict)

    def to_dict(self) -> dict[str, object]:
        out: dict[str, object] = {"requests": self.requests, "ok": self.ok, "outcomes": dict(self.outcomes)}
        for name in _STATS:
            out[name] = getattr(self, name).to_dict()
        out.update(
            {
                "reasoning": self.reasoning,
                "aggregate_tps": self.aggregate_tps,
                "speedup": self.speedup,
                "overlap": self.overlap,
                "anomalies": {k: a.to_dict() for k, a in self.anomalies.items()},
                "untrusted_usage": self.untrusted_usage,
            }
        )
        out.update(self.extra)
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Summary:
        return cls(
            int(d.get("requests") or 0),
            int(d.get("ok") or 0),
            dict(d.get("outcomes") or {}),
            Stat.from_dict(d.get("ttft_s")),
            Stat.from_dict(d.get("ttfc_s")),
            Stat.from_dict(d.get("e2e_s")),
            Stat.from_dict(d.get("wall_tps")),
            Stat.from_dict(d.get("decode_tps")),
            Stat.from_dict(d.get("tpot_s")),
            Stat.from_dict(d.get("prefill_tps")),
            Stat.from_dict(d.get("cached_tokens")),
            reasoning=bool(d.get("reasoning")),
            aggregate_tps=d.get("aggregate_tps"),
            speedup=d.get("speedup"),
            overlap=d.get("overlap"),
            anomalies={k: AnomalyCount.from_dict(a) for k, a in (d.get("anomalies") or {}).items()},
            untrusted_usage=int(d.get("untrusted_usage") or 0),
            extra={k: v for k, v in d.items() if k not in _FIXED},
        )

    def updated(self, more: JSONObject) -> Summary:
        """This summary with `more`'s keys set, as `dict.update` would (new keys last)."""
        return Summary.from_dict({**self.to_dict(), **more})

    def with_anomaly(self, kind: str, count: int, evidence: str) -> Summary:
        """This summary with one more anomaly kind (a judgment over the whole group)."""
        return replace(self, anomalies={**self.anomalies, kind: AnomalyCount(count, evidence)})

    # -- the optional sections ----------------------------------------------------------------

    @property
    def slo(self) -> SloVerdict | None:
        """The SLO verdict of a judged group (`mlxproxy.load.judge.slo.judge`)."""
        d = self.extra.get("slo")
        return None if d is None else SloVerdict.from_json(_json_object(d))

    @property
    def goodput(self) -> Goodput | None:
        """The goodput of a judged group."""
        d = self.extra.get("goodput")
        return None if d is None else Goodput.from_json(_json_object(d))

    def judged(self, j: Judgment) -> Summary:
        """This summary with `j`'s verdict and goodput set (`summary.slo`, `summary.goodput`)."""
        return self.updated(j.to_json())

    @property
    def waves(self) -> tuple[Wave, ...] | None:
        """bench's figures of each wave of a wave group (None in files written before them)."""
        v = self.extra.get("waves")
        return None if v is None else tuple(Wave.from_json(w) for w in _json_objects(v))

    @property
    def sessions(self) -> SessionsFigures | None:
        """The figures of replayed conversations (`{"count", "conversations", "session_s"}`)."""
        v = self.extra.get("sessions")
        return None if not isinstance(v, Mapping) else SessionsFigures.from_json(v)

    def figure(self, key: str) -> float | None:
        """An optional number by its key in the file (`speedup_min`, `overlap_max`, `sent_rate`, ...), else None."""
        return json_float(self.extra.get(key))

    def stat(self, key: str) -> Stat | None:
        """An optional figure's order statistics by its key (`schedule_lag_s`), else None."""
        v = self.extra.get(key)
        return None if not isinstance(v, Mapping) else Stat.from_json(v)

    def section(self, key: str) -> JSONObject:
        """An optional object by its key (`usage_figures`), empty when absent."""
        return _json_object(self.extra.get(key))


@dataclass(frozen=True, slots=True)
class FailedRequest:
    """A request of a wave that failed (`summary.waves[i].failed[j]`): its outcome and HTTP status."""

    outcome: str
    status: int | None = None

    def to_json(self) -> dict[str, JSONValue]:
        return {"outcome": self.outcome, "status": self.status}

    @classmethod
    def from_json(cls, d: JSONObject) -> FailedRequest:
        status = d.get("status")
        return cls(str(d.get("outcome")), status if isinstance(status, int) and not isinstance(status, bool) else None)


@dataclass(frozen=True, slots=True)
class Wave:
    """bench's figures of one wave of requests released together (`summary.waves[i]`)."""

    speedup: float | None
    overlap: float | None
    ok: int
    failed: tuple[FailedRequest, ...] = ()
    aggregate_tps: float | None = None
    baseline_wall_tps: float | None = None

    def to_json(self) -> dict[str, JSONValue]:
        """The wave as `summary.waves[i]` holds it, in the order bench writes its keys."""
        return {
            "aggregate_tps": self.aggregate_tps,
            "baseline_wall_tps": self.baseline_wall_tps,
            "overlap": self.overlap,
            "speedup": self.speedup,
            "ok": self.ok,
            "failed": [f.to_json() for f in self.failed],
        }

    @classmethod
    def from_json(cls, d: JSONObject) -> Wave:
        return cls(
            json_float(d.get("speedup")),
            json_float(d.get("overlap")),
            _json_int(d.get("ok")),
            tuple(FailedRequest.from_json(f) for f in _json_objects(d.get("failed"))),
            json_float(d.get("aggregate_tps")),
            json_float(d.get("baseline_wall_tps")),
        )


@dataclass(frozen=True, slots=True)
class SessionsFigures:
    """What replayed conversations add to a summary (`summary.sessions`): how many runs, of how
    many captured conversations, and each run's wall time."""

    count: int
    conversations: int
    session_s: Stat

    @classmethod
    def from_json(cls, d: JSONObject) -> SessionsFigures:
        return cls(_json_int(d.get("count")), _json_int(d.get("conversations")), Stat.from_json(d.get("session_s")))


@dataclass(frozen=True, slots=True)
class TargetFacts:
    """bench's facts about one target (`targets[i]` of a bench result file)."""

    name: str
    url: str = ""
    model: str | None = None
    error: str | None = None
    calibration: str = ""

    @classmethod
    def from_json(cls, d: JSONObject) -> TargetFacts:
        return cls(
            str(d.get("name")),
            _json_str(d.get("url")) or "",
            _json_str(d.get("model")),
            None if d.get("error") is None else str(d.get("error")),
            _json_str(d.get("calibration")) or "",
        )


@dataclass(frozen=True, slots=True)
class SessionTurn:
    """Where a request of replayed conversations stood: its conversation run (`session`, the
    run's number in the whole test), its `turn` in it (from 0) and the think time before it."""

    session: int
    turn: int
    think_s: float


#: the keys `Record.to_dict(timeline=True)` writes, in its order
_RECORD_ORDER = (
    *(f.name for f in fields(Record) if f.name not in ("t_start_mono", "event_offsets_s")),
    "event_offsets_ms",
)
_RECORD_KEYS = frozenset(_RECORD_ORDER)
#: what a row lacking one of the record's required keys reads as (a hand-made row; its keys are kept
#: as they were): no endpoint counts as a chat completion, no outcome as a failed request
_REQUIRED: dict[str, object] = {
    "id": "",
    "started_at": 0.0,
    "upstream": "",
    "model": None,
    "endpoint": "chat_completions",
    "stream": False,
    "status": None,
    "outcome": "protocol_error",
}
#: the keys the load generator adds to a record's (`turn` replaces the record's own, in place)
_RUN_KEYS = frozenset({"source_id", "schedule_lag_s", "session", "turn", "think_s"})
#: row key orders not this version's (earlier files), one tuple each however many rows have it
_LAYOUTS: dict[tuple[str, ...], tuple[str, ...]] = {}


@dataclass(frozen=True, slots=True)
class RunRecord:
    """One measured request of a run: the core's `Record` and what the load generator adds.

    In a result file it is one row of a group's `records`: the record's keys
    (`Record.to_dict(timeline=True)`), then `source_id` (replay's rows: the captured record it
    replays, null for a synthetic request; bench's rows have no such key, `has_source_id`),
    `schedule_lag_s` (when it had a due time), and a replayed conversation's `session` and
    `think_s` (its `turn` replaces the record's own prefix-tracking turn, in place).
    Keys this version does not know are kept in `extra` and written back; a row whose keys
    were in another order (or lacked some: an earlier version's) keeps its order in `layout`."""

    record: Record
    source_id: str | None = None
    has_source_id: bool = False
    schedule_lag_s: float | None = None
    session: int | None = None
    turn: int | None = None
    think_s: float | None = None
    extra: JSONObject = field(default_factory=dict)
    layout: tuple[str, ...] | None = field(default=None, compare=False)

    @property
    def id(self) -> str:
        return self.record.id

    @property
    def row_turn(self) -> int | None:
        """The row's `turn`: a replayed conversation's turn, else the record's own."""
        return self.record.turn if self.turn is None else self.turn

    @classmethod
    def of(
        cls,
        record: Record,
        *,
        source_id: str | None = None,
        has_source_id: bool = False,
        schedule_lag_s: float | None = None,
        where: SessionTurn | None = None,
    ) -> RunRecord:
        """A request of this run, with its conversation's place when it had one."""
        if where is None:
            return cls(record, source_id, has_source_id, schedule_lag_s)
        return cls(record, source_id, has_source_id, schedule_lag_s, where.session, where.turn, where.think_s)

    def to_dict(self) -> dict[str, object]:
        d: dict[str, object] = self.record.to_dict(timeline=True)
        if self.has_source_id:
            d["source_id"] = self.source_id
        if self.schedule_lag_s is not None:
            d["schedule_lag_s"] = self.schedule_lag_s
        if self.session is not None:
            d["session"] = self.session
        if self.turn is not None:
            d["turn"] = self.turn
        if self.think_s is not None:
            d["think_s"] = self.think_s
        d.update(self.extra)
        if self.layout is not None:
            return {k: d.get(k) for k in self.layout}
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RunRecord:
        sessions = "session" in d
        out = cls(
            Record.from_dict({**_REQUIRED, **d}),
            d.get("source_id"),
            "source_id" in d,
            d.get("schedule_lag_s"),
            d.get("session"),
            d.get("turn") if sessions else None,
            d.get("think_s"),
            {k: v for k, v in d.items() if k not in _RECORD_KEYS and k not in _RUN_KEYS},
        )
        keys = tuple(d)
        if out._keys() != keys:
            out = replace(out, layout=_LAYOUTS.setdefault(keys, keys))
        return out

    def _keys(self) -> tuple[str, ...]:
        """The keys `to_dict` writes without a `layout`, in order (what `from_dict` compares a row's with)."""
        run = (
            ("source_id",) * self.has_source_id
            + ("schedule_lag_s",) * (self.schedule_lag_s is not None)
            + ("session",) * (self.session is not None)
            + ("think_s",) * (self.think_s is not None)
        )
        return _RECORD_ORDER + run + tuple(k for k in self.extra if k not in _RECORD_KEYS and k not in run)


class CompareRow(TypedDict, total=False):
    """One row of `replay --compare` (a group's `compare`): a replayed request's figures next to
    the captured request's. A dict as the file holds it (files may lack the later keys)."""

    source_id: str
    model: str | None
    captured_ttft_s: float | None
    replayed_ttft_s: float | None
    captured_cached_tokens: int | None
    replayed_cached_tokens: int | None
    replayed_prompt_tokens: int | None
    captured_decode_tps: float | None
    replayed_decode_tps: float | None
    captured_outcome: str
    replayed_outcome: str


@dataclass(frozen=True, slots=True)
class Group:
    """One test of a run against one target: its requests (`RunRecord`s) and their summary."""

    name: str
    target: str
    mode: str
    kind: GroupKind
    params: JSONObject
    summary: Summary
    records: tuple[RunRecord, ...] = ()
    #: replay --compare: each replayed request next to its captured figures (None: not asked)
    compare: tuple[CompareRow, ...] | None = None

    def to_dict(self) -> dict[str, object]:
        out: dict[str, object] = {
            "name": self.name,
            "target": self.target,
            "mode": self.mode,
            "kind": self.kind,
            "params": dict(self.params),
            "summary": self.summary.to_dict(),
            "records": [r.to_dict() for r in self.records],
        }
        if self.compare is not None:
            out["compare"] = [dict(r) for r in self.compare]
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Group:
        params = dict(d.get("params") or {})
        summary = Summary.from_dict(d.get("summary") or {})
        kind = d.get("kind")
        if kind not in GROUP_KINDS:
            kind = legacy_kind(str(d.get("name", "")), params, summary)
        compare = d.get("compare")
        return cls(
            str(d.get("name", "")),
            str(d.get("target", "")),
            str(d.get("mode", "")),
            kind,
            params,
            summary,
            tuple(RunRecord.from_dict(r) for r in d.get("records") or ()),
            None if compare is None else tuple(compare),
        )

    def retargeted(self, target: str) -> Group:
        return replace(self, target=target)

    def with_summary(self, summary: Summary) -> Group:
        return replace(self, summary=summary)

    def param(self, key: str) -> float | None:
        """A numeric parameter (`streams`, `prompt_tokens`, `rate`, ...), else None."""
        return json_float(self.params.get(key))


def legacy_kind(name: str, params: JSONObject, summary: Summary) -> GroupKind:
    """The kind of a group from a file written before groups carried one (mlxproxy up to
    41d6a63), told from the names and parameters those versions gave each test."""
    if params.get("sweep"):
        return "sweep_step"
    if name == "single":
        return "single"
    if name.startswith("single "):
        return "single_size"
    if name == "baseline":
        return "baseline"
    if name.endswith(" interrupted"):
        return "interrupted"
    if params.get("streams") or name.startswith("batch "):
        return "wave"
    if summary.sessions is not None:
        return "sessions"
    if params.get("rate") or params.get("scheduled_rate"):
        return "rate"
    return "replay"


@dataclass(frozen=True, slots=True)
class ResultFile:
    """A whole result file. `extra` holds the file's other top-level keys in order: bench's
    `targets`, replay's `capture` and `target`, the sweeps' `capacity`."""

    kind: ResultKind
    groups: tuple[Group, ...]
    verdicts: Mapping[str, str] = field(default_factory=dict)
    version: str = ""
    created_at: float = 0.0
    extra: JSONObject = field(default_factory=dict)
    format_version: int = RESULT_VERSION

    @classmethod
    def new(
        cls,
        kind: ResultKind,
        groups: Iterable[Group],
        verdicts: Mapping[str, str] | None = None,
        extra: JSONObject | None = None,
    ) -> ResultFile:
        """A file of this run, written now by this version (`schedules.result_file` adds the
        sweeps' capacity)."""
        return cls(kind, tuple(groups), dict(verdicts or {}), __version__, time.time(), dict(extra or {}))

    @property
    def targets(self) -> tuple[TargetFacts, ...]:
        """bench's per-target facts (`name`, `url`, `model`, `calibration`, `error`); empty for replay."""
        return tuple(TargetFacts.from_json(t) for t in _json_objects(self.extra.get("targets")))

    def to_dict(self) -> dict[str, object]:
        return {
            "mlxproxy_result": self.format_version,
            "kind": self.kind,
            "version": self.version,
            "created_at": self.created_at,
            "groups": [g.to_dict() for g in self.groups],
            "verdicts": dict(self.verdicts),
            **self.extra,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ResultFile:
        """Raises ValueError for a document that is not a result file this version can read."""
        fmt = d.get("mlxproxy_result")
        if not isinstance(fmt, int) or isinstance(fmt, bool):
            raise ValueError("not an mlxproxy result file (written by replay/bench --json)")
        if fmt > RESULT_VERSION:
            raise ValueError(f"written by a newer mlxproxy (result format {fmt}); upgrade mlxproxy")
        groups = d.get("groups")
        if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
            raise ValueError("its `groups` is not a list of groups")
        kind: ResultKind = "bench" if d.get("kind") == "bench" else "replay"
        fixed = ("mlxproxy_result", "kind", "version", "created_at", "groups", "verdicts")
        return cls(
            kind,
            tuple(Group.from_dict(g) for g in groups),
            dict(d.get("verdicts") or {}),
            str(d.get("version", "")),
            d.get("created_at") or 0.0,
            {k: v for k, v in d.items() if k not in fixed},
            fmt,
        )
