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

import asyncio
import dataclasses
import importlib.util
import multiprocessing
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.context import SpawnProcess
from typing import Any, Literal

from mlxproxy.core.cachecheck import PrefixIndex
from mlxproxy.core.detect import Thresholds
from mlxproxy.core.record import Record
from mlxproxy.core.stats import percentile
from mlxproxy.edge.runner import run_async
from mlxproxy.load.arrivals import GENERATOR_LAG_S, arrival_offsets, ramp_offsets
from mlxproxy.load.capacity import MIN_PER_STREAM
from mlxproxy.load.client import MeasuringClient, PreparedRequest, Timed
from mlxproxy.load.progress import say
from mlxproxy.load.results import SessionTurn, Summary
from mlxproxy.load.shapes import ClosedLoop, OpenLoop, Recorded, Sequential, Sessions, TimedShape, Turn
from mlxproxy.load.sweep import StepRun, mix_copies

__all__ = [
    "BOTTLENECK_CPU",
    "ONE_PROCESS",
    "WorkersError",
    "closed_loop_step",
    "open_loop_step",
    "cluster_available",
    "workers_for",
    "FleetTimed",
    "Segment",
    "SegmentResult",
    "WorkerFigures",
    "Workers",
    "merge",
    "plan_closed",
    "plan_due",
    "plan_sessions",
    "run_segment",
    "run_sessions",
    "run_shape",
    "workers_section",
]

#: a worker whose event loop used more than this share of one core was the bottleneck
BOTTLENECK_CPU = 0.85
#: seconds between the workers being ready and the shared start (local processes, a cluster)
LOCAL_LEAD_S = 0.25
CLUSTER_LEAD_S = 1.0
#: seconds a run waits for a cluster's first worker
CLUSTER_WAIT_S = 10.0
#: seconds between a local worker's progress reports (its figures; never one per request)
REPORT_EVERY_S = 0.5
#: seconds a local worker has to send back what it measured after a Ctrl-C, before it is ended
STOP_WAIT_S = 5.0

MISSING_EXTRA = "--cluster needs Dask: pip install 'mlxproxy[cluster]'"

SegmentKind = Literal["due", "closed", "sessions"]
Where = dict[str, SessionTurn]


class WorkersError(RuntimeError):
    """The segments cannot run: the [cluster] extra is missing, no scheduler or no workers
    answer, a worker failed. Its message is one line for the command line."""


@dataclass(frozen=True, slots=True)
class Workers:
    """How a test's schedule is spread: `count` worker processes on this host, or the workers
    of the Dask cluster at `cluster` (`count` segments, default: one per cluster worker)."""

    count: int = 1
    cluster: str | None = None

    @property
    def parallel(self) -> bool:
        return self.count > 1 or self.cluster is not None

    def describe(self) -> str:
        return f"Dask cluster {self.cluster}" if self.cluster else f"{self.count} local processes"


#: the default: everything sent from this process
ONE_PROCESS = Workers()


@dataclass(frozen=True, slots=True)
class ClientSpec:
    """What a worker needs to build its own measuring client like the parent's."""

    base_url: str
    name: str
    thresholds: Thresholds
    api_key: str | None
    timeout_s: float
    connect_timeout_s: float
    tag_replay: bool
    keep_text: bool
    prefixes: bool
    max_connections: int | None = None

    @classmethod
    def of(cls, c: MeasuringClient) -> ClientSpec:
        return cls(
            c.base_url, c.name, c.th, c.api_key, c.timeout_s, c.connect_timeout_s, c.tag_replay, c.keep_text,
            c.prefixes is not None, c.max_connections,
        )  # fmt: skip

    def client(self) -> MeasuringClient:
        c = MeasuringClient(
            self.base_url, name=self.name, thresholds=self.thresholds, api_key=self.api_key,
            timeout_s=self.timeout_s, connect_timeout_s=self.connect_timeout_s, tag_replay=self.tag_replay,
            keep_text=self.keep_text, max_connections=self.max_connections,
        )  # fmt: skip
        if self.prefixes:
            c.prefixes = PrefixIndex()
        return c


