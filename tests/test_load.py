"""Load shapes that answer the capacity question: open-loop arrival schedules (constant,
Poisson) and the load generator's own limit, driven against the simulator."""

from __future__ import annotations

import asyncio
import math
import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from mlxproxy.capture import CapturedRequest
from mlxproxy.core.record import Record
from mlxproxy.load import arrival_offsets, generator_note, schedule
from mlxproxy.replay import ReplayOptions, run_replay
from mlxproxy.runner import ServerThread
from mlxproxy.sim.app import create_app as create_sim

REPO = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def cli(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mlxproxy", *args], capture_output=True, text=True, timeout=timeout,
                          env=ENV, stdin=subprocess.DEVNULL)


def ks_exponential(gaps: list[float], rate: float) -> tuple[float, float]:
    """Kolmogorov-Smirnov statistic D of `gaps` against Exp(rate), and the critical value
    at the 1 % level (1.628 / sqrt(n), the asymptotic Kolmogorov quantile)."""
    xs = sorted(gaps)
    n = len(xs)
    d = 0.0
    for i, x in enumerate(xs):
        f = 1.0 - math.exp(-rate * x)
        d = max(d, (i + 1) / n - f, f - i / n)
    return d, 1.628 / math.sqrt(n)


def test_the_ks_check_tells_poisson_from_constant_and_from_the_wrong_rate() -> None:
    gaps = lambda offs: [b - a for a, b in zip(offs, offs[1:])]  # noqa: E731
    d, crit = ks_exponential(gaps(arrival_offsets(400, 20.0, "poisson", seed=1)), 20.0)
    assert d < crit
    d, crit = ks_exponential(gaps(arrival_offsets(400, 20.0, "constant")), 20.0)
    assert d > crit  # evenly spaced is not Poisson
    d, crit = ks_exponential(gaps(arrival_offsets(400, 40.0, "poisson", seed=1)), 20.0)
    assert d > crit  # twice the rate is caught


def test_schedules_are_exact_and_seeded() -> None:
    assert arrival_offsets(4, 2.0, "constant") == [0.0, 0.5, 1.0, 1.5]
    assert arrival_offsets(50, 5.0, "poisson", seed=7) == arrival_offsets(50, 5.0, "poisson", seed=7)
    assert arrival_offsets(50, 5.0, "poisson", seed=7) != arrival_offsets(50, 5.0, "poisson", seed=8)
    offs, params = schedule(11, 5.0, "constant")
    assert params["scheduled_rate"] == pytest.approx(5.0) and offs[-1] == pytest.approx(2.0)
    with pytest.raises(ValueError):
        arrival_offsets(3, 0.0)


def _caps(n: int) -> list[CapturedRequest]:
    out = []
    for i in range(n):
        rec = Record(id=f"c{i}", started_at=1.0 + i, upstream="u", model="m", endpoint="chat_completions", stream=True, status=200,
                     outcome="ok", method="POST", path="/v1/chat/completions")
        body = {"model": "m", "stream": True, "max_tokens": 4, "messages": [{"role": "user", "content": f"hello {i}"}]}
        out.append(CapturedRequest(record=rec, raw={}, request=body, request_bytes=None, offset_s=0.0,
                                   method="POST", path="/v1/chat/completions"))
    return out


def write_capture(path: Path, caps: list[CapturedRequest]) -> Path:
    """A capture file whose lines are made by the capture writer's own `line_for`."""
    from mlxproxy.capture import CaptureWriter

    w = CaptureWriter(path.with_suffix(".unused"))
    lines = []
    for c in caps:
        d = orjson.loads(w.line_for(c.record, None))
        d.update(path=c.path, request=c.request, offset_s=c.offset_s)
        lines.append(orjson.dumps(d))
    w.close()
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def test_measured_poisson_inter_arrivals_fit_the_requested_rate() -> None:
    rate, n = 20.0, 150  # mean gap 50 ms: the loop's own jitter (~1 ms) is small beside it
    with ServerThread(create_sim("healthy", speed=50)) as sim:
        groups = asyncio.run(run_replay(_caps(n), sim.url, ReplayOptions(mode="rate", rate=rate, arrival="poisson", seed=3),
                                        progress=False))
    (g,) = groups
    assert g["summary"]["ok"] == n and g["params"]["arrival"] == "poisson"
    sends = sorted(r["started_at"] for r in g["records"])
    gaps = [b - a for a, b in zip(sends, sends[1:])]
    d, crit = ks_exponential(gaps, rate)
    assert d < crit, (d, crit)
    lag = g["summary"]["schedule_lag_s"]
    assert lag["count"] == n and lag["p50"] < 0.02


