"""`mlxproxy replay` and `mlxproxy report`: the command-line shells of replay and reports."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import click

from mlxproxy.errors import MlxproxyError
from mlxproxy.results import Group, ResultFile
from mlxproxy.vocabulary import (
    BATCH_SIZES,
    FAIL_ON,
    FLOAT_LIST,
    INT_LIST,
    SECONDS,
    SLO,
    arrival_options,
    deprecated_alias,
    help_for,
)

if TYPE_CHECKING:
    from mlxproxy.bench import TargetResult


def fail(message: str, code: int = 2) -> None:
    """One line on stderr (whatever the message holds, e.g. a server's HTML error page), then exit."""
    click.echo(f"mlxproxy: {' '.join(str(message).split())}", err=True)
    sys.exit(code)


def run_async(coro: Any) -> Any:
    """Run the client (`coro`) on the stack's event loop (`mlxproxy.runner.run_async`); a bad
    MLXPROXY_STACK is one line and exit 2, before anything is sent."""
    from mlxproxy.runner import run_async as run_on_stack
    from mlxproxy.runner import stack_settings

    try:
        stack_settings(None)
    except ValueError as exc:
        coro.close()
        fail(str(exc))
    return run_on_stack(coro)


def replay_sections(groups: Sequence[Group], verdicts: dict[str, str] | None = None) -> list[Any]:
    """Everything `replay` prints (and `report` prints again for a replay result)."""
    from mlxproxy.report import Section, group_sections, session_sections, slo_section, sweep_sections

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
    from mlxproxy.report import render_sections

    click.echo(render_sections(replay_sections(groups, verdicts)))


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


def parse_target(spec: str) -> tuple[str, str]:
    """`[NAME=]URL` -> (name, base URL), the URL checked and normalized like the proxy's
    upstream (`parse_upstream_url`); a dropped /v1 is said in one line on stderr."""
    from urllib.parse import urlsplit

    from mlxproxy.config import parse_upstream_url
    from mlxproxy.errors import ConfigError

    name, sep, url = spec.partition("=")
    if not sep or "://" in name:  # no NAME= (a URL may contain "=" in its own parts)
        name, url = "", spec
    try:
        base, note = parse_upstream_url(url, "--target")
    except ConfigError as exc:
        raise click.BadParameter(
            f"{str(exc).removeprefix('--target ')}; give [NAME=]URL", param_hint="--target"
        ) from None
    if note:
        click.echo(f"mlxproxy: note: {note}", err=True)
    return name or urlsplit(base).netloc, base


def env_key(api_key_env: str | None) -> str | None:
    if not api_key_env:
        return None
    key = os.environ.get(api_key_env)
    if key is None:
        raise click.BadParameter(f"environment variable {api_key_env} is not set", param_hint="--api-key-env")
    return key


def all_failed_reason(groups: Sequence[Group]) -> str | None:
    """When not one request succeeded: the outcomes and the first error, in one line."""
    from collections import Counter

    from mlxproxy.core.record import OK_OUTCOMES

    recs = [r for g in groups for r in g.records]
    if not recs or any(r["outcome"] in OK_OUTCOMES for r in recs):
        return None
    outcomes = Counter(r["outcome"] for r in {r["id"]: r for r in recs}.values())
    first = next((r for r in recs if r.get("error") or r.get("status")), recs[0])
    why = first.get("error") or (f"HTTP {first['status']}" if first.get("status") else first["outcome"])
    why = " ".join(str(why).split())[:200]
    return f"every request failed ({', '.join(f'{k} {v}' for k, v in sorted(outcomes.items()))}): {why}"


def check_writable(*paths: str | None) -> None:
    """Fail in one line, before anything runs, when an output file cannot be written."""
    for p in paths:
        if not p:
            continue
        parent = os.path.dirname(os.path.abspath(p))
        if not os.path.isdir(parent):
            fail(f"cannot write {p}: folder {parent} does not exist")
        if not os.access(parent, os.W_OK) or (os.path.exists(p) and not os.access(p, os.W_OK)):
            fail(f"cannot write {p}: permission denied")


_TESTS = {
    "concurrency": "a closed loop",
    "batch": "waves released together",
    "rate": "an open loop",
    "sessions": "conversations",
}


@click.command("replay")
@click.argument("capture", type=click.Path(dir_okay=False))
@click.option(
    "--target",
    "target_spec",
    required=True,
    metavar="[NAME=]URL",
    help=help_for("--target", "E.g. http://127.0.0.1:8080; paths come from the capture."),
)
@click.option("--name", "target_name", default=None, hidden=True, callback=deprecated_alias("replay", "--name"))
@click.option(
    "--mode",
    type=click.Choice(["recorded", "sequential", "concurrency", "batch", "rate", "sessions"]),
    default=None,
    help="recorded: at the captured offsets / --speed (default); sequential: one at a time; "
    "concurrency: closed loop of --concurrency; batch: waves of --batch released together, "
    "after a one-at-a-time baseline that gives the speedup; rate: open loop at --rate; sessions: "
    "conversations, --sessions at once.",
)
@click.option(
    "--speed",
    type=click.FloatRange(min=0.001),
    default=None,
    help=help_for("--speed", "Recorded mode only.  [default: 1]"),
)
@click.option(
    "--concurrency",
    type=INT_LIST,
    default=None,
    metavar="N[,N,...]",
    help=help_for("--concurrency", "Implies --mode concurrency (several values: --sweep)."),
)
@click.option(
    "--sweep",
    is_flag=True,
    help=help_for("--sweep", "Each step sends streams x --repeat (at least 3) requests, cycling through the capture."),
)
@click.option(
    "--batch", type=BATCH_SIZES, default=None, metavar="N[,N,...]", help=help_for("--batch", "Implies --mode batch.")
)
@click.option(
    "--rate",
    type=FLOAT_LIST,
    default=None,
    metavar="R[,R,...]",
    help=help_for(
        "--rate", "The captured requests in order, --repeat times (each step of a sweep). Implies --mode rate."
    ),
)
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
@click.option("--repeat", type=click.IntRange(min=1), default=1, show_default=True, help=help_for("--repeat"))
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
@click.option("--nonce/--no-nonce", default=True, help=help_for("--nonce"))
@click.option("--model", default=None, help=help_for("--model", "[default: the captured one]"))
@click.option("--api-key-env", default=None, metavar="VAR", help=help_for("--api-key-env"))
@click.option(
    "--timeout", "timeout", type=SECONDS, default=None, metavar="SECONDS", help=help_for("--timeout", "[default: 1800]")
)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help=help_for("--json"))
@click.option("--csv", "csv_path", type=click.Path(dir_okay=False), default=None, help=help_for("--csv"))
@click.option("--markdown", "md_path", type=click.Path(dir_okay=False), default=None, help=help_for("--markdown"))
@click.option(
    "--slo",
    "slo",
    type=SLO,
    default=None,
    metavar="KEY=VALUE,...",
    help=help_for("--slo", "Every test is judged.  [default: ttft_p95=5s,tpot_p95=100ms]"),
)
@click.option(
    "--fail-on",
    "fail_on",
    type=FAIL_ON,
    default=None,
    metavar="KIND,...",
    help=help_for("--fail-on", "[default: none: exit 1 only when every request failed]"),
)
@click.option(
    "--plot",
    "plot_path",
    type=click.Path(dir_okay=False),
    default=None,
    help=help_for("--plot", "With --sweep: TTFT, TPOT and aggregate tok/s by concurrency, with the SLO."),
)
@click.option(
    "--compare",
    is_flag=True,
    help="Show each request's replayed TTFT, cached prompt tokens and decode TPS next to its captured values.",
)
@click.option("--html", "html_path", type=click.Path(dir_okay=False), default=None, help=help_for("--html"))
def replay(
    capture: str,
    target_spec: str,
    target_name: str | None,
    mode: str | None,
    speed: float | None,
    concurrency: tuple[int, ...] | None,
    sweep: bool,
    batch: tuple[int, ...] | None,
    rate: tuple[float, ...] | None,
    arrival: str,
    ramp_s: float,
    seed: int,
    sessions: tuple[int, ...] | None,
    think_time: float | None,
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
) -> None:
    """Replay a capture file against a server (or a proxy) and measure every request.
    CAPTURE may be builtin:agent, a small synthetic coding-agent conversation.

    Bodies are sent as captured, except for the documented rewrites: include_usage
    on streams, --model, the nonce (--no-nonce to send the captured prompts), and
    filler text for privacy captures.
    """
    from mlxproxy.capture import read_capture
    from mlxproxy.replay import (
        BUILTIN_AGENT,
        ReplayOptions,
        run_replay,
        select,
        served_from_cache,
        synthetic_agent_session,
    )

    name, target_url = parse_target(target_spec)
    if target_name:
        name = target_name
    given = [
        o for o, v in (("concurrency", concurrency), ("batch", batch), ("rate", rate), ("sessions", sessions)) if v
    ]
    if think_time is not None and not sessions and mode != "sessions":
        fail("--think-time applies to --sessions only")
    implied = given[0] if given else None
    if len(given) > 1:
        fail(
            f"--{given[0]} and --{given[1]} are two different tests ({', '.join(_TESTS[g] for g in given[:2])}); give one"
        )
    if mode is not None and implied is not None and mode != implied:
        fail(f"--mode {mode} conflicts with --{implied}; drop one")
    sweep = sweep or len(concurrency or ()) > 1 or len(sessions or ()) > 1 or len(rate or ()) > 1
    if sweep:
        other = (
            "--batch"
            if batch
            else "--speed"
            if speed is not None
            else f"--mode {mode}"
            if mode not in (None, "concurrency", "sessions", "rate")
            else None
        )
        if other:
            fail(f"--sweep steps the concurrency, the number of --sessions or the --rate; it cannot run with {other}")
        implied = "sessions" if sessions or mode == "sessions" else "rate" if rate or mode == "rate" else "concurrency"
    mode = mode or implied or "recorded"
    if ramp_s and not rate:
        fail("--ramp applies to --rate only")
    if mode == "rate" and not rate:
        fail("--mode rate needs --rate R (requests per second)")
    if mode == "sessions" and not sessions and not sweep:
        fail("--mode sessions needs --sessions N (conversations at once)")
    if speed is not None and mode != "recorded":
        fail(f"--speed only applies to --mode recorded, not {mode}")
    if timeout is not None and timeout[0] not in (None, name):
        fail(f"--timeout {timeout[0]}=...: no target named {timeout[0]!r} (this replay's target is {name!r})")
    api_key = env_key(api_key_env)
    check_writable(json_path, csv_path, md_path, html_path, plot_path)
    if plot_path and not sweep:
        fail("replay --plot draws a sweep; add --sweep (or --concurrency N,N,...)")
    skipped: list[str] = []
    try:
        caps = (
            synthetic_agent_session()
            if capture == BUILTIN_AGENT
            else read_capture(
                capture,
                warn=lambda m: click.echo(f"mlxproxy: warning: {m}", err=True),
                skip_bad=skip_bad_lines,
                skipped=skipped,
            )
        )
    except MlxproxyError as exc:
        hint = (
            ""
            if skip_bad_lines or "cannot read" in str(exc) or "version" in str(exc)
            else " (--skip-bad-lines skips such lines)"
        )
        fail(f"{exc}{hint}")
    if skipped:
        click.echo(
            f"mlxproxy: warning: skipped {len(skipped)} unreadable line(s) of {capture}; the first: {skipped[0]}",
            err=True,
        )
    chosen = select(caps, parse_filters(filters), limit)
    if not chosen:
        fail(f"no requests to replay: {capture} has {len(caps)}, none matched the filters")
    steps = {"sessions": sessions, "rate": rate}.get(mode, concurrency) or ()
    opts = ReplayOptions(
        mode=mode,
        speed=speed or 1.0,
        concurrency=(concurrency or (1,))[0],
        sweep=sweep,
        sweep_steps=steps if sweep else (),
        slo=slo,
        batch=(batch or (2,))[0],
        batches=batch or (2,),
        repeat=repeat,
        warmup=warmup,
        nonce=nonce,
        model=model,
        limit=limit,
        filters=parse_filters(filters),
        rate=rate[0] if rate else None,
        arrival=arrival,
        ramp_s=ramp_s,
        seed=seed,
        sessions=(sessions or (1,))[0],
        think_time=think_time,
    )
    click.echo(
        f"replaying {len(chosen)} requests x{repeat} from {capture} against {target_url} ({mode}"
        f"{', nonce' if nonce else ', no nonce: captured prompt bytes'})",
        err=True,
    )
    groups: list[Group] = []
    interrupted = False
    try:
        run_async(
            run_replay(
                chosen,
                target_url,
                opts,
                target_name=name,
                api_key=api_key,
                timeout_s=timeout[1] if timeout else 1800.0,
                compare=compare,
                out=groups,
                say=lambda line: click.echo(f"mlxproxy: {line}", err=True),
            )
        )
    except KeyboardInterrupt:
        interrupted = True
    judge_groups(groups, slo)
    print_groups(groups)
    cached, reported = served_from_cache(r for g in groups for r in g.records)
    if cached:
        click.echo(
            f"mlxproxy: warning: {cached} of {reported} replayed requests were served mostly from the prompt cache "
            "(cached_tokens > half the prompt): their TTFT measures the cache, not prefill"
            + ("; drop --no-nonce to measure prefill" if not nonce else ""),
            err=True,
        )
    write_replay_outputs(groups, capture, target_url, json_path, csv_path, md_path, html_path)
    if plot_path:
        with open(plot_path, "w", encoding="utf-8") as fh:
            fh.write(sweep_svg(groups))
        click.echo(f"wrote {plot_path}", err=True)
    if interrupted:
        fail(
            f"interrupted: {sum(len(g.records) for g in groups)} finished requests printed"
            + (" and written" if json_path or csv_path or md_path or html_path else ""),
            130,
        )
    reason = all_failed_reason(groups)
    if reason:
        fail(reason, 1)
    check_fail_on(fail_on, groups)


