"""The measuring client shared by `replay` and `bench`: sends requests, meters each
response with the same core as the proxy, and schedules them in the four ways the
reports use (one at a time, recorded offsets, closed loop, released-together waves).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import httpx

from mlxproxy.core.analyze import finish_checked
from mlxproxy.core.detect import Thresholds
from mlxproxy.core.meter import RequestMeter
from mlxproxy.core.openai import parse_request
from mlxproxy.core.record import Record

__all__ = ["PreparedRequest", "MeasuringClient", "Timed"]

now = time.perf_counter
REPLAY_HEADER = "x-mlxproxy-replay"
# hop-by-hop and framing headers, and ones this client sets itself, are never sent as given
_NOT_RESENT = frozenset({"host", "content-length", "transfer-encoding", "connection", "keep-alive", "te", "upgrade",
                         "accept-encoding", "proxy-authorization", REPLAY_HEADER})


@dataclass(frozen=True)
class PreparedRequest:
    """A request ready to send. `offset_s` is its recorded time from the start of a
    capture; `source_id` the captured record it replays (None for synthetic ones)."""

    method: str
    path: str
    body: bytes
    headers: tuple[tuple[str, str], ...] = ()
    offset_s: float = 0.0
    source_id: str | None = None
    label: str = ""


@dataclass
class Timed:
    """The records of one run plus the load generator's own schedule lag."""

    records: list[Record] = field(default_factory=list)
    lag_s: list[float] = field(default_factory=list)
    source_ids: dict[str, str | None] = field(default_factory=dict)  # record id -> captured id