@dataclass(frozen=True, slots=True)
class Segment:
    """One worker's part of a test. `due`: `requests` (and the unmeasured `ramp`) each sent at
    its `offset_s` seconds after the start; `closed`: `requests` on `streams` streams; `sessions`:
    `runs` (numbered `run_ids` in the whole test), `streams` of them at once."""

    index: int
    client: ClientSpec
    kind: SegmentKind
    requests: tuple[PreparedRequest, ...] = ()
    ramp: tuple[PreparedRequest, ...] = ()
    streams: int = 1
    runs: tuple[tuple[Turn, ...], ...] = ()
    run_ids: tuple[int, ...] = ()
    start_at: float = 0.0  # wall clock (time.time()) of the schedule's 0, the same in every segment


@dataclass(frozen=True, slots=True)
class SegmentResult:
    """What a worker sends back: its raw records (send times on its own monotonic clock, whose
    reading at the shared start is `start_mono`), lag samples, session keys, CPU and wall time."""

    index: int
    host: str
    pid: int
    records: tuple[Record, ...]
    start_mono: float
    lag_s: tuple[float, ...]
    lag_by_id: Mapping[str, float]
    source_ids: Mapping[str, str | None]
    where: Mapping[str, SessionTurn]
    session_s: tuple[float, ...]
    cpu_s: float
    wall_s: float


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

    def annotate(self, summary: Summary) -> Summary:
        """`summary` with the `workers` section (each worker's lag and CPU)."""
        return workers_section(summary, self)

    worker_of: dict[str, int] = field(default_factory=dict)  # record id -> the worker that sent it
    where: Where = field(default_factory=dict)
    session_s: list[float] = field(default_factory=list)
    cluster: str | None = None


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


# -- planning (pure) ---------------------------------------------------------------------------


def plan_due(reqs: Sequence[PreparedRequest], n: int) -> list[list[PreparedRequest]]:
    """Requests with due times (`offset_s`) dealt round-robin in due order over `n` workers."""
    ordered = sorted(reqs, key=lambda r: r.offset_s)
    return [ordered[k::n] for k in range(n)]


def plan_closed(reqs: Sequence[PreparedRequest], streams: int, n: int) -> list[tuple[int, list[PreparedRequest]]]:
    """A closed loop of `streams` split over `n` workers: (its streams, its requests) each;
    stream s on worker s mod n, request i on stream i mod streams. Workers without a stream
    are left out."""
    streams = max(1, streams)
    out = []
    for k in range(min(n, streams)):
        mine = set(range(k, streams, n))
        out.append((len(mine), [r for i, r in enumerate(reqs) if i % streams in mine]))
    return out


def plan_sessions(
    runs: Sequence[Sequence[Turn]], at_once: int, n: int
) -> list[tuple[int, list[Sequence[Turn]], list[int]]]:
    """Conversation runs over `n` workers: (conversations at once, its runs, their numbers)
    each; run i in slot i mod at_once, slot k on worker k mod n: a conversation never moves."""
    at_once = max(1, at_once)
    out = []
    for k in range(min(n, at_once)):
        slots = set(range(k, at_once, n))
        ids = [i for i in range(len(runs)) if i % at_once in slots]
        out.append((len(slots), [runs[i] for i in ids], ids))
    return out


def _due_offsets(
    shape: OpenLoop | Recorded, reqs: Sequence[PreparedRequest], ramp: Sequence[PreparedRequest]
) -> tuple[list[PreparedRequest], list[PreparedRequest]]:
    """The measured requests and the ramp's, each with its due time from the start as
    `offset_s`, exactly as the shape would send them from one process."""
    if isinstance(shape, Recorded):
        first = min((r.offset_s for r in reqs), default=0.0)
        return [dataclasses.replace(r, offset_s=(r.offset_s - first) / shape.speed) for r in reqs], []
    offsets = arrival_offsets(len(reqs), shape.rate, shape.arrival, shape.seed)
    ramp_at = ramp_offsets(shape.rate, shape.ramp_s, shape.arrival, shape.seed)
    after = shape.ramp_s if ramp and ramp_at else 0.0
    warm = [dataclasses.replace(r, offset_s=o) for r, o in zip(ramp, ramp_at)] if after else []
    return [dataclasses.replace(r, offset_s=after + o) for r, o in zip(reqs, offsets)], warm


