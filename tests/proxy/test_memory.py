"""What a finished, failed or closed connection leaves behind: nothing for the cyclic GC.

Reference cycles do not leak, but everything they hold (a response, its buffers and headers, a
transport, a socket) waits for a full collection, and a long run keeps the memory that garbage
took between collections. Over a 20,000-request soak with faults that was +16% resident memory on
the fast stack and +21% on the plain one (benchmarks/README.md, "Memory over a long run"). The
cycles were aiohttp's exception of a broken body (kept on its stream reader, its traceback holding
the reader; the proxy's own transport keeps an error as class and text), the plain stack's request-head checks (a closure over the protocol set on h11's
connection) and, before Python 3.12, asyncio's selector transports (a bound method kept on the
transport, python/cpython#100348).

The collector is switched off while the requests run, so that nothing is collected behind the
test's back; then one collection with DEBUG_SAVEALL shows what was cyclic garbage.
"""

from __future__ import annotations

import gc
from collections import Counter

import httpx

from mlxproxy.edge.runner import ServerThread
from mlxproxy.sim.app import create_app as create_sim
from support import proxy, wait_for

CHAT = {
    "model": "m",
    "stream": True,
    "max_tokens": 6,
    "messages": [{"role": "user", "content": "hello there"}],
}
FAULTS = [
    None,
    "reset-mid-stream@2",
    "reset-before-headers",
    "malformed@2",
    "stream-error@2",
    "http-error=500",
    "stall=1@2",  # past the proxy's 0.3 s read timeout
]
#: the kinds of object a connection's cycles held (the test process's other garbage is not the proxy's)
WATCHED = {
    "Conn",  # the upstream transport's protocol (proxy/transport.py)
    "LimitedH11Protocol",
    "LimitedHttpToolsProtocol",
    "GuardedConnection",
    "_SelectorSocketTransport",
    "RequestResponseCycle",
}


def _watched(garbage: list[object]) -> Counter[str]:
    seen: Counter[str] = Counter()
    for o in garbage:
        name = type(o).__name__
        if name in WATCHED or (isinstance(o, BaseException) and type(o).__module__.startswith("mlxproxy")):
            seen[name] += 1
    return seen


def test_finished_failed_and_closed_connections_leave_no_cyclic_garbage(stack: str) -> None:
    with ServerThread(create_sim("healthy", speed=20)) as sim:
        with proxy(sim.url, timeouts={"read_s": 0.3}) as (url, app):
            with httpx.Client() as warm:  # imports and first-use caches happen before the count
                warm.post(url + "/v1/chat/completions", json=CHAT)
            gc.collect()
            gc.disable()
            try:
                for fault in FAULTS:
                    for _ in range(3):
                        with httpx.Client(timeout=10) as client:  # a connection of its own, closed after
                            try:
                                client.post(
                                    url + "/v1/chat/completions",
                                    json=CHAT,
                                    headers={"x-sim-fault": fault} if fault else {},
                                ).read()
                            except httpx.HTTPError:
                                pass  # the broken bodies break here too
                assert wait_for(lambda: not app.in_flight, timeout_s=10)
                assert app.recent.total == 1 + 3 * len(FAULTS)
                gc.set_debug(gc.DEBUG_SAVEALL)
                gc.collect()
                left = _watched(gc.garbage)
            finally:
                gc.set_debug(0)
                gc.garbage.clear()
                gc.enable()
    assert not left, f"cyclic garbage after {3 * len(FAULTS)} requests: {dict(left)}"
