"""One self-contained HTML file for result documents (`report --html`, `bench --html`,
`replay --html`, and the demo's `bench.html`).

The file references nothing outside itself: inline CSS, inline SVG, no script, no font,
no image link. It holds the verdicts, the summary table, every anomaly with its evidence,
the curves a bench measures (TTFT and prefill by prompt size, per-stream decode tokens/s,
aggregate tokens/s and speedup by streams released together) and every request's timeline,
for one result file or several side by side. No prompt or completion text is written.
"""

from __future__ import annotations

import datetime as _dt
import math
import time
from collections.abc import Callable, Sequence
from html import escape
from importlib.resources import files
from typing import Any

from mlxproxy import __version__
from mlxproxy.core.record import Record
from mlxproxy.load.data.plot import Chart, Series, svg_charts
from mlxproxy.load.data.results import Group, ResultFile
from mlxproxy.load.judge.capacity import capacity_of
from mlxproxy.load.judge.verdict import capacity_line, sweep_charts
from mlxproxy.load.output.files import measured_requests
from mlxproxy.load.output.report import SUMMARY_COLUMNS, summary_row
from mlxproxy.load.output.sessions_view import sessions_html

__all__ = ["render_html"]

MAX_LANES = 120  # requests drawn per group
LANE_LABEL_W = 296  # the room left of a lane for its label: LANE_LABEL_CHARS at ~6 px (10 px sans-serif)
LANE_LABEL_CHARS = 48  # a label's most characters (whole anomaly names, then "+N")
MAX_TICKS = 240  # token marks drawn per request

#: the report's style sheet, package data beside this module
CSS = (files("mlxproxy.load.output") / "report.css").read_text(encoding="utf-8")


def _when(epoch: float | None) -> str:
    if not epoch:
        return "-"
    return _dt.datetime.fromtimestamp(epoch).strftime("%Y-%m-%d %H:%M:%S")


def _num(v: Any, fmt: str, unit: str = "") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return format(v, fmt) + unit


Docs = Sequence[tuple[str, ResultFile]]
Namer = Callable[[str, str], str]  # (source label, target) -> the name a target is shown under


def render_html(docs: Docs) -> str:
    """`docs`: (label, result document) pairs; with several, targets are shown as label:target."""
    many = len(docs) > 1

    def name(label: str, target: str) -> str:
        return f"{label}:{target}" if many else target

    out: list[str] = [
        '<!doctype html><html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>mlxproxy report: {escape(', '.join(label for label, _ in docs))}</title>",
        f"<style>\n{CSS}</style></head><body>",
        f"<header><h1>mlxproxy report</h1><p>written {escape(_when(time.time()))} "
        f"by mlxproxy {escape(__version__)}</p></header><main>",
    ]
    out += _sources(docs)
    out += _verdicts(docs, name)
    out += _capacity(docs, name)
    out += _summary(docs, name)
    out += _anomalies(docs, name)
    out.append(sessions_html(docs, name))  # replayed sessions: each conversation's turns and its re-prefills
    out += _curves(docs, name)
    out += _timelines(docs, name)
    out.append("</main></body></html>\n")
    return "".join(out)


def _sources(docs: Docs) -> list[str]:
    """The result files, side by side: what each is, when written, what it measured."""
    out = ['<section id="sources"><h2>Results</h2><div class="cols">']
    for label, doc in docs:
        targets = sorted({g.target for g in doc.groups})
        n = measured_requests(doc.groups)
        out.append(
            f'<div class="source"><h3>{escape(label)}</h3><p class="muted">{escape(doc.kind)} '
            f"written {escape(_when(doc.created_at))} by mlxproxy {escape(doc.version or '?')}; "
            f"{n} requests measured (each counted once, though several tests may show it; "
            f"{len(doc.groups)} tests); targets: {escape(', '.join(targets))}</p>"
        )
        for t in doc.targets:
            if t.error:
                out.append(f'<p class="bad">{escape(t.name)}: {escape(t.error)}</p>')
        out.append("</div>")
    out.append("</div></section>")
    return out