# -- a worker ----------------------------------------------------------------------------------


def run_segment(seg: Segment, start_at: float | None = None, stop_event: str | None = None) -> SegmentResult:
    """Run one segment on this process's stack event loop (in a worker process or a Dask task),
    from `start_at` when given (the segment itself was handed over earlier). `stop_event`: the
    name of a Dask `Event` (in a Dask task) whose setting stops the run; the result then holds
    the records finished before the stop."""
    seg = seg if start_at is None else dataclasses.replace(seg, start_at=start_at)
    if stop_event is None:
        return run_async(_run_segment(seg))
    from distributed import Event, get_client  # the optional [cluster] extra, there in a Dask task

    # the worker's client, got in the task's own thread (where Dask knows the task's worker)
    return run_async(_run_until_event(seg, Event(stop_event, client=get_client())))


async def _run_until_event(seg: Segment, event: Any) -> SegmentResult:
    """A Dask task's run of its segment, polling the Dask `Event` `event` every
    `REPORT_EVERY_S` (the parent sets it on Ctrl-C): once set, the run is cancelled and the
    result is the records finished so far."""
    measured = _Measured()
    task = asyncio.ensure_future(_run_segment(seg, measured))
    try:
        while not task.done():
            await asyncio.wait([task], timeout=REPORT_EVERY_S)
            if not task.done() and await asyncio.to_thread(event.is_set):
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    return measured.partial(seg)
        return task.result()
    finally:
        task.cancel()


async def _sleep_until(t: float) -> None:
    while (delay := t - time.perf_counter()) > 0.001:
        await asyncio.sleep(delay)


class _Measured:
    """The records a segment's run has finished so far, as its shape counts them (the ramp's
    requests are not counted): each tick takes the client's newest record, since every shape
    counts a request right after `MeasuringClient.send` appended its record, with no await
    between. What a stopped worker sends back, and what its progress reports count."""

    def __init__(self) -> None:
        self.client: MeasuringClient | None = None
        self.records: list[Record] = []
        self.start_mono = 0.0
        self.cpu0 = 0.0

    def __call__(self) -> None:
        if self.client is not None:
            self.records.append(self.client.finished[-1])

    def figures(self) -> tuple[int, int, int]:
        """(finished, in flight, tokens received) for the parent's progress line."""
        c = self.client
        return (len(self.records), c.in_flight, c.tokens_received()) if c is not None else (0, 0, 0)

    def partial(self, seg: Segment) -> SegmentResult:
        """The records finished before the stop (the requests in flight are not records)."""
        return SegmentResult(
            seg.index, socket.gethostname(), os.getpid(), tuple(self.records), self.start_mono, (), {}, {}, {}, (),
            time.thread_time() - self.cpu0, time.perf_counter() - self.start_mono,
        )  # fmt: skip


async def _run_segment(seg: Segment, measured: _Measured | None = None) -> SegmentResult:
    start_mono = time.perf_counter() + (seg.start_at - time.time())
    where: Where = {}
    session_s: list[float] = []
    m = measured if measured is not None else _Measured()
    async with seg.client.client() as client:
        cpu0 = time.thread_time()
        m.client, m.start_mono, m.cpu0 = client, start_mono, cpu0
        if seg.kind == "due":
            run = client.run_recorded(seg.requests, 1.0, m, start=start_mono)
            if seg.ramp:
                _, timed = await asyncio.gather(client.run_recorded(seg.ramp, 1.0, start=start_mono), run)
            else:
                timed = await run
        else:
            await _sleep_until(start_mono)
            if seg.kind == "closed":
                timed = await ClosedLoop(seg.streams).run(client, seg.requests, m)
            else:
                timed, where, session_s = await Sessions(seg.streams).run_sessions(client, seg.runs, m)
        cpu_s, wall_s = time.thread_time() - cpu0, time.perf_counter() - start_mono
    # each conversation run's number in the whole test
    where = {k: dataclasses.replace(w, session=seg.run_ids[w.session]) for k, w in where.items()}
    return SegmentResult(
        seg.index, socket.gethostname(), os.getpid(), tuple(timed.records), start_mono, tuple(timed.lag_s),
        timed.lag_by_id, timed.source_ids, where, tuple(session_s), cpu_s, wall_s,
    )  # fmt: skip


