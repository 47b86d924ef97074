"""Confidence intervals for a sweep step's figures: percentile bootstrap over its requests,
in blocks of consecutive requests (a busy host slows everything in flight at once).

Pure functions with a seeded generator: the same requests give the same interval, so a result
file read again is judged the same. A step's p95 TTFT is the 95th percentile of a few dozen
requests; its interval says how far another step of the same size could land from it. The
aggregate tok/s of a step is a ratio (tokens over the time the step's streams were busy), so it
is resampled as one: each resample draws requests with their own tokens and their own wall time.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence

from mlxproxy.core.stats import percentile

__all__ = [
    "BLOCKS",
    "BOOTSTRAP_RESAMPLES",
    "CONFIDENCE",
    "Interval",
    "blocks_of",
    "bootstrap",
    "percentile_interval",
    "ratio_interval",
]

#: resamples per interval: enough for a 95 % interval's ends to move by well under the interval's
#: own width from one seed to the next, cheap at a step's few hundred requests
BOOTSTRAP_RESAMPLES = 400
#: the intervals' level
CONFIDENCE = 0.95
#: runs of consecutive requests a block bootstrap draws (a step's few seconds cut in this many)
BLOCKS = 8

#: (low, high)
Interval = tuple[float, float]


def bootstrap(
    n: int,
    stat: Callable[[list[int]], float | None],
    *,
    resamples: int = BOOTSTRAP_RESAMPLES,
    level: float = CONFIDENCE,
    seed: int = 0,
) -> Interval | None:
    """The percentile-bootstrap interval of `stat` over `n` items: `stat` gets the indices of
    one resample (n draws with replacement) and returns its figure (None: none). None when
    there are fewer than 2 items or no resample had a figure."""
    if n < 2:
        return None
    rng = random.Random(seed)
    values: list[float] = []
    idx = range(n)
    for _ in range(resamples):
        v = stat(rng.choices(idx, k=n))
        if v is not None and math.isfinite(v):
            values.append(v)
    if not values:
        return None
    values.sort()
    tail = (1.0 - level) / 2.0 * 100.0
    lo, hi = percentile(values, tail), percentile(values, 100.0 - tail)
    if lo is None or hi is None:
        return None
    return (lo, hi)


def blocks_of(n: int, count: int = BLOCKS) -> list[list[int]]:
    """Indices 0..n-1 (items in time order) cut into `count` runs of consecutive items (fewer
    when there are fewer than 2 items a block): the units a block bootstrap draws."""
    k = max(1, min(count, n // 2))
    return [list(range(i * n // k, (i + 1) * n // k)) for i in range(k)]


def _block_stat(
    blocks: list[list[int]], stat: Callable[[list[int]], float | None]
) -> Callable[[list[int]], float | None]:
    """`stat` over the items of the drawn blocks (`bootstrap` draws block numbers)."""
    return lambda drawn: stat([i for b in drawn for i in blocks[b]])


def percentile_interval(values: Sequence[float], q: float, *, seed: int = 0, blocks: int = BLOCKS) -> Interval | None:
    """The interval of the `q`th percentile of `values` (in the order they were sent): a block
    bootstrap over `blocks` runs of consecutive requests, so a slow few seconds on a busy host,
    which slows every request in flight at once, widens the interval as it should (requests
    sent together are not independent draws); `blocks=0`: each request its own block."""
    xs = list(values)

    def stat(ix: list[int]) -> float | None:
        return percentile(sorted(xs[i] for i in ix), q)

    if not blocks:
        return bootstrap(len(xs), stat, seed=seed)
    runs = blocks_of(len(xs), blocks)
    return bootstrap(len(runs), _block_stat(runs, stat), seed=seed) if len(xs) >= 2 else None


def ratio_interval(
    num: Sequence[float], den: Sequence[float], scale: float, *, seed: int = 0, blocks: int = BLOCKS
) -> Interval | None:
    """The interval of `scale * sum(num) / sum(den)` over paired items in the order they were
    sent (a step's aggregate tok/s: each request's output tokens over its wall time, times the
    streams busy on average), a block bootstrap as `percentile_interval`'s."""
    if len(num) != len(den):
        raise ValueError("num and den must pair up")

    def stat(ix: list[int]) -> float | None:
        d = sum(den[i] for i in ix)
        return scale * sum(num[i] for i in ix) / d if d > 0 else None

    if not blocks:
        return bootstrap(len(num), stat, seed=seed)
    runs = blocks_of(len(num), blocks)
    return bootstrap(len(runs), _block_stat(runs, stat), seed=seed) if len(num) >= 2 else None
