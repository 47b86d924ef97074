"""Summaries, tables and result files for `replay`, `bench` and `report`.

A result file is JSON (its types: `mlxproxy.load.data.results`): `{"mlxproxy_result": 1, "kind",
"version", "created_at", "groups": [{"name", "target", "mode", "kind", "params", "summary",
"records": [...]}], "verdicts": {target: text}}`, with every per-request record (timeline
included), so `mlxproxy report` can render it again and others can recompute anything from it.
"""

from __future__ import annotations

import math
import textwrap
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from mlxproxy.core.detect import overlap_ratio, prefill_judgeable
from mlxproxy.core.record import OK_OUTCOMES, Record, rate_figures, wall_window_s
from mlxproxy.core.stats import percentile, summarize
from mlxproxy.load.data.arrivals import generator_note, sent_rate
from mlxproxy.load.data.results import Group, RunRecord
from mlxproxy.load.data.summary import Goodput, Summary, json_float
from mlxproxy.load.judge.capacity import capacity_of
from mlxproxy.load.judge.slo import SLO_METRICS, fmt_value, slo_text, step_problem
from mlxproxy.load.judge.verdict import capacity_line

__all__ = [
    "aggregate_tps",
    "summarize_records",
    "render_table",
    "summary_row",
    "SUMMARY_COLUMNS",
    "mark_speeds",
    "untrusted_mark",
    "untrusted_notes",
    "Section",
    "render_sections",
    "markdown_sections",
    "markdown_table",
    "group_sections",
    "summary_rows",
    "LINE_WIDTH",
    "range_text",
    "speedup_text",
]

LINE_WIDTH = 100  # console tables are split to fit this many columns


def aggregate_tps(records: Iterable[Record]) -> float | None:
    """sum(N_out) / (max t_end - min t_start) over successful records (one clock)."""
    ok = [r for r in records if r.outcome in OK_OUTCOMES and r.n_out is not None and r.duration_s is not None]
    if not ok:
        return None
    span = max(r.t_end_mono for r in ok) - min(r.t_start_mono for r in ok)
    return sum(r.n_out or 0 for r in ok) / span if span > 0 else None


def summarize_records(
    records: Sequence[Record],
    *,
    waves: Sequence[Sequence[Record]] | None = None,
    single_wall_tps: float | None = None,
    lag_s: Sequence[float] | None = None,
    send_times: Sequence[float] | None = None,
) -> Summary:
    """Headline figures of a group: medians (p50) first, then p90/p99/min/max/count.
    Failed requests never enter latency statistics; they are counted by outcome."""
    ok = [r for r in records if r.outcome in OK_OUTCOMES]

    def stat(attr: str) -> dict[str, Any]:
        return summarize(getattr(r, attr) for r in ok)

    if waves:
        per_wave = [a for a in (aggregate_tps(w) for w in waves) if a is not None]
        agg = percentile(sorted(per_wave), 50) if per_wave else None
        overlaps = [o for o in (overlap_ratio(w) for w in waves) if o is not None]
        overlap = percentile(sorted(overlaps), 50) if overlaps else None
    else:
        agg = aggregate_tps(records)
        overlap = None
    anomalies: dict[str, dict[str, Any]] = {}
    for r in records:
        for kind in r.anomalies:
            a = anomalies.setdefault(kind, {"count": 0, "evidence": r.anomaly_evidence.get(kind, "")})
            a["count"] += 1
    out: dict[str, Any] = {
        "requests": len(records),
        "ok": len(ok),
        "outcomes": dict(Counter(r.outcome for r in records)),
        "ttft_s": stat("ttft_s"),
        "ttfc_s": stat("ttfc_s"),
        "e2e_s": stat("e2e_s"),
        "wall_tps": stat("wall_tps"),
        "decode_tps": stat("decode_tps"),
        "tpot_s": stat("tpot_s"),
        # prefill rates only where they mean something (uncached tokens, incremental stream)
        "prefill_tps": summarize(r.prefill_tps for r in ok if prefill_judgeable(r)),
        "cached_tokens": summarize(r.cached_tokens for r in ok if r.cached_tokens is not None),
        "reasoning": any((r.reasoning_tokens_counted or 0) > 0 or (r.reasoning_tokens_reported or 0) > 0 for r in ok),
        "aggregate_tps": agg,
        "speedup": (agg / single_wall_tps) if (agg is not None and single_wall_tps) else None,
        "overlap": overlap,
        "anomalies": anomalies,
    }
    # rows whose speeds do not use the server's usage (the stream contradicted it), and what
    # the usage would have made of them (tables mark the row and print both figures)
    untrusted = [r for r in ok if r.usage_untrusted]
    out["untrusted_usage"] = len(untrusted)
    if untrusted:
        by_usage = [
            rate_figures(
                r.completion_tokens_reported, r.ttft_s, r.e2e_s, wall_window_s(r.duration_s, r.tail_after_done_s)
            )
            for r in ok
        ]
        out["usage_figures"] = {
            "wall_tps_p50": summarize(f[2] for f in by_usage)["p50"],
            "decode_tps_p50": summarize(f[1] for f in by_usage)["p50"],
            "sources": dict(Counter(r.tokens_source for r in untrusted)),
        }
    if lag_s is not None:
        out["schedule_lag_s"] = summarize(lag_s)
    if send_times is not None:
        out["sent_rate"] = sent_rate(send_times)
    return Summary.from_dict(out)