async def _run_stoppable(seg: Segment, conn: Connection) -> tuple[str, SegmentResult]:
    """A local worker's run of its segment: its figures reported to the parent every
    `REPORT_EVERY_S`, and a `stop` from the parent (Ctrl-C there), or the parent gone, cancels
    the run: ("done", the whole result) or ("stopped", the records finished before the stop)."""
    loop = asyncio.get_running_loop()
    measured = _Measured()
    task = asyncio.ensure_future(_run_segment(seg, measured))

    def watch() -> None:  # the pipe's only reader from now on
        try:
            conn.recv()  # "stop"
        except (EOFError, OSError):
            pass  # the parent is gone: stop too
        try:
            loop.call_soon_threadsafe(task.cancel)
        except RuntimeError:  # the run is over, its loop closed
            pass

    async def report() -> None:
        while True:
            await asyncio.sleep(REPORT_EVERY_S)
            try:
                conn.send(("count", measured.figures()))
            except OSError:  # the parent is gone (the watcher stops the run)
                return

    threading.Thread(target=watch, name="mlxproxy-load-stop", daemon=True).start()
    reporter = asyncio.ensure_future(report())
    try:
        return "done", await task
    except asyncio.CancelledError:
        if not task.cancelled():
            raise
        return "stopped", measured.partial(seg)
    finally:
        reporter.cancel()


# -- running the segments ----------------------------------------------------------------------


def _serve(conn: Connection) -> None:
    """A local worker process: its segment, ready once that and the imports are in, then the
    shared start, its result, exit. Ctrl-C is the parent's to handle: it sends `stop`, and the
    worker sends back what it has measured so far (`_run_stoppable`)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _warm()
    seg = conn.recv()
    conn.send(("ready", os.getpid()))
    start_at = conn.recv()
    try:
        conn.send(run_async(_run_stoppable(dataclasses.replace(seg, start_at=start_at), conn)))
    except BaseException as exc:  # a worker's failure is one line in the parent
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        conn.close()


class _Link:
    """The parent's end of one local worker's pipe: one thread reads it (a read cancelled in
    the event loop would go on in its thread and swallow the next message), keeps the latest
    progress figures and hands every other message to the loop."""

    def __init__(self, conn: Connection, index: int, loop: asyncio.AbstractEventLoop) -> None:
        self.conn, self.index, self.loop = conn, index, loop
        self.figures = (0, 0, 0)  # finished, in flight, tokens received: the worker's latest report
        self.messages: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        threading.Thread(target=self._read, name=f"mlxproxy-load-link-{index}", daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                what, value = self.conn.recv()
            except (EOFError, OSError):
                what, value = "eof", None
            if what == "count":
                self.figures = value
                continue
            try:
                self.loop.call_soon_threadsafe(self.messages.put_nowait, (what, value))
            except RuntimeError:  # the parent's loop is closed
                return
            if what != "ready":
                return

    async def receive(self, *expected: str) -> Any:
        """The next message's value, one of `expected`; WorkersError for an error or none."""
        what, value = await self.messages.get()
        if what == "eof":
            raise WorkersError(f"load worker {self.index} exited without a result")
        if what == "error":
            raise WorkersError(f"load worker {self.index} failed: {value}")
        if what not in expected:
            raise WorkersError(f"load worker {self.index} sent {what!r}, not {' or '.join(expected)}")
        return value


