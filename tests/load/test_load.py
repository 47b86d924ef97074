"""Load shapes that answer the capacity question: open-loop arrival schedules (constant,
Poisson) and the load generator's own limit, driven against the simulator."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import orjson
import pytest

from mlxproxy.capture import CapturedRequest
from mlxproxy.edge.runner import ServerThread
from mlxproxy.load.commands.replay import ReplayOptions, run_replay
from mlxproxy.load.commands.replay_requests import Rewrites
from mlxproxy.load.data.arrivals import arrival_offsets, generator_note, schedule
from mlxproxy.load.data.results import RunRecord
from mlxproxy.load.data.targets import Target
from mlxproxy.load.run.sweep import mix_copies
from mlxproxy.sim.app import create_app as create_sim
from support import captured_chat, cli, engine_closed_loop, write_capture
from support import captured_chats as _caps


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


def test_measured_poisson_inter_arrivals_fit_the_requested_rate() -> None:
    rate, n = 20.0, 150  # mean gap 50 ms: the loop's own jitter (~1 ms) is small beside it
    with ServerThread(create_sim("healthy", speed=50)) as sim:
        groups = asyncio.run(
            run_replay(
                _caps(n),
                Target("target", sim.url),
                ReplayOptions(mode="rate", rate=rate, arrival="poisson", seed=3),
            )
        )
    (g,) = groups
    assert g.summary.ok == n and g.params["arrival"] == "poisson" and g.kind == "rate"
    sends = sorted(r.record.started_at for r in g.records)
    gaps = [b - a for a, b in zip(sends, sends[1:])]
    d, crit = ks_exponential(gaps, rate)
    assert d < crit, (d, crit)
    lag = g.summary.stat("schedule_lag_s")
    assert lag is not None and lag.count == n and lag.p50 < 0.02


def test_constant_rate_reports_its_schedule_lag(tmp_path: Path) -> None:
    cap = write_capture(tmp_path / "c.jsonl", _caps(3))
    with ServerThread(create_sim("healthy", speed=50)) as sim:
        res = cli(
            "replay", str(cap), "--target", sim.url, "--rate", "25", "--repeat", "8", "--json", str(tmp_path / "r.json")
        )
    assert res.returncode == 0, res.stderr[-1500:]
    doc = orjson.loads((tmp_path / "r.json").read_bytes())
    (g,) = doc["groups"]
    assert g["mode"] == "constant 25/s" and g["summary"]["requests"] == 24
    assert g["summary"]["schedule_lag_s"]["count"] == 24 and g["params"]["scheduled_rate"] == pytest.approx(25.0)
    assert g["summary"]["sent_rate"] == pytest.approx(25.0, rel=0.2)
    out = " ".join(res.stdout.split())
    assert "schedule lag p50" in out and "req/s, scheduled 25.00" in out
    assert ("kept to its schedule" in out) != (
        "not the server, was the limit" in out
    )  # the line says which (load-dependent)


def test_the_generator_says_when_it_was_the_limit() -> None:
    from mlxproxy.load.data.summary import Summary

    lag = lambda p99: {"count": 10, "p50": p99 / 2, "p99": p99}  # noqa: E731
    summ = lambda p99, sent: Summary.from_dict({"schedule_lag_s": lag(p99), "sent_rate": sent})  # noqa: E731
    kept = generator_note("t", summ(0.004, 10.0), {"rate": 10.0, "scheduled_rate": 10.0})
    assert kept and "kept to its schedule" in kept and "was the limit" not in kept
    late = generator_note("t", summ(0.2, 10.0), {"rate": 10.0, "scheduled_rate": 10.0})
    assert late and "not the server, was the limit" in late and "lag p99 over 25 ms" in late
    slow = generator_note("t", summ(0.004, 800.0), {"rate": 1000.0, "scheduled_rate": 1000.0})
    assert slow and "under 95% of the scheduled rate" in slow
    assert generator_note("t", Summary.from_dict({}), {}) is None


def test_rate_conflicts_with_the_other_tests(tmp_path: Path) -> None:
    res = cli(
        "replay", str(tmp_path / "none.jsonl"), "--target", "http://127.0.0.1:9", "--rate", "2", "--concurrency", "2"
    )
    assert res.returncode == 2 and "two different tests" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    res = cli("replay", str(tmp_path / "none.jsonl"), "--target", "http://127.0.0.1:9", "--mode", "rate")
    assert res.returncode == 2 and "--mode rate needs --rate" in res.stderr
    res = cli("bench", "--target", "http://127.0.0.1:9", "--sweep", "--rate", "1,2")
    assert res.returncode == 2 and "one sweep per run" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    res = cli("replay", str(tmp_path / "none.jsonl"), "--target", "http://127.0.0.1:9", "--sweep", "--batch", "2")
    assert res.returncode == 2 and "--sweep steps" in res.stderr


# -- SLOs, goodput, --fail-on ------------------------------------------------------------------


def test_slo_syntax() -> None:
    from mlxproxy.load.judge.slo import DEFAULT_SLO, parse_slo, slo_text

    assert parse_slo("ttft_p95=3s,tpot_p50=60ms") == {"ttft_p95": 3.0, "tpot_p50": pytest.approx(0.06)}
    assert parse_slo("e2e_p99=2.5, decode_tps_p50=20tok/s, itl_p90=80ms") == {
        "e2e_p99": 2.5,
        "decode_tps_p50": 20.0,
        "itl_p90": pytest.approx(0.08),
    }
    assert slo_text(parse_slo(DEFAULT_SLO)) == "TTFT p95 <= 5 s, TPOT p95 <= 100 ms"
    for bad in (
        "ttft=3s",
        "ttft_p95",
        "ttft_p95=fast",
        "latency_p95=1s",
        "ttft_p0=1s",
        "ttft_p95=-1s",
        ",",
        "tpot_p50=3x",
    ):
        with pytest.raises(ValueError, match="KEY=VALUE"):
            parse_slo(bad)


def _judge(rows: list[dict], slo: dict[str, float]):
    """`judge` over rows as a result file holds them."""
    from mlxproxy.load.judge.slo import judge

    return judge([RunRecord.from_dict(r) for r in rows], slo)


def _rec(i: int, ttft: float | None, tpot: float | None, outcome: str = "ok") -> dict:
    return {
        "id": f"r{i}",
        "outcome": outcome,
        "ttft_s": ttft,
        "tpot_s": tpot,
        "decode_tps": 1 / tpot if tpot else None,
        "e2e_s": 1.0,
        "started_at": 100.0 + i,
        "duration_s": 1.0,
        "anomalies": [],
    }


def test_goodput_counts_requests_meeting_every_threshold() -> None:
    from mlxproxy.load.judge.slo import step_problem

    slo = {"ttft_p95": 1.0, "tpot_p50": 0.05}
    recs = [
        _rec(0, 0.5, 0.02),
        _rec(1, 0.5, 0.06),
        _rec(2, 2.0, 0.02),
        _rec(3, 0.4, 0.03),
        _rec(4, None, None, "upstream_timeout"),
    ]
    j = _judge(recs, slo)
    # r0 and r3 meet both; r1 too slow per token, r2 too slow to start, r4 failed; span 100..105 s
    assert j.goodput.to_json() == {"good": 2, "requests": 5, "share": 0.4, "rate": pytest.approx(2 / 5.0)}
    assert not j.slo.met and j.slo.errors == 1
    assert [b.key for b in j.slo.breaches] == ["ttft_p95"]  # tpot p50 of 0.02,0.06,0.02,0.03 is 0.025
    assert "TTFT p95 is" in step_problem(j) and "1 of 5 requests failed" in step_problem(j)
    fine = _judge(recs[:1] + recs[3:4], slo)
    assert fine.slo.met and fine.goodput.share == 1.0
    lower = _judge([_rec(0, 0.1, 0.1), _rec(1, 0.1, 0.01)], {"decode_tps_p50": 20.0})
    assert lower.goodput.good == 1  # decode_tps is a lower bound: 10 tok/s misses, 100 meets


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
    # 2 alone + 2 waves of 2 + 3 alone around the waves (the baseline)
    assert (
        last.startswith("mlxproxy: --fail-on")
        and "phantom_speed in 9 of 9 requests" in last
        and "Traceback" not in bad.stderr
    )
    assert plain.returncode == 0, plain.stderr[-1500:]
    assert good.returncode == 0, good.stderr[-1500:]
    assert good.stderr.strip().splitlines()[-1] == f"mlxproxy: --fail-on {checks}: every check held"
    assert "SLO (TTFT p95 <= 5 s, TPOT p95 <= 100 ms):" in good.stdout
    assert strict.returncode == 1 and "SLO broken on s" in strict.stderr and "TTFT p50 is" in strict.stderr


def test_a_breach_never_reads_as_equal_to_its_limit() -> None:
    from mlxproxy.load.data.summary import Breach
    from mlxproxy.load.judge.slo import breach_text

    def text(key: str, value: float, limit: float) -> str:
        return breach_text(Breach(key, value, limit))

    assert text("tpot_p95", 0.1004, 0.1) == "TPOT p95 is 100.4 ms (> 100.0 ms)"  # was "100 ms (> 100 ms)"
    assert text("tpot_p95", 0.10004, 0.1) == "TPOT p95 is 100.04 ms (> 100.00 ms)"
    assert text("tpot_p95", 0.1007, 0.1006) == "TPOT p95 is 100.7 ms (> 100.6 ms)"  # not "100.7 ms (> 101 ms)"
    assert text("ttft_p95", 5.001, 5.0) == "TTFT p95 is 5.001 s (> 5.000 s)"
    assert text("ttft_p95", 1.0004, 0.9996) == "TTFT p95 is 1.000 s (> 999.6 ms)"  # not "1 s (> 1000 ms)"
    assert text("decode_tps_p50", 19.96, 20.0) == "decode tok/s p50 is 19.96 tok/s (< 20.00 tok/s)"
    # apart already: as before
    assert text("ttft_p95", 5.2, 3.0) == "TTFT p95 is 5.20 s (> 3 s)"
    assert text("tpot_p95", 0.104, 0.1) == "TPOT p95 is 104 ms (> 100 ms)"


@pytest.mark.parametrize("command", ["bench", "replay"])
@pytest.mark.parametrize(
    "opt, value, needle",
    [
        ("--slo", "ttft_p95=3x", "must be a number"),
        ("--slo", "ttft=3s", "KEY=VALUE"),
        ("--fail-on", "slo,nonsense", "is not a check"),
    ],
)
def test_bad_slo_and_fail_on_exit_2_with_one_line(
    tmp_path: Path, command: str, opt: str, value: str, needle: str
) -> None:
    cap = write_capture(tmp_path / "c.jsonl", _caps(1))
    args = (
        ["bench", "--target", "http://127.0.0.1:9"]
        if command == "bench"
        else ["replay", str(cap), "--target", "http://127.0.0.1:9"]
    )
    res = cli(*args, opt, value)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 2 and len(lines) == 1 and opt in lines[0] and needle in lines[0], res.stderr


# -- sweeps and capacity -------------------------------------------------------------------------


def truth_goodput(
    profile, conc: int, n_total: int, prompt_tokens: int, n_tokens: int, ttft_max_s: float, tpot_max_s: float
) -> float:
    """The goodput share a closed loop of `conc` streams sending `n_total` requests must get,
    from the simulator's own engine in scripted time (thresholds in simulated seconds)."""
    reqs = engine_closed_loop(profile, conc, n_total, prompt_tokens, n_tokens)
    good = sum(
        r.first_token - r.started <= ttft_max_s and (r.finished - r.first_token) / (n_tokens - 1) <= tpot_max_s
        for r in reqs
    )
    return good / n_total


