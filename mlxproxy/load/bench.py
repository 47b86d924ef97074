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
import math
import os
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from mlxproxy.core.detect import Thresholds, overlap_ratio, prefill_scaling
from mlxproxy.core.record import OK_OUTCOMES, Record
from mlxproxy.core.stats import percentile
from mlxproxy.core.text import clip
from mlxproxy.load.client import MeasuringClient, PreparedRequest, Timed
from mlxproxy.load.common import filler_text, requests_text, unreachable_message
from mlxproxy.load.progress import Progress
from mlxproxy.load.report import aggregate_tps, mark_speeds, range_text, summarize_records, untrusted_notes
from mlxproxy.load.results import AnomalyCount, FailedRequest, Group, GroupKind, JSONObject, JSONValue, Summary, Wave
from mlxproxy.load.shapes import ClosedLoop, OpenLoop, Sweep, SweptShape, Waves
from mlxproxy.load.slo import DEFAULT_SLO, parse_slo
from mlxproxy.load.sweep import DEFAULT_BUDGET_S, DEFAULT_STEP_MIN_S, StepRun
from mlxproxy.load.workers import ONE_PROCESS, Workers, closed_loop_step, open_loop_step, run_shape, workers_section

__all__ = [
    "BenchOptions",
    "Target",
    "Calibration",
    "bench_targets",
    "verdict",
    "batching_verdict",
    "wave_class",
    "headline",
    "headline_notes",
    "DEFAULT_SIZES",
]

DEFAULT_SIZES = (100, 500, 1000, 2000, 4000, 8000, 16000, 53000)


@dataclass(frozen=True)
class Target:
    name: str
    url: str
    timeout_s: float = 1800.0
    api_key: str | None = None


@dataclass(frozen=True)
class BenchOptions:
    prompt_tokens: tuple[int, ...] = DEFAULT_SIZES
    max_tokens: int = 128
    repeat: int = 5
    batch: int = 2
    batch_prompt_tokens: int | None = None  # default: the smallest size
    concurrency: tuple[int, ...] = ()  # more wave sizes (kept for callers of the old spelling)
    batches: tuple[int, ...] = ()  # wave sizes released together; default (batch, *concurrency)
    model: str | None = None
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
    step_time: float = DEFAULT_STEP_MIN_S  # a sweep step sends its mix again until it ran this long (--step-time)
    runs: int = 1  # the whole sweep search this many times (--runs)
    max_connections: int | None = None  # per target and process (--max-connections; None: the default)
    refine: bool = True  # a doubling sweep refines its answer (--sweep auto), else stops at a power of two
    workers: Workers = ONE_PROCESS  # the processes or cluster the open-loop and sweep tests send from


@dataclass
class Calibration:
    """prompt_tokens ~= intercept + slope * chars, fitted on the target's own usage."""

    slope: float = 0.25
    intercept: float = 0.0
    source: str = "assumed 4 chars/token (the target reported no usage)"

    def chars_for(self, tokens: int) -> int:
        return max(1, int(round((tokens - self.intercept) / self.slope)))


@dataclass
class TargetResult:
    target: Target
    model: str | None = None
    calibration: Calibration = field(default_factory=Calibration)
    groups: list[Group] = field(default_factory=list)
    error: str | None = None


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


def _req(body: bytes, label: str) -> PreparedRequest:
    return PreparedRequest("POST", "/v1/chat/completions", body, (("content-type", "application/json"),), label=label)


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


async def calibrate(client: MeasuringClient, model: str) -> tuple[Calibration, list[Record]]:
    """Two non-stream probes of different lengths; a line through their prompt_tokens."""
    probes = []
    for chars in (400, 4000):
        text = f"[nonce {os.urandom(6).hex()}] " + filler_text(chars)
        rec = await client.send(_req(chat_body(model, text, 1, stream=False), "calibration"))
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


