"""The sans-I/O measurement core, shared by the proxy, replay, bench and the tests.

Nothing in this package imports asyncio, an HTTP library or a clock: every function takes
bytes, decoded values and timestamps as arguments and returns values.
"""

from __future__ import annotations

from mlxproxy.core.meter import RequestMeter
from mlxproxy.core.openai import RequestInfo, classify_chunk, endpoint_of, parse_request
from mlxproxy.core.record import OK_OUTCOMES, OUTCOMES, Record
from mlxproxy.core.sse import SSEComment, SSEDecoder, SSEEvent, SSEProtocolError
from mlxproxy.core.stats import percentile, summarize

__all__ = [
    "RequestMeter",
    "RequestInfo",
    "classify_chunk",
    "endpoint_of",
    "parse_request",
    "Record",
    "OUTCOMES",
    "OK_OUTCOMES",
    "SSEDecoder",
    "SSEEvent",
    "SSEComment",
    "SSEProtocolError",
    "percentile",
    "summarize",
]
