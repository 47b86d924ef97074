"""A server's figures about its own speed, checked against what the wire showed (pure).

Servers report rates of their own (rule 13 keeps them apart as `server_claims`): Ollama's
final line (`prompt_eval_count` / `prompt_eval_duration`, `eval_count` / `eval_duration`, in
nanoseconds), llama.cpp-style `timings` (`prompt_per_second`, `predicted_per_second`, sent by
llama.cpp, mlx-vlm and Ollama's OpenAI-compatible API since 0.35.1) and LM Studio's `stats`
(`tokens_per_second`). `audit` recomputes each from the request's measured figures:

- **prefill**: the tokens really prefilled (the prompt less the cached tokens the server
  reports, `uncached`) over the prefill time, which is the server's own duration, capped by
  the time to the first token on the wire less its model load (queueing only lengthens the
  wire's figure, so the cap never wrongs an honest server). Since Ollama 0.33.3 the count is the
  whole prompt while the duration covers only the uncached part (`llm/llama_server.go`:
  `cache_n + prompt_n` over `prompt_ms`): a mostly cached prompt then claims thousands of tok/s.
- **decode**: the claim's own token count over the stream's decode window (first to last
  generated event), judged when at least `min_tokens` tokens and `min_s` seconds were streamed.

A figure that differs from its recomputation by more than `ratio` (either way) is returned as
evidence text naming both; the caller (`core.detect`) files it as `speed_claim_mismatch`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from mlxproxy.core.meter import Measurement
    from mlxproxy.core.record import Record

__all__ = ["SpeedClaim", "speed_claims", "audit"]


class SpeedClaim(NamedTuple):
    phase: str  # "prefill" or "decode"
    label: str  # how the server states it, for the evidence
    rate_tps: float  # the claimed tokens per second
    tokens: int | None  # the tokens the claim counts, when it says
    duration_s: float | None  # the time it divides by, when it says
    load_s: float  # model load time inside the time to first token, as the server reports it


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _rate(count: float | None, seconds: float | None) -> float | None:
    return count / seconds if count is not None and seconds is not None and seconds > 0 and count > 0 else None


def speed_claims(claims: dict[str, Any]) -> list[SpeedClaim]:
    """The speed figures in a record's `server_claims`, in one shape."""
    out: list[SpeedClaim] = []
    ol = claims.get("ollama")
    if isinstance(ol, dict):
        load = (_num(ol.get("load_duration")) or 0.0) / 1e9
        for phase, ck, dk in (
            ("prefill", "prompt_eval_count", "prompt_eval_duration"),
            ("decode", "eval_count", "eval_duration"),
        ):
            n, d = _num(ol.get(ck)), _num(ol.get(dk))
            secs = None if d is None else d / 1e9
            r = _rate(n, secs)
            if r is not None and n is not None:
                out.append(SpeedClaim(phase, f"{ck} / {dk}", r, int(n), secs, load))
    tm = claims.get("timings")
    if isinstance(tm, dict):
        for phase, key, nk, mk in (
            ("prefill", "prompt_per_second", "prompt_n", "prompt_ms"),
            ("decode", "predicted_per_second", "predicted_n", "predicted_ms"),
        ):
            n, ms = _num(tm.get(nk)), _num(tm.get(mk))
            secs = None if ms is None else ms / 1000
            stated = _num(tm.get(key))
            r = stated if stated is not None and stated > 0 else _rate(n, secs)
            if r is not None:
                label = f"timings.{key}" if stated is not None else f"timings.{nk} / {mk}"
                out.append(SpeedClaim(phase, label, r, None if n is None else int(n), secs, 0.0))
    st = claims.get("stats")
    if isinstance(st, dict):
        r = _num(st.get("tokens_per_second"))
        n = _num(st.get("total_output_tokens"))
        if r is not None and r > 0:
            out.append(SpeedClaim("decode", "stats.tokens_per_second", r, None if n is None else int(n), None, 0.0))
    return out


def audit(r: Measurement | Record, ratio: float, min_s: float, min_tokens: int) -> list[str]:
    """Evidence for every speed claim in `r.server_claims` that disagrees with its recomputation
    from `r`'s own figures by more than `ratio`."""
    ttft_s, event_offsets_s = r.ttft_s, r.event_offsets_s
    uncached_tokens, output_tokens = r.uncached_prompt_tokens, r.completion_tokens_reported
    found: list[str] = []
    for c in speed_claims(r.server_claims):
        if c.phase == "prefill":
            if ttft_s is None or not uncached_tokens or uncached_tokens < min_tokens:
                continue  # (a handful of prefilled tokens: their time is mostly fixed cost, no rate)
            window = ttft_s - c.load_s
            secs = c.duration_s if c.duration_s is not None else (c.tokens or uncached_tokens) / c.rate_tps
            secs = min(secs, window) if window > 0 else secs
            if secs <= 0:
                continue
            measured = uncached_tokens / secs
            if max(measured, c.rate_tps) / min(measured, c.rate_tps) > ratio:
                counted = f"{c.tokens} tokens" if c.tokens is not None else "its tokens"
                found.append(
                    f"claimed prefill {c.rate_tps:.0f} tok/s ({c.label}, {counted}), measured {measured:.0f} tok/s: "
                    f"{uncached_tokens} prompt tokens were prefilled (the rest cached) in {secs:.3f} s "
                    f"(first token after {ttft_s:.3f} s)"
                )
        else:
            if len(event_offsets_s) < 2:
                continue
            span = event_offsets_s[-1] - event_offsets_s[0]
            n = c.tokens if c.tokens is not None else output_tokens
            if n is None:
                n = len(event_offsets_s)
            if n < min_tokens or span < min_s:
                continue
            measured = (n - 1) / span
            if max(measured, c.rate_tps) / min(measured, c.rate_tps) > ratio:
                found.append(
                    f"claimed decode {c.rate_tps:.1f} tok/s ({c.label}), measured {measured:.1f} tok/s: "
                    f"{n} tokens streamed over {span:.3f} s"
                )
    return found
