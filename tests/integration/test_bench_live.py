"""``mlxproxy bench`` against every live seed server in one run: each server's batching verdict is
the class observed over repeated runs (docs/VERIFIED.md, "Bench verdicts against the live
servers"), and no verdict contradicts its overlap figure. A server whose waves disagree
(``inconclusive``) is measured a second time, and then must be its class.

The servers serve the rigged model built so that bench's filler prompt gets the endless answer
(``bench_live.build_loop_model``): every stream runs to ``max_tokens``. A server that cannot run
here is left out with the reason, and the test skips only when none can.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .bench_live import SERVERS, TOGETHER, all_servers, build_loop_model, row, run_bench
from .tinymodel import mlx_unavailable_reason

pytestmark = pytest.mark.integration

_REASON = mlx_unavailable_reason()
if _REASON is not None:
    pytest.skip(f"mlx stack unavailable (the rigged model is built with it): {_REASON}", allow_module_level=True)

#: What each server did with two streams in every run of ``python -m tests.integration.bench_live``
#: (Linux CPU, 2 shared cores): vllm-mlx in simple mode answers the second stream with HTTP 200 then
#: an error event; mlx-openai-server 1.6.3 serves one request at a time (``--max-concurrency`` 1 by
#: default); the others generate the two streams together (overlap 0.99-1.00). Whether those also
#: gain ("continuous batching", >= 1.2x) or not ("batches, no gain"), or the gain is too close to
#: call, depended on the CPU the other work on the machine left (mlx-vlm: 0.98x in one run, 1.54x
#: and 1.77x in the next two), so the gain is not asserted; the overlap-decided class is.
OBSERVED: dict[str, str] = {
    "vllm-mlx": "rejects concurrent requests",
    "mlx-openai-server": "serial",
    "vllm-mlx-cb": TOGETHER,
    "rapid-mlx": TOGETHER,
    "mlx-vlm": TOGETHER,
    "mlx-lm": TOGETHER,
}


def test_bench_verdicts_against_every_live_server(tmp_path: Path) -> None:
    model = build_loop_model(tmp_path / "model")
    with all_servers(model, tmp_path) as (urls, missing):
        for name, why in missing.items():
            print(f"left out {name}: {why}")
        if not urls:
            pytest.skip("no live server could run: " + "; ".join(f"{n}: {w}" for n, w in missing.items()))
        # 400 tokens: at 300-900 tok/s a stream lasts about a second, long enough that the two of a
        # wave overlap on a server that batches (at 160, mlx_lm.server's waves were sometimes serial)
        _, doc = run_bench(urls, tmp_path / "bench.json", max_tokens=400, repeat=3)
        rows = {name: row(doc, name) for name in urls}
        # On a busy machine (a CPU hog beside the suite) a batching server's waves can disagree, one
        # admitted late: bench then says `inconclusive`, its honest answer, not a wrong class. Such
        # a server is measured once more, as a user would; a wrong class fails at once.
        again = {name: urls[name] for name, r in rows.items() if r["behaviour"] == "inconclusive"}
        if again:
            print(f"measured again (inconclusive): {', '.join(again)}")
            _, doc2 = run_bench(again, tmp_path / "bench2.json", max_tokens=400, repeat=3)
            rows.update({name: row(doc2, name) for name in again})
    assert set(urls) <= set(SERVERS)
    failures = []
    for name in urls:
        r = rows[name]
        print(f"{name}: {r['verdict']}")
        if r["behaviour"] != OBSERVED[name]:
            failures.append(f"{name}: {r['verdict']!r} is not {OBSERVED[name]}")
        if r["contradiction"]:
            failures.append(f"{name}: {r['verdict']!r} contradicts its overlap: {r['contradiction']}")
    assert not failures, "\n".join(failures)
