"""A discrete-event model of one MLX inference device: pure, no clock, no I/O.

The engine plans *when* things happen; it never sleeps. The shell (`app.py`) admits requests
at the simulated time they arrive, asks `next_event_time()`, sleeps until then and calls
`advance(t_s)`, which returns every event due by `t_s` in time order. Tests drive it with
scripted times and assert the timelines exactly.

The device does one piece of work at a time, never preempted:

- **prefill** of one request: `prefill_s(profile, P)` seconds; it emits `PrefillProgress` at
  every `prefill_step_tokens` boundary and at P, and the request's first token (index 0) at its
  end (TTFT of a lone request == `prefill_s(P)`).
- **decode step** over the streams that are decoding: `step_s(profile, n)` seconds (plus
  `stall_s` when any stream in the step produces a token index that is a multiple of
  `stall_every_tokens`); every stream in the step gets one token at its end.

Scheduling when the device is free at time t:

- continuous batching (`serial=False`): headers at admission; if a request waits for prefill
  (and fewer than `max_batch_streams` streams decode) its prefill runs next, pausing decode;
  otherwise one decode step for all decoding streams, n = their number.
- serial (`serial=True`): one request at a time. The next waiting request gets its `Headers`
  only when the device is free of the previous one, then its prefill, then its decode steps
  with n = 1 + the number of requests waiting behind it.

A prompt longer than `max_context_tokens` gets `Rejected` instead of `Headers` (at the moment
its headers would have been sent). All times are simulated seconds (floats).

Jitter (`jitter_s` > 0): each request reaches the device a random while after it arrived,
exponentially distributed with mean `jitter_s`, drawn from the engine's seeded generator in
admission order (the same seed and arrivals give the same plan). The wait is the request's
alone (a busy host, a network): it adds to the request's TTFT and E2E and never occupies the
device, so what the device can take (a `max_batch_streams` capacity) is unchanged.
"""

from __future__ import annotations

import heapq
import random
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from mlxproxy.sim.profiles import Profile


def prefill_s(profile: Profile, prompt_tokens: int) -> float:
    """Seconds to prefill `prompt_tokens`: linear, superlinear past `superlinear_after_tokens`."""
    linear_s = prompt_tokens / profile.prefill_tps
    knee = profile.superlinear_after_tokens
    if knee is None or prompt_tokens <= knee or profile.superlinear_exponent == 1.0:
        return linear_s
    factor: float = (prompt_tokens / knee) ** (profile.superlinear_exponent - 1.0)
    return linear_s * factor


def step_s(profile: Profile, n_streams: int) -> float:
    """Seconds of one decode step shared by `n_streams` (>= 1): (1 + penalty*(n-1)) / decode_tps."""
    return (1.0 + profile.batch_penalty * (max(n_streams, 1) - 1)) / profile.decode_tps


@dataclass(frozen=True)
class Headers:
    """The response may start (status line and headers) at `t_s`."""

    req_id: str
    t_s: float


@dataclass(frozen=True)
class Rejected:
    """The prompt exceeds `max_context_tokens`; answer with an error at `t_s`. Terminal."""

    req_id: str
    t_s: float
    prompt_tokens: int
    max_context_tokens: int


@dataclass(frozen=True)
class PrefillProgress:
    """`processed_tokens` of `total_tokens` prompt tokens are prefilled at `t_s`."""

    req_id: str
    t_s: float
    processed_tokens: int
    total_tokens: int


@dataclass(frozen=True)
class Token:
    """Generated token number `index` (0-based) is ready at `t_s`."""

    req_id: str
    t_s: float
    index: int


@dataclass(frozen=True)
class Finish:
    """The request generated its `n_tokens` tokens; the last one came at `t_s`. Terminal."""

    req_id: str
    t_s: float
    n_tokens: int


Event = Headers | Rejected | PrefillProgress | Token | Finish


@dataclass
class _Request:
    req_id: str
    admitted_s: float
    prompt_tokens: int
    n_tokens: int
    emitted: int = 0
    cancelled: bool = False


@dataclass
class _Arrive:
    """A request reaches the device after its jitter."""

    req: _Request


@dataclass
class _WorkDone:
    kind: str  # "prefill" or "step"
    requests: list[_Request] = field(default_factory=list)