def test_sweep_names_the_saturation_point_and_goodput_matches_the_simulators_truth(tmp_path: Path) -> None:
    from mlxproxy.sim.profiles import get_profile

    # batches up to 4 streams at exactly 50 tok/s each (no batch penalty), then queues: a 5th
    # stream waits a whole answer (40 tokens = 0.8 s simulated, 0.2 s at speed 4) for a slot, far
    # past the 100 ms TTFT target, while a stream that gets a slot at once waits only for
    # prefills of 2.5 ms each (simulated)
    knobs = {"max_batch_streams": 4, "batch_penalty": 0.0, "prefill_tps": 20000.0}
    out = tmp_path / "sweep.json"
    with ServerThread(create_sim("healthy", speed=4, **knobs)) as sim:
        res = cli(
            "bench",
            "--target",
            f"s={sim.url}",
            "--prompt-tokens",
            "50",
            "--repeat",
            "3",
            "--max-tokens",
            "40",
            "--concurrency",
            "1,2,3,4,5,6",
            "--slo",
            "ttft_p95=100ms,tpot_p95=25ms",
            "--json",
            str(out),
            "--plot",
            str(tmp_path / "sweep.svg"),
            "--html",
            str(tmp_path / "sweep.html"),
        )
    assert res.returncode == 0, res.stderr[-1500:]
    doc = orjson.loads(out.read_bytes())
    cap = doc["capacity"]["s"]
    assert (
        cap["max_concurrency"] == 4
        and cap["limited_by"] == "slo"
        and cap["slo"] == {"ttft_p95": 0.1, "tpot_p95": 0.025}
    )
    assert "s: meets the SLO up to 4 concurrent streams; at 5, TTFT p95 is" in res.stdout
    profile = get_profile("healthy", **knobs)
    prompt = doc["groups"][0]["params"].get("prompt_tokens") or 50
    for st in cap["steps"]:
        c = st["concurrency"]
        n = mix_copies(c, 1, 3)  # the same request, at least 3 per stream and 20 in all
        truth = truth_goodput(profile, c, n, prompt, 40, 0.1 * 4, 0.025 * 4)  # thresholds in simulated seconds
        # each stream's first request of each round is its warm-up, sent and not judged; a step
        # sends its mix again until it has run --step-time (5 s)
        assert (st["requests"] + st["warmup"]) % n == 0 and st["warmup"] % c == 0 and st["errors"] == 0
        assert abs(st["goodput"]["share"] - truth) <= 0.05, (c, st["goodput"], truth)
    assert [st["slo_met"] for st in cap["steps"]] == [True] * 4 + [False] * 2
    # the doubling from 1 stops at the first step that breaks the SLO, and the aggregate grows until 4
    aggs = [st["aggregate_tps"] for st in cap["steps"]]
    assert aggs[3] > 3.5 * aggs[0] and aggs[4] < 1.05 * aggs[3]
    again = cli("report", str(out))
    assert again.returncode == 0 and "meets the SLO up to 4 concurrent streams" in again.stdout
    html = (tmp_path / "sweep.html").read_text()
    assert '<section id="capacity">' in html and "meets the SLO up to 4 concurrent streams; at 5, TTFT p95 is" in html
    assert "TTFT by concurrency (p50, p95)" in html
    svg = (tmp_path / "sweep.svg").read_text()
    for text in (
        "TTFT by concurrency (p50, p95)",
        "TPOT by concurrency (p50, p95)",
        "Aggregate tokens/s by concurrency",
        "SLO TTFT p95 100 ms",
        "SLO TPOT p95 25 ms",
        ">s p95<",
    ):
        assert text in svg, text


