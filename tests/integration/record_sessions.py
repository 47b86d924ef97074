"""Record real agent CLIs' multi-turn sessions through ``mlxproxy serve`` to a live server.

    PYTHONPATH=. python -m tests.integration.record_sessions --server mlx-lm|vllm-mlx \\
        --out DIR [--client NAME ...] [--turns N]

Each client (:data:`CLIENTS`) runs one session of ``--turns`` invocations (its own "continue"
form from the second on) with a temporary HOME, against a proxy in front of the server, with a
:class:`~.sessiontap.SessionTap` in front of the proxy. The session is written to
``DIR/<client>_<version>__<server>/``: per HTTP exchange N (in the order sent) ``turnN.headers``
(request line and headers), ``turnN.request.json`` (the body, exact bytes), ``turnN.response``
(status line, headers and body exactly as the proxy sent them), ``turnN.timing.json``; plus
``records.jsonl`` (the proxy's capture lines for the session: what mlxproxy says today),
``server.log`` (the server's log lines during the session, each with its receive time) and
``session.json`` (the commands, versions, which CLI invocation sent which exchange).
:mod:`.sessiontruth` then writes ``truth.json`` from these files.

Run it inside a network namespace with only loopback (``unshare -n``, then ``ip link set lo
up``), so no client can reach anything but the proxy, whatever its telemetry settings.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from .live_servers import live_server, unavailable_reason
from .peers import (
    AIDER_QUIET,
    CLIENT_CPUS,
    CODEX_CONFIG,
    REPO,
    SERVER_CPUS,
    cpu_affinity,
    find_client,
    loopback_env,
    mlxproxy_serve,
    xdg_env,
)
from .rigged import answer_always, build_rigged_model
from .sessiontap import _TOKEN, Exchange, SessionTap, session_tap
from .tinymodel import MODEL_NAME, free_port, mlx_lm_server

CLIENT_TIMEOUT_S = 300.0
#: The folder each client runs in (its project) and keeps its HOME in; a fixed path, so the
#: recorded prompts (which name the working directory) are the same from run to run.
WORK_ROOT = Path(os.environ.get("MLXPROXY_SESSIONS_WORK", "/var/tmp/mlxproxy-sessions"))
PROMPTS = (
    "say hi",
    "say hi again, please",
    "what was my first message?",
    "thanks, that is all",
    "one more: say bye",
)
OUTPUT_TOKENS = 48
#: mlx_lm.server's prefill step: the tiny model prefills a thousand tokens in a few hundredths of
#: a second in steps of 512, too little to tell a hit from a miss; in steps of 4 a re-prefill of
#: a few hundred tokens costs tenths of a second, as larger models do on real hardware
PREFILL_STEP = os.environ.get("MLXPROXY_SESSIONS_PREFILL_STEP", "4")


@dataclasses.dataclass
class Ctx:
    """What a client's command needs: where the proxy (the tap) is and which model to ask for."""

    url: str  # the tap in front of the proxy, no /v1
    model: str
    home: Path
    work: Path
    server: str


@dataclasses.dataclass(frozen=True)
class Client:
    name: str
    binary: str  # looked up with peers.find_client
    apis: tuple[str, ...]  # "chat", "messages", "responses"
    version: Callable[[str], str]
    setup: Callable[[Ctx], dict[str, str]]  # writes config files, returns extra env
    argv: Callable[[str, Ctx, int, str], list[str]]  # (binary, ctx, turn index from 0, prompt)


