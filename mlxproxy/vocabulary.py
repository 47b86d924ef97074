"""One vocabulary for every command's options.

An option spelled the same in two commands means the same thing in both: its meaning is
written once here, each command's help starts with it (`help_for`), and
tests/e2e/test_cli_ux.py checks every command's click parameters and docs/CLI.md's table
against `MEANINGS`. Spellings that changed keep working for one release, hidden, with a
deprecation line on stderr (`DEPRECATED`, `deprecated_alias`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import click

if TYPE_CHECKING:
    _ParamType = click.ParamType[Any]
else:  # (click's ParamType takes type arguments only in recent releases)
    _ParamType = click.ParamType

__all__ = [
    "arrival_options",
    "shared_option",
    "stacked",
    "MEANINGS",
    "DEPRECATED",
    "help_for",
    "SECONDS",
    "INT_LIST",
    "BATCH_SIZES",
    "deprecated_alias",
    "EXIT_CODES",
    "SLO",
    "FAIL_ON",
    "FLOAT_LIST",
    "SWEEP_MODES",
    "LoadCommand",
]

#: option -> its one meaning (the first sentence of its help in every command that has it)
MEANINGS: dict[str, str] = {
    "--host": "Address to listen on.",
    "--port": "Port to listen on (0 picks a free one).",
    "--target": "[NAME=]URL of a server or proxy to send requests to (a trailing /v1 is dropped); "
    "NAME labels it in reports (default: its host:port).",
    "--timeout": "Seconds a request may wait in silence for its response or its next byte before it times out.",
    "--model": "Model name to send in every request instead of the default.",
    "--repeat": "How many times each request or test is sent; figures are medians.",
    "--speed": "Time runs this many times faster than recorded or simulated (2 = twice as fast).",
    "--batch": "N[,N,...]: waves of N requests released together, after a one-at-a-time baseline that gives "
    "the speedup (2 = the double-batch test).",
    "--concurrency": "N[,N,...]: N requests in flight at once, each next one sent when one finishes (closed loop); "
    "several values are the steps of a --sweep.",
    "--sweep": "auto or double: step the concurrency up and give the capacity: the largest concurrency that met "
    "the --slo, never past where aggregate tok/s stopped rising. auto (what --sweep alone means): 1, 2, 4, ... "
    "until aggregate tok/s stops rising, the SLO breaks or requests fail, then halving the gap between the last "
    "good and the first bad step, to the exact number; double: the powers of two only, not refined. Steps "
    "given with --concurrency run as given.",
    "--sweep-budget": "SECONDS: a --sweep without given steps starts refining steps only while it has run less "
    "than this long (the verdict says when the answer was left unrefined).",
    "--step-time": "SECONDS: each closed-loop --sweep step sends its mix again until it has run at least this "
    "long (each stream's first request of each round is a warm-up: sent, not judged).",
    "--runs": "N: run the whole --sweep search N times and report every run's capacity, their median and spread.",
    "--max-connections": "N: at most N connections (so requests in flight) to a target from one load-generator "
    "process; more wait in the generator, the wait counted in their TTFT and E2E. Default: 1024, or half the "
    "open-file limit where that is lower.",
    "--rate": "R[,R,...]: open loop: send R requests per second whatever the server does (arrivals spaced by "
    "--arrival); several values are the steps of a sweep.",
    "--arrival": "How --rate's requests are spaced: constant (exactly 1/R apart) or poisson (random gaps of mean "
    "1/R, from --seed).",
    "--ramp": "SECONDS: before each --rate test, raise the rate linearly from 0 to R over this long; those "
    "requests are sent but not measured.",
    "--seed": "Seed of everything drawn at random, so the same seed repeats a run exactly.",
    "--workers": "N or auto: send from N load-generator processes (auto: the cores less one), each a disjoint "
    "part of the schedule from one shared start; percentiles are computed over all their raw records.",
    "--cluster": "ADDRESS: send from the workers of the Dask cluster whose scheduler is at ADDRESS "
    "(tcp://HOST:8786), one part of the schedule each; needs the [cluster] extra.",
    "--slo": "KEY=VALUE,...: latency targets a test must meet, e.g. ttft_p95=3s,tpot_p50=60ms (keys ttft, tpot, "
    "itl, e2e: at most; decode_tps: at least; _pNN the percentile); goodput counts the requests that met "
    "every one.",
    "--fail-on": "KIND,...: exit 1, with one line saying what failed, when a check fails: slo, errors, anomaly "
    "(any), or an anomaly kind such as phantom_speed.",
    "--nonce": "Prefix every prompt with its own marker so no prompt cache can serve it "
    "(on by default; --no-nonce sends the prompts' bytes unchanged).",
    "--api-key-env": "Environment variable holding the target's API key.",
    "--max-tokens": "max_tokens of every request sent.",
    "--json": "Write every per-request record and the summaries to this JSON file.",
    "--csv": "Write one row per request to this CSV file.",
    "--markdown": "Write the console's tables as Markdown to this file.",
    "--plot": "Write an SVG plot of the results to this file.",
    "--html": "Write a self-contained HTML report (tables, verdicts with evidence, plots, every request's "
    "timeline; no network needed to open it) to this file.",
}

#: old spelling -> (command, what to use instead); accepted until the next release
DEPRECATED: dict[tuple[str, str], str] = {
    ("replay", "--name"): "--target NAME=URL",
    ("sim", "--max-tokens"): "--max-output-tokens (the server's cap; --max-tokens is a request's max_tokens)",
}

#: exit codes of every command
EXIT_CODES = {
    0: "success (also: `serve` stopped with Ctrl-C)",
    1: "the run failed: every request failed, a target was unreachable, a port could not be opened, "
    "a --fail-on check failed",
    2: "the command line or an input file is wrong (one line says what and how to fix it)",
    130: "interrupted with Ctrl-C (`bench`/`replay`: what was measured so far is printed and written)",
}


def help_for(option: str, extra: str = "") -> str:
    """The option's shared meaning, then what is particular to this command."""
    return MEANINGS[option] + (" " + extra if extra else "")


