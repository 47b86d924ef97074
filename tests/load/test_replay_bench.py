"""Capture -> replay in every mode, bench against simulated truth, report, and the demo."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
from click.testing import CliRunner

from fakeupstream import Conn, FakeUpstream, Req, sse_response
from mlxproxy.capture import read_capture
from mlxproxy.cli import main
from mlxproxy.core.stats import percentile
from mlxproxy.edge.runner import ServerThread
from mlxproxy.load.commands.bench import BenchOptions, bench_targets
from mlxproxy.load.commands.replay import MODES, ReplayOptions, replay_plan, run
from mlxproxy.load.commands.replay_requests import Rewrites, prepare
from mlxproxy.load.commands.sweep_options import SweepOptions
from mlxproxy.load.data.targets import Target
from mlxproxy.load.output.bench_verdict import verdict
from mlxproxy.sim.app import create_app as create_sim
from mlxproxy.sim.engine import planned_speedup
from mlxproxy.sim.profiles import get_profile
from support import proxy, read_fixture, wait_for
from timing import latency_ok, rate_ok


@pytest.fixture(scope="module")
def capture_file(tmp_path_factory) -> Path:
    """A capture made through the proxy while the OpenAI SDK ran a few requests."""
    openai = pytest.importorskip("openai")
    cap = tmp_path_factory.mktemp("cap") / "capture.jsonl"
    with ServerThread(create_sim("healthy", speed=20)) as sim, proxy(sim.url, capture=str(cap)) as (url, app):
        client = openai.OpenAI(base_url=url + "/v1", api_key="sk-secret-test", max_retries=0)
        for i in range(3):
            stream = client.chat.completions.create(
                model="qwen", stream=True, max_tokens=24, messages=[{"role": "user", "content": f"question {i} " * 20}]
            )
            assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        out = client.chat.completions.create(
            model="qwen", max_tokens=16, messages=[{"role": "user", "content": "once"}]
        )
        assert out.usage is not None and out.usage.completion_tokens == 16
        assert wait_for(lambda: app.capture is not None and app.capture.written == 4)
    assert b"sk-secret-test" not in cap.read_bytes()
    return cap


def test_replayed_bodies_equal_captured_except_documented_rewrites(capture_file: Path) -> None:
    caps = read_capture(capture_file)
    body = read_fixture("wire/01_openai_reference_include_usage.sse")
    received: list[Req] = []

    async def handler(req: Req, conn: Conn) -> None:
        received.append(req)
        await sse_response(body)(req, conn)

    with FakeUpstream(handler) as up:
        run(caps, up.url, ReplayOptions(mode="sequential", nonce=False))  # --no-nonce: the captured bytes
        run(caps[:1], up.url, ReplayOptions(mode="sequential", model="other"))  # the nonce is the default
    for c, got in zip(caps, received[:4]):
        original = orjson.dumps(c.request)
        if c.request.get("stream"):  # the SDK did not ask for usage: replay adds include_usage, nothing else
            assert got.body == original[:-1] + b',"stream_options":{"include_usage":true}}'
        else:
            assert got.body == original
        assert got.header("x-mlxproxy-replay") == "1" and got.header("authorization") is None  # redacted: not replayed
    rewritten = orjson.loads(received[4].body)
    assert rewritten["model"] == "other" and rewritten["messages"][0]["content"].startswith("[nonce ")
    assert rewritten["messages"][0]["content"].endswith(caps[0].request["messages"][0]["content"])


def test_every_request_sent_carries_its_own_nonce(capture_file: Path) -> None:
    """The baseline, every wave and every repeat send prompts no cache has seen: the waves
    of `--batch` never reuse the baseline's bytes (a prompt cache would serve them)."""
    caps = [c for c in read_capture(capture_file) if c.request.get("stream")]
    body = read_fixture("wire/01_openai_reference_include_usage.sse")
    received: list[Req] = []

    async def handler(req: Req, conn: Conn) -> None:
        received.append(req)
        await sse_response(body)(req, conn)

    with FakeUpstream(handler) as up:
        groups = run(caps, up.url, ReplayOptions(mode="batch", batches=(2, 3), repeat=2))
    firsts = [orjson.loads(r.body)["messages"][0]["content"] for r in received]
    assert len(firsts) == len(caps) * 2 * 3  # baseline + waves of 2 + waves of 3, each x2
    assert all(f.startswith("[nonce ") for f in firsts) and len(set(firsts)) == len(firsts)
    assert [g.name for g in groups] == ["single", "batch 2", "batch 3"]
    assert [g.kind for g in groups] == ["single", "wave", "wave"]