def judge_groups(groups: list[Group], slo: dict[str, float] | None) -> None:
    """Every group's `summary.slo` and `summary.goodput` against `slo` (default: DEFAULT_SLO), in place."""
    from mlxproxy.load import DEFAULT_SLO, judge, parse_slo

    slo = slo or parse_slo(DEFAULT_SLO)
    groups[:] = [g.with_summary(g.summary.updated(judge(g.records, slo))) for g in groups]


def check_fail_on(kinds: tuple[str, ...] | None, groups: Sequence[Group]) -> None:
    """`--fail-on`: one line on stderr either way; exit 1 when a check failed."""
    from mlxproxy.load import failed_checks

    if not kinds:
        return
    failed = failed_checks(kinds, groups)
    if failed:
        fail(f"--fail-on {','.join(kinds)}: failed: " + "; ".join(failed), 1)
    click.echo(f"mlxproxy: --fail-on {','.join(kinds)}: every check held", err=True)


def sweep_svg(groups: Sequence[Group]) -> str:
    from mlxproxy.load import sweep_charts
    from mlxproxy.plot import svg_charts

    return svg_charts(sweep_charts(groups))


def compare_table(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, str]]:
    def v(x: Any, fmt: str = ".3f", unit: str = "") -> str:
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


def write_replay_outputs(
    groups: Sequence[Group],
    capture: str,
    target_url: str,
    json_path: str | None,
    csv_path: str | None,
    md_path: str | None,
    html_path: str | None = None,
) -> None:
    from mlxproxy.report import markdown_sections, write_csv, write_result

    doc = ResultFile.new("replay", groups, extra={"capture": capture, "target": target_url})
    if json_path:
        write_result(json_path, doc)
        click.echo(f"wrote {json_path} (render again with: mlxproxy report {json_path})", err=True)
    if csv_path:
        write_csv(csv_path, groups)
        click.echo(f"wrote {csv_path}", err=True)
    if md_path:
        with open(md_path, "w", encoding="utf-8") as f:
            f.write(markdown_sections(replay_sections(groups)))
        click.echo(f"wrote {md_path}", err=True)
    if html_path:
        from mlxproxy.htmlreport import write_html

        try:
            write_html(html_path, [(os.path.basename(capture), doc)])
        except OSError as exc:
            fail(f"cannot write {html_path}: {exc.strerror or exc}")
        click.echo(f"wrote {html_path}", err=True)


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
    import orjson

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
@click.option("--csv", "csv_path", type=click.Path(dir_okay=False), default=None, help=help_for("--csv"))
@click.option("--markdown", "md_path", type=click.Path(dir_okay=False), default=None, help=help_for("--markdown"))
@click.option(
    "--plot",
    "plot_path",
    type=click.Path(dir_okay=False),
    default=None,
    help=help_for("--plot", "Bench results, and sweeps of replay results."),
)
@click.option("--html", "html_path", type=click.Path(dir_okay=False), default=None, help=help_for("--html"))
def report(
    files: tuple[str, ...], csv_path: str | None, md_path: str | None, plot_path: str | None, html_path: str | None
) -> None:
    """Render saved replay/bench results (--json files) again, the same view as the run
    that wrote them; several files side by side, each target labelled with its file."""
    from mlxproxy.bench_cli import bench_sections, plot_svg, results_from_doc
    from mlxproxy.report import markdown_sections, read_result, render_sections, write_csv

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
    from mlxproxy.load import capacity_of

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
    if csv_path:
        write_csv(csv_path, [g for r in bench_results for g in r.groups] + replay_groups)
        click.echo(f"wrote {csv_path}", err=True)
    if md_path:
        with open(md_path, "w", encoding="utf-8") as fh:
            fh.write(markdown_sections(sections))
        click.echo(f"wrote {md_path}", err=True)
    if plot_path:
        with open(plot_path, "w", encoding="utf-8") as fh:
            fh.write(plot_svg(bench_results) if bench_results else sweep_svg(replay_groups))
        click.echo(f"wrote {plot_path}", err=True)
    if html_path:
        from mlxproxy.htmlreport import write_html

        try:
            write_html(html_path, list(zip(labels, docs)))
        except OSError as exc:
            fail(f"cannot write {html_path}: {exc.strerror or exc}")
        click.echo(f"wrote {html_path}", err=True)
