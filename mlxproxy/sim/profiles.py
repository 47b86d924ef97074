"""Simulator profiles: every knob of a simulated MLX server, with its unit in its name.

A `Profile` is the whole truth of a simulated server: the engine model (`engine.py`) reads
its timing knobs, the wire formatter (`wire.py`) its `wire` style, the shell (`app.py`) the
rest. Profiles are frozen; `get_profile(name, **overrides)` returns a validated copy with
some knobs replaced, and raises `ValueError` (one sentence saying which knob and why) for an
unknown profile, an unknown knob or a bad value.

`PROFILES` is the one registry of named profiles: `sim --profile`'s choices and its help are made
from it, and docs/SIMULATOR.md's profile table is checked against it (tests/sim/
test_profile_registry.py). Adding a profile is one `Profile(...)` there (and, for a new wire
format, one style class registered in `mlxproxy.sim.styles.STYLES`).

Timing truths (all in simulated seconds; wall time = simulated time / speed):

- prefill of P prompt tokens: `prefill_s(P) = P / prefill_tps`, and past
  `superlinear_after_tokens` (T) each token costs `(P / T) ** (superlinear_exponent - 1)` times
  more: `prefill_s(P) = P / prefill_tps * (P / T) ** (superlinear_exponent - 1)`.
- TTFT of a request alone = `prefill_s(P)`: the first token comes out of the prefill pass.
- decode step with n streams sharing the device:
  `step_s(n) = (1 + batch_penalty * (n - 1)) / decode_tps`; one step makes one token for each
  decoding stream, so a lone stream decodes at exactly `decode_tps`.
- `serial`: one request at a time (its response headers included); n in `step_s` then counts
  the requests blocked behind it too, because the real server's blocked event loop still has
  to deal with them, which is what pushes aggregate throughput below 1x.
- stalls: the step producing token index i (0-based, i >= 1) with i % stall_every_tokens == 0
  takes `stall_s` longer, for every stream in that step (a device-wide pause, like a GC).
- jitter: each request reaches the device after a random wait of its own, exponential with mean
  `jitter_s` (seeded by the simulator's `--seed`): TTFT and E2E vary from request to request
  as on a busy host, while the device's capacity stays what the other knobs say.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from mlxproxy.sim.cache import parse_cache_drop
from mlxproxy.sim.styles import STYLES

#: the wire styles a profile can name: the styles' own registry (`mlxproxy.sim.styles.STYLES`)
WIRE_STYLES = tuple(STYLES)

DEFAULT_MODEL = "mlx-community/Qwen3.5-35B-A3B-4bit"


@dataclass(frozen=True)
class Profile:
    """All knobs of one simulated server. Units are in the names; `None` means "off"."""

    name: str = "healthy"
    description: str = "A healthy continuous-batching server with OpenAI-reference wire format."
    wire: str = "openai"
    model_name: str = DEFAULT_MODEL
    # Engine timing.
    decode_tps: float = 50.0
    prefill_tps: float = 2000.0
    prefill_step_tokens: int = 2048
    batch_penalty: float = 0.05
    serial: bool = False
    max_batch_streams: int | None = None
    superlinear_after_tokens: int | None = None
    superlinear_exponent: float = 2.0
    stall_every_tokens: int | None = None
    stall_s: float = 0.0
    jitter_s: float = 0.0  # mean of each request's random wait before the device (0: none)
    # Requests and output.
    max_context_tokens: int | None = None
    default_output_tokens: int = 64
    max_output_tokens: int = 512
    chars_per_token: float = 4.0
    reasoning_share: float = 0.0
    # Wire behaviour.
    burst_at_end: bool = False
    keepalive_idle_s: float | None = None
    usage_multiplier: float = 1.0
    usage_counts_eos: bool = False
    faults: str = ""
    # Prompt cache (sim/cache.py): reuse the longest cached prefix, report it as cached_tokens.
    prompt_cache: bool = False
    cache_drop: str = ""  # "", "every", "every-other", "after:N"
    # What usage says of the cache: "" (the truth), "hidden" (reuses its cache but reports
    # cached_tokens 0), "claimed-cold" (reports what it could reuse, but prefills every token).
    cache_report: str = ""
    # Answer to a chat request that declares tools (OpenAI wire only): "" (text), "structured",
    # "markup" (<tool_call> in content), "invalid-json" (structured, broken arguments).
    tool_call_style: str = ""
    # A request that arrives while another is being served: "" (served as the engine plans),
    # "stream" (HTTP 200, then at once an error in the stream, like vllm-mlx's simple mode) or
    # "http" (HTTP 503 at once).
    reject_concurrent: str = ""
    # What the server's own speed figures say (ollama, lm-studio wires): "" (the truth) or
    # "whole-prompt" (Ollama since 0.33.3: the prompt count includes the cached tokens, the
    # duration only the prefilled ones, so a cached prompt claims a phantom prefill rate).
    speed_claims: str = ""

    def __post_init__(self) -> None:
        _validate(self)

    def knobs(self) -> dict[str, Any]:
        """The profile as a JSON-ready dict (the truth a test should measure)."""
        return dataclasses.asdict(self)


def _validate(p: Profile) -> None:
    def bad(knob: str, why: str) -> ValueError:
        return ValueError(f"profile knob {knob!r} {why} (got {getattr(p, knob)!r})")

    if p.wire not in WIRE_STYLES:
        raise bad("wire", f"must be one of {', '.join(WIRE_STYLES)}")
    for knob in ("decode_tps", "prefill_tps", "chars_per_token"):
        value = getattr(p, knob)
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise bad(knob, "must be a finite number > 0")
    for knob in ("batch_penalty", "stall_s", "jitter_s"):
        value = getattr(p, knob)
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
            raise bad(knob, "must be a finite number >= 0")
    if not (isinstance(p.usage_multiplier, (int, float)) and p.usage_multiplier > 0):
        raise bad("usage_multiplier", "must be a number > 0")
    if not 0.0 <= p.reasoning_share <= 1.0:
        raise bad("reasoning_share", "must be between 0 and 1")
    if not p.superlinear_exponent >= 1.0:
        raise bad("superlinear_exponent", "must be >= 1")
    for knob in ("prefill_step_tokens", "default_output_tokens", "max_output_tokens"):
        value = getattr(p, knob)
        if not (isinstance(value, int) and value >= 1):
            raise bad(knob, "must be an integer >= 1")
    for knob in ("max_batch_streams", "superlinear_after_tokens", "stall_every_tokens", "max_context_tokens"):
        value = getattr(p, knob)
        if value is not None and not (isinstance(value, int) and value >= 1):
            raise bad(knob, "must be an integer >= 1 or None")
    if p.tool_call_style not in ("", "structured", "markup", "invalid-json"):
        raise bad("tool_call_style", "must be '', 'structured', 'markup' or 'invalid-json'")
    if p.speed_claims not in ("", "whole-prompt"):
        raise bad("speed_claims", "must be '' or 'whole-prompt'")
    if p.tool_call_style and p.wire not in ("openai", "ollama", "lm-studio"):
        raise bad("tool_call_style", "is only simulated on the openai, ollama and lm-studio wires")
    if p.cache_report not in ("", "hidden", "claimed-cold"):
        raise bad("cache_report", "must be '', 'hidden' or 'claimed-cold'")
    if p.reject_concurrent not in ("", "stream", "http"):
        raise bad("reject_concurrent", "must be '', 'stream' or 'http'")
    try:
        parse_cache_drop(p.cache_drop)
    except ValueError:
        raise bad("cache_drop", "must be '', 'every', 'every-other' or 'after:N'") from None
    if p.keepalive_idle_s is not None and not p.keepalive_idle_s > 0:
        raise bad("keepalive_idle_s", "must be a number > 0 or None")


PROFILES: dict[str, Profile] = {
    p.name: p
    for p in (
        Profile(),
        Profile(
            name="mlx-lm",
            description="mlx_lm.server: `: keepalive P/T` prefill progress, `reasoning` field, usage only "
            "on request (object chat.completion, choices []), EOS counted in usage.",
            wire="mlx-lm",
            batch_penalty=0.1,
            reasoning_share=0.25,
            usage_counts_eos=True,
        ),
        Profile(
            name="mlx-openai-server",
            description="mlx-openai-server 1.8 (today's release): continuous batching by default (since "
            "1.7), role-only first chunk, `reasoning_content`, usage always on the finish chunk, never `length`.",
            wire="mlx-openai-server",  # live 1.8.1: the same chunks as 1.6.3
            # 1.8.1 decodes with mlx-lm's BatchGenerator, as mlx_lm.server does: the mlx-lm profile's
            # penalty (live CPU, 1,500-token streams: overlap 0.92, 1.40x)
            batch_penalty=0.1,
            reasoning_share=0.25,
            usage_counts_eos=True,  # live 1.8.1: 16 words + EOS = usage 17
        ),
        Profile(
            name="mlx-openai-server@1.6",
            description="mlx-openai-server 1.6: one request at a time (`--max-concurrency` defaults to 1), "
            "role-only first chunk, `reasoning_content`, usage always on the finish chunk, never `length`.",
            wire="mlx-openai-server",
            serial=True,  # live 1.6.3: two streams one after the other (overlap 0.00 in every wave)
            batch_penalty=0.0,  # ... at 0.92-1.06x of one stream
            reasoning_share=0.25,
            usage_counts_eos=True,  # live 1.6.3: 16 words + EOS = usage 17
        ),
        Profile(
            name="mlx-omni-server",
            description="mlx-omni-server: serial (a second request gets no headers until the first "
            "ends; aggregate below 1x), reasoning streamed as plain content, finish_reason twice.",
            wire="mlx-omni-server",
            serial=True,
            batch_penalty=0.3,
            reasoning_share=0.25,
        ),
        Profile(
            name="vllm-mlx",
            description="vllm-mlx with a thinking model: a long `reasoning_content` stream before a "
            "short answer; usage (reasoning included) on the finish chunk and again on request.",
            wire="vllm-mlx",
            reasoning_share=0.9,
            keepalive_idle_s=5.0,
        ),
        Profile(
            name="rapid-mlx",
            description="Rapid-MLX: role-only first chunk, then one token per event (`--stream-interval` "
            "defaults to 1), usage only on request, `: keepalive` after 20 s idle.",
            wire="rapid-mlx",
            reasoning_share=0.25,
            keepalive_idle_s=20.0,
            usage_counts_eos=True,  # live 0.16.10: 16 words + EOS = usage 17
        ),
        Profile(
            name="omlx",
            description="oMLX: `: keep-alive` as the first bytes, HTTP 400 above 32768 prompt tokens, "
            "usage with server-claimed timing fields.",
            wire="omlx",
            max_context_tokens=32768,
            reasoning_share=0.25,
            keepalive_idle_s=10.0,
        ),
        Profile(
            name="ollama",
            description="Ollama: /api/chat and /api/generate as NDJSON (streamed unless stream is false), "
            "thinking in message.thinking, whole tool calls, the final line's counts and nanosecond durations; "
            "/v1/chat/completions with `timings` on the final chunk and /v1/messages; a prompt cache whose "
            "speed figures divide the whole prompt by the uncached part's time (speed_claims=whole-prompt).",
            wire="ollama",
            model_name="qwen3:8b",
            reasoning_share=0.25,
            prompt_cache=True,
            tool_call_style="structured",
            speed_claims="whole-prompt",
        ),
        Profile(
            name="lm-studio",
            description="LM Studio: /api/v1/chat events ending in chat.end with stats, /api/v0/* with stats, "
            "/v1/chat/completions.",
            wire="lm-studio",
            model_name="qwen/qwen3-8b",
            reasoning_share=0.25,
            tool_call_style="structured",
        ),
        Profile(
            name="mlx-vlm",
            description="mlx-vlm: periodic multi-second stalls, superlinear prefill past 30k tokens, "
            "both reasoning fields with the same text, per-chunk timings.",
            wire="mlx-vlm",
            reasoning_share=0.25,
            stall_every_tokens=32,
            stall_s=2.0,
            superlinear_after_tokens=30000,
            superlinear_exponent=5.5,
            usage_counts_eos=True,  # live 0.7.10: 16 words + EOS = usage 17
        ),
        Profile(
            name="phantom-usage",
            description="A server whose usage.completion_tokens is 4x the tokens it streamed.",
            wire="openai",
            usage_multiplier=4.0,
        ),
    )
}

_KNOB_TYPES: dict[str, Any] = {f.name: f.type for f in dataclasses.fields(Profile)}


def knob_names() -> list[str]:
    """Names of the knobs that `get_profile` accepts as overrides."""
    return [name for name in _KNOB_TYPES if name != "name"]


def coerce_knob(name: str, text: str) -> Any:
    """Parse a knob value given as text (CLI `--set name=value`); raises ValueError."""
    if name not in _KNOB_TYPES or name == "name":
        raise ValueError(f"unknown profile knob {name!r}; known knobs: {', '.join(knob_names())}")
    kind = str(_KNOB_TYPES[name])
    raw = text.strip()
    if "None" in kind and raw.lower() in ("none", "off", ""):
        return None
    try:
        if kind.startswith("bool"):
            if raw.lower() in ("1", "true", "yes", "on"):
                return True
            if raw.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if kind.startswith("int"):
            return int(raw)
        if kind.startswith("float"):
            return float(raw)
    except ValueError:
        raise ValueError(f"profile knob {name!r} needs a {kind.split(' ')[0]} value, got {text!r}") from None
    return text


def get_profile(name: str | Profile = "healthy", **overrides: Any) -> Profile:
    """The named profile (or a given one) with `overrides` applied and validated.

    Every override is applied as given (`None` switches an optional knob off); ints are accepted
    for float knobs. Raises ValueError for an unknown profile name, unknown knob or invalid value.
    """
    if isinstance(name, Profile):
        base = name
    else:
        try:
            base = PROFILES[name]
        except KeyError:
            raise ValueError(f"unknown profile {name!r}; choose one of {', '.join(PROFILES)}") from None
    changes = dict(overrides)
    unknown = sorted(set(changes) - set(knob_names()))
    if unknown:
        raise ValueError(f"unknown profile knob {unknown[0]!r}; known knobs: {', '.join(knob_names())}")
    for key, value in list(changes.items()):
        kind = str(_KNOB_TYPES[key])
        if kind.startswith("float") and isinstance(value, int) and not isinstance(value, bool):
            changes[key] = float(value)
    return dataclasses.replace(base, **changes)


def truth_lines(profile: Profile) -> list[str]:
    """Human-readable timing truths of `profile` (simulated seconds; divide by speed for wall time)."""
    p = profile
    prefill = f"P / {p.prefill_tps:g}"
    if p.superlinear_after_tokens is not None and p.superlinear_exponent != 1.0:
        prefill += f" * max(1, P / {p.superlinear_after_tokens}) ** {p.superlinear_exponent - 1.0:g}"
    lines = [
        f"TTFT of a lone request with P prompt tokens = prefill_s(P) = {prefill} s",
        f"decode of a lone stream = {p.decode_tps:g} tokens/s (one token every {1.0 / p.decode_tps:g} s)",
        f"decode step with n streams = (1 + {p.batch_penalty:g} * (n - 1)) / {p.decode_tps:g} s"
        + (" (serial: n counts the requests blocked behind the active one)" if p.serial else ""),
        f"prompt tokens = max(1, ceil(characters / {p.chars_per_token:g})); output = max_tokens (cap "
        f"{p.max_output_tokens}) or {p.default_output_tokens}",
    ]
    if p.serial:
        lines.append("serial: a request's headers wait until the previous request has finished")
    if p.stall_every_tokens is not None and p.stall_s > 0:
        lines.append(f"stall: +{p.stall_s:g} s before every token index multiple of {p.stall_every_tokens}")
    if p.jitter_s > 0:
        lines.append(f"jitter: each request waits an exponential random time, mean {p.jitter_s:g} s, before the device")
    if p.max_context_tokens is not None:
        lines.append(f"prompts over {p.max_context_tokens} tokens get HTTP 400")
    if p.burst_at_end:
        lines.append("the whole answer is sent in one burst when generation ends")
    if p.usage_multiplier != 1.0:
        lines.append(f"usage.completion_tokens = {p.usage_multiplier:g} x generated tokens")
    if p.reasoning_share > 0:
        lines.append(f"the first floor({p.reasoning_share:g} * n) tokens of a chat answer are reasoning")
    if p.usage_counts_eos:
        lines.append("a natural stop costs one more decode step (EOS) and usage counts it: usage = chunks + 1")
    return lines