def _version_of(args: list[str], pattern: str = r"(\d+\.\d+\.\d+)") -> Callable[[str], str]:
    def get(binary: str) -> str:
        res = subprocess.run([binary, *args], capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
        m = re.search(pattern, res.stdout + res.stderr)
        return m.group(1) if m else "unknown"

    return get


# --- Claude Code (Messages) ---------------------------------------------------------------


def _claude_setup(variant: dict[str, str]) -> Callable[[Ctx], dict[str, str]]:
    def setup(ctx: Ctx) -> dict[str, str]:
        return {
            "ANTHROPIC_BASE_URL": ctx.url,
            "ANTHROPIC_API_KEY": "dummy",
            "ANTHROPIC_DEFAULT_HAIKU_MODEL": ctx.model,
            "ANTHROPIC_DEFAULT_SONNET_MODEL": ctx.model,
            "ANTHROPIC_DEFAULT_OPUS_MODEL": ctx.model,
            "DISABLE_TELEMETRY": "1",
            "DISABLE_AUTOUPDATER": "1",
            "DISABLE_ERROR_REPORTING": "1",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            **variant,
        }

    return setup


def _claude_argv(binary: str, ctx: Ctx, i: int, prompt: str) -> list[str]:
    return [binary, *(["-c"] if i else []), "-p", prompt, "--model", ctx.model, "--max-turns", "1"]


# --- Codex (Responses) --------------------------------------------------------------------


def _codex_setup(ctx: Ctx) -> dict[str, str]:
    codex_home = ctx.home / ".codex"
    codex_home.mkdir(parents=True, exist_ok=True)
    (codex_home / "config.toml").write_text(CODEX_CONFIG.format(model=ctx.model, url=ctx.url))
    return {"CODEX_HOME": str(codex_home), "MLXPROXY_TEST_KEY": "dummy", "RUST_LOG": "warn"}


def _codex_argv(binary: str, ctx: Ctx, i: int, prompt: str) -> list[str]:
    if i == 0:
        return [binary, "exec", "--skip-git-repo-check", prompt]
    return [binary, "exec", "--skip-git-repo-check", "resume", "--last", prompt]


# --- Aider (Chat) -------------------------------------------------------------------------


def _aider_setup(ctx: Ctx) -> dict[str, str]:
    cache = ctx.home / ".aider" / "caches"
    cache.mkdir(parents=True, exist_ok=True)
    price = {
        "max_input_tokens": 32768,
        "max_output_tokens": OUTPUT_TOKENS,
        "max_tokens": OUTPUT_TOKENS,
        "input_cost_per_token": 0.0,
        "output_cost_per_token": 0.0,
        "litellm_provider": "openai",
        "mode": "chat",
    }
    (cache / "model_prices_and_context_window.json").write_text(json.dumps({f"openai/{ctx.model}": price}))
    return {
        "OPENAI_API_KEY": "dummy",
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        "AIDER_CHECK_UPDATE": "false",
        "PYTHONUNBUFFERED": "1",
    }


def _aider_argv(binary: str, ctx: Ctx, i: int, prompt: str) -> list[str]:
    return [
        binary,
        "--message",
        prompt,
        "--restore-chat-history",
        "--openai-api-base",
        ctx.url + "/v1",
        "--model",
        f"openai/{ctx.model}",
        *AIDER_QUIET,
        "--timeout",
        "120",
    ]


# --- OpenCode (Chat) ----------------------------------------------------------------------


def _opencode_setup(ctx: Ctx) -> dict[str, str]:
    cfg = {
        "$schema": "https://opencode.ai/config.json",
        "provider": {
            "mlx": {
                "npm": "@ai-sdk/openai-compatible",
                "name": "mlx",
                "options": {"baseURL": ctx.url + "/v1", "apiKey": "dummy"},
                "models": {ctx.model: {"name": "tiny", "limit": {"context": 200000, "output": OUTPUT_TOKENS}}},
            }
        },
        "model": f"mlx/{ctx.model}",
        "autoupdate": False,
        "share": "disabled",
    }
    (ctx.work / "opencode.json").write_text(json.dumps(cfg, indent=2))
    return {
        **xdg_env(ctx.home),
        "OPENCODE_DISABLE_MODELS_FETCH": "1",
        "OPENCODE_DISABLE_AUTOUPDATE": "1",
        "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1",
        "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
        "OPENCODE_DISABLE_CLAUDE_CODE": "1",
        "OPENCODE_DISABLE_SHARE": "1",
        "npm_config_offline": "true",
        "npm_config_update_notifier": "false",
        "PWD": str(ctx.work),
    }


def _opencode_argv(binary: str, ctx: Ctx, i: int, prompt: str) -> list[str]:
    return [binary, "run", *(["--continue"] if i else []), prompt, "-m", f"mlx/{ctx.model}"]


#: documents pasted into the first prompt: ~27k tokens of conversation past the system prompt, which
#: every later turn extends (~1.5 s of prefill for the rigged model on vllm-mlx, well above a hit's
#: fixed cost): what tells a cache that keeps the conversation from one that keeps only the system
#: prompt (vllm-mlx 0.6.0's default, issue 36); under the 128 KiB one argument may have
PASTE_CHARS = 110_000


def _paste(prompt: str) -> str:
    docs = "\n\n".join(p.read_text() for p in sorted((REPO / "docs").glob("*.md")))
    return f"Here are my project's docs:\n\n{docs[:PASTE_CHARS]}\n\n{prompt}"


def _opencode_paste_argv(binary: str, ctx: Ctx, i: int, prompt: str) -> list[str]:
    return _opencode_argv(binary, ctx, i, _paste(prompt) if i == 0 else prompt)


# --- Qwen Code (Chat) ---------------------------------------------------------------------


def _qwen_setup(ctx: Ctx) -> dict[str, str]:
    d = ctx.home / ".qwen"
    d.mkdir(parents=True, exist_ok=True)
    settings = {
        "privacy": {"usageStatisticsEnabled": False},
        "telemetry": {"enabled": False},
        "general": {"disableAutoUpdate": True, "disableUpdateNag": True},
    }
    (d / "settings.json").write_text(json.dumps(settings, indent=2))
    return {"OPENAI_API_KEY": "dummy", "OPENAI_BASE_URL": ctx.url + "/v1", "OPENAI_MODEL": ctx.model}


def _qwen_argv(binary: str, ctx: Ctx, i: int, prompt: str) -> list[str]:
    return [
        binary,
        *(["--continue"] if i else []),
        "--auth-type",
        "openai",
        "--openai-base-url",
        ctx.url + "/v1",
        "--openai-api-key",
        "dummy",
        "-m",
        ctx.model,
        prompt,
    ]


# --- llm (Chat) ---------------------------------------------------------------------------


def _llm_setup(ctx: Ctx) -> dict[str, str]:
    d = ctx.home / "llm"
    d.mkdir(parents=True, exist_ok=True)
    (d / "extra-openai-models.yaml").write_text(
        f"- model_id: local\n  model_name: {ctx.model}\n  api_base: {ctx.url}/v1\n  api_key_name: local\n"
    )
    (d / "keys.json").write_text(json.dumps({"local": "dummy"}))
    return {"LLM_USER_PATH": str(d)}


def _llm_argv(binary: str, ctx: Ctx, i: int, prompt: str) -> list[str]:
    return [binary, "prompt", *(["-c"] if i else ["-m", "local"]), prompt]


CLIENTS: dict[str, Client] = {
    "claude-code": Client(
        "claude-code", "claude", ("messages",), _version_of(["--version"]), _claude_setup({}), _claude_argv
    ),
    # the per-request billing line in system line 1 (this version adds it only where it takes the
    # base URL for Anthropic's own)
    "claude-code-billing": Client(
        "claude-code-billing",
        "claude",
        ("messages",),
        _version_of(["--version"]),
        _claude_setup({"_CLAUDE_CODE_ASSUME_FIRST_PARTY_BASE_URL": "1"}),
        _claude_argv,
    ),
    # ... and the setting users apply to drop it
    "claude-code-billing-off": Client(
        "claude-code-billing-off",
        "claude",
        ("messages",),
        _version_of(["--version"]),
        _claude_setup({"_CLAUDE_CODE_ASSUME_FIRST_PARTY_BASE_URL": "1", "CLAUDE_CODE_ATTRIBUTION_HEADER": "0"}),
        _claude_argv,
    ),
    "codex": Client("codex", "codex", ("responses",), _version_of(["--version"]), _codex_setup, _codex_argv),
    "aider": Client("aider", "aider", ("chat",), _version_of(["--version"]), _aider_setup, _aider_argv),
    "opencode": Client("opencode", "opencode", ("chat",), _version_of(["--version"]), _opencode_setup, _opencode_argv),
    # OpenCode with a document pasted into its first prompt: turns that extend a long conversation
    "opencode-paste": Client(
        "opencode-paste", "opencode", ("chat",), _version_of(["--version"]), _opencode_setup, _opencode_paste_argv
    ),
    "qwen-code": Client("qwen-code", "qwen", ("chat",), _version_of(["--version"]), _qwen_setup, _qwen_argv),
    "llm": Client("llm", "llm", ("chat",), _version_of(["--version"], r"(\d+\.\d+(?:\.\d+)?)"), _llm_setup, _llm_argv),
}

#: Which APIs each server serves (mlx_lm.server: Chat Completions and text completions only).
SERVER_APIS = {
    "mlx-lm": ("chat",),
    "vllm-mlx": ("chat", "messages", "responses"),
    # LiteLLM translating Messages and Responses to mlx_lm.server's chat completions
    "mlx-lm+litellm": ("messages", "responses"),
}


class LogTail:
    """Follows a server log file, stamping each new line with the monotonic time it was read."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lines: list[tuple[float, str]] = []
        self._stop = threading.Event()
        self._pos = path.stat().st_size if path.exists() else 0
        self._buf = b""
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.poll()
            self._stop.wait(0.02)  # log polling interval, not a measurement

    def poll(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._pos)
                data = f.read()
        except OSError:
            return
        if not data:
            return
        self._pos += len(data)
        t = time.monotonic()
        self._buf += data
        *done, self._buf = self._buf.split(b"\n")
        self.lines.extend((t, line.decode("utf-8", "replace")) for line in done)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.poll()


@dataclasses.dataclass
class Server:
    name: str  # what the session folders call it: mlx-lm, vllm-mlx, mlx-lm+litellm
    url: str  # the model server itself
    model: str
    log_path: Path
    version: str
    model_dir: Path
    #: the tap in front of the model server
    tap: SessionTap | None = None
    #: where the proxy forwards to: the tap, or a gateway in front of it (LiteLLM)
    proxy_target: str = ""
    #: the tap's exchanges are what the proxy got back (no gateway between)
    tap_is_upstream: bool = True


@contextlib.contextmanager
def start_server(name: str, root: Path) -> Iterator[Server]:
    """The rigged model (one fixed short answer, whatever it is asked) on ``name``, with a tap in
    front of it (and LiteLLM in front of the tap for ``mlx-lm+litellm``)."""
    rig = build_rigged_model(root / "rigged-model")
    answer_always(rig, "<|rig_think|>")
    log = root / f"{name}.log"
    with contextlib.ExitStack() as stack:
        with cpu_affinity(SERVER_CPUS):
            if name.startswith("mlx-lm"):
                import mlx_lm

                # many prefill steps: a prompt of a thousand tokens takes long enough to compare a hit with a miss
                extra = ["--prefill-step-size", PREFILL_STEP]
                url = stack.enter_context(
                    mlx_lm_server(rig.path, max_tokens=OUTPUT_TOKENS, log_path=log, extra_args=extra)
                )
                version = f"mlx_lm.server {mlx_lm.__version__} (--prefill-step-size {PREFILL_STEP})"
                server = Server(name, url, MODEL_NAME, log, version, rig.path)
            else:
                reason = unavailable_reason(name)
                if reason:
                    raise RuntimeError(reason)
                from .live_servers import SERVERS_DIR, SPECS

                venv = SERVERS_DIR / SPECS[name].venv
                version = subprocess.run(
                    [
                        str(venv / "bin/python"),
                        "-c",
                        "from importlib.metadata import version; print(version('vllm-mlx'))",
                    ],
                    capture_output=True,
                    text=True,
                    timeout=60,
                ).stdout.strip()
                srv = stack.enter_context(live_server(name, rig.path, log_path=log))
                server = Server(name, srv.url, srv.model, log, f"vllm-mlx {version}", rig.path)
        server.tap = stack.enter_context(session_tap(int(server.url.rsplit(":", 1)[1])))
        server.proxy_target = server.tap.url
        if name.endswith("+litellm"):
            gw, version = stack.enter_context(litellm_gateway(server.tap.url, server.model, root))
            server.proxy_target, server.tap_is_upstream = gw, False
            server.version += f" behind LiteLLM {version}"
        yield server


LITELLM = REPO / ".ci-tools/litellm-venv/bin/litellm"


@contextlib.contextmanager
def litellm_gateway(target: str, model: str, root: Path) -> Iterator[tuple[str, str]]:
    """LiteLLM's proxy translating Messages and Responses to ``target``'s chat completions, as the
    issue's recordings had it (real2's harness: ``hosted_vllm/<model>``, chat completions API)."""
    if not LITELLM.exists():
        raise RuntimeError(f"{LITELLM} not found: .ci/install-clients installs LiteLLM's proxy there")
    cfg = root / "litellm.yaml"
    cfg.write_text(
        "model_list:\n"
        f"  - model_name: {model}\n"
        "    litellm_params:\n"
        f"      model: hosted_vllm/{model}\n"
        f"      api_base: {target}/v1\n"
        "      api_key: none\n"
        "      use_chat_completions_api: true\n"
        "litellm_settings:\n  telemetry: false\n  num_retries: 0\n"
        "general_settings:\n  master_key: dummy\n"
    )
    port = free_port()
    env = loopback_env(LITELLM_LOCAL_MODEL_COST_MAP="True", LITELLM_TELEMETRY="False", HOME=str(root))
    log = open(root / "litellm.log", "wb")
    proc = subprocess.Popen(
        [str(LITELLM), "--config", str(cfg), "--host", "127.0.0.1", "--port", str(port), "--num_workers", "1"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        import httpx

        deadline = time.monotonic() + 180
        while True:
            try:
                if httpx.get(url + "/health/liveliness", timeout=2, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"LiteLLM did not start: {(root / 'litellm.log').read_text()[-2000:]}")
            time.sleep(0.5)  # start-up polling, not a measurement
        version = subprocess.run(
            [str(LITELLM.parent / "python"), "-c", "from importlib.metadata import version; print(version('litellm'))"],
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout.strip()
        yield url, version
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        log.close()


def _request_id(response: bytes) -> str | None:
    m = re.search(rb"(?im)^x-mlxproxy-request-id:\s*(\S+)", response.split(b"\r\n\r\n", 1)[0])
    return m.group(1).decode() if m else None


def record_session(
    client: Client,
    server: Server,
    out_root: Path,
    *,
    turns: int,
    capture: Path,
    proxy_port: int,
) -> Path:
    binary, searched = find_client(client.binary)
    if binary is None:
        raise RuntimeError(f"{client.binary} not found (looked in {', '.join(searched)})")
    version = client.version(binary)
    folder = out_root / f"{client.name}_{version}__{server.name}"
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    base = WORK_ROOT / client.name
    if base.exists():
        shutil.rmtree(base)
    home, work = base / "home", base / "work"
    home.mkdir(parents=True)
    work.mkdir(parents=True)
    invocations: list[dict[str, Any]] = []
    tail = LogTail(server.log_path)
    with session_tap(proxy_port) as tap:
        ctx = Ctx(tap.url, server.model, home, work, server.name)
        env = loopback_env(HOME=str(home), **client.setup(ctx))
        t0 = time.monotonic()
        for i in range(turns):
            prompt = PROMPTS[i % len(PROMPTS)]
            argv = client.argv(binary, ctx, i, prompt)
            start = time.monotonic()
            with cpu_affinity(CLIENT_CPUS):
                try:
                    res = subprocess.run(
                        argv,
                        cwd=work,
                        env=env,
                        stdin=subprocess.DEVNULL,
                        capture_output=True,
                        text=True,
                        timeout=CLIENT_TIMEOUT_S,
                    )
                    rc, out, err = res.returncode, res.stdout, res.stderr
                except subprocess.TimeoutExpired as exc:
                    rc, out, err = None, str(exc.stdout or ""), str(exc.stderr or "")
            end = time.monotonic()
            invocations.append(
                {
                    "cli_turn": i + 1,
                    "argv": [Path(argv[0]).name, *argv[1:]],
                    "prompt": prompt,
                    "exit_code": rc,
                    "t_start": round(start - t0, 4),
                    "t_end": round(end - t0, 4),
                    "stdout_tail": out[-1500:],
                    "stderr_tail": err[-1500:],
                }
            )
            print(f"{client.name} turn {i + 1}: exit {rc} in {end - start:.1f} s: {out.strip()[-200:]!r}", flush=True)
            if rc != 0:
                break
        time.sleep(0.5)  # let the last log lines and capture lines land (not a measurement)
        exchanges = tap.exchanges()
    tail.stop()
    up = [e for e in server.tap.exchanges() if e.t_sent >= t0] if server.tap is not None else []
    _write(folder, client, version, server, env, exchanges, invocations, tail, t0, capture, home, up)
    return folder


def record_with_proxy(client: Client, server: Server, out_root: Path, *, turns: int) -> Path:
    """One session through a proxy of its own (a fresh prefix index: what mlxproxy says about this
    session alone) forwarding to ``server.proxy_target``."""
    cfg = {"tokenizer": str(server.model_dir / "tokenizer.json")}
    with mlxproxy_serve(server.proxy_target, cfg, capture=True, startup_timeout_s=60) as px:
        assert px.capture_path is not None
        port = int(px.url.rsplit(":", 1)[1])
        return record_session(client, server, out_root, turns=turns, capture=px.capture_path, proxy_port=port)


def record_through_one_proxy(clients: list[Client], server: Server, out_root: Path, *, turns: int) -> list[Path]:
    """The sessions of ``clients``, one after the other, through ONE proxy (one prefix index: what
    mlxproxy says about a session after the sessions before it, as a proxy that runs all day
    does). Each folder's ``session.json`` names the sessions that went before it (``after``)."""
    cfg = {"tokenizer": str(server.model_dir / "tokenizer.json")}
    folders: list[Path] = []
    with mlxproxy_serve(server.proxy_target, cfg, capture=True, startup_timeout_s=60) as px:
        assert px.capture_path is not None
        port = int(px.url.rsplit(":", 1)[1])
        for client in clients:
            folder = record_session(client, server, out_root, turns=turns, capture=px.capture_path, proxy_port=port)
            session = json.loads((folder / "session.json").read_text())
            session["after"] = [f.name for f in folders]  # through the same proxy, in this order
            if folders:
                session["proxy"] = (
                    f"the mlxproxy serve of the sessions before it ({', '.join(session['after'])}): its conversation "
                    "index had seen them"
                )
            (folder / "session.json").write_text(json.dumps(session, indent=2) + "\n")
            folders.append(folder)
    return folders


