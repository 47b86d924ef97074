"""How many agents can my server take: sweeps against the simulator name the capacity its own
engine gives in scripted time; steps are comparable and big enough; the verdict names each
step once; open-loop latency counts the time a request waited in the generator."""

from __future__ import annotations

import dataclasses
import itertools
import re
from pathlib import Path

import orjson
import pytest

from mlxproxy.capture import CapturedRequest
from mlxproxy.core.record import Record
from mlxproxy.core.stats import percentile
from mlxproxy.edge.runner import ServerThread
from mlxproxy.load.data.results import Group, RunRecord
from mlxproxy.load.data.summary import Judgment
from mlxproxy.load.judge.capacity import MIN_STEP_REQUESTS, capacity_of, rise_needed
from mlxproxy.load.judge.slo import fmt_value, judge
from mlxproxy.load.judge.verdict import capacity_line
from mlxproxy.load.run.sweep import mix_copies, refine_bounds, session_runs
from mlxproxy.sim.app import create_app as create_sim
from mlxproxy.sim.profiles import get_profile
from support import captured_chat, cli, engine_closed_loop, proxy, wait_for, write_capture

# batches up to N streams at exactly 50 tok/s each (no batch penalty), then queues: a stream
# past the batch waits a whole answer (40 tokens = 0.8 s simulated, 0.2 s at speed 4) for a
# slot, far past the 100 ms TTFT target; a stream that gets a slot at once waits only for a
# prefill of a few ms
SPEED = 4.0
TOKENS = 40
SLO = "ttft_p95=100ms"
TTFT_MAX_S = 0.1


def knobs(max_batch: int) -> dict[str, float]:
    return {"max_batch_streams": max_batch, "batch_penalty": 0.0, "prefill_tps": 20000.0}


def engine_step(profile, conc: int, n_total: int, prompt_tokens: int = 50) -> dict[str, float]:
    """What a closed loop of `conc` streams sending `n_total` requests gets from the
    simulator's own engine in scripted time: TTFT p95 (wall seconds at SPEED) and aggregate
    tok/s (network milliseconds left out)."""
    reqs = engine_closed_loop(profile, conc, n_total, prompt_tokens, TOKENS)
    ttft_p95 = percentile(sorted((r.first_token - r.started) / SPEED for r in reqs), 95)
    assert ttft_p95 is not None
    end = max(r.finished for r in reqs) / SPEED
    return {"ttft_p95": ttft_p95, "tps": n_total * TOKENS / end}


def truth_capacity(profile, steps: list[int], n_of) -> int:
    """The capacity the engine's figures give for `steps` (in order): the largest step, big
    enough to judge, whose TTFT p95 holds, below the first that breaks, not past the step
    after which aggregate tok/s stopped rising."""
    best_tps, best = None, 0
    for c in steps:
        n = n_of(c)
        if n < MIN_STEP_REQUESTS:
            continue
        fig = engine_step(profile, c, n)
        if fig["ttft_p95"] > TTFT_MAX_S:
            break
        if best_tps is not None and fig["tps"] < rise_needed(best, c) * best_tps:
            break
        best_tps, best = fig["tps"], c
    return best


def test_the_engines_truth_is_what_the_tests_below_expect() -> None:
    """The truth is computed, not assumed: it moves with the batch size."""
    for mb in (4, 6):
        p = get_profile("healthy", **knobs(mb))
        assert truth_capacity(p, list(range(1, 13)), lambda c: mix_copies(c, 1, 3)) == mb


@pytest.mark.parametrize(("max_batch", "sweep"), [(4, ["--sweep"]), (6, ["--sweep", "auto"])])
def test_bench_sweep_doubles_then_refines_to_the_engines_truth(
    tmp_path: Path, max_batch: int, sweep: list[str]
) -> None:
    """`--sweep` alone is `--sweep auto`: 6 on a --max-batch 6 server, not a power of two."""
    out = tmp_path / "b.json"
    with ServerThread(create_sim("healthy", speed=SPEED, **knobs(max_batch))) as sim:
        res = cli(
            "bench", "--target", f"s={sim.url}", "--prompt-tokens", "50", "--repeat", "1",
            "--max-tokens", str(TOKENS), *sweep, "--slo", SLO, "--json", str(out),
        )  # fmt: skip
    assert res.returncode == 0, res.stderr[-1500:]
    cap = orjson.loads(out.read_bytes())["capacity"]["s"]
    ran = [st["concurrency"] for st in cap["steps"]]
    truth = truth_capacity(get_profile("healthy", **knobs(max_batch)), sorted(ran), lambda c: mix_copies(c, 1, 3))
    assert cap["max_concurrency"] == truth == max_batch, (ran, cap["max_concurrency"])
    assert {1, 2, 4, 8, max_batch + 1} <= set(ran)  # doubled, then refined between 4 and 8 to the step past it
    assert all(st["requests"] >= MIN_STEP_REQUESTS and not st["too_small"] for st in cap["steps"])
    line = next(ln for ln in res.stdout.splitlines() if ln.strip().startswith("s: "))
    # the interval the noise leaves, in parentheses: the simulator's steps are clear of the SLO
    want = (
        rf"meets the SLO up to {max_batch} concurrent streams; at {max_batch + 1}, TTFT p95 is [^;]*; beyond the noise"
    )
    assert re.search(want, " ".join(res.stdout.split())), line


