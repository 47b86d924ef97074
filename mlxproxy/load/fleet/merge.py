"""The workers' raw records merged into one `Timed` (`FleetTimed`: send times moved onto this
process's clock, every percentile over the union, never averaged), each worker's own figures
and the line that names a worker that was the bottleneck.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from mlxproxy.core.stats import percentile
from mlxproxy.load.data.arrivals import GENERATOR_LAG_S
from mlxproxy.load.data.summary import Summary
from mlxproxy.load.fleet.segment import SegmentResult
from mlxproxy.load.run.client import Timed

__all__ = ["BOTTLENECK_CPU", "FleetTimed", "WorkerFigures", "merge", "workers_line", "workers_section"]

#: a worker whose event loop used more than this share of one core was the bottleneck
BOTTLENECK_CPU = 0.85


@dataclass(frozen=True, slots=True)
class WorkerFigures:
    """One worker's own figures: requests, schedule lag p99, CPU seconds of its event loop's
    thread over its wall time (the share of one core)."""

    index: int
    host: str
    pid: int
    requests: int
    lag_p99_s: float | None
    cpu_s: float
    wall_s: float

    @property
    def cpu_share(self) -> float:
        return self.cpu_s / self.wall_s if self.wall_s > 0 else 0.0

    def problems(self) -> list[str]:
        """Why this worker, not the server, may have been the limit (empty: it was not)."""
        out = []
        if self.cpu_share > BOTTLENECK_CPU:
            out.append(f"CPU {self.cpu_share:.0%} of a core")
        if self.lag_p99_s is not None and self.lag_p99_s > GENERATOR_LAG_S:
            out.append(f"schedule lag p99 {self.lag_p99_s * 1000:.1f} ms over {GENERATOR_LAG_S * 1000:.0f} ms")
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index, "host": self.host, "pid": self.pid, "requests": self.requests,
            "schedule_lag_p99_s": self.lag_p99_s, "cpu_s": round(self.cpu_s, 4), "wall_s": round(self.wall_s, 4),
            "cpu_share": round(self.cpu_share, 4),
        }  # fmt: skip


@dataclass
class FleetTimed(Timed):
    """A `Timed` merged from several workers' segments, with each worker's own figures."""

    workers: tuple[WorkerFigures, ...] = ()
    worker_of: dict[str, int] = field(default_factory=dict)  # record id -> the worker that sent it
    cluster: str | None = None

    def annotate(self, summary: Summary) -> Summary:
        """`summary` with the `workers` section (each worker's lag and CPU)."""
        return workers_section(summary, self)


def merge(results: Sequence[SegmentResult], start_mono: float) -> FleetTimed:
    """The workers' raw records as one `Timed`, in send order, every send time moved onto this
    process's monotonic clock (`start_mono`: its reading at the shared start); lag samples,
    source ids and session keys are the union of the workers'."""
    out = FleetTimed()
    figures = []
    for res in sorted(results, key=lambda r: r.index):
        shift = start_mono - res.start_mono
        out.records.extend(r.evolve(t_start_mono=r.t_start_mono + shift) for r in res.records)
        out.worker_of.update((r.id, res.index) for r in res.records)
        out.lag_s.extend(res.lag_s)
        out.lag_by_id.update(res.lag_by_id)
        out.source_ids.update(res.source_ids)
        out.where.update(res.where)
        out.session_s.extend(res.session_s)
        p99 = percentile(sorted(res.lag_s), 99) if res.lag_s else None
        figures.append(WorkerFigures(res.index, res.host, res.pid, len(res.records), p99, res.cpu_s, res.wall_s))
    out.records.sort(key=lambda r: r.t_start_mono)
    out.workers = tuple(figures)
    return out


def workers_line(figures: Sequence[WorkerFigures], cluster: str | None = None) -> str:
    """One line: each worker's schedule lag p99 and CPU share; which was the bottleneck."""
    where = f" on the Dask cluster {cluster}" if cluster else ""
    each = ", ".join(
        f"{w.index}: {w.requests} req, lag p99 "
        + ("-" if w.lag_p99_s is None else f"{w.lag_p99_s * 1000:.1f} ms")
        + f", CPU {w.cpu_share:.0%}"
        for w in figures
    )
    head = f"{len(figures)} load worker{'' if len(figures) == 1 else 's'}{where} ({each})"
    slow = [w for w in figures if w.problems()]
    if not slow:
        return head
    said = "; ".join(f"worker {w.index} ({w.host}): {'; '.join(w.problems())}" for w in slow)
    if any(w.cpu_share > BOTTLENECK_CPU for w in slow):
        hint = "add workers or hosts"
    else:  # late without using its core: it waited for one
        hint = "it was late without using its core, so its host had none free: send from more hosts"
    return f"{head}: a load worker was the bottleneck, {said}: {hint}"


def workers_section(summary: Summary, timed: FleetTimed) -> Summary:
    """`summary` with the `workers` section (each worker's lag and CPU), when any worker answered."""
    if not timed.workers:
        return summary
    slow = [w for w in timed.workers if w.problems()]
    return summary.updated(
        {
            "workers": {
                "count": len(timed.workers),
                "cluster": timed.cluster,
                "per_worker": [w.to_dict() for w in timed.workers],
                "bottleneck": workers_line(timed.workers, timed.cluster) if slow else None,
            }
        }
    )