@pytest.mark.parametrize("mode", ["recorded", "sequential", "concurrency", "batch"])
def test_replay_every_mode_against_simulator(capture_file: Path, mode: str) -> None:
    caps = read_capture(capture_file)
    with ServerThread(create_sim("healthy", speed=20)) as sim:
        groups = run(caps, sim.url, ReplayOptions(mode=mode, concurrency=2, batch=2, speed=4.0), compare=True)
    g = groups[-1]
    assert g.summary.requests == 4 and g.summary.ok == 4
    assert len(g.records) == 4 and all(r.record.outcome == "ok" for r in g.records)
    assert g.compare is not None and {row["source_id"] for row in g.compare} == {c.record.id for c in caps}
    if mode == "batch":
        assert groups[0].mode == "single" and g.summary.speedup is not None


def test_a_sweep_of_a_mode_that_cannot_be_swept_is_refused_before_anything_is_sent() -> None:
    # (the CLI refuses `--sweep` with these modes first; the options value alone refuses them too)
    unswept = [m for m, mode in MODES.items() if mode.swept is None]
    assert unswept == ["recorded", "sequential", "batch"]
    for m in unswept:
        with pytest.raises(ValueError, match=f"replay mode '{m}' cannot be swept"):
            replay_plan(ReplayOptions(mode=m, sweep=SweepOptions()))
    assert replay_plan(ReplayOptions(mode="concurrency", sweep=SweepOptions())).test.name == "concurrency 1"


def test_batch_speedup_tracks_the_truth() -> None:
    """--batch 2 of identical requests: continuous batching near 2x, a serial server <= 1x."""
    from mlxproxy.capture import CapturedRequest
    from mlxproxy.core.record import Record

    def cap(i: int) -> CapturedRequest:
        req = {"model": "m", "stream": True, "max_tokens": 64, "messages": [{"role": "user", "content": "x" * 400}]}
        rec = Record(
            id=f"c{i}",
            started_at=0.0,
            upstream="u",
            model="m",
            endpoint="chat_completions",
            stream=True,
            status=200,
            outcome="ok",
        )
        return CapturedRequest(rec, "POST", "/v1/chat/completions", float(i), req, None, {})

    caps = [cap(i) for i in range(4)]
    speedups = {}
    knobs = {"healthy": {"batch_penalty": 0.02}, "mlx-omni-server": {}}
    for profile in ("healthy", "mlx-omni-server"):
        with ServerThread(
            create_sim(profile, speed=2, **knobs[profile])
        ) as sim:  # 10 ms token gaps: robust on a busy machine
            groups = run(caps, sim.url, ReplayOptions(mode="batch", batch=2))
        speedups[profile] = groups[-1].summary.speedup
        truth = planned_speedup(get_profile(profile, **knobs[profile]), 2, 100, 64)
        assert speedups[profile] == pytest.approx(truth, abs=0.25), (profile, truth)
    assert speedups["healthy"] > 1.8 and speedups["mlx-omni-server"] <= 1.0


