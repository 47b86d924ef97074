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
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal, TypedDict, get_args

from mlxproxy import __version__
from mlxproxy.core.record import Record
from mlxproxy.load.data.summary import (
    JSONObject,
    Summary,
    TargetFacts,
    json_float,
    json_objects,
)

__all__ = [
    "RESULT_VERSION",
    "GroupKind",
    "GROUP_KINDS",
    "ResultKind",
    "Group",
    "ResultFile",
    "legacy_kind",
    "SessionTurn",
    "RunRecord",
    "CompareRow",
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
    where: SessionTurn | None = None  # a replayed conversation's request: its run, turn and think time
    extra: JSONObject = field(default_factory=dict)
    layout: tuple[str, ...] | None = field(default=None, compare=False)

    @property
    def id(self) -> str:
        return self.record.id

    @property
    def session(self) -> int | None:
        """A replayed conversation's run number in the whole test (None: not one)."""
        return None if self.where is None else self.where.session

    @property
    def turn(self) -> int | None:
        """A replayed conversation's turn, from 0 (None: not one)."""
        return None if self.where is None else self.where.turn

    @property
    def think_s(self) -> float | None:
        return None if self.where is None else self.where.think_s

    @property
    def row_turn(self) -> int | None:
        """The row's `turn`: a replayed conversation's turn, else the record's own."""
        return self.record.turn if self.where is None else self.where.turn

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
        return cls(record, source_id, has_source_id, schedule_lag_s, where)

    def to_dict(self) -> dict[str, object]:
        d: dict[str, object] = self.record.to_dict(timeline=True)
        if self.has_source_id:
            d["source_id"] = self.source_id
        if self.schedule_lag_s is not None:
            d["schedule_lag_s"] = self.schedule_lag_s
        if self.where is not None:
            d["session"], d["turn"], d["think_s"] = self.where.session, self.where.turn, self.where.think_s
        d.update(self.extra)
        if self.layout is not None:
            return {k: d.get(k) for k in self.layout}
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RunRecord:
        out = cls(
            Record.from_dict({**_REQUIRED, **d}),
            d.get("source_id"),
            "source_id" in d,
            d.get("schedule_lag_s"),
            _where(d),
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
            + ("session", "think_s") * (self.where is not None)
        )
        return _RECORD_ORDER + run + tuple(k for k in self.extra if k not in _RECORD_KEYS and k not in run)


def _where(d: Mapping[str, Any]) -> SessionTurn | None:
    """A row's conversation place (`session`, `turn`, `think_s`; every version writes the three
    together). A hand-made row with a `session` but no `turn` or `think_s` reads turn 0 and no
    think time (and is written back with its own keys, in their order)."""
    session, turn = d.get("session"), d.get("turn")
    if session is None:
        return None
    return SessionTurn(session, turn if isinstance(turn, int) else 0, d.get("think_s") or 0.0)


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


#: a result file's own top-level keys, in the order it writes them (its `extra` keys follow)
_FILE_KEYS = ("mlxproxy_result", "kind", "version", "created_at", "groups", "verdicts")


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
        return tuple(TargetFacts.from_json(t) for t in json_objects(self.extra.get("targets")))

    def to_dict(self) -> dict[str, object]:
        head = (self.format_version, self.kind, self.version, self.created_at)
        body = ([g.to_dict() for g in self.groups], dict(self.verdicts))
        return {**dict(zip(_FILE_KEYS, (*head, *body))), **self.extra}

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
        return cls(
            kind,
            tuple(Group.from_dict(g) for g in groups),
            dict(d.get("verdicts") or {}),
            str(d.get("version", "")),
            d.get("created_at") or 0.0,
            {k: v for k, v in d.items() if k not in _FILE_KEYS},
            fmt,
        )
