"""How a replay result is shown: its console tables, sweep plot, comparison table and output
files (used by `replay` and `report`)."""

from __future__ import annotations

import os
from collections.abc import Sequence

import click

from mlxproxy.load.data.plot import svg_charts
from mlxproxy.load.data.results import CompareRow, Group
from mlxproxy.load.judge.verdict import result_file, sweep_charts
from mlxproxy.load.output.files import Outputs, write_csv, write_result, write_text
from mlxproxy.load.output.htmlreport import render_html
from mlxproxy.load.output.report import (
    Section,
    group_sections,
    markdown_sections,
    render_sections,
    session_sections,
    slo_section,
    sweep_sections,
)


def replay_sections(groups: Sequence[Group], verdicts: dict[str, str] | None = None) -> list[Section]:
    """Everything `replay` prints (and `report` prints again for a replay result)."""
    sections = group_sections(groups, verdicts)
    slo = slo_section(groups)
    if slo is not None:
        sections.append(slo)
    sections += sweep_sections(groups)
    sections += session_sections(groups)
    for g in groups:
        if g.compare:
            sections.append(
                Section(
                    f"{g.target} {g.mode}: captured vs replayed:",
                    compare_table(g.compare),
                    legend="ttft: time to first token; cached: prompt tokens the server took from its"
                    " prompt cache (- = not reported); prompt_tok: prompt tokens of the replay.",
                )
            )
    return sections


def print_groups(groups: Sequence[Group], verdicts: dict[str, str] | None = None) -> None:
    click.echo(render_sections(replay_sections(groups, verdicts)))


def sweep_svg(groups: Sequence[Group]) -> str:
    return svg_charts(sweep_charts(groups))


def compare_table(rows: Sequence[CompareRow]) -> list[dict[str, str]]:
    def v(x: float | None, fmt: str = ".3f", unit: str = "") -> str:
        return "-" if x is None else (format(x, fmt) if isinstance(x, float) else str(x)) + unit

    return [
        {
            "source_id": str(r["source_id"])[:12],
            "model": str(r.get("model") or "-")[:24],
            "ttft_captured": v(r["captured_ttft_s"], unit="s"),
            "ttft_replayed": v(r["replayed_ttft_s"], unit="s"),
            "cached_captured": v(r.get("captured_cached_tokens")),
            "cached_replayed": v(r.get("replayed_cached_tokens")),
            "prompt_tok": v(r.get("replayed_prompt_tokens")),
            "decode_tok/s_captured": v(r["captured_decode_tps"], ".1f"),
            "decode_tok/s_replayed": v(r["replayed_decode_tps"], ".1f"),
            "outcome": r["replayed_outcome"],
        }
        for r in rows
    ]


def write_replay_outputs(groups: Sequence[Group], capture: str, target_url: str, out: Outputs) -> None:
    """Every file of `out` (the plot: a sweep's)."""
    doc = result_file("replay", groups, extra={"capture": capture, "target": target_url})
    if out.json:
        write_result(out.json, doc)
    if out.csv:
        write_csv(out.csv, groups)
    if out.markdown:
        write_text(out.markdown, markdown_sections(replay_sections(groups)))
    if out.html:
        write_text(out.html, render_html([(os.path.basename(capture), doc)]))
    if out.plot:
        write_text(out.plot, sweep_svg(groups))
