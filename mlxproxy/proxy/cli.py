"""`mlxproxy serve`: run the measuring proxy in the foreground."""

from __future__ import annotations

import gc
import logging
import sys

import click

from mlxproxy.config import Config, is_loopback_host, load_config
from mlxproxy.errors import ConfigError


def setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper()), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)


def exposure_warning(cfg: Config) -> str | None:
    """The warning to print when the proxy would listen beyond this machine without a key."""
    if is_loopback_host(cfg.host) or cfg.proxy_api_key_env is not None:
        return None
    return (f"mlxproxy: warning: listening on {cfg.host} without a proxy key: anyone who can reach this address can "
            "use your servers and read /metrics and /streams; set proxy_api_key_env in the config (see SECURITY.md)")


@click.command("serve")
@click.option("--upstream", "upstream_url", metavar="URL",
              help="Server to forward to, e.g. http://127.0.0.1:8080 (replaces the config's upstreams). "
                   "Default: the config's upstreams, else http://127.0.0.1:8080 (mlx_lm.server's default port).")
@click.option("--host", default=None, help="Address to listen on.  [default: 127.0.0.1]")
@click.option("--port", type=int, default=None, help="Port to listen on (0 picks a free one).  [default: 8000]")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
              help="YAML config file (keys: see config.example.yaml). Flags override it.")
@click.option("--capture", "capture_path", type=click.Path(dir_okay=False), default=None,
              help="Append every finished request to this JSON Lines capture file (for `mlxproxy replay`).")
@click.option("--no-inject-usage", is_flag=True, default=False,
              help="Do not add stream_options.include_usage upstream: pure byte-for-byte passthrough.")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info", show_default=True,
              help="One line per finished request is logged at info.")
def serve(upstream_url: str | None, host: str | None, port: int | None, config_path: str | None,
          capture_path: str | None, no_inject_usage: bool, log_level: str) -> None:
    """Run the measuring proxy.

    Point clients at http://HOST:PORT/v1 instead of the server. Every request is
    forwarded unchanged (see the README for the few documented rewrites) and measured;
    metrics at /metrics, live streams and recent records at /streams, health at /healthz.
    """
    try:
        cfg = load_config(config_path, upstream_url=upstream_url, host=host, port=port,
                          inject_usage=False if no_inject_usage else None, capture=capture_path)
    except ConfigError as exc:
        click.echo(f"mlxproxy: {exc}", err=True)
        sys.exit(2)
    setup_logging(log_level)
    from mlxproxy.proxy.app import create_app
    from mlxproxy.proxy.upstream import display_url
    from mlxproxy.runner import bind_socket, make_uvicorn_config, run_server, stack_settings

    try:
        stack_settings(None)
    except ValueError as exc:  # MLXPROXY_STACK names no installed stack
        click.echo(f"mlxproxy: {exc}", err=True)
        sys.exit(2)
    try:
        app = create_app(cfg)
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
    click.echo(f"mlxproxy: listening on http://{cfg.host}:{bound}/v1 -> {ups}  (metrics: /metrics, live: /streams)", err=True)
    if cfg.capture:
        click.echo(f"mlxproxy: capturing requests to {cfg.capture}", err=True)
    import uvicorn

    ucfg = make_uvicorn_config(app, cfg.host, bound, server_header=False, date_header=False)
    # Everything imported and built so far lives as long as the process: keep the cyclic
    # GC from scanning it again and again, and let it run less often (per-event objects are
    # freed by reference counting; benchmarks/README.md measures what this buys).
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)
    run_server(uvicorn.Server(ucfg), sock)
