"""Several load-generator processes (`--workers N`) and several hosts (`--cluster ADDRESS`).

One Python process gives the measuring client one core; past that its own event loop delays
sends and stamps (benchmarks/README.md). Here the schedule of one test is split into disjoint
segments, one per worker process, planned once in this process:

- due times (an open loop, recorded offsets): every due time is computed here, as one process
  would, and the i-th request in due order goes to worker i mod N, so the union of the
  workers' due times is exactly the schedule asked for (the unmeasured ramp is split alike);
- a closed loop of S streams: stream s runs on worker s mod N, with that stream's share of the
  requests (request i belongs to stream i mod S);
- conversation runs (`Sessions`): run i takes slot i mod K (K conversations at once) and slot
  k lives on worker k mod N, so every turn of one conversation is sent by one worker, in order,
  with its think time, and its prompt-cache checks see the whole conversation;
- one request at a time (`Sequential`) and released-together waves stay in this process: they
  are one stream, or must start from one event loop to start together.

Every worker starts its segment at one absolute wall-clock instant chosen here (`start_at`), so
the segments line up as one schedule. Each returns its raw records (`Record`s, pickled whole:
`Record.to_dict` drops the monotonic send time), its schedule-lag samples and the CPU seconds of
its event loop's thread; this process rebases every send time onto its own monotonic clock and
merges them into one `Timed`, so every percentile is computed over the union of the raw records,
never averaged. `workers_section` adds each worker's schedule lag p99 and CPU share to the
group's summary, and names a worker that was the bottleneck (CPU over `BOTTLENECK_CPU` of a
core, or lag p99 over the generator's own `GENERATOR_LAG_S`).

Local workers are `multiprocessing` processes started with `spawn`, each running its segment on
the stack's event loop (`mlxproxy.edge.runner.run_async`). Other hosts are the workers of a Dask
cluster (`dask scheduler` + `dask worker tcp://HOST:8786 --nthreads 1`, the `[cluster]` extra):
the same segments are submitted as tasks, one per worker, and merged the same way
(docs/ARCHITECTURE.md says why Dask). Hosts must keep their clocks in sync (NTP): `start_at` is
wall-clock time.

Ctrl-C (the parent's run cancelled): each local worker gets `stop` on its pipe, each Dask task
sees the run's Dask `Event` set; each cancels its run and sends back the records it had
finished (a partial `SegmentResult`), merged into the parent client's finished records before
the cancel goes on; one that does not answer within `STOP_WAIT_S` is ended. Local workers send
their figures every `REPORT_EVERY_S` for the progress line (`MeasuringClient.elsewhere`).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

from mlxproxy.load.fleet.cluster import MISSING_EXTRA, run_cluster
from mlxproxy.load.fleet.local import run_local
from mlxproxy.load.fleet.merge import FleetTimed, workers_line
from mlxproxy.load.fleet.segment import ClientSpec, Segment, WorkersError
from mlxproxy.load.output.progress import say
from mlxproxy.load.run.client import MeasuringClient, Timed
from mlxproxy.load.run.runner import Plan
from mlxproxy.load.run.shapes import Tick

__all__ = ["Workers", "WorkersError", "cluster_available", "workers_for"]


@dataclass(frozen=True, slots=True)
class Workers:
    """How a test's schedule is spread: `count` worker processes on this host, or the workers
    of the Dask cluster at `cluster` (`count` segments, default: one per cluster worker). A
    `Fleet` the runner sends through (`mlxproxy.load.run.runner.send`)."""

    count: int = 1
    cluster: str | None = None

    @property
    def parallel(self) -> bool:
        return self.count > 1 or self.cluster is not None

    def describe(self) -> str:
        return f"Dask cluster {self.cluster}" if self.cluster else f"{self.count} local processes"

    async def send(self, plan: Plan, client: MeasuringClient, tick: Tick) -> Timed:
        """The parts `plan(n)` gives, each sent by a worker from one shared start, merged."""
        spec = ClientSpec.of(client)

        def segments(n: int) -> list[Segment]:
            return [Segment(k, spec, shape, load) for k, (shape, load) in enumerate(plan(n))]

        return await dispatch(self, segments, client, tick)


def cluster_available() -> bool:
    """Whether the [cluster] extra (Dask's `distributed`) is installed."""
    return importlib.util.find_spec("distributed") is not None


def workers_for(count: int, cluster: str | None) -> Workers:
    """`--workers` and `--cluster` as a `Workers`; WorkersError when the cluster cannot be used."""
    if cluster is not None:
        if not cluster.strip():
            raise WorkersError("--cluster needs the Dask scheduler's address, e.g. tcp://10.0.0.5:8786")
        if not cluster_available():
            raise WorkersError(MISSING_EXTRA)
    return Workers(count, cluster.strip() if cluster else None)


async def dispatch(
    workers: Workers, plan: Callable[[int], list[Segment]], client: MeasuringClient, tick: Tick
) -> FleetTimed:
    """The segments run and merged, their records counted as `client`'s
    (`mlxproxy.load.fleet.parts.gather_parts`, which keeps what the workers had finished when
    the run is cancelled), and one line on the workers (which one was the bottleneck, if any)."""
    if workers.cluster:
        fleet = await run_cluster(workers.cluster, plan, workers.count, client, tick)
    else:
        fleet = await run_local(plan(workers.count), client, tick)
    fleet.cluster = workers.cluster
    say(workers_line(fleet.workers, fleet.cluster))
    return fleet
