"""`mlxproxy bench`: compare servers the way the 2026 MLX benchmark did.

Per target: one request at a time at each prompt size (`single`), then rounds of waves of two
identical-size requests released together (`double`), optionally waves of N for a
concurrency curve, each round between two requests alone (`baseline`); every test repeated
and summarised by medians. Each request is metered by the shared core and checked by the
truth checks; a verdict names what was found, the batching part judged wave by wave
(`wave_class`, `batching_verdict`).

The options are read once, at the top (`bench_plan`): they become the prompts every request is
built from (`bench_requests.Prompts`, calibrated per target) and the tests in the order they
run, one small frozen class per test carrying only its own fields (its shape, prompt size,
counts, SLO and fleet). A target's run calibrates its prompts, then runs each test in turn.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic

from mlxproxy.core.detect import Thresholds
from mlxproxy.core.record import Record
from mlxproxy.load.commands.bench_groups import bench_group, single_groups, wave_groups
from mlxproxy.load.commands.bench_requests import Prompts, TargetPrompts, calibrated
from mlxproxy.load.commands.common import SweepsOnTarget, client_for, requests_text
from mlxproxy.load.commands.sweep_options import SweepOptions
from mlxproxy.load.data.results import Group
from mlxproxy.load.data.summary import JSONObject, JSONValue
from mlxproxy.load.data.targets import Target, TargetResult
from mlxproxy.load.fleet.threads import streams_fleet
from mlxproxy.load.judge.slo import DEFAULT_SLO, parse_slo
from mlxproxy.load.output.progress import Progress
from mlxproxy.load.output.report import summarize_records
from mlxproxy.load.run.client import MeasuringClient, Timed
from mlxproxy.load.run.runner import ONE_PROCESS, Fleet, closed_loop_step, open_loop_step, send
from mlxproxy.load.run.shapes import ClosedLoop, Load, OpenLoop, Sequential, Sweep, SweptShape, Waves

__all__ = ["BenchOptions", "BenchPlan", "DEFAULT_SIZES", "bench_one", "bench_plan", "bench_targets"]

DEFAULT_SIZES = (100, 500, 1000, 2000, 4000, 8000, 16000, 53000)


@dataclass(frozen=True)
class BenchOptions:
    """bench's options as the command takes them; `bench_plan` types them, the one place they are read."""

    prompt_tokens: tuple[int, ...] = DEFAULT_SIZES
    max_tokens: int = 128
    repeat: int = 5
    batch: int = 2
    batch_prompt_tokens: int | None = None  # default: the smallest size
    batches: tuple[int, ...] = ()  # wave sizes released together; default (batch,)
    model: str | None = None
    api: str = "chat"  # "chat" (/v1/chat/completions) or "ollama" (Ollama's native /api/chat)
    nonce: bool = True
    rate: float | None = None  # an open-loop test at this many requests/s (after the others)
    arrival: str = "constant"
    seed: int = 0
    requests: int = 50  # requests of the open-loop test (of each step of a rate sweep)
    rate_steps: tuple[float, ...] = ()  # a sweep of open-loop rates instead of the one --rate test
    ramp_s: float = 0.0  # an unmeasured ramp up to the rate before each open-loop test
    sweep: SweepOptions | None = None  # closed-loop steps of growing concurrency at the batch prompt size
    sweep_steps: tuple[int, ...] = ()  # the steps; () doubles from 1 until saturation
    slo: dict[str, float] | None = None  # the sweep's SLO (default: mlxproxy.load.DEFAULT_SLO)
    workers: Fleet = ONE_PROCESS  # the processes or cluster the open-loop and sweep tests send from


@dataclass(frozen=True)
class OnTarget(SweepsOnTarget):
    """One target's run as its tests see it, once its prompts are calibrated: the client, the
    result the groups go to, the prompts and the groups' params."""

    client: MeasuringClient
    res: TargetResult
    prompts: TargetPrompts
    params: JSONObject
    th: Thresholds
    say: Callable[[str], None] | None

    def sweep_into(self) -> tuple[str, list[Group]]:
        return self.res.target.name, self.res.groups


class BenchTest:
    """One of bench's tests, typed by its shape: how many requests the progress line counts on
    and how it runs against one target."""

    def total(self) -> int:
        return 0  # (a sweep's are not known in advance)

    async def run(self, on: OnTarget, tick: Progress) -> None:
        raise NotImplementedError


