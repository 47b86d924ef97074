"""`mlxproxy serve`: run the measuring proxy in the foreground."""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import click

from mlxproxy.config import Config, is_loopback_host, load_config, parse_upstream_url
from mlxproxy.errors import ConfigError
from mlxproxy.vocabulary import help_for, shared_option

if TYPE_CHECKING:
    from mlxproxy.proxy.observers import Observer

#: `serve --otel-semconv`: which OpenTelemetry GenAI semantic conventions the export's metric names
#: follow (mlxproxy.proxy.otel.SEMCONV, kept here so that --help needs no [otel] extra), and the
#: version each one is (docs/METRICS.md, "OpenTelemetry export")
OTEL_SEMCONV = {
    "current": "semantic-conventions-genai v0.1.0",
    "old": "semantic-conventions v1.41.0",
    "dup": "both semantic-conventions-genai v0.1.0 and v1.41.0",
}

#: the one line `serve --otlp-endpoint` prints when the [otel] extra is not installed
OTEL_EXTRA_MISSING = "OpenTelemetry export needs the [otel] extra: pip install 'mlxproxy[otel]'"


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def exposure_warning(cfg: Config) -> str | None:
    """The warning to print when the proxy would listen beyond this machine without a key."""
    if is_loopback_host(cfg.host) or cfg.proxy_api_key_env is not None:
        return None
    return (
        f"mlxproxy: warning: listening on {cfg.host} without a proxy key: anyone who can reach this address can "
        "use your servers and read /metrics and /streams; set proxy_api_key_env in the config (see SECURITY.md)"
    )


@click.command("serve")
@click.option(
    "--upstream",
    "upstream_url",
    metavar="URL",
    help="Server to forward to, e.g. http://127.0.0.1:8080 (replaces the config's upstreams; a trailing /v1 "
    "is dropped). Default: the config's upstreams, else http://127.0.0.1:8080 (mlx_lm.server's default port).",
)
@click.option("--host", default=None, help=help_for("--host", "[default: 127.0.0.1]"))
@click.option("--port", type=click.IntRange(0, 65535), default=None, help=help_for("--port", "[default: 8000]"))
@shared_option("--timeout", "Replaces the config's timeouts.read_s.  [default: 1800]")
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="YAML config file (keys: see config.example.yaml). Flags override it.",
)
@click.option(
    "--capture",
    "capture_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="Append every finished request to this JSON Lines capture file (for `mlxproxy replay`).",
)
@click.option(
    "--no-inject-usage",
    is_flag=True,
    default=False,
    help="Do not add stream_options.include_usage upstream: pure byte-for-byte passthrough.",
)
@click.option(
    "--otlp-endpoint",
    metavar="URL",
    default=None,
    help="Export OpenTelemetry GenAI metrics and one span per request over OTLP/HTTP (protobuf) to this "
    "collector, e.g. http://127.0.0.1:4318 (/v1/traces and /v1/metrics are added). Needs the [otel] extra.",
)
@click.option(
    "--otel-semconv",
    type=click.Choice(list(OTEL_SEMCONV)),
    default=None,
    help="The GenAI semantic conventions the OpenTelemetry metric names follow: current (the default; "
    "gen_ai.client.inference.*), old (gen_ai.client.operation.duration, gen_ai.server.time_to_first_token, "
    "gen_ai.client.token.usage, ...: for dashboards built on them) or dup (both). Needs --otlp-endpoint.",
)
@click.option(
    "--otel-per-chunk",
    is_flag=True,
    default=False,
    help="Also export gen_ai.client.inference.time_per_output_chunk: one point per streamed chunk, about "
    "12 us of the proxy's CPU each (6 ms for a 500-token answer). Needs --otlp-endpoint.",
)
@click.option(
    "--log-level",
    type=click.Choice(["debug", "info", "warning", "error"]),
    default="info",
    show_default=True,
    help="One line per finished request is logged at info.",
)
def serve(
    upstream_url: str | None,
    host: str | None,
    port: int | None,
    timeout: tuple[str | None, float] | None,
    config_path: str | None,
    capture_path: str | None,
    no_inject_usage: bool,
    otlp_endpoint: str | None,
    otel_semconv: str | None,
    otel_per_chunk: bool,
    log_level: str,
) -> None:
    """Run the measuring proxy.

    Point clients at http://HOST:PORT/v1 instead of the server. Every request is
    forwarded unchanged (see docs/USAGE.md for the few documented rewrites) and measured;
    a live page at http://HOST:PORT/, metrics at /metrics, live streams and recent records
    as JSON at /streams, health at /healthz.
    """
    try:
        if upstream_url is not None:  # name the flag, not the config key, when the flag is wrong
            parse_upstream_url(upstream_url, "--upstream")
        if timeout is not None and timeout[0] is not None:
            raise ConfigError("--timeout takes SECONDS here (the proxy has one read timeout for every upstream)")
        for flag, given in (("--otel-semconv", otel_semconv is not None), ("--otel-per-chunk", otel_per_chunk)):
            if given and otlp_endpoint is None:
                raise ConfigError(f"{flag} shapes the OpenTelemetry export: it needs --otlp-endpoint")
        if otel_per_chunk and otel_semconv == "old":
            raise ConfigError("--otel-per-chunk adds a metric of the current conventions, not of --otel-semconv old")
        semconv = otel_semconv or "current"
        cfg = load_config(
            config_path,
            upstream_url=upstream_url,
            host=host,
            port=port,
            inject_usage=False if no_inject_usage else None,
            capture=capture_path,
        )
        cfg = normalized_upstreams(
            cfg, upstream_url is not None, lambda m: click.echo(f"mlxproxy: note: {m}", err=True)
        )
    except ConfigError as exc:
        click.echo(f"mlxproxy: {exc}", err=True)
        sys.exit(2)
    if timeout is not None:
        cfg = dataclasses.replace(cfg, timeouts=dataclasses.replace(cfg.timeouts, read_s=timeout[1]))
    if cfg.capture:  # checked now: a capture that cannot be written would lose the day's traffic
        parent = os.path.dirname(os.path.abspath(cfg.capture))
        if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
            click.echo(
                f"mlxproxy: cannot write the capture file {cfg.capture}: folder {parent} "
                f"{'is not writable' if os.path.isdir(parent) else 'does not exist'}",
                err=True,
            )
            sys.exit(2)
    setup_logging(log_level)
    from mlxproxy.edge.runner import bind_socket, make_uvicorn_config, run_server, stack_settings
    from mlxproxy.proxy.app import create_app
    from mlxproxy.proxy.reach import start_warnings
    from mlxproxy.proxy.upstream import display_url

    try:
        stack_settings(None)
    except ValueError as exc:  # MLXPROXY_STACK names no installed stack
        click.echo(f"mlxproxy: {exc}", err=True)
        sys.exit(2)
    try:
        observers = [otlp_observer(otlp_endpoint, cfg, semconv, otel_per_chunk)] if otlp_endpoint is not None else []
        app = create_app(cfg, observers=observers)
    except ConfigError as exc:
        click.echo(f"mlxproxy: {exc}", err=True)
        sys.exit(2)
    warning = exposure_warning(cfg)
    if warning:
        click.echo(warning, err=True)
    try:
        sock = bind_socket(cfg.host, cfg.port)
    except OSError as exc:
        click.echo(f"mlxproxy: cannot listen on {cfg.host}:{cfg.port}: {exc.strerror or exc}", err=True)
        sys.exit(1)
    bound = sock.getsockname()[1]
    ups = ", ".join(f"{u.name}={display_url(u.url)}" for u in cfg.upstreams)
    click.echo(
        f"mlxproxy: listening on http://{cfg.host}:{bound}/v1 -> {ups}  (live page: http://{cfg.host}:{bound}/, metrics: /metrics)",
        err=True,
    )
    if cfg.capture:
        click.echo(f"mlxproxy: capturing requests to {cfg.capture}", err=True)
    if otlp_endpoint is not None:
        click.echo(
            f"mlxproxy: exporting OpenTelemetry metrics and spans to {otlp_endpoint} "
            f"(metric names: {semconv}, {OTEL_SEMCONV[semconv]})",
            err=True,
        )
    for line in start_warnings(app.pool.upstreams):
        click.echo(f"mlxproxy: warning: {line}", err=True)
    import uvicorn

    ucfg = make_uvicorn_config(app, cfg.host, bound, server_header=False, date_header=False)
    # Everything imported and built so far lives as long as the process: keep the cyclic
    # GC from scanning it again and again, and let it run less often (per-event objects are
    # freed by reference counting; benchmarks/README.md measures what this buys).
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)
    try:
        run_server(uvicorn.Server(ucfg), sock)
    except KeyboardInterrupt:  # Ctrl-C is how a foreground proxy is stopped: not an error
        pass
    click.echo("mlxproxy: stopped", err=True)


