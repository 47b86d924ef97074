"""The simulator's engine model: planned timelines asserted exactly, with scripted times.

Knob values are chosen binary-exact (decode 4 tok/s = 0.25 s steps, prefill 8 or 1024 tok/s,
penalty 0.5) so float timelines compare with `==`.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from mlxproxy.sim.engine import (
    Arrival,
    Engine,
    Finish,
    Headers,
    PrefillProgress,
    Rejected,
    Token,
    plan,
    planned_speedup,
    prefill_s,
    step_s,
    timelines,
)
from mlxproxy.sim.profiles import PROFILES, get_profile


def exact(**overrides: object):
    base = {"decode_tps": 4.0, "prefill_tps": 8.0, "batch_penalty": 0.5}
    base.update(overrides)
    return get_profile("healthy", **base)


def test_prefill_and_step_formulas() -> None:
    p = exact()
    assert prefill_s(p, 8) == 1.0
    assert prefill_s(p, 0) == 0.0
    assert step_s(p, 1) == 0.25
    assert step_s(p, 2) == 0.375
    assert step_s(p, 3) == 0.5
    healthy = PROFILES["healthy"]
    assert prefill_s(healthy, 1000) == pytest.approx(0.5)
    assert 1.0 / step_s(healthy, 1) == pytest.approx(healthy.decode_tps)


def test_superlinear_prefill_past_the_knee() -> None:
    p = exact(prefill_tps=1024.0, superlinear_after_tokens=1024, superlinear_exponent=3.0)
    assert prefill_s(p, 1024) == 1.0  # linear up to the knee
    assert prefill_s(p, 2048) == 2.0 * 2.0**2  # (P/T)^(e-1) times the linear cost
    assert prefill_s(p, 512) == 0.5
    vlm = PROFILES["mlx-vlm"]
    per_token_4k = prefill_s(vlm, 4000) / 4000
    per_token_52k = prefill_s(vlm, 52000) / 52000
    assert per_token_52k > 10 * per_token_4k  # the 52k-token pathological prefill


def test_single_request_timeline_exactly() -> None:
    events = plan(exact(), [Arrival("a", 1.0, 8, 4)])
    assert events == [
        Headers("a", 1.0),
        PrefillProgress("a", 2.0, 8, 8),
        Token("a", 2.0, 0),
        Token("a", 2.25, 1),
        Token("a", 2.5, 2),
        Token("a", 2.75, 3),
        Finish("a", 2.75, 4),
    ]
    tl = timelines(events)["a"]
    assert tl.first_token_s - 1.0 == prefill_s(exact(), 8)  # TTFT = prefill_s(P)
    assert (len(tl.token_s) - 1) / (tl.token_s[-1] - tl.token_s[0]) == 4.0  # decode_tps exactly


def test_prefill_progress_at_step_boundaries() -> None:
    p = exact(prefill_tps=1024.0, prefill_step_tokens=2048)
    tl = timelines(plan(p, [Arrival("a", 0.0, 5120, 1)]))["a"]
    assert tl.progress == ((2.0, 2048), (4.0, 4096), (5.0, 5120))
    assert tl.token_s == (5.0,)
    assert tl.finish_s == 5.0


def test_two_concurrent_streams_share_steps() -> None:
    events = plan(exact(), [Arrival("a", 0.0, 8, 3), Arrival("b", 0.25, 4, 3)])
    tl = timelines(events)
    assert tl["a"].headers_s == 0.0 and tl["b"].headers_s == 0.25  # headers at once
    # b's prefill runs after a's (1.0 .. 1.5) and pauses a's decoding; then 2-stream steps of 0.375 s.
    assert tl["a"].token_s == (1.0, 1.875, 2.25)
    assert tl["b"].token_s == (1.5, 1.875, 2.25)
    assert tl["a"].finish_s == tl["b"].finish_s == 2.25


def test_late_arrival_joins_after_the_current_step() -> None:
    p = exact(prefill_tps=1024.0)
    tl = timelines(plan(p, [Arrival("a", 0.0, 256, 4), Arrival("b", 0.3, 256, 2)]))
    # a: first token 0.25, step 0.25..0.5 already running when b arrives at 0.3;
    # b's prefill 0.5..0.75, then a and b decode together (0.375 s), then a alone.
    assert tl["a"].token_s == (0.25, 0.5, 1.125, 1.375)
    assert tl["b"].token_s == (0.75, 1.125)


def test_continuous_batching_speedup_of_the_profiles() -> None:
    """The truth the proxy team measures: aggregate TPS of 2 parallel / wall TPS of 1 alone."""
    assert planned_speedup(get_profile("healthy", batch_penalty=0.02)) >= 1.9
    assert planned_speedup(PROFILES["mlx-openai-server@1.6"]) == pytest.approx(1.0)  # one at a time, live 1.6.3
    assert planned_speedup(PROFILES["mlx-openai-server"]) >= 1.8  # 1.8: batching by default, as mlx-lm
    assert 1.8 <= planned_speedup(PROFILES["healthy"]) < 2.0
    assert 0.8 <= planned_speedup(PROFILES["mlx-omni-server"]) <= 0.95
    assert planned_speedup(PROFILES["mlx-omni-server"], n_parallel=3) < 0.9
    # long prompts dilute the batching gain: prefill is not shared
    assert planned_speedup(get_profile("healthy", batch_penalty=0.02), prompt_tokens=500) < 1.8
    assert planned_speedup(exact(batch_penalty=0.0), prompt_tokens=1, n_tokens=1000) == pytest.approx(2.0, rel=1e-3)


def test_serial_blocks_headers_until_the_previous_request_ends() -> None:
    events = plan(exact(serial=True), [Arrival("a", 0.0, 8, 3), Arrival("b", 0.25, 4, 3)])
    tl = timelines(events)
    assert tl["a"].headers_s == 0.0
    # a decodes while b waits: n = 2 in the step cost (0.375 s per token)
    assert tl["a"].token_s == (1.0, 1.375, 1.75)
    assert tl["b"].headers_s == 1.75 == tl["a"].finish_s
    assert tl["b"].token_s == (2.25, 2.5, 2.75)
    kinds = [type(e).__name__ for e in events if e.req_id == "b"]
    assert kinds[0] == "Headers"


def test_max_batch_streams_queues_prefill_but_not_headers() -> None:
    tl = timelines(plan(exact(max_batch_streams=1), [Arrival("a", 0.0, 8, 2), Arrival("b", 0.0, 8, 2)]))
    assert tl["b"].headers_s == 0.0
    assert tl["a"].token_s == (1.0, 1.25)
    assert tl["b"].token_s == (2.25, 2.5)  # prefill only once a has finished


def test_stalls_every_n_tokens() -> None:
    tl = timelines(plan(exact(stall_every_tokens=2, stall_s=1.0), [Arrival("a", 0.0, 8, 6)]))["a"]
    # token i at 1.0 + 0.25 * i + floor(i / 2) * 1.0
    assert tl.token_s == (1.0, 1.25, 2.5, 2.75, 4.0, 4.25)


def test_stall_pauses_every_stream_in_the_step() -> None:
    p = exact(stall_every_tokens=2, stall_s=1.0, prefill_tps=1024.0)
    tl = timelines(plan(p, [Arrival("a", 0.0, 256, 3), Arrival("b", 0.0, 256, 3)]))
    assert tl["a"].token_s == (0.25, 0.875, 2.25)
    assert tl["b"].token_s == (0.5, 0.875, 2.25)


def test_context_limit_rejects_at_admission() -> None:
    events = plan(exact(max_context_tokens=100), [Arrival("a", 0.5, 101, 4), Arrival("b", 0.5, 100, 1)])
    assert events[0] == Rejected("a", 0.5, 101, 100)
    assert Headers("b", 0.5) in events
    assert not [e for e in events if e.req_id == "a" and not isinstance(e, Rejected)]


def test_context_limit_in_serial_rejects_when_headers_would_go_out() -> None:
    events = plan(exact(serial=True, max_context_tokens=100), [Arrival("a", 0.0, 8, 2), Arrival("b", 0.1, 500, 2)])
    # a: first token at 1.0, one 2-stream step (b waits) of 0.375 s; b is looked at when a ends.
    assert Rejected("b", 1.375, 500, 100) in events
    assert not any(isinstance(e, Headers) and e.req_id == "b" for e in events)


def test_omlx_profile_limit_is_32768() -> None:
    events = plan(PROFILES["omlx"], [Arrival("a", 0.0, 32769, 4), Arrival("b", 0.0, 32768, 1)])
    assert events[0] == Rejected("a", 0.0, 32769, 32768)
    assert isinstance(events[1], Headers)


def test_cancel_frees_the_device() -> None:
    engine = Engine(exact(serial=True))
    engine.admit("a", 0.0, 8, 100)
    engine.admit("b", 0.0, 8, 2)
    got = engine.advance(1.5)
    assert Headers("a", 0.0) in got and not any(e.req_id == "b" for e in got)
    engine.cancel("a", 1.5)
    rest = engine.drain()
    tl = timelines(rest)
    assert tl["b"].headers_s == 1.75  # the step of a running at cancel time (1.375 .. 1.75) still ends
    assert not any(e.req_id == "a" for e in rest)
    assert engine.in_flight == 0


def test_advance_in_small_increments_equals_the_plan() -> None:
    arrivals = [Arrival("a", 0.0, 20, 10), Arrival("b", 0.1, 30, 7), Arrival("c", 0.4, 5, 3)]
    profile = exact(prefill_tps=100.0, stall_every_tokens=4, stall_s=0.5)
    expected = plan(profile, arrivals)
    engine = Engine(profile)
    got = []
    pending = list(arrivals)
    t = 0.0
    while pending or engine.next_event_time() is not None:
        while pending and pending[0].t_s <= t:
            a = pending.pop(0)
            got += engine.advance(a.t_s)
            engine.admit(a.req_id, a.t_s, a.prompt_tokens, a.n_tokens)
        got += engine.advance(t)
        t += 0.05
    assert got == expected


def test_engine_contract_errors() -> None:
    engine = Engine(exact())
    engine.admit("a", 1.0, 8, 1)
    with pytest.raises(ValueError):
        engine.advance(0.5)  # time went backwards
    with pytest.raises(ValueError):
        engine.admit("a", 1.0, 8, 1)  # same id in flight
    with pytest.raises(ValueError):
        engine.admit("b", 1.0, 8, 0)
    assert engine.next_event_time() == 1.0  # the headers are ready now
    assert engine.advance(1.0) == [Headers("a", 1.0)]
    assert engine.next_event_time() == 2.0


def test_engine_module_imports_no_io() -> None:
    code = (
        "import sys; import mlxproxy.sim.engine, mlxproxy.sim.render, mlxproxy.sim.request;"
        "bad = [m for m in ('asyncio', 'socket', 'httpx', 'starlette', 'uvicorn') if m in sys.modules];"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
