"""Capture durability (`proxy/capture_writer.py`): a full, stuck or unwritable disk and a killed
process never block streams and never leave a torn line behind."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from fakeupstream import FakeUpstream
from faultrig import OK_BODY, STREAM_REQ, healthy_handler, rig, wait_for
from mlxproxy.capture import read_capture
from mlxproxy.core.record import OUTCOMES, Record
from mlxproxy.proxy.capture_writer import CaptureWriter

# -- capture durability -------------------------------------------------------------------------


def a_record(i: int) -> Record:
    return Record(
        id=f"r{i}",
        started_at=0.0,
        upstream="u",
        model="m",
        endpoint="chat_completions",
        stream=True,
        status=200,
        outcome="ok",
        t_start_mono=float(i),
    )


class FlakyDisk:
    """A capture file on a disk that fills up: while `full`, each write stores half of what
    it is given and then fails with ENOSPC, as a real full disk can."""

    def __init__(self, real) -> None:
        self.real = real
        self.full = False

    def write(self, data) -> int:
        if self.full:
            self.real.write(bytes(data[: max(1, len(data) // 2)]))
            raise OSError(28, "No space left on device")
        return self.real.write(data)

    def fileno(self) -> int:
        return self.real.fileno()

    def close(self) -> None:
        self.real.close()


def test_capture_on_a_full_disk_counts_reports_once_and_keeps_whole_lines(tmp_path: Path, caplog) -> None:
    errors: list[int] = []
    w = CaptureWriter(tmp_path / "c.jsonl", on_error=lambda: errors.append(1))
    disk = w._file = FlakyDisk(w._file)
    for i in range(30):
        disk.full = 10 <= i < 20  # full for a while, then space comes back
        w.on_record(a_record(i), None)
        w.flush()
    w.close()
    assert (w.written, w.write_errors, len(errors)) == (20, 10, 10)
    assert sum("capture to" in r.getMessage() for r in caplog.records) == 1
    assert [c.record.id for c in read_capture(tmp_path / "c.jsonl")] == [f"r{i}" for i in [*range(10), *range(20, 30)]]


def test_capture_reopened_after_a_crash_cuts_off_the_torn_line(tmp_path: Path, caplog) -> None:
    p = tmp_path / "c.jsonl"
    w = CaptureWriter(p)
    for i in range(3):
        w.on_record(a_record(i), None)
    w.close()
    whole = p.read_bytes()
    p.write_bytes(whole + whole.splitlines(keepends=True)[0][:50])  # killed while writing a fourth line
    warnings: list[str] = []
    assert len(read_capture(p, warn=warnings.append)) == 3 and "torn last line" in warnings[0]
    w = CaptureWriter(p)  # a restarted proxy appends to the same file
    w.on_record(a_record(3), None)
    w.close()
    assert [c.record.id for c in read_capture(p)] == ["r0", "r1", "r2", "r3"]
    assert any("torn line" in r.getMessage() for r in caplog.records)


def test_unwritable_capture_path_never_stops_the_proxy(tmp_path: Path, caplog) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the capture's directory should be")
    with rig({"m": lambda req, conn: healthy_handler(req, conn, None)}, capture=str(blocker / "cap.jsonl")) as t:
        for _ in range(3):
            r = httpx.post(t.url + "/v1/chat/completions", json=STREAM_REQ)
            assert r.status_code == 200 and r.content == OK_BODY
        assert wait_for(lambda: t.app.registry.get_sample_value("mlxproxy_capture_errors_total") == 3)
    assert sum("capture to" in r.getMessage() for r in caplog.records) == 1


def test_a_stuck_capture_disk_never_slows_streams(tmp_path: Path) -> None:
    """The capture's disk hangs (a stalled network mount): streams keep flowing, records
    that do not fit the capture queue are dropped and counted, and the rest are written
    once the disk comes back."""
    stuck = threading.Event()
    with rig(
        {"m": lambda req, conn: healthy_handler(req, conn, None)},
        capture=str(tmp_path / "c.jsonl"),
        capture_queue_size=4,
    ) as t:
        assert t.app.capture is not None
        real_write = t.app.capture._file.write
        t.app.capture._file.write = lambda data: (stuck.wait(30), real_write(data))[1]
        for _ in range(20):
            r = httpx.post(t.url + "/v1/chat/completions", json=STREAM_REQ, timeout=10)
            assert r.status_code == 200 and r.content == OK_BODY
        assert len(t.records(20)) == 20
        dropped = t.app.registry.get_sample_value("mlxproxy_capture_dropped_total")
        assert dropped is not None and 20 - 4 - 1 <= dropped < 20  # the queue, plus the one stuck in write
        stuck.set()
        assert wait_for(lambda: t.app.capture is not None and t.app.capture.written == 20 - dropped)


def start_proxy_process(upstream_url: str, *args: str, **popen) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlxproxy", "serve", "--upstream", upstream_url, "--port", "0", *args],
        stderr=subprocess.PIPE,
        text=True,
        **popen,
    )
    for line in proc.stderr:  # type: ignore[union-attr]
        if "listening on http://127.0.0.1:" in line:
            return proc, "http://127.0.0.1:" + line.split("http://127.0.0.1:")[1].split("/")[0]
    raise AssertionError(f"the proxy did not start (exit {proc.wait(10)})")


def test_disk_full_in_a_real_process_never_blocks_streams(tmp_path: Path) -> None:
    """`mlxproxy serve` with a capture whose file may not grow past 8 KiB (RLIMIT_FSIZE: the
    kernel writes part of a line, then refuses with EFBIG, as on a full disk)."""
    resource = pytest.importorskip("resource")
    cap = tmp_path / "cap.jsonl"

    def limit_file_size() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (8192, 8192))

    with FakeUpstream(lambda req, conn: healthy_handler(req, conn, None)) as up:
        proc, url = start_proxy_process(
            up.url, "--capture", str(cap), "--log-level", "warning", preexec_fn=limit_file_size
        )
        try:
            with httpx.Client(timeout=30) as c:
                for _ in range(30):
                    r = c.post(url + "/v1/chat/completions", json=STREAM_REQ)
                    assert r.status_code == 200 and r.content == OK_BODY
                assert wait_for(lambda: c.get(url + "/healthz").json()["in_flight"] == 0)

                def sample(name: str) -> float:
                    for line in c.get(url + "/metrics").text.splitlines():
                        if line.startswith(name + " "):
                            return float(line.split()[1])
                    return 0.0

                lines = len(read_capture(cap))
                assert wait_for(lambda: sample("mlxproxy_capture_errors_total") + len(read_capture(cap)) == 30)
        finally:
            proc.terminate()
            err = proc.communicate(timeout=10)[1]
    assert 0 < lines < 30 and cap.stat().st_size <= 8192
    assert err.count("capture to") == 1, err
    assert all(c.record.outcome == "ok" for c in read_capture(cap))  # whole lines only: nothing torn


def test_kill_9_under_load_loses_only_queued_records(tmp_path: Path) -> None:
    """Streams complete concurrently while the proxy is killed with SIGKILL: the capture
    holds only whole lines (a torn last one at most, skipped with a warning), no record
    twice, and at least every record whose line was already written before the kill."""
    cap = tmp_path / "cap.jsonl"
    with FakeUpstream(lambda req, conn: healthy_handler(req, conn, None)) as up:
        proc, url = start_proxy_process(up.url, "--capture", str(cap), "--log-level", "error")
        stop = threading.Event()
        completed = [0]

        def client() -> None:
            with httpx.Client(timeout=10) as c:
                while not stop.is_set():
                    try:
                        if c.post(url + "/v1/chat/completions", json=STREAM_REQ).content == OK_BODY:
                            completed[0] += 1
                    except httpx.HTTPError:
                        return  # the proxy is gone

        threads = [threading.Thread(target=client) for _ in range(8)]
        try:
            for th in threads:
                th.start()
            assert wait_for(lambda: cap.exists() and cap.read_bytes().count(b"\n") >= 200, 30)
            seen_before_kill = cap.read_bytes().count(b"\n")
            proc.send_signal(signal.SIGKILL)  # while lines are being written
            proc.wait(10)
        finally:
            stop.set()
            for th in threads:
                th.join(10)
            if proc.poll() is None:
                proc.kill()
    warnings: list[str] = []
    caps = read_capture(cap, warn=warnings.append)
    assert len(caps) >= seen_before_kill and len(caps) <= completed[0] + 8
    assert len({c.record.id for c in caps}) == len(caps) and all(c.record.outcome in OUTCOMES for c in caps)
    assert len(warnings) <= 1
