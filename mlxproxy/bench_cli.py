"""`mlxproxy bench` and `mlxproxy demo`: the command-line shells of the benchmark."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Any

import click

from mlxproxy.bench import DEFAULT_SIZES, BenchOptions, Target, TargetResult, bench_targets, headline, headline_notes, verdict
from mlxproxy.replay_cli import fail


def _int_list(value: str, what: str) -> tuple[int, ...]:
    try:
        items = tuple(int(x) for x in value.split(",") if x.strip())
    except ValueError:
        raise click.BadParameter(f"{value!r}: give comma-separated whole numbers, e.g. 100,500,2000", param_hint=what) from None
    if not items or any(i < 1 for i in items):
        raise click.BadParameter(f"{value!r}: give at least one number, each >= 1", param_hint=what)
    return items


def results_doc(results: list[TargetResult]) -> tuple[list[dict[str, Any]], dict[str, str], dict[str, Any]]:
    groups = [g for r in results for g in r.groups]
    verdicts = {r.target.name: verdict(r) for r in results}
    extra = {"targets": [{"name": r.target.name, "url": r.target.url, "model": r.model, "error": r.error,
                          "calibration": r.calibration.source} for r in results]}
    return groups, verdicts, extra


def print_bench(results: list[TargetResult]) -> None:
    from mlxproxy.report import render_table

    click.echo(render_table([headline(r) for r in results]))
    for note in headline_notes(results):
        click.echo(note)
    sizes = sorted({g["params"]["prompt_tokens"] for r in results for g in r.groups if g["name"].startswith("single ")})
    if sizes:
        rows = []
        for size in sizes:
            row = {"prompt_tokens": str(size)}
            for r in results:
                g = next((g for g in r.groups if g["name"] == f"single {size}"), None)
                if g is None:
                    row[r.target.name] = "-"
                    continue
                s = g["summary"]
                if s["ok"] == 0:
                    row[r.target.name] = ",".join(sorted(s["outcomes"]))
                    continue
                ttft, pre = s["ttft_s"]["p50"], s["prefill_tps"]["p50"]
                row[r.target.name] = f"{ttft:.2f}s" + (f" {pre:.0f}t/s" if pre else "") if ttft is not None else "-"
            rows.append(row)
        click.echo("\nTTFT p50 and prefill tokens/s by prompt size:")
        click.echo(render_table(rows))
    curves = [(r, g) for r in results for g in r.groups if g["params"].get("streams")]
    if curves:
        rows = [{"target": r.target.name, "streams": str(g["params"]["streams"]),
                 "per_stream_decode_tps": _f(g["summary"]["decode_tps"]["p50"]), "aggregate_tps": _f(g["summary"]["aggregate_tps"]),
                 "speedup": _f(g["summary"]["speedup"], "x", ".2f"), "overlap": _f(g["summary"]["overlap"], "", ".2f")} for r, g in curves]
        click.echo("\nParallel requests released together:")
        click.echo(render_table(rows))
    notes = []
    for r in results:
        seen = set()
        for g in r.groups:
            for kind, a in sorted(g["summary"]["anomalies"].items()):
                if kind not in seen:
                    seen.add(kind)
                    notes.append(f"  {r.target.name}: {kind} (x{a['count']} in {g['name']}): {a['evidence']}")
    if notes:
        click.echo("\nAnomalies, with evidence:")
        click.echo("\n".join(notes))


def _f(v: float | None, unit: str = "", fmt: str = ".1f") -> str:
    return "-" if v is None else format(v, fmt) + unit


def write_outputs(results: list[TargetResult], json_path: str | None, csv_path: str | None, md_path: str | None,
                  plot_path: str | None) -> None:
    from mlxproxy.report import write_csv, write_result

    groups, verdicts, extra = results_doc(results)
    if json_path:
        write_result(json_path, "bench", groups, verdicts, extra)
        click.echo(f"wrote {json_path} (render again with: mlxproxy report {json_path})", err=True)
    if csv_path:
        write_csv(csv_path, groups)
        click.echo(f"wrote {csv_path}", err=True)
    if md_path:
        rows = [headline(r) for r in results]
        cols = list(rows[0].keys())
        md = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        md += ["| " + " | ".join(r[c] for c in cols) + " |" for r in rows]
        md += ["", *headline_notes(results)] if headline_notes(results) else []
        Path(md_path).write_text("\n".join(md) + "\n")
        click.echo(f"wrote {md_path}", err=True)
    if plot_path:
        Path(plot_path).write_text(plot_svg(results))
        click.echo(f"wrote {plot_path}", err=True)


def write_bench_html(results: list[TargetResult], path: str) -> None:
    from mlxproxy.htmlreport import result_doc, write_html

    groups, verdicts, extra = results_doc(results)
    write_html(path, [("bench", result_doc("bench", groups, verdicts, extra))])


def plot_svg(results: list[TargetResult]) -> str:
    from mlxproxy.plot import svg_charts

    ttft, prefill, curve = [], [], []
    for r in results:
        pts_t, pts_p, pts_c = [], [], []
        for g in r.groups:
            s = g["summary"]
            if g["name"].startswith("single "):
                size = g["params"].get("prompt_tokens_sent") or g["params"]["prompt_tokens"]
                pts_t.append((float(size), s["ttft_s"]["p50"]))
                pts_p.append((float(size), s["prefill_tps"]["p50"]))
            if g["params"].get("streams"):
                pts_c.append((float(g["params"]["streams"]), s["decode_tps"]["p50"]))
        sized = [g for g in r.groups if g["name"].startswith("single ")]
        if sized:  # one stream alone, at the smallest prompt size
            smallest = min(sized, key=lambda g: g["params"]["prompt_tokens"])
            pts_c.append((1.0, smallest["summary"]["decode_tps"]["p50"]))
        ttft.append((r.target.name, pts_t))
        prefill.append((r.target.name, pts_p))
        curve.append((r.target.name, pts_c))
    return svg_charts([
        ("TTFT by prompt size (p50)", "prompt tokens", "seconds", ttft, True),
        ("Prefill tokens/s by prompt size (p50)", "prompt tokens", "tokens/s", prefill, True),
        ("Per-stream decode tokens/s by parallel streams (p50)", "streams released together", "tokens/s", curve, False),
    ])


def parse_targets(values: tuple[str, ...], timeouts: tuple[str, ...], api_key_env: str | None) -> list[Target]:
    from urllib.parse import urlsplit

    default_timeout = 1800.0
    per: dict[str, float] = {}
    for t in timeouts:
        name, sep, secs = t.rpartition("=")
        try:
            value = float(secs)
        except ValueError:
            raise click.BadParameter(f"{t!r}: give SECONDS or NAME=SECONDS", param_hint="--timeout") from None
        if sep:
            per[name] = value
        else:
            default_timeout = value
    key = None
    if api_key_env:
        key = os.environ.get(api_key_env)
        if key is None:
            raise click.BadParameter(f"environment variable {api_key_env} is not set", param_hint="--api-key-env")
    out = []
    for v in values:
        name, sep, url = v.partition("=")
        if not sep:
            name, url = urlsplit(v).netloc or v, v
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise click.BadParameter(f"{v!r}: give NAME=URL with an http:// URL", param_hint="--target")
        out.append(Target(name, url.rstrip("/").removesuffix("/v1"), per.get(name, default_timeout), key))
    names = [t.name for t in out]
    if len(set(names)) != len(names):
        raise click.BadParameter("target names must be unique", param_hint="--target")
    return out


@click.command("bench")
@click.option("--target", "targets", multiple=True, required=True, metavar="NAME=URL",
              help="A server or proxy to benchmark, e.g. mlx-lm=http://127.0.0.1:8080 (repeatable).")
@click.option("--prompt-tokens", default=",".join(map(str, DEFAULT_SIZES)), show_default=True,
              help="Prompt sizes of the one-at-a-time test, in tokens (calibrated against each server's usage).")
@click.option("--max-tokens", type=click.IntRange(min=2), default=128, show_default=True, help="max_tokens of every request.")
@click.option("--repeat", type=click.IntRange(min=1), default=5, show_default=True, help="Repetitions of every test; medians are reported.")
@click.option("--batch", type=click.IntRange(min=2), default=2, show_default=True, help="Requests released together in the batch test (2 = double batch).")
@click.option("--batch-prompt-tokens", type=click.IntRange(min=1), default=None, help="Prompt size of the batch tests.  [default: the smallest --prompt-tokens]")
@click.option("--concurrency", default=None, metavar="N,N,...", help="Also release N requests together for each N, e.g. 1,2,4,8 (per-stream speed curve).")
@click.option("--model", default=None, help="Model name to request.  [default: the first of the target's /v1/models]")
@click.option("--timeout", "timeouts", multiple=True, metavar="[NAME=]SECONDS", help="Request timeout, for all targets or one (repeatable).  [default: 1800]")
@click.option("--api-key-env", default=None, metavar="VAR", help="Environment variable holding the targets' API key.")
@click.option("--no-nonce", is_flag=True, help="Do not prefix prompts with a nonce (lets prompt caches serve repeats).")
@click.option("--parallel", is_flag=True, help="Benchmark all targets at once (only fair if they do not share hardware).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="Write every per-request record and the summaries.")
@click.option("--csv", "csv_path", type=click.Path(dir_okay=False), default=None, help="Write one row per request.")
@click.option("--markdown", "md_path", type=click.Path(dir_okay=False), default=None, help="Write the headline table as Markdown.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None, help="Write an SVG of TTFT and prefill tok/s by prompt size and per-stream tok/s by streams.")
@click.option("--html", "html_path", type=click.Path(dir_okay=False), default=None,
              help="Write a self-contained HTML report: verdicts, evidence, curves and every request's timeline.")
def bench(targets: tuple[str, ...], prompt_tokens: str, max_tokens: int, repeat: int, batch: int, batch_prompt_tokens: int | None,
          concurrency: str | None, model: str | None, timeouts: tuple[str, ...], api_key_env: str | None, no_nonce: bool,
          parallel: bool, json_path: str | None, csv_path: str | None, md_path: str | None, plot_path: str | None,
          html_path: str | None) -> None:
    """Compare servers: one request at a time across prompt sizes, then requests
    released together, with the truth checks applied and a verdict per target."""
    tlist = parse_targets(targets, timeouts, api_key_env)
    opts = BenchOptions(prompt_tokens=_int_list(prompt_tokens, "--prompt-tokens"), max_tokens=max_tokens, repeat=repeat,
                        batch=batch, batch_prompt_tokens=batch_prompt_tokens,
                        concurrency=_int_list(concurrency, "--concurrency") if concurrency else (), model=model, nonce=not no_nonce)
    results = asyncio.run(bench_targets(tlist, opts, parallel=parallel))
    print_bench(results)
    write_outputs(results, json_path, csv_path, md_path, plot_path)
    if html_path:
        try:
            write_bench_html(results, html_path)
        except OSError as exc:
            fail(f"cannot write {html_path}: {exc.strerror or exc}")
        click.echo(f"wrote {html_path}", err=True)
    if all(r.error for r in results):
        sys.exit(1)


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
}


@click.command("demo")
@click.option("--dir", "out_dir", type=click.Path(file_okay=False), default="mlxproxy-demo", show_default=True,
              help="Where the capture, the results and a metrics snapshot are written.")
@click.option("--port", type=click.IntRange(min=0, max=65535), default=0, show_default=True, help="Proxy port (0 = any free port).")
@click.option("--serve", is_flag=True, help="Keep the simulators and the proxy running after the run (Ctrl-C to stop), e.g. to scrape /metrics.")
@click.option("--repeat", type=click.IntRange(min=1), default=2, show_default=True, help="Repetitions of every test.")
def demo(out_dir: str, port: int, serve: bool, repeat: int) -> None:
    """Run the whole product on built-in simulators: eight simulated MLX servers behind
    one proxy, a short benchmark through it, and the comparison table with verdicts.
    Needs no network beyond loopback and no Mac."""
    from mlxproxy.config import build_config
    from mlxproxy.proxy.app import create_app
    from mlxproxy.runner import ServerThread
    from mlxproxy.sim.app import create_app as create_sim

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    capture = out / "capture.jsonl"
    if capture.exists():
        capture.unlink()
    started = time.perf_counter()
    sims = {name: ServerThread(create_sim(name, prefill_tps=20000.0, **knobs)).start() for name, knobs in DEMO_PROFILES.items()}
    upstreams = [{"name": name, "url": s.url, "models": [name]} for name, s in sims.items()]
    cfg = build_config({"upstreams": upstreams, "capture": str(capture)}, port=port, log_requests=False)
    app = create_app(cfg)
    proxy = ServerThread(app, port=port, server_header=False, date_header=False).start()
    click.echo(f"simulators: {', '.join(f'{n} {s.url}' for n, s in sims.items())}", err=True)
    click.echo(f"proxy: {proxy.url}/v1  (live page {proxy.url}/, metrics {proxy.url}/metrics)", err=True)
    click.echo("benchmark through the proxy: prompts of 100, 2000 and 40000 tokens one at a time, then two at once"
               f" (x{repeat} each); about a minute...", err=True)
    try:
        targets = [Target(name, proxy.url, 120.0) for name in sims]
        opts = BenchOptions(prompt_tokens=(100, 2000, 40000), max_tokens=96, repeat=repeat, batch=2, nonce=True)
        results = asyncio.run(_demo_run(targets, opts))
        elapsed = time.perf_counter() - started
        click.echo("")
        print_bench(results)
        click.echo("\nThe simulated servers imitate what a 2026 benchmark of MLX servers found (Qwen3.5-35B-A3B, M2 Max):"
                   " their decode speed is 50 tokens/s per stream; prefill runs at 20000 tok/s here to keep the demo short.")
        write_outputs(results, str(out / "bench.json"), str(out / "bench.csv"), str(out / "bench.md"), str(out / "bench.svg"))
        write_bench_html(results, str(out / "bench.html"))
        from prometheus_client import generate_latest

        (out / "metrics.prom").write_bytes(generate_latest(app.registry))
        if app.capture is not None:
            app.capture.flush()
        n = sum(1 for _ in capture.open("rb"))
        click.echo(f"\nfinished in {elapsed:.0f} s. capture of all {n} requests: {capture} (replay it: mlxproxy replay {capture} "
                   f"--target URL); results: {out / 'bench.json'} (mlxproxy report {out / 'bench.json'}); plot: {out / 'bench.svg'}; "
                   f"metrics snapshot: {out / 'metrics.prom'}.")
        click.echo(f"HTML report: {(out / 'bench.html').resolve()} (open it in a browser; it needs no network)")
        if serve:
            click.echo(f"serving until Ctrl-C: live page at {proxy.url}/, metrics at {proxy.url}/metrics", err=True)
            try:
                while True:
                    time.sleep(3600)
            except KeyboardInterrupt:
                pass
    finally:
        proxy.stop()
        for s in sims.values():
            s.stop()


async def _demo_run(targets: list[Target], opts: BenchOptions) -> list[TargetResult]:
    # each target is the same proxy; the model name routes to the simulator of that name
    results = await asyncio.gather(*(bench_targets([t], BenchOptions(**{**opts.__dict__, "model": t.name}), parallel=False)
                                     for t in targets))
    return [r[0] for r in results]