def _verdict_section(head: str, rows: list[tuple[str, str]], tr: str = "<tr>") -> list[str]:
    """A section of one verdict a target, opened by `head`, its rows by `tr` (formatted with the target)."""
    if not rows:
        return []
    out = [head + "<table><tr><th>target</th><th>verdict</th></tr>"]
    out += [f'{tr.format(escape(t))}<td>{escape(t)}</td><td class="verdict">{escape(v)}</td></tr>' for t, v in rows]
    out.append("</table></section>")
    return out


def _verdicts(docs: Docs, name: Namer) -> list[str]:
    verdicts = [(name(label, t), v) for label, doc in docs for t, v in doc.verdicts.items()]
    return _verdict_section('<section id="verdicts"><h2>Verdicts</h2>', verdicts, '<tr data-target="{}">')


def _capacity(docs: Docs, name: Namer) -> list[str]:
    """Each sweep's capacity verdict."""
    caps = [(name(label, t), c) for label, doc in docs for t, c in capacity_of(doc.groups).items()]
    return _verdict_section(
        '<section id="capacity"><h2>Capacity</h2><p class="muted">the largest step that met the SLO, below '
        "the first that broke it and not past where aggregate tok/s stopped rising; in parentheses, where the "
        "noise leaves it</p>",
        [(t, capacity_line(t, c).split(": ", 1)[1]) for t, c in caps],
    )


def _summary(docs: Docs, name: Namer) -> list[str]:
    """One row of headline figures per group."""
    out = [
        '<section id="summary"><h2>Summary</h2><p class="muted">medians (p50) unless named; failed requests are '
        "counted by outcome and kept out of the latency figures</p><table><tr>"
    ]
    out += [f"<th>{escape(c)}</th>" for c in SUMMARY_COLUMNS]
    out.append("<th>group</th></tr>")
    for label, doc in docs:
        for g in doc.groups:
            row = summary_row(name(label, g.target), g.mode, g.summary)
            out.append(
                "<tr>"
                + "".join(
                    ("<td>" if c in ("target", "mode", "errors", "anomalies") else '<td class="num">')
                    + f"{escape(row[c])}</td>"
                    for c in SUMMARY_COLUMNS
                )
                + f"<td>{escape(g.name)}</td></tr>"
            )
    out.append("</table></section>")
    return out


def _anomalies(docs: Docs, name: Namer) -> list[str]:
    """Every anomaly kind of every group, with one example of its evidence."""
    rows = []
    for label, doc in docs:
        for g in doc.groups:
            for kind, a in sorted(g.summary.anomalies.items()):
                rows.append(
                    f"<tr><td>{escape(name(label, g.target))}</td><td>{escape(g.name)}</td><td>{escape(kind)}</td>"
                    f'<td class="num">{a.count}</td><td class="evidence">{escape(a.evidence)}</td></tr>'
                )
    out = ['<section id="anomalies"><h2>Anomalies, with evidence</h2>']
    if rows:
        out.append(
            "<table><tr><th>target</th><th>group</th><th>anomaly</th><th>count</th><th>evidence (one example)</th></tr>"
        )
        out += rows
        out.append("</table>")
    else:
        out.append("<p>None found.</p>")
    out.append("</section>")
    return out


def _curves(docs: Docs, name: Namer) -> list[str]:
    """The charts of every source, one per row."""
    charts: list[Any] = list(_charts(docs, name))
    for label, doc in docs:
        charts += sweep_charts([g.retargeted(name(label, g.target)) for g in doc.groups])
    if not charts:
        return []
    return [
        '<section id="plots"><h2>Curves</h2><div class="plots">',
        *(svg_charts([c]) for c in charts),
        "</div></section>",
    ]


def _timelines(docs: Docs, name: Namer) -> list[str]:
    """Each group's requests as lanes (a request shown by several groups, once)."""
    out = [
        '<section id="timelines"><h2>Request timelines</h2><p class="muted">one lane per request, from its '
        "start: pale until the first token, dark while decoding, a tick per token event, red where a stall "
        "was; time from the group's first request</p>"
    ]
    for label, doc in docs:
        shown: set[str] = set()
        for g in doc.groups:
            recs = [r.record for r in g.records if r.id not in shown]
            if not recs:
                continue
            shown.update(r.id for r in recs)
            title = f"{name(label, g.target)} · {g.name} · {len(recs)} requests"
            out.append(f'<details open class="timeline"><summary>{escape(title)}</summary>{_lanes(recs)}</details>')
    out.append("</section>")
    return out