def test_bench_sweep_double_stops_at_the_powers_of_two(tmp_path: Path) -> None:
    """`--sweep double` on the --max-batch 6 server: 1, 2, 4, 8 and no more; the answer is the
    power of two below the truth, and the verdict says it was not refined."""
    out = tmp_path / "b.json"
    with ServerThread(create_sim("healthy", speed=SPEED, **knobs(6))) as sim:
        res = cli(
            "bench", "--target", f"s={sim.url}", "--prompt-tokens", "50", "--repeat", "1",
            "--max-tokens", str(TOKENS), "--sweep", "double", "--slo", SLO, "--json", str(out),
        )  # fmt: skip
    assert res.returncode == 0, res.stderr[-1500:]
    cap = orjson.loads(out.read_bytes())["capacity"]["s"]
    ran = [st["concurrency"] for st in cap["steps"]]
    assert ran == [1, 2, 4, 8]
    truth = truth_capacity(get_profile("healthy", **knobs(6)), ran, lambda c: mix_copies(c, 1, 3))
    assert cap["max_concurrency"] == truth == 4 and cap["broken_at"] == 8
    assert "the capacity lies between 4 and 7: not refined" in " ".join(res.stdout.split())


def _capture_with_models(tmp_path: Path, chats: list[CapturedRequest]) -> Path:
    """A capture of `chats` plus the `GET /v1/models` a client sends first."""
    models = dataclasses.replace(
        chats[0],
        record=dataclasses.replace(chats[0].record, id="models", endpoint="other", path="/v1/models", method="GET"),
        method="GET",
        path="/v1/models",
        request=None,
    )
    return write_capture(tmp_path / "c.jsonl", [models, *chats])


@pytest.mark.parametrize(("max_batch", "sweep"), [(4, ["--sweep"]), (6, ["--sweep", "auto"])])
def test_replay_sweep_refines_to_the_engines_truth_and_leaves_out_get_models(
    tmp_path: Path, max_batch: int, sweep: list[str]
) -> None:
    """Doubling 1, 2, 4, 8, then refining: 6 on a --max-batch 6 server, not a power of two."""
    chats = [
        captured_chat(f"c{i}", [{"role": "user", "content": f"task {i}"}], started_at=1.0 + i, max_tokens=TOKENS)
        for i in range(2)
    ]
    cap_file = _capture_with_models(tmp_path, chats)
    out = tmp_path / "r.json"
    with ServerThread(create_sim("healthy", speed=SPEED, **knobs(max_batch))) as sim:
        res = cli("replay", str(cap_file), "--target", f"s={sim.url}", *sweep, "--slo", SLO, "--json", str(out))
    assert res.returncode == 0, res.stderr[-1500:]
    doc = orjson.loads(out.read_bytes())
    cap = doc["capacity"]["s"]
    ran = [st["concurrency"] for st in cap["steps"]]
    truth = truth_capacity(get_profile("healthy", **knobs(max_batch)), sorted(ran), lambda c: 2 * mix_copies(c, 2))
    assert cap["max_concurrency"] == truth == max_batch, (ran, cap)
    assert {1, 2, 4, 8, max_batch + 1} <= set(ran)  # doubled to 8, then refined to the step past the truth
    for g in doc["groups"]:
        if g["kind"] == "sweep_step":
            paths = {r["path"] for r in g["records"]}
            assert paths == {"/v1/chat/completions"}, paths  # GET /v1/models is not part of any step
            # the same mix at every step: both captured chats, equally often
            ids = [r["source_id"] for r in g["records"]]
            assert ids.count("c0") == ids.count("c1") == len(ids) // 2
    want = (
        rf"meets the SLO up to {max_batch} concurrent streams; at {max_batch + 1}, TTFT p95 is [^;]*; beyond the noise"
    )
    assert re.search(want, " ".join(res.stdout.split()))


