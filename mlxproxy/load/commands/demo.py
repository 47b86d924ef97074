"""`mlxproxy demo`: the built-in simulators behind one proxy, benchmarked, with every output
written to a folder."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from prometheus_client import generate_latest

from mlxproxy.config import build_config
from mlxproxy.edge.runner import ServerThread, bind_socket
from mlxproxy.load.commands.bench import BenchOptions, BenchPlan, bench_one, bench_plan
from mlxproxy.load.commands.common import (
    fail,
    run_async,
)
from mlxproxy.load.data.targets import Target, TargetResult
from mlxproxy.load.output.bench_report import all_groups, print_bench, wrap_lines, write_bench_html, write_outputs
from mlxproxy.load.output.files import Outputs, measured_requests
from mlxproxy.load.output.progress import say
from mlxproxy.vocabulary import help_for, shared_option

if TYPE_CHECKING:
    from mlxproxy.proxy.app import ProxyApp

DEMO_PROFILES: dict[str, dict[str, Any]] = {
    # Simulated servers for the demo. Prefill runs 10x faster than the profiles' default
    # (20000 tok/s) so a 40000-token prompt takes seconds, not minutes; decode speed,
    # batching, stalls and wire formats are the profiles' own.
    "mlx-lm": {},
    # today's release (1.8: continuous batching by default); `mlx-openai-server@1.6` is the old serial one
    "mlx-openai-server-1.8": {"profile": "mlx-openai-server"},
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
@shared_option("--repeat", default=2)
def demo(out_dir: str, port: int, serve: bool, repeat: int) -> None:
    """Run the whole product on built-in simulators: nine simulated MLX servers behind
    one proxy, a short benchmark through it, and the comparison table with verdicts.
    Needs no network beyond loopback and no Mac."""
    # the proxy's and the simulator's apps (starlette, the whole proxy) are imported
    # when the demo runs, not when the command line starts: every command registers `demo`
    from mlxproxy.proxy.app import create_app
    from mlxproxy.sim.app import create_app as create_sim

    out = _writable_dir(out_dir)
    capture = out / "capture.jsonl"
    if capture.exists():
        capture.unlink()
    started = time.perf_counter()
    sims: dict[str, ServerThread] = {}
    proxy = None
    try:
        try:
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
            run_async(_demo_run(targets, bench_plan(opts), results))
        except KeyboardInterrupt:
            proxy.stop()  # the requests cut short are captured too, and the file closed, before it is counted
            fail(interrupted_note(app, capture), 130)
        elapsed = time.perf_counter() - started
        click.echo("")
        print_bench(results)
        click.echo("")
        click.echo(
            "\n".join(
                wrap_lines(
                    "The simulated servers imitate what a 2026 benchmark of MLX servers found"
                    " (Qwen3.5-35B-A3B, M2 Max): their decode speed is 50 tokens/s per stream;"
                    " prefill runs at 20000 tok/s here to keep the demo short."
                )
            )
        )
        _write_all(results, out, app)
        _say_written(results, out, app, capture, elapsed)
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


def captured_lines(app: Any, capture: Path) -> int:
    """The requests in the capture file so far (its queue written out first)."""
    if app.capture is not None:
        app.capture.flush()
    return sum(1 for _ in capture.open("rb")) if capture.exists() else 0


def capture_count(lines: int, measured: int) -> str:
    """What the capture holds, counted as the results count: every request the proxy forwarded
    is the measured ones (bench.json, bench.csv, the HTML report) and bench's calibration probes."""
    if lines <= measured:
        return f"all {lines} requests the proxy forwarded, the {measured} measured"
    return (
        f"all {lines} requests the proxy forwarded: the {measured} measured and {lines - measured} calibration probes"
    )


def interrupted_note(app: Any, capture: Path) -> str:
    """Ctrl-C before the benchmark finished: no results, but the capture holds what was sent."""
    n = captured_lines(app, capture)
    if not n:
        return "interrupted before the benchmark finished; nothing written"
    return (
        f"interrupted before the benchmark finished: no results written; {capture} holds the {n} "
        f"request{'s' if n != 1 else ''} forwarded so far (replay them: mlxproxy replay {capture} --target URL)"
    )


def _writable_dir(out_dir: str) -> Path:
    """The output folder, made and checked before anything starts: a folder we cannot write
    would lose the whole run."""
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".mlxproxy-write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        fail(f"cannot write to --dir {out_dir}: {exc.strerror or exc}")
    return out


def _write_all(results: list[TargetResult], out: Path, app: ProxyApp) -> None:
    """The bench outputs, a snapshot of the proxy's metrics, and the capture flushed."""
    name = str(out / "bench")
    write_outputs(results, Outputs(f"{name}.json", f"{name}.csv", f"{name}.md", f"{name}.svg"))
    write_bench_html(results, str(out / "bench.html"), quiet=True)
    (out / "metrics.prom").write_bytes(generate_latest(app.registry))
    if app.capture is not None:
        app.capture.flush()


def _say_written(results: list[TargetResult], out: Path, app: ProxyApp, capture: Path, elapsed: float) -> None:
    n = captured_lines(app, capture)
    click.echo(f"\nfinished in {elapsed:.0f} s. Written to {out}/:")
    click.echo(f"  capture.jsonl  {capture_count(n, measured_requests(all_groups(results)))}")
    click.echo(f"                 (replay them: mlxproxy replay {capture} --target URL)")
    click.echo(f"  bench.json     the results (show them again: mlxproxy report {out / 'bench.json'})")
    click.echo("  bench.csv      one row per request;  bench.md  these tables as Markdown")
    click.echo("  bench.svg      the plot;  metrics.prom  a snapshot of the proxy's /metrics")
    click.echo(f"HTML report: {(out / 'bench.html').resolve()} (open it in a browser; it needs no network)")


async def _demo_run(targets: list[Target], plan: BenchPlan, out: list[TargetResult]) -> list[TargetResult]:
    # each target is the same proxy; the model name routes to the simulator of that name
    out.extend(TargetResult(t) for t in targets)
    await asyncio.gather(
        *(
            bench_one(t, replace(plan, prompts=replace(plan.prompts, model=t.name)), r, say)
            for t, r in zip(targets, out)
        )
    )
    return out
