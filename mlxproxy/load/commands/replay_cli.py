"""`mlxproxy replay`: the command-line shell of replay."""

from __future__ import annotations

import click

from mlxproxy.capture import CapturedRequest, read_capture
from mlxproxy.errors import MlxproxyError
from mlxproxy.load.commands.common import (
    check_outcomes,
    check_writable,
    env_key,
    fail,
    parse_target,
    requests_text,
    run_interrupted,
)
from mlxproxy.load.commands.fixreplay import fix_report
from mlxproxy.load.commands.inputs import interrupted_line, nothing_to_replay, result_file_hint
from mlxproxy.load.commands.preflight import require_reachable
from mlxproxy.load.commands.replay import MODES, ReplayOptions, run_replay
from mlxproxy.load.commands.replay_groups import served_from_cache
from mlxproxy.load.commands.replay_requests import BUILTIN_AGENT, generation_mix, select, synthetic_agent_session
from mlxproxy.load.commands.sweep_options import SweepOptions, sweep_options
from mlxproxy.load.data.results import Group
from mlxproxy.load.data.targets import Target
from mlxproxy.load.fleet.workers import Workers, WorkersError, workers_for
from mlxproxy.load.judge.slo import DEFAULT_SLO, judge, parse_slo
from mlxproxy.load.output.files import Outputs
from mlxproxy.load.output.progress import say
from mlxproxy.load.output.replay_report import print_groups, write_replay_outputs
from mlxproxy.vocabulary import (
    INT_LIST,
    LoadCommand,
    arrival_options,
    deprecated_alias,
    help_for,
    shared_option,
)


