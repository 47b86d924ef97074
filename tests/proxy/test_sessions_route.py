"""`/sessions`' grouping (proxy/sessions.py) on scripted records: each conversation's client,
the cause that lost it the most and that cause's fix, and the side requests listed apart."""

from __future__ import annotations

from typing import Any

from mlxproxy.core.record import Record
from mlxproxy.proxy.sessions import sessions, side_requests
from support import ok_record


def _rec(rid: str, t: float, **kw: Any) -> Record:
    return ok_record(id=rid, started_at=t, **kw)


def test_sessions_name_the_client_and_the_worst_cause_fix() -> None:
    claude = "Claude Code 2.1.332"

    def reprefilled(rid: str, t: float, turn: int, cause: str, lost_s: float, conv_lost_s: float, fix: str) -> Record:
        """A later turn of Claude Code's conversation `a` that lost `lost_s` to `cause`."""
        return _rec(
            rid, t, conversation_id="a", turn=turn, client=claude, reprefill_cause=cause, reprefill_lost_s=lost_s,
            conversation_lost_s=conv_lost_s, reprefill_fix=fix,
        )  # fmt: skip

    records = [
        _rec("a", 1.0, conversation_id="a", turn=1, client=claude),
        _rec("t", 1.5, client="OpenCode 1.18.33", side_request="title"),
        reprefilled("b", 2.0, 2, "tools_changed", 0.2, 0.2, "tools fix"),
        reprefilled("c", 3.0, 3, "volatile_span", 0.5, 0.7, "set CLAUDE_CODE_ATTRIBUTION_HEADER=0"),
        _rec("p", 4.0, method="HEAD", path="/api/hello", client=claude, side_request="probe"),
        _rec("x", 5.0, conversation_id="x", turn=1),
    ]
    clean, conv = sessions(records)  # most recent first
    assert (clean["client"], clean["fix_cause"], clean["fix"], clean["lost_s"]) == (None, None, None, 0.0)
    assert conv["client"] == claude and conv["turns"] == 3 and conv["lost_s"] == 0.7
    assert (conv["fix_cause"], conv["fix"]) == ("volatile_span", "set CLAUDE_CODE_ATTRIBUTION_HEADER=0")
    assert [t["reprefill_fix"] for t in conv["turn_list"]] == [
        None,
        "tools fix",
        "set CLAUDE_CODE_ATTRIBUTION_HEADER=0",
    ]
    side = side_requests(records)
    assert [(s["id"], s["side_request"], s["client"], s["path"]) for s in side] == [
        ("p", "probe", claude, "/api/hello"),
        ("t", "title", "OpenCode 1.18.33", ""),
    ]
    assert side_requests(records, limit=1) == side[:1]