class MeasuringClient:
    """Sends `PreparedRequest`s to one target and returns a checked `Record` for each.

    Never raises for a request's own failure: refused connections, timeouts and broken
    bodies become the record's outcome, so one bad target cannot stop a run.
    """

    def __init__(self, base_url: str, *, name: str = "target", thresholds: Thresholds | None = None,
                 api_key: str | None = None, timeout_s: float = 1800.0, connect_timeout_s: float = 10.0,
                 tag_replay: bool = True, keep_text: bool = False) -> None:
        self.base_url = base_url.rstrip("/")
        self.name = name
        self.th = thresholds or Thresholds()
        self.api_key = api_key
        self.tag_replay = tag_replay
        self.keep_text = keep_text
        self.in_flight = 0
        self.finished: list[Record] = []
        self._timeout = httpx.Timeout(timeout_s, connect=connect_timeout_s)
        self._client = httpx.AsyncClient(timeout=self._timeout, trust_env=False,
                                         limits=httpx.Limits(max_connections=None, max_keepalive_connections=512))
        # Requests released together must start alike: each on a new connection, never one
        # on a warm keep-alive connection and the other still connecting (a few ms apart,
        # enough for a server to admit the second one into its batch late).
        self._fresh = httpx.AsyncClient(timeout=self._timeout, trust_env=False,
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=0))

    async def aclose(self) -> None:
        await self._client.aclose()
        await self._fresh.aclose()

    async def __aenter__(self) -> MeasuringClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _headers(self, req: PreparedRequest) -> list[tuple[str, str]]:
        headers = [(k, v) for k, v in req.headers if k.lower() not in _NOT_RESENT]
        if self.api_key is not None:
            headers = [(k, v) for k, v in headers if k.lower() != "authorization"]
            headers.append(("authorization", f"Bearer {self.api_key}"))
        if not any(k.lower() == "content-type" for k, _ in headers) and req.body:
            headers.append(("content-type", "application/json"))
        headers.append(("accept-encoding", "identity"))
        if self.tag_replay:
            headers.append((REPLAY_HEADER, "1"))
        return headers

    async def send(self, req: PreparedRequest, *, fresh_connection: bool = False) -> Record:
        """Send one request and return its checked record. `fresh_connection` opens a new
        connection for it (used for requests released together)."""
        http = self._fresh if fresh_connection else self._client
        info, _ = parse_request(req.method, req.path, req.body)
        self.in_flight += 1
        t_start = now()
        meter = RequestMeter(info, request_id=os.urandom(8).hex(), upstream=self.name, t_start=t_start,
                             started_at=time.time(), concurrency=self.in_flight, tags=("replay",) if self.tag_replay else (),
                             keep_text=self.keep_text)
        outcome = error = None
        try:
            meter.upstream_sent(now())
            request = http.build_request(req.method, self.base_url + req.path, content=req.body,
                                         headers=self._headers(req))
            response = await http.send(request, stream=True)
            try:
                meter.response_started(now(), response.status_code, response.headers.get("content-type"))
                async for chunk in response.aiter_raw():
                    meter.feed(chunk, now())
            finally:
                await response.aclose()
        except httpx.TimeoutException as exc:
            outcome, error = "upstream_timeout", f"no answer within the timeout ({type(exc).__name__})"
        except httpx.ConnectError as exc:
            outcome, error = "upstream_unreachable", f"cannot connect to {self.base_url}: {str(exc)[:160] or type(exc).__name__}"
        except httpx.HTTPError as exc:
            error = f"{type(exc).__name__}: {str(exc)[:160]}"
            if meter.status is None:
                outcome = "upstream_unreachable"
        finally:
            self.in_flight -= 1
        record = finish_checked(meter, now(), self.th, outcome=outcome, error=error, earlier=self.finished[-64:])
        self.finished.append(record)
        return record

    # -- schedules ---------------------------------------------------------------------

    async def run_sequential(self, reqs: Sequence[PreparedRequest], progress: Callable[[], None] | None = None) -> Timed:
        out = Timed()
        for req in reqs:
            r = await self.send(req)
            out.records.append(r)
            out.source_ids[r.id] = req.source_id
            if progress:
                progress()
        return out

    async def run_recorded(self, reqs: Sequence[PreparedRequest], speed: float = 1.0,
                           progress: Callable[[], None] | None = None) -> Timed:
        """Each request sent at its recorded offset / speed, against absolute deadlines;
        the lag of every actual send behind its deadline is kept."""
        out = Timed()
        if not reqs:
            return out
        first = min(r.offset_s for r in reqs)
        t0 = now()

        async def one(req: PreparedRequest) -> None:
            deadline = t0 + (req.offset_s - first) / speed
            delay = deadline - now()
            if delay > 0:
                await asyncio.sleep(delay)
            out.lag_s.append(max(0.0, now() - deadline))
            r = await self.send(req)
            out.records.append(r)
            out.source_ids[r.id] = req.source_id
            if progress:
                progress()

        await asyncio.gather(*(one(r) for r in sorted(reqs, key=lambda r: r.offset_s)))
        return out

    async def run_open_loop(self, reqs: Sequence[PreparedRequest], offsets: Sequence[float],
                            progress: Callable[[], None] | None = None,
                            ramp: tuple[Sequence[PreparedRequest], Sequence[float], float] | None = None) -> Timed:
        """Open loop: request i is sent at `offsets[i]` seconds from now, whatever the server
        does (see `mlxproxy.load.arrival_offsets`); the schedule lag of every send is kept.
        `ramp` = (requests, offsets, seconds): those are sent first, on their own schedule
        (`mlxproxy.load.ramp_offsets`), and the measured requests start `seconds` later; the
        ramp's requests are sent but not returned (not measured)."""
        import dataclasses

        timed = [dataclasses.replace(r, offset_s=o) for r, o in zip(reqs, offsets)]
        if ramp is None or not ramp[0]:
            return await self.run_recorded(timed, 1.0, progress)
        ramp_reqs = [dataclasses.replace(r, offset_s=o) for r, o in zip(ramp[0], ramp[1])]

        async def main() -> Timed:
            await asyncio.sleep(ramp[2])
            return await self.run_recorded(timed, 1.0, progress)

        _, out = await asyncio.gather(self.run_recorded(ramp_reqs, 1.0), main())
        return out

    async def run_closed_loop(self, reqs: Sequence[PreparedRequest], concurrency: int,
                              progress: Callable[[], None] | None = None) -> Timed:
        """`concurrency` workers, each sending the next request as soon as its last one ended."""
        out = Timed()
        queue = list(reqs)[::-1]

        async def worker() -> None:
            while queue:
                req = queue.pop()
                r = await self.send(req)
                out.records.append(r)
                out.source_ids[r.id] = req.source_id
                if progress:
                    progress()

        await asyncio.gather(*(worker() for _ in range(max(1, concurrency))))
        return out

    async def run_waves(self, reqs: Sequence[PreparedRequest], size: int,
                        progress: Callable[[], None] | None = None) -> tuple[Timed, list[list[Record]]]:
        """Waves of `size` requests released together: every task is started and waiting
        on one gate before the gate opens (the double-batch method). Returns all
        records and the records of each wave."""
        out = Timed()
        waves: list[list[Record]] = []
        items = list(reqs)
        for i in range(0, len(items), size):
            wave = items[i : i + size]
            gate = asyncio.Event()
            ready = 0
            all_ready = asyncio.Event()

            # awaited within this iteration (gather below), so the loop variables are this wave's
            async def one(req: PreparedRequest) -> Record:
                nonlocal ready
                ready += 1
                if ready == len(wave):  # noqa: B023
                    all_ready.set()  # noqa: B023
                await gate.wait()  # noqa: B023
                return await self.send(req, fresh_connection=True)

            tasks = [asyncio.ensure_future(one(r)) for r in wave]
            await all_ready.wait()
            gate.set()
            recs = list(await asyncio.gather(*tasks))
            for req, r in zip(wave, recs):
                out.source_ids[r.id] = req.source_id
                if progress:
                    progress()
            out.records.extend(recs)
            waves.append(recs)
        return out, waves