def sim_url_unused() -> str:
    return "http://127.0.0.1:9"  # refused before anything is sent


def test_a_serial_server_has_a_capacity_of_one(tmp_path: Path) -> None:
    cap_file = write_capture(tmp_path / "c.jsonl", _caps(2, max_tokens=40))
    out = tmp_path / "r.json"
    with ServerThread(create_sim("mlx-omni-server", speed=4, prefill_tps=20000.0)) as sim:
        res = cli(
            "replay",
            str(cap_file),
            "--target",
            f"omni={sim.url}",
            "--sweep",
            "--slo",
            "ttft_p95=100ms",
            "--fail-on",
            "slo",
            "--json",
            str(out),
        )
    assert res.returncode == 0, res.stderr[-1500:]  # --fail-on slo judges a sweep's lightest step
    cap = orjson.loads(out.read_bytes())["capacity"]["omni"]
    # automatic doubling: 1 held, 2 broke (the second request gets no headers until the first ends)
    assert [st["concurrency"] for st in cap["steps"]] == [1, 2]
    assert cap["max_concurrency"] == 1 and cap["limited_by"] == "slo"
    assert "omni: meets the SLO up to 1 concurrent stream; at 2, TTFT p95 is" in " ".join(res.stdout.split())
    # step 2's result line, found by what it says: a stall notice of the load generator
    # ("...: the load generator had a ... stall: measuring it again") may come before it
    step2 = [
        ln
        for ln in res.stderr.splitlines()
        if ln.startswith("mlxproxy: sweep omni: 2 concurrent streams: ") and " ok, aggregate " in ln
    ]
    assert step2 and step2[0].endswith("(> 100 ms)"), res.stderr[-1500:]
    plot = cli("report", str(out), "--plot", str(tmp_path / "p.svg"))
    assert plot.returncode == 0 and "SLO TTFT p95 100 ms" in (tmp_path / "p.svg").read_text()
    res = cli("replay", str(cap_file), "--target", sim_url_unused(), "--plot", str(tmp_path / "x.svg"))
    assert res.returncode == 2 and "add --sweep" in res.stderr


