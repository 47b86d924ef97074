"""The `mlxproxy` command line: each subcommand lives with the shell it drives."""

from __future__ import annotations

import sys
from typing import Any

import click

from mlxproxy import __version__

#: click >= 8.2 raises this for a group called without a command (older releases print the
#: help themselves and exit 0, which is what this keeps).
NO_ARGS_IS_HELP: type[click.UsageError] = getattr(
    click.exceptions, "NoArgsIsHelpError", type("_Never", (click.UsageError,), {})
)


class OneLineErrors(click.Group):
    """Every command-line mistake is one line on stderr and exit 2 (click's default is a
    usage block of four lines); Ctrl-C outside a command's own handling exits 130 without
    click's `Aborted!`; bare `mlxproxy` prints the help (stdout, exit 0). Exit codes: see `mlxproxy.vocabulary.EXIT_CODES` and the README."""

    def main(
        self,
        args: Any = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        try:
            super().main(args, prog_name, complete_var, False, **extra)
        except NO_ARGS_IS_HELP as exc:  # bare `mlxproxy`: the help as --help prints it, exit 0
            click.echo(exc.ctx.get_help() if exc.ctx is not None else self.get_usage(click.Context(self)))
            sys.exit(0)
        except click.UsageError as exc:
            where = (
                f"mlxproxy {exc.ctx.info_name}" if exc.ctx is not None and exc.ctx.parent is not None else "mlxproxy"
            )
            hint = f" (see {where} --help)" if exc.ctx is not None else ""
            click.echo(f"{where}: {' '.join(exc.format_message().split())}{hint}", err=True)
            sys.exit(exc.exit_code)
        except click.exceptions.Abort:
            click.echo("mlxproxy: interrupted", err=True)
            sys.exit(130)
        except click.ClickException as exc:
            click.echo(f"mlxproxy: {' '.join(exc.format_message().split())}", err=True)
            sys.exit(exc.exit_code)
        except KeyboardInterrupt:
            click.echo("mlxproxy: interrupted", err=True)
            sys.exit(130)
        sys.exit(0)


@click.group(cls=OneLineErrors, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="mlxproxy")
def main() -> None:
    """Measure what a local OpenAI-compatible LLM server really does.

    Point your client (Aider, OpenCode, the OpenAI SDK) at the proxy instead of the
    server; every byte is forwarded unchanged while TTFT, inter-token latency, real
    tokens/s and the truth of the server's `usage` are measured and exported.
    """
    from mlxproxy.edge.runner import quiet_after_interrupt, raise_open_files_limit

    raise_open_files_limit()
    quiet_after_interrupt()  # a second Ctrl-C never cuts short the first one's summary  # every command opens sockets: one or two per stream in flight


def _register() -> None:
    from mlxproxy.load.commands.bench_cli import bench
    from mlxproxy.load.commands.demo import demo
    from mlxproxy.load.commands.replay_cli import replay
    from mlxproxy.load.commands.report_cli import report
    from mlxproxy.proxy.cli import serve

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
