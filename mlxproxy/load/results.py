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
from dataclasses import dataclass, field, replace
from typing import Any, Literal, get_args

from mlxproxy import __version__

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
]

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

    def to_json(self) -> dict[str, str | float]:
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

    def to_json(self) -> dict[str, object]:
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

    def to_json(self) -> dict[str, int | float | None]:
        return {"good": self.good, "requests": self.requests, "share": self.share, "rate": self.rate}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Goodput:
        return cls(int(d.get("good") or 0), int(d.get("requests") or 0), d.get("share"), d.get("rate"))


@dataclass(frozen=True, slots=True)
class Judgment:
    """A step judged against an SLO (`judge`): its verdict and its goodput."""

    slo: SloVerdict
    goodput: Goodput

    def to_json(self) -> dict[str, object]:
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
    """A group's headline figures (`mlxproxy.load.report.summarize_records`). The sections only
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
    extra: Mapping[str, Any] = field(default_factory=dict)

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

    def updated(self, more: Mapping[str, Any]) -> Summary:
        """This summary with `more`'s keys set, as `dict.update` would (new keys last)."""
        return Summary.from_dict({**self.to_dict(), **more})

    def with_anomaly(self, kind: str, count: int, evidence: str) -> Summary:
        """This summary with one more anomaly kind (a judgment over the whole group)."""
        return replace(self, anomalies={**self.anomalies, kind: AnomalyCount(count, evidence)})

    # -- the optional sections ----------------------------------------------------------------

    @property
    def slo(self) -> SloVerdict | None:
        """The SLO verdict of a judged group (`mlxproxy.load.slo.judge`)."""
        d = self.extra.get("slo")
        return None if d is None else SloVerdict.from_json(d)

    @property
    def goodput(self) -> Goodput | None:
        """The goodput of a judged group."""
        d = self.extra.get("goodput")
        return None if d is None else Goodput.from_json(d)

    def judged(self, j: Judgment) -> Summary:
        """This summary with `j`'s verdict and goodput set (`summary.slo`, `summary.goodput`)."""
        return self.updated(j.to_json())

    @property
    def waves(self) -> Sequence[Mapping[str, Any]] | None:
        """bench's figures of each wave of a wave group (None in files written before them)."""
        return self.extra.get("waves")

    @property
    def sessions(self) -> Mapping[str, Any] | None:
        """`{"count", "conversations", "session_s"}` of replayed conversations."""
        return self.extra.get("sessions")

    def figure(self, key: str) -> Any:
        """An optional figure by its key in the file (`speedup_min`, `overlap_max`, `sent_rate`, ...), else None."""
        return self.extra.get(key)


@dataclass(frozen=True, slots=True)
class Group:
    """One test of a run against one target: its requests (as `Record.to_dict(timeline=True)`
    wrote them, with what the test added: `source_id`, a session's `turn`, ...) and their summary."""

    name: str
    target: str
    mode: str
    kind: GroupKind
    params: Mapping[str, Any]
    summary: Summary
    records: tuple[Mapping[str, Any], ...] = ()
    #: replay --compare: each replayed request next to its captured figures (None: not asked)
    compare: tuple[Mapping[str, Any], ...] | None = None

    def to_dict(self) -> dict[str, object]:
        out: dict[str, object] = {
            "name": self.name,
            "target": self.target,
            "mode": self.mode,
            "kind": self.kind,
            "params": dict(self.params),
            "summary": self.summary.to_dict(),
            "records": [dict(r) for r in self.records],
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
            tuple(d.get("records") or ()),
            None if compare is None else tuple(compare),
        )

    def retargeted(self, target: str) -> Group:
        return replace(self, target=target)

    def with_summary(self, summary: Summary) -> Group:
        return replace(self, summary=summary)


def legacy_kind(name: str, params: Mapping[str, Any], summary: Summary) -> GroupKind:
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
    extra: Mapping[str, Any] = field(default_factory=dict)
    format_version: int = RESULT_VERSION

    @classmethod
    def new(
        cls,
        kind: ResultKind,
        groups: Iterable[Group],
        verdicts: Mapping[str, str] | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> ResultFile:
        """A file of this run, written now by this version (`schedules.result_file` adds the
        sweeps' capacity)."""
        return cls(kind, tuple(groups), dict(verdicts or {}), __version__, time.time(), dict(extra or {}))

    @property
    def targets(self) -> Sequence[Mapping[str, Any]]:
        """bench's per-target facts (`name`, `url`, `model`, `calibration`, `error`); empty for replay."""
        return self.extra.get("targets") or ()

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
