"""The measuring client shared by `replay` and `bench`: sends requests and meters each
response with the same core as the proxy. How requests are scheduled is the load shapes'
(`mlxproxy.load.run.shapes`); what a run returns is a `Timed`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from mlxproxy.core.analyze import finish_checked
from mlxproxy.core.cachecheck import PrefixIndex
from mlxproxy.core.clients import classify
from mlxproxy.core.detect import Thresholds
from mlxproxy.core.meter import RequestMeter
from mlxproxy.core.openai import parse_request
from mlxproxy.core.record import Record
from mlxproxy.errors import UpstreamBodyError, UpstreamBodyTimeout, UpstreamError
from mlxproxy.headers import NOT_RESENT, REPLAY_HEADER
from mlxproxy.load.data.results import RunRecord, SessionTurn
from mlxproxy.load.data.summary import Summary
from mlxproxy.load.run.rawhttp import RawPool

__all__ = ["MAX_CONNECTIONS", "PreparedRequest", "MeasuringClient", "Timed", "default_max_connections"]

now = time.perf_counter


def _wire(text: str) -> bytes:
    """A header name or value as bytes: latin-1 (HTTP's own), UTF-8 for what latin-1 cannot
    hold (a hand-edited capture), never an exception in the middle of a run."""
    try:
        return text.encode("latin-1")
    except UnicodeEncodeError:
        return text.encode("utf-8")


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


class _Collect:
    """The sink of an unmetered request: status and body."""

    def __init__(self) -> None:
        self.status = 0
        self.parts: list[bytes] = []

    def response_started(self, t: float, status: int, content_type: str | None) -> None:
        self.status = status

    def feed(self, data: bytes, t: float) -> None:
        self.parts.append(data)


@dataclass
class Timed:
    """The records of one run plus the load generator's own schedule lag, and what a shape
    adds: each record's place in a conversation run (`where`) and each run's wall time, the
    records of each wave released together."""

    records: list[Record] = field(default_factory=list)
    lag_s: list[float] = field(default_factory=list)
    source_ids: dict[str, str | None] = field(default_factory=dict)  # record id -> captured id
    lag_by_id: dict[str, float] = field(default_factory=dict)  # record id -> its schedule lag
    where: dict[str, SessionTurn] = field(default_factory=dict)  # record id -> session, turn, think time
    session_s: list[float] = field(default_factory=list)  # each conversation run's wall time
    waves: list[list[Record]] = field(default_factory=list)  # each wave's records (released together)

    def add(self, r: Record, source_id: str | None) -> None:
        """One finished request, with the captured request it replays (None: synthetic)."""
        self.records.append(r)
        self.source_ids[r.id] = source_id

    def annotate(self, summary: Summary) -> Summary:
        """`summary` with what this run adds to it: nothing here (a run merged from several
        workers adds each worker's figures: `mlxproxy.load.fleet.workers.FleetTimed`)."""
        return summary

    def rows(self, where: Mapping[str, SessionTurn] | None = None, *, source_ids: bool = True) -> list[RunRecord]:
        """The records as a group holds them: each with its `source_id` (unless `source_ids`
        is False), its `schedule_lag_s` when it had a due time (open loop, recorded offsets)
        and its place in a replayed conversation (`where`)."""
        where = self.where if where is None else where
        return [
            RunRecord.of(
                r,
                source_id=self.source_ids.get(r.id) if source_ids else None,
                has_source_id=source_ids,
                schedule_lag_s=self.lag_by_id.get(r.id),
                where=where.get(r.id),
            )
            for r in self.records
        ]


#: the most connections one process opens to a target by default: an open loop far past what
#: the server (or the generator) can take queues its late requests here instead of opening one
#: connection each (thousands: the host's ephemeral ports and file descriptors run out)
MAX_CONNECTIONS = 1024


def default_max_connections() -> int:
    """`MAX_CONNECTIONS`, or half this process's open-file limit where that is lower."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):  # (no resource module on Windows)
        return MAX_CONNECTIONS
    return MAX_CONNECTIONS if soft == resource.RLIM_INFINITY else max(16, min(MAX_CONNECTIONS, soft // 2))


class MeasuringClient:
    """Sends `PreparedRequest`s to one target and returns a checked `Record` for each.

    Never raises for a request's own failure: refused connections, timeouts and broken
    bodies become the record's outcome, so one bad target cannot stop a run.
    """

    def __init__(
        self,
        base_url: str,
        *,
        name: str = "target",
        thresholds: Thresholds | None = None,
        api_key: str | None = None,
        timeout_s: float = 1800.0,
        connect_timeout_s: float = 10.0,
        tag_replay: bool = True,
        keep_text: bool = False,
        max_connections: int | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        # requests in flight to this target at once (`--max-connections`); past it they queue in
        # this process, the wait counted in their TTFT and E2E (they started when they were due)
        self.max_connections = max_connections or default_max_connections()
        self.name = name
        self.th = thresholds or Thresholds()
        self.api_key = api_key
        self.tag_replay = tag_replay
        self.keep_text = keep_text
        self.timeout_s, self.connect_timeout_s = timeout_s, connect_timeout_s
        self._sending = 0  # requests this process has in flight
        self.finished: list[Record] = []
        # while load worker processes send for this client (`mlxproxy.load.fleet.workers`): their
        # finished requests, requests in flight and tokens received so far, for the progress line
        self.elsewhere: Callable[[], tuple[int, int, int]] | None = None
        # prompt fingerprints of the conversations sent (the cache doctor's re-prefill causes); None: not tracked
        self.prefixes: PrefixIndex | None = None
        self._streaming: set[RequestMeter] = set()  # the meters of the requests in flight
        self._tokens_done = 0  # output tokens of the finished requests
        # A lean raw-asyncio HTTP/1.1 client (mlxproxy.load.run.rawhttp): each socket read goes
        # straight from the connection's protocol to the request's meter, stamped once on
        # arrival, so the client is not what limits a run (benchmarks/README.md, "Is the
        # load generator ever the bottleneck?"). `timeout_s` bounds every wait for bytes,
        # headers included.
        self._pooled = RawPool(
            self.base_url,
            name=name,
            connect_timeout_s=connect_timeout_s,
            read_timeout_s=timeout_s,
            max_connections=self.max_connections,
        )
        # Requests released together must start alike: each on a new connection, never one
        # on a warm keep-alive connection and the other still connecting (a few ms apart,
        # enough for a server to admit the second one into its batch late).
        self._fresh = RawPool(
            self.base_url,
            name=name,
            connect_timeout_s=connect_timeout_s,
            read_timeout_s=timeout_s,
            reuse_connections=False,
            max_connections=self.max_connections,
        )
        # credentials in the URL (user:password@) become Basic auth, as in the proxy
        self._url_auth = self._pooled.auth_header.decode("latin-1") if self._pooled.auth_header else None

    @property
    def in_flight(self) -> int:
        return self._sending + (self.elsewhere()[1] if self.elsewhere else 0)

    @property
    def finished_count(self) -> int:
        return len(self.finished) + (self.elsewhere()[0] if self.elsewhere else 0)

    def tokens_received(self) -> int:
        """Output tokens received so far: those of the finished requests and the tokens
        streamed so far by the requests in flight (for the progress line)."""
        there = self.elsewhere()[2] if self.elsewhere else 0
        return self._tokens_done + sum(m.generated_events for m in self._streaming) + there

    async def aclose(self) -> None:
        await self._pooled.aclose()
        await self._fresh.aclose()

    async def __aenter__(self) -> MeasuringClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _headers(self, req: PreparedRequest) -> list[tuple[bytes, bytes]]:
        headers = [(k, v) for k, v in req.headers if k.lower() not in NOT_RESENT]
        auth = f"Bearer {self.api_key}" if self.api_key is not None else self._url_auth
        if auth is not None:
            headers = [(k, v) for k, v in headers if k.lower() != "authorization"]
            headers.append(("authorization", auth))
        if not any(k.lower() == "content-type" for k, _ in headers) and req.body:
            headers.append(("content-type", "application/json"))
        headers.append(("accept-encoding", "identity"))
        if self.tag_replay:
            headers.append((REPLAY_HEADER, "1"))
        out = [(_wire(k), _wire(v)) for k, v in headers]
        for k, v in out:
            if any(c in k + v for c in b"\r\n\0"):
                raise ValueError(
                    f"the header {k[:40].decode('latin-1')!r} holds a line break or NUL, which HTTP cannot carry"
                )
        return out

    def _target(self, path: str) -> bytes:
        return self._pooled.target(path)

    async def fetch(self, method: str, path: str) -> tuple[int, bytes]:
        """One unmetered request (for example `GET /v1/models` to discover the model):
        the status and the whole body. Raises `UpstreamError` or `UpstreamBodyError` when
        no complete answer came."""
        headers = [(b"accept-encoding", b"identity")]
        auth = f"Bearer {self.api_key}" if self.api_key is not None else self._url_auth
        if auth is not None:
            headers.append((b"authorization", auth.encode("latin-1")))
        try:
            target = self._target(path)
        except ValueError as exc:
            raise UpstreamError(f"cannot send {path[:80]!r} to {self.base_url}: {exc}") from None
        got = _Collect()
        await self._pooled.request(method, target, headers, b"", got)
        return got.status, b"".join(got.parts)

    async def send(self, req: PreparedRequest, *, fresh_connection: bool = False) -> Record:
        """Send one request and return its checked record. `fresh_connection` opens a new
        connection for it (used for requests released together)."""
        up = self._fresh if fresh_connection else self._pooled
        info, _ = parse_request(req.method, req.path, req.body)
        self._sending += 1
        t_start = now()
        meter = RequestMeter(
            info,
            request_id=os.urandom(8).hex(),
            upstream=self.name,
            t_start=t_start,
            started_at=time.time(),
            concurrency=self._sending,
            tags=("replay",) if self.tag_replay else (),
            keep_text=self.keep_text,
        )
        outcome = error = None
        self._streaming.add(meter)
        try:
            try:
                target = self._target(req.path)
                headers = self._headers(req)
            except ValueError as exc:
                raise UpstreamError(f"cannot send {req.path[:80]!r} to {self.base_url}: {exc}") from None
            meter.upstream_sent(now())
            # the meter is the response's sink: status and every read reach it from the
            # connection's protocol, each read stamped once when it arrived
            await up.request(req.method, target, headers, req.body, meter)
        except UpstreamError as exc:  # no response: refused, reset, timed out, bad URL
            outcome, error = exc.outcome, str(exc)
        except UpstreamBodyTimeout as exc:
            outcome, error = "upstream_timeout", str(exc)
        except UpstreamBodyError as exc:  # the body broke after the response started
            error = str(exc)
        finally:
            self._sending -= 1
            self._streaming.discard(meter)
        record = finish_checked(
            meter, now(), self.th, outcome=outcome, error=error, earlier=self.finished[-64:], prefixes=self.prefixes,
            client=classify(req.headers, req.method, req.path, info.prompt_obj),
        )  # fmt: skip
        self.finished.append(record)
        self._tokens_done += record.n_out or meter.generated_events
        return record