class Engine:
    """The device's scheduler. Not thread-safe; drive it from one thread or event loop.

    Contract: times passed to `admit`, `cancel` and `advance` never go backwards (ValueError
    otherwise). Events are returned by `advance` in time order (ties: in the order they were
    planned); events of a cancelled request are dropped.
    """

    def __init__(self, profile: Profile, seed: int = 0) -> None:
        self.profile = profile
        self._rng = random.Random(seed)
        self.now_s = 0.0
        self._heap: list[tuple[float, int, object]] = []
        self._seq = 0
        self._outbox: list[Event] = []
        self._live: dict[str, _Request] = {}
        self._waiting: deque[_Request] = deque()
        self._decoding: list[_Request] = []
        self._serial_active: _Request | None = None
        self._busy = False

    # -- public API -------------------------------------------------------------------------

    def admit(self, req_id: str, t_s: float, prompt_tokens: int, n_tokens: int) -> None:
        """A request arrives at `t_s` with `prompt_tokens` to prefill and `n_tokens` (>= 1) to make."""
        if req_id in self._live:
            raise ValueError(f"request id {req_id!r} is already in flight")
        if prompt_tokens < 0 or n_tokens < 1:
            raise ValueError(f"need prompt_tokens >= 0 and n_tokens >= 1, got {prompt_tokens}, {n_tokens}")
        self._run_until(t_s)
        req = _Request(req_id, t_s, prompt_tokens, n_tokens)
        if not self.profile.serial:
            if self._over_context(req):
                self._reject(req, t_s)
                return
            self._outbox.append(Headers(req_id, t_s))
        self._live[req_id] = req
        if self.profile.jitter_s > 0:
            self._push(t_s + self._rng.expovariate(1.0 / self.profile.jitter_s), _Arrive(req))
            return
        self._waiting.append(req)
        if not self._busy:
            self._start_work(t_s)

    def cancel(self, req_id: str, t_s: float) -> None:
        """Forget a request (client gone) at `t_s`; work already started on it still takes its time."""
        self._run_until(t_s)
        req = self._live.pop(req_id, None)
        if req is None:
            return
        req.cancelled = True
        if req in self._waiting:
            self._waiting.remove(req)
        if req in self._decoding:
            self._decoding.remove(req)
        if self._serial_active is req:
            self._serial_active = None
        if not self._busy:
            self._start_work(t_s)

    def next_event_time(self) -> float | None:
        """Simulated time of the next planned event, or None when nothing is planned."""
        if self._outbox:
            return self.now_s
        return self._heap[0][0] if self._heap else None

    def advance(self, t_s: float) -> list[Event]:
        """Run the model up to `t_s` and return the events due by then, in time order."""
        self._run_until(t_s)
        out, self._outbox = self._outbox, []
        return out

    def drain(self) -> list[Event]:
        """Run until nothing is planned and return all remaining events (tests and planning)."""
        while self._heap:
            self._run_until(self._heap[0][0])
        out, self._outbox = self._outbox, []
        return out

    @property
    def in_flight(self) -> int:
        """Requests admitted and not yet finished, rejected or cancelled."""
        return len(self._live)

    # -- internals --------------------------------------------------------------------------

    def _run_until(self, t_s: float) -> None:
        if t_s < self.now_s:
            raise ValueError(f"time went backwards: {t_s} < {self.now_s}")
        while self._heap and self._heap[0][0] <= t_s:
            when, _, item = heapq.heappop(self._heap)
            self.now_s = when
            if isinstance(item, _WorkDone):
                self._busy = False
                self._complete(item, when)
                if not self._busy:
                    self._start_work(when)
            elif isinstance(item, PrefillProgress):
                if item.req_id in self._live:
                    self._outbox.append(item)
            elif isinstance(item, _Arrive) and not item.req.cancelled:
                self._waiting.append(item.req)
                if not self._busy:
                    self._start_work(when)
        self.now_s = t_s

    def _push(self, when: float, item: object) -> None:
        heapq.heappush(self._heap, (when, self._seq, item))
        self._seq += 1

    def _over_context(self, req: _Request) -> bool:
        limit = self.profile.max_context_tokens
        return limit is not None and req.prompt_tokens > limit

    def _reject(self, req: _Request, t_s: float) -> None:
        limit = self.profile.max_context_tokens
        assert limit is not None
        self._outbox.append(Rejected(req.req_id, t_s, req.prompt_tokens, limit))
        self._live.pop(req.req_id, None)

    def _start_work(self, t_s: float) -> None:
        if self.profile.serial:
            self._start_serial(t_s)
            return
        limit = self.profile.max_batch_streams
        if self._waiting and (limit is None or len(self._decoding) < limit):
            self._start_prefill(self._waiting.popleft(), t_s)
        elif self._decoding:
            self._start_step(list(self._decoding), len(self._decoding), t_s)

    def _start_serial(self, t_s: float) -> None:
        if self._serial_active is not None:
            self._start_step([self._serial_active], 1 + len(self._waiting), t_s)
            return
        while self._waiting:
            req = self._waiting.popleft()
            if self._over_context(req):
                self._reject(req, t_s)
                continue
            self._outbox.append(Headers(req.req_id, t_s))
            self._serial_active = req
            self._start_prefill(req, t_s)
            return

    def _start_prefill(self, req: _Request, t_s: float) -> None:
        total = req.prompt_tokens
        step = self.profile.prefill_step_tokens
        for processed in [*range(step, total, step), total] if total > 0 else []:
            when = t_s + prefill_s(self.profile, processed)
            self._push(when, PrefillProgress(req.req_id, when, processed, total))
        self._busy = True
        self._push(t_s + prefill_s(self.profile, total), _WorkDone("prefill", [req]))

    def _start_step(self, reqs: list[_Request], n_streams: int, t_s: float) -> None:
        duration_s = step_s(self.profile, n_streams)
        every = self.profile.stall_every_tokens
        if every is not None and any(r.emitted % every == 0 for r in reqs):
            duration_s += self.profile.stall_s
        self._busy = True
        self._push(t_s + duration_s, _WorkDone("step", reqs))

    def _complete(self, work: _WorkDone, t_s: float) -> None:
        for req in work.requests:
            if req.cancelled:
                continue
            self._outbox.append(Token(req.req_id, t_s, req.emitted))
            req.emitted += 1
            if req.emitted >= req.n_tokens:
                self._outbox.append(Finish(req.req_id, t_s, req.n_tokens))
                self._live.pop(req.req_id, None)
                if req in self._decoding:
                    self._decoding.remove(req)
                if self._serial_active is req:
                    self._serial_active = None
            elif work.kind == "prefill" and not self.profile.serial:
                self._decoding.append(req)


