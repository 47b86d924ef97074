"""The cache doctor against a real ``mlx_lm.server`` (issue 28, "Done when").

The same 5-turn agent conversation twice through ``mlxproxy serve``: once with a per-request
header line at the front of the system prompt (Claude Code's ``cch=`` attribution shape),
once without. With it every later turn names ``volatile_span`` (line 1, its shape) and the
prefill seconds it lost; without it no turn has an anomaly. The seconds lost add up to the
measured TTFT differences between the two runs within 20%, judged on a measurement whose four
differences (the same prefill) agree within 1.5x; one the machine's load spread wider is held to
its per-turn range and the pair measured again (at most three times). ``prefix_min_tokens`` is lowered
to 200, so a prompt of ~800 tokens (fast on CPU) is judged.

Skipped, with the reason, where the mlx stack does not import.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from .peers import mlxproxy_serve, require_mlx
from .test_prefix_mlx_lm import _turn

pytestmark = pytest.mark.integration

require_mlx()

TURNS = 5


def _system(volatile: bool, turn: int, nonce: str) -> str:
    rules = "\n".join(f"Rule {i}: item{i} fox jumps over the lazy dog." for i in range(60))
    body = f"You are a coding agent [{nonce}].\n{rules}"  # the nonce keeps other runs out of the cache
    if not volatile:
        return body
    value = f"{turn}{uuid.uuid4().hex[:3]}f"  # 5 hex digits, a new value every request
    return f"x-anthropic-billing-header: cc_version=2.1.37; cch={value};\n{body}"


def _conversation(proxy: Any, volatile: bool) -> list[Any]:
    nonce = uuid.uuid4().hex
    msgs: list[dict[str, str]] = [{"role": "user", "content": "List three colours."}]
    out = []
    for turn in range(1, TURNS + 1):
        rec, answer = _turn(proxy, [{"role": "system", "content": _system(volatile, turn, nonce)}, *msgs])
        out.append(rec)
        msgs += [{"role": "assistant", "content": answer}, {"role": "user", "content": f"Step {turn}: three more."}]
    return out


#: how far apart the measured TTFT differences of turns 2-5 (the same ~1,750-token prefill each) may
#: lie before the measurement itself is taken as noise: on a loaded 2-core machine one run measured
#: 0.30, 0.48, 0.64 and 0.44 s for them (the proxy: 0.31-0.33 s, turn 1's cold rate), the next 0.34-0.38 s
CONSISTENT = 1.5
ATTEMPTS = 3


def _both(mlx_server: str) -> tuple[list[Any], list[Any]]:
    with mlxproxy_serve(mlx_server, {"detectors": {"prefix_min_tokens": 200}}) as proxy:
        return _conversation(proxy, volatile=False), _conversation(proxy, volatile=True)


def test_a_volatile_header_line_names_every_turn_and_its_cost(mlx_server: str, record_property: Any) -> None:
    for attempt in range(1, ATTEMPTS + 1):
        clean, volatile = _both(mlx_server)
        rows = [
            (
                r.turn,
                r.prompt_tokens,
                r.cached_tokens,
                r.ttft_s,
                r.reprefill_cause,
                r.reprefill_lost_s,
                list(r.anomalies),
            )
            for r in clean + volatile
        ]
        record_property(f"turns_{attempt}", rows)
        print(f"\nattempt {attempt} (turn, prompt, cached, TTFT, cause, lost s, anomalies):", *rows, sep="\n  ")
        assert clean[0].prompt_tokens > 600 and [r.turn for r in clean] == [r.turn for r in volatile] == [1, 2, 3, 4, 5]
        assert len({r.conversation_id for r in clean}) == len({r.conversation_id for r in volatile}) == 1
        # without the line: every turn reuses the cache, no anomaly, no cause
        assert all(r.anomalies == () and r.reprefill_cause is None for r in clean), [r.anomaly_evidence for r in clean]
        # with it: every later turn names the span, where it is and its shape
        for r in volatile[1:]:
            assert r.reprefill_cause == "volatile_span", (r.turn, r.reprefill_at, r.anomaly_evidence)
            assert r.reprefill_at == "messages[0].content line 1: a-a-a-a: a_a=9.9.99; a=<hex:5>;"
            assert r.reprefill_lost_s is not None and r.reprefill_lost_s > 0
        diffs = [v.ttft_s - c.ttft_s for v, c in zip(volatile[1:], clean[1:])]
        lost = sum(r.reprefill_lost_s for r in volatile[1:])
        measured = sum(diffs)
        record_property(f"lost_vs_measured_{attempt}", (lost, measured))
        print(
            f"seconds lost {lost:.3f}, measured TTFT difference {measured:.3f} (per turn {[round(d, 3) for d in diffs]})"
        )
        assert volatile[-1].conversation_lost_s == pytest.approx(lost)
        assert min(diffs) > 0
        if max(diffs) <= CONSISTENT * min(diffs):
            break  # the same prefill measured alike on every turn: a measurement to judge by
        # the machine's load moved the same prefill's time from turn to turn: the proxy's figure is
        # held to what was measured at least (no turn's lost seconds outside the measured range),
        # and the sum is judged on a measurement taken again
        for r in volatile[1:]:
            assert 0.8 * min(diffs) <= r.reprefill_lost_s <= 1.2 * max(diffs), (r.turn, r.reprefill_lost_s, diffs)
    else:
        return  # every attempt noisy: each held to its measured range above
    # the seconds lost add up to the measured TTFT differences (turns 2-5) within 20%
    assert abs(lost - measured) <= 0.2 * measured