async def _stop(
    links: Sequence[_Link], results: Sequence[asyncio.Future[Any]], procs: Sequence[SpawnProcess]
) -> list[SegmentResult]:
    """Ctrl-C in a run of local workers: each still running is told to stop and sends back the
    records it had finished (`results`: each worker's answer, whole or stopped); one that does
    not answer within `STOP_WAIT_S` is terminated, said in one line."""
    for link, res in zip(links, results):
        if not res.done():
            try:
                link.conn.send("stop")
            except OSError:  # it has just exited (its result, or an error, is on the way)
                pass
    await asyncio.wait(results, timeout=STOP_WAIT_S)
    kept: list[SegmentResult] = []
    for link, res, p in zip(links, results, procs):
        if not res.done() or res.cancelled():
            res.cancel()
            p.terminate()
            say(f"load worker {link.index} did not stop within {STOP_WAIT_S:g} s: terminated, its requests are lost")
        elif res.exception() is not None:
            say(str(res.exception()))
        else:
            kept.append(res.result())
    return kept


async def _run_local(
    segments: Sequence[Segment], client: MeasuringClient, keep: Callable[[list[SegmentResult], float], None]
) -> tuple[list[SegmentResult], float]:
    """Each segment in a process of its own (started with `spawn`: no fork of a process that
    runs an event loop), all started at one instant once every segment is in its process (a
    segment of 30,000 requests takes a while to pickle and unpickle: not inside the schedule).
    Meanwhile `client.elsewhere` sums the workers' progress reports; when the run is cancelled
    (Ctrl-C) after the start, the workers stop and `keep` gets the records they had finished
    (before the start: nothing was sent, the workers are ended)."""
    ctx = multiprocessing.get_context("spawn")
    loop = asyncio.get_running_loop()
    procs: list[SpawnProcess] = []
    links: list[_Link] = []
    results: list[asyncio.Future[Any]] = []

    def figures() -> tuple[int, int, int]:
        done, flying, tokens = (sum(f) for f in zip(*(k.figures for k in links)))
        return done, flying, tokens

    try:
        for seg in segments:
            mine, theirs = ctx.Pipe()
            p = ctx.Process(target=_serve, args=(theirs,), name=f"mlxproxy-load-{seg.index}", daemon=True)
            p.start()
            theirs.close()
            procs.append(p)
            links.append(_Link(mine, len(links), loop))
        # off the loop: a pipe takes a big segment only as fast as its process reads it
        await asyncio.gather(*(asyncio.to_thread(k.conn.send, seg) for k, seg in zip(links, segments)))
        await asyncio.gather(*(k.receive("ready") for k in links))
        start_at = time.time() + LOCAL_LEAD_S
        for k in links:
            k.conn.send(start_at)
        client.elsewhere = figures
        # each worker's answer a task of its own, so that a Ctrl-C (which cancels only this
        # wait) loses none already received
        results = [asyncio.ensure_future(k.receive("done", "stopped")) for k in links]
        try:
            await asyncio.wait(results, return_when=asyncio.FIRST_EXCEPTION)
        except asyncio.CancelledError:
            client.elsewhere = None
            keep(await _stop(links, results, procs), start_at)
            raise
        for r in results:
            if r.done() and (exc := r.exception()) is not None:
                raise exc  # a worker's failure: one line
        return [r.result() for r in results], start_at
    finally:
        client.elsewhere = None
        for r in results:
            r.cancel()
        for p in procs:
            if p.is_alive():
                p.terminate()
            p.join(5)
        for k in links:
            k.conn.close()


def _warm() -> int:
    """Run in every worker before the start is chosen, so that importing the package and the
    event loop's modules is not in the schedule."""
    run_async(asyncio.sleep(0))
    return os.getpid()