def _five_turns() -> list[CapturedRequest]:
    sys_msg = {"role": "system", "content": "You are a coding agent."}
    msgs: list[dict] = [sys_msg, {"role": "user", "content": "fix the failing test"}]
    out = []
    for t in range(5):
        out.append(
            captured_chat(
                f"t{t}", list(msgs), started_at=10.0 + t, offset_s=float(t), duration_s=0.5, max_tokens=TOKENS
            )
        )
        msgs += [{"role": "assistant", "content": f"step {t}"}, {"role": "tool", "content": f"output {t}"}]
    return out


def test_a_sessions_sweep_replays_whole_conversations_and_judges_their_later_turns(tmp_path: Path) -> None:
    """Every conversation whole; its first turn (the whole prompt, every conversation of the step
    starting it at once) is the step's warm-up, sent and reported apart, not judged; a step
    sends whole conversations until it judges 20 later turns (3 at 2 sessions, 2 at 4)."""
    cap_file = _capture_with_models(tmp_path, _five_turns())
    out = tmp_path / "s.json"
    with ServerThread(create_sim("healthy", speed=SPEED, **knobs(4))) as sim:
        res = cli(
            "replay", str(cap_file), "--target", f"s={sim.url}", "--sessions", "2,4,5",
            "--think-time", "0", "--slo", SLO, "--json", str(out),
        )  # fmt: skip
    assert res.returncode == 0, res.stderr[-1500:]
    doc = orjson.loads(out.read_bytes())
    steps = [g for g in doc["groups"] if g["kind"] == "sweep_step"]
    for g in steps:
        n = g["params"]["concurrency"]
        # a step whose break was within the noise is measured again: its records are both measurements'
        assert len(g["records"]) == 5 * session_runs(n, [5]) * g["params"]["measured"] and {
            r["path"] for r in g["records"]
        } == {"/v1/chat/completions"}
        for s in {r["session"] for r in g["records"]}:
            turns = sorted((r for r in g["records"] if r["session"] == s), key=lambda r: r["started_at"])
            assert [r["turn"] for r in turns] == list(range(5))  # every turn of every session
            assert [r.get("warmup", False) for r in turns] == [True, False, False, False, False]
    cap = doc["capacity"]["s"]
    truth = truth_capacity(get_profile("healthy", **knobs(4)), [2, 4, 5], lambda c: 5 * session_runs(c, [5]))
    assert cap["max_concurrency"] == truth == 4 and "too_small" not in cap and cap["broken_at"] == 5
    by_step = {st["step"]: st for st in cap["steps"]}
    per_look = {n: (st["requests"] // st["measured"], st["warmup"] // st["measured"]) for n, st in by_step.items()}
    assert per_look == {2: (24, 6), 4: (32, 8), 5: (20, 5)}  # every conversation's turns past its first
    text = " ".join(res.stdout.split())
    assert "meets the SLO up to 4 concurrent sessions; at 5, TTFT p95 is" in text
    first = fmt_value(by_step[4]["warmup_ttft_p95_s"], "s")
    assert (
        f"the conversations' first turns (the whole prompt, started together; not judged) had TTFT p95 {first} at 4"
        in text
    )


def test_a_sessions_sweep_auto_refines_to_the_engines_truth(tmp_path: Path) -> None:
    """`replay --mode sessions --sweep auto` on the --max-batch 6 server: every step judged (the
    first ones send more conversations, one after another), then refining finds 6 sessions."""
    cap_file = _capture_with_models(tmp_path, _five_turns())
    out = tmp_path / "s.json"
    with ServerThread(create_sim("healthy", speed=SPEED, **knobs(6))) as sim:
        res = cli(
            "replay", str(cap_file), "--target", f"s={sim.url}", "--mode", "sessions", "--sweep", "auto",
            "--think-time", "0", "--slo", SLO, "--json", str(out),
        )  # fmt: skip
    assert res.returncode == 0, res.stderr[-1500:]
    cap = orjson.loads(out.read_bytes())["capacity"]["s"]
    ran = [st["concurrency"] for st in cap["steps"]]
    truth = truth_capacity(get_profile("healthy", **knobs(6)), sorted(ran), lambda c: 5 * session_runs(c, [5]))
    assert cap["max_concurrency"] == truth == 6, (ran, cap)
    assert {1, 2, 4, 8, 7} <= set(ran) and "too_small" not in cap and cap["unit"] == "sessions"
    assert "meets the SLO up to 6 concurrent sessions; at 7, TTFT p95 is" in " ".join(res.stdout.split())


def test_a_bare_sweep_before_the_capture_leaves_the_capture_an_argument(tmp_path: Path) -> None:
    """`--sweep` takes an optional value: the word after a bare `--sweep` is still the capture."""
    cap_file = _capture_with_models(tmp_path, _five_turns())
    res = cli("replay", "--sweep", str(cap_file), "--target", "http://127.0.0.1:9", "--batch", "2")
    assert res.returncode == 2 and "--sweep steps" in res.stderr  # parsed as a sweep of that capture
    res = cli("replay", str(cap_file), "--target", "http://127.0.0.1:9", "--sweep", "twice")
    assert res.returncode == 2 and "'twice' is not one of 'auto', 'double'" in res.stderr


# -- the verdict ------------------------------------------------------------------------------


def _judge(rows: list[dict], slo: dict[str, float]) -> Judgment:
    """`judge` over rows as a result file holds them."""
    return judge([RunRecord.from_dict(r) for r in rows], slo)


def _rec(i: int, ttft: float, outcome: str = "ok", lag: float | None = None) -> dict:
    r = Record(
        id=f"r{i}", started_at=100.0 + i, upstream="t", model="m", endpoint="chat_completions", stream=True, status=200,
        outcome=outcome, ttft_s=ttft, e2e_s=ttft + 1.0, tpot_s=0.02, duration_s=ttft + 1.0,
    ).to_dict()  # fmt: skip
    if lag is not None:
        r["schedule_lag_s"] = lag
    return r


def _step(c: float, ttft: float, agg: float, n: int = 20, outcome: str = "ok", unit: str = "streams") -> Group:
    recs = [_rec(i, ttft, outcome) for i in range(n)]
    key = "rate" if unit == "req/s" else "concurrency"
    return Group.from_dict(
        {
            "target": "t",
            "mode": f"{key} {c:g}",
            "kind": "sweep_step",
            "params": {key: c, "step": c, "sweep": True, "unit": unit},
            "summary": {"aggregate_tps": agg, **_judge(recs, {"ttft_p95": 5.0}).to_json()},
            "records": recs,
        }
    )


def test_flat_throughput_ends_the_capacity_at_the_knee_and_names_two_steps() -> None:
    # the --max-batch 4 server under a loose SLO: TTFT 0.8 s -> 4.5 s, throughput flat past 4
    groups = [_step(1, 0.8, 50), _step(2, 0.8, 100), _step(4, 0.9, 200), _step(8, 4.5, 201)]
    cap = capacity_of(groups)["t"]
    assert cap.value == 4 and cap.limited_by == "throughput" and cap.knee == 4
    line = capacity_line("t", cap)
    assert line == (
        "t: capacity 4 concurrent streams, where aggregate tok/s stopped rising (200 tok/s; 201 at 8, where the SLO"
        " still held: more load only queues); the capacity lies between 4 and 7: not refined"
    )


def test_falling_throughput_is_not_capacity() -> None:
    # the capture replayed at 4 then 8 streams: 911 -> 122 tok/s while the SLO's thresholds still held
    cap = capacity_of([_step(1, 0.5, 300), _step(2, 0.6, 600), _step(4, 1.0, 911), _step(8, 4.0, 122)])["t"]
    assert cap.value == 4 and cap.limited_by == "throughput"
    line = capacity_line("t", cap)
    assert "capacity 4 concurrent streams, where aggregate tok/s stopped rising (911 tok/s; 122 at 8," in line
    assert line.endswith("; the capacity lies between 4 and 7: not refined")


def test_the_verdict_never_names_one_step_twice() -> None:
    """Every combination of held / broken / failed / too small / flat over four steps."""
    kinds = {
        "held": lambda c, agg: _step(c, 1.0, agg),
        "slow": lambda c, agg: _step(c, 9.0, agg),
        "failed": lambda c, agg: _step(c, 1.0, agg, outcome="upstream_timeout"),
        "small": lambda c, agg: _step(c, 1.0, agg, n=5),
    }
    seen = 0
    for combo in itertools.product(kinds, repeat=4):
        for aggs in ((10, 20, 40, 80), (10, 20, 20, 20), (50, 40, 30, 20)):
            groups = [kinds[k](c, a) for k, c, a in zip(combo, (1, 2, 4, 8), aggs)]
            cap = capacity_of(groups)["t"]
            line = capacity_line("t", cap)
            head = line.split(": too few requests")[0].rsplit("; ", 1)[0] if "too few" in line else line
            named = re.findall(r"\b(?:at|past|to|capacity) (\d+)\b", head)
            assert len(named) == len(set(named)), (combo, aggs, line)  # each step named once at most
            if cap.value:
                st = next(s for s in cap.steps if s.step == cap.value)
                assert st.slo_met and not st.too_small, (combo, aggs, line)
            seen += 1
    assert seen == 4**4 * 3


def test_a_too_small_step_is_never_reported_as_meeting_the_slo() -> None:
    cap = capacity_of([_step(1, 0.1, 10, n=5), _step(2, 0.1, 20, n=10)])["t"]
    assert cap.value == 0 and cap.limited_by == "too_small" and cap.too_small == (1, 2)
    line = capacity_line("t", cap)
    assert (
        line
        == "t: cannot say: every step was too small to judge (1, 2: under 20 generation requests each; add --repeat)"
    )


def test_refining_stops_when_the_bounds_meet() -> None:
    steps = [
        dataclasses.replace(s, too_small=False)
        for s in capacity_of([_step(c, 1.0, 10 * c) for c in (1, 2, 4)])["t"].steps
    ]
    assert refine_bounds(steps) is None  # every step held and rose: nothing to refine
    broke = capacity_of([_step(1, 1.0, 10), _step(2, 1.0, 20), _step(4, 1.0, 40), _step(8, 9.0, 40)])["t"].steps
    assert refine_bounds(broke) == (4, 8)
    more = capacity_of([_step(c, 1.0 if c <= 6 else 9.0, 10 * min(c, 6)) for c in (1, 2, 4, 6, 7, 8)])["t"]
    assert refine_bounds(more.steps) is None and more.value == 6


# -- coordinated omission -----------------------------------------------------------------------


def test_open_loop_latency_counts_the_time_queued_in_the_generator() -> None:
    """A request sent 3 s late by a saturated generator waited 3 s more than its TTFT says."""
    on_time = [_rec(i, 0.5, lag=0.001) for i in range(20)]
    late = [_rec(i, 0.5, lag=3.0) for i in range(20)]
    slo = {"ttft_p95": 2.0, "e2e_p95": 3.0}
    assert _judge(on_time, slo).slo.met
    j = _judge(late, slo)
    assert not j.slo.met and j.slo.values["ttft_p95"] == pytest.approx(3.5)
    assert j.goodput.good == 0


def test_open_loop_rows_carry_each_requests_schedule_lag() -> None:
    import asyncio

    from mlxproxy.load.commands.replay_requests import Rewrites, prepare
    from mlxproxy.load.run.client import MeasuringClient
    from mlxproxy.load.run.runner import send
    from mlxproxy.load.run.shapes import Due, Load

    chats = [captured_chat(f"c{i}", [{"role": "user", "content": "hi"}]) for i in range(5)]

    async def go():
        async with MeasuringClient(sim.url) as client:
            reqs = [prepare(c, Rewrites()) for c in chats]
            due = [dataclasses.replace(r, offset_s=o) for r, o in zip(reqs, [0.0, 0.01, 0.02, 0.03, 0.04])]
            return await send(Due(), Load(due), client)

    with ServerThread(create_sim("healthy", speed=50)) as sim:
        timed = asyncio.run(go())
    rows = timed.rows()
    assert len(rows) == 5 and all(isinstance(r.schedule_lag_s, float) and r.schedule_lag_s >= 0 for r in rows)
    assert sorted(r.schedule_lag_s for r in rows) == sorted(timed.lag_s)
    assert all(r.to_dict()["schedule_lag_s"] == r.schedule_lag_s for r in rows)  # the key in the file


# -- separate conversations ------------------------------------------------------------------------


def test_each_session_run_is_its_own_conversation_to_the_prefix_tracker() -> None:
    """The nonce marks the first user message too (a conversation's key), so two runs of the
    bundled agent session are two conversations, and one run's turns are one."""
    from mlxproxy.core.prefix import fingerprint
    from mlxproxy.load.commands.replay_requests import Rewrites, prepare, synthetic_agent_session

    turns = synthetic_agent_session(turns=3)
    opts = Rewrites()
    run_a = [orjson.loads(prepare(c, opts, "[nonce aaa] ").body) for c in turns]
    run_b = [orjson.loads(prepare(c, opts, "[nonce bbb] ").body) for c in turns]
    keys_a = {fingerprint("chat_completions", b).key for b in run_a}
    keys_b = {fingerprint("chat_completions", b).key for b in run_b}
    assert len(keys_a) == 1 and len(keys_b) == 1 and keys_a != keys_b
    first_user = next(m for m in run_a[0]["messages"] if m["role"] == "user")
    assert run_a[0]["messages"][0]["role"] == "system" and first_user["content"].startswith("[nonce aaa] ")


def test_replayed_agent_sessions_raise_no_prefix_anomaly_through_the_proxy(tmp_path: Path) -> None:
    """`replay builtin:agent --sessions 2 --repeat 3` through the proxy in front of a healthy
    simulator with a prompt cache: three runs of the conversation, two at once, none merged
    with another, so no prefix anomaly, and every later turn continues its own run."""
    out = tmp_path / "a.json"
    with ServerThread(create_sim("healthy", speed=50, prompt_cache=True)) as sim, proxy(sim.url) as (url, app):
        res = cli(
            "replay", "builtin:agent", "--target", f"p={url}", "--sessions", "2", "--repeat", "3",
            "--think-time", "0", "--json", str(out),
        )  # fmt: skip
        assert wait_for(lambda: len(app.recent.records) >= 18)
        records = list(app.recent.records)
    assert res.returncode == 0, res.stderr[-1500:]
    (g,) = orjson.loads(out.read_bytes())["groups"]
    assert len(g["records"]) == 18 and g["summary"]["sessions"]["count"] == 3
    continued = [r for r in records if r.prefix_reusable_tokens]
    assert len(continued) == 15  # turns 2-6 of each of the three runs continue their own conversation
    prefix = [a for r in records for a in r.anomalies if a in ("prompt_prefix_changed", "prefix_cache_miss")]
    assert prefix == [], [r.anomaly_evidence for r in records if r.anomalies]


def test_fail_on_slo_judges_the_lightest_step_big_enough_to_judge() -> None:
    from mlxproxy.load.judge.slo import failed_checks

    assert failed_checks(("slo",), [_step(1, 9.0, 10, n=5), _step(2, 1.0, 20)]) == []  # step 1: too small
    assert failed_checks(("slo",), [_step(1, 1.0, 10, n=5), _step(2, 1.0, 20, n=10)]) == [
        "SLO not judged on t: every sweep step sent under 20 generation requests"
    ]
    (broken,) = failed_checks(("slo",), [_step(2, 1.0, 20), _step(1, 9.0, 10)])  # in step order, not run order
    assert broken.startswith("SLO broken on t concurrency 1: TTFT p95 is 9")


def test_the_capacity_object_keeps_its_keys_in_the_result_file() -> None:
    """The frozen results convert to the same JSON keys, in the same order, as the file always had."""
    cap = capacity_of([_step(1, 1.0, 10), _step(2, 1.0, 20), _step(4, 9.0, 20), _step(8, 1.0, 20, n=5)])["t"]
    d = cap.to_json()
    assert list(d) == ["max_concurrency", "slo", "limited_by", "unit", "steps", "broken_at", "too_small", "interval"]
    assert d["max_concurrency"] == 2 and d["broken_at"] == 4 and d["too_small"] == [8] and d["slo"] == {"ttft_p95": 5.0}
    step = d["steps"][2]
    assert list(step) == [
        "step", "concurrency", "requests", "ok", "errors", "too_small", "ttft_p50_s", "ttft_p95_s", "tpot_p50_s",
        "tpot_p95_s", "decode_tps_p50", "aggregate_tps", "anomalies", "goodput", "slo_met", "breaches", "problem",
        "warmup", "measured", "aggregate_tps_ci", "intervals", "certain", "stalls_s", "split", "warmup_ttft_p95_s",
        "slow_waves_s",
    ]  # fmt: skip
    assert step["breaches"] == [{"key": "ttft_p95", "value": 9.0, "threshold": 5.0}] and step["slo_met"] is False
    assert list(step["goodput"]) == ["good", "requests", "share", "rate"]
    rate = capacity_of([_step(2.5, 1.0, 10, unit="req/s")])["t"].to_json()
    assert "max_rate" in rate and list(rate["steps"][0])[:2] == ["step", "rate"]
