"""`mlxproxy bench`: the command-line shell of the benchmark."""

from __future__ import annotations

import dataclasses

import click

from mlxproxy.core.text import clip
from mlxproxy.errors import MlxproxyError
from mlxproxy.load.commands.bench import DEFAULT_SIZES, BenchOptions, bench_targets
from mlxproxy.load.commands.common import (
    check_outcomes,
    check_writable,
    env_key,
    fail,
    parse_target,
    run_interrupted,
)
from mlxproxy.load.commands.sweep_options import SweepOptions, sweep_options
from mlxproxy.load.data.targets import Target, TargetResult
from mlxproxy.load.fleet.workers import WorkersError, workers_for
from mlxproxy.load.judge.slo import DEFAULT_SLO, judge, parse_slo
from mlxproxy.load.output.bench_report import all_groups, print_bench, write_outputs
from mlxproxy.load.output.files import Outputs
from mlxproxy.load.output.progress import say
from mlxproxy.vocabulary import (
    INT_LIST,
    LoadCommand,
    arrival_options,
    help_for,
    shared_option,
)


@click.command("bench", cls=LoadCommand)
@shared_option("--target", "E.g. mlx-lm=http://127.0.0.1:8080 (repeatable).", dest="targets", multiple=True)
@click.option(
    "--prompt-tokens",
    type=INT_LIST,
    default=",".join(map(str, DEFAULT_SIZES)),
    show_default=True,
    metavar="N,N,...",
    help="Prompt sizes of the one-at-a-time test, in tokens (calibrated against each server's usage).",
)
@click.option("--max-tokens", type=click.IntRange(min=2), default=128, show_default=True, help=help_for("--max-tokens"))
@shared_option("--repeat", default=5)
@shared_option("--batch", "E.g. 2,4,8 for a per-stream speed curve.  [default: 2; none with --sweep]")
@click.option(
    "--batch-prompt-tokens",
    type=click.IntRange(min=1),
    default=None,
    help="Prompt size of the batch tests.  [default: the smallest --prompt-tokens]",
)
@shared_option("--concurrency", "Here: the sweep's steps, at the batch prompt size (implies --sweep).")
@sweep_options("At the batch prompt size; replaces the batch waves unless --batch is given.")
@shared_option("--max-connections")
@shared_option(
    "--rate",
    "Adds an open-loop test of --requests requests at the batch tests' prompt size "
    "(several values: one per step, with the capacity in req/s).",
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
@shared_option(
    "--slo",
    "Judged on the tests at the batch prompt size (one at a time, batch, --rate, "
    "--sweep).  [default: ttft_p95=5s,tpot_p95=100ms]",
)
@shared_option("--fail-on", "[default: none: exit 1 only when every target failed]")
@shared_option("--workers", "Here: the --rate test and the --sweep steps; the other tests send from one process.")
@shared_option("--cluster", "Here: the --rate test and the --sweep steps.")
@shared_option("--model", "[default: the first of the target's /v1/models]")
@shared_option(
    "--timeout",
    "For all targets or the one named (repeatable).  [default: 1800]",
    dest="timeouts",
    multiple=True,
    metavar="[NAME=]SECONDS",
)
@shared_option("--api-key-env")
@click.option(
    "--api",
    type=click.Choice(["chat", "ollama"]),
    default="chat",
    show_default=True,
    help="The API the requests use: chat (/v1/chat/completions) or ollama (Ollama's native /api/chat, NDJSON).",
)
@shared_option("--nonce")
@click.option(
    "--parallel", is_flag=True, help="Benchmark all targets at once (only fair if they do not share hardware)."
)
@shared_option("--json")
@shared_option("--csv")
@shared_option("--markdown")
@shared_option(
    "--plot",
    "TTFT and prefill tok/s by prompt size, speedup and per-stream tok/s by streams; "
    "with --sweep also TTFT, TPOT and aggregate tok/s by concurrency, with the SLO.",
)
@shared_option("--html")
def bench(
    targets: tuple[str, ...],
    prompt_tokens: tuple[int, ...],
    max_tokens: int,
    repeat: int,
    batch: tuple[int, ...],
    batch_prompt_tokens: int | None,
    concurrency: tuple[int, ...] | None,
    sweep: SweepOptions,
    max_connections: int | None,
    rate: tuple[float, ...] | None,
    arrival: str,
    ramp_s: float,
    seed: int,
    n_requests: int,
    slo: dict[str, float] | None,
    fail_on: tuple[str, ...] | None,
    workers: int,
    cluster: str | None,
    model: str | None,
    timeouts: tuple[tuple[str | None, float], ...],
    api_key_env: str | None,
    api: str,
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
    tlist = parse_targets(targets, timeouts, api_key_env, max_connections)
    outputs = Outputs(json_path, csv_path, md_path, plot_path, html_path)
    check_writable(*outputs.paths)
    swept = sweep.when(implied=bool(concurrency))
    if ramp_s and not rate:
        fail("--ramp applies to --rate only")
    if swept and rate and len(rate) > 1:
        fail(
            "--sweep (or --concurrency) steps the concurrency and several --rate values step the rate: one sweep "
            "per run; give one"
        )
    opts = _options(
        prompt_tokens, max_tokens, repeat, batch, batch_prompt_tokens, model, nonce, rate, ramp_s, arrival, seed,
        n_requests, swept, concurrency, slo,
    )  # fmt: skip
    opts = dataclasses.replace(opts, api=api)
    opts = _with_workers(opts, workers, cluster)
    results: list[TargetResult] = []
    interrupted = run_interrupted(bench_targets(tlist, opts, parallel=parallel, out=results, say=say))
    judge_results(results, slo, batch_prompt_tokens or min(prompt_tokens))
    print_bench(results)
    try:
        write_outputs(results, outputs)
    except MlxproxyError as exc:
        fail(str(exc))
    if interrupted:
        fail(
            "interrupted: what was measured so far is printed" + (" and written" if outputs.paths else ""),
            130,
        )
    if results and all(r.error for r in results):
        fail("every target failed: " + clip("; ".join(f"{r.target.name}: {r.error}" for r in results), 300), 1)
    check_outcomes(fail_on, all_groups(results))


def _options(
    prompt_tokens: tuple[int, ...],
    max_tokens: int,
    repeat: int,
    batch: tuple[int, ...],
    batch_prompt_tokens: int | None,
    model: str | None,
    nonce: bool,
    rate: tuple[float, ...] | None,
    ramp_s: float,
    arrival: str,
    seed: int,
    n_requests: int,
    sweep: SweepOptions | None,
    concurrency: tuple[int, ...] | None,
    slo: dict[str, float] | None,
) -> BenchOptions:
    """The benchmark's options from the command's."""
    sizes = tuple(dict.fromkeys(batch or (() if sweep else (2,))))
    return BenchOptions(
        prompt_tokens=prompt_tokens, max_tokens=max_tokens, repeat=repeat, batch=sizes[0] if sizes else 2,
        batches=sizes, batch_prompt_tokens=batch_prompt_tokens, model=model, nonce=nonce,
        rate=rate[0] if rate else None, rate_steps=rate if rate and len(rate) > 1 else (), ramp_s=ramp_s,
        arrival=arrival, seed=seed, requests=n_requests, sweep=sweep, sweep_steps=concurrency or (), slo=slo,
    )  # fmt: skip


def _with_workers(opts: BenchOptions, count: int, cluster: str | None) -> BenchOptions:
    """`opts` sending its --rate and --sweep tests from `--workers`/`--cluster`; a note when
    there are no such tests (the others send from one process)."""
    try:
        out = dataclasses.replace(opts, workers=workers_for(count, cluster))
    except WorkersError as exc:
        fail(str(exc))
    if out.workers.parallel and not (opts.rate or opts.sweep):
        say("--workers and --cluster apply to --rate and --sweep; these tests send from one process")
    return out


def judge_results(results: list[TargetResult], slo: dict[str, float] | None, prompt_tokens: int) -> None:
    """SLO and goodput of the tests at the batch prompt size (the one-at-a-time test at that
    size, the waves, --rate and --sweep steps): `summary.slo`, `summary.goodput`."""
    slo = slo or parse_slo(DEFAULT_SLO)
    for r in results:
        r.groups[:] = [
            g.with_summary(g.summary.judged(judge(g.records, slo)))
            if g.kind != "single" and g.params.get("prompt_tokens") == prompt_tokens
            else g
            for g in r.groups
        ]


def parse_targets(
    values: tuple[str, ...],
    timeouts: tuple[tuple[str | None, float], ...],
    api_key_env: str | None,
    max_connections: int | None = None,
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
    return [Target(t.name, t.url, per.get(t.name, default_timeout), t.api_key, max_connections) for t in out]