def _group(name: str, kind: GroupKind, target: str, params: JSONObject, timed: Timed, summary: Summary) -> Group:
    return Group(name, target, name, kind, params, summary, tuple(timed.rows(source_ids=False)))


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
            if not res.groups:
                _single_groups(res, run.single, run.sizes, run.params, th)
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
    res.calibration, probes = await calibrate(client, res.model)
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
        waves = [n for n in dict.fromkeys(opts.batches or (opts.batch, *opts.concurrency)) if n >= 2]
        # a sweep replaces the batch waves unless they were asked for
        self.waves = [] if opts.sweep and not opts.batches else waves
        self.single = Timed()
        self.params: dict[str, JSONValue] = {
            "model": res.model,
            "max_tokens": opts.max_tokens,
            "repeat": opts.repeat,
            "nonce": opts.nonce,
        }

    def total(self) -> int:
        """Requests the progress line counts on (a sweep's are not known in advance)."""
        opts = self.opts
        return (
            len(self.sizes) * opts.repeat
            + sum(n * opts.repeat for n in self.waves)
            + (opts.repeat + 1 if self.waves else 0)
            + (opts.requests if opts.rate and not opts.rate_steps else 0)
        )

    def requests(self, n: int, label: str) -> list[PreparedRequest]:
        """`n` requests at the batch prompt size, each with its own nonce."""
        opts, cal = self.opts, self.res.calibration
        return [
            _req(chat_body(self.model, _prompt(cal, self.bsize, opts.nonce), opts.max_tokens), label) for _ in range(n)
        ]

    async def run(self, tick: Progress) -> None:
        opts = self.opts
        for _ in range(opts.repeat):  # interleave sizes so slow drift does not bias one size
            for size in self.sizes:
                body = chat_body(self.model, _prompt(self.res.calibration, size, opts.nonce), opts.max_tokens)
                r = await self.client.send(_req(body, f"single:{size}"))
                self.single.records.append(r)
                self.single.source_ids[r.id] = f"{size}"
                tick()
        _single_groups(self.res, self.single, self.sizes, self.params, self.th)
        if self.waves:
            await _measure_waves(self.client, self.res, opts, self.bsize, self.waves, self.params, tick)
        if opts.sweep:
            step = closed_loop_step(self.client, lambda n: self.requests(n, "sweep"), 1, opts.repeat, opts.workers)
            shape_c = Sweep(ClosedLoop(1), opts.sweep_steps, opts.refine, opts.budget_s, opts.step_time, opts.runs)
            await self.sweep(shape_c, step, tick)
        if opts.rate_steps:
            step_r = open_loop_step(self.client, lambda n: self.requests(n, "rate"), opts.requests, opts.workers)
            shape = Sweep(OpenLoop(1.0, opts.arrival, opts.seed, opts.ramp_s), opts.rate_steps)
            params: dict[str, JSONValue] = {"arrival": opts.arrival, "seed": opts.seed, "ramp_s": opts.ramp_s}
            await self.sweep(shape, step_r, tick, params)
        elif opts.rate:
            await self.rate(opts.rate, tick)

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

    async def rate(self, rate: float, tick: Progress) -> None:
        """One open-loop test of `--requests` requests at `rate` (after an unmeasured ramp)."""
        opts = self.opts
        shape = OpenLoop(rate, opts.arrival, opts.seed, opts.ramp_s)
        reqs = self.requests(opts.requests, "rate")
        timed = await run_shape(opts.workers, shape, self.client, reqs, tick, self.requests(shape.ramp_size(), "ramp"))
        summ = summarize_records(timed.records, lag_s=timed.lag_s, send_times=[r.t_start_mono for r in timed.records])
        summ = workers_section(summ, timed)
        params = {**self.params, "prompt_tokens": self.bsize, **shape.params(len(reqs))}
        self.res.groups.append(_group(f"{opts.arrival} {rate:g}/s", "rate", self.res.target.name, params, timed, summ))


#: a request of a wave that failed this way, while another of the wave was served, means the
#: server refused to serve them together (context_limit is about the prompt, not concurrency)
REJECT_OUTCOMES = frozenset(
    {"http_error", "stream_error", "truncated", "protocol_error", "upstream_unreachable", "upstream_timeout"}
)


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

    def body() -> bytes:  # every request gets its own nonce: no wave is served from the cache
        return chat_body(res.model or "", _prompt(res.calibration, bsize, opts.nonce), opts.max_tokens)

    async def alone() -> None:
        r = await client.send(_req(body(), "baseline"))
        baseline.records.append(r)
        baseline.source_ids[r.id] = "baseline"
        tick()

    try:
        await alone()
        for _ in range(opts.repeat):
            for n in waves:
                timed, wave_recs = await Waves(n).run_waves(client, [_req(body(), f"x{n}") for _ in range(n)], tick)
                acc, recs = per[n]
                acc.records.extend(timed.records)
                acc.source_ids.update(timed.source_ids)
                recs.extend(wave_recs)
            await alone()
    finally:
        _wave_groups(res, baseline, per, waves, params, bsize)


