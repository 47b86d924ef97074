"""From engine events to what one response writes, and when: pure, no I/O.

A `Renderer` turns the engine's events for one request (`on_event`) into `Write` items that
the shell plays in order at the event's time: `Start` (status line and headers), `bytes`
(one body write), `Stall` (pause this response; later writes shift by the same wall time) and
`Close` (drop the connection: `reset=True` is a TCP reset, `False` a plain close that leaves
the body incomplete). When `done` becomes True the shell completes the body (unless a `Close`
came). It applies the profile's wire behaviours (burst at end, silent EOS token, usage
multiplier) and the request's faults.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlxproxy.sim.engine import Event, Finish, Headers, PrefillProgress, Rejected, Token
from mlxproxy.sim.faults import Faults
from mlxproxy.sim.profiles import Profile
from mlxproxy.sim.request import OutputPlan, reported_completion_tokens
from mlxproxy.sim.wire import Style, UsageReport

MALFORMED = b'data: {"id": "broken", "choices": [{"delta": {"content": "\xff\xfe\n\n'


@dataclass(frozen=True)
class Start:
    """Send the status line and headers."""

    status: int
    headers: tuple[tuple[bytes, bytes], ...]


@dataclass(frozen=True)
class Stall:
    """Pause this response for `wall_s` real seconds (not scaled by speed)."""

    wall_s: float


@dataclass(frozen=True)
class Close:
    """Drop the connection now; `reset` sends a TCP RST instead of a FIN."""

    reset: bool


Write = Start | bytes | Stall | Close


def context_message(prompt_tokens: int, max_context_tokens: int) -> str:
    """oMLX's exact context-window error text (used by every style)."""
    return f"Prompt too long: {prompt_tokens} tokens exceeds max context window of {max_context_tokens} tokens"


