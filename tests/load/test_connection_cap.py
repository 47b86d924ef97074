"""An open loop far past what can be served never distorts the answer: at three times the rate
the target (through the connection cap) can take, the load generator opens no more connections
than its cap, reuses them (no connection per late request, so no ephemeral-port exhaustion), and
the time a request queued in the generator for a connection is in its TTFT and E2E."""

from __future__ import annotations

import asyncio

import orjson

from mlxproxy.core.stats import percentile
from mlxproxy.load.data.results import RunRecord
from mlxproxy.load.judge.slo import effective
from mlxproxy.load.run.client import MAX_CONNECTIONS, MeasuringClient, PreparedRequest, default_max_connections
from mlxproxy.load.run.runner import send
from mlxproxy.load.run.shapes import Load, OpenLoop

SERVICE_S = 0.2  # the server answers each request this long after it arrived
CAP = 8
SERVED_RATE = CAP / SERVICE_S  # 40 req/s is what the target takes through the cap
RATE = 3 * SERVED_RATE
REQUESTS = 120  # 1 s of the open loop; the last ones wait ~2 s for a connection


def _chunk(delta: dict[str, str], finish: str | None = None) -> bytes:
    choice = {"index": 0, "delta": delta, "finish_reason": finish}
    return b"data: " + orjson.dumps({"id": "c", "object": "chat.completion.chunk", "model": "m", "choices": [choice]})


# one streamed answer: its first token, then the end (TTFT and E2E both measured)
BODY = b"\n\n".join([_chunk({"role": "assistant", "content": "hi"}), _chunk({}, "stop"), b"data: [DONE]", b""])


class SlowServer:
    """HTTP/1.1 keep-alive server answering every request after `SERVICE_S`, counting the
    connections it accepted and the most open at once."""

    def __init__(self) -> None:
        self.accepted = 0
        self.open = 0
        self.most_open = 0
        self.server: asyncio.base_events.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        self.open += 1
        self.most_open = max(self.most_open, self.open)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                await reader.readexactly(length)
                await asyncio.sleep(SERVICE_S)
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: "
                    + str(len(BODY)).encode()
                    + b"\r\n\r\n"
                    + BODY
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            self.open -= 1
            writer.close()


def test_an_open_loop_past_the_cap_queues_in_the_generator_and_counts_the_wait() -> None:
    async def main() -> tuple[SlowServer, list[RunRecord]]:
        srv = SlowServer()
        url = await srv.start()
        body = orjson.dumps({"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]})
        reqs = [PreparedRequest("POST", "/v1/chat/completions", body) for _ in range(REQUESTS)]
        async with MeasuringClient(url, name="s", max_connections=CAP) as c:  # due at i / RATE s
            timed = await send(OpenLoop(RATE), Load(reqs), c)
        assert srv.server is not None
        srv.server.close()
        return srv, timed.rows()

    srv, rows = asyncio.run(main())
    assert len(rows) == REQUESTS and all(r.record.outcome == "ok" for r in rows)
    # never more connections than the cap, and those few reused: not one per late request
    assert srv.most_open <= CAP, srv.most_open
    assert srv.accepted <= CAP, srv.accepted
    # the queue: the server took each request in SERVICE_S, but the k-th request sent waited for
    # a connection about k / SERVED_RATE - k / RATE seconds; that wait is in TTFT and E2E
    ordered = sorted(rows, key=lambda r: r.record.t_start_mono)
    last = ordered[-10:]
    want_wait = (REQUESTS - 10) / SERVED_RATE - REQUESTS / RATE  # ~1.75 s for the last ten
    for r in last:
        e2e, ttft = effective(r, "e2e_s"), effective(r, "ttft_s")
        assert e2e is not None and e2e >= SERVICE_S + 0.8 * want_wait, (e2e, want_wait)
        assert ttft is not None and ttft >= 0.8 * want_wait, (ttft, want_wait)
    first = ordered[:CAP]  # these found a free connection: only the server's time
    assert all((r.record.e2e_s or 0.0) < SERVICE_S + 0.5 for r in first)
    p95 = percentile(sorted(effective(r, "e2e_s") or 0.0 for r in rows), 95)
    assert p95 is not None and p95 > 5 * SERVICE_S  # an uncapped client would have said ~SERVICE_S


def test_the_default_cap_stays_under_the_open_file_limit() -> None:
    cap = default_max_connections()
    assert 16 <= cap <= MAX_CONNECTIONS
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except ImportError:
        return
    if soft != resource.RLIM_INFINITY:
        assert cap <= max(16, soft // 2)