def test_constant_rate_reports_its_schedule_lag(tmp_path: Path) -> None:
    cap = write_capture(tmp_path / "c.jsonl", _caps(3))
    with ServerThread(create_sim("healthy", speed=50)) as sim:
        res = cli("replay", str(cap), "--target", sim.url, "--rate", "25", "--repeat", "8", "--json", str(tmp_path / "r.json"))
    assert res.returncode == 0, res.stderr[-1500:]
    doc = orjson.loads((tmp_path / "r.json").read_bytes())
    (g,) = doc["groups"]
    assert g["mode"] == "constant 25/s" and g["summary"]["requests"] == 24
    assert g["summary"]["schedule_lag_s"]["count"] == 24 and g["params"]["scheduled_rate"] == pytest.approx(25.0)
    assert g["summary"]["sent_rate"] == pytest.approx(25.0, rel=0.2)
    out = " ".join(res.stdout.split())
    assert "schedule lag p50" in out and "req/s, scheduled 25.00" in out
    assert ("kept to its schedule" in out) != ("not the server, was the limit" in out)  # the line says which (load-dependent)


def test_the_generator_says_when_it_was_the_limit() -> None:
    lag = lambda p99: {"count": 10, "p50": p99 / 2, "p99": p99}  # noqa: E731
    kept = generator_note("t", {"schedule_lag_s": lag(0.004), "sent_rate": 10.0}, {"rate": 10.0, "scheduled_rate": 10.0})
    assert kept and "kept to its schedule" in kept and "was the limit" not in kept
    late = generator_note("t", {"schedule_lag_s": lag(0.2), "sent_rate": 10.0}, {"rate": 10.0, "scheduled_rate": 10.0})
    assert late and "not the server, was the limit" in late and "lag p99 over 25 ms" in late
    slow = generator_note("t", {"schedule_lag_s": lag(0.004), "sent_rate": 800.0}, {"rate": 1000.0, "scheduled_rate": 1000.0})
    assert slow and "under 95% of the scheduled rate" in slow
    assert generator_note("t", {}, {}) is None


def test_rate_conflicts_with_the_other_tests(tmp_path: Path) -> None:
    res = cli("replay", str(tmp_path / "none.jsonl"), "--target", "http://127.0.0.1:9", "--rate", "2", "--concurrency", "2")
    assert res.returncode == 2 and "two different tests" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    res = cli("replay", str(tmp_path / "none.jsonl"), "--target", "http://127.0.0.1:9", "--mode", "rate")
    assert res.returncode == 2 and "--mode rate needs --rate" in res.stderr


# -- SLOs, goodput, --fail-on ------------------------------------------------------------------


def test_slo_syntax() -> None:
    from mlxproxy.load import DEFAULT_SLO, parse_slo, slo_text

    assert parse_slo("ttft_p95=3s,tpot_p50=60ms") == {"ttft_p95": 3.0, "tpot_p50": pytest.approx(0.06)}
    assert parse_slo("e2e_p99=2.5, decode_tps_p50=20tok/s, itl_p90=80ms") == {
        "e2e_p99": 2.5, "decode_tps_p50": 20.0, "itl_p90": pytest.approx(0.08)}
    assert slo_text(parse_slo(DEFAULT_SLO)) == "TTFT p95 <= 5 s, TPOT p95 <= 100 ms"
    for bad in ("ttft=3s", "ttft_p95", "ttft_p95=fast", "latency_p95=1s", "ttft_p0=1s", "ttft_p95=-1s", ",", "tpot_p50=3x"):
        with pytest.raises(ValueError, match="KEY=VALUE"):
            parse_slo(bad)


