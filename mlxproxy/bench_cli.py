"""`mlxproxy bench` and `mlxproxy demo`: the command-line shells of the benchmark."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click

from mlxproxy.bench import (
    DEFAULT_SIZES,
    BenchOptions,
    Calibration,
    Target,
    TargetResult,
    bench_targets,
    headline,
    headline_notes,
    smallest_single,
    verdict,
)
from mlxproxy.replay_cli import all_failed_reason, check_fail_on, check_writable, env_key, fail, parse_target, run_async
from mlxproxy.report import LEGEND, Section, legend_for, range_text, speedup_text
from mlxproxy.results import Group, ResultFile
from mlxproxy.vocabulary import BATCH_SIZES, FAIL_ON, FLOAT_LIST, INT_LIST, SECONDS, SLO, arrival_options, help_for


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
    return ResultFile.new("bench", all_groups(results), verdicts, extra)


def results_from_doc(doc: ResultFile, prefix: str = "") -> tuple[list[TargetResult], dict[str, str]]:
    """A bench result file back into the results `bench` printed (for `report`)."""
    out: dict[str, TargetResult] = {}
    for t in doc.targets:
        r = TargetResult(
            Target(prefix + t["name"], t.get("url") or ""),
            t.get("model"),
            Calibration(source=t.get("calibration") or ""),
            [],
            t.get("error"),
        )
        out[t["name"]] = r
    for g in doc.groups:
        r = out.setdefault(g.target, TargetResult(Target(prefix + g.target, "")))
        r.groups.append(g.retargeted(prefix + g.target))
    verdicts = {prefix + k: v for k, v in doc.verdicts.items()}
    return list(out.values()), verdicts


def _wrap_lines(text: str) -> list[str]:
    import textwrap

    return textwrap.wrap(text, width=100)


def _f(v: float | None, unit: str = "", fmt: str = ".1f") -> str:
    return "-" if v is None else format(v, fmt) + unit


def bench_sections(results: list[TargetResult], verdicts: dict[str, str] | None = None) -> list[Section]:
    """Everything `bench` prints, as sections (the console and --markdown render the same)."""
    verdicts = verdicts if verdicts is not None else {r.target.name: verdict(r) for r in results}
    sections = []
    rows = [headline(r) for r in results]
    reasoning = any(g.summary.reasoning for g in all_groups(results))
    cols = [c for c in rows[0] if c != "TTFC p50" or reasoning] if rows else []
    sections.append(
        Section(
            "One request at a time, smallest prompt size (p50 = median of the repeats):",
            rows,
            cols,
            legend_for(cols, ["prompt: prompt tokens sent", "speedup (N): N streams released together"]),
            headline_notes(results),
        )
    )
    width = max((len(r.target.name) for r in results), default=0)
    sections.append(
        Section(
            "Verdicts:",
            [],
            None,
            "",
            [f"{r.target.name.ljust(width)}  {verdicts.get(r.target.name, '')}" for r in results],
        )
    )
    sizes = sorted({g.params["prompt_tokens"] for g in all_groups(results) if g.kind == "single_size"})
    if len(sizes) > 1:
        srows = []
        for r in results:
            row = {"target": r.target.name}
            for size in sizes:
                g = next((g for g in r.groups if g.kind == "single_size" and g.params["prompt_tokens"] == size), None)
                key = f"{size} tok"
                if g is None:
                    row[key] = "-"
                    continue
                s = g.summary
                if s.ok == 0:
                    row[key] = ",".join(sorted(s.outcomes))[:16]
                    continue
                ttft, pre = s.ttft_s.p50, s.prefill_tps.p50
                row[key] = "-" if ttft is None else f"{ttft:.2f}s " + (f"{pre:.0f}/s" if pre else "-")
            srows.append(row)
        sections.append(
            Section(
                "TTFT p50 and prefill tok/s by prompt size:",
                srows,
                None,
                "each cell: TTFT p50, then prefill tok/s (uncached prompt tokens / TTFT; - when the stream"
                " was not incremental or the prompt mostly cached); an outcome name where every request"
                " failed (context_limit: the server refused the prompt's size).",
            )
        )
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
    if crows:
        sections.append(
            Section(
                "Requests released together (batching):",
                crows,
                None,
                "streams: requests started at the same instant (1 = alone, wall tok/s, measured"
                " between the waves); decode tok/s: per stream (median); "
                + "; ".join(LEGEND[k] for k in ("agg tok/s", "speedup", "overlap"))
                + "; (a\u2013b): lowest and highest over the waves.",
            )
        )
    rate_groups = [g for g in all_groups(results) if g.kind == "rate"]
    if rate_groups:
        from mlxproxy.load import generator_note
        from mlxproxy.report import SUMMARY_COLUMNS, summary_row

        cols = [c for c in SUMMARY_COLUMNS if c not in ("TTFC p50", "speedup")]
        lines = [generator_note(f"{g.target} {g.mode}", g.summary, g.params) for g in rate_groups]
        sections.append(
            Section(
                "Open loop (--rate: requests sent on schedule, whatever the server does):",
                [summary_row(g.target, g.mode, g.summary) for g in rate_groups],
                cols,
                legend_for(cols),
                [ln for ln in lines if ln],
            )
        )
    from mlxproxy.report import slo_section, sweep_sections

    slo = slo_section(all_groups(results))
    if slo is not None:
        sections.append(slo)
    sections += sweep_sections(all_groups(results))
    notes = []
    for r in results:
        per: dict[str, dict[str, Any]] = {}
        total = sum(g.summary.requests for g in r.groups if g.kind != "single")
        for g in r.groups:
            if g.kind == "single":  # holds every `single N` again
                for kind, a in g.summary.anomalies.items():
                    if not any(kind in x.summary.anomalies for x in r.groups if x.kind != "single"):
                        per.setdefault(kind, {"count": a.count, "evidence": a.evidence, "where": ["single"]})
                continue
            for kind, a in g.summary.anomalies.items():
                k = per.setdefault(kind, {"count": 0, "evidence": a.evidence, "where": []})
                k["count"] += a.count
                k["where"].append(g.name)
        for kind, k in sorted(per.items()):
            where = (
                "across prompt sizes"
                if k["where"] == ["single"]
                else f"in {k['count']} of {total} requests ({', '.join(k['where'])})"
            )
            notes.append(f"{r.target.name}: {kind} {where}: {' '.join(str(k['evidence']).split())}")
    if notes:
        sections.append(Section("Anomalies, with evidence:", [], None, "", notes))
    return sections


def print_bench(results: list[TargetResult], verdicts: dict[str, str] | None = None) -> None:
    from mlxproxy.report import render_sections

    click.echo(render_sections(bench_sections(results, verdicts)))


def write_outputs(
    results: list[TargetResult],
    json_path: str | None,
    csv_path: str | None,
    md_path: str | None,
    plot_path: str | None,
    verdicts: dict[str, str] | None = None,
    write_json: bool = True,
) -> None:
    from mlxproxy.report import markdown_sections, write_csv, write_result

    doc = results_doc(results, verdicts)
    verdicts = dict(doc.verdicts)
    groups = doc.groups
    if json_path and write_json:
        write_result(json_path, doc)
        click.echo(f"wrote {json_path} (render again with: mlxproxy report {json_path})", err=True)
    if csv_path:
        write_csv(csv_path, groups)
        click.echo(f"wrote {csv_path}", err=True)
    if md_path:
        Path(md_path).write_text(markdown_sections(bench_sections(results, verdicts)), encoding="utf-8")
        click.echo(f"wrote {md_path}", err=True)
    if plot_path:
        Path(plot_path).write_text(plot_svg(results), encoding="utf-8")
        click.echo(f"wrote {plot_path}", err=True)


def write_bench_html(results: list[TargetResult], path: str) -> None:
    from mlxproxy.htmlreport import write_html

    write_html(path, [("bench", results_doc(results))])


def plot_svg(results: list[TargetResult]) -> str:
    """TTFT and prefill tok/s by prompt size; per-stream decode tok/s, aggregate tok/s and
    speedup by streams released together (1 = the smallest prompt alone)."""
    from mlxproxy.plot import Chart, svg_charts

    ttft, prefill, curve, agg = [], [], [], []
    for r in results:
        pts_t, pts_p, pts_c, pts_a = [], [], [], []
        for g in r.groups:
            s = g.summary
            if g.kind == "single_size" and s.ok:
                size = g.params.get("prompt_tokens_sent") or g.params["prompt_tokens"]
                pts_t.append((float(size), s.ttft_s.p50))
                pts_p.append((float(size), s.prefill_tps.p50))
            if g.kind == "wave":
                pts_c.append((float(g.params["streams"]), s.decode_tps.p50))
                pts_a.append((float(g.params["streams"]), s.speedup))
        alone = smallest_single(r)
        if alone and (pts_c or pts_a):
            pts_c.append((1.0, alone.summary.decode_tps.p50))
            pts_a.append((1.0, 1.0))
        ttft.append((r.target.name, pts_t))
        prefill.append((r.target.name, pts_p))
        curve.append((r.target.name, pts_c))
        agg.append((r.target.name, pts_a))
    from mlxproxy.load import sweep_charts

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


@click.command("bench")
@click.option(
    "--target",
    "targets",
    multiple=True,
    required=True,
    metavar="[NAME=]URL",
    help=help_for("--target", "E.g. mlx-lm=http://127.0.0.1:8080 (repeatable)."),
)
@click.option(
    "--prompt-tokens",
    type=INT_LIST,
    default=",".join(map(str, DEFAULT_SIZES)),
    show_default=True,
    metavar="N,N,...",
    help="Prompt sizes of the one-at-a-time test, in tokens (calibrated against each server's usage).",
)
@click.option("--max-tokens", type=click.IntRange(min=2), default=128, show_default=True, help=help_for("--max-tokens"))
@click.option("--repeat", type=click.IntRange(min=1), default=5, show_default=True, help=help_for("--repeat"))
@click.option(
    "--batch",
    type=BATCH_SIZES,
    default=None,
    metavar="N[,N,...]",
    help=help_for("--batch", "E.g. 2,4,8 for a per-stream speed curve.  [default: 2; none with --sweep]"),
)
@click.option(
    "--batch-prompt-tokens",
    type=click.IntRange(min=1),
    default=None,
    help="Prompt size of the batch tests.  [default: the smallest --prompt-tokens]",
)
@click.option(
    "--concurrency",
    type=INT_LIST,
    default=None,
    metavar="N[,N,...]",
    help=help_for("--concurrency", "Here: the sweep's steps, at the batch prompt size (implies --sweep)."),
)
@click.option(
    "--sweep",
    is_flag=True,
    help=help_for("--sweep", "At the batch prompt size; replaces the batch waves unless --batch is given."),
)
@click.option(
    "--rate",
    type=FLOAT_LIST,
    default=None,
    metavar="R[,R,...]",
    help=help_for(
        "--rate",
        "Adds an open-loop test of --requests requests at the batch tests' prompt size "
        "(several values: one per step, with the capacity in req/s).",
    ),
)
@arrival_options
@click.option(
    "--requests",
    "n_requests",
    type=click.IntRange(min=2),
    default=50,
    show_default=True,
    help="Requests of the open-loop (--rate) test.",
)
@click.option(
    "--slo",
    "slo",
    type=SLO,
    default=None,
    metavar="KEY=VALUE,...",
    help=help_for(
        "--slo",
        "Judged on the tests at the batch prompt size (one at a time, batch, --rate, "
        "--sweep).  [default: ttft_p95=5s,tpot_p95=100ms]",
    ),
)
@click.option(
    "--fail-on",
    "fail_on",
    type=FAIL_ON,
    default=None,
    metavar="KIND,...",
    help=help_for("--fail-on", "[default: none: exit 1 only when every target failed]"),
)
@click.option("--model", default=None, help=help_for("--model", "[default: the first of the target's /v1/models]"))
@click.option(
    "--timeout",
    "timeouts",
    type=SECONDS,
    multiple=True,
    metavar="[NAME=]SECONDS",
    help=help_for("--timeout", "For all targets or the one named (repeatable).  [default: 1800]"),
)
@click.option("--api-key-env", default=None, metavar="VAR", help=help_for("--api-key-env"))
@click.option("--nonce/--no-nonce", default=True, help=help_for("--nonce"))
@click.option(
    "--parallel", is_flag=True, help="Benchmark all targets at once (only fair if they do not share hardware)."
)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help=help_for("--json"))
@click.option("--csv", "csv_path", type=click.Path(dir_okay=False), default=None, help=help_for("--csv"))
@click.option("--markdown", "md_path", type=click.Path(dir_okay=False), default=None, help=help_for("--markdown"))
@click.option(
    "--plot",
    "plot_path",
    type=click.Path(dir_okay=False),
    default=None,
    help=help_for(
        "--plot",
        "TTFT and prefill tok/s by prompt size, speedup and per-stream tok/s by streams; "
        "with --sweep also TTFT, TPOT and aggregate tok/s by concurrency, with the SLO.",
    ),
)
@click.option("--html", "html_path", type=click.Path(dir_okay=False), default=None, help=help_for("--html"))
def bench(
    targets: tuple[str, ...],
    prompt_tokens: tuple[int, ...],
    max_tokens: int,
    repeat: int,
    batch: tuple[int, ...],
    batch_prompt_tokens: int | None,
    concurrency: tuple[int, ...] | None,
    sweep: bool,
    rate: tuple[float, ...] | None,
    arrival: str,
    ramp_s: float,
    seed: int,
    n_requests: int,
    slo: dict[str, float] | None,
    fail_on: tuple[str, ...] | None,
    model: str | None,
    timeouts: tuple[tuple[str | None, float], ...],
    api_key_env: str | None,
    nonce: bool,
    parallel: bool,
    json_path: str | None,
    csv_path: str | None,
    md_path: str | None,
    plot_path: str | None,
    html_path: str | None,
) -> None:
    """Compare servers: one request at a time across prompt sizes, then requests
    released together, with the truth checks applied and a verdict per target."""
    tlist = parse_targets(targets, timeouts, api_key_env)
    check_writable(json_path, csv_path, md_path, plot_path, html_path)
    sweep = sweep or bool(concurrency)
    if ramp_s and not rate:
        fail("--ramp applies to --rate only")
    if sweep and rate and len(rate) > 1:
        fail(
            "--sweep (or --concurrency) steps the concurrency and several --rate values step the rate: one sweep "
            "per run; give one"
        )
    sizes = tuple(dict.fromkeys(batch or (() if sweep else (2,))))
    opts = BenchOptions(
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
        repeat=repeat,
        batch=sizes[0] if sizes else 2,
        batches=sizes,
        batch_prompt_tokens=batch_prompt_tokens,
        model=model,
        nonce=nonce,
        rate=rate[0] if rate else None,
        rate_steps=rate if rate and len(rate) > 1 else (),
        ramp_s=ramp_s,
        arrival=arrival,
        seed=seed,
        requests=n_requests,
        sweep=sweep,
        sweep_steps=concurrency or (),
        slo=slo,
    )
    results: list[TargetResult] = []
    interrupted = False
    try:
        run_async(
            bench_targets(
                tlist, opts, parallel=parallel, out=results, say=lambda line: click.echo(f"mlxproxy: {line}", err=True)
            )
        )
    except KeyboardInterrupt:
        interrupted = True
    judge_results(results, slo, batch_prompt_tokens or min(prompt_tokens))
    print_bench(results)
    write_outputs(results, json_path, csv_path, md_path, plot_path)
    if html_path:
        try:
            write_bench_html(results, html_path)
        except OSError as exc:
            fail(f"cannot write {html_path}: {exc.strerror or exc}")
        click.echo(f"wrote {html_path}", err=True)
    if interrupted:
        fail(
            "interrupted: what was measured so far is printed"
            + (" and written" if json_path or csv_path or md_path or plot_path or html_path else ""),
            130,
        )
    if results and all(r.error for r in results):
        fail("every target failed: " + "; ".join(f"{r.target.name}: {r.error}" for r in results)[:300], 1)
    reason = all_failed_reason(all_groups(results))
    if reason:
        fail(reason, 1)
    check_fail_on(fail_on, all_groups(results))


def judge_results(results: list[TargetResult], slo: dict[str, float] | None, prompt_tokens: int) -> None:
    """SLO and goodput of the tests at the batch prompt size (the one-at-a-time test at that
    size, the waves, --rate and --sweep steps): `summary.slo`, `summary.goodput`."""
    from mlxproxy.load import DEFAULT_SLO, judge, parse_slo

    slo = slo or parse_slo(DEFAULT_SLO)
    for r in results:
        r.groups[:] = [
            g.with_summary(g.summary.updated(judge(g.records, slo)))
            if g.kind != "single" and g.params.get("prompt_tokens") == prompt_tokens
            else g
            for g in r.groups
        ]


def parse_targets(
    values: tuple[str, ...], timeouts: tuple[tuple[str | None, float], ...], api_key_env: str | None
) -> list[Target]:
    key = env_key(api_key_env)
    out = [Target(name, url, 1800.0, key) for name, url in (parse_target(v) for v in values)]
    names = [t.name for t in out]
    if len(set(names)) != len(names):
        raise click.BadParameter("target names must be unique; give NAME=URL", param_hint="--target")
    default_timeout, per = 1800.0, {}
    for name, secs in timeouts:
        if name is None:
            default_timeout = secs
        elif name not in names:
            raise click.BadParameter(
                f"{name}={secs:g}: no target named {name!r} (targets: {', '.join(names)})", param_hint="--timeout"
            )
        else:
            per[name] = secs
    return [Target(t.name, t.url, per.get(t.name, default_timeout), t.api_key) for t in out]


DEMO_PROFILES: dict[str, dict[str, Any]] = {
    # Simulated servers for the demo. Prefill runs 10x faster than the profiles' default
    # (20000 tok/s) so a 40000-token prompt takes seconds, not minutes; decode speed,
    # batching, stalls and wire formats are the profiles' own.
    "mlx-lm": {},
    "mlx-openai-server": {},
    "mlx-omni-server": {},
    "rapid-mlx": {},
    "vllm-mlx": {},
    "omlx": {},
    "mlx-vlm": {"stall_every_tokens": 24, "stall_s": 1.2},
    "phantom-usage": {},
    # the whole answer in one write at the end, as Rapid-MLX did in the 2026 Mac benchmark (0.16.10
    # streams one token per event by default, so its own profile no longer does)
    "burst-at-end": {"profile": "rapid-mlx", "burst_at_end": True},
}


@click.command("demo")
@click.option(
    "--dir",
    "out_dir",
    type=click.Path(file_okay=False),
    default="mlxproxy-demo",
    show_default=True,
    help="Where the capture, the results and a metrics snapshot are written.",
)
@click.option(
    "--port",
    type=click.IntRange(min=0, max=65535),
    default=0,
    show_default=True,
    help=help_for("--port", "The proxy's port."),
)
@click.option(
    "--serve",
    is_flag=True,
    help="Keep the simulators and the proxy running after the run (Ctrl-C to stop), e.g. to scrape /metrics.",
)
@click.option("--repeat", type=click.IntRange(min=1), default=2, show_default=True, help=help_for("--repeat"))
def demo(out_dir: str, port: int, serve: bool, repeat: int) -> None:
    """Run the whole product on built-in simulators: nine simulated MLX servers behind
    one proxy, a short benchmark through it, and the comparison table with verdicts.
    Needs no network beyond loopback and no Mac."""
    from mlxproxy.config import build_config
    from mlxproxy.proxy.app import create_app
    from mlxproxy.runner import ServerThread
    from mlxproxy.sim.app import create_app as create_sim

    out = Path(out_dir)
    try:  # checked before anything starts: a folder we cannot write would lose the whole run
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".mlxproxy-write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        fail(f"cannot write to --dir {out_dir}: {exc.strerror or exc}")
    capture = out / "capture.jsonl"
    if capture.exists():
        capture.unlink()
    started = time.perf_counter()
    sims: dict[str, ServerThread] = {}
    proxy = None
    try:
        try:
            from mlxproxy.runner import bind_socket

            bind_socket("127.0.0.1", port).close()
        except OSError as exc:
            fail(f"cannot listen on 127.0.0.1:{port} (--port): {exc.strerror or exc}", 1)
        for name, knobs in DEMO_PROFILES.items():
            knobs = dict(knobs)
            profile = knobs.pop("profile", name)
            sims[name] = ServerThread(create_sim(profile, prefill_tps=20000.0, **knobs)).start()
        upstreams = [{"name": name, "url": s.url, "models": [name]} for name, s in sims.items()]
        cfg = build_config({"upstreams": upstreams, "capture": str(capture)}, port=port, log_requests=False)
        app = create_app(cfg)
        try:
            proxy = ServerThread(app, port=port, server_header=False, date_header=False).start()
        except (OSError, RuntimeError) as exc:
            fail(f"cannot start the proxy on 127.0.0.1:{port}: {getattr(exc, 'strerror', None) or exc}", 1)
        click.echo(f"simulators: {', '.join(f'{n} {s.url}' for n, s in sims.items())}", err=True)
        click.echo(f"proxy: {proxy.url}/v1  (live page {proxy.url}/, metrics {proxy.url}/metrics)", err=True)
        click.echo(
            "benchmark through the proxy: prompts of 100, 2000 and 40000 tokens one at a time, then two at once"
            f" (x{repeat} each); about a minute...",
            err=True,
        )
        targets = [Target(name, proxy.url, 120.0) for name in sims]
        opts = BenchOptions(prompt_tokens=(100, 2000, 40000), max_tokens=96, repeat=repeat, batch=2, nonce=True)
        results: list[TargetResult] = []
        try:
            run_async(_demo_run(targets, opts, results))
        except KeyboardInterrupt:
            fail("interrupted before the benchmark finished; nothing written", 130)
        elapsed = time.perf_counter() - started
        click.echo("")
        print_bench(results)
        click.echo("")
        click.echo(
            "\n".join(
                _wrap_lines(
                    "The simulated servers imitate what a 2026 benchmark of MLX servers found"
                    " (Qwen3.5-35B-A3B, M2 Max): their decode speed is 50 tokens/s per stream;"
                    " prefill runs at 20000 tok/s here to keep the demo short."
                )
            )
        )
        write_outputs(
            results, str(out / "bench.json"), str(out / "bench.csv"), str(out / "bench.md"), str(out / "bench.svg")
        )
        write_bench_html(results, str(out / "bench.html"))
        from prometheus_client import generate_latest

        (out / "metrics.prom").write_bytes(generate_latest(app.registry))
        if app.capture is not None:
            app.capture.flush()
        n = sum(1 for _ in capture.open("rb"))
        click.echo(f"\nfinished in {elapsed:.0f} s. Written to {out}/:")
        click.echo(f"  capture.jsonl  all {n} requests (replay them: mlxproxy replay {capture} --target URL)")
        click.echo(f"  bench.json     the results (show them again: mlxproxy report {out / 'bench.json'})")
        click.echo("  bench.csv      one row per request;  bench.md  these tables as Markdown")
        click.echo("  bench.svg      the plot;  metrics.prom  a snapshot of the proxy's /metrics")
        click.echo(f"HTML report: {(out / 'bench.html').resolve()} (open it in a browser; it needs no network)")
        if serve:
            click.echo(f"serving until Ctrl-C: live page at {proxy.url}/, metrics at {proxy.url}/metrics", err=True)
            try:
                while True:
                    time.sleep(3600)
            except KeyboardInterrupt:
                pass
    except OSError as exc:
        fail(f"demo stopped: {exc.strerror or exc}", 1)
    finally:
        if proxy is not None:
            proxy.stop()
        for s in sims.values():
            s.stop()


async def _demo_run(targets: list[Target], opts: BenchOptions, out: list[TargetResult]) -> list[TargetResult]:
    # each target is the same proxy; the model name routes to the simulator of that name
    out.extend(TargetResult(t) for t in targets)
    from mlxproxy.bench import bench_one
    from mlxproxy.core.detect import Thresholds

    await asyncio.gather(
        *(
            bench_one(t, BenchOptions(**{**opts.__dict__, "model": t.name}), Thresholds(), None, r)
            for t, r in zip(targets, out)
        )
    )
    return out
