"""Claude Code and Codex, the real CLIs from npm, through ``mlxproxy serve`` to a live vllm-mlx.

* Claude Code (``@anthropic-ai/claude-code``) in print mode (``claude -p``) with
  ``ANTHROPIC_BASE_URL`` at the proxy: it sends Anthropic Messages (``/v1/messages``).
* Codex (``@openai/codex``) with ``codex exec`` and a custom provider whose ``wire_api`` is
  ``"responses"``: it sends OpenAI Responses (``/v1/responses``).

vllm-mlx 0.6.0 serves both APIs. Both CLIs always offer their own tools (none is the rig's
``write_file``) and send long prompts, so the rigged model is fixed to one answer whatever it is
asked (``rigged.answer_always``): ``<think>...</think>`` then "It is sunny today.", which each
CLI must print, and which the proxy must meter with no anomaly. A tap in front of the proxy keeps
each CLI's request bytes exactly as sent; ``MLXPROXY_RECORD_CLIENTS=DIR`` stores them there
(``tests/fixtures/clients/`` holds the recorded ones).

The CLIs are looked for where ``.ci/install-clients`` puts them (``.ci-tools/npm/bin``), then
``$MLXPROXY_CLAUDE`` / ``$MLXPROXY_CODEX``, then PATH; a missing one skips with the places
searched. Each runs with a temporary HOME and its telemetry, update checks and other network
traffic turned off; a CLI that sends nothing to the proxy (a login it insists on, a download
it needs) skips with its own words.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from mlxproxy.core.record import Record

from .live_servers import LiveServer, RiggedVllm
from .peers import CODEX_CONFIG, ProxyProcess, loopback_env, mlxproxy_serve, require_client, require_mlx
from .rigged import REASONING_ANSWER
from .tap import Tap, tap

pytestmark = pytest.mark.integration

require_mlx("the rigged model is built with it")

SERVER = "vllm-mlx"  # serves /v1/messages and /v1/responses
CLIENT_TIMEOUT_S = 180
ANSWER = REASONING_ANSWER.strip()
INSTALL_HINT = "CI installs it with .ci/install-clients when Node.js/npm are available (into .ci-tools/npm)"


@dataclasses.dataclass
class Stack:
    server: LiveServer
    proxy: ProxyProcess


@pytest.fixture(scope="module")
def stack(rigged_vllm: RiggedVllm) -> Iterator[Stack]:
    """The session's rigged vllm-mlx (conftest) with this module's proxy in front."""
    server = rigged_vllm.server
    with mlxproxy_serve(server.url, {"tokenizer": str(rigged_vllm.model_dir / "tokenizer.json")}, capture=True) as px:
        yield Stack(server, px)


def _run(cmd: list[str], *, cwd: Path, env: dict[str, str], name: str) -> subprocess.CompletedProcess[str]:
    t0 = time.monotonic()
    try:
        res = subprocess.run(
            cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=CLIENT_TIMEOUT_S
        )
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(
            f"{name} did not finish within {CLIENT_TIMEOUT_S} s:\n{exc.stdout!r}\n{exc.stderr!r}"
        ) from None
    print(f"\n{name} finished in {time.monotonic() - t0:.1f} s with exit code {res.returncode}")
    return res


def _new_records(px: ProxyProcess, before: set[str], at_least: int = 1) -> list[Record]:
    """The records this test's client made (the module's proxy is shared)."""
    try:
        caps = px.captured(at_least=len(before) + at_least, timeout_s=10.0)
    except AssertionError:
        caps = px.captured(at_least=0)
    return [r for r in caps if r.id not in before]


def _skip_if_nothing_reached(name: str, records: list[Record], res: subprocess.CompletedProcess[str]) -> None:
    if not records:
        out = (res.stdout + res.stderr).strip()
        pytest.skip(f"{name} sent nothing to the proxy (exit code {res.returncode}): {out[-800:]}")


def _store(t: Tap, prefix: str, tmp_path: Path) -> list[bytes]:
    """The tapped requests; stored as ``prefix-N.req`` under ``$MLXPROXY_RECORD_CLIENTS`` when set,
    with the test's temporary folder written as ``/tmp/t`` (and Content-Length to match)."""
    reqs = t.requests()
    out_dir = os.environ.get("MLXPROXY_RECORD_CLIENTS")
    if out_dir:
        for i, raw in enumerate(reqs, 1):
            head, sep, body = raw.partition(b"\r\n\r\n")
            # the folder as a path, and as Claude Code's project slug (every / and _ a -)
            for old, new in ((str(tmp_path), "/tmp/t"), (re.sub(r"[/_.]", "-", str(tmp_path)), "-tmp-t")):
                body = body.replace(old.encode(), new.encode())
            head = re.sub(rb"(?im)^(content-length:\s*)\d+", rb"\g<1>" + str(len(body)).encode(), head)
            (Path(out_dir) / f"{prefix}-{i}.req").write_bytes(head + sep + body)
    return reqs