def _rec(i: int, ttft: float | None, tpot: float | None, outcome: str = "ok") -> dict:
    return {"id": f"r{i}", "outcome": outcome, "ttft_s": ttft, "tpot_s": tpot, "decode_tps": 1 / tpot if tpot else None,
            "e2e_s": 1.0, "started_at": 100.0 + i, "duration_s": 1.0, "anomalies": []}


def test_goodput_counts_requests_meeting_every_threshold() -> None:
    from mlxproxy.load import judge, step_problem

    slo = {"ttft_p95": 1.0, "tpot_p50": 0.05}
    recs = [_rec(0, 0.5, 0.02), _rec(1, 0.5, 0.06), _rec(2, 2.0, 0.02), _rec(3, 0.4, 0.03), _rec(4, None, None, "upstream_timeout")]
    j = judge(recs, slo)
    # r0 and r3 meet both; r1 too slow per token, r2 too slow to start, r4 failed; span 100..105 s
    assert j["goodput"] == {"good": 2, "requests": 5, "share": 0.4, "rate": pytest.approx(2 / 5.0)}
    assert not j["slo"]["met"] and j["slo"]["errors"] == 1
    assert [b["key"] for b in j["slo"]["breaches"]] == ["ttft_p95"]  # tpot p50 of 0.02,0.06,0.02,0.03 is 0.025
    assert "TTFT p95 is" in step_problem(j) and "1 of 5 requests failed" in step_problem(j)
    fine = judge(recs[:1] + recs[3:4], slo)
    assert fine["slo"]["met"] and fine["goodput"]["share"] == 1.0
    lower = judge([_rec(0, 0.1, 0.1), _rec(1, 0.1, 0.01)], {"decode_tps_p50": 20.0})
    assert lower["goodput"]["good"] == 1  # decode_tps is a lower bound: 10 tok/s misses, 100 meets


def bench_args(url: str, *extra: str) -> list[str]:
    return ["bench", "--target", f"s={url}", "--prompt-tokens", "50", "--repeat", "2", "--max-tokens", "40", *extra]


def test_fail_on_exits_1_on_phantom_usage_and_0_on_a_healthy_server() -> None:
    checks = "slo,errors,phantom_speed,usage_mismatch"
    with ServerThread(create_sim("phantom-usage", speed=20)) as sim:
        bad = cli(*bench_args(sim.url, "--fail-on", checks))
        plain = cli(*bench_args(sim.url))  # without --fail-on the same findings exit 0
    with ServerThread(create_sim("healthy", speed=20)) as sim:
        good = cli(*bench_args(sim.url, "--fail-on", checks))
        strict = cli(*bench_args(sim.url, "--fail-on", "slo", "--slo", "ttft_p50=0.1ms"))
    assert bad.returncode == 1, bad.stderr[-1500:]
    last = bad.stderr.strip().splitlines()[-1]
    assert last.startswith("mlxproxy: --fail-on") and "phantom_speed in 6 of 6 requests" in last and "Traceback" not in bad.stderr
    assert plain.returncode == 0, plain.stderr[-1500:]
    assert good.returncode == 0, good.stderr[-1500:]
    assert good.stderr.strip().splitlines()[-1] == f"mlxproxy: --fail-on {checks}: every check held"
    assert "SLO (TTFT p95 <= 5 s, TPOT p95 <= 100 ms):" in good.stdout
    assert strict.returncode == 1 and "SLO broken on s" in strict.stderr and "TTFT p50 is" in strict.stderr


@pytest.mark.parametrize("command", ["bench", "replay"])
@pytest.mark.parametrize("opt, value, needle", [("--slo", "ttft_p95=3x", "must be a number"),
                                                 ("--slo", "ttft=3s", "KEY=VALUE"),
                                                 ("--fail-on", "slo,nonsense", "is not a check")])
def test_bad_slo_and_fail_on_exit_2_with_one_line(tmp_path: Path, command: str, opt: str, value: str, needle: str) -> None:
    cap = write_capture(tmp_path / "c.jsonl", _caps(1))
    args = ["bench", "--target", "http://127.0.0.1:9"] if command == "bench" else ["replay", str(cap), "--target", "http://127.0.0.1:9"]
    res = cli(*args, opt, value)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 2 and len(lines) == 1 and opt in lines[0] and needle in lines[0], res.stderr
