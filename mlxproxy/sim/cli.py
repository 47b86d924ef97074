"""`mlxproxy sim`: serve a simulated MLX server with a chosen profile."""

from __future__ import annotations

import json
import socket
import sys
from typing import Any

import click

from mlxproxy.sim.profiles import PROFILES, Profile, coerce_knob, get_profile, truth_lines
from mlxproxy.vocabulary import deprecated_alias, help_for, shared_option


def build_profile(profile_name: str, options: dict[str, Any], sets: tuple[str, ...]) -> Profile:
    """The effective profile from the CLI options; raises click.UsageError for a bad value."""
    overrides: dict[str, Any] = {k: v for k, v in options.items() if v is not None}
    for key in ("max_context_tokens", "max_batch_streams"):
        if overrides.get(key) == 0:
            overrides[key] = None  # 0 = no limit
    try:
        for item in sets:
            name, sep, value = item.partition("=")
            if not sep:
                raise ValueError(f"--set needs KNOB=VALUE, got {item!r}")
            overrides[name.strip()] = coerce_knob(name.strip(), value)
        return get_profile(profile_name, **overrides)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None


#: the command's help: its profiles are the registry's (`mlxproxy.sim.profiles.PROFILES`)
SIM_HELP = f"""Serve a simulated MLX server: OpenAI-compatible, deterministic timing, a real server's wire format.

Profiles: {", ".join(PROFILES)} (see docs/SIMULATOR.md). The effective knobs are printed first as one
JSON line, so a test knows the truth it should measure; GET /sim/profile returns them too.
"""


@click.command("sim", help=SIM_HELP)
@click.option(
    "--profile",
    "profile_name",
    type=click.Choice(list(PROFILES)),
    default="healthy",
    show_default=True,
    help="Which real server to imitate.",
)
@click.option("--host", default="127.0.0.1", show_default=True, help=help_for("--host"))
@click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True, help=help_for("--port"))
@click.option(
    "--speed",
    type=click.FloatRange(min=0.0, min_open=True),
    default=1.0,
    show_default=True,
    help=help_for("--speed", "Simulated time against the wall clock."),
)
@shared_option("--seed", "Here: the generated text.")
@click.option("--decode-tps", type=click.FloatRange(min=0.0, min_open=True), help="Single-stream decode tokens/s.")
@click.option("--prefill-tps", type=click.FloatRange(min=0.0, min_open=True), help="Prefill tokens/s.")
@click.option("--max-context", type=click.IntRange(min=0), help="Reject longer prompts with HTTP 400 (0 = no limit).")
@click.option(
    "--max-output-tokens",
    "max_tokens",
    type=click.IntRange(min=1),
    help="The server's cap on output tokens per request (a request asking for more gets this many).",
)
@click.option(
    "--max-tokens",
    "old_max_tokens",
    type=click.IntRange(min=1),
    hidden=True,
    callback=deprecated_alias("sim", "--max-tokens"),
)
@click.option("--output-tokens", type=click.IntRange(min=1), help="Output tokens when a request sets no max_tokens.")
@click.option("--batch-penalty", type=click.FloatRange(min=0.0), help="Extra step cost per added stream (fraction).")
@click.option("--max-batch", type=click.IntRange(min=0), help="Most streams decoding at once (0 = no limit).")
@click.option("--batching", type=click.Choice(["continuous", "serial"]), help="Batching model.")
@click.option(
    "--jitter",
    type=click.FloatRange(min=0.0),
    help="Mean seconds (simulated) of each request's random wait before the device (exponential; seeded by --seed).",
)
@click.option("--set", "sets", multiple=True, metavar="KNOB=VALUE", help="Set any profile knob (repeatable).")
@click.option("--dry-run", is_flag=True, help="Print the effective knobs and exit without serving.")
def sim(
    profile_name: str,
    host: str,
    port: int,
    speed: float,
    seed: int,
    decode_tps: float | None,
    prefill_tps: float | None,
    max_context: int | None,
    max_tokens: int | None,
    old_max_tokens: int | None,
    output_tokens: int | None,
    batch_penalty: float | None,
    max_batch: int | None,
    batching: str | None,
    jitter: float | None,
    sets: tuple[str, ...],
    dry_run: bool,
) -> None:
    if max_tokens is None:
        max_tokens = old_max_tokens
    options = {
        "decode_tps": decode_tps,
        "prefill_tps": prefill_tps,
        "max_context_tokens": max_context,
        "max_output_tokens": max_tokens,
        "default_output_tokens": output_tokens,
        "batch_penalty": batch_penalty,
        "max_batch_streams": max_batch,
        "serial": None if batching is None else batching == "serial",
        "jitter_s": jitter,
    }
    profile = build_profile(profile_name, options, sets)
    sock = None if dry_run else _listen(host, port)  # a taken port is the only line, before the knobs
    click.echo(json.dumps({"sim_profile": profile.knobs(), "speed": speed, "seed": seed}))
    for line in truth_lines(profile):
        click.echo(f"truth: {line}")
    if dry_run:
        return
    import uvicorn

    from mlxproxy.edge.runner import make_uvicorn_config, run_server
    from mlxproxy.sim.app import SimApp

    assert sock is not None
    app = SimApp(profile, speed=speed, seed=seed)
    bound = sock.getsockname()[1]
    shown_host = f"[{host}]" if ":" in host else host
    click.echo(f"mlxproxy sim ({profile.name}) listening on http://{shown_host}:{bound} (speed {speed:g}x)")
    try:
        run_server(uvicorn.Server(make_uvicorn_config(app, host, bound)), sock)
    except KeyboardInterrupt:  # Ctrl-C is how a foreground server is stopped: not an error
        pass


def _listen(host: str, port: int) -> socket.socket:
    """The listening socket, or one line and exit 1 when the port cannot be opened."""
    from mlxproxy.edge.runner import bind_socket

    try:
        return bind_socket(host, port)
    except OSError as exc:
        click.echo(f"mlxproxy sim: cannot listen on {host}:{port}: {exc.strerror or exc}", err=True)
        sys.exit(1)
