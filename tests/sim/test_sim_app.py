"""The simulator over real sockets: each profile's wire shape and timing signature, faults, small endpoints, CLI.

Servers run on port 0 (`ServerThread`) at high `speed`; timing assertions are ratios or
orderings with loose bounds, never absolute speeds.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from click.testing import CliRunner

from mlxproxy.edge.runner import ServerThread
from mlxproxy.sim.app import create_app
from mlxproxy.sim.cli import sim
from timing import latency_ok, rate_ok


@contextmanager
def served(profile: str = "healthy", *, speed: float = 50.0, **overrides: Any) -> Iterator[tuple[Any, httpx.Client]]:
    app = create_app(profile, speed=speed, **overrides)
    with ServerThread(app) as server, httpx.Client(base_url=server.url, timeout=30) as client:
        client.app = app  # type: ignore[attr-defined]
        yield server, client


@dataclass
class Stream:
    status: int
    headers: httpx.Headers
    t_headers: float
    blocks: list[tuple[float, bytes]] = field(default_factory=list)  # (arrival, raw SSE block)
    reads: list[tuple[float, bytes]] = field(default_factory=list)

    @property
    def body(self) -> bytes:
        return b"".join(data for _, data in self.reads)

    def events(self) -> list[tuple[float, dict]]:
        """Decoded `data:` JSON events (a malformed one, sent on purpose, is skipped)."""
        out = []
        for t, b in self.blocks:
            if b.startswith(b"data: {"):
                try:
                    out.append((t, json.loads(b[6:])))
                except ValueError:
                    continue
        return out

    def generated(self) -> list[tuple[float, dict]]:
        """Events carrying a token: non-empty content, reasoning or text."""
        out = []
        for t, ev in self.events():
            for choice in ev.get("choices") or []:
                delta = choice.get("delta") or {}
                if (
                    delta.get("content")
                    or delta.get("reasoning_content")
                    or delta.get("reasoning")
                    or choice.get("text")
                ):
                    out.append((t, ev))
        return out


def stream(
    client: httpx.Client,
    body: dict,
    path: str = "/v1/chat/completions",
    headers: dict | None = None,
    t0: float | None = None,
) -> Stream:
    """POST and read the body, stamping each read and each complete SSE block on arrival."""
    t0 = time.perf_counter() if t0 is None else t0
    with client.stream("POST", path, json=body, headers=headers or {}) as r:
        s = Stream(r.status_code, r.headers, time.perf_counter() - t0)
        pending = b""
        for data in r.iter_raw():
            now = time.perf_counter() - t0
            s.reads.append((now, data))
            pending += data
            while b"\n\n" in pending:
                block, pending = pending.split(b"\n\n", 1)
                s.blocks.append((now, block))
    return s


def chat(content: str = "hello there", **extra: Any) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": content}], "stream": True, **extra}


USAGE = {"stream_options": {"include_usage": True}}


# -- each profile's wire shape --------------------------------------------------------------


@pytest.mark.parametrize(
    "profile, role_only_first, reasoning_field, usage_without_asking, done",
    [
        ("healthy", True, None, False, True),
        ("mlx-lm", False, "reasoning", False, True),
        ("mlx-openai-server", True, "reasoning_content", True, True),
        ("mlx-omni-server", False, None, False, True),
        ("vllm-mlx", True, "reasoning_content", True, True),
        ("rapid-mlx", True, "reasoning_content", False, True),
        ("omlx", True, "reasoning_content", False, True),
        ("mlx-vlm", False, "reasoning", False, True),
        ("phantom-usage", True, None, False, True),
    ],
)
def test_each_profile_streams_its_wire_shape(
    profile, role_only_first, reasoning_field, usage_without_asking, done
) -> None:
    with served(profile) as (_, client):
        s = stream(client, chat(max_tokens=12))
        assert s.status == 200 and s.headers["content-type"].startswith("text/event-stream")
        events = s.events()
        first_delta = events[0][1]["choices"][0]["delta"]
        assert (first_delta.get("content") in (None, "") and "reasoning" not in str(first_delta)) == role_only_first
        gen = s.generated()
        assert len(gen) == 12  # one event per token on every per-token server
        if reasoning_field:
            assert any(reasoning_field in ev["choices"][0]["delta"] for _, ev in gen)
        has_usage = any(ev.get("usage") for _, ev in events)
        assert has_usage == usage_without_asking
        assert s.body.endswith(b"data: [DONE]\n\n") == done
        with_usage = stream(client, chat(max_tokens=12, **USAGE))
        usage = [ev["usage"] for _, ev in with_usage.events() if ev.get("usage")][-1]
        multiplier = 4 if profile == "phantom-usage" else 1
        assert usage["completion_tokens"] == 12 * multiplier
        assert usage["prompt_tokens"] == 3  # "hello there": 11 characters / 4, rounded up


def test_mlx_vlm_sends_both_reasoning_fields_and_timings() -> None:
    with served("mlx-vlm") as (_, client):
        s = stream(client, chat(max_tokens=8))
        first = s.generated()[0][1]
        delta = first["choices"][0]["delta"]
        assert delta["reasoning"] == delta["reasoning_content"] and delta["tool_calls"] is None
        assert "timings" in first and first["usage"] is None


def test_mlx_lm_prefill_progress_comments_come_before_tokens() -> None:
    with served("mlx-lm") as (_, client):
        s = stream(client, chat(**USAGE), headers={"X-Sim-Prompt-Tokens": "5000"})
        comments = [b for _, b in s.blocks if b.startswith(b":")]
        assert comments == [b": keepalive 2048/5000", b": keepalive 4096/5000", b": keepalive 5000/5000"]
        usage = s.events()[-1][1]
        assert (
            usage["object"] == "chat.completion" and usage["choices"] == [] and usage["usage"]["prompt_tokens"] == 5000
        )


def test_omlx_keepalive_first_and_context_400() -> None:
    with served("omlx") as (_, client):
        s = stream(client, chat(max_tokens=4))
        assert s.reads[0][1].startswith(b": keep-alive\n\n")
        r = client.post("/v1/chat/completions", json=chat(), headers={"X-Sim-Prompt-Tokens": "40000"})
        assert r.status_code == 400
        assert r.content == (
            b'{"error":{"message":"Prompt too long: 40000 tokens exceeds max context window of 32768 '
            b'tokens","type":"invalid_request_error","param":null,"code":null}}'
        )
        big = client.post("/v1/chat/completions", json=chat("y" * (4 * 32769)))
        assert big.status_code == 400 and "32769 tokens" in big.json()["error"]["message"]
        assert client.post("/v1/chat/completions", json=chat("y" * (4 * 32768), max_tokens=1)).status_code == 200


def test_vllm_heartbeat_during_a_long_prefill() -> None:
    with served("vllm-mlx", speed=20, keepalive_idle_s=0.5) as (_, client):
        s = stream(client, chat(max_tokens=2), headers={"X-Sim-Prompt-Tokens": "4500"})  # 2.25 s prefill
        before_first_token = []
        for _, block in s.blocks:
            if block.startswith(b"data: {") and (b'"reasoning_content"' in block or b'"content"' in block):
                break
            before_first_token.append(block)
        assert before_first_token.count(b": heartbeat") >= 3


# -- timing signatures ----------------------------------------------------------------------


def test_healthy_ttft_and_decode_rate_match_the_truth() -> None:
    speed = 2.0
    with served("healthy", speed=speed) as (_, client):
        stream(client, chat(max_tokens=2))  # warm the connection
        t0 = time.perf_counter()
        s = stream(client, chat("z" * 8000, max_tokens=64), t0=t0)  # 2000 prompt tokens: 0.5 s of wall time
        gen = s.generated()
        ttft_sim = gen[0][0] * speed
        decode_tps_sim = (len(gen) - 1) / (gen[-1][0] - gen[0][0]) / speed
        assert latency_ok(ttft_sim, 2000 / 2000), ttft_sim
        assert rate_ok(decode_tps_sim, 50.0), decode_tps_sim


def parallel(client: httpx.Client, bodies: list[dict]) -> list[Stream]:
    results: list[Stream | None] = [None] * len(bodies)
    t0 = time.perf_counter()

    def run(i: int) -> None:
        results[i] = stream(client, bodies[i], t0=t0)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results  # type: ignore[return-value]


def speedup(profile: str, n_tokens: int = 100, **knobs: Any) -> tuple[float, list[Stream]]:
    # speed 2: a request lasts about a second, so thread start-up jitter on a busy machine
    # cannot make two parallel requests look serial
    with served(profile, speed=2, **knobs) as (_, client):
        stream(client, chat(max_tokens=2))
        alone = stream(client, chat(max_tokens=n_tokens))
        alone_wall = alone.generated()[-1][0]
        pair = parallel(client, [chat(max_tokens=n_tokens), chat(max_tokens=n_tokens)])
        pair_wall = max(s.generated()[-1][0] for s in pair)
        return (2 * n_tokens / pair_wall) / (n_tokens / alone_wall), pair


def test_continuous_batching_vs_serial() -> None:
    batched, pair = speedup("healthy", batch_penalty=0.02)
    assert batched > 1.6
    a, b = pair
    # both answered at once: headers within the first fifth of the stream (not after the other)
    assert max(a.t_headers, b.t_headers) < 0.2 * min(a.generated()[-1][0], b.generated()[-1][0])
    serial, pair = speedup("mlx-omni-server")
    assert serial < 1.0
    first, second = sorted(pair, key=lambda s: s.t_headers)
    # the second request's headers wait until the first stream has ended (the engine's truth:
    # its headers_s equals the first one's finish_s; on the wire: no headers while the first decodes)
    assert second.t_headers > 0.8 * first.generated()[-1][0]
    assert second.generated()[0][0] > 0.9 * first.generated()[-1][0]


def test_burst_at_end_ttft_equals_total_time() -> None:
    with served("rapid-mlx", speed=20, burst_at_end=True) as (_, client):
        s = stream(client, chat(max_tokens=64))
        gen = s.generated()
        assert s.events()[0][0] < 0.5 * gen[0][0]  # the role chunk comes at once
        assert gen[0][0] >= 0.95 * gen[-1][0]


def test_mlx_vlm_stalls_periodically() -> None:
    with served("mlx-vlm", speed=10, stall_every_tokens=8, stall_s=1.0) as (_, client):
        gen = stream(client, chat(max_tokens=25)).generated()
        gaps = [b[0] - a[0] for a, b in zip(gen, gen[1:])]
        long = [i + 1 for i, g in enumerate(gaps) if g > 0.05]  # 1 s / 10 = 100 ms stalls vs 2 ms steps
        assert long == [8, 16, 24]


def test_a_starved_simulator_pauses_its_clock_instead_of_bursting() -> None:
    with served("healthy", speed=10) as (server, client):
        arrivals: list[float] = []
        with client.stream("POST", "/v1/chat/completions", json=chat(max_tokens=80)) as r:
            pending = b""
            for data in r.iter_raw():
                pending += data
                while b"\n\n" in pending:
                    block, pending = pending.split(b"\n\n", 1)
                    if b'"content":"' in block and b'"content":""' not in block:
                        arrivals.append(time.perf_counter())
                        if len(arrivals) == 10:  # block the simulator's event loop for 150 ms
                            server.loop.call_soon_threadsafe(time.sleep, 0.15)
        gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
        assert len(arrivals) == 80 and max(gaps) >= 0.12
        resumed = gaps.index(max(gaps)) + 1
        # the 70 tokens after the pause keep their 2 ms cadence (~140 ms) instead of arriving at once
        assert arrivals[-1] - arrivals[resumed] >= 0.07
        assert client.get("/sim/requests").json()["clock_paused_s"] >= 0.1


# -- faults ---------------------------------------------------------------------------------


def test_fault_reset_mid_stream() -> None:
    with served() as (_, client):
        got = []
        with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
            with client.stream(
                "POST", "/v1/chat/completions", json=chat(max_tokens=10), headers={"X-Sim-Fault": "reset-mid-stream@4"}
            ) as r:
                for data in r.iter_raw():
                    got.append(data)
        assert b"".join(got).count(b'"content":"') >= 1  # some tokens got through first
        assert client.get("/health").status_code == 200  # the server lives on


def test_fault_reset_before_headers() -> None:
    with served() as (_, client):
        with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
            client.post("/v1/chat/completions", json=chat(), headers={"X-Sim-Fault": "reset-before-headers"})


def test_fault_malformed_stall_http_error_and_stream_error() -> None:
    with served(speed=100) as (_, client):
        s = stream(client, chat(max_tokens=6), headers={"X-Sim-Fault": "malformed@2, stall=0.5@4"})
        assert b"\xff\xfe" in s.body and s.body.endswith(b"[DONE]\n\n")
        gen = s.generated()
        assert gen[4][0] - gen[3][0] >= 0.4 and gen[5][0] - gen[4][0] < 0.3  # later tokens shift, no burst
        r = client.post("/v1/chat/completions", json=chat(), headers={"X-Sim-Fault": "http-error=503"})
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
        bad = client.post("/v1/chat/completions", json=chat(), headers={"X-Sim-Fault": "explode"})
        assert bad.status_code == 400 and "unknown fault" in bad.json()["error"]["message"]
    with served("omlx") as (_, client):
        s = stream(client, chat(max_tokens=6), headers={"X-Sim-Fault": "stream-error@3"})
        assert s.events()[-1][1] == {"error": {"message": "Simulated stream error", "type": "server_error"}}
        assert s.body.endswith(b"data: [DONE]\n\n")


def test_fault_from_the_profile_knob() -> None:
    with served("mlx-vlm", faults="http-error=500") as (_, client):
        r = client.post("/v1/chat/completions", json=chat())
        assert r.status_code == 500 and "detail" in r.json()


# -- non-stream, small endpoints, errors ----------------------------------------------------


def test_nonstream_bodies_and_determinism() -> None:
    with served() as (_, client):
        body = {**chat("same prompt", max_tokens=5), "stream": False}
        a, b = client.post("/v1/chat/completions", json=body), client.post("/v1/chat/completions", json=body)
        assert (
            a.status_code == 200
            and a.json()["choices"][0]["message"]["content"] == b.json()["choices"][0]["message"]["content"]
        )
        assert a.json()["usage"]["completion_tokens"] == 5 and a.json()["choices"][0]["finish_reason"] == "length"
        c = client.post("/v1/completions", json={"model": "m", "prompt": "abc", "max_tokens": 3})
        assert c.json()["object"] == "text_completion" and c.json()["usage"]["completion_tokens"] == 3
        s = stream(client, {"model": "m", "prompt": "abc", "max_tokens": 3, "stream": True}, path="/v1/completions")
        assert "".join(ev["choices"][0]["text"] for _, ev in s.events()) == c.json()["choices"][0]["text"]
    with served("omlx") as (_, client):
        r = client.post("/v1/chat/completions", json={**chat(max_tokens=3), "stream": False})
        assert r.content.startswith(b" {") and r.json()["usage"]["completion_tokens"] == 3


def test_models_health_and_truth_endpoints() -> None:
    with served("omlx", decode_tps=40) as (_, client):
        models = client.get("/v1/models").json()
        assert models["data"][0]["capabilities"]["max_tokens"] == 32768
        assert client.get("/health").json() == {"status": "ok"}
        truth = client.get("/sim/profile").json()
        assert truth["name"] == "omlx" and truth["decode_tps"] == 40.0 and truth["speed"] == 50.0
        stream(client, chat(max_tokens=4))
        record = client.get("/sim/requests").json()["requests"][-1]
        assert record["outcome"] == "ok" and record["n_tokens"] == 4 and record["prompt_tokens"] == 3
        assert record["first_token_s"] - record["admitted_s"] == pytest.approx(3 / 2000)
        assert client.get("/nope").status_code == 404


def test_unsupported_routes_and_validation_in_the_server_style() -> None:
    with served("mlx-openai-server") as (_, client):
        r = client.post("/v1/completions", json={"model": "m", "prompt": "x"})
        assert r.status_code == 404 and r.json() == {"detail": "Not Found"}
    with served("mlx-omni-server") as (_, client):
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "model"]
    with served("mlx-lm") as (_, client):
        r = client.post("/v1/chat/completions", content=b"{not json")
        assert r.status_code == 400 and r.json()["error"].startswith("Invalid JSON in request body")
        assert client.get("/v2/whatever").content == b"Not Found"


def test_client_disconnect_frees_the_engine() -> None:
    with served("mlx-omni-server", speed=5) as (_, client):
        with client.stream("POST", "/v1/chat/completions", json=chat(max_tokens=500)) as r:
            for _ in r.iter_raw():
                break
        app = client.app  # type: ignore[attr-defined]
        deadline = time.monotonic() + 5
        while app.engine.in_flight and time.monotonic() < deadline:
            time.sleep(0.01)  # readiness poll, not a measurement
        assert app.engine.in_flight == 0
        r = client.post("/v1/chat/completions", json={**chat(max_tokens=2), "stream": False})
        assert r.status_code == 200  # the serial server is free again


# -- CLI ------------------------------------------------------------------------------------


def test_cli_help_dry_run_and_bad_values() -> None:
    runner = CliRunner()
    help_text = runner.invoke(sim, ["--help"])
    assert help_text.exit_code == 0 and "--decode-tps" in help_text.output and "--profile" in help_text.output
    dry = runner.invoke(sim, ["--profile", "mlx-omni-server", "--decode-tps", "30", "--max-batch", "0", "--dry-run"])
    assert dry.exit_code == 0
    knobs = json.loads(dry.output.splitlines()[0])["sim_profile"]
    assert knobs["name"] == "mlx-omni-server" and knobs["decode_tps"] == 30.0 and knobs["serial"] is True
    assert "truth: TTFT" in dry.output
    for bad in (
        ["--speed", "0"],
        ["--profile", "nope"],
        ["--set", "bogus=1"],
        ["--set", "decode_tps=fast"],
        ["--set", "reasoning_share=2"],
    ):
        result = runner.invoke(sim, [*bad, "--dry-run"])
        assert result.exit_code == 2, (bad, result.output)
