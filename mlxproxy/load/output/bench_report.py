"""How a bench result is shown: its console tables, plot, HTML page and result file (used by
`bench`, `demo` and `report`)."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from typing import Any

import click

from mlxproxy.load.data.arrivals import generator_note
from mlxproxy.load.data.plot import Chart, svg_charts
from mlxproxy.load.data.results import Group, ResultFile
from mlxproxy.load.data.targets import Calibration, Target, TargetResult
from mlxproxy.load.judge.verdict import result_file, sweep_charts
from mlxproxy.load.output.bench_verdict import headline, headline_notes, smallest_single, verdict
from mlxproxy.load.output.files import Outputs, write_csv, write_result, write_text
from mlxproxy.load.output.htmlreport import render_html
from mlxproxy.load.output.report import (
    LEGEND,
    SUMMARY_COLUMNS,
    Section,
    legend_for,
    markdown_sections,
    range_text,
    render_sections,
    slo_section,
    speedup_text,
    summary_row,
    sweep_sections,
)


def all_groups(results: Sequence[TargetResult]) -> list[Group]:
    return [g for r in results for g in r.groups]


def results_doc(results: Sequence[TargetResult], verdicts: dict[str, str] | None = None) -> ResultFile:
    """The bench result file of `results` (verdicts computed unless given)."""
    verdicts = verdicts if verdicts is not None else {r.target.name: verdict(r) for r in results}
    extra = {
        "targets": [
            {
                "name": r.target.name,
                "url": r.target.url,
                "model": r.model,
                "error": r.error,
                "calibration": r.calibration.source,
            }
            for r in results
        ]
    }
    return result_file("bench", all_groups(results), verdicts, extra)


def results_from_doc(doc: ResultFile, prefix: str = "") -> tuple[list[TargetResult], dict[str, str]]:
    """A bench result file back into the results `bench` printed (for `report`)."""
    out: dict[str, TargetResult] = {}
    for t in doc.targets:
        r = TargetResult(Target(prefix + t.name, t.url), t.model, Calibration(source=t.calibration), [], t.error)
        out[t.name] = r
    for g in doc.groups:
        r = out.setdefault(g.target, TargetResult(Target(prefix + g.target, "")))
        r.groups.append(g.retargeted(prefix + g.target))
    verdicts = {prefix + k: v for k, v in doc.verdicts.items()}
    return list(out.values()), verdicts


def wrap_lines(text: str) -> list[str]:
    return textwrap.wrap(text, width=100)


def _f(v: float | None, unit: str = "", fmt: str = ".1f") -> str:
    return "-" if v is None else format(v, fmt) + unit


def bench_sections(results: list[TargetResult], verdicts: dict[str, str] | None = None) -> list[Section]:
    """Everything `bench` prints, as sections (the console and --markdown render the same)."""
    verdicts = verdicts if verdicts is not None else {r.target.name: verdict(r) for r in results}
    sections = _headline_sections(results, verdicts)
    for part in (_size_section(results), _curve_section(results), _rate_section(results)):
        if part is not None:
            sections.append(part)
    slo = slo_section(all_groups(results))
    if slo is not None:
        sections.append(slo)
    sections += sweep_sections(all_groups(results))
    notes = [note for r in results for note in _anomaly_notes(r)]
    if notes:
        sections.append(Section("Anomalies, with evidence:", [], None, "", notes))
    return sections


def _headline_sections(results: list[TargetResult], verdicts: dict[str, str]) -> list[Section]:
    rows = [headline(r) for r in results]
    reasoning = any(g.summary.reasoning for g in all_groups(results))
    cols = [c for c in rows[0] if c != "TTFC p50" or reasoning] if rows else []
    width = max((len(r.target.name) for r in results), default=0)
    return [
        Section(
            "One request at a time, smallest prompt size (p50 = median of the repeats):",
            rows,
            cols,
            legend_for(cols, ["prompt: prompt tokens sent", "speedup (N): N streams released together"]),
            headline_notes(results),
        ),
        Section(
            "Verdicts:",
            [],
            None,
            "",
            [f"{r.target.name.ljust(width)}  {verdicts.get(r.target.name, '')}" for r in results],
        ),
    ]


def _size_cell(g: Group | None) -> str:
    if g is None:
        return "-"
    s = g.summary
    if s.ok == 0:
        return ",".join(sorted(s.outcomes))[:16]
    ttft, pre = s.ttft_s.p50, s.prefill_tps.p50
    return "-" if ttft is None else f"{ttft:.2f}s " + (f"{pre:.0f}/s" if pre else "-")


def _size_section(results: list[TargetResult]) -> Section | None:
    sizes = sorted(
        {n for g in all_groups(results) if g.kind == "single_size" and (n := g.param("prompt_tokens")) is not None}
    )
    if len(sizes) <= 1:
        return None
    srows = []
    for r in results:
        row = {"target": r.target.name}
        for size in sizes:
            g = next((g for g in r.groups if g.kind == "single_size" and g.param("prompt_tokens") == size), None)
            row[f"{size} tok"] = _size_cell(g)
        srows.append(row)
    return Section(
        "TTFT p50 and prefill tok/s by prompt size:",
        srows,
        None,
        "each cell: TTFT p50, then prefill tok/s (uncached prompt tokens / TTFT; - when the stream"
        " was not incremental or the prompt mostly cached); an outcome name where every request"
        " failed (context_limit: the server refused the prompt's size).",
    )


def _curve_section(results: list[TargetResult]) -> Section | None:
    crows = []
    for r in results:
        curve = [g for g in r.groups if g.kind == "wave"]
        # one stream alone: the baseline measured between the waves (older results: the smallest single size)
        single = next((g for g in r.groups if g.kind == "baseline"), None) or smallest_single(r)
        if curve and single:
            s1 = single.summary
            crows.append(
                {
                    "target": r.target.name,
                    "streams": "1",
                    "decode tok/s": _f(s1.decode_tps.p50),
                    "agg tok/s": _f(s1.wall_tps.p50),
                    "speedup": "1.00x",
                    "overlap": "-",
                }
            )
        for g in curve:
            s = g.summary
            crows.append(
                {
                    "target": r.target.name,
                    "streams": str(g.params["streams"]),
                    "decode tok/s": _f(s.decode_tps.p50),
                    "agg tok/s": _f(s.aggregate_tps),
                    "speedup": speedup_text(s),
                    "overlap": _f(s.overlap, "", ".2f")
                    + range_text(s.figure("overlap_min"), s.figure("overlap_max"), ".2f"),
                }
            )
    if not crows:
        return None
    return Section(
        "Requests released together (batching):",
        crows,
        None,
        "streams: requests started at the same instant (1 = alone, wall tok/s, measured"
        " between the waves); decode tok/s: per stream (median); "
        + "; ".join(LEGEND[k] for k in ("agg tok/s", "speedup", "overlap"))
        + "; (a\u2013b): lowest and highest over the waves.",
    )


def _rate_section(results: list[TargetResult]) -> Section | None:
    rate_groups = [g for g in all_groups(results) if g.kind == "rate"]
    if not rate_groups:
        return None
    cols = [c for c in SUMMARY_COLUMNS if c not in ("TTFC p50", "speedup")]
    lines = [generator_note(f"{g.target} {g.mode}", g.summary, g.params) for g in rate_groups]
    return Section(
        "Open loop (--rate: requests sent on schedule, whatever the server does):",
        [summary_row(g.target, g.mode, g.summary) for g in rate_groups],
        cols,
        legend_for(cols),
        [ln for ln in lines if ln],
    )


def _anomaly_notes(r: TargetResult) -> list[str]:
    """One line per anomaly kind of one target, with where it was found and its evidence."""
    per: dict[str, dict[str, Any]] = {}
    for g in r.groups:
        if g.kind == "single":  # holds every `single N` again
            for kind, a in g.summary.anomalies.items():
                if not any(kind in x.summary.anomalies for x in r.groups if x.kind != "single"):
                    per.setdefault(kind, {"count": a.count, "evidence": a.evidence, "where": ["single"]})
            continue
        for kind, a in g.summary.anomalies.items():
            k = per.setdefault(kind, {"count": 0, "evidence": a.evidence, "where": [], "of": 0})
            k["count"] += a.count
            k["of"] += g.summary.requests  # out of the tests it was found in, not the whole run
            k["where"].append(g.name)
    notes = []
    for kind, k in sorted(per.items()):
        where = (
            "across prompt sizes"
            if k["where"] == ["single"]
            else f"in {k['count']} of {k['of']} requests ({', '.join(k['where'])})"
        )
        notes.append(f"{r.target.name}: {kind} {where}: {' '.join(str(k['evidence']).split())}")
    return notes


def print_bench(results: list[TargetResult], verdicts: dict[str, str] | None = None) -> None:
    click.echo(render_sections(bench_sections(results, verdicts)))


def write_outputs(
    results: list[TargetResult], out: Outputs, verdicts: dict[str, str] | None = None, write_json: bool = True
) -> None:
    """Every file of `out` that bench writes."""
    doc = results_doc(results, verdicts)
    verdicts = dict(doc.verdicts)
    groups = doc.groups
    if out.json and write_json:
        write_result(out.json, doc)
    if out.csv:
        write_csv(out.csv, groups)
    if out.markdown:
        write_text(out.markdown, markdown_sections(bench_sections(results, verdicts)))
    if out.plot:
        write_text(out.plot, plot_svg(results))
    if out.html:
        write_bench_html(results, out.html)


def write_bench_html(results: list[TargetResult], path: str, *, quiet: bool = False) -> None:
    write_text(path, render_html([("bench", results_doc(results))]), quiet=quiet)


def plot_svg(results: list[TargetResult]) -> str:
    """TTFT and prefill tok/s by prompt size; per-stream decode tok/s, aggregate tok/s and
    speedup by streams released together (1 = the smallest prompt alone)."""

    ttft, prefill, curve, agg = [], [], [], []
    for r in results:
        pts_t, pts_p, pts_c, pts_a = [], [], [], []
        for g in r.groups:
            s = g.summary
            if g.kind == "single_size" and s.ok:
                size = float(g.param("prompt_tokens_sent") or g.param("prompt_tokens") or 0)
                pts_t.append((size, s.ttft_s.p50))
                pts_p.append((size, s.prefill_tps.p50))
            if g.kind == "wave":
                streams = float(g.param("streams") or 0)
                pts_c.append((streams, s.decode_tps.p50))
                pts_a.append((streams, s.speedup))
        alone = smallest_single(r)
        if alone and (pts_c or pts_a):
            pts_c.append((1.0, alone.summary.decode_tps.p50))
            pts_a.append((1.0, 1.0))
        ttft.append((r.target.name, pts_t))
        prefill.append((r.target.name, pts_p))
        curve.append((r.target.name, pts_c))
        agg.append((r.target.name, pts_a))

    sweep = sweep_charts(all_groups(results))
    return svg_charts(
        [
            Chart(
                "TTFT by prompt size (p50)",
                "prompt tokens (log scale)",
                "seconds (log scale)",
                ttft,
                log_x=True,
                log_y=True,
            ),
            Chart(
                "Prefill tokens/s by prompt size (p50)",
                "prompt tokens (log scale)",
                "tokens/s",
                prefill,
                log_x=True,
                note="no point: stream not incremental, prompt cached, or request refused",
            ),
            Chart(
                "Batching: speedup of streams released together",
                "streams released together",
                "speedup (x)",
                agg,
                integer_x=True,
                note="speedup = aggregate tok/s / one stream alone; 1 = no batching",
            ),
            Chart(
                "Per-stream decode tokens/s by streams released together (p50)",
                "streams released together",
                "tokens/s",
                curve,
                integer_x=True,
            ),
            *sweep,
        ]
    )
