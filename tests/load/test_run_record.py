"""A group's requests are `RunRecord`s: the core's `Record` plus the load generator's own fields,
converted to a result file's row (and back) only at the file boundary."""

from __future__ import annotations

import orjson

from mlxproxy.core.record import Record
from mlxproxy.load.data.results import Group, RunRecord, SessionTurn
from mlxproxy.load.run.client import Timed


def _record(i: int = 0, turn: int | None = None) -> Record:
    return Record(
        id=f"r{i}", started_at=100.0 + i, upstream="t", model="m", endpoint="chat_completions", stream=True,
        status=200, outcome="ok", ttft_s=0.25, e2e_s=1.0, duration_s=1.0, completion_tokens=3,
        event_offsets_s=(0.25, 0.5, 1.0), anomalies=("stall",), turn=turn, t_start_mono=5.0,
    )  # fmt: skip


def _again(r: RunRecord) -> dict[str, object]:
    """`r` written, read and written again, through JSON as a result file holds it."""
    first = orjson.loads(orjson.dumps(r.to_dict()))
    back = RunRecord.from_dict(first)
    assert back.layout is None  # this version's own row: no key order to remember
    second = back.to_dict()
    assert list(second) == list(first)  # the same keys in the same order
    assert second == first
    return second


def test_a_replay_row_round_trips_with_its_source_id() -> None:
    r = RunRecord(_record(), source_id="cap1", has_source_id=True, schedule_lag_s=0.002)
    d = _again(r)
    keys = list(d)
    assert keys[: len(_record().to_dict(timeline=True))] == list(_record().to_dict(timeline=True))
    assert keys[-2:] == ["source_id", "schedule_lag_s"] and d["source_id"] == "cap1"
    back = RunRecord.from_dict(d)
    assert back.source_id == "cap1" and back.has_source_id and back.schedule_lag_s == 0.002
    assert back.record.anomalies == ("stall",) and back.record.event_offsets_s == _record().event_offsets_s


def test_a_synthetic_replay_row_has_a_null_source_id_and_a_bench_row_none_at_all() -> None:
    replayed = _again(RunRecord(_record(), source_id=None, has_source_id=True))
    assert "source_id" in replayed and replayed["source_id"] is None
    bench = _again(RunRecord(_record()))
    assert "source_id" not in bench and "schedule_lag_s" not in bench and "session" not in bench
    assert RunRecord.from_dict(replayed).has_source_id and not RunRecord.from_dict(bench).has_source_id


def test_a_session_row_keeps_its_turn_in_the_records_place() -> None:
    """A replayed conversation's `turn` replaces the record's own prefix-tracking turn where the
    record has it; `session` and `think_s` come after `source_id`, as `dict.update` put them."""
    timed = Timed([_record(0, turn=7)], source_ids={"r0": "cap1"})
    (r,) = timed.rows({"r0": SessionTurn(3, 1, 0.5)})
    assert (r.session, r.turn, r.think_s, r.row_turn, r.record.turn) == (3, 1, 0.5, 1, 7)
    d = _again(r)
    assert d["turn"] == 1 and list(d).index("turn") == list(_record().to_dict(timeline=True)).index("turn")
    assert list(d)[-3:] == ["source_id", "session", "think_s"]
    back = RunRecord.from_dict(d)
    assert (back.session, back.turn, back.think_s) == (3, 1, 0.5)


def test_an_unknown_key_is_kept_and_written_back_in_its_place() -> None:
    d = RunRecord(_record(), source_id="cap1", has_source_id=True).to_dict()
    d["from_a_newer_version"] = {"a": [1, 2.5, None]}
    d["source_id_2"] = "x"
    back = RunRecord.from_dict(d)
    assert dict(back.extra) == {"from_a_newer_version": {"a": [1, 2.5, None]}, "source_id_2": "x"}
    assert list(back.to_dict()) == list(d) and back.to_dict() == d
    # a key unknown to this version in the middle of the record's keys stays where it was
    middle = dict(list(d.items())[:5] + [("inserted", 1)] + list(d.items())[5:])
    assert list(RunRecord.from_dict(middle).to_dict().items()) == list(middle.items())


def test_an_earlier_row_without_some_of_the_records_keys_is_written_back_without_them() -> None:
    d = RunRecord(_record(), source_id=None, has_source_id=True).to_dict()
    for key in ("reprefill_cause", "tail_after_done_s", "conversation_lost_s"):
        del d[key]
    back = RunRecord.from_dict(d)
    assert back.layout is not None
    assert list(back.to_dict().items()) == list(d.items())


def test_a_group_holds_run_records_and_writes_rows() -> None:
    timed = Timed([_record(0), _record(1)], source_ids={"r0": "cap1", "r1": None}, lag_by_id={"r1": 0.01})
    g = Group("rate", "t", "rate", "rate", {"rate": 2.0}, Group.from_dict({}).summary, tuple(timed.rows()))
    assert all(isinstance(r, RunRecord) for r in g.records)
    d = g.to_dict()
    again = Group.from_dict(orjson.loads(orjson.dumps(d)))
    assert orjson.dumps(again.to_dict()) == orjson.dumps(d)
    assert [r.id for r in again.records] == ["r0", "r1"] and again.records[1].schedule_lag_s == 0.01


def test_a_hand_made_session_row_without_turn_or_think_time_reads_and_writes_back_as_it_was() -> None:
    """Every version writes `session`, `turn` and `think_s` together; a hand-made row with a
    `session` but a null `turn` and no `think_s` reads as the conversation's turn 0 with no think
    time, and is written back so (the turn 0 it read) with only the keys it had, in their order."""
    row = _record(0, turn=None).to_dict(timeline=True)
    row["session"] = 2
    back = RunRecord.from_dict(orjson.loads(orjson.dumps(row)))
    assert (back.session, back.turn, back.think_s, back.row_turn) == (2, 0, 0.0, 0)
    again = back.to_dict()
    assert again == {**row, "turn": 0} and list(again) == list(row) and "think_s" not in again