async def _run_cluster(
    address: str,
    plan: Callable[[int], list[Segment]],
    count: int,
    keep: Callable[[list[SegmentResult], float], None],
) -> tuple[list[SegmentResult], float]:
    """The segments as tasks on a Dask cluster, one per worker (round-robin when more segments
    than workers), through Dask's asynchronous client on this event loop. A cancelled run
    (Ctrl-C) after the start sets the run's Dask `Event`: each task stops and returns the
    records it had finished, which `keep` gets; a task that has not within `STOP_WAIT_S` is
    cancelled, said in one line."""
    try:
        from distributed import Client, Event  # the optional [cluster] extra
    except ImportError:
        raise WorkersError(MISSING_EXTRA) from None
    try:
        dc = await Client(address, asynchronous=True, timeout=10, set_as_default=False)
    except (OSError, TimeoutError) as exc:
        raise WorkersError(f"cannot reach the Dask scheduler at {address}: {exc}") from None
    futures: list[Any] = []
    try:
        try:
            await dc.wait_for_workers(1, timeout=CLUSTER_WAIT_S)
        except TimeoutError:
            raise WorkersError(f"the Dask scheduler at {address} has no workers") from None
        hosts = sorted(await dc.nthreads())
        segments = plan(count if count > 1 else len(hosts))
        where = [hosts[i % len(hosts)] for i in range(len(segments))]
        # in each worker's task thread, as the segments will run (`Client.run` would run it on
        # the worker's own event loop); each segment sent to its worker (`scatter` returns once
        # it is there) before the start is chosen
        await dc.gather([dc.submit(_warm, workers=[h], allow_other_workers=False, pure=False) for h in hosts])
        data = [await dc.scatter(s, workers=[h], broadcast=False, hash=False) for s, h in zip(segments, where)]
        start_at = time.time() + CLUSTER_LEAD_S
        tag = uuid.uuid4().hex[:8]
        stop = f"mlxproxy-stop-{tag}"
        futures = [
            dc.submit(
                run_segment,
                seg,
                start_at,
                stop,
                key=f"mlxproxy-segment-{tag}-{i}",
                workers=[where[i]],
                allow_other_workers=False,
                pure=False,
            )
            for i, seg in enumerate(data)
        ]
        try:
            return list(await dc.gather(futures)), start_at
        except asyncio.CancelledError:
            event = Event(stop, client=dc)
            # bounded: a scheduler that does not answer leaves the tasks to be cancelled below
            await asyncio.wait([asyncio.ensure_future(event.set())], timeout=STOP_WAIT_S)
            answers = [asyncio.ensure_future(dc.gather(f)) for f in futures]
            await asyncio.wait(answers, timeout=STOP_WAIT_S)
            kept = []
            for i, a in enumerate(answers):
                if not a.done() or a.cancelled():
                    a.cancel()
                    say(
                        f"load worker {i} ({where[i]}) did not stop within {STOP_WAIT_S:g} s: cancelled, its requests are lost"
                    )
                elif a.exception() is not None:
                    say(f"load worker {i} ({where[i]}) failed: {a.exception()}")
                else:
                    kept.append(a.result())
            await asyncio.wait([asyncio.ensure_future(event.clear())], timeout=STOP_WAIT_S)  # the scheduler forgets it
            keep(kept, start_at)
            raise
    finally:
        if futures:
            await dc.cancel(futures)
        await dc.close()


async def _dispatch(
    workers: Workers, plan: Callable[[int], list[Segment]], client: MeasuringClient, tick: Callable[[], None] | None
) -> FleetTimed:
    """The segments run and merged, their records counted as `client`'s (`_finish`); a run
    cancelled (Ctrl-C) counts the records its workers had finished, then ends as cancelled."""

    def keep(partial: list[SegmentResult], start_at: float) -> None:
        fleet = merge(partial, time.perf_counter() + (start_at - time.time()))
        client.finished.extend(fleet.records)
        n, k = len(fleet.records), len(partial)
        say(f"Ctrl-C: {n} finished request{'' if n == 1 else 's'} kept from {k} load worker{'' if k == 1 else 's'}")

    if workers.cluster:
        results, start_at = await _run_cluster(workers.cluster, plan, workers.count, keep)
    else:
        results, start_at = await _run_local(plan(workers.count), client, keep)
    fleet = merge(results, time.perf_counter() + (start_at - time.time()))
    fleet.cluster = workers.cluster
    return _finish(client, fleet, tick)


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