def parse_filters(values: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    out = []
    for v in values:
        key, sep, pat = v.partition("=")
        if not sep or key not in ("model", "endpoint", "path", "outcome"):
            raise click.BadParameter(
                f"{v!r}: use KEY=GLOB with KEY one of model, endpoint, path, outcome", param_hint="--filter"
            )
        out.append((key, pat))
    return tuple(out)


@click.command("replay", cls=LoadCommand)
@click.argument("capture", type=click.Path(dir_okay=False))
@shared_option("--target", "E.g. http://127.0.0.1:8080; paths come from the capture.", dest="target_spec")
@click.option("--name", "target_name", default=None, hidden=True, callback=deprecated_alias("replay", "--name"))
@click.option(
    "--mode",
    type=click.Choice(list(MODES)),
    default=None,
    help="; ".join(f"{name}: {mode.help}" for name, mode in MODES.items()) + ".",
)
@click.option(
    "--speed",
    type=click.FloatRange(min=0.001),
    default=None,
    help=help_for("--speed", "Recorded mode only.  [default: 1]"),
)
@shared_option("--concurrency", "Implies --mode concurrency (several values: --sweep).")
@sweep_options(
    "Every step sends the capture's generation requests (not GET /v1/models) x --repeat, whole copies of them "
    "scaled by the step (at least 3 per stream and 20 in all); --sessions steps replay whole conversations."
)
@shared_option("--max-connections")
@shared_option("--batch", "Implies --mode batch.")
@shared_option("--rate", "The captured requests in order, --repeat times (each step of a sweep). Implies --mode rate.")
@arrival_options
@click.option(
    "--sessions",
    type=INT_LIST,
    default=None,
    metavar="N[,N,...]",
    help="Split the capture into conversations (same first user message, growing message list) and run N "
    "at once, each its turns in order with the think time between them; one nonce per conversation "
    "run, so turns reuse the prompt cache as captured. Implies --mode sessions; several values (or "
    "--sweep) step the number of sessions.",
)
@click.option(
    "--think-time",
    type=click.FloatRange(min=0.0),
    default=None,
    metavar="SECONDS",
    help="Seconds between a response's end and the conversation's next turn.  [default: as captured]",
)
@click.option(
    "--fix",
    is_flag=True,
    help="With --sessions: run each conversation as captured and again with the fix applied (the system prompt "
    "pinned to its first turn's, the tools in one order) and print the seconds saved per turn and per session.",
)
@shared_option("--repeat", default=1)
@click.option(
    "--warmup",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Send the first K requests once first, unmeasured.",
)
@click.option(
    "--filter",
    "filters",
    multiple=True,
    metavar="KEY=GLOB",
    help="Only requests whose model/endpoint/path/outcome match (repeatable).",
)
@click.option("--limit", type=click.IntRange(min=1), default=None, help="At most N requests (after filtering).")
@click.option(
    "--skip-bad-lines",
    is_flag=True,
    help="Skip capture lines that cannot be read (their count is printed) instead of refusing the file.",
)
@shared_option("--nonce")
@shared_option("--model", "[default: the captured one]")
@shared_option("--api-key-env")
@shared_option("--timeout", "[default: 1800]")
@shared_option("--json")
@shared_option("--csv")
@shared_option("--markdown")
@shared_option("--slo", "Every test is judged.  [default: ttft_p95=5s,tpot_p95=100ms]")
@shared_option("--fail-on", "[default: none: exit 1 only when every request failed]")
@shared_option("--plot", "With --sweep: TTFT, TPOT and aggregate tok/s by concurrency, with the SLO.")
@click.option(
    "--compare",
    is_flag=True,
    help="Show each request's replayed TTFT, cached prompt tokens and decode TPS next to its captured values.",
)
@shared_option("--html")
@shared_option(
    "--workers",
    "Here: recorded, --rate, --concurrency and --sessions (each conversation stays on one worker); "
    "sequential and --batch send from one process.",
)
@shared_option("--cluster", "Here: as --workers.")
def replay(
    capture: str,
    target_spec: str,
    target_name: str | None,
    mode: str | None,
    speed: float | None,
    concurrency: tuple[int, ...] | None,
    sweep: SweepOptions,
    max_connections: int | None,
    batch: tuple[int, ...] | None,
    rate: tuple[float, ...] | None,
    arrival: str,
    ramp_s: float,
    seed: int,
    sessions: tuple[int, ...] | None,
    think_time: float | None,
    fix: bool,
    repeat: int,
    warmup: int,
    filters: tuple[str, ...],
    limit: int | None,
    skip_bad_lines: bool,
    nonce: bool,
    model: str | None,
    api_key_env: str | None,
    timeout: tuple[str | None, float] | None,
    json_path: str | None,
    csv_path: str | None,
    md_path: str | None,
    plot_path: str | None,
    compare: bool,
    slo: dict[str, float] | None,
    fail_on: tuple[str, ...] | None,
    html_path: str | None,
    workers: int,
    cluster: str | None,
) -> None:
    """Replay a capture file against a server (or a proxy) and measure every request.
    CAPTURE may be builtin:agent, a small synthetic coding-agent conversation.

    Bodies are sent as captured, except for the documented rewrites: include_usage
    on streams, --model, the nonce (--no-nonce to send the captured prompts), and
    filler text for privacy captures.
    """
    name, target_url = parse_target(target_spec)
    name = target_name or name
    values = {"concurrency": concurrency, "batch": batch, "rate": rate, "sessions": sessions}
    mode, swept = _shape(mode, speed, values, sweep.mode is not None, think_time, ramp_s)
    if fix and ("--fix" not in MODES[mode].takes or swept):
        fail("--fix replays conversations: use it with --sessions N (one value, no --sweep)")
    if timeout is not None and timeout[0] not in (None, name):
        fail(f"--timeout {timeout[0]}=...: no target named {timeout[0]!r} (this replay's target is {name!r})")
    api_key = env_key(api_key_env)
    outputs = Outputs(json_path, csv_path, md_path, plot_path, html_path)
    check_writable(*outputs.paths)
    if plot_path and not swept:
        fail("replay --plot draws a sweep; add --sweep (or --concurrency N,N,...)")
    chosen = _chosen(capture, skip_bad_lines, parse_filters(filters), limit, swept)
    opts = ReplayOptions(
        mode=mode, speed=speed or 1.0, concurrency=(concurrency or (1,))[0], sweep=sweep.when(implied=swept),
        sweep_steps=(values.get(mode) or ()) if swept else (), slo=slo, batch=(batch or (2,))[0], batches=batch or (2,),
        repeat=repeat, warmup=warmup, nonce=nonce, model=model, rate=rate[0] if rate else None, arrival=arrival,
        ramp_s=ramp_s, seed=seed, sessions=(sessions or (1,))[0], think_time=think_time, fix=fix,
        workers=_workers(workers, cluster, mode),
    )  # fmt: skip
    require_reachable(target_url, name=name, api_key=api_key, timeout_s=timeout[1] if timeout else 1800.0)
    _say_replaying(chosen, swept, repeat, capture, target_url, mode, nonce)
    target = Target(name, target_url, timeout[1] if timeout else 1800.0, api_key, max_connections)
    groups, interrupted = _run(chosen, target, opts, compare)
    judge_groups(groups, slo)
    _show(groups, nonce, capture, target_url, outputs)
    _exit(groups, interrupted, bool(outputs.paths), fail_on)


def _workers(count: int, cluster: str | None, mode: str) -> Workers:
    """`--workers`/`--cluster`, with a note where the mode sends from one process anyway."""
    try:
        out = workers_for(count, cluster)
    except WorkersError as exc:
        fail(str(exc))
    if out.parallel and MODES[mode].one_process:
        say(f"--workers and --cluster do not apply to {mode}: it sends from one process")
    return out


def _run(chosen: list[CapturedRequest], target: Target, opts: ReplayOptions, compare: bool) -> tuple[list[Group], bool]:
    """The replay's groups (those finished so far when interrupted) and whether Ctrl-C ended it."""
    groups: list[Group] = []
    run = run_replay(chosen, target, opts, compare=compare, out=groups, say=say)
    return groups, run_interrupted(run)


def _exit(groups: list[Group], interrupted: bool, written: bool, fail_on: tuple[str, ...] | None) -> None:
    """The exit code: 130 when interrupted, 1 when every request failed or a --fail-on check did."""
    if interrupted:
        fail(interrupted_line(groups, written), 130)
    check_outcomes(fail_on, groups)


def _shape(
    mode: str | None,
    speed: float | None,
    values: dict[str, tuple[int, ...] | tuple[float, ...] | None],
    sweep: bool,
    think_time: float | None,
    ramp_s: float,
) -> tuple[str, bool]:
    """The replay mode and whether it is a sweep, from `--mode` and the options that imply a mode
    (`values`, by mode), as `MODES` declares them (one-line errors for options that conflict)."""
    given = [m for m, v in values.items() if v]
    if think_time is not None and not any("--think-time" in MODES[m].takes for m in [*given, mode] if m):
        fail("--think-time applies to --sessions only")
    if len(given) > 1:
        a, b = given[:2]
        fail(f"--{a} and --{b} are two different tests ({MODES[a].test}, {MODES[b].test}); give one")
    if mode and given and given[0] != mode:
        fail(f"--mode {mode} conflicts with --{given[0]}; drop one")
    sweep = sweep or any(len(v or ()) > 1 for m, v in values.items() if MODES[m].swept)
    if sweep:
        other = (
            f"--{given[0]}"
            if given and not MODES[given[0]].swept
            else "--speed"
            if speed is not None
            else f"--mode {mode}"
            if mode and not MODES[mode].swept
            else None
        )
        if other:
            fail(f"--sweep steps the concurrency, the number of --sessions or the --rate; it cannot run with {other}")
    mode = mode or (given[0] if given else "concurrency" if sweep else "recorded")
    if ramp_s and not values["rate"]:
        fail("--ramp applies to --rate only")
    needs = MODES[mode].needs
    if needs and not values[mode] and not (sweep and MODES[mode].doubles):
        fail(f"--mode {mode} needs --{mode} {needs}")
    if speed is not None and "--speed" not in MODES[mode].takes:
        fail(f"--speed only applies to --mode recorded, not {mode}")
    return mode, sweep


def _warn(message: str) -> None:
    click.echo(f"mlxproxy: warning: {message}", err=True)


def _chosen(
    capture: str, skip_bad_lines: bool, filters: tuple[tuple[str, str], ...], limit: int | None, sweep: bool
) -> list[CapturedRequest]:
    """The requests to replay: the capture's (or the bundled agent session's) that match the
    filters (one-line errors when there are none, or none a sweep can send)."""
    skipped: list[str] = []
    try:
        caps = (
            synthetic_agent_session()
            if capture == BUILTIN_AGENT
            else read_capture(capture, warn=_warn, skip_bad=skip_bad_lines, skipped=skipped)
        )
    except MlxproxyError as exc:
        hint = (
            ""
            if skip_bad_lines or "cannot read" in str(exc) or "version" in str(exc)
            else " (--skip-bad-lines skips such lines)"
        )
        fail(result_file_hint(capture) or f"{exc}{hint}")
    if skipped:
        _warn(f"skipped {len(skipped)} unreadable line(s) of {capture}; the first: {skipped[0]}")
    chosen = select(caps, filters, limit)
    if not chosen:
        fail(nothing_to_replay(capture, len(caps)))
    if sweep and not generation_mix(chosen):
        fail(f"nothing to sweep: none of the {len(chosen)} requests chosen from {capture} asks for generation")
    return chosen


def _say_replaying(
    chosen: list[CapturedRequest], swept: bool, repeat: int, capture: str, target_url: str, mode: str, nonce: bool
) -> None:
    """The one line before the run: what is sent (a sweep leaves the capture's GET lines out), how."""
    sent = generation_mix(chosen) if swept else chosen
    left_out = f"; {len(chosen) - len(sent)} non-generation left out" if len(sent) != len(chosen) else ""
    click.echo(
        f"replaying {requests_text(len(sent))}{left_out} x{repeat} from {capture} against {target_url} ({mode}"
        f"{', nonce' if nonce else ', no nonce: captured prompt bytes'})",
        err=True,
    )


def _show(groups: list[Group], nonce: bool, capture: str, target_url: str, outputs: Outputs) -> None:
    """The console tables, the prompt-cache warning and the output files."""
    if any(g.records for g in groups):  # a Ctrl-C before the first result: no empty table, no legend
        print_groups(groups)
    for line in fix_report(groups):
        click.echo(line)
    # a replayed conversation's later turns reuse the cache by design (sessions): not warned of
    cached, reported = served_from_cache(r for g in groups for r in g.records if r.session is None)
    if cached:
        _warn(
            f"{cached} of {reported} replayed requests were served mostly from the prompt cache "
            "(cached_tokens > half the prompt): their TTFT measures the cache, not prefill"
            + ("; drop --no-nonce to measure prefill" if not nonce else "")
        )
    try:
        write_replay_outputs(groups, capture, target_url, outputs)
    except MlxproxyError as exc:
        fail(str(exc))


def judge_groups(groups: list[Group], slo: dict[str, float] | None) -> None:
    """Every group's `summary.slo` and `summary.goodput` against `slo` (default: DEFAULT_SLO), in place."""
    slo = slo or parse_slo(DEFAULT_SLO)
    groups[:] = [g.with_summary(g.summary.judged(judge(g.records, slo))) for g in groups]
