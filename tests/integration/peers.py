"""Real peers for the integration tests: ``mlxproxy serve`` as a child process, the
coding-agent client binaries, and small helpers shared by the tests.

* :func:`mlxproxy_serve` runs the real CLI (``python -m mlxproxy serve --port 0``) with a
  config file, reads the bound URL from its start-up line and yields a
  :class:`ProxyProcess` that reads the proxy's own records back from ``GET /streams``
  (and its capture file, which keeps the per-event timeline).
* :func:`find_client` looks for ``aider`` / ``opencode`` where CI installs them
  (``.ci/install-clients``: ``.ci-tools/``), then where a developer may have them, then
  on ``PATH``; :func:`require_client` skips the test with the places searched.
* :func:`loopback_env` is an environment with no proxy for loopback addresses.

Only loopback is ever contacted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

from mlxproxy.capture import read_capture
from mlxproxy.core.record import Record

from .tinymodel import mlx_unavailable_reason

REPO = Path(__file__).resolve().parents[2]

#: Where each client is looked for, in order, before ``PATH``: the executable an environment
#: variable names (``MLXPROXY_AIDER``, ``MLXPROXY_OPENCODE``, ``MLXPROXY_CLAUDE``,
#: ``MLXPROXY_CODEX``, ``MLXPROXY_QWEN``, ``MLXPROXY_LLM``: a developer's own install), then where
#: ``.ci/install-clients`` puts it.
CLIENT_ENV = {
    "aider": "MLXPROXY_AIDER",
    "opencode": "MLXPROXY_OPENCODE",
    "claude": "MLXPROXY_CLAUDE",
    "codex": "MLXPROXY_CODEX",
    "qwen": "MLXPROXY_QWEN",
    "llm": "MLXPROXY_LLM",
}
CLIENT_PATHS: dict[str, tuple[Path, ...]] = {
    "aider": (REPO / ".ci-tools/aider-venv/bin/aider",),
    "opencode": (REPO / ".ci-tools/npm/bin/opencode",),
    "claude": (REPO / ".ci-tools/npm/bin/claude",),
    "codex": (REPO / ".ci-tools/npm/bin/codex",),
    "qwen": (REPO / ".ci-tools/npm/bin/qwen",),
    "llm": (REPO / ".ci-tools/llm-venv/bin/llm",),
}

#: Aider's flags for a quiet, offline, non-interactive run (no update check, analytics, repo map,
#: lint, test, shell suggestions or URL detection)
AIDER_QUIET = (
    "--yes-always",
    "--no-git",
    "--no-check-update",
    "--no-show-release-notes",
    "--analytics-disable",
    "--no-show-model-warnings",
    "--no-pretty",
    "--no-fancy-input",
    "--map-tokens",
    "0",
    "--no-auto-lint",
    "--no-auto-test",
    "--no-suggest-shell-commands",
    "--no-detect-urls",
)

#: Codex's config.toml: a custom provider speaking Responses at ``{url}/v1``
CODEX_CONFIG = """model = "{model}"
model_provider = "mlxproxy"

[model_providers.mlxproxy]
name = "mlxproxy"
base_url = "{url}/v1"
wire_api = "responses"
env_key = "MLXPROXY_TEST_KEY"
"""

T = TypeVar("T")


def find_client(name: str) -> tuple[str | None, list[str]]:
    """The first executable ``name`` among :data:`CLIENT_PATHS` then ``PATH``; also the places searched."""
    searched = []
    var = CLIENT_ENV.get(name)
    own = (Path(os.environ[var]),) if var and os.environ.get(var) else ()
    if var and not own:
        searched.append(f"${var} (unset)")
    for p in (*own, *CLIENT_PATHS.get(name, ())):
        searched.append(str(p))
        if p.is_file() and os.access(p, os.X_OK):
            return str(p), searched
    searched.append("PATH")
    found = shutil.which(name)
    return found, searched


def require_client(name: str, install_hint: str) -> str:
    """The client's path, or ``pytest.skip`` naming where it was looked for."""
    path, searched = find_client(name)
    if path is None:
        pytest.skip(f"{name} not found (looked in {', '.join(searched)}); {install_hint}")
    return path


