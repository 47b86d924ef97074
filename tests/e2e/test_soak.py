"""Load and soak: thousands of requests through a real `mlxproxy serve` process at
concurrency 64 against a simulated server (`mlxproxy sim`), with random upstream and client
faults mixed in. Afterwards: the proxy is alive, every request is counted once in
`mlxproxy_requests_total` under the outcome its fault implies, and resident memory, file
descriptors and event-loop tasks are back where they were after the warm-up.

The default run sends 1,500 requests (well under a minute on 2 cores); the full 20,000 is
`@pytest.mark.slow`. Everything listens on 127.0.0.1, port 0. Linux only (reads /proc).
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from support import start

pytestmark = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads RSS and fds from /proc (Linux)")

CONCURRENCY = 64
CHAT = {
    "model": "m",
    "stream": True,
    "max_tokens": 6,
    "messages": [{"role": "user", "content": "hello there"}],
    "stream_options": {"include_usage": True},
}

SOAK_SYSTEM = "You are a coding agent working in a large repository. " * 40  # ~2 kB

# kind: (weight, X-Sim-Fault, outcome the proxy must record)
MIX: dict[str, tuple[int, str | None, str]] = {
    "ok": (60, None, "ok"),
    "usage-injected": (8, None, "ok"),
    "non-stream": (6, None, "ok"),
    "http-500": (3, "http-error=500", "http_error"),
    "http-429": (2, "http-error=429", "http_error"),
    "reset-before-headers": (3, "reset-before-headers", "upstream_unreachable"),
    "reset-mid-stream": (3, "reset-mid-stream@2", "truncated"),
    "malformed": (3, "malformed@2", "protocol_error"),
    "stream-error": (3, "stream-error@2", "stream_error"),
    # 3 s against the proxy's read_s of 1 s: a margin a loaded machine's loop lag cannot close. With
    # 1.5 s, the warm-up once reported a problem with a CPU hog and two test suites on the 2 cores
    # (the message was not kept); a stall ending before the read timeout fired is the timing-bound
    # check that a lagging loop can break, so its margin is widened.
    "stall-past-read-timeout": (1, "stall=3@2", "upstream_timeout"),
    "client-leaves": (3, "stall=2@2", "client_disconnect"),
    "bad-json": (2, None, "http_error"),
    "unknown-path": (2, None, "http_error"),
}
BROKEN_BODY = {"reset-mid-stream", "stall-past-read-timeout"}  # the client must see these bodies break


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def one(client: httpx.AsyncClient, kind: str) -> str | None:
    """Send one request of `kind`; return a problem seen by the client, or None."""
    fault = MIX[kind][1]
    headers = {"x-sim-fault": fault} if fault else {}
    if kind == "unknown-path":
        r = await client.get("/v1/no-such-route")
        return None if r.status_code == 404 else f"{kind}: status {r.status_code}"
    if kind == "bad-json":
        r = await client.post(
            "/v1/chat/completions",
            content=b'{"model": "m", "stream": tru',
            headers={"content-type": "application/json"},
        )
        return None if r.status_code == 400 else f"{kind}: status {r.status_code}"
    body = dict(CHAT)
    # every request starts a new conversation with an agent-sized system prompt: the prompt-prefix
    # index (256 conversations per upstream) fills during the warm-up and must stay bounded after it
    body["messages"] = [
        {"role": "system", "content": SOAK_SYSTEM},
        {"role": "user", "content": f"hello there {random.getrandbits(48):x}"},
    ]
    if kind == "usage-injected":
        del body["stream_options"]
    if kind == "non-stream":
        body = {**body, "stream": False}
        del body["stream_options"]
    async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
        if kind == "client-leaves":
            async for _ in r.aiter_raw():
                break  # the first bytes, then the client goes away mid-stream
            return None
        try:
            data = b"".join([part async for part in r.aiter_raw()])
        except httpx.HTTPError:
            return None if kind in BROKEN_BODY else f"{kind}: body broke"
        if kind in BROKEN_BODY:
            return f"{kind}: body ended cleanly"
        expected = {"http-500": 500, "http-429": 429, "reset-before-headers": 502}.get(kind, 200)
        if r.status_code != expected:
            return f"{kind}: status {r.status_code}"
        if expected == 200 and kind not in ("non-stream", "stream-error") and not data.endswith(b"data: [DONE]\n\n"):
            return f"{kind}: no [DONE]"
        if kind == "usage-injected" and b'"choices":[]' in data:
            return f"{kind}: the injected usage event reached the client"
        return None


async def drive(url: str, kinds: list[str]) -> list[str]:
    sem = asyncio.Semaphore(CONCURRENCY)
    limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)
    async with httpx.AsyncClient(base_url=url, timeout=30, limits=limits, trust_env=False) as client:

        async def guarded(kind: str) -> str | None:
            async with sem:
                try:
                    return await one(client, kind)
                except httpx.HTTPError as exc:
                    return f"{kind}: {type(exc).__name__}: {exc}"

        results = await asyncio.gather(*(guarded(k) for k in kinds))
    return [r for r in results if r is not None]


def plan(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    names = list(MIX)
    return rng.choices(names, weights=[MIX[k][0] for k in names], k=n)


def outcomes(url: str) -> Counter[str]:
    text = httpx.get(url + "/metrics").text
    counts: Counter[str] = Counter()
    for fam in text_string_to_metric_families(text):
        if fam.name == "mlxproxy_requests":
            for s in fam.samples:
                if s.name == "mlxproxy_requests_total":
                    counts[s.labels["outcome"]] += int(s.value)
    return counts


def settle(url: str, timeout_s: float = 30) -> dict:
    """/healthz once nothing is in flight (polled; the last faulted streams end on their own)."""
    deadline = time.monotonic() + timeout_s
    while True:
        h = httpx.get(url + "/healthz").json()
        if h["in_flight"] == 0 or time.monotonic() > deadline:
            return h
        time.sleep(0.05)


def soak(tmp_path: Path, warmup: int, n: int) -> dict:
    config = tmp_path / "proxy.yaml"
    sim = start(["sim", "--profile", "healthy", "--port", "0", "--speed", "200", "--seed", "1"], "listening on")
    try:
        config.write_text(
            f"port: 0\nlog_requests: false\ntimeouts:\n  read_s: 1.0\nupstreams:\n  - name: sim\n    url: {sim.url}\n"
        )
        proxy = start(["serve", "--config", str(config), "--log-level", "warning"], "listening on")
        try:
            pid = proxy.proc.pid
            fds_idle = open_fds(pid)  # before any connection
            warm_kinds, kinds = plan(warmup, 1), plan(n, 2)
            warm_problems = asyncio.run(drive(proxy.url, warm_kinds))
            assert not warm_problems, warm_problems[:10]
            before = settle(proxy.url)
            rss0, fds0, tasks0 = rss_kib(pid), open_fds(pid), before["tasks"]
            t0 = time.monotonic()
            problems = asyncio.run(drive(proxy.url, kinds))
            duration = time.monotonic() - t0
            after = settle(proxy.url)
            rss1, fds1, tasks1 = rss_kib(pid), open_fds(pid), after["tasks"]
            counted = outcomes(proxy.url)
            alive = proxy.proc.poll() is None
        finally:
            proxy.stop()
    finally:
        sim.stop()
    expected = Counter(MIX[k][2] for k in warm_kinds + kinds)
    figures = {
        "requests": n,
        "warmup": warmup,
        "duration_s": round(duration, 1),
        "rps": round(n / duration),
        "outcomes": dict(sorted(counted.items())),
        "rss_kib": (rss0, rss1),
        "rss_growth": round(rss1 / rss0 - 1, 4),
        "fds": (fds_idle, fds0, fds1),
        "tasks": (tasks0, tasks1),
        "in_flight_after": after["in_flight"],
    }
    print("\nsoak:", figures)
    assert alive, "the proxy process died:\n" + "".join(proxy.lines[-30:])
    assert problems == [], problems[:10]
    assert after["requests"] == warmup + n and after["in_flight"] == 0
    assert counted == expected, (counted, expected)  # every request counted once, under the outcome its fault implies
    assert rss1 < rss0 * 1.10, f"RSS grew {figures['rss_growth']:.1%}: {rss0} -> {rss1} KiB"
    # beyond those of an idle proxy: at most the keep-alive connections to the upstream
    # that the client's concurrency needed (a leak of one per faulted request would be hundreds)
    assert fds1 <= fds_idle + CONCURRENCY + 4, f"file descriptors {fds_idle} idle, {fds0} after warm-up, {fds1} after"
    assert tasks1 <= tasks0, f"event-loop tasks {tasks0} -> {tasks1}"
    assert not [line for line in proxy.lines if "Traceback" in line or "ERROR" in line], "".join(proxy.lines[-30:])
    return figures


def test_soak_1500_requests_with_faults(tmp_path: Path) -> None:
    soak(tmp_path, warmup=300, n=1200)


@pytest.mark.slow
def test_soak_20000_requests_with_faults(tmp_path: Path) -> None:
    soak(tmp_path, warmup=1000, n=20_000)
