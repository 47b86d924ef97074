"""`mlxproxy replay`: send a capture again against any target and measure it.

Documented rewrites of the captured request body (nothing else changes):
  - streaming chat and text completions get `stream_options.include_usage: true` (so usage
    can be checked; Anthropic Messages and OpenAI Responses streams always carry usage);
  - `--model NAME` replaces `model`;
  - the nonce (on by default; `--no-nonce` turns it off) prefixes the first message (or
    the prompt, or a Responses `input`) with `[nonce <hex>] `, a new one for every request sent (the baseline and
    the waves of `--batch`, every repeat), so no prompt cache can serve the request;
  - a privacy capture (`capture_prompts: false`) has only message lengths: each message is
    sent as filler text of its recorded length.
Captured headers are sent again except redacted ones and hop-by-hop ones; `--api-key-env`
supplies the target's key.
"""

from __future__ import annotations

import asyncio
import fnmatch
import os
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from mlxproxy.capture import CapturedRequest
from mlxproxy.core.cachecheck import PrefixIndex
from mlxproxy.core.detect import MOSTLY_CACHED, Thresholds, prefill_scaling
from mlxproxy.core.openai import GENERATION_ENDPOINTS, endpoint_of, inject_include_usage
from mlxproxy.core.record import Record
from mlxproxy.core.stats import summarize
from mlxproxy.edge.runner import run_async
from mlxproxy.headers import REDACTED
from mlxproxy.load.client import MeasuringClient, PreparedRequest, Timed
from mlxproxy.load.common import filler_text
from mlxproxy.load.progress import Progress
from mlxproxy.load.report import summarize_records
from mlxproxy.load.results import (
    CompareRow,
    Group,
    GroupKind,
    JSONObject,
    JSONValue,
    RunRecord,
    SessionTurn,
    Summary,
)
from mlxproxy.load.shapes import (
    ClosedLoop,
    OpenLoop,
    Recorded,
    Sequential,
    Sessions,
    Sweep,
    SweptShape,
    TimedShape,
    Turn,
    Waves,
)
from mlxproxy.load.slo import DEFAULT_SLO, parse_slo
from mlxproxy.load.sweep import DEFAULT_BUDGET_S, DEFAULT_STEP_MIN_S, StepRun
from mlxproxy.load.workers import ONE_PROCESS, Workers, closed_loop_step, open_loop_step, run_shape, workers_section
from mlxproxy.load.workers import run_sessions as sessions_on

__all__ = ["ReplayOptions", "prepare", "run_replay", "select"]


@dataclass(frozen=True)
class ReplayOptions:
    mode: str = "recorded"  # recorded | sequential | concurrency | batch | rate
    speed: float = 1.0
    concurrency: int = 1
    batch: int = 2
    repeat: int = 1
    warmup: int = 0
    nonce: bool = True
    batches: tuple[int, ...] = ()  # batch mode: wave sizes, one group each (default: (batch,))
    model: str | None = None
    limit: int | None = None
    filters: tuple[tuple[str, str], ...] = ()
    rate: float | None = None  # rate mode: requests/s (open loop)
    arrival: str = "constant"  # rate mode: constant | poisson
    seed: int = 0  # rate mode: the Poisson schedule's seed
    ramp_s: float = 0.0  # rate mode: an unmeasured ramp up to the rate first
    sweep: bool = False  # concurrency mode: closed-loop steps (sweep_steps, or doubling from 1)
    sweep_steps: tuple[float, ...] = ()
    slo: dict[str, float] | None = None  # the sweep's SLO (default: mlxproxy.load.DEFAULT_SLO)
    sessions: int = 1  # sessions mode: conversations run at once
    think_time: float | None = (
        None  # sessions mode: seconds between a response's end and the next turn (None: captured)
    )
    budget_s: float = DEFAULT_BUDGET_S  # a doubling sweep refines its answer while it has run less than this
    step_time: float = DEFAULT_STEP_MIN_S  # a closed-loop sweep step sends its mix again until it ran this long
    runs: int = 1  # the whole sweep search this many times (--runs)
    max_connections: int | None = None  # per target and process (--max-connections; None: the default)
    refine: bool = True  # a doubling sweep refines its answer (--sweep auto), else stops at a power of two
    workers: Workers = ONE_PROCESS  # the processes or cluster the requests are sent from (not sequential, batch)