def json_start(status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> list[Write]:
    """A complete JSON response: start with content-length, then the body."""
    return [Start(status, (*headers, (b"content-length", str(len(body)).encode()))), body]


class Renderer:
    """Renders one response. Call `before_admission` first; admit to the engine only if not `done`."""

    def __init__(
        self,
        style: Style,
        profile: Profile,
        plan: OutputPlan,
        prompt_tokens: int,
        *,
        stream: bool,
        faults: Faults,
        admitted_s: float,
    ) -> None:
        self.style = style
        self.profile = profile
        self.plan = plan
        self.prompt_tokens = prompt_tokens
        self.cached_tokens = 0  # of prompt_tokens, served from the prompt cache (set by the app)
        # wall seconds per simulated second (the app's 1 / speed): a server's own timing claims
        # are wall-clock figures, so they agree with what a client sees at any speed
        self.wall_per_sim_s = 1.0
        # wall seconds from the first to the last token written, when the shell timed them: the
        # decode time a real server reports includes any pause of its process
        self.decode_wall_s: float | None = None
        self.stream = stream
        self.faults = faults
        self.admitted_s = admitted_s
        self.done = False
        self.started = False  # True once the status line and headers are out
        self.first_token_s: float | None = None
        self.last_token_s: float | None = None
        self.finish_s: float | None = None
        self._burst: list[bytes] = []
        self._deferred: tuple[str, str] | None = None
        n = plan.n_visible
        self._stall_s, stall_at = faults.stall or (0.0, None)
        self._stall_at = Faults.at(stall_at, n) if self._stall_s else None
        self._reset_at = Faults.at(faults.reset_at, n)
        self._malformed_at = Faults.at(faults.malformed_at, n)
        self._error_at = Faults.at(faults.stream_error_at, n)

    # -- lifecycle ----------------------------------------------------------------------------

    def before_admission(self) -> list[Write]:
        """Faults that answer before the engine sees the request."""
        if self.faults.reset_before_headers:
            self.done = True
            return [Close(reset=True)]
        if self.faults.http_error is not None:
            self.done = True
            status, headers, body = self.style.error(
                self.faults.http_error, f"Simulated error (X-Sim-Fault: http-error={self.faults.http_error})"
            )
            return json_start(status, headers, body)
        return []

    def reject_busy(self, how: str) -> list[Write]:
        """The answer of a server busy with another request (the `reject_concurrent` knob):
        HTTP 200 then an error in the stream ("stream"; a non-stream request gets HTTP 500), or HTTP 503 ("http")."""
        self.done = True
        message = "Simulated rejection: another request is being served"
        if how == "http" or not self.stream:
            return json_start(*self.style.error(503 if how == "http" else 500, message))
        self.started = True
        data, ending = self.style.stream_error(message, self.plan.finish_reason, self.usage())
        writes: list[Write] = [Start(200, tuple(self.style.stream_headers())), self.style.open_stream(), data]
        return [*writes, Close(reset=False)] if ending == "close" else writes

    def on_event(self, ev: Event) -> list[Write]:
        if self.done:
            return []
        if isinstance(ev, Headers):
            return self._on_headers()
        if isinstance(ev, Rejected):
            self.done = True
            status, headers, body = self.style.error(400, context_message(ev.prompt_tokens, ev.max_context_tokens))
            return json_start(status, headers, body)
        if isinstance(ev, PrefillProgress):
            return [self.style.progress(ev.processed_tokens, ev.total_tokens)] if self.stream else []
        if isinstance(ev, Token):
            return self._on_token(ev)
        if isinstance(ev, Finish):
            return self._on_finish(ev)
        return []

    def idle(self) -> list[Write]:
        """Keep-alive bytes for a quiet gap of `profile.keepalive_idle_s` (after headers only)."""
        if not self.started or self.done:
            return []
        if self.stream:
            return [self.style.idle_comment()]
        prefix = self.style.nonstream_prefix()
        return [prefix] if prefix else []

    def usage(self) -> UsageReport:
        """Usage as the server reports it, with its timing claims (wall seconds: `wall_per_sim_s`)."""
        k = self.wall_per_sim_s
        ttft = None if self.first_token_s is None else (self.first_token_s - self.admitted_s) * k
        decode = None
        if self.decode_wall_s is not None:
            decode = self.decode_wall_s
        elif self.first_token_s is not None and self.last_token_s is not None:
            decode = (self.last_token_s - self.first_token_s) * k
        total = None if self.finish_s is None else (self.finish_s - self.admitted_s) * k
        reasoning = self.plan.reasoning_text
        return UsageReport(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=reported_completion_tokens(self.plan, self.profile),
            reasoning_tokens=self.plan.n_reasoning,
            reasoning_chars=len(reasoning),
            total_chars=len(reasoning) + len(self.plan.content_text),
            ttft_s=ttft,
            decode_s=decode,
            total_s=total,
            n_visible=self.plan.n_visible,
            cached_tokens=self.cached_tokens,
        )

    # -- events -------------------------------------------------------------------------------

    def _on_headers(self) -> list[Write]:
        if self.stream:
            self.started = True
            return [Start(200, tuple(self.style.stream_headers())), self.style.open_stream()]
        prefix = self.style.nonstream_prefix()
        if prefix:  # oMLX commits 200 at once and streams the JSON later
            self.started = True
            return [Start(200, ((b"content-type", b"application/json"),)), prefix]
        return []

    def _on_token(self, ev: Token) -> list[Write]:
        i = ev.index
        if i >= self.plan.n_visible:
            return []  # a counted EOS token: takes its step, sends nothing
        if self.first_token_s is None:
            self.first_token_s = ev.t_s
        self.last_token_s = ev.t_s
        writes: list[Write] = []
        if i == self._stall_at:
            writes.append(Stall(self._stall_s))
        if i == self._reset_at:
            self.done = True
            return [*writes, Close(reset=True)]
        if not self.stream:
            if i == self._error_at:
                self.done = True
                status, headers, body = self.style.error(500, "Simulated stream error")
                return [*writes, *json_start(status, headers, body)]
            return writes
        if i == self._malformed_at:
            writes.append(MALFORMED)
        if i == self._error_at:
            self.done = True
            data, ending = self.style.stream_error("Simulated stream error", self.plan.finish_reason, self.usage())
            writes.append(b"".join(self._burst) + data)
            return [*writes, Close(reset=False)] if ending == "close" else writes
        kind = "tool" if self.plan.tool_name else "reasoning" if i < self.plan.n_reasoning else "content"
        text = self.plan.pieces[i]
        if self.style.finish_on_last_token and i == self.plan.n_visible - 1:
            self._deferred = (kind, text)
            return writes
        rate = (
            i / (ev.t_s - self.first_token_s) / self.wall_per_sim_s if i > 0 and ev.t_s > self.first_token_s else None
        )
        chunk = self.style.piece(kind, text, rate)
        if self.profile.burst_at_end:
            self._burst.append(chunk)
        else:
            writes.append(chunk)
        return writes

    def _on_finish(self, ev: Finish) -> list[Write]:
        self.done = True
        self.finish_s = ev.t_s
        usage = self.usage()
        if not self.stream:
            body = self.style.nonstream_body(
                self.plan.reasoning_text, self.plan.content_text, self.plan.finish_reason, usage
            )
            if self.started:  # headers already sent (oMLX)
                return [body]
            return json_start(200, [(b"content-type", b"application/json")], body)
        data = b"".join(self._burst) + self.style.finish(self.plan.finish_reason, usage, self._deferred)
        if getattr(self.style, "truncates_after_finish", False):
            return [data, Close(reset=False)]
        return [data]