def untrusted_mark(s: Summary) -> str:
    """ "*" for a group some of whose speeds do not use the server's usage count, else ""."""
    return "*" if s.untrusted_usage else ""


def untrusted_notes(items: Iterable[tuple[str, Summary]]) -> list[str]:
    """One footnote line per marked group (`label`, summary): which count its speeds use and
    the figures the server's usage would have given."""
    lines = []
    for label, s in items:
        if not untrusted_mark(s):
            continue
        uf = s.section("usage_figures")
        names = {"stream": "streamed", "tokenizer": "local tokenizer's"}
        sources = uf.get("sources")
        src = " / ".join(names.get(k, k) for k in sorted(sources if isinstance(sources, Mapping) else {})) or "streamed"
        lines.append(
            f"* {label}: usage not trusted in {s.untrusted_usage} of {s.ok} requests (the stream "
            f"contradicts it); speeds use the {src} count. From the usage they would read wall "
            f"{_num(json_float(uf.get('wall_tps_p50')), '.1f')}, decode {_num(json_float(uf.get('decode_tps_p50')), '.1f')}"
            " tok/s."
        )
    return lines


def range_text(lo: float | None, hi: float | None, fmt: str) -> str:
    """ " (lo\u2013hi)" of a figure's spread over bench waves; "" when absent or equal once formatted."""
    if lo is None or hi is None or format(lo, fmt) == format(hi, fmt):
        return ""
    return f" ({format(lo, fmt)}\u2013{format(hi, fmt)})"


def speedup_text(s: Summary) -> str:
    """A group's speedup, "1.79x", with its spread over the waves where bench measured one: "1.79x (1.19\u20131.81)"."""
    if s.speedup is None:
        return "-"
    return _num(s.speedup, ".2f") + "x" + range_text(s.figure("speedup_min"), s.figure("speedup_max"), ".2f")


def _num(v: Any, fmt: str) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return format(v, fmt)


SUMMARY_COLUMNS = (
    "target",
    "mode",
    "ok/req",
    "TTFT p50",
    "TTFC p50",
    "decode tok/s",
    "wall tok/s",
    "TPOT p50",
    "TPOT p99",
    "agg tok/s",
    "speedup",
)

#: the legend printed under every table that has these columns (one meaning, everywhere)
LEGEND = {
    "ok/req": "ok/req: requests that succeeded / sent",
    "TTFT p50": "TTFT: time to first token (p50 = median)",
    "TTFC p50": "TTFC: time to first content token, after any reasoning",
    "decode tok/s": "decode tok/s: one stream's output tokens/s after its first token (median)",
    "wall tok/s": "wall tok/s: output tokens / whole request time (median)",
    "TPOT p50": "TPOT: time per output token (p99 = 99th percentile)",
    "agg tok/s": "agg tok/s: all streams' output tokens / wall time (per wave when released together)",
    "speedup": "speedup: agg tok/s / one stream alone, per wave then the median (2.00x = two streams at full speed, "
    "<=1x = one after another)",
    "overlap": "overlap: share of a wave's time when its streams were all generating",
    "prefill": "prefill tok/s: uncached prompt tokens / TTFT",
}
DASH = "-: does not apply or not measured"