def _charts(docs: Sequence[tuple[str, ResultFile]], name: Any) -> list[Chart]:
    ttft: list[Series] = []
    prefill: list[Series] = []
    curve: list[Series] = []
    agg: list[Series] = []
    speedup: list[Series] = []
    for label, doc in docs:
        by_target: dict[str, list[Group]] = {}
        for g in doc.groups:
            by_target.setdefault(g.target, []).append(g)
        for target, groups in by_target.items():
            n = name(label, target)
            sized = [
                (g, size) for g in groups if g.kind == "single_size" and (size := g.param("prompt_tokens")) is not None
            ]
            # bench's waves (replay's batch waves have no stream count to draw against)
            streams = [(g, float(k)) for g in groups if g.kind == "wave" and (k := g.param("streams"))]
            pts_t, pts_p = [], []
            for g, size in sized:
                sent = float(g.param("prompt_tokens_sent") or size)
                pts_t.append((sent, g.summary.ttft_s.p50))
                pts_p.append((sent, g.summary.prefill_tps.p50))
            pts_c = [(k, g.summary.decode_tps.p50) for g, k in streams]
            if sized and streams:  # one stream alone, at the smallest prompt size
                smallest = min(sized, key=lambda gs: gs[1])[0]
                pts_c.append((1.0, smallest.summary.decode_tps.p50))
            pts_a = [(k, g.summary.aggregate_tps) for g, k in streams]
            alone = [a / s for a, s in ((g.summary.aggregate_tps, g.summary.speedup) for g, _ in streams) if a and s]
            if alone:  # one stream alone: the tok/s each wave's speedup divides by (their median)
                pts_a.append((1.0, sorted(alone)[len(alone) // 2]))
            pts_s = [(k, g.summary.speedup) for g, k in streams]
            if streams and any(y is not None for _, y in pts_s):
                pts_s.append((1.0, 1.0))
            for series, pts in ((ttft, pts_t), (prefill, pts_p), (curve, pts_c), (agg, pts_a), (speedup, pts_s)):
                if any(y is not None for _, y in pts):
                    series.append((n, pts))
    streams_x = "streams released together"
    out = []
    if ttft:
        out.append(Chart("TTFT by prompt size (p50)", "prompt tokens", "seconds", ttft, log_x=True))
    if prefill:
        out.append(Chart("Prefill tokens/s by prompt size (p50)", "prompt tokens", "tokens/s", prefill, log_x=True))
    if curve:
        out.append(
            Chart("Per-stream decode tokens/s by parallel streams (p50)", streams_x, "tokens/s", curve, integer_x=True)
        )
    if agg:
        out.append(Chart("Aggregate tokens/s by parallel streams", streams_x, "tokens/s", agg, integer_x=True))
    if speedup:
        out.append(Chart("Speedup over one stream", streams_x, "x", speedup, integer_x=True))
    return out


def _stalls(offs: list[float]) -> list[tuple[float, float]]:
    gaps = [b - a for a, b in zip(offs, offs[1:])]
    if len(gaps) < 5:
        return []
    median = sorted(gaps)[len(gaps) // 2]
    limit = max(1000.0, 10.0 * median)  # the default stall rule (ms): 10x the median gap and >= 1 s
    return [(a, b) for a, b in zip(offs, offs[1:]) if b - a >= limit]


def _lanes(records: Sequence[Record]) -> str:
    recs = sorted(records, key=lambda r: r.started_at or 0.0)
    more = len(recs) - MAX_LANES
    recs = recs[:MAX_LANES]
    t0 = min(r.started_at or 0.0 for r in recs)
    ends = [(r.started_at or 0.0) - t0 + (r.duration_s or 0.0) for r in recs]
    span = max(ends + [1e-3])
    w, left, right, lane = 960, LANE_LABEL_W, 12, 13
    h = 26 + lane * len(recs)

    def sx(t: float) -> float:
        return left + t / span * (w - left - right)

    out = [
        f'<svg class="lanes" xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" '
        'font-family="sans-serif" font-size="10">'
    ]
    for i, r in enumerate(recs):
        y = 4 + i * lane
        start = (r.started_at or 0.0) - t0
        end = start + (r.duration_s or 0.0)
        ok = r.outcome in ("ok", "ok_no_done")
        color = "#2f6fdb" if ok and not r.anomalies else "#d98a00" if ok else "#c62828"
        pale = {"#2f6fdb": "#b9cdf1", "#d98a00": "#f6d9a6", "#c62828": "#f3b9b9"}[color]
        label = _lane_label(r)
        tip = (
            f"{r.id} {r.model or '-'} {r.outcome}: TTFT {_num(r.ttft_s, '.3f', ' s')}, "
            f"e2e {_num(r.e2e_s, '.3f', ' s')}, decode {_num(r.decode_tps, '.1f', ' tok/s')}, "
            f"tokens reported {r.completion_tokens_reported}, counted {r.completion_tokens_counted}"
            + (f"; anomalies: {', '.join(r.anomalies)}" if r.anomalies else "")
        )
        out.append(
            f'<g class="req" data-id="{escape(str(r.id))}"><title>{escape(tip)}</title>'
            f'<text x="{left - 6}" y="{y + 9}" text-anchor="end" fill="{"#1d2330" if ok else "#c62828"}">{escape(label)}</text>'
        )
        x1, x2 = sx(start), max(sx(end), sx(start) + 1.5)
        out.append(f'<rect x="{x1:.1f}" y="{y}" width="{x2 - x1:.1f}" height="{lane - 3}" fill="{pale}"/>')
        ttft = r.ttft_s
        if ttft is not None:
            xt = sx(start + ttft)
            if x2 > xt:
                out.append(f'<rect x="{xt:.1f}" y="{y}" width="{x2 - xt:.1f}" height="{lane - 3}" fill="{color}"/>')
        offs = [round(o * 1000.0, 3) for o in r.event_offsets_s]  # as the file holds them (Record.to_dict)
        for a, b in _stalls(offs):
            out.append(
                f'<rect class="stall" x="{sx(start + a / 1000):.1f}" y="{y - 1}" '
                f'width="{sx(start + b / 1000) - sx(start + a / 1000):.1f}" height="{lane - 1}" fill="#c62828" fill-opacity="0.45"/>'
            )
        step = max(1, math.ceil(len(offs) / MAX_TICKS))
        if offs:
            ticks = " ".join(f"M{sx(start + o / 1000):.1f} {y + lane - 6}v3" for o in offs[::step])
            out.append(f'<path class="tok" d="{ticks}" stroke="#1d2330" stroke-width="0.6"/>')
        out.append("</g>")
    axis_y = 4 + lane * len(recs) + 4
    out.append(f'<line x1="{left}" x2="{w - right}" y1="{axis_y}" y2="{axis_y}" stroke="#999"/>')
    tick_s = _step(span)
    t = 0.0
    while t <= span + 1e-9:
        out.append(f'<text x="{sx(t):.1f}" y="{axis_y + 12}" text-anchor="middle" fill="#6b7280">{t:g} s</text>')
        t += tick_s
    out.append("</svg>")
    if more > 0:
        out.append(f'<p class="muted">and {more} more requests not drawn</p>')
    return "".join(out)


def _lane_label(r: Record) -> str:
    """A lane's label: id, outcome, TTFT, then as many whole anomaly names as fit and "+N" for
    the rest (the lane's tooltip lists them all); never a name cut in the middle."""
    label = f"{(r.id or '')[:8]} {r.outcome} {_num(r.ttft_s, '.3f', 's')}"
    kinds = list(r.anomalies)
    for i, kind in enumerate(kinds):
        rest = len(kinds) - i - 1
        more = f" +{rest}" if rest else ""
        if len(label) + 1 + len(kind) + len(more) > LANE_LABEL_CHARS:
            return label + f" +{len(kinds) - i}"
        label += ("," if i else " ") + kind
    return label


def _step(span: float) -> float:
    raw = span / 8
    mag = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1
    for m in (1, 2, 5, 10):
        if raw <= m * mag:
            return m * mag
    return 10 * mag