def require_mlx(needed_for: str = "") -> None:
    """Skip the calling test module, with the reason, where the mlx stack does not import
    (`needed_for`: why a module that runs no mlx model needs it all the same)."""
    reason = mlx_unavailable_reason()
    if reason is not None:
        why = f" ({needed_for})" if needed_for else ""
        pytest.skip(f"mlx stack unavailable{why}: {reason}", allow_module_level=True)


def loopback_env(**extra: str) -> dict[str, str]:
    """This process's environment without HTTP proxies for loopback, plus ``extra``."""
    env = dict(os.environ)
    for k in ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        env.pop(k, None)
    env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost,::1"
    env.update(extra)
    return env


def xdg_env(home: Path) -> dict[str, str]:
    """The XDG base directories under ``home`` (clients that keep config and state there: OpenCode)."""
    return {
        k: str(home / sub)
        for k, sub in (
            ("XDG_CONFIG_HOME", ".config"),
            ("XDG_DATA_HOME", ".local/share"),
            ("XDG_CACHE_HOME", ".cache"),
            ("XDG_STATE_HOME", ".local/state"),
        )
    }


def split_cpus() -> tuple[set[int] | None, set[int] | None]:
    """(CPUs for the model server, CPUs for everything else), or (None, None) where
    affinity cannot be set or there is a single CPU.

    On a small runner the tiny model's server, the proxy and the client all compete for
    the same cores, and the mlx CPU backend spreads over every core it may use: any other
    busy process then slows its prefill and decode. On a real Mac the model runs on the
    GPU, so that contention is an artefact of the test box; giving the server its own
    cores keeps it out of the timing comparisons.
    """
    if not hasattr(os, "sched_getaffinity"):
        return None, None
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None, None
    half = len(cpus) // 2
    return set(cpus[:half]), set(cpus[half:])


SERVER_CPUS, CLIENT_CPUS = split_cpus()


@contextlib.contextmanager
def cpu_affinity(cpus: set[int] | None) -> Iterator[None]:
    """Run the calling thread (and children it starts meanwhile) on ``cpus``; no-op for None."""
    if cpus is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def wait_for(pred: Callable[[], T], timeout_s: float = 10.0, interval_s: float = 0.01) -> T:
    """Poll ``pred`` until it returns something truthy; return it (or fail the test)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s} s")
        time.sleep(interval_s)  # polling interval, not a measurement


def nonce_prompt(words: int) -> str:
    """A prompt of roughly ``11.5 * words`` tokens that starts with a nonce, so the
    server's prompt cache cannot shorten its prefill."""
    return f"[{uuid.uuid4().hex}] " + " ".join(f"item{i} fox jumps" for i in range(words))


def median(values: Sequence[float]) -> float:
    s = sorted(values)
    n = len(s)
    if n == 0:
        raise ValueError("median of nothing")
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def assert_completed(rec: Record, allow: tuple[str, ...] = ()) -> None:
    """``rec`` is a successful request with no anomalies but those in ``allow``."""
    assert rec.outcome == "ok", f"outcome {rec.outcome!r}: {rec.error} ({rec})"
    unexpected = tuple(a for a in rec.anomalies if a not in allow)
    assert unexpected == (), f"anomalies {unexpected}: {rec.anomaly_evidence}"


