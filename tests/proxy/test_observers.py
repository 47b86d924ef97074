"""The observer contract (`mlxproxy.proxy.observers.Observer`): every finished request's record
reaches every observer with its exchange when a capture is on, `close()` runs once at shutdown
after the last record, and a failing observer is logged and counted without touching the others
or the stream."""

from __future__ import annotations

from pathlib import Path

import httpx
from prometheus_client import CollectorRegistry

from fakeupstream import FakeUpstream, sse_response
from mlxproxy.capture import Exchange, read_capture
from mlxproxy.config import build_config
from mlxproxy.core.record import Record
from mlxproxy.edge.runner import ServerThread
from mlxproxy.proxy.app import create_app
from support import read_fixture, wait_for

BODY = read_fixture("wire/01_openai_reference_include_usage.sse")
REQ = {
    "model": "m",
    "stream": True,
    "messages": [{"role": "user", "content": "hi"}],
    "stream_options": {"include_usage": True},  # asked by the client: nothing injected, nothing stripped
}


class Seeing:
    def __init__(self, name: str, fail: bool = False) -> None:
        self.name, self.fail = name, fail
        self.got: list[tuple[Record, Exchange | None]] = []
        self.closed = 0
        self.records_when_closed: int | None = None

    def on_record(self, record: Record, exchange: Exchange | None = None) -> None:
        self.got.append((record, exchange))
        if self.fail:
            raise RuntimeError("observer bug")

    def close(self) -> None:
        self.closed += 1
        self.records_when_closed = len(self.got)
        if self.fail:
            raise RuntimeError("observer bug on close")


def run(tmp_path: Path, capture: bool, n: int = 3) -> tuple[Seeing, Seeing, CollectorRegistry, Path]:
    good, bad = Seeing("good"), Seeing("bad", fail=True)
    registry = CollectorRegistry()
    cap = tmp_path / "cap.jsonl"
    with FakeUpstream(sse_response(BODY)) as up:
        config = build_config(None, upstream_url=up.url, log_requests=False, capture=str(cap) if capture else None)
        app = create_app(config, registry=registry, observers=[bad, good])
        with ServerThread(app) as srv:
            for _ in range(n):
                r = httpx.post(srv.url + "/v1/chat/completions", json=REQ, timeout=30)
                assert r.status_code == 200 and r.content == BODY  # the failing observer never touches the stream
            assert wait_for(lambda: len(good.got) == n)
            assert good.closed == 0  # only at shutdown
    return good, bad, registry, cap


def test_every_observer_gets_every_record_then_one_close_at_shutdown(tmp_path: Path) -> None:
    good, bad, registry, _ = run(tmp_path, capture=False)
    assert len(good.got) == 3 and len(bad.got) == 3 and all(ex is None for _, ex in good.got)
    assert {r.outcome for r, _ in good.got} == {"ok"}
    assert good.closed == 1 and good.records_when_closed == 3
    assert bad.closed == 1  # a failing observer is still closed, and the next one too
    errors = registry.get_sample_value("mlxproxy_observer_errors_total", {"observer": "bad"})
    assert errors == 4  # three records and the close, each counted
    assert registry.get_sample_value("mlxproxy_observer_errors_total", {"observer": "good"}) in (None, 0)


def test_with_a_capture_observers_get_the_exchange_and_the_capture_is_closed_whole(tmp_path: Path) -> None:
    good, _, _, cap = run(tmp_path, capture=True, n=2)
    for _, exchange in good.got:
        assert exchange is not None and b'"messages"' in exchange.body
        assert any(k.lower() == b"content-type" for k, _ in exchange.request_headers)
    caps = read_capture(cap)
    assert [c.record.id for c in caps] == [r.id for r, _ in good.got]  # written and closed by the shutdown