def _scrub_env(env: dict[str, str]) -> dict[str, str]:
    keep = {}
    base = os.environ
    for k, v in env.items():
        if base.get(k) == v and k not in ("HOME",):
            continue  # inherited, not set for the client
        keep[k] = "dummy" if re.search(r"KEY|TOKEN|SECRET", k) and v else v
    return keep


def _write(
    folder: Path,
    client: Client,
    version: str,
    server: Server,
    env: dict[str, str],
    exchanges: list[Exchange],
    invocations: list[dict[str, Any]],
    tail: LogTail,
    t0: float,
    capture: Path,
    home: Path,
    upstream: list[Exchange],
) -> None:
    index = []
    ids = []
    free = list(upstream)
    for n, ex in enumerate(exchanges, 1):
        # what the proxy sent the server for it: the next upstream request on the same path
        # sent after this one arrived (the proxy forwards in arrival order)
        # (behind a gateway: the next chat completion it sent the server; kept as turnN.server.*,
        # since it is not what the proxy got back)
        same = server.tap_is_upstream
        up = next((u for u in free if (u.path == ex.path or not same) and u.t_sent >= ex.t_sent), None)
        if up is not None:
            free.remove(up)
            kind = "upstream" if same else "server"
            (folder / f"turn{n}.{kind}.request").write_bytes(up.request)
            (folder / f"turn{n}.{kind}.response").write_bytes(up.response)
            marks = [[off, round(t - ex.t_sent, 6)] for off, t in up.response_marks]
            (folder / f"turn{n}.{kind}.marks.json").write_text(json.dumps(marks) + "\n")
        head, body = ex.head_and_body()
        (folder / f"turn{n}.headers").write_bytes(head + b"\r\n")
        (folder / f"turn{n}.request.json").write_bytes(body)
        (folder / f"turn{n}.response").write_bytes(ex.response)
        rel = {
            "t_sent_session": round(ex.t_sent - t0, 6),
            "t_request_end": round(ex.t_request_end - ex.t_sent, 6),
            "t_first_byte": None if ex.t_first_byte is None else round(ex.t_first_byte - ex.t_sent, 6),
            "t_first_token": None if ex.t_first_token is None else round(ex.t_first_token - ex.t_sent, 6),
            "t_end": None if ex.t_end is None else round(ex.t_end - ex.t_sent, 6),
        }
        (folder / f"turn{n}.timing.json").write_text(json.dumps(rel, indent=2) + "\n")
        marks = [[off, round(t - ex.t_sent, 6)] for off, t in ex.response_marks]
        (folder / f"turn{n}.response.marks.json").write_text(json.dumps(marks) + "\n")
        cli_turn = next(
            (inv["cli_turn"] for inv in invocations if inv["t_start"] - 0.01 <= ex.t_sent - t0 <= inv["t_end"] + 0.01),
            None,
        )
        rid = _request_id(ex.response)
        ids.append(rid)
        index.append(
            {
                "n": n,
                "method": ex.method,
                "path": ex.path,
                "cli_turn": cli_turn,
                "request_id": rid,
                "upstream": up is not None,
            }
        )
    # the proxy's own records (capture lines) for these requests
    wanted = {i for i in ids if i}
    lines = []
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        lines = []
        if capture.exists():
            for line in capture.read_text().splitlines():
                try:
                    if json.loads(line).get("id") in wanted:
                        lines.append(line)
                except ValueError:
                    pass
        if len(lines) >= len(wanted):
            break
        time.sleep(0.2)  # waiting for the capture file, not a measurement
    (folder / "records.jsonl").write_text("".join(line + "\n" for line in lines))
    (folder / "server.log").write_text("".join(f"{t - t0:.4f}\t{line}\n" for t, line in tail.lines))
    session = {
        "client": client.name,
        "client_version": version,
        "server": server.name,
        "server_version": server.version,
        "model": server.model,
        "env": _scrub_env(env),
        "home": str(home),
        "work": str(home.parent / "work"),
        "invocations": invocations,
        "exchanges": index,
        "recorded": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "platform": f"{sys.platform} CPU, {os.cpu_count()} cores",
    }
    (folder / "session.json").write_text(json.dumps(session, indent=2) + "\n")


