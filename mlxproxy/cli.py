"""The `mlxproxy` command line: each subcommand lives with the shell it drives."""

from __future__ import annotations

import click

from mlxproxy import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="mlxproxy")
def main() -> None:
    """Measure what a local OpenAI-compatible LLM server really does.

    Point your client (Aider, OpenCode, the OpenAI SDK) at the proxy instead of the
    server; every byte is forwarded unchanged while TTFT, inter-token latency, real
    tokens/s and the truth of the server's `usage` are measured and exported.
    """


def _register() -> None:
    from mlxproxy.proxy.cli import serve
    from mlxproxy.replay_cli import replay, report

    from mlxproxy.bench_cli import bench, demo

    main.add_command(demo)
    main.add_command(serve)
    main.add_command(bench)
    main.add_command(replay)
    main.add_command(report)
    try:
        from mlxproxy.sim.cli import sim
    except ImportError:  # the simulator package is optional while it is being built
        pass
    else:
        main.add_command(sim)


_register()
