"""`/sessions`' grouping (proxy/sessions.py) on scripted records: each conversation's client,
the cause that lost it the most and that cause's fix, and the side requests listed apart."""

from __future__ import annotations

from typing import Any

from mlxproxy.core.record import Record
from mlxproxy.proxy.sessions import sessions, side_requests


def _rec(rid: str, t: float, **kw: Any) -> Record:
    base: dict[str, Any] = dict(
        id=rid, started_at=t, upstream="u", model="m", endpoint="chat_completions", stream=True, status=200,
        outcome="ok",
    )  # fmt: skip
    return Record(**{**base, **kw})


def test_sessions_name_the_client_and_the_worst_cause_fix() -> None:
    claude = "Claude Code 2.1.332"
    records = [
        _rec("a", 1.0, conversation_id="a", turn=1, client=claude),
        _rec("t", 1.5, client="OpenCode 1.18.33", side_request="title"),
        _rec(
            "b",
            2.0,
            conversation_id="a",
            turn=2,
            client=claude,
            reprefill_cause="tools_changed",
            reprefill_lost_s=0.2,
            conversation_lost_s=0.2,
            reprefill_fix="tools fix",
        ),  # fmt: skip
        _rec(
            "c",
            3.0,
            conversation_id="a",
            turn=3,
            client=claude,
            reprefill_cause="volatile_span",
            reprefill_lost_s=0.5,
            conversation_lost_s=0.7,
            reprefill_fix="set CLAUDE_CODE_ATTRIBUTION_HEADER=0",
        ),  # fmt: skip
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