@dataclass(frozen=True)
class Singles(BenchTest):
    """One request at a time at each prompt size, sizes interleaved so slow drift does not bias
    one size, `repeat` times (`single`, `single N`); when cancelled, the groups of what finished."""

    sizes: tuple[int, ...]
    repeat: int

    def total(self) -> int:
        return len(self.sizes) * self.repeat

    async def run(self, on: OnTarget, tick: Progress) -> None:
        reqs = [
            on.prompts.request(size, f"single:{size}", f"{size}") for _ in range(self.repeat) for size in self.sizes
        ]
        start, single = len(on.client.finished), Timed()
        try:
            single = await send(Sequential(), Load(reqs), on.client, tick=tick)
        except asyncio.CancelledError:  # the requests finished so far, in order
            for req, r in zip(reqs, on.client.finished[start:]):
                single.add(r, req.source_id)
            raise
        finally:
            single_groups(on.res, single, list(self.sizes), on.params, on.th)


@dataclass(frozen=True)
class WaveRounds(BenchTest):
    """`repeat` rounds of one wave of each size released together, each round between two
    requests alone at the same prompt size (`baseline`, `double`, `xN`)."""

    sizes: tuple[int, ...]
    prompt_tokens: int
    repeat: int

    def total(self) -> int:
        return sum(n * self.repeat for n in self.sizes) + self.repeat + 1

    async def run(self, on: OnTarget, tick: Progress) -> None:
        await _measure_waves(on, self, tick)


@dataclass(frozen=True)
class SweepTest(BenchTest, Generic[SweptShape]):
    """A sweep of one shape at a prompt size, judged against `slo` as it goes, from `fleet`."""

    sweep: Sweep[SweptShape]
    prompt_tokens: int
    slo: dict[str, float]
    fleet: Fleet = ONE_PROCESS


@dataclass(frozen=True)
class StreamsSweep(SweepTest[ClosedLoop]):
    """Closed-loop streams at growing counts, each stream sending `per_stream` requests."""

    per_stream: int = field(kw_only=True)

    @property
    def sender(self) -> Fleet:
        """Where the streams are sent from: the workers or cluster given, else a thread each."""
        return streams_fleet(self.fleet)

    async def run(self, on: OnTarget, tick: Progress) -> None:
        size = self.prompt_tokens
        step = closed_loop_step(
            on.client, lambda n: on.prompts.requests(n, size, "sweep"), 1, self.per_stream, self.sender
        )
        await on.sweep(self.sweep, self.slo, step, tick, prompt_tokens=size)


@dataclass(frozen=True)
class RateSweep(SweepTest[OpenLoop]):
    """Open-loop rates at growing counts, `requests` at each."""

    requests: int = field(kw_only=True)

    async def run(self, on: OnTarget, tick: Progress) -> None:
        inner, size = self.sweep.inner, self.prompt_tokens
        step = open_loop_step(on.client, lambda n: on.prompts.requests(n, size, "rate"), self.requests, self.fleet)
        await on.sweep(
            self.sweep, self.slo, step, tick, prompt_tokens=size, arrival=inner.arrival, seed=inner.seed,
            ramp_s=inner.ramp_s,
        )  # fmt: skip


@dataclass(frozen=True)
class Rate(BenchTest):
    """One open-loop test of `requests` requests at the prompt size (after an unmeasured ramp), from `fleet`."""

    shape: OpenLoop
    prompt_tokens: int
    requests: int
    fleet: Fleet = ONE_PROCESS

    def total(self) -> int:
        return self.requests

    async def run(self, on: OnTarget, tick: Progress) -> None:
        shape, size = self.shape, self.prompt_tokens
        reqs = on.prompts.requests(self.requests, size, "rate")
        load = Load(reqs, on.prompts.requests(shape.ramp_size(), size, "ramp"))
        timed = await send(shape, load, on.client, fleet=self.fleet, tick=tick)
        summ = summarize_records(timed.records, lag_s=timed.lag_s, send_times=[r.t_start_mono for r in timed.records])
        summ = timed.annotate(summ)
        params = {**on.params, "prompt_tokens": size, **shape.params(len(reqs))}
        name = f"{shape.arrival} {shape.rate:g}/s"
        on.res.groups.append(bench_group(name, "rate", on.res.target.name, params, timed, summ))


@dataclass(frozen=True)
class BenchPlan:
    """bench's options typed once (`bench_plan`): what every request is, the groups' params
    after the model, and the tests in the order they run."""

    prompts: Prompts
    params: JSONObject
    tests: tuple[BenchTest, ...]