def select(
    caps: Sequence[CapturedRequest], filters: Sequence[tuple[str, str]], limit: int | None
) -> list[CapturedRequest]:
    """Captured requests matching every `key=glob` filter (keys: model, endpoint, path, outcome)."""
    out = []
    for c in caps:
        values = {
            "model": c.record.model or "",
            "endpoint": c.record.endpoint,
            "path": c.path,
            "outcome": c.record.outcome,
        }
        if all(fnmatch.fnmatchcase(values.get(k, ""), pat) for k, pat in filters):
            out.append(c)
    return out[:limit] if limit is not None else out


def _marked(m: dict[str, Any], nonce: str) -> dict[str, Any]:
    """A message (or Responses input item) whose text begins with `nonce`."""
    m = dict(m)
    c = m.get("content")
    if isinstance(c, str):
        m["content"] = nonce + c
    elif isinstance(c, list) and c and isinstance(c[0], dict) and isinstance(c[0].get("text"), str):
        m["content"] = [{**c[0], "text": nonce + c[0]["text"]}, *c[1:]]
    return m


def _marked_list(items: list[Any], nonce: str) -> list[Any]:
    out = [_marked(items[0], nonce), *items[1:]]
    user = next((i for i, m in enumerate(out) if isinstance(m, dict) and m.get("role") == "user"), None)
    if user:
        out[user] = _marked(out[user], nonce)
    return out


def _with_nonce(obj: dict[str, Any], nonce: str) -> None:
    """`nonce` at the start of the prompt (so no cache holds any of it) and, where the first
    message is not the user's (a system prompt), at the start of the first user message too:
    a conversation is known by its first user message, so two runs of the same captured
    conversation stay two conversations (never one that seems to restart its prompt)."""
    msgs = obj.get("messages")
    if isinstance(msgs, list) and msgs and isinstance(msgs[0], dict):
        obj["messages"] = _marked_list(msgs, nonce)
    elif isinstance(obj.get("prompt"), str):
        obj["prompt"] = nonce + obj["prompt"]
    elif isinstance(obj.get("input"), str):  # OpenAI Responses
        obj["input"] = nonce + obj["input"]
    elif isinstance(obj.get("input"), list) and obj["input"] and isinstance(obj["input"][0], dict):
        obj["input"] = _marked_list(obj["input"], nonce)


def _unprivate(obj: dict[str, Any]) -> dict[str, Any]:
    """A privacy capture's message lengths turned back into filler text of that length."""
    msgs = obj.get("messages")
    if isinstance(msgs, list) and any(isinstance(m, dict) and "content_chars" in m for m in msgs):
        new = []
        for m in msgs:
            if isinstance(m, dict) and "content_chars" in m:
                n = int(m["content_chars"])
                m = {k: v for k, v in m.items() if k != "content_chars"}
                m["content"] = filler_text(n)
            new.append(m)
        obj = {**obj, "messages": new}
    for key in ("prompt", "system", "instructions", "input"):  # Messages `system`, Responses `instructions`/`input`
        if f"{key}_chars" in obj and key not in obj:
            n = int(obj[f"{key}_chars"])
            obj = {k: v for k, v in obj.items() if k != f"{key}_chars"}
            obj[key] = filler_text(n)
    inp = obj.get("input")
    if isinstance(inp, list) and any(isinstance(it, dict) and "content_chars" in it for it in inp):
        items = []
        for it in inp:
            if isinstance(it, dict) and "content_chars" in it:
                n = int(it["content_chars"])
                it = {k: v for k, v in it.items() if k != "content_chars"}
                if it.get("type") == "function_call_output":
                    it["output"] = filler_text(n)
                elif it.get("type") == "function_call":
                    it["arguments"] = "{}"
                else:
                    it["content"] = filler_text(n)
            items.append(it)
        obj = {**obj, "input": items}
    return obj


def prepare(c: CapturedRequest, opts: ReplayOptions, nonce: str | None = None) -> PreparedRequest:
    """The request to send for one captured request, with only the documented rewrites.
    `nonce`: this marker instead of a new one (the turns of one replayed session share one,
    so each turn can reuse the prompt cache of the turns before it, as in real use)."""
    headers = tuple(
        (k, v) for k, v in (c.raw.get("request_headers") or []) if v != REDACTED
    )  # hop-by-hop: loadgen drops
    if c.request is None:
        return PreparedRequest(c.method, c.path, c.request_bytes or b"", headers, c.offset_s, c.record.id)
    obj = _unprivate(c.request)
    if opts.model is not None:
        obj = {**obj, "model": opts.model}
    if opts.nonce:
        obj = dict(obj)
        _with_nonce(obj, nonce or f"[nonce {os.urandom(6).hex()}] ")
    body = orjson.dumps(obj)
    if obj.get("stream") is True and endpoint_of(c.path) in ("chat_completions", "completions"):
        # Messages and Responses streams always report usage (and reject stream_options)
        so = obj.get("stream_options")
        if not (isinstance(so, dict) and so.get("include_usage")):
            body = inject_include_usage(body, obj)
    return PreparedRequest(c.method, c.path, body, headers, c.offset_s, c.record.id, label=c.record.id)