def test_capacity_lines_for_every_ending() -> None:
    from mlxproxy.load.data.results import Group
    from mlxproxy.load.judge.capacity import capacity_of
    from mlxproxy.load.judge.verdict import capacity_line

    def group(c: int, ttft: float, tpot: float = 0.02, agg: float = 100.0, outcome: str = "ok") -> Group:
        recs = [_rec(i, ttft, tpot, outcome) for i in range(20)]
        summary = {"aggregate_tps": agg, **_judge(recs, {"ttft_p95": 1.0}).to_json()}
        return Group.from_dict(
            {
                "target": "t",
                "mode": f"concurrency {c}",
                "kind": "sweep_step",
                "params": {"concurrency": c, "sweep": True},
                "summary": summary,
                "records": recs,
            }
        )

    cap = capacity_of([group(1, 2.0)])["t"]
    assert cap.value == 0
    assert capacity_line("t", cap) == (
        "t: does not meet the SLO even at 1 concurrent stream: TTFT p95 is 2 s (> 1 s); beyond the noise"
    )
    cap = capacity_of([group(1, 0.1, agg=50), group(2, 0.1, agg=52)])["t"]
    assert cap.limited_by == "throughput" and cap.value == 1  # 2 streams added no throughput
    assert capacity_line("t", cap) == (
        "t: capacity 1 concurrent stream, where aggregate tok/s stopped rising (50 tok/s; 52 at 2, where the SLO"
        " still held: more load only queues)"
    )
    cap = capacity_of([group(1, 0.1, agg=50), group(2, 0.1, agg=100)])["t"]
    assert (
        cap.limited_by == "steps"
        and capacity_line("t", cap) == "t: meets the SLO at every step, up to 2 concurrent streams"
    )
    cap = capacity_of([group(1, 0.1), group(2, 0.1, outcome="upstream_timeout")])["t"]
    assert cap.limited_by == "errors" and "at 2, 20 of 20 requests failed" in capacity_line("t", cap)


