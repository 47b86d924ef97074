"""`mlxproxy replay` and `mlxproxy report`: the command-line shells of replay and reports."""

from __future__ import annotations

import os
import sys
from typing import Any

import click

from mlxproxy.errors import MlxproxyError


def fail(message: str, code: int = 2) -> None:
    click.echo(f"mlxproxy: {message}", err=True)
    sys.exit(code)


def print_groups(groups: list[dict[str, Any]], verdicts: dict[str, str] | None = None) -> None:
    from mlxproxy.report import SUMMARY_COLUMNS, render_table, summary_row, untrusted_notes

    click.echo(render_table([summary_row(g["target"], g["mode"], g["summary"]) for g in groups], SUMMARY_COLUMNS))
    for note in untrusted_notes((f"{g['target']} {g['mode']}", g["summary"]) for g in groups):
        click.echo(note)
    for g in groups:
        s = g["summary"]
        lag = s.get("schedule_lag_s")
        if lag and lag.get("count"):
            click.echo(f"{g['target']} {g['mode']}: schedule lag p50 {lag['p50'] * 1000:.1f} ms, p99 {lag['p99'] * 1000:.1f} ms"
                       " (how far the load generator itself fell behind the recorded offsets)")
        for kind, a in sorted(s["anomalies"].items()):
            click.echo(f"  {g['target']} {g['mode']}: {kind} x{a['count']}: {a['evidence']}")
    for target, verdict in (verdicts or {}).items():
        click.echo(f"verdict {target}: {verdict}")


def parse_filters(values: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    out = []
    for v in values:
        key, sep, pat = v.partition("=")
        if not sep or key not in ("model", "endpoint", "path", "outcome"):
            raise click.BadParameter(f"{v!r}: use KEY=GLOB with KEY one of model, endpoint, path, outcome", param_hint="--filter")
        out.append((key, pat))
    return tuple(out)


@click.command("replay")
@click.argument("capture", type=click.Path(dir_okay=False))
@click.option("--target", "target_url", required=True, metavar="URL",
              help="Server or proxy to replay against, e.g. http://127.0.0.1:8080 (no /v1: paths come from the capture).")
@click.option("--name", "target_name", default=None, help="Name of the target in reports.  [default: its host:port]")
@click.option("--mode", type=click.Choice(["recorded", "sequential", "concurrency", "batch"]), default=None,
              help="recorded: at the captured offsets / --speed (default); sequential: one at a time; "
                   "concurrency: closed loop of --concurrency; batch: waves of --batch released together, "
                   "after a one-at-a-time baseline that gives the speedup.")
@click.option("--speed", type=click.FloatRange(min=0.001), default=1.0, show_default=True,
              help="recorded mode: 2 replays twice as fast, 0.5 half as fast.")
@click.option("--concurrency", type=click.IntRange(min=1), default=None, help="Closed loop with N requests in flight (implies --mode concurrency).")
@click.option("--batch", type=click.IntRange(min=1), default=None, help="Waves of N requests released together (implies --mode batch; 2 = the double-batch test).")
@click.option("--repeat", type=click.IntRange(min=1), default=1, show_default=True, help="Send the selection K times.")
@click.option("--warmup", type=click.IntRange(min=0), default=0, show_default=True, help="Send the first K requests once first, unmeasured.")
@click.option("--filter", "filters", multiple=True, metavar="KEY=GLOB", help="Only requests whose model/endpoint/path/outcome match (repeatable).")
@click.option("--limit", type=click.IntRange(min=1), default=None, help="At most N requests (after filtering).")
@click.option("--nonce", is_flag=True, help="Prefix each prompt with a unique marker so no prompt cache can serve it.")
@click.option("--model", default=None, help="Send this model name instead of the captured one.")
@click.option("--api-key-env", default=None, metavar="VAR", help="Environment variable holding the target's API key.")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=0.1), default=1800.0, show_default=True, help="Seconds of silence before a request times out.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="Write the summary and every per-request record here.")
@click.option("--csv", "csv_path", type=click.Path(dir_okay=False), default=None, help="Write one row per request here.")
@click.option("--compare", is_flag=True, help="Show each request's replayed TTFT and decode TPS next to its captured values.")
@click.option("--html", "html_path", type=click.Path(dir_okay=False), default=None,
              help="Write a self-contained HTML report (tables, anomalies with evidence, every request's timeline).")