def _wave_groups(
    res: TargetResult,
    baseline: Timed,
    per: dict[int, tuple[Timed, list[list[Record]]]],
    waves: list[int],
    params: JSONObject,
    bsize: int,
) -> None:
    if baseline.records:
        res.groups.append(
            _group(
                "baseline",
                "baseline",
                res.target.name,
                {**params, "prompt_tokens": bsize},
                baseline,
                summarize_records(baseline.records),
            )
        )
    walls = [r.wall_tps if r.outcome in OK_OUTCOMES else None for r in baseline.records]
    ok_walls = sorted(w for w in walls if w)
    median_wall = percentile(ok_walls, 50)
    for i, n in enumerate(waves):
        timed, wave_recs = per[n]
        if not wave_recs:
            continue
        summ = summarize_records(timed.records, waves=wave_recs, single_wall_tps=median_wall)
        rows: list[Wave] = []
        for k, wave in enumerate(wave_recs):  # wave k ran between baseline requests k and k + 1
            around = [w for w in walls[k : k + 2] if w]
            base = sum(around) / len(around) if around else median_wall
            agg = aggregate_tps(wave)
            rows.append(
                Wave(
                    speedup=agg / base if agg is not None and base else None,
                    overlap=overlap_ratio(wave),
                    ok=sum(1 for r in wave if r.outcome in OK_OUTCOMES),
                    failed=tuple(FailedRequest(r.outcome, r.status) for r in wave if r.outcome in REJECT_OUTCOMES),
                    aggregate_tps=agg,
                    baseline_wall_tps=base,
                )
            )
        speedups = sorted(w.speedup for w in rows if w.speedup is not None)
        overlaps = sorted(w.overlap for w in rows if w.overlap is not None)
        summ = summ.updated(
            {
                "speedup": percentile(speedups, 50),
                "speedup_min": speedups[0] if speedups else None,
                "speedup_max": speedups[-1] if speedups else None,
                "overlap_min": overlaps[0] if overlaps else None,
                "overlap_max": overlaps[-1] if overlaps else None,
                "baseline_wall_tps": median_wall,
                "waves": [w.to_json() for w in rows],
            }
        )
        name = "double" if n == 2 and i == 0 else f"x{n}"
        res.groups.append(
            _group(name, "wave", res.target.name, {**params, "prompt_tokens": bsize, "streams": n}, timed, summ)
        )


def _single_groups(res: TargetResult, single: Timed, sizes: list[int], params: JSONObject, th: Thresholds) -> None:
    """The one-at-a-time groups: `single` (every size) first, then `single N` per size."""
    for size in sizes:
        sub = Timed([r for r in single.records if single.source_ids[r.id] == f"{size}"])
        if sub.records:
            res.groups.append(
                _group(
                    f"single {size}",
                    "single_size",
                    res.target.name,
                    {**params, "prompt_tokens": size, "prompt_tokens_sent": _sent(sub.records)},
                    sub,
                    summarize_records(sub.records),
                )
            )
    if single.records:
        all_single = summarize_records(single.records)
        scaling = prefill_scaling(single.records, th)
        if scaling is not None:
            all_single = all_single.with_anomaly(scaling.kind, 1, scaling.evidence)
        res.groups.insert(0, _group("single", "single", res.target.name, params, single, all_single))


def _sent(records: Sequence[Record]) -> int | None:
    vals = sorted(v for r in records if (v := r.prompt_tokens or r.context_prompt_tokens))
    p50 = percentile(vals, 50)
    return int(p50) if p50 is not None else None


#: overlap (share of a wave's decode time when at least two of its streams were generating) at or
#: below which the streams were served one after another, and at or above which they were generated together
OVERLAP_SERIAL = 0.25
OVERLAP_BATCHING = 0.6
#: with overlapping streams, a speedup below this is no gain (a CPU-bound server shares one compute)
GAIN = 1.2
#: a median speedup within this of GAIN (1.1-1.3) cannot say gain from no gain: one lone request's
#: tok/s varies that much from the next on a shared machine, so the verdict says so instead of flipping
GAIN_MARGIN = 0.1
#: N streams can give at most N x one stream; beyond N x this margin the baseline was not comparable
IMPOSSIBLE_MARGIN = 1.1
#: a verdict names an anomaly only when at least this share of the target's requests had it
ANOMALY_SHARE = 0.25

BATCH_CLASSES = (
    "rejects concurrent requests",
    "serial",
    "partial batching",
    "batches, no gain",
    "continuous batching",
    "overlap not measurable",
)