# -- agent sessions --------------------------------------------------------------------------------


def _conversation_caps() -> list[CapturedRequest]:
    """Conversation A: three turns, each 0.1 s long and 0.5 s of think time apart, its message list
    growing; conversation B: one turn, with another first user message, begun between them."""
    out = []

    def add(rid: str, offset: float, messages: list[dict]) -> None:
        out.append(captured_chat(rid, messages, started_at=1000.0 + offset, offset_s=offset, duration_s=0.1))

    sys_msg = {"role": "system", "content": "You are a coding agent."}
    u1, a1 = {"role": "user", "content": "fix the failing test"}, {"role": "assistant", "content": "reading tests"}
    u2, a2 = {"role": "tool", "content": "test output ..."}, {"role": "assistant", "content": "patched"}
    add("a0", 0.0, [sys_msg, u1])
    add("b0", 0.3, [sys_msg, {"role": "user", "content": "write a README"}])
    add("a1", 0.6, [sys_msg, u1, a1, u2])
    add("a2", 1.2, [sys_msg, u1, a1, u2, a2, {"role": "user", "content": "run it again"}])
    return out


def test_a_capture_splits_into_conversations_and_a_session_shares_one_nonce() -> None:
    from mlxproxy.load.commands.replay_requests import captured_think_s, prepare, split_sessions

    caps = _conversation_caps()
    sessions = split_sessions(caps)
    assert [[c.record.id for c in s] for s in sessions] == [["a0", "a1", "a2"], ["b0"]]
    assert captured_think_s(caps[0], caps[2]) == pytest.approx(0.5)
    import dataclasses

    redo = dataclasses.replace(caps[0], offset_s=2.0, record=dataclasses.replace(caps[0].record, id="redo"))
    again = split_sessions(caps + [redo])  # the same task begun again (its list shrank): a new conversation
    assert [[c.record.id for c in s] for s in again] == [["a0", "a1", "a2"], ["b0"], ["redo"]]
    opts = Rewrites()
    bodies = [orjson.loads(prepare(c, opts, "[nonce abc] ").body) for c in sessions[0]]
    assert all(b["messages"][0]["content"].startswith("[nonce abc] ") for b in bodies)


