"""`mlxproxy report`: saved replay and bench results rendered again."""

from __future__ import annotations

import os

import click
import orjson

from mlxproxy.errors import MlxproxyError
from mlxproxy.load.commands.common import (
    check_writable,
    fail,
)
from mlxproxy.load.data.results import Group
from mlxproxy.load.data.targets import TargetResult
from mlxproxy.load.judge.capacity import capacity_of
from mlxproxy.load.output.bench_report import bench_sections, plot_svg, results_from_doc
from mlxproxy.load.output.files import read_result, write_csv, write_text
from mlxproxy.load.output.htmlreport import render_html
from mlxproxy.load.output.replay_report import replay_sections, sweep_svg
from mlxproxy.load.output.report import markdown_sections, render_sections
from mlxproxy.vocabulary import (
    shared_option,
)


def file_labels(files: tuple[str, ...] | list[str]) -> list[str]:
    """Short labels that tell the files apart: the file name, or as many trailing path
    parts as it takes (two runs' `bench.json` become `a/bench.json` and `b/bench.json`)."""
    parts = [os.path.normpath(os.path.abspath(f)).split(os.sep) for f in files]
    for n in range(1, max(len(p) for p in parts) + 1):
        labels = ["/".join(p[-n:]) for p in parts]
        if len(set(labels)) == len(labels):
            return labels
    return [str(i + 1) + ":" + f for i, f in enumerate(files)]  # the same file twice


def _capture_hint(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            first = f.readline()
        d = orjson.loads(first)
    except (OSError, ValueError):
        return None
    if isinstance(d, dict) and "v" in d and "id" in d and "outcome" in d:
        return (
            f"{path} is a capture file (written by serve --capture), not a result; "
            f"replay it to measure it: mlxproxy replay {path} --target URL --json result.json"
        )
    return None


@click.command("report")
@click.argument("files", nargs=-1, required=True, type=click.Path(dir_okay=False))
@shared_option("--csv")
@shared_option("--markdown")
@shared_option("--plot", "Bench results, and sweeps of replay results.")
@shared_option("--html")
def report(
    files: tuple[str, ...], csv_path: str | None, md_path: str | None, plot_path: str | None, html_path: str | None
) -> None:
    """Render saved replay/bench results (--json files) again, the same view as the run
    that wrote them; several files side by side, each target labelled with its file."""

    check_writable(csv_path, md_path, plot_path, html_path)
    docs = []
    for f in files:
        try:
            docs.append(read_result(f))
        except MlxproxyError as exc:
            fail(_capture_hint(f) or str(exc))
    labels = file_labels(files)
    bench_results: list[TargetResult] = []
    replay_groups: list[Group] = []
    bench_verdicts: dict[str, str] = {}
    replay_verdicts: dict[str, str] = {}
    for label, doc in zip(labels, docs):
        prefix = f"{label}:" if len(files) > 1 else ""
        if doc.kind == "bench":
            res, verdicts = results_from_doc(doc, prefix)
            bench_results += res
            bench_verdicts.update(verdicts)
        else:
            replay_groups += [g.retargeted(prefix + g.target) for g in doc.groups]
            replay_verdicts.update({prefix + t: v for t, v in doc.verdicts.items()})

    if plot_path and not bench_results and not capacity_of(replay_groups):
        fail(
            "--plot draws bench results and sweeps; these files hold replay results without a sweep "
            "(use --csv or --markdown)"
        )
    sections = []
    if bench_results:
        sections += bench_sections(bench_results, bench_verdicts)
    if replay_groups:
        sections += replay_sections(replay_groups, replay_verdicts)
    click.echo(render_sections(sections))
    try:
        if csv_path:
            write_csv(csv_path, [g for r in bench_results for g in r.groups] + replay_groups)
        if md_path:
            write_text(md_path, markdown_sections(sections))
        if plot_path:
            write_text(plot_path, plot_svg(bench_results) if bench_results else sweep_svg(replay_groups))
        if html_path:
            write_text(html_path, render_html(list(zip(labels, docs))))
    except MlxproxyError as exc:
        fail(str(exc))
