"""A server object served in a thread for the length of a `with` block (stdlib only, so the
recorders run as `python -m tests.integration...` import it as well as the tests do)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

S = TypeVar("S")


@contextlib.contextmanager
def serving(server: S, serve: Callable[[], object], stop: Callable[[], object]) -> Iterator[S]:
    """`server` while `serve` runs in a daemon thread; at the end `stop` ends it and the thread
    is joined (5 s at most)."""
    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        stop()
        thread.join(timeout=5)