@dataclasses.dataclass
class ProxyProcess:
    """A running ``mlxproxy serve`` child."""

    url: str  # http://127.0.0.1:PORT (no /v1)
    proc: subprocess.Popen[bytes]
    log_path: Path
    capture_path: Path | None
    http: httpx.Client

    def streams(self) -> dict[str, Any]:
        r = self.http.get(self.url + "/streams")
        r.raise_for_status()
        return r.json()

    def records(self) -> list[Record]:
        """Finished records kept by the proxy, oldest first (``/streams`` has no event timeline)."""
        return [Record.from_dict(d) for d in reversed(self.streams()["recent"])]

    def record(self, request_id: str, timeout_s: float = 10.0) -> Record:
        """The record of one request (by ``x-mlxproxy-request-id``), once it is finished."""

        def find() -> Record | None:
            return next((r for r in self.records() if r.id == request_id), None)

        return wait_for(find, timeout_s)

    def captured(self, at_least: int = 1, timeout_s: float = 10.0) -> list[Record]:
        """Records from the capture file (timeline included), oldest start first, with
        ``t_start_mono`` set to the capture offset so records can be compared in time."""
        assert self.capture_path is not None, "this proxy has no capture file"
        path = self.capture_path

        def lines() -> int:
            return sum(1 for _ in path.open("rb")) if path.exists() else 0

        wait_for(lambda: lines() >= at_least, timeout_s)
        caps = read_capture(path)
        return sorted(
            (dataclasses.replace(c.record, t_start_mono=c.offset_s) for c in caps), key=lambda r: r.t_start_mono
        )

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return "<no log>"


_LISTENING = re.compile(r"listening on (http://[^\s/]+)/v1")


@contextlib.contextmanager
def mlxproxy_serve(
    upstream_url: str,
    config: dict[str, Any] | None = None,
    *,
    capture: bool = False,
    startup_timeout_s: float = 30.0,
    cpus: set[int] | None = CLIENT_CPUS,
) -> Iterator[ProxyProcess]:
    """Run ``python -m mlxproxy serve --config FILE --port 0`` in front of ``upstream_url``.

    ``config`` holds extra config keys (YAML written as JSON); ``capture`` adds a capture
    file in a temp folder; ``cpus`` is the child's CPU affinity (default: off the model
    server's cores). The child is stopped with SIGTERM (a graceful shutdown that closes
    the capture file) and reaped.
    """
    with tempfile.TemporaryDirectory(prefix="mlxproxy-serve-") as tmp:
        tmpdir = Path(tmp)
        raw: dict[str, Any] = {
            "upstreams": [{"name": "mlx-lm", "url": upstream_url}],
            "log_requests": False,
            **(config or {}),
        }
        capture_path = tmpdir / "capture.jsonl" if capture else None
        if capture_path is not None:
            raw["capture"] = str(capture_path)
        cfg = tmpdir / "config.yaml"
        cfg.write_text(json.dumps(raw, indent=2) + "\n")  # JSON is YAML
        log_path = tmpdir / "serve.log"
        cmd = [sys.executable, "-m", "mlxproxy", "serve", "--config", str(cfg), "--port", "0", "--log-level", "warning"]
        with open(log_path, "wb") as logf, cpu_affinity(cpus):
            proc = subprocess.Popen(
                cmd,
                stdout=logf,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=loopback_env(PYTHONUNBUFFERED="1"),
                cwd=tmpdir,
            )
        http = httpx.Client(timeout=30.0, trust_env=False)
        try:
            deadline = time.monotonic() + startup_timeout_s
            url = None
            while url is None:
                m = _LISTENING.search(log_path.read_text(errors="replace"))
                if m:
                    url = m.group(1)
                elif proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"mlxproxy serve did not start (exit code {proc.poll()}):\n"
                        f"{log_path.read_text(errors='replace')[-3000:]}"
                    )
                else:
                    time.sleep(0.02)  # start-up polling, not a measurement
            wait_for(lambda: _healthy(http, url), startup_timeout_s)
            yield ProxyProcess(url, proc, log_path, capture_path, http)
        finally:
            http.close()
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)


def _healthy(http: httpx.Client, url: str) -> bool:
    try:
        return http.get(url + "/healthz").status_code == 200
    except httpx.HTTPError:
        return False