@pytest.mark.parametrize("think", [None, 0.2])
def test_replay_sessions_keep_turn_order_and_think_time(tmp_path: Path, think: float | None) -> None:
    cap = write_capture(tmp_path / "c.jsonl", _conversation_caps())
    out = tmp_path / "s.json"
    extra = [] if think is None else ["--think-time", str(think)]
    with ServerThread(create_sim("healthy", speed=20)) as sim:
        res = cli("replay", str(cap), "--target", f"s={sim.url}", "--sessions", "3", *extra, "--json", str(out))
    assert res.returncode == 0, res.stderr[-1500:]
    (g,) = orjson.loads(out.read_bytes())["groups"]
    assert g["mode"] == "sessions 3" and g["summary"]["sessions"]["count"] == 3
    by_session: dict[int, list[dict]] = {}
    for r in g["records"]:
        by_session.setdefault(r["session"], []).append(r)
    assert sorted(len(v) for v in by_session.values()) == [1, 3, 3]  # A, B, and A again to make three
    want = 0.5 if think is None else think
    for recs in by_session.values():
        recs.sort(key=lambda r: r["started_at"])
        assert [r["turn"] for r in recs] == list(range(len(recs)))
        assert [r["source_id"] for r in recs] in (["a0", "a1", "a2"], ["b0"])
        for prev, r in zip(recs, recs[1:]):
            gap = r["started_at"] - (prev["started_at"] + prev["duration_s"])
            assert r["think_s"] == pytest.approx(want)
            assert want - 0.01 <= gap <= want + 0.25, (gap, want)
    assert "by turn:" in res.stdout and "whole session: p50" in res.stdout


def test_the_sweep_steps_the_number_of_agent_sessions(tmp_path: Path) -> None:
    cap = write_capture(tmp_path / "c.jsonl", _conversation_caps())
    out = tmp_path / "s.json"
    # serial: a turn of one session waits for the other session's turn (4 tokens at 5 tok/s = 0.8 s
    # simulated, 0.2 s at speed 4)
    with ServerThread(create_sim("mlx-omni-server", speed=4, decode_tps=5.0, prefill_tps=20000.0)) as sim:
        res = cli(
            "replay",
            str(cap),
            "--target",
            f"agents={sim.url}",
            "--sessions",
            "1,2",
            "--think-time",
            "0.05",
            "--repeat",
            "5",
            "--slo",
            "ttft_p95=100ms",
            "--json",
            str(out),
        )
    assert res.returncode == 0, res.stderr[-1500:]
    doc = orjson.loads(out.read_bytes())
    cap_ = doc["capacity"]["agents"]
    assert (
        cap_["unit"] == "sessions"
        and cap_["max_concurrency"] == 1
        and [s["concurrency"] for s in cap_["steps"]] == [1, 2]
    )
    assert "agents: meets the SLO up to 1 concurrent session; at 2, TTFT p95 is" in " ".join(res.stdout.split())
    step2 = next(g for g in doc["groups"] if g["params"]["concurrency"] == 2)
    # the same mix at every step, scaled: 2 sessions x (A (3 turns) + B (1 turn)) x 5 repeats
    assert step2["mode"] == "sessions 2" and len(step2["records"]) == 2 * 4 * 5
    for s in {r["session"] for r in step2["records"]}:
        turns = sorted((r for r in step2["records"] if r["session"] == s), key=lambda r: r["started_at"])
        assert [r["turn"] for r in turns] == list(range(len(turns)))