def _first_user(obj: dict[str, Any]) -> bytes | None:
    msgs = obj.get("messages")
    if not isinstance(msgs, list):
        return None
    first = next((m for m in msgs if isinstance(m, dict) and m.get("role") == "user"), None)
    if first is None:
        return None
    return orjson.dumps({k: first.get(k) for k in ("content", "content_chars")}, option=orjson.OPT_SORT_KEYS)


def split_sessions(caps: Sequence[CapturedRequest]) -> list[list[CapturedRequest]]:
    """A capture split into conversations, in the order they began: the requests whose
    first user message is the same, while their message lists keep growing (a list that
    does not grow starts a new conversation: the same task begun again). A request without
    a message list is a conversation of its own."""
    sessions: list[list[CapturedRequest]] = []
    open_by_key: dict[bytes, int] = {}
    for c in sorted(caps, key=lambda c: c.offset_s):
        key = _first_user(c.request) if c.request is not None else None
        n = len(c.request["messages"]) if key is not None and c.request is not None else 0
        i = open_by_key.get(key) if key is not None else None
        if i is not None and n > len(sessions[i][-1].request["messages"]):  # type: ignore[index]
            sessions[i].append(c)
            continue
        sessions.append([c])
        if key is not None:
            open_by_key[key] = len(sessions) - 1
    return sessions


def captured_think_s(prev: CapturedRequest, c: CapturedRequest) -> float:
    """Seconds between the end of `prev`'s response and the start of `c`, as captured."""
    return max(0.0, c.offset_s - (prev.offset_s + (prev.record.duration_s or 0.0)))


BUILTIN_AGENT = "builtin:agent"


def synthetic_agent_session(turns: int = 6, think_s: float = 1.5, max_tokens: int = 256) -> list[CapturedRequest]:
    """A small made-up coding-agent conversation, for `replay builtin:agent` when there is no
    capture: a ~1,500-token system prompt with tool definitions, a task, then turns that each
    add the assistant's tool call and the tool's result (~800 tokens of file or test output),
    so the prompt grows as an agent's does; `think_s` between a response's end and the next
    turn stands for the tool running. Each turn is recorded as lasting 4 s. Deterministic."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": name,
                "description": desc,
                "parameters": {"type": "object", "properties": {"arg": {"type": "string"}}, "required": ["arg"]},
            },
        }
        for name, desc in (
            ("read_file", "Read a file of the repository."),
            ("run_tests", "Run the test suite."),
            ("edit_file", "Replace a range of lines in a file."),
        )
    ]
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent working in a Python repository. " + filler_text(6000)},
        {"role": "user", "content": "The test tests/test_parser.py::test_nested fails; find out why and fix it."},
    ]
    out: list[CapturedRequest] = []
    offset = 0.0
    for i in range(turns):
        body = {
            "model": "default_model",
            "stream": True,
            "max_tokens": max_tokens,
            "temperature": 0,
            "messages": [dict(m) for m in messages],
            "tools": tools,
        }
        rec = Record(
            id=f"agent-turn-{i + 1}",
            started_at=offset,
            upstream="synthetic",
            model="default_model",
            endpoint="chat_completions",
            stream=True,
            status=200,
            outcome="ok",
            method="POST",
            path="/v1/chat/completions",
            duration_s=4.0,
        )
        out.append(
            CapturedRequest(
                record=rec,
                method="POST",
                path="/v1/chat/completions",
                offset_s=offset,
                request=body,
                request_bytes=None,
                raw={},
            )
        )
        tool = ("read_file", "run_tests", "edit_file")[i % 3]
        call_id = f"call_{i + 1}"
        messages.append(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": tool, "arguments": f'{{"arg": "step {i + 1}"}}'},
                    }
                ],
            }
        )
        messages.append({"role": "tool", "tool_call_id": call_id, "content": filler_text(3200)})
        offset += 4.0 + think_s
    return out


def compare_rows(caps: dict[str, CapturedRequest], timed: Timed) -> list[CompareRow]:
    """Each replayed request's TTFT and decode TPS next to its captured values."""
    rows: list[CompareRow] = []
    for r in timed.records:
        src = timed.source_ids.get(r.id)
        c = caps.get(src) if src else None
        if src is None or c is None:
            continue
        rows.append(
            {
                "source_id": src,
                "model": r.model,
                "captured_ttft_s": c.record.ttft_s,
                "replayed_ttft_s": r.ttft_s,
                "captured_cached_tokens": c.record.cached_tokens,
                "replayed_cached_tokens": r.cached_tokens,
                "replayed_prompt_tokens": r.prompt_tokens,
                "captured_decode_tps": c.record.decode_tps,
                "replayed_decode_tps": r.decode_tps,
                "captured_outcome": c.record.outcome,
                "replayed_outcome": r.outcome,
            }
        )
    return rows