def replay(capture: str, target_url: str, target_name: str | None, mode: str | None, speed: float, concurrency: int | None,
           batch: int | None, repeat: int, warmup: int, filters: tuple[str, ...], limit: int | None, nonce: bool,
           model: str | None, api_key_env: str | None, timeout_s: float, json_path: str | None, csv_path: str | None,
           compare: bool, html_path: str | None) -> None:
    """Replay a capture file against a server (or a proxy) and measure every request.

    Bodies are sent as captured, except for the documented rewrites: include_usage
    on streams, --model, --nonce, and filler text for privacy captures.
    """
    from urllib.parse import urlsplit

    from mlxproxy.capture import read_capture
    from mlxproxy.replay import ReplayOptions, run, select
    from mlxproxy.report import write_csv, write_result

    if mode is None:
        mode = "concurrency" if concurrency else "batch" if batch else "recorded"
    parts = urlsplit(target_url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        fail(f"--target must be an http:// or https:// URL, got {target_url!r}")
    api_key = None
    if api_key_env:
        api_key = os.environ.get(api_key_env)
        if api_key is None:
            fail(f"--api-key-env {api_key_env}: that environment variable is not set")
    try:
        caps = read_capture(capture, warn=lambda m: click.echo(f"mlxproxy: warning: {m}", err=True))
    except MlxproxyError as exc:
        fail(str(exc))
    chosen = select(caps, parse_filters(filters), limit)
    if not chosen:
        fail(f"no requests to replay: {capture} has {len(caps)}, none matched the filters")
    opts = ReplayOptions(mode=mode, speed=speed, concurrency=concurrency or 1, batch=batch or 2, repeat=repeat, warmup=warmup,
                         nonce=nonce, model=model, limit=limit, filters=parse_filters(filters))
    name = target_name or parts.netloc
    click.echo(f"replaying {len(chosen)} requests x{repeat} from {capture} against {target_url} ({mode})", err=True)
    groups = run(chosen, target_url, opts, target_name=name, api_key=api_key, timeout_s=timeout_s, compare=compare)
    print_groups(groups)
    if compare:
        from mlxproxy.report import render_table

        for g in groups:
            if g.get("compare"):
                click.echo(f"\n{g['mode']}: captured vs replayed")
                click.echo(render_table([{k: ("-" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v))
                                          for k, v in row.items()} for row in g["compare"]]))
    if json_path:
        write_result(json_path, "replay", groups, extra={"capture": capture, "target": target_url})
        click.echo(f"wrote {json_path}", err=True)
    if csv_path:
        write_csv(csv_path, groups)
        click.echo(f"wrote {csv_path}", err=True)
    if html_path:
        from mlxproxy.htmlreport import result_doc, write_html

        write_html(html_path, [(name, result_doc("replay", groups, extra={"capture": capture, "target": target_url}))])
        click.echo(f"wrote {html_path}", err=True)


@click.command("report")
@click.argument("files", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("--html", "html_path", type=click.Path(dir_okay=False), default=None,
              help="Also write the results as one self-contained HTML file (plots, evidence, timelines).")
def report(files: tuple[str, ...], html_path: str | None) -> None:
    """Render saved replay/bench results (--json files) again, several side by side."""
    from mlxproxy.report import read_result

    groups: list[dict[str, Any]] = []
    verdicts: dict[str, str] = {}
    docs: list[tuple[str, dict[str, Any]]] = []
    for f in files:
        try:
            doc = read_result(f)
        except MlxproxyError as exc:
            fail(str(exc))
        docs.append((os.path.basename(f), doc))
        tag = os.path.basename(f)
        for g in doc["groups"]:
            g = dict(g)
            if len(files) > 1:
                g["target"] = f"{tag}:{g['target']}"
            groups.append(g)
        for t, v in doc.get("verdicts", {}).items():
            verdicts[f"{tag}:{t}" if len(files) > 1 else t] = v
    print_groups(groups, verdicts)
    if html_path:
        from mlxproxy.htmlreport import write_html

        try:
            write_html(html_path, docs)
        except OSError as exc:
            fail(f"cannot write {html_path}: {exc.strerror or exc}")
        click.echo(f"wrote {html_path}", err=True)