def wave_class(w: Wave) -> str:
    """What one wave of the batch test showed (one of BATCH_CLASSES): a request failed while
    another was served; else by overlap first (serial only with low overlap, batching only with
    high), the speedup deciding only between gain and no gain among overlapping streams."""
    if w.failed and w.ok:
        return "rejects concurrent requests"
    ov, sp = w.overlap, w.speedup
    if ov is None:
        return "overlap not measurable"
    if ov <= OVERLAP_SERIAL:
        return "serial"
    if ov < OVERLAP_BATCHING:
        return "partial batching"
    return "continuous batching" if sp is None or sp >= GAIN else "batches, no gain"


def batching_verdict(group: Group) -> str | None:
    """The batching part of a verdict, from a wave group (`double`, `xN`): the class most
    waves agree on (two thirds of them), with the median speedup and its spread over the waves
    and the overlap; "inconclusive" with the reason when they disagree. Groups written before
    per-wave figures existed are judged as one wave from their summary."""
    s, n = group.summary, group.param("streams") or 2
    waves = s.waves
    if waves is None:  # an older result file: one judgment from the medians
        waves = (Wave(s.speedup, s.overlap, s.ok),)
    rows = [w for w in waves if w.ok]  # a wave with nothing served says nothing about batching
    if not rows:
        return None
    classes = [wave_class(w) for w in rows]
    counts = {c: classes.count(c) for c in BATCH_CLASSES if c in classes}
    top = max(counts, key=lambda c: counts[c])
    at = "" if n == 2 else f" at {n} streams"
    sp, ov = s.speedup, s.overlap
    sp_txt = "" if sp is None else f"{sp:.2f}x" + range_text(s.figure("speedup_min"), s.figure("speedup_max"), ".2f")
    ov_txt = (
        "" if ov is None else f"overlap {ov:.2f}" + range_text(s.figure("overlap_min"), s.figure("overlap_max"), ".2f")
    )
    if counts[top] * 3 < len(rows) * 2:
        mix = " / ".join(f"{counts[c]} {c}" for c in sorted(counts, key=lambda c: -counts[c]))
        figures = "; ".join(x for x in (ov_txt, f"speedup {sp_txt}" if sp_txt else "") if x)
        return f"inconclusive{at}: the {len(rows)} waves disagree ({mix}){'; ' + figures if figures else ''}"
    if top == "rejects concurrent requests":
        failed = [f for w in rows for f in w.failed]
        how = sorted(
            {
                "HTTP 200 then an error in the stream"
                if f.outcome == "stream_error" and f.status == 200
                else f"HTTP 200 then {f.outcome}"
                if f.status == 200
                else f"HTTP {f.status}"
                if f.status
                else f.outcome
                for f in failed
            }
        )
        return f"rejects concurrent requests{at} ({counts[top]} of {len(rows)} waves: {', '.join(how)})"
    if top in ("continuous batching", "batches, no gain") and sp is not None and abs(sp - GAIN) < GAIN_MARGIN:
        return (
            f"inconclusive{at}: the streams are generated together ({ov_txt or 'overlap not measured'}), but "
            f"speedup {sp_txt} is too close to {GAIN:g}x to say whether they gain"
        )
    parts = [top + at]
    if top == "overlap not measurable":
        return f"speedup{at} {sp_txt}, overlap not measurable" if sp_txt else top + at
    if sp_txt:
        parts[0] += (": " if top in ("serial", "batches, no gain") else " ") + sp_txt
    over = [w.speedup for w in rows if w.speedup is not None and w.speedup > n * IMPOSSIBLE_MARGIN]
    if over:
        parts.append(f"speedup unreliable: {len(over)} of {len(rows)} waves above what {n} streams can give ({n}x)")
    if ov_txt:
        parts.append(ov_txt)
    return ", ".join(parts)


