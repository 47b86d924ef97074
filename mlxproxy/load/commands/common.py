"""What the load-testing parts share: the filler text of synthetic prompts,
and the command-line helpers every load command uses (one-line errors with exit 2 on bad input,
targets, keys, output checks, the run on the stack's event loop)."""

from __future__ import annotations

import os
import sys
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, NoReturn
from urllib.parse import urlsplit

import click

from mlxproxy.config import parse_upstream_url
from mlxproxy.core.detect import Thresholds
from mlxproxy.core.record import OK_OUTCOMES
from mlxproxy.core.text import clip
from mlxproxy.edge.runner import run_async as run_on_stack
from mlxproxy.edge.runner import stack_settings
from mlxproxy.errors import ConfigError, UpstreamError
from mlxproxy.load.data.results import Group
from mlxproxy.load.data.summary import JSONObject, JSONValue
from mlxproxy.load.data.targets import Target
from mlxproxy.load.fleet.workers import WorkersError
from mlxproxy.load.judge.slo import failed_checks
from mlxproxy.load.output.progress import Progress
from mlxproxy.load.run.client import MeasuringClient
from mlxproxy.load.run.shapes import Sweep, SweptShape
from mlxproxy.load.run.sweep import StepRun

FILLER = "the quick brown fox jumps over the lazy dog while the proxy measures every token it streams "


def filler_text(n: int) -> str:
    """Deterministic text of exactly n characters."""
    reps = n // len(FILLER) + 1
    return (FILLER * reps)[:n]


def client_for(target: Target, thresholds: Thresholds) -> MeasuringClient:
    """The client that measures `target`: its URL and name, key, timeout and most connections."""
    return MeasuringClient(
        target.url, name=target.name, thresholds=thresholds, api_key=target.api_key, timeout_s=target.timeout_s,
        max_connections=target.max_connections,
    )  # fmt: skip


def fail(message: str, code: int = 2) -> NoReturn:
    """One line on stderr (whatever the message holds, e.g. a server's HTML error page), then exit."""
    click.echo(f"mlxproxy: {' '.join(str(message).split())}", err=True)
    sys.exit(code)


def run_async(coro: Any) -> Any:
    """Run the client (`coro`) on the stack's event loop (`mlxproxy.edge.runner.run_async`); a bad
    MLXPROXY_STACK is one line and exit 2, before anything is sent."""
    try:
        stack_settings(None)
    except ValueError as exc:
        coro.close()
        fail(str(exc))
    return run_on_stack(coro)


def parse_target(spec: str) -> tuple[str, str]:
    """`[NAME=]URL` -> (name, base URL), the URL checked and normalized like the proxy's
    upstream (`parse_upstream_url`); a dropped /v1 is said in one line on stderr."""
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
    recs = [r for g in groups for r in g.records]
    if not recs or any(r.record.outcome in OK_OUTCOMES for r in recs):
        return None
    outcomes = Counter(r.record.outcome for r in {r.id: r for r in recs}.values())
    first = next((r.record for r in recs if r.record.error or r.record.status), recs[0].record)
    why = first.error or (f"HTTP {first.status}" if first.status else first.outcome)
    why = clip(str(why), 200)
    return f"every request failed ({', '.join(f'{k} {v}' for k, v in sorted(outcomes.items()))}): {why}"


def run_interrupted(coro: Any) -> bool:
    """`run_async(coro)`: whether Ctrl-C ended it; the workers failing is one line and exit 1."""
    try:
        run_async(coro)
    except KeyboardInterrupt:
        return True
    except WorkersError as exc:
        fail(str(exc), 1)
    return False


def check_outcomes(fail_on: tuple[str, ...] | None, groups: Sequence[Group]) -> None:
    """A finished run's exit: 1 when every request failed (`all_failed_reason`) or a `--fail-on` check did."""
    reason = all_failed_reason(groups)
    if reason:
        fail(reason, 1)
    check_fail_on(fail_on, groups)


def requests_text(n: int, what: str = "") -> str:
    """`1 measured request`, `2 measured requests`: a count with its noun agreeing."""
    return f"{n} {what + ' ' if what else ''}request{'' if n == 1 else 's'}"


def unreachable_message(url: str, exc: BaseException) -> str:
    """Why `url` could not be reached, said once (the client's own errors already name the URL
    and say it is unreachable), in whole words."""
    if isinstance(exc, UpstreamError) and str(exc):
        return clip(str(exc), 300)
    return clip(f"cannot reach {url}: {type(exc).__name__}: {exc}", 300)


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


def check_fail_on(kinds: tuple[str, ...] | None, groups: Sequence[Group]) -> None:
    """`--fail-on`: one line on stderr either way; exit 1 when a check failed."""
    if not kinds:
        return
    failed = failed_checks(kinds, groups)
    if failed:
        fail(f"--fail-on {','.join(kinds)}: failed: " + "; ".join(failed), 1)
    click.echo(f"mlxproxy: --fail-on {','.join(kinds)}: every check held", err=True)


class SweepsOnTarget:
    """What bench's and replay's run against one target share for a sweep: the groups' params, the
    progress lines' `say`, and where the steps' groups go (`sweep_into`)."""

    params: JSONObject
    say: Callable[[str], None] | None

    def sweep_into(self) -> tuple[str, list[Group]]:
        """The target's name and the list its groups are added to."""
        raise NotImplementedError

    async def sweep(
        self,
        shape: Sweep[SweptShape],
        slo: dict[str, float],
        step: Callable[[SweptShape], Awaitable[StepRun]],
        tick: Progress,
        **params: JSONValue,
    ) -> None:
        """`shape`'s steps, each sending through `step`, judged against `slo` as they finish."""
        target, out = self.sweep_into()
        await shape.run(
            step, slo, target=target, params={**self.params, **params}, out=out, say=self.say, progress=tick
        )
