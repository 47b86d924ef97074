"""A group's headline figures as the result file holds them: `Summary` (a `Stat` per figure,
an `AnomalyCount` per kind, the optional sections kept in file order as JSON values) and the
typed views of those sections (`SloVerdict`, `Goodput`, `Wave`, `SessionsFigures`,
`TargetFacts`), with the JSON value types and readers the result file's types share.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeAlias

__all__ = [
    "JSONValue",
    "JSONObject",
    "json_float",
    "json_int",
    "json_str",
    "json_object",
    "json_objects",
    "Stat",
    "AnomalyCount",
    "Summary",
    "Breach",
    "SloVerdict",
    "Goodput",
    "Judgment",
    "Wave",
    "FailedRequest",
    "SessionsFigures",
    "TargetFacts",
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


def json_int(v: JSONValue) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) else 0


def json_str(v: JSONValue) -> str | None:
    return v if isinstance(v, str) else None


def json_object(v: JSONValue) -> JSONObject:
    return v if isinstance(v, Mapping) else {}


def json_objects(v: JSONValue) -> list[JSONObject]:
    if isinstance(v, str) or not isinstance(v, Sequence):
        return []
    return [x for x in v if isinstance(x, Mapping)]


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
        d = json_object(v)
        return cls(
            json_int(d.get("count")),
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
        return None if d is None else SloVerdict.from_json(json_object(d))

    @property
    def goodput(self) -> Goodput | None:
        """The goodput of a judged group."""
        d = self.extra.get("goodput")
        return None if d is None else Goodput.from_json(json_object(d))

    def judged(self, j: Judgment) -> Summary:
        """This summary with `j`'s verdict and goodput set (`summary.slo`, `summary.goodput`)."""
        return self.updated(j.to_json())

    @property
    def waves(self) -> tuple[Wave, ...] | None:
        """bench's figures of each wave of a wave group (None in files written before them)."""
        v = self.extra.get("waves")
        return None if v is None else tuple(Wave.from_json(w) for w in json_objects(v))

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
        return json_object(self.extra.get(key))


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
            json_int(d.get("ok")),
            tuple(FailedRequest.from_json(f) for f in json_objects(d.get("failed"))),
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
        return cls(json_int(d.get("count")), json_int(d.get("conversations")), Stat.from_json(d.get("session_s")))


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
            json_str(d.get("url")) or "",
            json_str(d.get("model")),
            None if d.get("error") is None else str(d.get("error")),
            json_str(d.get("calibration")) or "",
        )