def bench_plan(opts: BenchOptions) -> BenchPlan:
    """The plan the options ask for: the one place bench's options are read."""
    bsize = opts.batch_prompt_tokens or min(opts.prompt_tokens)
    sizes = opts.prompt_tokens if bsize in opts.prompt_tokens else (*opts.prompt_tokens, bsize)
    waves = tuple(n for n in dict.fromkeys(opts.batches or (opts.batch,)) if n >= 2)
    slo = opts.slo or parse_slo(DEFAULT_SLO)
    tests: list[BenchTest] = [Singles(sizes, opts.repeat)]
    if waves and not (opts.sweep and not opts.batches):  # a sweep replaces the batch waves unless asked for
        tests.append(WaveRounds(waves, bsize, opts.repeat))
    if opts.sweep:
        streams = opts.sweep.of(ClosedLoop(1), opts.sweep_steps)
        tests.append(StreamsSweep(streams, bsize, slo, opts.workers, per_stream=opts.repeat))
    open_loop = OpenLoop(opts.rate or 1.0, opts.arrival, opts.seed, opts.ramp_s)
    if opts.rate_steps:
        rates = Sweep(open_loop, opts.rate_steps)
        tests.append(RateSweep(rates, bsize, slo, opts.workers, requests=opts.requests))
    elif opts.rate:
        tests.append(Rate(open_loop, bsize, opts.requests, opts.workers))
    params: dict[str, JSONValue] = {"max_tokens": opts.max_tokens, "repeat": opts.repeat, "nonce": opts.nonce}
    if opts.api != "chat":  # (files of Chat Completions runs stay as they were)
        params["api"] = opts.api
    return BenchPlan(Prompts(opts.api, opts.model, opts.max_tokens, opts.nonce), params, tuple(tests))


async def _measure_waves(on: OnTarget, test: WaveRounds, tick: Callable[[], None]) -> None:
    """The batch tests: `repeat` rounds of one wave of each size, every round bracketed by a
    request alone at the same prompt size (the `baseline` group), so each wave's speedup is
    judged against one stream measured just before and just after it, not minutes earlier.
    The groups are added even when cancelled, with what was measured."""
    baseline = Timed()
    per: dict[int, tuple[Timed, list[list[Record]]]] = {n: (Timed(), []) for n in test.sizes}
    size = test.prompt_tokens

    async def alone() -> None:
        timed = await send(Sequential(), Load([on.prompts.request(size, "baseline", "baseline")]), on.client, tick=tick)
        baseline.records.extend(timed.records)
        baseline.source_ids.update(timed.source_ids)

    try:
        await alone()
        for _ in range(test.repeat):
            for n in test.sizes:
                timed = await send(Waves(n), Load(on.prompts.requests(n, size, f"x{n}")), on.client, tick=tick)
                acc, recs = per[n]
                acc.records.extend(timed.records)
                acc.source_ids.update(timed.source_ids)
                recs.extend(timed.waves)
            await alone()
    finally:
        wave_groups(on.res, baseline, per, list(test.sizes), on.params, size)


async def bench_one(
    target: Target,
    plan: BenchPlan,
    res: TargetResult | None = None,
    say: Callable[[str], None] | None = None,
) -> TargetResult:
    """Benchmark one target into `res` (a new one unless given): its prompts calibrated, then
    each test of `plan` in turn. When cancelled (Ctrl-C), the requests finished so far are in
    `res.groups` and `res.error` says so. The run's lines go to `say`, with its progress (drawn on
    a terminal, a plain line now and then elsewhere); without `say` it prints nothing."""
    res = res if res is not None else TargetResult(target)
    th = Thresholds()
    async with client_for(target, th) as client:
        prompts = await calibrated(client, res, plan.prompts)
        if prompts is None:
            return res
        on = OnTarget(client, res, prompts, {"model": prompts.model, **plan.params}, th, say)
        measured_from = len(client.finished)
        tick = Progress(
            f"bench {target.name}", sum(test.total() for test in plan.tests), None if say else False, client
        )
        tick.start()
        try:
            for test in plan.tests:
                await test.run(on, tick)
        except asyncio.CancelledError:
            res.error = f"interrupted after {requests_text(len(client.finished) - measured_from, 'measured')}"
            raise
        finally:
            tick.close()
    return res


async def bench_targets(
    targets: Sequence[Target],
    opts: BenchOptions,
    parallel: bool = False,
    out: list[TargetResult] | None = None,
    say: Callable[[str], None] | None = None,
) -> list[TargetResult]:
    """Benchmark each target (one after another unless `parallel`, which is only fair
    when the targets do not share hardware, e.g. simulators). Results are appended to
    `out` (when given) as each target starts, so a cancelled run keeps what it measured. The
    run's lines and progress go to `say` (`bench_one`)."""
    plan = bench_plan(opts)
    results = out if out is not None else []
    for together in [list(targets)] if parallel else [[t] for t in targets]:
        results.extend(TargetResult(t) for t in together)
        runs = results[len(results) - len(together) :]
        await asyncio.gather(*(bench_one(r.target, plan, r, say) for r in runs))
    return results