class _Seconds(_ParamType):
    """SECONDS or NAME=SECONDS -> (name or None, seconds)."""

    name = "seconds"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> tuple[str | None, float]:
        if isinstance(value, tuple):
            return value
        name, sep, secs = str(value).rpartition("=")
        try:
            v = float(secs)
        except ValueError:
            self.fail(f"{value!r}: give SECONDS (or NAME=SECONDS), e.g. 600", param, ctx)
        if not v > 0:
            self.fail(f"{value!r}: seconds must be more than 0", param, ctx)
        return (name if sep else None), v


class _IntList(_ParamType):
    """N or N,N,... -> tuple of ints >= `min`."""

    name = "int_list"

    def __init__(self, minimum: int = 1) -> None:
        self.minimum = minimum

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> tuple[int, ...]:
        if isinstance(value, tuple):
            return value
        try:
            items = tuple(int(x) for x in str(value).split(",") if x.strip())
        except ValueError:
            self.fail(f"{value!r}: give comma-separated whole numbers, e.g. 2,4,8", param, ctx)
        if not items or any(i < self.minimum for i in items):
            self.fail(f"{value!r}: give at least one number, each >= {self.minimum}", param, ctx)
        return items


class _Workers(_ParamType):
    """N (>= 1) or auto -> a number of load-generator processes (auto: the cores less one, at least 1)."""

    name = "workers"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        if str(value).strip().lower() == "auto":
            return max(1, (os.cpu_count() or 1) - 1)
        try:
            n = int(value)
        except ValueError:
            self.fail(f"{value!r}: give a number of processes (1 or more) or auto", param, ctx)
        if n < 1:
            self.fail(f"{value!r}: give a number of processes (1 or more) or auto", param, ctx)
        return n