def _ttft(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """One streamed request straight to the server: TTFT (first token-bearing event) and usage."""
    import httpx

    from .sessiontruth import cached_of, events, prompt_of, usage_in

    body = {**body, "stream": True}
    if path.endswith("/chat/completions"):
        body["stream_options"] = {"include_usage": True}
    t0 = time.monotonic()
    ttft = None
    data = bytearray()
    with httpx.Client(timeout=300, trust_env=False) as http:
        with http.stream("POST", url + path, json=body, headers={"anthropic-version": "2023-06-01"}) as r:
            for chunk in r.iter_bytes():
                data += chunk
                if ttft is None and _TOKEN.search(data):
                    ttft = time.monotonic() - t0
    total = time.monotonic() - t0
    usage = None
    for ev in events(bytes(data)):
        usage = usage_in(ev) or usage
    return {
        "ttft_s": None if ttft is None else round(ttft, 6),
        "total_s": round(total, 6),
        "prompt_tokens": prompt_of(usage),
        "cached_tokens": cached_of(usage),
    }


def _nonce_body(body: dict[str, Any], nonce: str) -> dict[str, Any]:
    """``body`` with ``nonce`` at the very start of its prompt (the first text the server renders),
    so nothing of it can come from the server's prompt cache."""
    b = json.loads(json.dumps(body))
    if isinstance(b.get("instructions"), str):
        b["instructions"] = nonce + b["instructions"]
        return b
    sys_ = b.get("system")
    if isinstance(sys_, str):
        b["system"] = nonce + sys_
        return b
    if isinstance(sys_, list) and sys_ and isinstance(sys_[0].get("text"), str):
        sys_[0]["text"] = nonce + sys_[0]["text"]
        return b
    msgs = b.get("messages") or b.get("input")
    if isinstance(msgs, list) and msgs:
        m = msgs[0]
        if isinstance(m.get("content"), str):
            m["content"] = nonce + m["content"]
        elif isinstance(m.get("content"), list) and m["content"]:
            part = m["content"][0]
            for key in ("text",):
                if isinstance(part.get(key), str):
                    part[key] = nonce + part[key]
    return b


#: a prompt below this many body bytes is measured REPEATS times (the median kept); a longer one once
SMALL_BODY = 40_000
REPEATS = 3


def _median(xs: list[float]) -> float | None:
    xs = sorted(x for x in xs if x is not None)
    return xs[len(xs) // 2] if xs else None


def _server_body(folder: Path, ex: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    path = ex["path"].split("?", 1)[0]
    body = json.loads((folder / f"turn{ex['n']}.request.json").read_bytes())
    behind = folder / f"turn{ex['n']}.server.request"
    if behind.exists():  # behind a gateway: what it sent the server, straight to the server
        return "/v1/chat/completions", json.loads(behind.read_bytes().partition(b"\r\n\r\n")[2])
    return path, body


def _generation_requests(folder: Path) -> Iterator[tuple[dict[str, Any], bool, str, dict[str, Any]]]:
    """A recorded session's generation requests in order: the exchange, whether the truth calls it
    a turn (``sessiontruth.expected``), and the path and body to send the server straight."""
    from .sessiontruth import GENERATION_PATHS, expected

    session = json.loads((folder / "session.json").read_text())
    want = expected(folder)
    for ex in session["exchanges"]:
        if ex["method"] != "POST" or ex["path"].split("?", 1)[0] not in GENERATION_PATHS:
            continue
        path, body = _server_body(folder, ex)
        yield ex, want.get(ex["n"], {}).get("role") == "turn", path, body


def calibrate(folder: Path, server: Server, *, prime: bool = False) -> None:
    """Each turn of the session sent again straight to the server (``calibration.json``): cold (a
    nonce at the prompt's start: nothing cached), warm (the exact body again: all cached), and after
    the previous turn (the previous turn's body, then this one: the cache as the session left it for
    this turn). ``after_previous - warm`` is what the turn's re-prefill cost, measured under the same
    conditions within seconds; small prompts are measured REPEATS times and the medians kept."""
    import uuid

    out: dict[str, Any] = {}
    previous: dict[str, Any] | None = None
    for ex, is_turn, path, body in _generation_requests(folder):
        reps = REPEATS if len(json.dumps(body)) < SMALL_BODY else 1
        cold = [_ttft(server.url, path, _nonce_body(body, f"[{uuid.uuid4().hex}] ")) for _ in range(reps)]
        entry: dict[str, Any] = {"repeats": reps}
        if is_turn and previous is not None:
            # the previous turn then this one, both behind one fresh nonce: the server can reuse
            # exactly what the two share, as in the session, and nothing it cached before; then
            # this one again, all cached
            after, again = [], []
            for _ in range(reps):
                nonce = f"[{uuid.uuid4().hex}] "
                _ttft(server.url, previous["path"], _nonce_body(previous["body"], nonce))
                after.append(_ttft(server.url, path, _nonce_body(body, nonce)))
                again.append(_ttft(server.url, path, _nonce_body(body, nonce)))
            entry["after_previous"] = {"ttft_s": _median([a["ttft_s"] for a in after]), "runs": after}
            entry["warm_same_nonce"] = {"ttft_s": _median([a["ttft_s"] for a in again]), "runs": again}
        elif prime:  # a fresh server: the exact prompt sent once before it is measured warm
            _ttft(server.url, path, body)
        warm = [_ttft(server.url, path, body) for _ in range(reps)]
        entry["cold"] = {**cold[0], "ttft_s": _median([c["ttft_s"] for c in cold]), "runs": cold}
        entry["warm"] = {**warm[0], "ttft_s": _median([w["ttft_s"] for w in warm]), "runs": warm}
        out[str(ex["n"])] = entry
        if is_turn:
            previous = {"path": path, "body": body}
    (folder / "calibration.json").write_text(json.dumps(out, indent=2) + "\n")


#: the servers ``calibrate_conversation_cache`` can run: vllm-mlx with a cache that keeps the
#: conversation (``--continuous-batching``: its BatchedEngine's prefix cache, on by default), or with
#: ``--prefix-trie-cache`` (0.6.0 with mlx-lm 0.31.3: never hits, see FINDINGS.md); it writes
#: ``calibration.<server>.json`` beside ``calibration.json``
CONVERSATION_CACHE_SERVERS = ("vllm-mlx-cb", "vllm-mlx-trie")


#: runs per turn on the conversation cache: its hit's TTFT is short against a busy machine's noise,
#: so the least of them is kept beside the median (the load of a shared machine only adds)
CONVERSATION_CACHE_RUNS = 5


def calibrate_conversation_cache(folder: Path, server: Server, log: Path) -> None:
    """Each turn after the first of a session recorded on vllm-mlx's default (a cache of the system
    prompt only) sent again to ``server``, vllm-mlx with a cache meant to keep the conversation
    (``CONVERSATION_CACHE_SERVERS``): the previous turn's body, then this one, both behind one fresh
    nonce, ``CONVERSATION_CACHE_RUNS`` times, the median and the least kept
    (``calibration.<server>.json``). Its ``after_previous`` TTFT is what the turn would
    have taken on a server that kept the conversation; the log lines say what that server reused."""
    import uuid

    turns: dict[str, Any] = {}
    previous: dict[str, Any] | None = None
    for ex, is_turn, path, body in _generation_requests(folder):
        if not is_turn:
            continue
        if previous is not None:
            runs, lines = [], []
            for _ in range(CONVERSATION_CACHE_RUNS):
                nonce = f"[{uuid.uuid4().hex}] "
                _ttft(server.url, previous["path"], _nonce_body(previous["body"], nonce))
                seen = len(log.read_text(errors="replace").splitlines())
                runs.append(_ttft(server.url, path, _nonce_body(body, nonce)))
                new = log.read_text(errors="replace").splitlines()[seen:]
                lines += [ln for ln in new if re.search(r"(?i)cache (hit|miss)|cached=", ln)]
            turns[str(ex["n"])] = {
                "after_previous": {
                    "ttft_s": _median([r["ttft_s"] for r in runs]),
                    "least_ttft_s": min((r["ttft_s"] for r in runs if r["ttft_s"] is not None), default=None),
                    "runs": runs,
                },
                "log": lines,
            }
        previous = {"path": path, "body": body}
    out = {"server": server.version, "turns": turns}
    (folder / f"calibration.{server.name}.json").write_text(json.dumps(out, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", required=True, choices=sorted(SERVER_APIS))
    ap.add_argument("--client", action="append", choices=sorted(CLIENTS))
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument(
        "--one-proxy", action="store_true", help="the --client sessions in the order given, through one proxy"
    )
    ap.add_argument("--out", type=Path, default=Path("recordings"))
    ap.add_argument("--root", type=Path, default=WORK_ROOT / "_stack")
    ap.add_argument("--calibrate-only", type=Path, nargs="*", help="recorded session folders to calibrate again")
    ap.add_argument(
        "--conversation-cache",
        type=Path,
        nargs="*",
        help="vllm-mlx session folders: their turns again on a vllm-mlx that keeps the conversation, for what a "
        "system-prompt-only cache lost",
    )
    ap.add_argument("--conversation-cache-server", choices=CONVERSATION_CACHE_SERVERS, default="vllm-mlx-cb")
    args = ap.parse_args(argv)
    from .sessiontruth import write_truth

    if args.conversation_cache:
        name = args.conversation_cache_server
        root = args.root / f"{name}-calibrate"
        if root.exists():
            shutil.rmtree(root)
        root.mkdir(parents=True)
        with start_server(name, root) as server:
            server.version += {"vllm-mlx-cb": " --continuous-batching", "vllm-mlx-trie": " --prefix-trie-cache"}[name]
            for folder in args.conversation_cache:
                calibrate_conversation_cache(folder, server, server.log_path)
                write_truth(folder)
                print(f"calibrated {folder} on a conversation cache", flush=True)
        return 0

    if args.calibrate_only:
        root = args.root / f"{args.server}-calibrate"
        if root.exists():
            shutil.rmtree(root)
        root.mkdir(parents=True)
        with start_server(args.server, root) as server:
            for folder in args.calibrate_only:
                calibrate(folder, server, prime=True)
                write_truth(folder, server.model_dir if args.server.startswith("mlx-lm") else None)
                print(f"calibrated {folder}", flush=True)
        return 0

    root = args.root / args.server
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    clients = [CLIENTS[c] for c in (args.client or sorted(CLIENTS))]
    clients = [c for c in clients if set(c.apis) & set(SERVER_APIS[args.server])]
    folders: list[Path] = []
    with start_server(args.server, root) as server:
        if args.one_proxy:
            folders = record_through_one_proxy(clients, server, args.out, turns=args.turns)
        for k, client in enumerate(clients):
            try:
                folder = folders[k] if args.one_proxy else record_with_proxy(client, server, args.out, turns=args.turns)
            except RuntimeError as exc:
                print(f"{client.name}: skipped: {exc}", flush=True)
                continue
            try:
                calibrate(folder, server)
            except Exception as exc:
                print(f"{client.name}: calibration failed: {type(exc).__name__}: {exc}", flush=True)
            try:
                write_truth(folder, server.model_dir if server.name.startswith("mlx-lm") else None)
            except Exception as exc:  # the recording stays; the truth can be written again
                print(f"{client.name}: truth not written: {type(exc).__name__}: {exc}", flush=True)
            print(f"{client.name}: recorded into {folder}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
