"""The simulator's prompt cache: which leading part of a prompt a server could reuse.

A server with `prompt_cache: true` keeps the text of its last `CACHE_SLOTS` prompts, each with
the model name it was requested with. A new prompt reuses its longest common prefix with any of
those of the same model name (a KV cache belongs to one model's weights: no server reuses one
model's cache for another, so a request naming another model is prefilled cold): `cached_tokens` =
that prefix's characters / `chars_per_token` (rounded down, at most prompt_tokens - 1, the
last token is always computed), reported as `prompt_tokens_details.cached_tokens`; only the
rest is prefilled, so TTFT depends on uncached tokens only.

`cache_drop` simulates servers that lose their cache: `every` (before every request: no
reuse at all), `every-other` (before every second request the server receives), `after:N`
(prompts longer than N tokens are never kept).
"""

from __future__ import annotations

from collections import deque

__all__ = ["PromptCache", "CACHE_SLOTS", "parse_cache_drop"]

CACHE_SLOTS = 16


def parse_cache_drop(value: str) -> tuple[str, int | None]:
    """("", None), ("every", None), ("every-other", None) or ("after", N); ValueError otherwise."""
    if value in ("", "every", "every-other"):
        return value, None
    if value.startswith("after:"):
        try:
            n = int(value[6:])
        except ValueError:
            n = 0
        if n >= 1:
            return "after", n
    raise ValueError(f"cache_drop must be '', 'every', 'every-other' or 'after:N' (N >= 1), got {value!r}")


def _common_prefix(a: str, b: str) -> int:
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:  # binary search over slice comparisons (done in C)
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class PromptCache:
    def __init__(self, chars_per_token: float, drop: str = "") -> None:
        self.chars_per_token = chars_per_token
        self.mode, self.limit = parse_cache_drop(drop)
        self._texts: deque[tuple[str | None, str]] = deque(maxlen=CACHE_SLOTS)
        self.requests = 0

    def serve(self, text: str, prompt_tokens: int, model: str | None = None) -> int:
        """The cached tokens for a prompt of `model` arriving now, and remember it."""
        self.requests += 1
        if self.mode == "every" or (self.mode == "every-other" and self.requests % 2 == 0):
            self._texts.clear()
        best = max((_common_prefix(t, text) for m, t in self._texts if m == model), default=0)
        cached = min(int(best / self.chars_per_token), prompt_tokens - 1)
        if self.mode != "after" or prompt_tokens <= (self.limit or 0):
            try:
                self._texts.remove((model, text))
            except ValueError:
                pass
            self._texts.append((model, text))
        return max(cached, 0)