class _Parsed(_ParamType):
    """A value parsed by `parse` (which raises ValueError with the one-line reason)."""

    def __init__(self, name: str, parse: Any) -> None:
        self.name, self._parse = name, parse

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if not isinstance(value, str):
            return value
        try:
            return self._parse(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


# -- the values of --slo and --fail-on (load/judge/slo.py judges with them) -------------------

#: metric -> (record key, unit, True when the threshold is a lower bound, label)
SLO_METRICS: dict[str, tuple[str, str, bool, str]] = {
    "ttft": ("ttft_s", "s", False, "TTFT"),
    "tpot": ("tpot_s", "s", False, "TPOT"),
    "itl": ("tpot_s", "s", False, "ITL"),  # inter-token latency: a stream's mean gap, the same as TPOT
    "e2e": ("e2e_s", "s", False, "E2E"),
    "decode_tps": ("decode_tps", "tok/s", True, "decode tok/s"),
}


def parse_slo(text: str) -> dict[str, float]:
    """`ttft_p95=3s,tpot_p50=60ms` -> {"ttft_p95": 3.0, "tpot_p50": 0.06}; ValueError (one
    sentence naming the bad part and the right form) otherwise."""
    out: dict[str, float] = {}
    form = (
        "give KEY=VALUE,... with KEY one of "
        + ", ".join(f"{m}_pNN" for m in SLO_METRICS)
        + ", e.g. ttft_p95=3s,tpot_p50=60ms"
    )
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        key, sep, value = part.partition("=")
        key, value = key.strip().lower(), value.strip().lower()
        metric, _, pct = key.rpartition("_p")
        if not sep or metric not in SLO_METRICS or not pct.isdigit() or not 1 <= int(pct) <= 100:
            raise ValueError(f"{part!r}: {form}")
        unit = SLO_METRICS[metric][1]
        scale = 1.0
        if unit == "s":
            if value.endswith("ms"):
                value, scale = value[:-2], 0.001
            elif value.endswith("s"):
                value = value[:-1]
        elif value.endswith("tok/s"):
            value = value[:-5]
        try:
            v = float(value) * scale
        except ValueError:
            raise ValueError(
                f"{part!r}: the value must be a number" + (" (with ms or s)" if unit == "s" else "") + f"; {form}"
            ) from None
        if not (v > 0 and math.isfinite(v)):
            raise ValueError(f"{part!r}: the value must be more than 0; {form}")
        out[f"{metric}_p{int(pct)}"] = v
    if not out:
        raise ValueError(f"no thresholds in {text!r}; {form}")
    return out


FAIL_ON_WORDS = {
    "slo": "a judged test broke the SLO (a sweep: its lightest step)",
    "errors": "a request failed",
    "anomaly": "any anomaly was found",
}


def parse_fail_on(text: str) -> tuple[str, ...]:
    from mlxproxy.core.detect import ANOMALY_KINDS

    kinds = tuple(dict.fromkeys(k.strip().lower() for k in text.split(",") if k.strip()))
    known = (*FAIL_ON_WORDS, *ANOMALY_KINDS)
    bad = [k for k in kinds if k not in known]
    if bad or not kinds:
        raise ValueError(f"{(bad or [text])[0]!r} is not a check; give KIND,... with KIND one of {', '.join(known)}")
    return kinds


SLO = _Parsed("slo", parse_slo)
FAIL_ON = _Parsed("fail_on", parse_fail_on)


class _FloatList(_ParamType):
    """R or R,R,... -> tuple of floats > 0."""

    name = "float_list"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> tuple[float, ...]:
        if isinstance(value, tuple):
            return value
        try:
            items = tuple(float(x) for x in str(value).split(",") if x.strip())
        except ValueError:
            self.fail(f"{value!r}: give comma-separated numbers, e.g. 1,2,4", param, ctx)
        if not items or any(not (i > 0 and i < float("inf")) for i in items):
            self.fail(f"{value!r}: give at least one number, each more than 0", param, ctx)
        return items


FLOAT_LIST = _FloatList()
SECONDS = _Seconds()
INT_LIST = _IntList(1)
BATCH_SIZES = _IntList(2)


def deprecated_alias(command: str, option: str) -> Any:
    """A click callback that prints the deprecation line when the old spelling is used."""
    instead = DEPRECATED[(command, option)]

    def callback(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
        if value is not None and value != () and value is not False:
            click.echo(
                f"mlxproxy: warning: {command} {option} is deprecated and will be removed in the next "
                f"release; use {instead}",
                err=True,
            )
        return value

    return callback


#: a click command function, as a decorator takes and returns it
_Command = TypeVar("_Command", bound=Callable[..., Any])


#: `--sweep`'s values: auto (doubling, then refined to the exact step; `--sweep` alone) or double
SWEEP_MODES = ("auto", "double")


_OUTPUT_FILE: dict[str, Any] = {"type": click.Path(dir_okay=False), "default": None}
#: how each option the commands share is declared: (click's declarations, settings); each
#: command adds its own help after the shared meaning and may override a setting (a default)
_DECLARATIONS: dict[str, tuple[tuple[str, ...], dict[str, Any]]] = {
    "--json": (("--json", "json_path"), _OUTPUT_FILE),
    "--csv": (("--csv", "csv_path"), _OUTPUT_FILE),
    "--markdown": (("--markdown", "md_path"), _OUTPUT_FILE),
    "--html": (("--html", "html_path"), _OUTPUT_FILE),
    "--plot": (("--plot", "plot_path"), _OUTPUT_FILE),
    "--slo": (("--slo", "slo"), {"type": SLO, "default": None, "metavar": "KEY=VALUE,..."}),
    "--fail-on": (("--fail-on", "fail_on"), {"type": FAIL_ON, "default": None, "metavar": "KIND,..."}),
    "--api-key-env": (("--api-key-env",), {"default": None, "metavar": "VAR"}),
    "--nonce": (("--nonce/--no-nonce",), {"default": True}),
    "--model": (("--model",), {"default": None}),
    "--target": (("--target",), {"required": True, "metavar": "[NAME=]URL"}),
    "--timeout": (("--timeout",), {"type": SECONDS, "default": None, "metavar": "SECONDS"}),
    "--concurrency": (("--concurrency",), {"type": INT_LIST, "default": None, "metavar": "N[,N,...]"}),
    "--batch": (("--batch",), {"type": BATCH_SIZES, "default": None, "metavar": "N[,N,...]"}),
    "--rate": (("--rate",), {"type": FLOAT_LIST, "default": None, "metavar": "R[,R,...]"}),
    "--sweep": (
        ("--sweep",),
        {"type": click.Choice(SWEEP_MODES), "is_flag": False, "flag_value": "auto", "default": None},
    ),
    "--sweep-budget": (
        ("--sweep-budget", "sweep_budget"),
        {"type": click.FloatRange(min=0.0), "default": 600.0, "show_default": True, "metavar": "SECONDS"},
    ),
    "--step-time": (
        ("--step-time", "step_time"),
        {"type": click.FloatRange(min=0.0), "default": 5.0, "show_default": True, "metavar": "SECONDS"},
    ),
    "--runs": (("--runs",), {"type": click.IntRange(min=1), "default": 1, "show_default": True, "metavar": "N"}),
    "--max-connections": (
        ("--max-connections", "max_connections"),
        {"type": click.IntRange(min=1), "default": None, "metavar": "N"},
    ),
    "--arrival": (
        ("--arrival",),
        {"type": click.Choice(["constant", "poisson"]), "default": "constant", "show_default": True},
    ),
    "--ramp": (
        ("--ramp", "ramp_s"),
        {"type": click.FloatRange(min=0.0), "default": 0.0, "show_default": True, "metavar": "SECONDS"},
    ),
    "--seed": (("--seed",), {"type": int, "default": 0, "show_default": True}),
    "--repeat": (("--repeat",), {"type": click.IntRange(min=1), "show_default": True}),
    "--workers": (("--workers",), {"type": _Workers(), "default": 1, "show_default": True, "metavar": "N|auto"}),
    "--cluster": (("--cluster",), {"default": None, "metavar": "ADDRESS"}),
}


def _is_value(word: str) -> bool:
    """Whether the word after `--sweep` is meant as its value: one of them, or a bare word
    that names no file (a mistyped value, which gets click's "not one of" error)."""
    return word in SWEEP_MODES or (word.isalpha() and word.islower() and not os.path.exists(word))


def _bare_sweep(args: list[str]) -> list[str]:
    """`args` with each `--sweep` not followed by a value spelled `--sweep=auto`, so the word
    after it stays an argument (`replay --sweep CAPTURE`)."""
    out = list(args)
    for i, a in enumerate(out):
        if a == "--":
            break
        if a == "--sweep" and (i + 1 == len(out) or out[i + 1].startswith("-") or not _is_value(out[i + 1])):
            out[i] = "--sweep=auto"
    return out


class LoadCommand(click.Command):
    """A load command (bench, replay): `--sweep` takes an optional value, and a bare `--sweep`
    before an argument leaves the argument alone."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        return super().parse_args(ctx, _bare_sweep(args))


def shared_option(
    option: str, extra: str = "", *, dest: str | None = None, **settings: Any
) -> Callable[[_Command], _Command]:
    """The click option `option` as the commands declare it, its help the shared meaning plus
    `extra`; `dest` names the command's parameter, `settings` override (e.g. a command's own
    default)."""
    decls, base = _DECLARATIONS[option]
    return click.option(
        *decls[:1], *((dest,) if dest else decls[1:]), help=help_for(option, extra), **{**base, **settings}
    )


def stacked(*options: Callable[[_Command], _Command]) -> Callable[[_Command], _Command]:
    """The option decorators as if written one above the other, in this order (their order in
    `--help`)."""

    def decorate(command: _Command) -> _Command:
        for option in reversed(options):
            command = option(command)
        return command

    return decorate


#: `--arrival`, `--ramp` and `--seed`: the open-loop schedule options `bench` and `replay` share
arrival_options = stacked(
    shared_option("--arrival"), shared_option("--ramp"), shared_option("--seed", "Here: the Poisson schedule.")
)
