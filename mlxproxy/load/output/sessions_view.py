"""The HTML report's replayed sessions view: each replayed conversation's turns with the
cache doctor's figures (prompt, reusable and cached tokens, TTFT, the re-prefill cause and
where, the seconds it lost), from the records of `replay --mode sessions` groups; per session
its client, the seconds lost and the fix in one line; the side requests apart; and what a fix
replay (`replay --fix`) saved."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from html import escape

from mlxproxy.core.fixes import worst_cause
from mlxproxy.load.data.results import ResultFile, RunRecord

__all__ = ["sessions_html", "MAX_SESSIONS"]

MAX_SESSIONS = 12  # per group, the first ones run (the rest repeat them)
_CACHE_ANOMALIES = (
    "prefix_cache_miss",
    "prompt_prefix_changed",
    "cached_tokens_unreported",
    "cached_tokens_claimed_cold",
)


_HEAD_ROW = '<tr class="conv" style="background:#f3f5f9">'  # a session's heading row (inline: the CSS is shared)


def _cell(v: float | None, fmt: str = "") -> str:
    if v is None:
        return '<td class="num">-</td>'
    return f'<td class="num">{escape(format(v, fmt))}</td>'


def _session_of(r: RunRecord) -> int | str | None:
    return r.record.conversation_id if r.session is None else r.session


def _turn_of(r: RunRecord) -> int:
    """The turn, from 1: replay's own `turn` counts from 0 next to its `session`."""
    t = int(r.row_turn or 0)
    return t + 1 if r.session is not None else t


def _session_head(sid: int | str, turns: Sequence[RunRecord]) -> str:
    """A session's heading row: its client, turns, the seconds it lost and the fix, in one line."""
    recs = [t.record for t in turns]
    client = next((r.client for r in reversed(recs) if r.client), None)
    cause, lost, fix = worst_cause(recs)
    text = f"session {sid}" + (f" · {client}" if client else "") + f" · {len(recs)} turns"
    if cause is not None:
        text += f" · {lost:.2f} s lost to {cause}"
        line = f"Fix: {fix}" if fix else ""
        return f'{_HEAD_ROW}<td colspan="10"><b>{escape(text)}.</b> <span class="fix">{escape(line)}</span></td></tr>'
    return f'{_HEAD_ROW}<td colspan="10"><b>{escape(text)}</b> · 0 s lost</td></tr>'


def _side_html(side: Sequence[RunRecord]) -> str:
    if not side:
        return ""
    rows = "".join(
        f"<tr><td>{escape(r.record.client or '-')}</td><td>{escape(r.record.side_request or '')}</td>"
        f"<td>{escape(r.record.method)} {escape(r.record.path)}</td><td>{escape(r.record.outcome)}</td>"
        f"{_cell(r.record.ttft_s, '.3f')}</tr>"
        for r in side[:MAX_SESSIONS]
    )
    return (
        f'<p class="muted">side requests ({len(side)}): kept out of the sessions and their turns</p>'
        "<table><tr><th>client</th><th>kind</th><th>request</th><th>outcome</th><th>TTFT s</th></tr>"
        + rows
        + "</table>"
    )


def _fix_html(fix: object) -> str:
    """A fix replay's figures (`replay --fix`, load/fixreplay.py): per turn TTFT as captured
    and with the fix, the seconds saved; per session in all."""
    if not isinstance(fix, dict) or not isinstance(fix.get("sessions"), list):
        return ""
    applied = fix.get("applied") if isinstance(fix.get("applied"), dict) else {}
    changed = ", ".join(f"{k} on {v} turns" for k, v in applied.items() if v) or "nothing"  # type: ignore[union-attr]
    rows: list[str] = []
    for s in fix["sessions"]:
        if not isinstance(s, dict):
            continue
        for t in s.get("turns") or []:
            rows.append(
                f"<tr><td>{escape(str(s.get('session')))}</td>{_cell(t.get('turn'))}"
                f"{_cell(t.get('ttft_captured_s'), '.3f')}{_cell(t.get('ttft_fixed_s'), '.3f')}"
                f"{_cell(t.get('saved_s'), '.3f')}</tr>"
            )
        speed = s.get("later_turns_speedup")
        rows.append(
            f'{_HEAD_ROW}<td colspan="5"><b>session {escape(str(s.get("session")))}: '
            f"{float(s.get('saved_s') or 0.0):.3f} s {'saved' if changed != 'nothing' else 'apart (not a saving)'}</b>"
            + (f" · turns &ge; 2 {float(speed):g}x faster to first token" if speed else "")
            + "</td></tr>"
        )
    saved = float(fix.get("saved_s") or 0.0)
    said = (
        f"the fix, replayed: {changed}; {saved:.3f} s saved in all"
        if changed != "nothing"
        else f"the fix, replayed: no request body to change (each fix above is a setting of the client or the "
        f"server); the two runs differ by {saved:.3f} s, run to run: not a saving"
    )
    return (
        f'<p class="muted">{escape(said)}</p>'
        "<table><tr><th>session</th><th>turn</th><th>TTFT as captured s</th><th>TTFT with fix s</th><th>saved s</th></tr>"
        + "".join(rows)
        + "</table>"
    )


