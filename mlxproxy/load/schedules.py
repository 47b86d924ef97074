"""The names `mlxproxy.load.schedules` used to hold, kept for code that imports them from
here: arrival schedules are in `mlxproxy.load.data.arrivals`, SLOs, goodput and `--fail-on` in
`mlxproxy.load.judge.slo`, sweeps' capacity and its verdict in `mlxproxy.load.judge.capacity`."""

from __future__ import annotations

from mlxproxy.load.data.arrivals import (
    ARRIVALS,
    GENERATOR_LAG_S,
    arrival_offsets,
    generator_note,
    ramp_offsets,
    schedule,
    sent_rate,
)
from mlxproxy.load.judge.capacity import (
    MAX_AUTO_CONCURRENCY,
    MIN_PER_STREAM,
    MIN_STEP_REQUESTS,
    RATE_UNIT,
    capacity_line,
    capacity_of,
    result_file,
    step_figures,
    step_label,
    stop_reason,
    sweep_charts,
)
from mlxproxy.load.judge.slo import (
    DEFAULT_SLO,
    SLO_METRICS,
    failed_checks,
    fmt_value,
    judge,
    parse_fail_on,
    parse_slo,
    slo_text,
    step_problem,
)

__all__ = [
    "ARRIVALS",
    "arrival_offsets",
    "ramp_offsets",
    "GENERATOR_LAG_S",
    "generator_note",
    "sent_rate",
    "schedule",
    "SLO_METRICS",
    "DEFAULT_SLO",
    "parse_slo",
    "slo_text",
    "fmt_value",
    "judge",
    "step_problem",
    "parse_fail_on",
    "failed_checks",
    "step_figures",
    "stop_reason",
    "capacity_of",
    "result_file",
    "capacity_line",
    "sweep_charts",
    "step_label",
    "RATE_UNIT",
    "MAX_AUTO_CONCURRENCY",
    "MIN_PER_STREAM",
    "MIN_STEP_REQUESTS",
]