def served_from_cache(records: Iterable[RunRecord]) -> tuple[int, int]:
    """(requests whose prompt was mostly cached, requests that reported prompt tokens):
    their TTFT measures the prompt cache, not prefill."""
    reported = [(p, r.record.cached_tokens or 0) for r in records if (p := r.record.prompt_tokens)]
    cached = [p for p, c in reported if c > MOSTLY_CACHED * p]
    return len(cached), len(reported)


def _group(
    name: str,
    kind: GroupKind,
    target: str,
    params: JSONObject,
    timed: Timed,
    summary: Summary,
    compare: list[CompareRow] | None = None,
    where: Mapping[str, SessionTurn] | None = None,
) -> Group:
    """A group of `timed`'s records, each with its `source_id` (and its session's `where` keys)."""
    records = timed.rows(where)
    return Group(name, target, name, kind, params, summary, tuple(records), None if compare is None else tuple(compare))


def generation_mix(caps: Sequence[CapturedRequest]) -> list[CapturedRequest]:
    """What a sweep sends: the generation requests of the capture (not `GET /v1/models`)."""
    return [c for c in caps if c.request is not None and endpoint_of(c.path) in GENERATION_ENDPOINTS]


class _ReplayRun:
    """One replay against one target: which load shape the options ask for, the requests it
    sends (prepared anew for every phase: with the nonce on, the baseline, each wave size and
    each repeat send prompts no cache has seen) and the groups it makes."""

    def __init__(
        self,
        client: MeasuringClient,
        caps: Sequence[CapturedRequest],
        opts: ReplayOptions,
        target: str,
        th: Thresholds,
        compare: bool,
        groups: list[Group],
        say: Callable[[str], None] | None,
    ) -> None:
        self.client, self.caps, self.opts, self.target, self.th = client, caps, opts, target, th
        self.compare, self.groups, self.say = compare, groups, say
        self.by_id = {c.record.id: c for c in caps}
        self.params: dict[str, JSONValue] = {
            "speed": opts.speed,
            "concurrency": opts.concurrency,
            "batch": opts.batch,
            "repeat": opts.repeat,
            "nonce": opts.nonce,
            "model": opts.model,
        }
        self.mode = _mode_name(opts)

    def fresh(self) -> list[PreparedRequest]:
        return [prepare(c, self.opts) for _ in range(self.opts.repeat) for c in self.caps]

    def finish(self, mode: str, kind: GroupKind, timed: Timed, summary: Summary, params: JSONObject) -> None:
        scaling = prefill_scaling(timed.records, self.th)
        if scaling is not None:
            summary = summary.with_anomaly(scaling.kind, 1, scaling.evidence)
        rows = compare_rows(self.by_id, timed) if self.compare else None
        self.groups.append(_group(mode, kind, self.target, params, timed, summary, rows))

    def shape(self) -> TimedShape:
        """The load shape of a single test (not a sweep, sessions or batch)."""
        opts = self.opts
        if opts.mode == "recorded":
            return Recorded(opts.speed)
        if opts.mode == "rate":
            return OpenLoop(opts.rate or 1.0, opts.arrival, opts.seed, opts.ramp_s)
        if opts.mode == "concurrency":
            return ClosedLoop(opts.concurrency)
        return Sequential()

    async def run(self, tick: Progress) -> None:
        opts = self.opts
        if opts.sweep:
            await self.sweep(tick)
        elif opts.mode == "sessions":
            await self.sessions(tick)
        elif opts.mode == "batch":
            await self.batch(tick)
        elif isinstance(shape := self.shape(), OpenLoop):
            ramp = [prepare(self.caps[i % len(self.caps)], opts) for i in range(shape.ramp_size())]
            timed = await run_shape(opts.workers, shape, self.client, self.fresh(), tick, ramp)
            sent = [r.t_start_mono for r in timed.records]
            summary = workers_section(summarize_records(timed.records, lag_s=timed.lag_s, send_times=sent), timed)
            self.finish(self.mode, "rate", timed, summary, {**self.params, **shape.params(len(timed.records))})
        else:
            timed = await run_shape(opts.workers, shape, self.client, self.fresh(), tick)
            lag = timed.lag_s if isinstance(shape, Recorded) else None
            summary = workers_section(summarize_records(timed.records, lag_s=lag), timed)
            self.finish(self.mode, "replay", timed, summary, self.params)

    async def sessions(self, tick: Progress) -> None:
        opts = self.opts
        runs = max(opts.sessions, len(split_sessions(self.caps)) * opts.repeat)
        timed, where, sess = await run_sessions(self.client, self.caps, opts, opts.sessions, runs, tick)
        summary = workers_section(summarize_records(timed.records), timed).updated({"sessions": sess})
        params = {**self.params, "sessions": opts.sessions, "think_time": opts.think_time}
        self.groups.append(
            _group(f"sessions {opts.sessions}", "sessions", self.target, params, timed, summary, None, where)
        )

    async def batch(self, tick: Progress) -> None:
        single = await Sequential().run(self.client, self.fresh(), tick)
        s_single = summarize_records(single.records)
        self.groups.append(_group("single", "single", self.target, self.params, single, s_single))
        for size in self.opts.batches or (self.opts.batch,):
            timed, waves = await Waves(size).run_waves(self.client, self.fresh(), tick)
            summary = summarize_records(timed.records, waves=waves, single_wall_tps=s_single.wall_tps.p50)
            self.finish(f"batch {size}", "wave", timed, summary, {**self.params, "batch": size})

    async def sweep(self, tick: Progress) -> None:
        """A sweep of the capture's generation requests (the same mix at every step): rates
        (open loop), conversations (whole, every turn) or closed-loop streams."""
        opts = self.opts
        mix = generation_mix(self.caps)
        if not mix:
            raise ValueError(
                "a sweep needs generation requests (chat, completions, messages, responses); none selected"
            )
        reps = [c for _ in range(opts.repeat) for c in mix]

        def copies(k: int) -> list[PreparedRequest]:
            return [prepare(reps[i % len(reps)], opts) for i in range(k * len(reps))]

        def cycle(k: int) -> list[PreparedRequest]:
            return [prepare(reps[i % len(reps)], opts) for i in range(k)]

        slo = opts.slo or parse_slo(DEFAULT_SLO)

        async def sweep(
            shape: Sweep[SweptShape], step: Callable[[SweptShape], Awaitable[StepRun]], **params: JSONValue
        ) -> None:
            await shape.run(
                step, slo, target=self.target, params={**self.params, **params}, out=self.groups, say=self.say,
                progress=tick,
            )  # fmt: skip

        steps, refine, budget = opts.sweep_steps, opts.refine, opts.budget_s
        if opts.mode == "rate":
            open_loop = OpenLoop(1.0, opts.arrival, opts.seed, opts.ramp_s)
            shape = Sweep(open_loop, steps or (opts.rate or 1.0,), refine, budget, opts.step_time, opts.runs)
            step = open_loop_step(self.client, cycle, len(reps), opts.workers)
            await sweep(shape, step, arrival=opts.arrival, seed=opts.seed, ramp_s=opts.ramp_s)
        elif opts.mode == "sessions":
            convs = len(split_sessions(mix))

            async def sessions_step(shape: Sessions) -> StepRun:
                k = shape.at_once
                timed, where, _ = await run_sessions(self.client, mix, opts, k, k * convs * opts.repeat)
                return timed, where

            await sweep(
                Sweep(Sessions(1), steps, refine, budget, opts.step_time, opts.runs),
                sessions_step,
                think_time=opts.think_time,
            )
        else:
            await sweep(
                Sweep(ClosedLoop(1), steps, refine, budget, opts.step_time, opts.runs),
                closed_loop_step(self.client, copies, len(reps), 1, opts.workers),
            )

    def interrupted(self, measured_from: int) -> None:
        """The requests finished so far but in no group yet, as one more group."""
        done = {r.id for g in self.groups for r in g.records}
        rest = [r for r in self.client.finished[measured_from:] if r.id not in done]
        if rest:
            name = f"{self.mode} interrupted"
            self.groups.append(
                _group(name, "interrupted", self.target, self.params, Timed(rest), summarize_records(rest))
            )