def sessions_html(docs: Sequence[tuple[str, ResultFile]], name: Callable[[str, str], str]) -> str:
    """The section, or "" when no group replayed sessions."""
    parts: list[str] = []
    for label, doc in docs:
        for g in doc.groups:
            if g.kind != "sessions" and not g.summary.sessions:
                continue
            by_session: dict[int | str, list[RunRecord]] = {}
            side: list[RunRecord] = []
            for r in g.records:
                sid = _session_of(r)
                if r.record.side_request is not None:
                    side.append(r)  # a title, a token count, a probe: in no conversation
                elif sid is not None:
                    by_session.setdefault(sid, []).append(r)
            if not by_session:
                continue
            lost: dict[str, float] = {}
            for r in g.records:
                cause, lost_s = r.record.reprefill_cause, r.record.reprefill_lost_s
                if cause and lost_s:
                    lost[cause] = lost.get(cause, 0.0) + lost_s
            total = ", ".join(f"{c} {s:.2f} s" for c, s in sorted(lost.items())) or "none"
            parts.append(
                f"<h3>{escape(name(label, g.target))} · {escape(g.name)} · {len(by_session)} sessions</h3>"
                f'<p class="muted">prefill seconds lost to re-prefills, by cause: {escape(total)}</p>'
                "<table><tr><th>session</th><th>turn</th><th>prompt</th><th>reusable</th><th>cached</th>"
                "<th>TTFT s</th><th>lost s</th><th>re-prefill cause</th><th>where</th><th>cache anomalies</th></tr>"
            )
            for sid, turns in list(by_session.items())[:MAX_SESSIONS]:
                parts.append(_session_head(sid, turns))
                for t in sorted(turns, key=_turn_of):
                    rec = t.record
                    anomalies = [a for a in rec.anomalies if a in _CACHE_ANOMALIES]
                    parts.append(
                        f"<tr><td>{escape(str(sid))}</td>{_cell(_turn_of(t))}{_cell(rec.prompt_tokens)}"
                        f"{_cell(rec.prefix_reusable_tokens)}{_cell(rec.cached_tokens)}"
                        f"{_cell(rec.ttft_s, '.3f')}{_cell(rec.reprefill_lost_s, '.3f')}"
                        f"<td>{escape(rec.reprefill_cause or '')}</td>"
                        f'<td class="evidence">{escape(rec.reprefill_at or "")}</td>'
                        f"<td>{escape(', '.join(anomalies))}</td></tr>"
                    )
            parts.append("</table>")
            parts.append(_side_html(side))
            parts.append(_fix_html(g.summary.extra.get("fix")))
            if len(by_session) > MAX_SESSIONS:
                parts.append(f'<p class="muted">the first {MAX_SESSIONS} of {len(by_session)} sessions</p>')
    if not parts:
        return ""
    return (
        '<section id="sessions"><h2>Replayed sessions</h2><p class="muted">each replayed conversation\'s turns: the '
        "prompt, what a prompt cache could reuse of the previous turn's, what the server said it reused, TTFT, and "
        'why a turn was prefilled again (docs/METRICS.md, "Re-prefill causes"); per session the client that sent '
        "it, the seconds lost and the fix; side requests (titles, token counts, probes) apart</p>"
        + "".join(parts)
        + "</section>"
    )
