"""The simulator's ASGI shell: plays the engine's plan on real sockets.

`create_app(profile, speed=, seed=, **overrides)` returns an ASGI app. One `Engine` per app
plans every request; a single timer (`loop.call_later` aimed at absolute `perf_counter`
deadlines, so nothing drifts) advances it and hands each event to the waiting response, which
renders it (`render.py`) and writes it at once: one write per token, never buffered.
Simulated time runs `speed` times faster than the wall clock, starting when the app starts;
if the process falls more than 20 ms behind the plan, the simulated clock pauses for that long
(one longer gap) rather than sending the overdue tokens in a burst.

Routes: POST `/v1/chat/completions`, `/chat/completions`, `/v1/completions`, `/completions`;
GET `/v1/models`, `/models`, `/health`; GET `/sim/profile` (the effective knobs, the truth)
and GET `/sim/requests` (the planned timeline of recent requests, simulated seconds).
Request headers: `X-Sim-Fault` (see `faults.py`), `X-Sim-Prompt-Tokens: N`.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import time
from collections import deque
from typing import Any

import orjson

from mlxproxy.asgi import Receive, Scope, Send
from mlxproxy.sim.cache import PromptCache
from mlxproxy.sim.engine import Engine, Event, Finish, Headers, Rejected, Token
from mlxproxy.sim.faults import parse_faults
from mlxproxy.sim.profiles import Profile, get_profile, truth_lines
from mlxproxy.sim.render import Close, Renderer, Stall, Start, Write, json_start
from mlxproxy.sim.request import RequestError, parse_request, plan_output, reported_completion_tokens
from mlxproxy.sim.styles import style_class
from mlxproxy.sim.wire import Style, WireContext

COMPLETION_PATHS = {
    "/v1/chat/completions": "chat",
    "/chat/completions": "chat",
    "/v1/completions": "completions",
    "/completions": "completions",
    "/api/v0/chat/completions": "chat",
    "/api/v0/completions": "completions",
    "/api/chat": "ollama_chat",
    "/api/generate": "ollama_generate",
    "/v1/messages": "messages",
    "/api/v1/chat": "lmstudio_chat",
}
_BASE_ENDPOINTS = frozenset({"chat", "completions"})
_DISCONNECTED = object()
TRUTH_HISTORY = 1000
MAX_LAG_WALL_S = 0.02  # overdue by more than this: pause the simulated clock instead of bursting


class SimApp:
    """A simulated MLX server (ASGI 3). `profile`, `speed`, `seed` and `engine` are public."""

    def __init__(self, profile: Profile, *, speed: float = 1.0, seed: int = 0) -> None:
        if not speed > 0:
            raise ValueError(f"speed must be > 0, got {speed!r}")
        self.profile = profile
        self.speed = float(speed)
        self.seed = seed
        self.engine = Engine(profile, seed)
        self.truths: deque[dict[str, Any]] = deque(maxlen=TRUTH_HISTORY)
        self.clock_paused_s = 0.0  # wall seconds the simulated clock stood still (starved process)
        self._t0: float | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._queues: dict[str, asyncio.Queue[Any]] = {}
        self._count = 0
        self._style_cls = style_class(profile.wire)
        self._prompt_cache = PromptCache(profile.chars_per_token, profile.cache_drop) if profile.prompt_cache else None

    # -- clock and pump -----------------------------------------------------------------------

    def _ensure_started(self) -> None:
        if self._t0 is None:
            self._t0 = time.perf_counter()
        if self._loop is None:
            self._loop = asyncio.get_running_loop()

    def sim_now(self) -> float:
        """Simulated seconds since the app started."""
        assert self._t0 is not None
        return (time.perf_counter() - self._t0) * self.speed

    def wall_at(self, t_s: float) -> float:
        """The `perf_counter` value at which simulated time `t_s` is due."""
        assert self._t0 is not None
        return self._t0 + t_s / self.speed

    def _hold_clock_if_late(self) -> None:
        """If this process fell behind the plan (starved of CPU, GIL), pause the simulated clock.

        Without this, every overdue token would go out in one burst and a healthy profile would
        look like a non-incremental one; with it, the starvation shows as one longer gap, as a
        real server paused by its host would.
        """
        t_next = self.engine.next_event_time()
        if t_next is None or self._t0 is None:
            return
        lag_s = time.perf_counter() - self.wall_at(t_next)
        if lag_s > MAX_LAG_WALL_S:
            self._t0 += lag_s
            self.clock_paused_s += lag_s

    def _pump(self) -> None:
        self._timer = None
        self._hold_clock_if_late()
        for ev in self.engine.advance(max(self.sim_now(), self.engine.now_s)):
            queue = self._queues.get(ev.req_id)
            if queue is not None:
                queue.put_nowait(ev)
        self._schedule()

    def _schedule(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        t_next = self.engine.next_event_time()
        if t_next is not None and self._loop is not None:
            delay = self.wall_at(t_next) - time.perf_counter()
            self._timer = self._loop.call_later(max(delay, 0.0), self._pump)

    # -- ASGI ---------------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        self._ensure_started()
        path, method = scope["path"], scope["method"]
        if path in COMPLETION_PATHS and method == "POST":
            await self._completion(scope, receive, send, COMPLETION_PATHS[path])
        elif method == "GET" and path in ("/v1/models", "/models"):
            body = self._bare_style().models_body(
                self.profile.model_name, int(time.time()), self.profile.max_context_tokens
            )
            await _play_simple(send, json_start(200, [(b"content-type", b"application/json")], body))
        elif method == "GET" and (native := self._native_get(path)) is not None:
            await _play_simple(send, json_start(200, [(b"content-type", b"application/json; charset=utf-8")], native))
        elif method == "GET" and path == "/health":
            await _play_simple(
                send, json_start(200, [(b"content-type", b"application/json")], self._bare_style().health_body())
            )
        elif method == "GET" and path == "/sim/profile":
            body = orjson.dumps(
                {**self.profile.knobs(), "speed": self.speed, "seed": self.seed, "truth": truth_lines(self.profile)}
            )
            await _play_simple(send, json_start(200, [(b"content-type", b"application/json")], body))
        elif method == "GET" and path == "/sim/requests":
            body = orjson.dumps(
                {"speed": self.speed, "clock_paused_s": self.clock_paused_s, "requests": list(self.truths)}
            )
            await _play_simple(send, json_start(200, [(b"content-type", b"application/json")], body))
        else:
            status, headers, body = self._bare_style().not_found()
            await _play_simple(send, json_start(status, headers, body))

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self._ensure_started()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self._timer is not None:
                    self._timer.cancel()
                await send({"type": "lifespan.shutdown.complete"})
                return

    def _native_get(self, path: str) -> bytes | None:
        """A server's own GET route (Ollama's `/api/tags`, ...), if its style has one for `path`."""
        style = self._bare_style()
        get = getattr(style, "native_get", None)
        return None if get is None else get(path, self.profile.model_name)

    def _bare_style(self) -> Style:
        return self._style_cls(WireContext("", self.profile.model_name, 0))

    # -- completions --------------------------------------------------------------------------

    async def _completion(self, scope: Scope, receive: Receive, send: Send, endpoint: str) -> None:
        raw = await _read_body(receive)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        bare = self._bare_style()
        native: frozenset[str] = getattr(self._style_cls, "native_endpoints", frozenset())
        if (endpoint == "completions" and not self._style_cls.supports_completions) or (
            endpoint not in _BASE_ENDPOINTS and endpoint not in native
        ):
            await _play_simple(send, json_start(*bare.not_found()))
            return
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            await _play_simple(send, json_start(*bare.error(400, f"Invalid JSON in request body: {exc}")))
            return
        try:
            faults = parse_faults(headers.get("x-sim-fault", self.profile.faults))
            req = parse_request(body, endpoint, self.profile, headers.get("x-sim-prompt-tokens"))
        except ValueError as exc:  # a bad X-Sim-Fault
            await _play_simple(send, json_start(*bare.error(400, str(exc))))
            return
        except RequestError as exc:
            if exc.missing_field:
                await _play_simple(send, json_start(*bare.validation_error(exc.missing_field, body)))
            else:
                await _play_simple(send, json_start(*bare.error(exc.status, exc.message)))
            return
        if req.model is None and getattr(self._style_cls, "requires_model", False):
            await _play_simple(send, json_start(*bare.validation_error("model", body)))
            return
        self._count += 1
        req_id = f"req-{self._count}"
        default_model = "default_model" if self.profile.wire == "mlx-lm" else self.profile.model_name
        ctx = WireContext(
            response_id=self._style_cls.make_id(f"{self.seed}|{self._count}", endpoint),
            model=req.model or default_model,
            created=int(time.time()),
            endpoint=endpoint,
            include_usage=req.include_usage,
            stream_options_without_include_usage=req.stream and req.stream_options_without_include_usage,
        )
        plan = plan_output(req, self.profile, self.seed)
        cached = (
            self._prompt_cache.serve(req.prompt_text, req.prompt_tokens, req.model)
            if self._prompt_cache is not None
            else 0
        )
        self._hold_clock_if_late()
        admitted_s = max(self.sim_now(), self.engine.now_s)
        renderer = Renderer(
            self._style_cls(ctx),
            self.profile,
            plan,
            req.prompt_tokens,
            stream=req.stream,
            faults=faults,
            admitted_s=admitted_s,
        )
        renderer.cached_tokens = 0 if self.profile.cache_report == "hidden" else cached
        prefill = req.prompt_tokens - (0 if self.profile.cache_report == "claimed-cold" else cached)
        if plan.tool_name:
            renderer.style.tool_name = plan.tool_name
        if self.profile.speed_claims:
            renderer.style.speed_claims = self.profile.speed_claims  # type: ignore[attr-defined]
        renderer.wall_per_sim_s = 1.0 / self.speed  # the servers' timing claims are wall seconds
        truth: dict[str, Any] = {
            "request": req_id,
            "response_id": ctx.response_id,
            "endpoint": endpoint,
            "stream": req.stream,
            "prompt_tokens": req.prompt_tokens,
            "cached_tokens": cached,
            "cached_tokens_reported": renderer.cached_tokens,
            "prefilled_tokens": prefill,
            "n_tokens": plan.n_visible,
            "n_reasoning": plan.n_reasoning,
            "n_engine_tokens": plan.n_engine_tokens,
            "finish_reason": plan.finish_reason,
            "reported_completion_tokens": reported_completion_tokens(plan, self.profile),
            "faults": headers.get("x-sim-fault", self.profile.faults),
            "admitted_s": admitted_s,
            "headers_s": None,
            "first_token_s": None,
            "last_token_s": None,
            "finish_s": None,
            "outcome": None,
        }
        self.truths.append(truth)
        early = renderer.before_admission()
        if not renderer.done and self.profile.reject_concurrent and self._queues:  # busy: refuse it
            early = renderer.reject_busy(self.profile.reject_concurrent)
        if renderer.done:
            truth["outcome"] = "fault"
            await self._play(early, send, receive, renderer, _Offset())
            return
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self._queues[req_id] = queue
        self.engine.admit(req_id, admitted_s, prefill, plan.n_engine_tokens)  # TTFT: what it prefills only
        self._pump()
        watcher = asyncio.ensure_future(_watch_disconnect(receive, queue))
        try:
            await self._respond(renderer, queue, send, receive, truth)
        finally:
            watcher.cancel()
            self._queues.pop(req_id, None)
            if truth["outcome"] is None:
                truth["outcome"] = "cancelled"
            self.engine.cancel(req_id, max(self.sim_now(), self.engine.now_s))
            self._schedule()

    async def _respond(
        self, renderer: Renderer, queue: asyncio.Queue[Any], send: Send, receive: Receive, truth: dict[str, Any]
    ) -> None:
        offset = _Offset()
        token_walls: list[float] = []  # wall time of the first and the latest token written
        idle_s = self.profile.keepalive_idle_s
        last_write_s = renderer.admitted_s
        while not renderer.done:
            timeout = None
            if idle_s is not None and renderer.started:
                timeout = max(self.wall_at(last_write_s + idle_s) + offset.wall_s - time.perf_counter(), 0.0)
            try:
                ev = await asyncio.wait_for(queue.get(), timeout) if timeout is not None else await queue.get()
            except asyncio.TimeoutError:
                last_write_s += idle_s or 0.0
                if await self._play(renderer.idle(), send, receive, renderer, offset):
                    return
                continue
            if ev is _DISCONNECTED:
                return
            _note_truth(truth, ev)
            if offset.wall_s > 0:
                await asyncio.sleep(max(self.wall_at(ev.t_s) + offset.wall_s - time.perf_counter(), 0.0))
            if isinstance(ev, Finish) and token_walls:  # the server's own decode time, on the wall clock
                renderer.decode_wall_s = token_walls[-1] - token_walls[0]
            writes = renderer.on_event(ev)
            if any(isinstance(w, bytes) and w for w in writes):
                last_write_s = ev.t_s
                if isinstance(ev, Token):  # kept: the first and the latest
                    token_walls[1:] = [time.perf_counter()]
            if await self._play(writes, send, receive, renderer, offset):
                truth["outcome"] = "fault"
                return
        truth["outcome"] = "rejected" if truth.get("rejected_s") is not None else "ok"
        if renderer.faults.any:
            truth["outcome"] = "fault"

    async def _play(
        self, writes: list[Write], send: Send, receive: Receive, renderer: Renderer, offset: _Offset
    ) -> bool:
        """Send `writes`; complete the body when the renderer is done. True if the connection was dropped."""
        for w in writes:
            if isinstance(w, Start):
                await send({"type": "http.response.start", "status": w.status, "headers": list(w.headers)})
            elif isinstance(w, bytes):
                if w:
                    await send({"type": "http.response.body", "body": w, "more_body": True})
            elif isinstance(w, Stall):
                await asyncio.sleep(w.wall_s)
                offset.wall_s += w.wall_s
            elif isinstance(w, Close):
                await _drop_connection(receive, reset=w.reset)
                return True
        if renderer.done:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        return False


class _Offset:
    """Wall seconds a response has been pushed back by stall faults."""

    def __init__(self) -> None:
        self.wall_s = 0.0


def _note_truth(truth: dict[str, Any], ev: Event) -> None:
    if isinstance(ev, Headers):
        truth["headers_s"] = ev.t_s
    elif isinstance(ev, Rejected):
        truth["rejected_s"] = ev.t_s
    elif isinstance(ev, Token):
        if truth["first_token_s"] is None:
            truth["first_token_s"] = ev.t_s
        truth["last_token_s"] = ev.t_s
    elif isinstance(ev, Finish):
        truth["finish_s"] = ev.t_s


async def _read_body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


async def _watch_disconnect(receive: Receive, queue: asyncio.Queue[Any]) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            queue.put_nowait(_DISCONNECTED)
            return


async def _play_simple(send: Send, writes: list[Write]) -> None:
    for w in writes:
        if isinstance(w, Start):
            await send({"type": "http.response.start", "status": w.status, "headers": list(w.headers)})
        elif isinstance(w, bytes):
            await send({"type": "http.response.body", "body": w, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


class SimulatedConnectionDrop(Exception):
    """Raised to make the ASGI server drop the connection when its transport is out of reach."""


async def _drop_connection(receive: Receive, *, reset: bool) -> None:
    """Close the client connection: an RST (`reset`) or a FIN that leaves the body incomplete.

    Reaches uvicorn's transport through the bound `receive` method; on another ASGI server it
    raises `SimulatedConnectionDrop`, which makes the server close the connection (and log it).
    """
    transport = getattr(getattr(receive, "__self__", None), "transport", None)
    if transport is None:
        raise SimulatedConnectionDrop("simulated connection drop")
    for _ in range(100):  # let earlier writes leave the process first
        if transport.get_write_buffer_size() == 0:
            break
        await asyncio.sleep(0.001)
    if reset:
        sock = transport.get_extra_info("socket")
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except (OSError, AttributeError):
            pass
        transport.abort()
    else:
        transport.close()
    for _ in range(10):  # let uvicorn notice (connection_lost) so it does not log an error
        await asyncio.sleep(0)


def create_app(profile: str | Profile = "healthy", *, speed: float = 1.0, seed: int = 0, **overrides: Any) -> SimApp:
    """An ASGI app simulating `profile` (a name from PROFILES or a Profile) with knob overrides.

    Raises ValueError for an unknown profile or knob, a bad knob value, or speed <= 0.
    """
    return SimApp(get_profile(profile, **overrides), speed=speed, seed=seed)