def normalized_upstreams(cfg: Config, from_flag: bool, note: Callable[[str], None]) -> Config:
    """The config with every upstream URL as `parse_upstream_url` normalizes it (a trailing
    /v1 dropped, with one note line each)."""
    ups = []
    for i, up in enumerate(cfg.upstreams):
        url, msg = parse_upstream_url(up.url, "--upstream" if from_flag else f"config key 'upstreams[{i}].url'")
        if msg:
            note(msg)
        ups.append(dataclasses.replace(up, url=url))
    return dataclasses.replace(cfg, upstreams=tuple(ups))


def otlp_observer(endpoint: str, cfg: Config, semconv: str = "current", per_chunk: bool = False) -> Observer:
    """The OpenTelemetry observer exporting to `endpoint` (OTLP over HTTP, protobuf).
    Raises `ConfigError` with one line for a bad URL, another OTLP protocol asked in the
    environment, or a missing `[otel]` extra."""
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"--otlp-endpoint takes an http(s)://HOST[:PORT] URL, not {endpoint!r}")
    for var in (
        "OTEL_EXPORTER_OTLP_PROTOCOL",
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
        "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL",
    ):
        protocol = os.environ.get(var)
        if protocol is not None and protocol != "http/protobuf":
            raise ConfigError(f"{var}={protocol}: mlxproxy exports OTLP over http/protobuf only")
    try:
        from mlxproxy.proxy import otel  # the optional [otel] extra, imported only when asked
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] != "opentelemetry":
            raise
        raise ConfigError(OTEL_EXTRA_MISSING) from None
    meters, tracers = otel.otlp_providers(endpoint)
    upstreams = {u.name: u.url for u in cfg.upstreams}
    return otel.OtelObserver(upstreams, meters, tracers, own_providers=True, semconv=semconv, per_chunk=per_chunk)