def _mode_name(opts: ReplayOptions) -> str:
    mode = {
        "recorded": f"recorded x{opts.speed:g}",
        "sequential": "sequential",
        "concurrency": f"concurrency {opts.concurrency}",
        "batch": "batch",
        "rate": f"{opts.arrival} {opts.rate:g}/s" if opts.rate else None,
        "sessions": f"sessions {opts.sessions}",
    }.get(opts.mode)
    if mode is None:
        raise ValueError(f"unknown replay mode {opts.mode!r}")
    return mode


async def run_replay(
    caps: Sequence[CapturedRequest],
    target_url: str,
    opts: ReplayOptions,
    *,
    target_name: str = "target",
    api_key: str | None = None,
    thresholds: Thresholds | None = None,
    timeout_s: float = 1800.0,
    progress: bool | None = None,
    compare: bool = False,
    out: list[Group] | None = None,
    say: Callable[[str], None] | None = None,
) -> list[Group]:
    """Run one replay; return the result groups (see `mlxproxy.load.report`). Groups are
    appended to `out` (when given) as they finish; when the run is cancelled (Ctrl-C),
    the requests finished so far are appended as one more group (mode `... interrupted`)."""
    th = thresholds or Thresholds()
    groups: list[Group] = out if out is not None else []
    _mode_name(opts)  # an unknown mode fails before anything is sent
    n = len(caps) * opts.repeat
    async with MeasuringClient(
        target_url, name=target_name, thresholds=th, api_key=api_key, timeout_s=timeout_s,
        max_connections=opts.max_connections,
    ) as client:  # fmt: skip
        if opts.warmup:
            await Sequential().run(client, [prepare(c, opts) for c in caps[: opts.warmup]])
        measured_from = len(client.finished)
        run = _ReplayRun(client, caps, opts, target_name, th, compare, groups, say)
        total = None if opts.sweep else n * (1 + len(opts.batches or (opts.batch,)) if opts.mode == "batch" else 1)
        tick = Progress(f"replay {target_name}", total, progress, client)
        tick.start()
        try:
            await run.run(tick)
        except asyncio.CancelledError:
            run.interrupted(measured_from)
            raise
        finally:
            tick.close()
    return groups


