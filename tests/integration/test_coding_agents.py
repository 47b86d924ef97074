"""Real coding-agent clients through ``mlxproxy serve`` in front of a real ``mlx_lm.server``.

* Aider, non-interactive (``--message ... --yes-always --no-git``), completes a turn
  through the proxy; its requests land in the capture file, and ``mlxproxy replay`` of
  that capture against mlx_lm.server succeeds.
* OpenCode (``opencode run``) with an ``opencode.json`` provider pointing at the proxy:
  every request it makes (``/v1/models`` if any, its streaming chats) passes through and
  is measured.

The binaries are looked for where ``.ci/install-clients`` puts them, then in developer
locations, then on PATH (``peers.find_client``); a missing client skips its test with
the places searched. Neither client is allowed to reach the network: each runs with a
temporary HOME, Aider with a seeded model-price cache (else it downloads litellm's price
list, ~5 s timeout offline) and ``LITELLM_LOCAL_MODEL_COST_MAP``, OpenCode with its
models.dev fetch, autoupdate, default plugins and npm turned off, and always under a
timeout.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from mlxproxy.core.record import Record

from .peers import AIDER_QUIET, assert_completed, loopback_env, mlxproxy_serve, require_client, require_mlx, xdg_env
from .tinymodel import MODEL_NAME

pytestmark = pytest.mark.integration

require_mlx()

#: Reply cap for the agents' requests (Aider sends no max_tokens: the server's
#: --max-tokens applies; OpenCode sends its model limit.output).
AGENT_OUTPUT_TOKENS = 48
CLIENT_TIMEOUT_S = 120


def _run(cmd: list[str], *, cwd: Path, env: dict[str, str], name: str) -> subprocess.CompletedProcess[str]:
    env = {**env, "PWD": str(cwd)}  # OpenCode takes its project directory from $PWD, not getcwd()
    t0 = time.monotonic()
    try:
        res = subprocess.run(
            cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=CLIENT_TIMEOUT_S
        )
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(
            f"{name} did not finish within {CLIENT_TIMEOUT_S} s:\n{exc.stdout}\n{exc.stderr}"
        ) from None
    print(f"\n{name} finished in {time.monotonic() - t0:.1f} s with exit code {res.returncode}")
    return res


def _chat_records(records: list[Record]) -> list[Record]:
    return [r for r in records if r.path == "/v1/chat/completions"]


def test_aider_turn_through_proxy_is_captured_and_replays(mlx_server: str, tmp_path: Path) -> None:
    aider = require_client(
        "aider", "CI installs it with .ci/install-clients (pip install aider-chat in .ci-tools/aider-venv)"
    )
    home = tmp_path / "home"
    work = tmp_path / "work"
    work.mkdir()
    # A non-empty price cache younger than 24 h: Aider then never downloads litellm's list.
    cache = home / ".aider" / "caches"
    cache.mkdir(parents=True)
    (cache / "model_prices_and_context_window.json").write_text(
        json.dumps(
            {
                f"openai/{MODEL_NAME}": {
                    "max_input_tokens": 32768,
                    "max_output_tokens": AGENT_OUTPUT_TOKENS,
                    "max_tokens": AGENT_OUTPUT_TOKENS,
                    "input_cost_per_token": 0.0,
                    "output_cost_per_token": 0.0,
                    "litellm_provider": "openai",
                    "mode": "chat",
                }
            }
        )
    )
    env = loopback_env(
        HOME=str(home),
        OPENAI_API_KEY="dummy",
        LITELLM_LOCAL_MODEL_COST_MAP="True",
        AIDER_CHECK_UPDATE="false",
        PYTHONUNBUFFERED="1",
    )
    with mlxproxy_serve(mlx_server, capture=True) as px:
        cmd = [
            aider,
            "--message",
            "say hi",
            "--openai-api-base",
            px.url + "/v1",
            "--model",
            f"openai/{MODEL_NAME}",
            *AIDER_QUIET,
            "--timeout",
            "60",
        ]
        res = _run(cmd, cwd=work, env=env, name="aider")
        out = res.stdout + res.stderr
        # Aider exits 0 even when every API call failed; the proxy's records tell the truth.
        assert res.returncode == 0, out
        assert not any(m in out for m in ("Retrying in", "APIConnectionError", "InternalServerError")), out
        captured = px.captured(at_least=1)
        live = px.records()
        chats = _chat_records(captured)
        assert chats, (
            f"Aider sent no chat completion through the proxy: {[(r.method, r.path) for r in captured]}\n{out}"
        )
        print_requests("aider", captured)
        assert {r.id for r in captured} == {r.id for r in live}, "capture and /streams disagree"
        for r in chats:
            assert_completed(r)
            assert r.stream and r.usage_injected and not r.usage_requested, "Aider streams without stream_options"
            assert r.completion_tokens_reported is not None and r.ttft_s is not None and r.decode_tps is not None
        for r in captured:
            assert r.status == 200, r

        # Replay the capture against mlx_lm.server directly, with the real CLI.
        assert px.capture_path is not None
        result = tmp_path / "replay.json"
        rep = subprocess.run(
            [
                sys.executable,
                "-m",
                "mlxproxy",
                "replay",
                str(px.capture_path),
                "--target",
                mlx_server,
                "--mode",
                "sequential",
                "--json",
                str(result),
                "--timeout",
                "120",
            ],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=CLIENT_TIMEOUT_S,
            env=loopback_env(),
        )
    assert rep.returncode == 0, rep.stdout + rep.stderr
    doc = json.loads(result.read_text())
    replayed = [Record.from_dict(r) for g in doc["groups"] for r in g["records"]]
    print(f"replay of {len(captured)} captured requests:\n{rep.stdout}")
    assert len(replayed) == len(captured)
    for r in replayed:
        assert (r.outcome, r.status) == ("ok", 200), r
        if r.path == "/v1/chat/completions":
            assert r.completion_tokens_reported is not None and r.anomalies == (), r


def print_requests(client: str, records: list[Record]) -> None:
    """One line describing what a client sent through the proxy (shown with -s or on failure)."""
    print(
        f"{client} requests: "
        + "; ".join(
            f"{r.method} {r.path} {r.outcome} stream={r.stream} ttft={r.ttft_s and round(r.ttft_s, 3)}s "
            f"prompt={r.prompt_tokens} tokens={r.completion_tokens_reported} anomalies={list(r.anomalies)}"
            for r in records
        )
    )


def _opencode_config(proxy_url: str) -> dict[str, Any]:
    return {
        "$schema": "https://opencode.ai/config.json",
        "provider": {
            "mlx": {
                "npm": "@ai-sdk/openai-compatible",
                "name": "mlx",
                "options": {"baseURL": proxy_url + "/v1", "apiKey": "dummy"},
                # a small context limit makes OpenCode compact in an endless loop
                "models": {MODEL_NAME: {"name": "tiny", "limit": {"context": 200000, "output": AGENT_OUTPUT_TOKENS}}},
            }
        },
        "model": f"mlx/{MODEL_NAME}",
        "autoupdate": False,
        "share": "disabled",
    }


def test_opencode_run_through_proxy_is_measured(mlx_server: str, tmp_path: Path) -> None:
    opencode = require_client(
        "opencode",
        "CI installs it with .ci/install-clients when Node.js/npm are available "
        "(npm install -g opencode-ai into .ci-tools/npm)",
    )
    home = tmp_path / "home"
    project = tmp_path / "project"
    project.mkdir()
    env = loopback_env(
        HOME=str(home),
        **xdg_env(home),
        OPENCODE_DISABLE_MODELS_FETCH="1",
        OPENCODE_DISABLE_AUTOUPDATE="1",
        OPENCODE_DISABLE_DEFAULT_PLUGINS="1",
        OPENCODE_DISABLE_LSP_DOWNLOAD="1",
        OPENCODE_DISABLE_CLAUDE_CODE="1",
        OPENCODE_DISABLE_SHARE="1",
        npm_config_offline="true",
        npm_config_update_notifier="false",
    )
    with mlxproxy_serve(mlx_server, capture=True) as px:
        (project / "opencode.json").write_text(json.dumps(_opencode_config(px.url), indent=2))
        res = _run([opencode, "run", "say hi", "-m", f"mlx/{MODEL_NAME}"], cwd=project, env=env, name="opencode")
        out = res.stdout + res.stderr
        assert res.returncode == 0, out
        captured = px.captured(at_least=1)
    print_requests("opencode", captured)
    chats = _chat_records(captured)
    assert chats, f"OpenCode sent no chat completion through the proxy:\n{out}"
    for r in captured:
        assert r.status == 200, r
        if r.path.endswith("/models"):  # OpenCode 1.18 does not call it; later versions may
            assert r.method == "GET" and r.outcome == "ok", r
    assert {r.path for r in captured} <= {"/v1/chat/completions", "/v1/models"}, [r.path for r in captured]
    ids = {r.id for r in chats}
    for r in chats:
        # OpenCode may send its title request alongside the answer; when mlx_lm.server
        # serves the two one after the other (it does whenever it cannot batch them), the
        # proxy rightly says `serialized`, naming the other chat
        assert_completed(r, allow=("serialized",))
        if "serialized" in r.anomalies:
            assert any(other in r.anomaly_evidence["serialized"] for other in ids - {r.id}), r.anomaly_evidence
        assert r.stream and r.usage_requested, "OpenCode streams with stream_options.include_usage"
        assert r.completion_tokens_reported is not None and 0 < r.completion_tokens_reported <= AGENT_OUTPUT_TOKENS
        assert r.ttft_s is not None and r.decode_tps is not None and r.prefill_tps is not None
        assert r.prompt_tokens and r.prompt_tokens > 500, "OpenCode sends its system prompt and tools"
