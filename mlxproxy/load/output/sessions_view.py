"""The HTML report's replayed sessions view: each replayed conversation's turns with the
cache doctor's figures (prompt, reusable and cached tokens, TTFT, the re-prefill cause and
where, the seconds it lost), from the records of `replay --mode sessions` groups."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from html import escape

from mlxproxy.load.data.results import ResultFile, RunRecord

__all__ = ["sessions_html", "MAX_SESSIONS"]

MAX_SESSIONS = 12  # per group, the first ones run (the rest repeat them)
_CACHE_ANOMALIES = (
    "prefix_cache_miss",
    "prompt_prefix_changed",
    "cached_tokens_unreported",
    "cached_tokens_claimed_cold",
)


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


def sessions_html(docs: Sequence[tuple[str, ResultFile]], name: Callable[[str, str], str]) -> str:
    """The section, or "" when no group replayed sessions."""
    parts: list[str] = []
    for label, doc in docs:
        for g in doc.groups:
            if g.kind != "sessions" and not g.summary.sessions:
                continue
            by_session: dict[int | str, list[RunRecord]] = {}
            for r in g.records:
                sid = _session_of(r)
                if sid is not None:
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
            if len(by_session) > MAX_SESSIONS:
                parts.append(f'<p class="muted">the first {MAX_SESSIONS} of {len(by_session)} sessions</p>')
    if not parts:
        return ""
    return (
        '<section id="sessions"><h2>Replayed sessions</h2><p class="muted">each replayed conversation\'s turns: the '
        "prompt, what a prompt cache could reuse of the previous turn's, what the server said it reused, TTFT, and "
        'why a turn was prefilled again (docs/METRICS.md, "Re-prefill causes")</p>' + "".join(parts) + "</section>"
    )