def verdict(res: TargetResult) -> str:
    """One line naming what the run found about a target."""
    if res.error:
        return res.error if res.error.startswith("interrupted") else f"failing: {res.error}"
    parts: list[str] = []
    wave_group = next((g for g in res.groups if g.kind == "wave"), None)
    if wave_group is not None:
        b = batching_verdict(wave_group)
        if b:
            parts.append(b)
    records = [r.record for g in res.groups if g.kind != "single" for r in g.records]
    total = len(records)
    counts: dict[str, int] = {}
    for r in records:
        for kind in r.anomalies:
            counts[kind] = counts.get(kind, 0) + 1
    anomalies: dict[str, AnomalyCount] = {}
    for g in res.groups:
        for k, a in g.summary.anomalies.items():
            anomalies.setdefault(k, a)

    def named(kind: str) -> str | None:
        """ " (k of n requests)" when `kind` is in a meaningful share of the requests, else None;
        "" for a judgment made once over the whole run (no per-request count)."""
        if kind not in anomalies:
            return None
        k = counts.get(kind, 0)
        if k == 0:
            return ""
        return f" ({k} of {total} requests)" if k >= ANOMALY_SHARE * total else None

    share = named("non_incremental_stream")
    if share is not None:
        parts.append("no incremental streaming" + share)
    limits = sorted(
        {r.context_limit_tokens for r in records if r.outcome == "context_limit" and r.context_limit_tokens}
    )
    rejected = sorted({r.context_prompt_tokens or 0 for r in records if r.outcome == "context_limit"})
    if limits:
        parts.append(f"rejects prompts > {limits[0]} tokens")
    elif rejected:
        parts.append(f"rejects prompts of {rejected[0]} tokens")
    share = named("stall")
    if share is not None:
        parts.append(("cyclic stalls" if "cyclic" in anomalies["stall"].evidence else "stalls") + share)
    usage = [x for x in (named("usage_mismatch"), named("phantom_speed")) if x is not None]
    if usage:
        ratios = [
            r.completion_tokens_reported / r.completion_tokens_counted
            for r in records
            if r.completion_tokens_reported and r.completion_tokens_counted
        ]
        if ratios:
            ratio = percentile(sorted(ratios), 50) or 0.0
            text = f"usage over-reports {ratio:.1f}x" if ratio > 1 else f"usage under-reports {1 / ratio:.1f}x"
            parts.append(text + max(usage, key=len))
    if "superlinear_prefill" in anomalies:
        parts.append("superlinear prefill")
    for kind, text in (
        ("dual_reasoning_fields", "dual reasoning fields"),
        ("unreported_length", "never reports length"),
        ("stream_error", "errors inside streams"),
        ("missing_finish", "streams end without finish_reason"),
        ("usage_missing", "no usage"),
    ):
        share = named(kind)
        if share is not None:
            parts.append(text + share)
    failed = sum(1 for r in records if r.outcome not in OK_OUTCOMES and r.outcome != "context_limit")
    if failed:
        parts.append(f"{failed} failed requests")
    return ", ".join(parts) or "healthy"


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


def smallest_single(res: TargetResult) -> Group | None:
    """The one-at-a-time group at the smallest prompt size: the headline's figures come
    from it, so a server that refuses big prompts cannot look fastest by a median over sizes."""
    sized = [g for g in res.groups if g.kind == "single_size" and g.summary.ok]
    return min(sized, key=lambda g: g.param("prompt_tokens") or 0) if sized else None


def first_wave(res: TargetResult) -> Group | None:
    """The first test of requests released together (its speedup is the headline's)."""
    return next((g for g in res.groups if g.kind == "wave"), None)


def headline(res: TargetResult, size_label: bool = True) -> dict[str, str]:
    """One row per target: TTFT, TTFC, decode and wall tok/s at the smallest prompt size,
    and the speedup of the first batch test."""
    g = smallest_single(res)
    s = g.summary if g else None
    batch = first_wave(res)
    b = batch.summary if batch else None

    def f(v: float | None, fmt: str, unit: str = "") -> str:
        return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, fmt) + unit

    ok = sum(x.summary.ok for x in res.groups if x.kind != "single")
    sent = sum(x.summary.requests for x in res.groups if x.kind != "single")
    row = {
        "target": res.target.name,
        "prompt": f"{g.params.get('prompt_tokens_sent') or g.params['prompt_tokens']} tok" if g else "-",
        "TTFT p50": f(s.ttft_s.p50, ".3f", "s") if s else "-",
        "TTFC p50": f(s.ttfc_s.p50, ".3f", "s") if s else "-",
        "decode tok/s": f(s.decode_tps.p50, ".1f") if s else "-",
        "wall tok/s": f(s.wall_tps.p50, ".1f") if s else "-",
        "speedup": (f(b.speedup, ".2f", "x") + f" ({batch.params['streams']})") if batch and b and b.speedup else "-",
        "ok/req": f"{ok}/{sent}",
    }
    if s:  # speeds that do not use the server's usage are marked (footnote: headline_notes)
        mark_speeds(row, s, ("decode tok/s", "wall tok/s"))
    if b:
        mark_speeds(row, b, ("speedup",))
    return row


def headline_notes(results: Sequence[TargetResult]) -> list[str]:
    """The footnotes of `headline` rows marked for untrusted usage."""
    items = []
    for res in results:
        g = smallest_single(res)
        for grp in (g, first_wave(res)):
            if grp is not None:
                items.append((f"{res.target.name} {grp.name}", grp.summary))
    return untrusted_notes(items)
