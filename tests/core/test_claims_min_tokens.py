"""`claims.audit` judges a prefill claim only from `speed_claim_min_tokens` prefilled tokens, as
it judges a decode claim only from that many streamed: a handful of tokens is mostly fixed cost."""

from __future__ import annotations

from mlxproxy.core.claims import audit
from support import ok_record

# llama.cpp-style timings claiming the whole prompt (50 tokens) prefilled in 5 ms, 10,000 tok/s,
# where only the uncached ones were: the Ollama trap, 10x off for 5 uncached tokens
CLAIMS = {"timings": {"prompt_n": 50, "prompt_ms": 5.0, "prompt_per_second": 10000.0}}


def _audit(uncached: int, min_tokens: int = 8) -> list[str]:
    r = ok_record(ttft_s=1.0, prompt_tokens=50, cached_tokens=50 - uncached, server_claims=CLAIMS)
    assert r.uncached_prompt_tokens == uncached
    return audit(r, 2.0, 0.05, min_tokens)


def test_a_prefill_claim_over_fewer_tokens_than_the_minimum_is_not_judged() -> None:
    assert _audit(5) == []  # 5 tokens < 8


def test_a_prefill_claim_over_enough_tokens_still_is() -> None:
    found = _audit(5, min_tokens=5)
    assert len(found) == 1 and found[0].startswith("claimed prefill 10000 tok/s")
