"""`replay --mode sessions --fix`: each captured conversation run as captured and again with
the fix applied, and the seconds the fix saves, per turn and per session.

The fix, applied to the request bodies of a conversation (pure functions, nothing else changes):
  - the system prompt pinned to its first turn's value (a Messages `system`, a Responses
    `instructions`, the leading system/developer messages): a volatile span (a per-request id,
    date or counter, Claude Code's billing line) or an edited system prompt no longer changes
    between turns;
  - the tools in one order: each turn's tools in the order the first turn declared them (new
    ones after, by name).
A history rewrite (the client's setting), an eviction (the server's cache size) and a cache that
keeps only the system prompt (the server's configuration) are not changed by a body rewrite: their
fix is printed (`core.fixes`) and marked as not replayed; where no body changed, the two runs'
difference is said to be run-to-run, not a saving.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from mlxproxy.capture import CapturedRequest
from mlxproxy.core.fixes import not_replayed
from mlxproxy.load.data.results import Group, RunRecord
from mlxproxy.load.data.summary import JSONObject, JSONValue

__all__ = ["FIX_SUFFIX", "fix_conversation", "fixed_captures", "fix_savings", "fix_lines", "fix_report"]

FIX_SUFFIX = ", fix applied"  # the fixed run's group name: the captured run's name and this
_SYSTEM_ROLES = ("system", "developer")


def _system_slots(body: dict[str, Any]) -> list[tuple[str, int | None]]:
    """Where a body keeps its system prompt: ("system", None), ("instructions", None), or
    (list key, index) of each leading system/developer message."""
    slots: list[tuple[str, int | None]] = []
    for key in ("system", "instructions"):
        if body.get(key) is not None:
            slots.append((key, None))
    for key in ("messages", "input"):
        items = body.get(key)
        if not isinstance(items, list):
            continue
        for i, m in enumerate(items):
            if not (isinstance(m, dict) and m.get("role") in _SYSTEM_ROLES):
                break
            slots.append((key, i))
    return slots


def _get(body: dict[str, Any], slot: tuple[str, int | None]) -> Any:
    key, i = slot
    return body.get(key) if i is None else body[key][i].get("content")


def _pin_system(first: dict[str, Any], body: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """`body` with its system prompt as in `first` (when both keep it in the same places)."""
    slots = _system_slots(first)
    if not slots or slots != _system_slots(body):
        return body, False
    changed = False
    out = dict(body)
    for slot in slots:
        want = _get(first, slot)
        if _get(body, slot) == want:
            continue
        changed = True
        key, i = slot
        if i is None:
            out[key] = want
        else:
            items = list(out[key])
            items[i] = {**items[i], "content": want}
            out[key] = items
    return out, changed


def _tool_name(t: Any) -> str:
    if not isinstance(t, dict):
        return ""
    f = t.get("function")
    return str((f if isinstance(f, dict) else t).get("name", ""))


def _order_tools(first: dict[str, Any], body: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """`body` with its tools in the order `first` declared them (new ones after, by name)."""
    ref, tools = first.get("tools"), body.get("tools")
    if not isinstance(ref, list) or not isinstance(tools, list) or len(tools) < 2:
        return body, False
    rank = {_tool_name(t): k for k, t in enumerate(ref)}
    ordered = sorted(tools, key=lambda t: (rank.get(_tool_name(t), len(rank)), _tool_name(t)))
    if ordered == tools:
        return body, False
    return {**body, "tools": ordered}, True


def fix_conversation(bodies: Sequence[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """A conversation's request bodies with the fix applied, and on how many turns each part
    of the fix changed something (the system prompt pinned, the tools ordered)."""
    if not bodies:
        return [], {}
    first = bodies[0]
    out = [first]
    applied = {"system prompt pinned to turn 1's": 0, "tools in turn 1's order": 0}
    for body in bodies[1:]:
        body, pinned = _pin_system(first, body)
        body, ordered = _order_tools(first, body)
        applied["system prompt pinned to turn 1's"] += pinned
        applied["tools in turn 1's order"] += ordered
        out.append(body)
    return out, applied


def fixed_captures(
    convs: Sequence[Sequence[CapturedRequest]],
) -> tuple[list[CapturedRequest], dict[str, int]]:
    """The captured conversations (`replay.split_sessions`) with the fix applied to each, in
    one list, and how many turns each part of the fix changed in all."""
    out: list[CapturedRequest] = []
    total: dict[str, int] = {}
    for conv in convs:
        bodies = [c.request for c in conv]
        if any(b is None for b in bodies):
            out.extend(conv)
            continue
        fixed, applied = fix_conversation([b for b in bodies if b is not None])
        out.extend(dataclasses.replace(c, request=b) for c, b in zip(conv, fixed))
        for k, v in applied.items():
            total[k] = total.get(k, 0) + v
    return out, total


def _by_turn(group: Group) -> dict[tuple[int, int], RunRecord]:
    return {
        (r.session, r.turn): r
        for r in group.records
        if r.session is not None and r.turn is not None and r.record.side_request is None
    }


def fix_savings(captured: Group, fixed: Group) -> JSONObject:
    """Per session (numbered as the groups number them) and turn (from 1), TTFT as captured and
    with the fix, and the seconds saved; per session the seconds saved in all and how much faster
    turns >= 2 reached their first token. Side requests are left out."""
    a, b = _by_turn(captured), _by_turn(fixed)
    turns: dict[int, list[tuple[int, float | None, float | None]]] = {}
    for key in sorted(a.keys() & b.keys()):
        turns.setdefault(key[0], []).append((key[1] + 1, a[key].record.ttft_s, b[key].record.ttft_s))
    sessions: list[JSONValue] = []
    total = 0.0
    for sid, rows in turns.items():
        saved = [None if x is None or y is None else round(x - y, 4) for _, x, y in rows]
        later = [(x or 0.0, y or 0.0) for turn, x, y in rows if turn >= 2]
        cap, fix = sum(x for x, _ in later), sum(y for _, y in later)
        session_saved = round(sum(v or 0.0 for v in saved), 4)
        total += session_saved
        sessions.append(
            {
                "session": sid,
                "turns": [
                    {"turn": turn, "ttft_captured_s": x, "ttft_fixed_s": y, "saved_s": v}
                    for (turn, x, y), v in zip(rows, saved)
                ],
                "saved_s": session_saved,
                "later_turns_speedup": round(cap / fix, 2) if later and fix > 0 else None,
            }
        )
    return {"sessions": sessions, "saved_s": round(total, 4)}


def _fmt(v: Any, spec: str = ".3f") -> str:
    return "-" if v is None else format(v, spec)


def fix_lines(savings: Mapping[str, Any], applied: dict[str, int], fixes: Sequence[tuple[str, str]]) -> list[str]:
    """The console report of a fix replay: what the fix changed, per turn the TTFT as captured
    and with the fix, the seconds saved per turn and per session; then the fixes (cause, line)
    a body rewrite cannot replay."""
    changed = ", ".join(f"{k} on {v} turn{'s' if v != 1 else ''}" for k, v in applied.items() if v)
    lines = [
        f"fix replay: {changed}"
        if changed
        else "fix replay: the bodies needed no change (no system prompt or tools order to pin); "
        "what the captured run lost is fixed outside them, below"
    ]
    for s in savings["sessions"]:
        lines.append(
            f"session {s['session']}:  turn  TTFT as captured  TTFT with fix  {'saved' if changed else 'apart'} s"
        )
        for t in s["turns"]:
            lines.append(
                f"{'':12}{t['turn']:>4}  {_fmt(t['ttft_captured_s']):>16}  {_fmt(t['ttft_fixed_s']):>13}"
                f"  {_fmt(t['saved_s']):>7}"
            )
        speed = s["later_turns_speedup"]
        faster = f"; turns >= 2 {speed:g}x faster to first token" if isinstance(speed, float) else ""
        if changed:
            lines.append(f"session {s['session']}: {s['saved_s']:.3f} s saved{faster}")
        else:
            lines.append(
                f"session {s['session']}: {s['saved_s']:.3f} s apart (the same bodies sent again: not a saving)"
            )
    total = savings["saved_s"]
    lines.append(
        f"all sessions: {total:.3f} s saved"
        if changed
        else f"all sessions: {total:.3f} s apart, run to run (nothing was fixed)"
    )
    for cause, line in fixes:
        why = not_replayed(cause)
        lines.append(f"{cause}: {line}" + (f" ({why})" if why else ""))
    return lines


def fix_report(groups: Sequence[Group]) -> list[str]:
    """The console lines of every fix replay among `groups` (a fixed group follows the group
    it fixes); [] when none ran. The fixes listed are those the captured run's records carry."""
    out: list[str] = []
    for prev, g in zip(groups, groups[1:]):
        fix = g.summary.extra.get("fix")
        if not g.name.endswith(FIX_SUFFIX) or not isinstance(fix, Mapping):
            continue
        seen: dict[str, str] = {}
        for r in prev.records:
            if r.record.reprefill_cause is not None and r.record.reprefill_fix:
                seen.setdefault(r.record.reprefill_cause, r.record.reprefill_fix)
        applied = fix.get("applied")
        counts = {k: v for k, v in applied.items() if isinstance(v, int)} if isinstance(applied, Mapping) else {}
        out += fix_lines(fix, counts, sorted(seen.items()))
    return out