def _print(name: str, records: list[Record]) -> None:
    for r in records:
        print(
            f"{name}: {r.method} {r.path} {r.outcome} stream={r.stream} ttft={r.ttft_s and round(r.ttft_s, 3)}s "
            f"prompt={r.prompt_tokens} tokens={r.completion_tokens_reported} finish={r.finish_reason} "
            f"anomalies={list(r.anomalies)}"
        )


def _check_generation(r: Record, endpoint: str, finish: str) -> None:
    """A rigged answer metered right: thinking then text, the server's counts, no anomaly."""
    assert (r.outcome, r.status, r.endpoint, r.finish_reason) == ("ok", 200, endpoint, finish), r
    assert r.anomalies == (), r.anomaly_evidence
    assert r.completion_tokens_reported in (17, 18) and r.completion_tokens == r.completion_tokens_reported, r
    if r.stream:
        assert r.reasoning_tokens_counted and r.ttft_s is not None and r.ttfc_s is not None and r.ttfc_s > r.ttft_s, r


def test_claude_code_print_mode_through_proxy(stack: Stack, tmp_path: Path) -> None:
    claude = require_client("claude", INSTALL_HINT)
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    model = stack.server.model
    env = loopback_env(
        HOME=str(home),
        ANTHROPIC_BASE_URL=stack.proxy.url,
        ANTHROPIC_API_KEY="dummy",
        ANTHROPIC_DEFAULT_HAIKU_MODEL=model,  # any side request goes to the same served model
        ANTHROPIC_DEFAULT_SONNET_MODEL=model,
        ANTHROPIC_DEFAULT_OPUS_MODEL=model,
        DISABLE_TELEMETRY="1",
        DISABLE_AUTOUPDATER="1",
        DISABLE_ERROR_REPORTING="1",
        CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
    )
    before = {r.id for r in stack.proxy.captured(at_least=0)}
    with tap(int(stack.proxy.url.rsplit(":", 1)[1])) as t:
        env["ANTHROPIC_BASE_URL"] = t.url
        res = _run([claude, "-p", "say hi", "--model", model, "--max-turns", "1"], cwd=work, env=env, name="claude")
        records = _new_records(stack.proxy, before)
        _skip_if_nothing_reached("claude", records, res)
        raw = _store(t, "claude_code_2.1.332_messages", tmp_path)
    _print("claude", records)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    assert ANSWER in res.stdout, out
    gens = [r for r in records if r.path == "/v1/messages"]
    assert gens, [r.path for r in records]
    for r in gens:
        _check_generation(r, "messages", "end_turn")
        assert r.prompt_tokens is None  # vllm-mlx's Anthropic stream never says the prompt size
    for r in records:  # anything else it sent (count_tokens) came back fine
        assert r.status == 200 and r.outcome == "ok", r
    assert raw and all(b"POST /v1/messages" in q.split(b"\r\n", 1)[0] for q in raw if q.startswith(b"POST"))


def test_codex_exec_through_proxy(stack: Stack, tmp_path: Path) -> None:
    codex = require_client("codex", INSTALL_HINT)
    home, work = tmp_path / "home", tmp_path / "work"
    codex_home = home / ".codex"
    codex_home.mkdir(parents=True)
    work.mkdir()
    env = loopback_env(HOME=str(home), CODEX_HOME=str(codex_home), MLXPROXY_TEST_KEY="dummy", RUST_LOG="warn")
    before = {r.id for r in stack.proxy.captured(at_least=0)}
    with tap(int(stack.proxy.url.rsplit(":", 1)[1])) as t:
        (codex_home / "config.toml").write_text(CODEX_CONFIG.format(model=stack.server.model, url=t.url))
        res = _run([codex, "exec", "--skip-git-repo-check", "say hi"], cwd=work, env=env, name="codex")
        records = _new_records(stack.proxy, before)
        _skip_if_nothing_reached("codex", records, res)
        raw = _store(t, "codex_0.171.0_responses", tmp_path)
    _print("codex", records)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    assert ANSWER in res.stdout, out
    gens = [r for r in records if r.path == "/v1/responses"]
    assert gens, [r.path for r in records]
    for r in gens:
        _check_generation(r, "responses", "completed")
        assert r.prompt_tokens and r.prompt_tokens > 1000, "Codex sends its instructions and tools"
    for r in records:
        assert r.status == 200 and r.outcome == "ok", r
    assert raw