async def run_sessions(
    client: MeasuringClient,
    caps: Sequence[CapturedRequest],
    opts: ReplayOptions,
    at_once: int,
    runs: int,
    tick: Callable[[], None] | None = None,
) -> tuple[Timed, dict[str, SessionTurn], JSONObject]:
    """`at_once` conversations at a time, `runs` conversation runs in all (the capture's
    conversations in order, cycled), each its turns in order with the think time between
    a response's end and the next turn (`Sessions`); each run has its own nonce (so it is a
    conversation of its own, never the continuation of another run). Returns the records,
    each record's `session`, `turn` and `think_s`, and the `sessions` summary."""
    convs = split_sessions(caps)
    if client.prefixes is None:  # each turn's re-prefill cause (the report's sessions view)
        client.prefixes = PrefixIndex()
    plans = [_session_run(convs[i % len(convs)], opts) for i in range(runs)]
    timed, where, session_s = await sessions_on(opts.workers, Sessions(at_once), client, plans, tick)
    return timed, where, {"count": runs, "conversations": len(convs), "session_s": summarize(session_s)}


def _session_run(conv: Sequence[CapturedRequest], opts: ReplayOptions) -> list[Turn]:
    """One run of a conversation: its turns prepared with one nonce of their own, each with
    its think time (`--think-time`, else as captured)."""
    nonce = f"[nonce {os.urandom(6).hex()}] " if opts.nonce else None
    turns = []
    for ti, c in enumerate(conv):
        think = 0.0
        if ti:
            think = opts.think_time if opts.think_time is not None else captured_think_s(conv[ti - 1], c)
        turns.append(Turn(prepare(c, opts, nonce), think))
    return turns


def run(caps: Sequence[CapturedRequest], target_url: str, opts: ReplayOptions, **kw: Any) -> list[Group]:
    return run_async(run_replay(caps, target_url, opts, **kw))


def records_of(group: Group) -> list[Record]:
    return [r.record for r in group.records]
