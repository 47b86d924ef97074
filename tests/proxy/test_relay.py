"""The relay (`proxy/relay.py`): every read reaches the client before the meter parses it, and a
metering failure never breaks the stream."""

from __future__ import annotations

import threading

import httpx
import pytest

from fakeupstream import Conn, Req
from faultrig import FINISH, OK_BODY, SSE_CHUNKED, STREAM_REQ, ok_events, read_all, rig
from mlxproxy.core.meter import RequestMeter
from mlxproxy.core.sse import SSEDecoder, SSEEvent
from support import EVENT_A


@pytest.mark.parametrize("injected", [False, True], ids=["passthrough", "usage-injected"])
@pytest.mark.parametrize("where", ["meter", "decoder"])
def test_a_metering_failure_never_breaks_the_stream(
    where: str, injected: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug that makes the meter raise mid-stream: the stream is still forwarded whole
    (stripping the injected usage event stops with the metering), the record says
    `protocol_error`, and the proxy goes on serving."""
    # the general path and the fast path of plain data events (`_feed_payloads`, `data_payloads`)
    target, names = (
        (RequestMeter, ("_feed_items", "_feed_payloads"))
        if where == "meter"
        else (SSEDecoder, ("feed", "data_payloads"))
    )
    reals = {name: getattr(target, name) for name in names}
    calls = [0]
    first_fed = threading.Event()

    def breaking(name):
        def breaks_on_the_second_call(self, *args):
            calls[0] += 1
            first_fed.set()
            if calls[0] == 2:
                raise ValueError("a metering bug")
            return reals[name](self, *args)

        return breaks_on_the_second_call

    async def per_event(req: Req, conn: Conn) -> None:
        await conn.head(200, SSE_CHUNKED)
        first, *rest = ok_events(OK_BODY)
        await conn.chunk(first)
        await conn.wait_gate(first_fed, 30)  # the rest arrives in a later read, so there is a second call
        for e in rest:
            await conn.chunk(e)
        await conn.end_chunked()

    usage = [e for e in ok_events(OK_BODY) if b'"choices":[]' in e][0]
    body = {**STREAM_REQ}
    if injected:
        del body["stream_options"]
    with rig({"m": per_event}) as t:
        for name in names:
            monkeypatch.setattr(target, name, breaking(name))
        status, got, exc, headers = read_all(t.url, body)
        for name in names:
            monkeypatch.setattr(target, name, reals[name])
        assert (status, exc) == (200, None) and got in (OK_BODY, OK_BODY.replace(usage, b""))
        rec = t.record(headers["x-mlxproxy-request-id"])
        assert rec.outcome == "protocol_error" and rec.error == "metering failed: ValueError"
        with t.healthy_stream_alongside():
            pass


@pytest.mark.parametrize("injected", [False, True], ids=["passthrough", "usage-injected"])
def test_the_client_has_each_event_before_the_meter_parses_it(injected: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Forward first, meter after, also where the proxy strips the usage event it injected
    (only the SSE framing is read first there): the meter's parse of the first event waits,
    blocking the proxy's loop, until the client says it has that event. A proxy that metered
    first would never let the event out and the wait would run out."""
    real, real_fast = RequestMeter._feed_items, RequestMeter._feed_payloads
    client_has_it = threading.Event()
    waits: list[bool] = []

    def after_the_client(self, items, t):
        if not waits and any(isinstance(i, SSEEvent) for i in items):
            waits.append(client_has_it.wait(10))
        return real(self, items, t)

    def after_the_client_fast(self, payloads, nbytes, t):  # the fast path of plain data events
        if not waits and payloads:
            waits.append(client_has_it.wait(10))
        return real_fast(self, payloads, nbytes, t)

    async def per_event(req: Req, conn: Conn) -> None:
        await conn.head(200, SSE_CHUNKED)
        for e in ok_events(OK_BODY):
            await conn.chunk(e)
        await conn.end_chunked()

    body = {**STREAM_REQ}
    if injected:
        del body["stream_options"]
    with rig({"m": per_event}) as t:
        monkeypatch.setattr(RequestMeter, "_feed_items", after_the_client)
        monkeypatch.setattr(RequestMeter, "_feed_payloads", after_the_client_fast)
        with httpx.Client(timeout=30) as c, c.stream("POST", t.url + "/v1/chat/completions", json=body) as r:
            lines = []
            for line in r.iter_lines():
                if line.startswith("data: "):
                    client_has_it.set()
                lines.append(line)
            rid = r.headers["x-mlxproxy-request-id"]
        assert waits == [True]  # the client had the event while the meter had not parsed it yet
        assert [x for x in lines if x][-1] == "data: [DONE]"
        rec = t.record(rid)
        assert (rec.outcome, rec.generated_events, rec.completion_tokens_reported) == ("ok", 2, 2)  # "Hello", " world"


def test_a_comment_with_thousands_of_digits_is_forwarded_whole() -> None:
    """The real trigger of a meter bug (int() of 5000 digits): the bytes still pass."""
    body = b": keepalive " + b"1" * 5000 + b"/2\n\n" + EVENT_A + FINISH + b"data: [DONE]\n\n"

    async def handler(req: Req, conn: Conn) -> None:
        await conn.head(200, SSE_CHUNKED)
        await conn.chunk(body)
        await conn.end_chunked()

    with rig({"m": handler}) as t, t.healthy_stream_alongside():
        status, got, exc, headers = read_all(t.url, STREAM_REQ)
        assert (status, got, exc) == (200, body, None)
        assert t.record(headers["x-mlxproxy-request-id"]).outcome in ("ok", "protocol_error")