def test_recorded_mode_keeps_the_schedule(tmp_path: Path) -> None:
    """100 requests at their recorded offsets over ~2 s: schedule lag p99 under a quarter of
    the schedule (under 50 ms on a quiet machine; a loaded one delays sends, never advances
    them), neither all at once nor one after another."""
    from mlxproxy.capture import CapturedRequest
    from mlxproxy.core.record import Record

    caps = []
    for i in range(100):
        rec = Record(
            id=f"c{i}",
            started_at=0.0,
            upstream="u",
            model="m",
            endpoint="chat_completions",
            stream=False,
            status=200,
            outcome="ok",
        )
        caps.append(
            CapturedRequest(
                rec,
                "POST",
                "/v1/chat/completions",
                i * 0.02,
                {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
                None,
                {},
            )
        )
    with ServerThread(create_sim("healthy", speed=50)) as sim:
        (g,) = run(caps, sim.url, ReplayOptions(mode="recorded", speed=1.0))
    lag = g.summary.stat("schedule_lag_s")
    assert lag is not None and lag.count == 100 and lag.p99 < 0.25 * 99 * 0.02, lag
    starts = sorted(r.record.started_at for r in g.records)
    assert starts[-1] - starts[0] == pytest.approx(99 * 0.02, rel=0.25)


def test_bench_matches_simulated_truth_and_reports(tmp_path: Path) -> None:
    """Real-time simulator: wall_tps_p50 and ttft_p50 match the configured truth (within
    `timing`'s load-tolerant bounds), speedup within 0.25 of the engine's plan; the JSON renders again with `report`."""
    profile = get_profile("healthy", batch_penalty=0.02)
    with ServerThread(create_sim(profile, speed=1.0)) as sim:
        opts = BenchOptions(prompt_tokens=(100, 1000), max_tokens=32, repeat=3)
        (res,) = asyncio.run(bench_targets([Target("sim", sim.url, 60.0)], opts))
    assert res.error is None
    groups = {g.name: g for g in res.groups}
    single = [r.record for r in groups["single"].records]
    truth_ttft = sorted(r.prompt_tokens / profile.prefill_tps for r in single)
    truth_wall = sorted(32 / (r.prompt_tokens / profile.prefill_tps + 31 / profile.decode_tps) for r in single)
    s = groups["single"].summary
    assert latency_ok(s.ttft_s.p50, percentile(truth_ttft, 50)), s.ttft_s
    assert rate_ok(s.wall_tps.p50, percentile(truth_wall, 50)), s.wall_tps
    sizes = sorted({r.record.prompt_tokens for r in groups["single 100"].records})
    assert sizes and abs(sizes[0] - 100) <= 5  # calibrated against the server's own usage
    speedup = groups["double"].summary.speedup
    assert speedup == pytest.approx(planned_speedup(profile, 2, sizes[0], 32), abs=0.25)
    assert verdict(res).startswith("continuous batching")
    # JSON, CSV, markdown and plot outputs; report renders the JSON again
    from mlxproxy.load.output.bench_report import write_outputs
    from mlxproxy.load.output.files import Outputs

    paths = [tmp_path / n for n in ("r.json", "r.csv", "r.md", "r.svg")]
    write_outputs([res], Outputs(*map(str, paths)))
    doc = orjson.loads(paths[0].read_bytes())
    assert doc["kind"] == "bench" and sum(len(g["records"]) for g in doc["groups"]) >= 12 + 6
    assert paths[3].read_text().startswith("<svg") and "TTFT by prompt size" in paths[3].read_text()
    out = CliRunner().invoke(main, ["report", str(paths[0])])
    assert (
        out.exit_code == 0
        and "Requests released together (batching):" in out.output
        and "continuous batching" in out.output
    )


def test_bench_failing_target_does_not_stop_others() -> None:
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    s.close()
    with ServerThread(create_sim("healthy", speed=20)) as sim:
        opts = BenchOptions(prompt_tokens=(100,), max_tokens=8, repeat=1)
        dead_res, ok_res = asyncio.run(bench_targets([Target("dead", dead, 5.0), Target("ok", sim.url, 30.0)], opts))
    assert (
        verdict(dead_res).startswith("failing: upstream 'dead' at http://127.0.0.1:")
        and "is unreachable" in verdict(dead_res)
        and ok_res.error is None
        and ok_res.groups
    )


def test_cli_errors_are_one_line(tmp_path: Path) -> None:
    r = CliRunner().invoke(main, ["replay", str(tmp_path / "nope.jsonl"), "--target", "http://127.0.0.1:1"])
    assert r.exit_code == 2 and "cannot read capture file" in r.output and "Traceback" not in r.output
    r = CliRunner().invoke(main, ["replay", str(tmp_path / "nope.jsonl"), "--target", "ftp://x"])
    assert r.exit_code == 2 and "--target: must be an http" in r.output
    r = CliRunner().invoke(main, ["bench", "--target", "a=notaurl"])
    assert r.exit_code == 2 and "[NAME=]URL" in r.output
    r = CliRunner().invoke(main, ["bench", "--target", "a=http://x", "--prompt-tokens", "1,x"])
    assert r.exit_code == 2 and "comma-separated" in r.output
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    r = CliRunner().invoke(main, ["report", str(bad)])
    assert r.exit_code == 2 and "not an mlxproxy result file" in r.output


def test_demo_shows_every_signature(tmp_path: Path) -> None:
    """The README's first command, shortened to one repetition."""
    res = subprocess.run(
        [sys.executable, "-m", "mlxproxy", "demo", "--repeat", "1", "--dir", str(tmp_path / "d")],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    out = res.stdout
    lines: dict[str, str] = {}
    verdicts = out[out.index("Verdicts:") :]
    last = ""
    for line in verdicts.splitlines()[1:]:  # the verdicts: one per target, long ones wrapped (indented)
        if not line.strip():
            break
        if line.startswith(" ") and last:
            lines[last] += " " + line.strip()
            continue
        last = line.split()[0]
        lines.setdefault(last, line)
    assert "continuous batching" in lines["mlx-lm"]
    # today's release batches (live 1.8.1: overlap 0.92 at 1,500 tokens); 1.6.3 served one at a time
    assert "continuous batching" in lines["mlx-openai-server-1.8"]
    assert "serial: " in lines["mlx-omni-server"]  # 0.88x on a quiet machine; the verdict is what counts
    assert "no incremental streaming" in lines["burst-at-end"]
    assert "no incremental streaming" not in lines["rapid-mlx"]  # one token per event, as live 0.16.10
    assert "rejects prompts > 32768 tokens" in lines["omlx"]
    assert "cyclic stalls" in lines["mlx-vlm"]
    assert "usage over-reports 4.0x" in lines["phantom-usage"]
    # its speeds are the stream's (~50 tok/s like the others), marked, never the usage's 4x
    d = tmp_path / "d"
    from mlxproxy.load.output.bench_report import results_from_doc
    from mlxproxy.load.output.bench_verdict import headline
    from mlxproxy.load.output.files import read_result

    rows = {r.target.name: headline(r) for r in results_from_doc(read_result(d / "bench.json"), "")[0]}
    ph, ok = rows["phantom-usage"], rows["mlx-lm"]
    assert ph["wall tok/s"].endswith("*") and ph["decode tok/s"].endswith("*")
    assert not ok["wall tok/s"].endswith("*") and not ok["decode tok/s"].endswith("*")
    console_row = next(line for line in out.splitlines() if line.startswith("phantom-usage "))
    assert ph["decode tok/s"] in console_row.split()  # the console shows the same row
    assert 0.8 < float(ph["decode tok/s"].rstrip("*")) / float(ok["decode tok/s"]) < 1.25
    assert 40 < float(ph["decode tok/s"].rstrip("*")) < 60
    assert "* phantom-usage single" in out and "usage not trusted" in out
    for name in ("capture.jsonl", "bench.json", "bench.csv", "bench.md", "bench.svg", "metrics.prom"):
        assert (d / name).stat().st_size > 0, name
    assert "* phantom-usage single" in (d / "bench.md").read_text()
    caps = read_capture(d / "capture.jsonl")
    assert len(caps) >= 8 * 5 and prepare(caps[0], Rewrites()).body