def summary_row(target: str, mode: str, s: Summary) -> dict[str, str]:
    row = {
        "target": target,
        "mode": mode,
        "ok/req": f"{s.ok}/{s.requests}",
        "TTFT p50": _sec(s.ttft_s.p50),
        "TTFC p50": _sec(s.ttfc_s.p50),
        "decode tok/s": _num(s.decode_tps.p50, ".1f"),
        "wall tok/s": _num(s.wall_tps.p50, ".1f"),
        "TPOT p50": _ms(s.tpot_s.p50),
        "TPOT p99": _ms(s.tpot_s.p99),
        "agg tok/s": _num(s.aggregate_tps, ".1f"),
        "speedup": speedup_text(s),
    }
    # speeds that do not use the server's usage count are marked (footnote: untrusted_notes)
    return mark_speeds(row, s, ("decode tok/s", "wall tok/s", "TPOT p50", "TPOT p99", "agg tok/s", "speedup"))


def mark_speeds(row: dict[str, str], s: Summary, keys: Sequence[str]) -> dict[str, str]:
    """`row` with the untrusted-usage mark after each figure in `keys` (see `untrusted_notes`)."""
    mark = untrusted_mark(s)
    if mark:
        for k in keys:
            if row.get(k, "-") != "-":
                row[k] += mark
    return row


def _sec(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}s"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.1f}ms"


def _wrap(text: str, width: int = LINE_WIDTH, indent: str = "  ") -> list[str]:
    return textwrap.wrap(text, width=width, subsequent_indent=indent, break_on_hyphens=False) or [""]


def legend_for(columns: Sequence[str], extra: Sequence[str] = ()) -> str:
    parts = [LEGEND[c] for c in columns if c in LEGEND] + list(extra) + [DASH]
    return "; ".join(parts) + "."


def render_table(rows: Sequence[dict[str, str]], columns: Sequence[str] | None = None, width: int = LINE_WIDTH) -> str:
    """A plain-text table (no dependency), columns in order, widths fitted. A table wider
    than `width` is split into several, each repeating the first column."""
    if not rows:
        return "(no results)"
    cols = list(columns or rows[0].keys())
    widths = {c: max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in cols}
    chunks: list[list[str]] = [[cols[0]]]
    for c in cols[1:]:
        used = sum(widths[x] + 2 for x in chunks[-1])
        if len(chunks[-1]) > 1 and used + widths[c] > width:
            chunks.append([cols[0]])
        chunks[-1].append(c)
    parts = []
    for chunk in chunks:
        line = "  ".join(c.ljust(widths[c]) for c in chunk).rstrip()
        sep = "  ".join("-" * widths[c] for c in chunk)
        body = ["  ".join(str(r.get(c, "")).ljust(widths[c]) for c in chunk).rstrip() for r in rows]
        parts.append("\n".join([line, sep, *body]))
    return "\n\n".join(parts)


def _md_cell(v: object) -> str:
    return str(v).replace("|", "\\|")


