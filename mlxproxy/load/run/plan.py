"""How a test's load is split over `n` workers (pure): the parts a shape's `split` hands to
the fleet (`mlxproxy.load.fleet`). Every part keeps what one process would have sent:

- due times: every request's due time is computed as one process would, and the i-th in due
  order goes to worker i mod n, so the union of the parts is exactly the schedule asked for;
- a closed loop of S streams: stream s on worker s mod n, with that stream's share of the
  requests (request i belongs to stream i mod S);
- conversation runs: run i in slot i mod K (K conversations at once), slot k on worker k mod n,
  so every turn of a conversation is sent by one worker, in order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from mlxproxy.load.run.client import PreparedRequest

__all__ = ["plan_closed", "plan_due", "plan_sessions"]

T = TypeVar("T")


def plan_due(reqs: Sequence[PreparedRequest], n: int) -> list[list[PreparedRequest]]:
    """Requests with due times (`offset_s`) dealt round-robin in due order over `n` workers."""
    ordered = sorted(reqs, key=lambda r: r.offset_s)
    return [ordered[k::n] for k in range(n)]


def plan_closed(reqs: Sequence[T], streams: int, n: int) -> list[tuple[int, list[T]]]:
    """A closed loop of `streams` split over `n` workers: (its streams, its requests) each;
    stream s on worker s mod n, request i on stream i mod streams. Workers without a stream
    are left out."""
    streams = max(1, streams)
    out = []
    for k in range(min(n, streams)):
        mine = set(range(k, streams, n))
        out.append((len(mine), [r for i, r in enumerate(reqs) if i % streams in mine]))
    return out


def plan_sessions(runs: Sequence[T], at_once: int, n: int) -> list[tuple[int, list[T], list[int]]]:
    """Conversation runs over `n` workers: (conversations at once, its runs, their numbers)
    each; run i in slot i mod at_once, slot k on worker k mod n: a conversation never moves."""
    at_once = max(1, at_once)
    out = []
    for k in range(min(n, at_once)):
        slots = set(range(k, at_once, n))
        ids = [i for i in range(len(runs)) if i % at_once in slots]
        out.append((len(slots), [runs[i] for i in ids], ids))
    return out
