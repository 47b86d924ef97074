"""The seed servers run live: vllm-mlx (simple and ``--continuous-batching``), mlx-openai-server
(1.6.3 and 1.8.1), Rapid-MLX and mlx-vlm, each from its own venv made by ``.ci/install-servers``.

:func:`live_server` starts one on a free loopback port with a local model folder, waits until
it answers a 1-token chat completion, yields a :class:`LiveServer` and stops it (SIGTERM,
then SIGKILL, whole process group). :func:`unavailable_reason` says why a server cannot run
here (its venv is missing), for a ``pytest.skip`` that prints it. Only loopback is contacted;
the child runs with ``HF_HUB_OFFLINE=1`` and empty hub caches, and ``HOME`` in a temp folder
(Rapid-MLX writes ``~/.rapid-mlx``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import json
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from .peers import ProxyProcess, mlxproxy_serve
from .tinymodel import free_port

SERVERS_DIR = Path(os.environ.get("MLXPROXY_SERVERS_DIR") or Path.home() / ".cache" / "mlxproxy-servers")


@dataclasses.dataclass(frozen=True)
class Spec:
    name: str  # what the tests call it
    venv: str  # folder under SERVERS_DIR
    command: Callable[[Path, Path, str, int], list[str]]  # (venv, model, host, port) -> argv
    startup_timeout_s: float = 120.0
    env: tuple[tuple[str, str], ...] = ()  # extra environment for the child


def _vllm(extra: Sequence[str]) -> Callable[[Path, Path, str, int], list[str]]:
    def cmd(venv: Path, model: Path, host: str, port: int) -> list[str]:
        return [
            str(venv / "bin/vllm-mlx"),
            "serve",
            str(model),
            "--host",
            host,
            "--port",
            str(port),
            "--served-model-name",
            "rigged",
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "hermes",
            "--reasoning-parser",
            "qwen3",
            *extra,
        ]

    return cmd


def _mlx_openai(venv: Path, model: Path, host: str, port: int) -> list[str]:
    return [
        str(venv / "bin/mlx-openai-server"),
        "launch",
        "--model-path",
        str(model),
        "--model-type",
        "lm",
        "--context-length",
        "4096",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        "--reasoning-parser",
        "qwen3",
        "--host",
        host,
        "--port",
        str(port),
    ]


def _rapid(venv: Path, model: Path, host: str, port: int) -> list[str]:
    return [
        str(venv / "bin/rapid-mlx"),
        "serve",
        str(model),
        "--host",
        host,
        "--port",
        str(port),
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        "--reasoning-parser",
        "qwen3",
    ]


def _rapid_bare(venv: Path, model: Path, host: str, port: int) -> list[str]:
    return [
        str(venv / "bin/rapid-mlx"),
        "serve",
        str(model),
        "--host",
        host,
        "--port",
        str(port),
        "--no-tool-call-parser",
        "--no-reasoning-parser",
    ]


def _mlx_vlm(venv: Path, model: Path, host: str, port: int) -> list[str]:
    return [
        str(venv / "bin/python"),
        "-m",
        "mlx_vlm.server",
        "--model",
        str(model),
        "--host",
        host,
        "--port",
        str(port),
    ]


SPECS: dict[str, Spec] = {
    "vllm-mlx": Spec("vllm-mlx", "vllm-mlx", _vllm(())),
    "vllm-mlx-cb": Spec("vllm-mlx-cb", "vllm-mlx", _vllm(("--continuous-batching",))),
    # its default SimpleEngine plus mlx-lm's LRUPromptCache, which keeps whole conversations (the
    # default keeps only the system prompt's KV): the fix for `cache_system_only`
    "vllm-mlx-trie": Spec("vllm-mlx-trie", "vllm-mlx", _vllm(("--prefix-trie-cache",))),
    "mlx-openai-server": Spec("mlx-openai-server", "mlx-openai-server", _mlx_openai),  # 1.6.3
    # 1.8.1: continuous batching by default since 1.7 (the same command)
    "mlx-openai-server-1.8": Spec("mlx-openai-server-1.8", "mlx-openai-server-1.8", _mlx_openai),
    # Rapid-MLX constrains tool calls by default with a Metal kernel, which fails on CPU
    # ("[metal_kernel] No Metal back-end" -> 503 engine_aborted): run its free-form parser
    "rapid-mlx": Spec("rapid-mlx", "rapid-mlx", _rapid, env=(("RAPID_MLX_CONSTRAIN_TOOLS", "0"),)),
    "rapid-mlx-bare": Spec("rapid-mlx-bare", "rapid-mlx", _rapid_bare, env=(("RAPID_MLX_CONSTRAIN_TOOLS", "0"),)),
    "mlx-vlm": Spec("mlx-vlm", "vllm-mlx", _mlx_vlm),
}


@dataclasses.dataclass
class LiveServer:
    name: str
    url: str  # http://127.0.0.1:PORT (no /v1)
    model: str  # the id to send as "model" (the first of GET /v1/models)
    proc: subprocess.Popen[bytes]
    log_path: Path

    def log(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return "<no log>"


@dataclasses.dataclass
class RiggedVllm:
    """vllm-mlx serving the rigged model fixed to one answer (``<think>...</think>`` then "It is
    sunny today."), for the agent CLIs, whose long prompts and own tools a free model would answer
    at length; one for the test session (conftest's ``rigged_vllm``: test_agent_clis.py,
    test_agent_sessions.py)."""

    server: LiveServer
    model_dir: Path


def unavailable_reason(name: str) -> str | None:
    """Why server ``name`` cannot run here (no venv from ``.ci/install-servers``), or None."""
    spec = SPECS[name]
    venv = SERVERS_DIR / spec.venv
    argv = spec.command(venv, Path("M"), "127.0.0.1", 0)
    if not Path(argv[0]).exists():
        return (
            f"{name}: {argv[0]} not found; run .ci/install-servers "
            f"(venvs in $MLXPROXY_SERVERS_DIR, default ~/.cache/mlxproxy-servers)"
        )
    return None


def _request(host: str, port: int, method: str, path: str, body: dict | None, timeout: float) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        data = json.dumps(body).encode() if body is not None else None
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"} if data else {})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _stop(proc: subprocess.Popen[bytes], grace: float = 10.0) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=grace)


@contextlib.contextmanager
def live_server(
    name: str, model_dir: Path, *, host: str = "127.0.0.1", log_path: Path | None = None, attempts: int = 2
) -> Iterator[LiveServer]:
    """Run server ``name`` on ``model_dir``; yield it once a 1-token chat completion succeeded.

    Raises ``RuntimeError`` with the log's tail when it does not get ready (callers skip with it).
    """
    spec = SPECS[name]
    venv = SERVERS_DIR / spec.venv
    with tempfile.TemporaryDirectory(prefix=f"mlxproxy-{name}-") as tmp:
        tmpdir = Path(tmp)
        for sub in ("hf-cache", "hf-home", "home"):
            (tmpdir / sub).mkdir()
        env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy") and k != "PYTHONPATH"}
        env.update(
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            HF_HUB_CACHE=str(tmpdir / "hf-cache"),
            HF_HOME=str(tmpdir / "hf-home"),
            HOME=str(tmpdir / "home"),
            HF_HUB_DISABLE_TELEMETRY="1",
            TOKENIZERS_PARALLELISM="false",
            PYTHONUNBUFFERED="1",
            NO_PROXY="127.0.0.1,localhost",
            **dict(spec.env),
            VIRTUAL_ENV=str(venv),
            PATH=f"{venv / 'bin'}:{os.environ.get('PATH', '')}",
        )
        log = Path(log_path) if log_path is not None else tmpdir / "server.log"
        last = "not started"
        for _ in range(max(1, attempts)):
            port = free_port(host)
            with open(log, "ab") as logf:
                proc = subprocess.Popen(
                    spec.command(venv, Path(model_dir), host, port),
                    env=env,
                    stdout=logf,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                    cwd=tmpdir,  # servers that write logs/ or caches into their working directory write there
                )
            try:
                model, last = _wait_ready(proc, host, port, spec.startup_timeout_s)
                if model is None:
                    if proc.poll() is not None:
                        last += f"\n--- {name} log ---\n{_tail(log)}"
                        continue
                    raise RuntimeError(
                        f"{name} not ready after {spec.startup_timeout_s} s: {last}\n--- {name} log ---\n{_tail(log)}"
                    )
                yield LiveServer(name, f"http://{host}:{port}", model, proc, log)
                return
            finally:
                _stop(proc)
        raise RuntimeError(f"{name} failed to start: {last}")


def _tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return "<no log>"


def _wait_ready(proc: subprocess.Popen[bytes], host: str, port: int, timeout: float) -> tuple[str | None, str]:
    deadline = time.monotonic() + timeout
    last = "no answer yet"
    model: str | None = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return None, f"exited with code {proc.returncode}"
        try:
            if model is None:
                status, body = _request(host, port, "GET", "/v1/models", None, 2.0)
                last = f"/v1/models -> {status} {body[:200]!r}"
                if status == 200:
                    data = json.loads(body).get("data") or []
                    model = data[0]["id"] if data else "default_model"
            if model is not None:
                status, body = _request(
                    host,
                    port,
                    "POST",
                    "/v1/chat/completions",
                    {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
                    max(2.0, deadline - time.monotonic()),
                )
                if status == 200:
                    return model, ""
                last = f"warm-up chat completion -> {status} {body[:300]!r}"
        except (OSError, http.client.HTTPException, ValueError, KeyError) as exc:
            last = f"{type(exc).__name__}: {exc}"
        time.sleep(0.2)  # readiness polling interval, not a measurement
    return None, last


@contextlib.contextmanager
def proxied_live_server(name: str, model_dir: Path, log_path: Path) -> Iterator[tuple[LiveServer, ProxyProcess]]:
    """Live server ``name`` on ``model_dir`` (a rigged model with its tokenizer.json) with one
    ``mlxproxy serve`` in front, capture on; the test is skipped with the reason when the server
    is not installed here or does not start."""
    reason = unavailable_reason(name)
    if reason is not None:
        pytest.skip(reason)
    with contextlib.ExitStack() as stack:
        try:
            server = stack.enter_context(live_server(name, model_dir, log_path=log_path))
        except RuntimeError as exc:
            pytest.skip(f"{name} did not start: {str(exc)[-1500:]}")
        proxy = stack.enter_context(
            mlxproxy_serve(server.url, {"tokenizer": str(model_dir / "tokenizer.json")}, capture=True)
        )
        yield server, proxy