def markdown_table(rows: Sequence[dict[str, str]], columns: Sequence[str] | None = None) -> str:
    if not rows:
        return "(no results)\n"
    cols = list(columns or rows[0].keys())
    md = ["| " + " | ".join(map(_md_cell, cols)) + " |", "|" + "---|" * len(cols)]
    md += ["| " + " | ".join(_md_cell(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(md) + "\n"


class Section:
    """One titled table with its legend and notes: rendered on the console and as Markdown alike."""

    def __init__(
        self,
        title: str,
        rows: list[dict[str, str]],
        columns: Sequence[str] | None = None,
        legend: str = "",
        notes: Sequence[str] = (),
    ) -> None:
        self.title, self.rows, self.legend, self.notes = title, rows, legend, list(notes)
        self.columns = list(columns or (rows[0].keys() if rows else ()))


def render_sections(sections: Sequence[Section]) -> str:
    out: list[str] = []
    for sec in sections:
        if out:
            out.append("")
        if sec.title:
            out.append(sec.title)
        if sec.rows:
            out.append(render_table(sec.rows, sec.columns))
        if sec.legend:
            out.extend(_wrap(sec.legend))
        for n in sec.notes:
            out.extend(_wrap(n, indent="    "))
    return "\n".join(out)


def markdown_sections(sections: Sequence[Section]) -> str:
    out: list[str] = []
    for sec in sections:
        if sec.title:
            out.append(f"### {sec.title.rstrip(':')}\n")
        if sec.rows:
            out.append(markdown_table(sec.rows, sec.columns))
        if sec.legend:
            out.append(f"_{sec.legend}_\n")
        if sec.notes:
            out.append("\n".join(f"- {n.strip()}" for n in sec.notes) + "\n")
    return "\n".join(out)


def summary_rows(groups: Sequence[Group]) -> list[dict[str, str]]:
    return [summary_row(g.target, g.mode, g.summary) for g in groups]


def group_sections(groups: Sequence[Group], verdicts: dict[str, str] | None = None) -> list[Section]:
    """The replay view: one row per group, its legend, then each anomaly once per target
    (with how many requests of how many showed it) and the errors."""
    rows = summary_rows(groups)
    cols = [c for c in SUMMARY_COLUMNS if c != "TTFC p50" or any(g.summary.reasoning for g in groups)]
    cols = [c for c in cols if c not in ("agg tok/s", "speedup") or any(r[c] != "-" for r in rows)]
    notes: list[str] = []
    for g in groups:
        note = generator_note(f"{g.target} {g.mode}", g.summary, g.params)
        if note:
            notes.append(note)
    for target in dict.fromkeys(g.target for g in groups):
        mine = [g for g in groups if g.target == target]
        kinds: dict[str, dict[str, Any]] = {}
        errors: Counter[str] = Counter()
        for g in mine:
            for kind, a in g.summary.anomalies.items():
                k = kinds.setdefault(kind, {"count": 0, "evidence": a.evidence, "groups": [], "of": 0})
                k["count"] += a.count
                k["of"] += g.summary.requests  # out of the tests it was found in, not the whole run
                k["groups"].append(g.mode)
            errors.update({k: v for k, v in g.summary.outcomes.items() if k not in OK_OUTCOMES})
        if errors:
            notes.append(f"{target}: failed requests: {', '.join(f'{k} {v}' for k, v in sorted(errors.items()))}")
        for kind, k in sorted(kinds.items()):
            notes.append(
                f"{target}: {kind} in {k['count']} of {k['of']} requests ({', '.join(k['groups'])}): {k['evidence']}"
            )
    for target, v in (verdicts or {}).items():
        notes.append(f"verdict {target}: {v}")
    notes.extend(untrusted_notes((f"{g.target} {g.mode}", g.summary) for g in groups))
    return [Section("", rows, cols, legend_for(cols), notes)]


def slo_section(groups: Sequence[Group]) -> Section | None:
    """The judged groups against their SLO: goodput (share and rate of requests that met
    every threshold), each threshold's measured value, and whether the SLO held."""
    judged = [(g, slo, g.summary.goodput or Goodput(0, 0)) for g in groups if (slo := g.summary.slo) is not None]
    if not judged:
        return None
    thresholds = judged[0][1].thresholds
    rows = []
    for g, slo, gp in judged:
        s = g.summary
        row = {
            "target": g.target,
            "test": g.mode,
            "ok/req": f"{s.ok}/{s.requests}",
            "goodput": "-" if gp.share is None else f"{gp.share:.0%}",
            "good req/s": _num(gp.rate, ".2f"),
        }
        for key in thresholds:
            metric, _, pct = key.rpartition("_p")
            row[f"{SLO_METRICS[metric][3]} p{pct}"] = fmt_value(slo.values.get(key), SLO_METRICS[metric][1])
        row["SLO"] = "held" if slo.met else "broken"
        rows.append(row)
    notes = [f"{g.target} {g.mode}: {step_problem(g.summary)}" for g, slo, _ in judged if not slo.met]
    return Section(
        f"SLO ({slo_text(thresholds)}):",
        rows,
        None,
        "goodput: requests that succeeded and met every threshold themselves / sent; good req/s: those"
        " per second of the test's wall time; SLO: held when every percentile met its threshold and no"
        " request failed.",
        notes,
    )


def sweep_sections(groups: Sequence[Group]) -> list[Section]:
    """The sweep's steps per target and the capacity verdict, one line per target."""
    caps = capacity_of(groups)
    if not caps:
        return []
    rows = []
    for target, cap in caps.items():
        for st in cap.steps:
            gp, unit = st.goodput, cap.unit
            rows.append(
                {
                    "target": target,
                    "step": f"{st.step:g} " + (unit if unit == "req/s" else unit[:4] + "."),
                    "ok/req": f"{st.ok}/{st.requests}",
                    "TTFT p50": _sec(st.ttft_p50_s),
                    "TTFT p95": _sec(st.ttft_p95_s),
                    "TPOT p50": _ms(st.tpot_p50_s),
                    "TPOT p95": _ms(st.tpot_p95_s),
                    "decode tok/s": _num(st.decode_tps_p50, ".1f"),
                    "agg tok/s": _num(st.aggregate_tps, ".1f"),
                    "goodput": "-" if gp is None or gp.share is None else f"{gp.share:.0%}",
                    "anomalies": ",".join(f"{k} {v}" for k, v in sorted(st.anomalies.items())) or "-",
                    "SLO": "held" if st.slo_met else "broken",
                }
            )
    legend = (
        "step: streams (requests in flight, closed loop), agent sessions at once, or requests/s sent (open loop); "
        + "; ".join(LEGEND[k] for k in ("ok/req", "TTFT p50", "decode tok/s", "agg tok/s"))
        + "; TPOT p95 / TTFT p95: 95th percentile; goodput: share of requests that met every threshold."
    )
    return [
        Section("Sweep (one load test per step):", rows, None, legend),
        Section(
            "Capacity (and the limit it met first; in parentheses, where the noise leaves it):",
            [],
            None,
            "",
            [capacity_line(t, c) for t, c in caps.items()],
        ),
    ]


def session_sections(groups: Sequence[Group]) -> list[Section]:
    """Replayed conversations (`replay --sessions`): TTFT and prompt-cache reuse by turn, and
    the whole-session time."""
    out = []
    for g in groups:
        sess = g.summary.sessions
        if not sess:
            continue
        by_turn: dict[int, list[RunRecord]] = {}
        for r in g.records:
            by_turn.setdefault(int(r.row_turn or 0), []).append(r)
        rows = []
        for turn, recs in sorted(by_turn.items()):
            ok = [r.record for r in recs if r.record.outcome in OK_OUTCOMES]
            ttft = sorted(r.ttft_s for r in ok if r.ttft_s is not None)
            cached = sorted(r.cached_tokens for r in ok if r.cached_tokens is not None)
            prompt = sorted(r.prompt_tokens for r in ok if r.prompt_tokens is not None)
            think = sorted(r.think_s for r in recs if r.think_s is not None)
            rows.append(
                {
                    "target": g.target,
                    "turn": str(turn + 1),
                    "ok/req": f"{len(ok)}/{len(recs)}",
                    "think p50": _sec(percentile(think, 50)) if turn else "-",
                    "TTFT p50": _sec(percentile(ttft, 50)),
                    "TTFT p95": _sec(percentile(ttft, 95)),
                    "prompt tok p50": _num(percentile(prompt, 50), ".0f"),
                    "cached tok p50": _num(percentile(cached, 50), ".0f"),
                }
            )
        st = sess.session_s
        out.append(
            Section(
                f"{g.target} {g.mode}: {sess.count} sessions ({sess.conversations} captured conversations), by turn:",
                rows,
                None,
                "turn: the turn's place in its conversation; think: seconds between the previous response's"
                " end and this turn; cached tok: prompt tokens the server took from its prompt cache"
                " (- = not reported).",
                [f"whole session: p50 {_num(st.p50, '.2f')} s, max {_num(st.max, '.2f')} s"],
            )
        )
    return out