def _finish(client: MeasuringClient, fleet: FleetTimed, tick: Callable[[], None] | None) -> FleetTimed:
    """The merged records counted as the parent client's (progress, an interrupted run), and
    one line on the workers (which one was the bottleneck, if any)."""
    client.finished.extend(fleet.records)
    if tick:
        for _ in fleet.records:
            tick()
    say(workers_line(fleet.workers, fleet.cluster))
    return fleet


async def run_shape(
    workers: Workers,
    shape: TimedShape,
    client: MeasuringClient,
    reqs: Sequence[PreparedRequest],
    tick: Callable[[], None] | None = None,
    ramp: Sequence[PreparedRequest] = (),
) -> Timed:
    """`shape.run` on `workers`: the same requests, due times or streams, split into segments
    (one request at a time stays in this process: it is one stream)."""
    if not workers.parallel or isinstance(shape, Sequential):
        if isinstance(shape, OpenLoop):
            return await shape.run(client, reqs, tick, ramp)
        return await shape.run(client, reqs, tick)
    spec = ClientSpec.of(client)
    if isinstance(shape, ClosedLoop):

        def plan(n: int) -> list[Segment]:
            parts = plan_closed(reqs, shape.streams, n)
            return [Segment(k, spec, "closed", tuple(rs), streams=s) for k, (s, rs) in enumerate(parts)]

    else:
        measured, warm = _due_offsets(shape, reqs, ramp)

        def plan(n: int) -> list[Segment]:
            return [
                Segment(k, spec, "due", tuple(m), tuple(w))
                for k, (m, w) in enumerate(zip(plan_due(measured, n), plan_due(warm, n)))
            ]

    return await _dispatch(workers, plan, client, tick)


async def run_sessions(
    workers: Workers,
    shape: Sessions,
    client: MeasuringClient,
    runs: Sequence[Sequence[Turn]],
    tick: Callable[[], None] | None = None,
) -> tuple[Timed, Where, list[float]]:
    """`shape.run_sessions` on `workers`: each conversation run whole on one worker."""
    if not workers.parallel:
        return await shape.run_sessions(client, runs, tick)
    spec = ClientSpec.of(client)

    def plan(n: int) -> list[Segment]:
        return [
            Segment(k, spec, "sessions", streams=s, runs=tuple(tuple(r) for r in rs), run_ids=tuple(ids))
            for k, (s, rs, ids) in enumerate(plan_sessions(runs, shape.at_once, n))
        ]

    fleet = await _dispatch(workers, plan, client, tick)
    return fleet, fleet.where, fleet.session_s


# -- reporting ---------------------------------------------------------------------------------


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


def workers_section(summary: Summary, timed: Timed) -> Summary:
    """`summary` with the `workers` section when `timed` came from several workers."""
    if not isinstance(timed, FleetTimed) or not timed.workers:
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


def open_loop_step(
    client: MeasuringClient,
    make: Callable[[int], list[PreparedRequest]],
    n: int,
    workers: Workers = ONE_PROCESS,
) -> Callable[[OpenLoop], Awaitable[StepRun]]:
    """A sweep step of the `n` requests `make(n)` returns (the same at every rate), sent in
    the step's open loop (after its unmeasured ramp, if it has one), from `workers`."""

    async def step(shape: OpenLoop) -> StepRun:
        return await run_shape(workers, shape, client, make(n), None, make(shape.ramp_size())), {}

    return step


def closed_loop_step(
    client: MeasuringClient,
    make: Callable[[int], list[PreparedRequest]],
    mix_size: int,
    per_stream: int = 1,
    workers: Workers = ONE_PROCESS,
) -> Callable[[ClosedLoop], Awaitable[StepRun]]:
    """A sweep step of the step's streams sending whole copies of a mix (`make(k)`: k copies
    of the mix's `mix_size` requests, in order), `mix_copies` of them, from `workers`."""

    async def step(shape: ClosedLoop) -> StepRun:
        copies = mix_copies(shape.streams, mix_size, max(per_stream, MIN_PER_STREAM))
        return await run_shape(workers, shape, client, make(copies)), {}

    return step
