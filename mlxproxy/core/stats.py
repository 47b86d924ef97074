"""Order statistics for reports: medians are the headline, with p90, p99, min, max."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

__all__ = ["percentile", "summarize"]


def percentile(sorted_values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) of already sorted values, linearly interpolated
    between closest ranks (numpy's default). `None` for no values."""
    n = len(sorted_values)
    if n == 0:
        return None
    if n == 1:
        return float(sorted_values[0])
    pos = (n - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, n - 1)
    frac = pos - lo
    return float(sorted_values[lo]) + (float(sorted_values[hi]) - float(sorted_values[lo])) * frac


def summarize(values: Iterable[float | None]) -> dict[str, float | int | None]:
    """count, mean, min, p50, p90, p99, max over the non-None values."""
    vals = sorted(v for v in values if v is not None)
    n = len(vals)
    return {
        "count": n,
        "mean": (sum(vals) / n) if n else None,
        "min": vals[0] if n else None,
        "p50": percentile(vals, 50),
        "p90": percentile(vals, 90),
        "p99": percentile(vals, 99),
        "max": vals[-1] if n else None,
    }
