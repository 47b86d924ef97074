"""`mlxproxy bench`: compare servers the way the 2026 MLX benchmark did.

Per target: one request at a time at each prompt size (`single`), then rounds of waves of two
identical-size requests released together (`double`), optionally waves of N for a
concurrency curve, each round between two requests alone (`baseline`); every test repeated
and summarised by medians. Each request is metered by the shared core and checked by the
truth checks; a verdict names what was found, the batching part judged wave by wave
(`wave_class`, `batching_verdict`).

Prompts of a given token count are built without any download: two probe requests
calibrate characters per token against the target's own `usage.prompt_tokens` (a linear
fit, so the chat template's fixed tokens are accounted for); the sizes actually sent are
reported. Every prompt starts with a nonce so no prompt cache serves a repeat.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from mlxproxy.core.detect import Thresholds
from mlxproxy.core.record import OK_OUTCOMES, Record
from mlxproxy.core.text import clip
from mlxproxy.load.commands.bench_groups import bench_group, single_groups, wave_groups
from mlxproxy.load.commands.common import filler_text, requests_text, unreachable_message
from mlxproxy.load.data.summary import JSONObject, JSONValue
from mlxproxy.load.data.targets import Calibration, Target, TargetResult
from mlxproxy.load.judge.slo import DEFAULT_SLO, parse_slo
from mlxproxy.load.output.progress import Progress
from mlxproxy.load.output.report import summarize_records
from mlxproxy.load.run.client import MeasuringClient, PreparedRequest, Timed
from mlxproxy.load.run.runner import ONE_PROCESS, Fleet, closed_loop_step, open_loop_step, send
from mlxproxy.load.run.shapes import ClosedLoop, Load, OpenLoop, Sequential, Sweep, SweptShape, Waves
from mlxproxy.load.run.sweep import DEFAULT_BUDGET_S, DEFAULT_STEP_MIN_S, StepRun

__all__ = [
    "BenchOptions",
    "DEFAULT_SIZES",
    "bench_one",
    "bench_request",
    "bench_targets",
    "chat_body",
    "discover_model",
]

DEFAULT_SIZES = (100, 500, 1000, 2000, 4000, 8000, 16000, 53000)


@dataclass(frozen=True)
class BenchOptions:
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
    sweep: bool = False  # closed-loop steps of growing concurrency at the batch prompt size
    sweep_steps: tuple[int, ...] = ()  # the steps; () doubles from 1 until saturation
    slo: dict[str, float] | None = None  # the sweep's SLO (default: mlxproxy.load.DEFAULT_SLO)
    budget_s: float = DEFAULT_BUDGET_S  # a doubling sweep refines its answer while it has run less than this
    step_time: float = DEFAULT_STEP_MIN_S  # a closed-loop sweep step sends its mix again until it ran this long
    runs: int = 1  # the whole sweep search this many times (--runs)
    max_connections: int | None = None  # per target and process (--max-connections; None: the default)
    refine: bool = True  # a doubling sweep refines its answer (--sweep auto), else stops at a power of two
    workers: Fleet = ONE_PROCESS  # the processes or cluster the open-loop and sweep tests send from


def chat_body(model: str, text: str, max_tokens: int, stream: bool = True) -> bytes:
    obj: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    }
    if stream:
        obj["stream_options"] = {"include_usage": True}
    return orjson.dumps(obj)


def _req(body: bytes, label: str, source_id: str | None = None) -> PreparedRequest:
    headers = (("content-type", "application/json"),)
    return PreparedRequest("POST", "/v1/chat/completions", body, headers, source_id=source_id, label=label)


def bench_request(
    api: str, model: str, text: str, max_tokens: int, label: str, source_id: str | None = None, stream: bool = True
) -> PreparedRequest:
    """One benchmark request through `api`: Chat Completions, or Ollama's native `/api/chat`
    (its limit is `options.num_predict`; it reports usage on every answer, streamed or not)."""
    if api != "ollama":
        return _req(chat_body(model, text, max_tokens, stream=stream), label, source_id)
    obj = {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "stream": stream,
        "options": {"num_predict": max_tokens, "temperature": 0},
    }
    headers = (("content-type", "application/json"),)
    return PreparedRequest("POST", "/api/chat", orjson.dumps(obj), headers, source_id=source_id, label=label)


async def discover_model(client: MeasuringClient) -> str:
    """The first model id of GET /v1/models, else `default_model` (mlx_lm.server's name)."""
    status, body = await client.fetch("GET", "/v1/models")
    try:
        data = orjson.loads(body).get("data") if status == 200 else None
        if isinstance(data, list) and data and isinstance(data[0], dict) and isinstance(data[0].get("id"), str):
            return str(data[0]["id"])
    except ValueError:
        pass
    return "default_model"


async def calibrate(client: MeasuringClient, model: str, api: str = "chat") -> tuple[Calibration, list[Record]]:
    """Two non-stream probes of different lengths; a line through their prompt_tokens."""
    probes = []
    for chars in (400, 4000):
        text = f"[nonce {os.urandom(6).hex()}] " + filler_text(chars)
        rec = await client.send(bench_request(api, model, text, 1, "calibration", stream=False))
        probes.append((len(text), rec))
    (c1, r1), (c2, r2) = probes
    recs = [r1, r2]
    if r1.prompt_tokens is None or r2.prompt_tokens is None or r2.prompt_tokens <= r1.prompt_tokens:
        return Calibration(), recs
    slope = (r2.prompt_tokens - r1.prompt_tokens) / (c2 - c1)
    intercept = r1.prompt_tokens - slope * c1
    return Calibration(
        slope, intercept, f"fitted on the target's usage: {1 / slope:.2f} chars/token + {intercept:.0f} template tokens"
    ), recs


def _prompt(cal: Calibration, tokens: int, nonce: bool) -> str:
    prefix = f"[nonce {os.urandom(6).hex()}] " if nonce else ""
    return prefix + filler_text(max(1, cal.chars_for(tokens) - len(prefix)))


async def bench_one(
    target: Target,
    opts: BenchOptions,
    th: Thresholds,
    progress: bool | None = None,
    res: TargetResult | None = None,
    say: Callable[[str], None] | None = None,
) -> TargetResult:
    """Benchmark one target into `res` (a new one unless given). When cancelled (Ctrl-C),
    the requests finished so far are in `res.groups` and `res.error` says so."""
    res = res if res is not None else TargetResult(target)
    async with MeasuringClient(
        target.url, name=target.name, thresholds=th, api_key=target.api_key, timeout_s=target.timeout_s,
        max_connections=opts.max_connections,
    ) as client:  # fmt: skip
        probes = await _prepare(client, res, opts)
        if probes is None:
            return res
        run = _BenchRun(client, res, opts, th, say)
        tick = Progress(f"bench {target.name}", run.total(), progress, client)
        tick.start()
        try:
            await run.run(tick)
        except asyncio.CancelledError:
            if not res.groups:  # cancelled one at a time: the requests finished so far, in order
                single = Timed()
                for req, r in zip(run.single_reqs, client.finished[len(probes) :]):
                    single.add(r, req.source_id)
                single_groups(res, single, run.sizes, run.params, th)
            res.error = f"interrupted after {requests_text(len(client.finished) - len(probes), 'measured')}"
            raise
        finally:
            tick.close()
    return res


async def _prepare(client: MeasuringClient, res: TargetResult, opts: BenchOptions) -> list[Record] | None:
    """The model and the calibration of `res`, and the probe requests; None (and `res.error`
    set) when the target cannot be benchmarked."""
    try:
        res.model = opts.model or await discover_model(client)
    except Exception as exc:  # unreachable target: report and move on
        res.error = unreachable_message(res.target.url, exc)
        return None
    res.calibration, probes = await calibrate(client, res.model, opts.api)
    bad = [r for r in probes if r.outcome not in OK_OUTCOMES]
    if len(bad) == len(probes):
        r = bad[0]
        res.error = (
            f"probe requests failed: {r.outcome}"
            + (f" (HTTP {r.status})" if r.status else "")
            + (f": {clip(r.error, 200)}" if r.error else "")
        )
        return None
    return probes


class _BenchRun:
    """The tests of one target after calibration: the requests they send and the load shape
    of each (one at a time, waves, a closed-loop sweep, an open-loop rate or a sweep of rates)."""

    def __init__(
        self,
        client: MeasuringClient,
        res: TargetResult,
        opts: BenchOptions,
        th: Thresholds,
        say: Callable[[str], None] | None,
    ) -> None:
        self.client, self.res, self.opts, self.th, self.say = client, res, opts, th, say
        self.model = res.model or "default_model"
        self.sizes = list(opts.prompt_tokens)
        self.bsize = opts.batch_prompt_tokens or min(self.sizes)
        if self.bsize not in self.sizes:
            self.sizes.append(self.bsize)
        waves = [n for n in dict.fromkeys(opts.batches or (opts.batch,)) if n >= 2]
        # a sweep replaces the batch waves unless they were asked for
        self.waves = [] if opts.sweep and not opts.batches else waves
        self.tests = bench_tests(opts, self.waves)
        # one at a time at each size, sizes interleaved so slow drift does not bias one size;
        # every prompt has its own nonce (no prompt cache serves a repeat)
        self.single_reqs = [
            bench_request(
                opts.api,
                self.model,
                _prompt(res.calibration, size, opts.nonce),
                opts.max_tokens,
                f"single:{size}",
                f"{size}",
            )  # fmt: skip
            for _ in range(opts.repeat)
            for size in self.sizes
        ]
        self.single = Timed()
        self.params: dict[str, JSONValue] = {
            "model": res.model,
            "max_tokens": opts.max_tokens,
            "repeat": opts.repeat,
            "nonce": opts.nonce,
        }
        if opts.api != "chat":  # (files of Chat Completions runs stay as they were)
            self.params["api"] = opts.api

    def total(self) -> int:
        """Requests the progress line counts on (a sweep's are not known in advance)."""
        return sum(test.total(self) for test in self.tests)

    def requests(self, n: int, label: str) -> list[PreparedRequest]:
        """`n` requests at the batch prompt size, each with its own nonce."""
        opts, cal = self.opts, self.res.calibration
        return [
            bench_request(opts.api, self.model, _prompt(cal, self.bsize, opts.nonce), opts.max_tokens, label)
            for _ in range(n)
        ]

    async def run(self, tick: Progress) -> None:
        for test in self.tests:
            await test.run(self, tick)

    async def sweep(
        self,
        shape: Sweep[SweptShape],
        step: Callable[[SweptShape], Awaitable[StepRun]],
        tick: Progress,
        params: JSONObject | None = None,
    ) -> None:
        await shape.run(
            step, self.opts.slo or parse_slo(DEFAULT_SLO), target=self.res.target.name,
            params={**self.params, "prompt_tokens": self.bsize, **(params or {})}, out=self.res.groups,
            say=self.say, progress=tick,
        )  # fmt: skip


class BenchTest:
    """One of bench's tests, typed by its shape (`bench_tests` chooses them from the options):
    how many requests the progress line counts on and how it runs against one target."""

    def total(self, b: _BenchRun) -> int:
        return 0  # (a sweep's are not known in advance)

    async def run(self, b: _BenchRun, tick: Progress) -> None:
        raise NotImplementedError


class Singles(BenchTest):
    """One request at a time at each prompt size, sizes interleaved (`single`, `single N`)."""

    def total(self, b: _BenchRun) -> int:
        return len(b.single_reqs)

    async def run(self, b: _BenchRun, tick: Progress) -> None:
        b.single = await send(Sequential(), Load(b.single_reqs), b.client, tick=tick)
        single_groups(b.res, b.single, b.sizes, b.params, b.th)


@dataclass(frozen=True)
class WaveRounds(BenchTest):
    """Rounds of one wave of each size released together, each round between two requests alone."""

    sizes: tuple[int, ...]

    def total(self, b: _BenchRun) -> int:
        return sum(n * b.opts.repeat for n in self.sizes) + b.opts.repeat + 1

    async def run(self, b: _BenchRun, tick: Progress) -> None:
        await _measure_waves(b.client, b.res, b.opts, b.bsize, list(self.sizes), b.params, tick)


@dataclass(frozen=True)
class StreamsSweep(BenchTest):
    """Closed-loop streams at growing counts, at the batch prompt size."""

    sweep: Sweep[ClosedLoop]

    async def run(self, b: _BenchRun, tick: Progress) -> None:
        step = closed_loop_step(b.client, lambda n: b.requests(n, "sweep"), 1, b.opts.repeat, b.opts.workers)
        await b.sweep(self.sweep, step, tick)


@dataclass(frozen=True)
class RateSweep(BenchTest):
    """Open-loop rates at growing counts, `--requests` at each."""

    sweep: Sweep[OpenLoop]

    async def run(self, b: _BenchRun, tick: Progress) -> None:
        opts, inner = b.opts, self.sweep.inner
        step = open_loop_step(b.client, lambda n: b.requests(n, "rate"), opts.requests, opts.workers)
        params: dict[str, JSONValue] = {"arrival": inner.arrival, "seed": inner.seed, "ramp_s": inner.ramp_s}
        await b.sweep(self.sweep, step, tick, params)


@dataclass(frozen=True)
class Rate(BenchTest):
    """One open-loop test of `--requests` requests (after an unmeasured ramp)."""

    shape: OpenLoop

    def total(self, b: _BenchRun) -> int:
        return b.opts.requests

    async def run(self, b: _BenchRun, tick: Progress) -> None:
        shape = self.shape
        reqs = b.requests(b.opts.requests, "rate")
        timed = await send(
            shape, Load(reqs, b.requests(shape.ramp_size(), "ramp")), b.client, fleet=b.opts.workers, tick=tick
        )
        summ = summarize_records(timed.records, lag_s=timed.lag_s, send_times=[r.t_start_mono for r in timed.records])
        summ = timed.annotate(summ)
        params = {**b.params, "prompt_tokens": b.bsize, **shape.params(len(reqs))}
        name = f"{shape.arrival} {shape.rate:g}/s"
        b.res.groups.append(bench_group(name, "rate", b.res.target.name, params, timed, summ))


def bench_tests(opts: BenchOptions, waves: Sequence[int]) -> list[BenchTest]:
    """The tests the options ask for, in the order they run, each typed by its shape: the one
    place bench's test options are read."""
    tests: list[BenchTest] = [Singles()]
    if waves:
        tests.append(WaveRounds(tuple(waves)))
    if opts.sweep:
        tests.append(
            StreamsSweep(Sweep(ClosedLoop(1), opts.sweep_steps, opts.refine, opts.budget_s, opts.step_time, opts.runs))
        )
    if opts.rate_steps:
        tests.append(RateSweep(Sweep(OpenLoop(1.0, opts.arrival, opts.seed, opts.ramp_s), opts.rate_steps)))
    elif opts.rate:
        tests.append(Rate(OpenLoop(opts.rate, opts.arrival, opts.seed, opts.ramp_s)))
    return tests


async def _measure_waves(
    client: MeasuringClient,
    res: TargetResult,
    opts: BenchOptions,
    bsize: int,
    waves: list[int],
    params: JSONObject,
    tick: Callable[[], None],
) -> None:
    """The batch tests: `repeat` rounds of one wave of each size, every round bracketed by a
    request alone at the same prompt size (the `baseline` group), so each wave's speedup is
    judged against one stream measured just before and just after it, not minutes earlier.
    The groups are added even when cancelled, with what was measured."""
    baseline = Timed()
    per: dict[int, tuple[Timed, list[list[Record]]]] = {n: (Timed(), []) for n in waves}

    def req(label: str, source_id: str | None = None) -> PreparedRequest:  # each its own nonce: no cache hit
        text = _prompt(res.calibration, bsize, opts.nonce)
        return bench_request(opts.api, res.model or "", text, opts.max_tokens, label, source_id)

    async def alone() -> None:
        timed = await send(Sequential(), Load([req("baseline", "baseline")]), client, tick=tick)
        baseline.records.extend(timed.records)
        baseline.source_ids.update(timed.source_ids)

    try:
        await alone()
        for _ in range(opts.repeat):
            for n in waves:
                timed = await send(Waves(n), Load([req(f"x{n}") for _ in range(n)]), client, tick=tick)
                wave_recs = timed.waves
                acc, recs = per[n]
                acc.records.extend(timed.records)
                acc.source_ids.update(timed.source_ids)
                recs.extend(wave_recs)
            await alone()
    finally:
        wave_groups(res, baseline, per, waves, params, bsize)


async def bench_targets(
    targets: Sequence[Target],
    opts: BenchOptions,
    th: Thresholds | None = None,
    progress: bool | None = None,
    parallel: bool = False,
    out: list[TargetResult] | None = None,
    say: Callable[[str], None] | None = None,
) -> list[TargetResult]:
    """Benchmark each target (one after another unless `parallel`, which is only fair
    when the targets do not share hardware, e.g. simulators). Results are appended to
    `out` (when given) as each target starts, so a cancelled run keeps what it measured."""
    th = th or Thresholds()
    results = out if out is not None else []
    if parallel:
        results.extend(TargetResult(t) for t in targets)
        await asyncio.gather(*(bench_one(t, opts, th, progress, res, say) for t, res in zip(targets, results)))
        return results
    for t in targets:
        results.append(TargetResult(t))
        await bench_one(t, opts, th, progress, results[-1], say)
    return results
