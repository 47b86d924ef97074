"""`--sweep`, `--sweep-budget`, `--step-time` and `--runs`: declared once for `bench` and
`replay` (`sweep_options`) and given to the command as one `SweepOptions`, which builds the
`Sweep` shape the command's tests run."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from mlxproxy.load.run.shapes import Sweep, SweptShape
from mlxproxy.load.run.sweep import DEFAULT_BUDGET_S, DEFAULT_STEP_MIN_S
from mlxproxy.vocabulary import shared_option, stacked

__all__ = ["SweepOptions", "sweep_options"]


@dataclass(frozen=True)
class SweepOptions:
    """`--sweep`, `--sweep-budget`, `--step-time` and `--runs`: whether a sweep was asked for and
    how it searches; its steps and the shape it steps come from each command's own options."""

    mode: str | None = "auto"  # auto: doubling, then refined; double: the powers of two only; None: not given
    budget_s: float = DEFAULT_BUDGET_S  # a doubling sweep refines its answer while it has run less than this
    step_time: float = DEFAULT_STEP_MIN_S  # a closed-loop sweep step sends its mix again until it ran this long
    runs: int = 1  # the whole sweep search this many times

    def when(self, implied: bool) -> SweepOptions | None:
        """These settings if a sweep runs: `--sweep` was given or other options imply one (an
        `auto` sweep then); None if not."""
        if self.mode is not None:
            return self
        return SweepOptions("auto", self.budget_s, self.step_time, self.runs) if implied else None

    def of(self, inner: SweptShape, steps: Sequence[float] = ()) -> Sweep[SweptShape]:
        """The load shape: `inner` run at `steps` (none: doubling from 1) as these settings say."""
        return Sweep(inner, tuple(steps), self.mode != "double", self.budget_s, self.step_time, self.runs)


_Command = TypeVar("_Command", bound=Callable[..., Any])


def sweep_options(sweep_help: str) -> Callable[[_Command], _Command]:
    """`--sweep` (its help the shared meaning plus `sweep_help`), `--sweep-budget`, `--step-time`
    and `--runs`, passed to the command as one `sweep: SweepOptions`."""

    def decorate(command: _Command) -> _Command:
        @functools.wraps(command)
        def gathered(*args: Any, sweep: str | None, sweep_budget: float, step_time: float, runs: int, **kw: Any) -> Any:
            return command(*args, sweep=SweepOptions(sweep, sweep_budget, step_time, runs), **kw)

        options = stacked(
            shared_option("--sweep", sweep_help),
            shared_option("--sweep-budget"),
            shared_option("--step-time"),
            shared_option("--runs"),
        )
        return cast("_Command", options(gathered))

    return decorate
