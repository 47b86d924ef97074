"""A loopback TCP tap: forwards every connection to a target port, both ways, and keeps the bytes
the clients sent, so a test can store a real client's requests exactly as they were sent (the
session tap, :mod:`.sessiontap`, which also keeps the responses and their timings)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from .sessiontap import SessionTap, session_tap


class Tap(SessionTap):
    """Listening on ``url``; :meth:`requests` gives what the clients sent."""

    def requests(self) -> list[bytes]:
        """Every HTTP request the clients sent (head and body), split by Content-Length (or at the
        last chunk of a chunked body), in the order they were sent."""
        return [e.request for e in self.exchanges()]


@contextlib.contextmanager
def tap(target_port: int) -> Iterator[Tap]:
    with session_tap(target_port, Tap) as t:
        yield t