@dataclass(frozen=True)
class Arrival:
    """A scripted request for `plan`: arrives at `t_s` (simulated seconds)."""

    req_id: str
    t_s: float
    prompt_tokens: int
    n_tokens: int


def plan(profile: Profile, arrivals: Iterable[Arrival]) -> list[Event]:
    """All events of a fixed set of arrivals, run to completion (ties keep the given order)."""
    engine = Engine(profile)
    for arrival in sorted(arrivals, key=lambda a: a.t_s):
        engine.admit(arrival.req_id, arrival.t_s, arrival.prompt_tokens, arrival.n_tokens)
    return engine.drain()


@dataclass(frozen=True)
class Timeline:
    """One request's planned moments (simulated seconds); None = did not happen."""

    req_id: str
    headers_s: float | None = None
    rejected_s: float | None = None
    progress: tuple[tuple[float, int], ...] = ()
    token_s: tuple[float, ...] = ()
    finish_s: float | None = None

    @property
    def first_token_s(self) -> float | None:
        return self.token_s[0] if self.token_s else None


def timelines(events: Iterable[Event]) -> dict[str, Timeline]:
    """Group events by request into `Timeline`s (insertion order = first event seen)."""
    order: dict[str, None] = {}  # request ids, first event seen first
    marks: dict[tuple[str, str], float] = {}  # (request id, "headers" | "rejected" | "finish") -> t
    progress: dict[str, list[tuple[float, int]]] = {}
    tokens: dict[str, list[float]] = {}
    for ev in events:
        order.setdefault(ev.req_id)
        if isinstance(ev, Headers):
            marks[ev.req_id, "headers"] = ev.t_s
        elif isinstance(ev, Rejected):
            marks[ev.req_id, "rejected"] = ev.t_s
        elif isinstance(ev, PrefillProgress):
            progress.setdefault(ev.req_id, []).append((ev.t_s, ev.processed_tokens))
        elif isinstance(ev, Token):
            tokens.setdefault(ev.req_id, []).append(ev.t_s)
        elif isinstance(ev, Finish):
            marks[ev.req_id, "finish"] = ev.t_s
    return {
        req_id: Timeline(
            req_id,
            headers_s=marks.get((req_id, "headers")),
            rejected_s=marks.get((req_id, "rejected")),
            progress=tuple(progress.get(req_id, ())),
            token_s=tuple(tokens.get(req_id, ())),
            finish_s=marks.get((req_id, "finish")),
        )
        for req_id in order
    }


def planned_speedup(profile: Profile, n_parallel: int = 2, prompt_tokens: int = 20, n_tokens: int = 64) -> float:
    """Aggregate TPS of `n_parallel` identical requests released together / wall TPS of one alone.

    This is METRICS.md's "speedup" as the engine plans it (no network overhead): compare a
    measured speedup with this, for the same prompt and output sizes.
    """
    alone = timelines(plan(profile, [Arrival("solo", 0.0, prompt_tokens, n_tokens)]))["solo"]
    assert alone.finish_s is not None
    together = plan(profile, [Arrival(f"r{i}", 0.0, prompt_tokens, n_tokens) for i in range(n_parallel)])
    end_s = max(t.finish_s or 0.0 for t in timelines(together).values())
    return (n_parallel * n_tokens / end_s) / (n_tokens / alone.finish_s)