def test_a_sweep_of_rates_gives_the_capacity_in_requests_per_second(tmp_path: Path) -> None:
    out = tmp_path / "rate.json"
    # 4 slots, each answer 40 tokens at 50 tok/s = 0.8 s simulated, 0.2 s wall at speed 4: constant arrivals at
    # 8/s keep at most 2 in flight (16/s would keep 3.2 on average, at the edge on a loaded machine); at 40/s
    # the queue grows and TTFT with it, past a whole answer's 200 ms (the 120 ms target leaves room for the
    # load generator's own lag, which counts in an open loop, on a busy machine)
    with ServerThread(
        create_sim("healthy", speed=4, max_batch_streams=4, batch_penalty=0.0, prefill_tps=20000.0)
    ) as sim:
        res = cli(
            "bench",
            "--target",
            f"s={sim.url}",
            "--prompt-tokens",
            "50",
            "--repeat",
            "1",
            "--max-tokens",
            "40",
            "--rate",
            "4,8,40",
            "--requests",
            "20",
            "--slo",
            "ttft_p95=120ms",
            "--json",
            str(out),
        )
    assert res.returncode == 0, res.stderr[-1500:]
    cap = orjson.loads(out.read_bytes())["capacity"]["s"]
    assert cap["max_rate"] == 8, res.stdout[-800:]
    assert (
        cap["unit"] == "req/s" and cap["max_rate"] == 8 and "max_concurrency" not in cap and cap["limited_by"] == "slo"
    )
    assert [st["rate"] for st in cap["steps"]] == [4, 8, 40] and all(st["requests"] == 20 for st in cap["steps"])
    assert "s: meets the SLO up to 8 req/s; at 40 req/s, TTFT p95 is" in " ".join(res.stdout.split())


def test_replay_sweeps_rates_too(tmp_path: Path) -> None:
    # the same server as above: 8/s keeps at most 2 answers in flight, 40/s queues them
    cap = write_capture(tmp_path / "c.jsonl", _caps(4, max_tokens=40))
    out = tmp_path / "rate.json"
    with ServerThread(
        create_sim("healthy", speed=4, max_batch_streams=4, batch_penalty=0.0, prefill_tps=20000.0)
    ) as sim:
        res = cli(
            "replay", str(cap), "--target", f"s={sim.url}", "--rate", "4,8,40", "--repeat", "5",
            "--slo", "ttft_p95=120ms", "--json", str(out),
        )  # fmt: skip
    assert res.returncode == 0, res.stderr[-1500:]
    cap_s = orjson.loads(out.read_bytes())["capacity"]["s"]
    assert cap_s["max_rate"] == 8, res.stdout[-800:]
    assert cap_s["unit"] == "req/s" and cap_s["max_rate"] == 8 and cap_s["limited_by"] == "slo"
    assert [st["rate"] for st in cap_s["steps"]] == [4, 8, 40] and all(st["requests"] == 20 for st in cap_s["steps"])
    assert "s: meets the SLO up to 8 req/s; at 40 req/s, TTFT p95 is" in " ".join(res.stdout.split())


def test_the_bundled_agent_session_grows_with_tool_turns_and_replays(tmp_path: Path) -> None:
    from mlxproxy.load.commands.replay_requests import split_sessions, synthetic_agent_session

    caps = synthetic_agent_session(turns=4)
    (conv,) = split_sessions(caps)  # one conversation of four turns
    sizes = [len(orjson.dumps(c.request)) for c in conv]
    assert len(conv) == 4 and sizes == sorted(sizes) and sizes[-1] > sizes[0] + 3 * 3000
    last = conv[-1].request["messages"]
    assert [m["role"] for m in last[2:]] == ["assistant", "tool"] * 3 and last[2]["tool_calls"][0]["type"] == "function"
    with ServerThread(create_sim("healthy", speed=50)) as sim:
        res = cli(
            "replay",
            "builtin:agent",
            "--target",
            f"s={sim.url}",
            "--sessions",
            "2",
            "--think-time",
            "0",
            "--csv",
            str(tmp_path / "a.csv"),
        )
    assert res.returncode == 0, res.stderr[-1500:]
    import csv

    with open(tmp_path / "a.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 12 and sorted({r["turn"] for r in rows}) == [str(i) for i in range(6)]
    prompt = {int(r["turn"]): int(r["prompt_tokens"]) for r in rows}
    assert all(prompt[i + 1] > prompt[i] for i in range(5))  # the prompt grows turn by turn


def test_a_ramp_rises_linearly_and_is_not_measured(tmp_path: Path) -> None:
    from mlxproxy.load.data.arrivals import ramp_offsets

    ramp = ramp_offsets(20.0, 2.0)  # 20/s reached after 2 s: 20 requests, due at sqrt(i / 5)
    assert len(ramp) == 20 and ramp[-1] < 2.0 and ramp[5] == pytest.approx(1.0)
    first_half = sum(1 for t in ramp if t < 1.0)
    assert first_half == 5  # a quarter of the ramp's requests in its first half: the rate rose linearly
    poisson = ramp_offsets(200.0, 2.0, "poisson", seed=4)
    assert 160 <= len(poisson) <= 240 and sum(1 for t in poisson if t < 1.0) < 0.4 * len(poisson)
    assert ramp_offsets(20.0, 0.0) == []
    cap = write_capture(tmp_path / "c.jsonl", _caps(2))
    out = tmp_path / "r.json"
    served = []

    async def counting(scope, receive, send):  # an ASGI app counting completions requests
        await app(scope, receive, send)
        if scope["type"] == "http" and scope["path"].endswith("/completions"):
            served.append(1)

    app = create_sim("healthy", speed=50)
    with ServerThread(counting) as sim:
        res = cli(
            "replay", str(cap), "--target", sim.url, "--rate", "20", "--ramp", "1", "--repeat", "5", "--json", str(out)
        )
    assert res.returncode == 0, res.stderr[-1500:]
    (g,) = orjson.loads(out.read_bytes())["groups"]
    assert g["summary"]["requests"] == 10 and g["params"]["ramp_s"] == 1.0  # the ramp's 10 requests are not in it
    assert len(served) == 20  # ... but they were sent
    res = cli("replay", str(cap), "--target", sim.url, "--ramp", "1")
    assert res.returncode == 2 and "--ramp applies to --rate only" in res.stderr


def test_replayed_sessions_reuse_the_prompt_cache_turn_by_turn() -> None:
    """On a simulator with a prompt cache, each replayed conversation starts cold (its own nonce)
    and every later turn reuses the cache of the turn before it, as an agent's turns do."""
    from mlxproxy.load.commands.replay_requests import synthetic_agent_session

    caps = synthetic_agent_session(turns=4)
    with ServerThread(create_sim("healthy", speed=50, prompt_cache=True)) as sim:
        (g,) = asyncio.run(
            run_replay(
                caps,
                Target("target", sim.url),
                ReplayOptions(mode="sessions", sessions=2, repeat=2, think_time=0.0),
            )
        )
    runs: dict[int, list[RunRecord]] = {}
    for r in g.records:
        assert r.session is not None
        runs.setdefault(r.session, []).append(r)
    assert len(runs) == 2
    for rows in runs.values():
        rows.sort(key=lambda r: r.turn)
        recs = [r.record for r in rows]
        # a new run of the conversation: nothing of it cached but the marker's own "[nonce " (~2 tokens)
        assert (recs[0].cached_tokens or 0) <= 2 < recs[0].prompt_tokens // 100
        for prev, r in zip(recs, recs[1:]):
            assert r.cached_tokens >= prev.prompt_tokens - 2, (prev.prompt_tokens, r.cached_tokens)
