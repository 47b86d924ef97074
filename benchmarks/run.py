"""Side-by-side proxy benchmark: direct vs `mlxproxy serve` (vs nginx, LiteLLM), one run.

    .venv/bin/python benchmarks/run.py            # full run, ~10 minutes
    .venv/bin/python benchmarks/run.py --quick    # smoke version, ~1-2 minutes

Process tree (each its own process, so nothing shares a GIL): this orchestrator (idle
while measuring), benchmarks/upstream.py (fast SSE upstream), `python -m mlxproxy serve`
(plus a second one with `--capture`), nginx and LiteLLM when installed, and
benchmarks/loadgen.py (raw asyncio client). The same workload runs against every target
in interleaved rounds (the order rotates each round), so slow drift of a shared, noisy
machine hits all of them alike. Results are medians across rounds and ratios to the
direct run of the same round; see benchmarks/README.md for definitions.

Loopback only, free ports, every loop bounded in count and time; every child is killed
at the end, on Ctrl-C, on SIGTERM and (PR_SET_PDEATHSIG) if this process dies.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
PY = sys.executable
CLK_TCK = os.sysconf("SC_CLK_TCK")
HOST = "127.0.0.1"
# $MLXPROXY_LITELLM, else `litellm` on PATH (no machine-specific default)
LITELLM_DEFAULT = os.environ.get("MLXPROXY_LITELLM") or shutil.which("litellm") or ""


def choose_litellm(option: str | None, quick: bool, found: str) -> tuple[str, str]:
    """(executable, why it is left out): from `--litellm` (None: not given; a bare name is looked
    up on PATH), else `found` ($MLXPROXY_LITELLM or `litellm` on PATH). Exactly one is non-empty."""
    if option is not None:
        return (shutil.which(option) or option, "") if option else ("", "left out (--litellm '')")
    if quick:
        return "", "left out with --quick (its start-up takes 20 s; --litellm PATH includes it)"
    if found and os.path.exists(found):
        return found, ""
    return "", "not found: set $MLXPROXY_LITELLM or --litellm PATH, or put `litellm` on PATH"


# -- targets (the issue's figures, 2-core machine, ratios measured in one run) ------------
# the targets of the timing issue (default install and fast stack alike)
T_SEQ_P50_MS = 0.3
T_SEQ_P99_MS = 2.0
T_TTFT_P50_MS = 0.5
T_EVENT_P99_MS = 0.5
T_64_RATIO = 0.97
T_64_GAP_MS = 2.0
T_256_RATIO = 0.95
T_256_GAP_MS = 5.0
T_CPU_US = 30.0
T_CAPTURE = 0.20
T_RSS_MB = 150.0
T_RSS_GROWTH_MB = 2.0


# == processes =============================================================================


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGKILL it if the harness dies (Linux)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class Children:
    """Every process the harness started; `kill_all()` ends them (their own process
    groups, by id) and is safe to call twice."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[Any]] = []

    def spawn(self, argv: Sequence[str], **kw: Any) -> subprocess.Popen[Any]:
        kw.setdefault("stdin", subprocess.DEVNULL)
        p = subprocess.Popen(list(argv), start_new_session=True, preexec_fn=_die_with_parent, **kw)
        self.procs.append(p)
        return p

    def stop(self, p: subprocess.Popen[Any], grace_s: float = 3.0) -> None:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                p.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(p.pid, signal.SIGKILL)  # stragglers in its group (workers)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            p.wait(2)
        except subprocess.TimeoutExpired:
            pass

    def kill_all(self) -> None:
        for p in reversed(self.procs):
            self.stop(p)
        self.procs.clear()


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def wait_http(url: str, proc: subprocess.Popen[Any], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            if http_get(url, 1.0)[0] < 500:
                return True
        except OSError:
            pass
        time.sleep(0.1)
    return False


def pgroup_pids(pgid: int) -> list[int]:
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    rest = f.read().rsplit(")", 1)[1].split()
                if int(rest[2]) == pgid:
                    pids.append(int(d))
            except (OSError, IndexError, ValueError):
                pass
    return pids


def proc_cpu(pid: int) -> float:
    """utime + stime of one process, seconds (/proc/PID/stat fields 14 and 15)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            rest = f.read().rsplit(")", 1)[1].split()
        return (int(rest[11]) + int(rest[12])) / CLK_TCK
    except (OSError, IndexError, ValueError):
        return 0.0


def system_busy_s() -> float:
    """CPU seconds all cores spent busy since boot (/proc/stat: user nice system irq softirq steal)."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return (v[0] + v[1] + v[2] + v[5] + v[6] + (v[7] if len(v) > 7 else 0)) / CLK_TCK
    except (OSError, ValueError, IndexError):
        return 0.0


def proc_mem_mb(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) in MB from /proc/PID/status."""
    rss = hwm = 0.0
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1]) / 1024
                elif line.startswith("VmHWM:"):
                    hwm = int(line.split()[1]) / 1024
    except OSError:
        pass
    return rss, hwm


@dataclass
class Target:
    name: str
    port: int
    proc: subprocess.Popen[Any] | None = None  # None: the direct path (upstream itself)
    group: bool = False  # count CPU over the whole process group (multi-process servers)
    note: str = ""
    only: Callable[[str, int], bool] = field(default=lambda mode, c: True)

    def cpu(self) -> float:
        if self.proc is None:
            return 0.0
        if self.group:
            return sum(proc_cpu(p) for p in pgroup_pids(self.proc.pid))
        return proc_cpu(self.proc.pid)

    def mem(self) -> tuple[float, float]:
        if self.proc is None:
            return 0.0, 0.0
        if self.group:
            rss = [proc_mem_mb(p) for p in pgroup_pids(self.proc.pid)]
            return sum(r for r, _ in rss), sum(h for _, h in rss)
        return proc_mem_mb(self.proc.pid)


class LoadGens:
    """One or more loadgen.py processes; a load job is split across them by streams."""

    def __init__(self, children: Children, n: int) -> None:
        self.children = children
        self.procs = [self._start() for _ in range(n)]

    def _start(self) -> subprocess.Popen[Any]:
        return self.children.spawn(
            [PY, os.path.join(HERE, "loadgen.py")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
        )

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def call(self, job: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        if job["kind"] != "load" or len(self.procs) == 1:
            return self._call_all([(self.procs[0], job)], timeout_s)[0]
        shares = [
            job["streams"] // len(self.procs) + (1 if i < job["streams"] % len(self.procs) else 0)
            for i in range(len(self.procs))
        ]
        jobs = [(p, {**job, "streams": s}) for p, s in zip(self.procs, shares) if s]
        return merge_load(self._call_all(jobs, timeout_s))

    def _call_all(
        self, jobs: list[tuple[subprocess.Popen[Any], dict[str, Any]]], timeout_s: float
    ) -> list[dict[str, Any]]:
        for p, job in jobs:
            assert p.stdin is not None
            p.stdin.write(json.dumps(job) + "\n")
            p.stdin.flush()
        out = []
        deadline = time.monotonic() + timeout_s
        for p, _ in jobs:
            assert p.stdout is not None
            left = deadline - time.monotonic()
            ready, _, _ = select.select([p.stdout], [], [], max(left, 0))
            line = p.stdout.readline() if ready else ""
            if not line:  # hung or dead: replace it so later jobs still run
                self.children.stop(p)
                self.procs[self.procs.index(p)] = self._start()
                out.append({"fatal": "load generator timed out or died", "errors": 1})
            else:
                out.append(json.loads(line))
        return out


def merge_load(parts: list[dict[str, Any]]) -> dict[str, Any]:
    m: dict[str, Any] = {
        "events": 0,
        "gaps": [],
        "lat": [],
        "errors": 0,
        "error_kinds": {},
        "requests": 0,
        "total_events": 0,
        "elapsed_s": 0.0,
        "client_cpu_s": 0.0,
        "window_s": 0.0,
    }
    for p in parts:
        if "fatal" in p:
            m["errors"] += 1
            m["error_kinds"]["fatal"] = m["error_kinds"].get("fatal", 0) + 1
            continue
        for k in ("events", "errors", "requests", "total_events", "client_cpu_s"):
            m[k] += p[k]
        m["gaps"] += p["gaps"]
        m["lat"] += p["lat"]
        m["elapsed_s"] = max(m["elapsed_s"], p["elapsed_s"])
        m["window_s"] = max(m["window_s"], p["window_s"])
        for k, v in p["error_kinds"].items():
            m["error_kinds"][k] = m["error_kinds"].get(k, 0) + v
    return m


# == starting the servers ==================================================================


def start_upstream(children: Children) -> tuple[subprocess.Popen[Any], int]:
    p = children.spawn([PY, os.path.join(HERE, "upstream.py"), "--port", "0"], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    ready, _, _ = select.select([p.stdout], [], [], 15)
    line = p.stdout.readline() if ready else ""
    if not line.startswith("READY "):
        raise RuntimeError(f"benchmark upstream did not start: {line!r}")
    return p, int(line.split()[1])


def capture_supported() -> bool:
    r = subprocess.run([PY, "-m", "mlxproxy", "serve", "--help"], capture_output=True, text=True, timeout=60, cwd=REPO)
    return "--capture" in r.stdout


def launch(
    children: Children, name: str, argv: list[str], workdir: str, health_url: str, timeout_s: float, **popen: Any
) -> tuple[subprocess.Popen[Any] | None, str]:
    """Start a target with its output in WORKDIR/NAME.log; wait until `health_url` answers.
    Returns the process (None, stopped, when it did not come up) and the log's path."""
    log = open(os.path.join(workdir, f"{name}.log"), "w")
    p = children.spawn(argv, stdout=log, stderr=subprocess.STDOUT, **popen)
    if wait_http(health_url, p, timeout_s):
        return p, log.name
    children.stop(p)
    return None, log.name


def start_mlxproxy(
    children: Children, name: str, up_port: int, workdir: str, capture: str | None = None, src: str | None = None
) -> Target:
    port = free_port()
    argv = [
        PY,
        "-m",
        "mlxproxy",
        "serve",
        "--upstream",
        f"http://{HOST}:{up_port}",
        "--port",
        str(port),
        "--log-level",
        "warning",
    ]
    if capture:
        argv += ["--capture", capture]
    env = dict(os.environ)
    if src:  # an experimental copy of the package (its folder holds `mlxproxy/`)
        env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    p, log = launch(children, name, argv, workdir, f"http://{HOST}:{port}/healthz", 30, env=env, cwd=src or REPO)
    if p is None:
        raise RuntimeError(f"{name} did not start; see {log}")
    return Target(name, port, p)


def start_floor(children: Children, up_port: int, workdir: str) -> Target:
    """benchmarks/floor.py: the same server stack and upstream client, no mlxproxy work."""
    port = free_port()
    argv = [PY, os.path.join(HERE, "floor.py"), "--upstream", f"http://{HOST}:{up_port}", "--port", str(port)]
    p, log = launch(children, "floor", argv, workdir, f"http://{HOST}:{port}/healthz", 30)
    if p is None:
        raise RuntimeError(f"floor did not start; see {log}")
    return Target("floor", port, p, note="uvicorn + the proxy's transport passthrough, no metering")


NGINX_CONF = """
daemon off;
master_process off;
worker_processes 1;
worker_rlimit_nofile 16384;
pid {d}/nginx.pid;
error_log {d}/nginx-error.log warn;
events {{ worker_connections 8192; }}
http {{
    access_log off;
    client_body_temp_path {d}/body;
    proxy_temp_path {d}/proxy;
    fastcgi_temp_path {d}/fastcgi;
    uwsgi_temp_path {d}/uwsgi;
    scgi_temp_path {d}/scgi;
    keepalive_requests 1000000;
    keepalive_timeout 120s;
    upstream bench {{ server {host}:{up}; keepalive 512; keepalive_requests 1000000; }}
    server {{
        listen {host}:{port};
        location / {{
            proxy_pass http://bench;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_request_buffering off;
            proxy_read_timeout 600s;
        }}
    }}
}}
"""


def start_nginx(children: Children, up_port: int, workdir: str) -> Target | None:
    exe = shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None)
    if exe is None:
        return None
    d = os.path.join(workdir, "nginx")
    os.makedirs(d, exist_ok=True)
    port = free_port()
    conf = os.path.join(d, "nginx.conf")
    with open(conf, "w") as f:
        f.write(NGINX_CONF.format(d=d, host=HOST, up=up_port, port=port))
    p, log = launch(
        children,
        "nginx",
        [exe, "-c", conf, "-p", d, "-e", os.path.join(d, "nginx-error.log")],
        workdir,
        f"http://{HOST}:{port}/health",
        15,
    )
    if p is None:
        print(f"  nginx did not start (see {log}); skipped", flush=True)
        return None
    return Target("nginx", port, p, note="1 worker, proxy_buffering off, upstream keepalive")


LITELLM_CONF = """
model_list:
  - model_name: bench
    litellm_params:
      model: openai/bench
      api_base: http://{host}:{up}/v1
      api_key: sk-bench
litellm_settings:
  drop_params: true
  telemetry: false
"""


def start_litellm(children: Children, exe: str, up_port: int, workdir: str, key: str) -> Target | None:
    if not exe or not os.path.exists(exe):
        return None
    port = free_port()
    conf = os.path.join(workdir, "litellm.yaml")
    with open(conf, "w") as f:
        f.write(LITELLM_CONF.format(host=HOST, up=up_port))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI", "LITELLM"))}
    env.update(
        {
            "LITELLM_MASTER_KEY": key,
            "LITELLM_LOG": "ERROR",
            "LITELLM_TELEMETRY": "False",
            "NO_DOCS": "True",
            "DISABLE_SCHEMA_UPDATE": "True",
        }
    )
    p, log = launch(
        children,
        "litellm",
        [exe, "--config", conf, "--host", HOST, "--port", str(port), "--num_workers", "1"],
        workdir,
        f"http://{HOST}:{port}/health/liveliness",
        120,
        env=env,
        cwd=workdir,
    )
    if p is None:
        print(f"  litellm did not start (see {log}); skipped", flush=True)
        return None
    return Target("litellm", port, p, group=True, note="1 worker")


# == statistics ============================================================================


def pct(xs: Sequence[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q / 100.0
    f = int(k)
    c = min(f + 1, len(s) - 1)
    return s[f] + (s[c] - s[f]) * (k - f)


def median(xs: Sequence[float | None]) -> float | None:
    v = [x for x in xs if x is not None]
    return pct(v, 50) if v else None


def sub(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def paired_added(
    target: list[dict[str, Any]], direct: list[dict[str, Any]], key: str
) -> tuple[float | None, float | None]:
    """Added p50 and p99: per round, the target's percentile minus the direct run's of the same
    round (run back to back), then the median over rounds, so one noisy round cannot decide."""
    d50, d99 = [], []
    for t, d in zip(target, direct):
        a, b = t.get(key, []), d.get(key, [])
        d50.append(sub(pct(a, 50), pct(b, 50)))
        d99.append(sub(pct(a, 99), pct(b, 99)))
    return median(d50), median(d99)


def ms(x: float | None, nd: int = 2, sign: bool = False) -> str:
    return "n/a" if x is None else f"{x * 1000:{'+' if sign else ''}.{nd}f} ms"


def fmt(x: float | None, f: str = ".2f", unit: str = "") -> str:
    return "n/a" if x is None else f"{x:{f}}{unit}"


# == the benchmark =========================================================================


@dataclass
class Plan:
    rounds: int
    seq_n: int
    ttft_n: int
    concs: tuple[int, ...]
    fast_concs: tuple[int, ...]
    window_s: float
    warmup_s: float
    paced_tokens: int
    fast_tokens: int
    rate: float
    churn_n: int
    capture_concs: tuple[int, ...]
    profile_s: float


FULL = Plan(
    rounds=3,
    seq_n=300,
    ttft_n=150,
    concs=(1, 16, 64, 256),
    fast_concs=(1, 16, 64, 256),
    window_s=2.5,
    warmup_s=1.2,
    paced_tokens=100,
    fast_tokens=100,
    rate=100.0,
    churn_n=10_000,
    capture_concs=(64, 256),
    profile_s=15.0,
)
QUICK = Plan(
    rounds=2,
    seq_n=100,
    ttft_n=40,
    concs=(1, 64, 256),
    fast_concs=(64,),
    window_s=1.0,
    warmup_s=1.0,
    paced_tokens=100,
    fast_tokens=100,
    rate=100.0,
    churn_n=1_000,
    capture_concs=(64,),
    profile_s=8.0,
)


class Bench:
    def __init__(self, args: argparse.Namespace, plan: Plan, children: Children, workdir: str) -> None:
        self.args = args
        self.plan = plan
        self.children = children
        self.workdir = workdir
        self.out_lines: list[str] = []
        self.results: dict[str, Any] = {"plan": plan.__dict__, "scenarios": {}}
        self.api_key = "sk-bench-" + os.urandom(12).hex()  # LiteLLM's master key; sent to every target alike
        self.foreign: list[tuple[float, float]] = []  # (CPU s used by processes outside this benchmark, wall s) per job

    def say(self, line: str = "") -> None:
        print(line, flush=True)
        self.out_lines.append(line)

    # -- setup --------------------------------------------------------------------------

    def setup(self) -> None:
        a = self.args
        self.upstream, self.up_port = start_upstream(self.children)
        self.direct = Target("direct", self.up_port, None)
        self.targets: list[Target] = [self.direct]
        self.mlx = start_mlxproxy(self.children, "mlxproxy", self.up_port, self.workdir)
        self.targets.append(self.mlx)
        for spec in a.extra_proxy:
            name, _, src = spec.partition("=")
            self.targets.append(
                start_mlxproxy(self.children, name, self.up_port, self.workdir, src=os.path.abspath(src))
            )
        self.capture: Target | None = None
        self.capture_note = ""
        if not a.no_capture:
            if capture_supported():
                cap_file = os.path.join(self.workdir, "capture.jsonl")
                cap_conc = set(self.plan.capture_concs)
                self.capture = start_mlxproxy(
                    self.children, "mlxproxy+capture", self.up_port, self.workdir, capture=cap_file
                )
                self.capture.only = lambda mode, c: c in cap_conc
                self.capture_file = cap_file
                self.targets.append(self.capture)
            else:
                self.capture_note = "capture: not available in this build"
        if not a.no_floor:
            self.targets.append(start_floor(self.children, self.up_port, self.workdir))
        if not a.no_nginx:
            ng = start_nginx(self.children, self.up_port, self.workdir)
            if ng is not None:
                self.targets.append(ng)
        if a.litellm:
            ll = start_litellm(self.children, a.litellm, self.up_port, self.workdir, self.api_key)
            if ll is not None:
                # 256 streams (and 64 unpaced) through LiteLLM would eat the time budget
                ll.only = lambda mode, c: c <= (64 if mode == "paced" else 16)
                self.targets.append(ll)
        self.gens = LoadGens(self.children, a.clients)

    def describe(self) -> None:
        cpu = "?"
        try:
            with open("/proc/cpuinfo") as f:
                for line in f:
                    if line.startswith("model name"):
                        cpu = line.split(":", 1)[1].strip()
                        break
        except OSError:
            pass
        self.say(
            f"machine: {os.cpu_count()} cores (nproc {len(os.sched_getaffinity(0))}), CPU: {cpu}, "
            f"{platform.system()} {platform.release()}, Python {platform.python_version()}"
        )
        import importlib.metadata as md

        vers = []
        for pkg in ("uvicorn", "aiohttp", "uvloop", "httptools"):
            try:
                vers.append(f"{pkg} {md.version(pkg)}")
            except md.PackageNotFoundError:
                pass
        from mlxproxy.edge.runner import stack_settings

        loop, http = stack_settings(self.args.stack)
        self.say(
            f"proxy stack: {loop} + {http} (--stack {self.args.stack or 'default'}); installed: " + ", ".join(vers)
        )
        self.say("targets: " + ", ".join(t.name + (f" ({t.note})" if t.note else "") for t in self.targets))
        p = self.plan
        self.say(
            f"plan: {p.rounds} interleaved rounds; seq {p.seq_n} req/round; ttft {p.ttft_n} req/round; "
            f"streams {p.concs} x {p.rate:g} tok/s and {p.fast_concs} as fast as possible; "
            f"window {p.window_s}s after {p.warmup_s}s warm-up; {p.paced_tokens} tokens/request; "
            f"load generator processes: {self.args.clients}"
        )
        if self.capture_note:
            self.say(self.capture_note)

    def set_rate(self, rate: float) -> None:
        status, _ = http_get(f"http://{HOST}:{self.up_port}/_bench/config?rate={rate:g}")
        if status != 200:
            raise RuntimeError("cannot configure the benchmark upstream")

    # -- one job against one target, with CPU accounting -----------------------------

    def our_cpu(self) -> float:
        """CPU seconds of this benchmark's whole process tree (to tell other processes' load apart)."""
        return sum(proc_cpu(p) for p in [self.upstream.pid, os.getpid()] + self.gens.pids) + sum(
            x.cpu() for x in self.targets if x.proc is not None
        )

    def run_job(self, t: Target, job: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        job = {**job, "host": HOST, "port": t.port, "auth": self.api_key, "shape": self.args.body}
        mine0 = self.our_cpu()
        cpu0, up0, busy0, w0 = t.cpu(), proc_cpu(self.upstream.pid), system_busy_s(), time.monotonic()
        res = self.gens.call(job, timeout_s)
        res["proxy_cpu_s"] = t.cpu() - cpu0
        res["upstream_cpu_s"] = proc_cpu(self.upstream.pid) - up0
        wall = time.monotonic() - w0
        foreign = (system_busy_s() - busy0) - (self.our_cpu() - mine0)
        res["foreign_cores"] = max(foreign, 0.0) / wall if wall > 0 else 0.0  # other processes on the machine
        self.foreign.append((max(foreign, 0.0), wall))
        return res

    def rounds(
        self, targets: list[Target], job: dict[str, Any], timeout_s: float, pause_s: float = 0.2
    ) -> dict[str, list[dict[str, Any]]]:
        out: dict[str, list[dict[str, Any]]] = {t.name: [] for t in targets}
        for r in range(self.plan.rounds):
            k = r % len(targets)
            for t in targets[k:] + targets[:k]:
                out[t.name].append(self.run_job(t, job, timeout_s))
                time.sleep(pause_s)
        return out

    # -- scenarios ----------------------------------------------------------------------

    def warm(self) -> None:
        self.set_rate(0)
        for t in self.targets:
            self.run_job(t, {"kind": "seq", "n": 30}, 60)
            self.run_job(t, {"kind": "seq", "n": 10, "stream": True, "tokens": 8}, 60)

    def seq(self) -> None:
        p = self.plan
        self.say(f"\n[1/5] sequential non-streaming requests ({p.seq_n} per round per target)")
        res = self.rounds(self.targets, {"kind": "seq", "n": p.seq_n, "max_s": 60}, 90, 0.1)
        self.results["scenarios"]["seq"] = {
            k: [{"lat": r.get("lat", []), "errors": r.get("errors")} for r in v] for k, v in res.items()
        }
        base = [x for r in res["direct"] for x in r.get("lat", [])]
        self.seq_added: dict[str, tuple[float | None, float | None]] = {}
        self.say(f"  direct: p50 {ms(pct(base, 50), 3)}  p99 {ms(pct(base, 99), 3)}  (n={len(base)})")
        for t in self.targets[1:]:
            lat = [x for r in res[t.name] for x in r.get("lat", [])]
            errs = sum(r.get("errors", 0) for r in res[t.name])
            a50, a99 = paired_added(res[t.name], res["direct"], "lat")
            self.seq_added[t.name] = (a50, a99)
            cpu = sum(r["proxy_cpu_s"] for r in res[t.name]) / max(len(lat), 1)
            self.say(
                f"  {t.name}: p50 {ms(pct(lat, 50), 3)}  p99 {ms(pct(lat, 99), 3)}  added p50 {ms(a50, 3)}  "
                f"added p99 {ms(a99, 3)}  cpu/request {cpu * 1e6:.0f} us  errors {errs}"
            )

    def ttft(self) -> None:
        p = self.plan
        self.say(f"\n[2/5] single stream TTFT (8-token streams, as fast as possible, {p.ttft_n} per round per target)")
        self.set_rate(0)
        res = self.rounds(
            self.targets, {"kind": "seq", "n": p.ttft_n, "stream": True, "tokens": 8, "max_s": 60}, 90, 0.1
        )
        self.results["scenarios"]["ttft"] = {
            k: [{"ttft": r.get("ttft", []), "errors": r.get("errors")} for r in v] for k, v in res.items()
        }
        base = [x for r in res["direct"] for x in r.get("ttft", [])]
        self.ttft_added: dict[str, tuple[float | None, float | None]] = {}
        self.say(f"  direct: TTFT p50 {ms(pct(base, 50), 3)}  p99 {ms(pct(base, 99), 3)}")
        for t in self.targets[1:]:
            v = [x for r in res[t.name] for x in r.get("ttft", [])]
            errs = sum(r.get("errors", 0) for r in res[t.name])
            a50, a99 = paired_added(res[t.name], res["direct"], "ttft")
            self.ttft_added[t.name] = (a50, a99)
            self.say(
                f"  {t.name}: TTFT p50 {ms(pct(v, 50), 3)}  p99 {ms(pct(v, 99), 3)}  added p50 {ms(a50, 3)}  "
                f"added p99 {ms(a99, 3)}  errors {errs}"
            )

    def load(self) -> None:
        p = self.plan
        self.say(f"\n[3/5] concurrent streams: {p.rate:g} tok/s per stream, then as fast as possible")
        self.load_rows: list[dict[str, Any]] = []
        modes = [("paced", p.rate, p.concs, p.paced_tokens), ("fast", 0.0, p.fast_concs, p.fast_tokens)]
        for mode, rate, concs, tokens in modes:
            self.set_rate(rate)
            for c in concs:
                targets = [t for t in self.targets if t.proc is None or t.only(mode, c)]
                # paced: starts spread over one request's duration so request boundaries are not in step;
                # fast: a short ramp and warm-up, there is no pacing to settle
                ramp, warmup = (min(1.0, p.warmup_s * 0.8), p.warmup_s) if mode == "paced" else (0.2, 0.6)
                job = {
                    "kind": "load",
                    "streams": c,
                    "tokens": tokens,
                    "warmup_s": warmup,
                    "window_s": p.window_s,
                    "ramp_s": ramp,
                    "timeout": 30,
                    "drain_s": 5,
                }
                res = self.rounds(targets, job, warmup + p.window_s + 40, 0.3)
                row = self.summarise(mode, rate, c, tokens, targets, res)
                self.load_rows.append(row)
                self.print_row(row)

    def summarise(
        self, mode: str, rate: float, c: int, tokens: int, targets: list[Target], res: dict[str, list[dict[str, Any]]]
    ) -> dict[str, Any]:
        d = res["direct"]

        def eps(r: dict[str, Any]) -> float:
            return r.get("events", 0) / r["window_s"] if r.get("window_s") else 0.0

        row: dict[str, Any] = {"mode": mode, "rate": rate, "streams": c, "tokens": tokens, "targets": {}}
        d_eps = [eps(r) for r in d]
        d_gap99 = [pct(r.get("gaps", []), 99) for r in d]
        d_lat = [x for r in d for x in r.get("lat", [])]
        row["direct_eps"] = median(d_eps)
        row["direct_gap_p99"] = median(d_gap99)
        row["direct_lat_p50"] = pct(d_lat, 50)
        row["direct_lat_p99"] = pct(d_lat, 99)
        row["direct_errors"] = sum(r.get("errors", 0) for r in d)
        row["foreign_cores"] = median([r.get("foreign_cores", 0.0) for rs in res.values() for r in rs])
        row["client_cpu_share"] = median([r.get("client_cpu_s", 0) / r["elapsed_s"] for r in d if r.get("elapsed_s")])
        row["upstream_cpu_us"] = median(
            [r["upstream_cpu_s"] / r["total_events"] * 1e6 for r in d if r.get("total_events")]
        )
        expect = c * rate * tokens / (tokens + 1) if rate else None
        row["expected_eps"] = expect
        bound = []
        if expect and row["direct_eps"] is not None and row["direct_eps"] < 0.97 * expect:
            bound.append(f"direct reached only {row['direct_eps'] / expect:.0%} of the configured {expect:.0f} ev/s")
        if row["client_cpu_share"] is not None and row["client_cpu_share"] > 0.85 * self.args.clients:
            bound.append(f"load generator used {row['client_cpu_share']:.0%} of a core")
        row["client_bound"] = "; ".join(bound)
        for t in targets[1:]:
            rs = res[t.name]
            ratios = [eps(r) / de if de else None for r, de in zip(rs, d_eps)]
            infl = [sub(pct(r.get("gaps", []), 99), g) for r, g in zip(rs, d_gap99)]
            lat = [x for r in rs for x in r.get("lat", [])]
            cpu_us = [r["proxy_cpu_s"] / r["total_events"] * 1e6 for r in rs if r.get("total_events")]
            rss, hwm = t.mem()
            kinds: dict[str, int] = {}
            for r in rs:
                for k, v in r.get("error_kinds", {}).items():
                    kinds[k] = kinds.get(k, 0) + v
            row["targets"][t.name] = {
                "eps": median([eps(r) for r in rs]),
                "ratio": median(ratios),
                "ratios": ratios,
                "gap_p99_infl": median(infl),
                "lat_p50": pct(lat, 50),
                "lat_p99": pct(lat, 99),
                "added_lat_p50": paired_added(rs, d, "lat")[0],
                "added_lat_p99": paired_added(rs, d, "lat")[1],
                "errors": sum(r.get("errors", 0) for r in rs),
                "error_kinds": kinds,
                "cpu_us_per_event": median(cpu_us),
                "rss_mb": rss,
                "hwm_mb": hwm,
                "cpu_share": median([r["proxy_cpu_s"] / r["elapsed_s"] for r in rs if r.get("elapsed_s")]),
            }
        return row

    def print_row(self, row: dict[str, Any]) -> None:
        label = f"{row['streams']} x {row['rate']:g} tok/s" if row["mode"] == "paced" else f"{row['streams']} x fast"
        self.say(
            f"  {label}: direct {row['direct_eps']:.0f} ev/s, gap p99 {ms(row['direct_gap_p99'])}, "
            f"errors {row['direct_errors']}, client CPU {fmt(row['client_cpu_share'], '.0%')}, "
            f"upstream {fmt(row['upstream_cpu_us'], '.1f')} us/ev, other processes {row['foreign_cores']:.2f} cores"
            + (f"  ** CLIENT/UPSTREAM-BOUND: {row['client_bound']}" if row["client_bound"] else "")
        )
        for name, v in row["targets"].items():
            self.say(
                f"    {name:18s} {fmt(v['ratio'], '.3f')}x ({v['eps']:.0f} ev/s)  gap p99 {ms(v['gap_p99_infl'], 2, True)}  "
                f"event delay {ms(v['added_lat_p50'], 3, True)} p50 / {ms(v['added_lat_p99'], 3, True)} p99  "
                f"errors {v['errors']}{' ' + str(v['error_kinds']) if v['error_kinds'] else ''}  "
                f"CPU {fmt(v['cpu_us_per_event'], '.1f')} us/ev ({fmt(v['cpu_share'], '.0%')} core)  "
                f"RSS {v['rss_mb']:.0f} MB (peak {v['hwm_mb']:.0f})"
            )

    def churn(self) -> None:
        n = self.plan.churn_n
        self.say(f"\n[4/5] RSS growth across {n} short streaming requests (8 tokens, 8 concurrent)")
        self.set_rate(0)
        self.churn_res: dict[str, tuple[float, float, list[float], int]] = {}
        for t in [x for x in self.targets if x.proc is not None and x.name.startswith("mlxproxy")]:
            seg = n // 10
            readings = []
            errors = 0
            first = self.run_job(t, {"kind": "churn", "n": seg, "concurrency": 8, "max_s": 120}, 150)
            errors += first.get("errors", 0)
            readings.append(t.mem()[0])
            for _ in range(3):
                r = self.run_job(t, {"kind": "churn", "n": 3 * seg, "concurrency": 8, "max_s": 120}, 150)
                errors += r.get("errors", 0)
                readings.append(t.mem()[0])
            growth = readings[-1] - readings[0]
            self.churn_res[t.name] = (growth, readings[-1] - readings[-2], readings, errors)
            self.say(
                f"  {t.name}: RSS after {seg}, {4 * seg}, {7 * seg}, {10 * seg} requests: "
                + ", ".join(f"{x:.1f}" for x in readings)
                + f" MB; growth {growth:+.2f} MB; errors {errors}"
            )

    def profile(self) -> None:
        n = self.args.profile_streams
        target = next((t for t in self.targets if t.name == self.args.profile_target and t.proc is not None), self.mlx)
        load = self.args.profile_load
        what = {
            "paced": f"{n} streams x {self.plan.rate:g} tok/s",
            "fast": f"{n} streams as fast as possible",
            "seq": "sequential non-streaming requests",
        }[load]
        self.say(f"\n[5/5] profile of {target.name} under {what} (py-spy)")
        exe = shutil.which("py-spy") or os.path.join(os.path.dirname(PY), "py-spy")
        if not os.path.exists(exe):
            self.say("  py-spy not installed (pip install py-spy): skipped")
            return
        p = self.plan
        out = os.path.join(self.workdir, "profile.txt")
        self.set_rate(p.rate if load == "paced" else 0)
        dur = p.profile_s
        if load == "seq":
            job: dict[str, Any] = {
                "kind": "seq",
                "n": 1_000_000,
                "max_s": dur + 1.5,
                "host": HOST,
                "port": target.port,
                "auth": self.api_key,
            }
        else:
            job = {
                "kind": "load",
                "streams": n,
                "tokens": p.paced_tokens,
                "warmup_s": 1.0,
                "window_s": dur + 1.0,
                "ramp_s": 0.8,
                "timeout": 30,
                "drain_s": 10,
                "host": HOST,
                "port": target.port,
                "auth": self.api_key,
            }
        assert target.proc is not None
        prof = self.children.spawn(
            [
                exe,
                "record",
                "-p",
                str(target.proc.pid),
                "-d",
                f"{dur:g}",
                "-r",
                "250",
                "--nonblocking",
                "-f",
                "raw",
                "-o",
                out,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        res = self.gens.call(job, dur + 60)
        try:
            _, err = prof.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self.children.stop(prof)
            err = "timed out"
        if not os.path.exists(out):
            self.say(f"  py-spy produced nothing: {(err or '').strip()[-300:]}")
            return
        self.profile_text = summarise_profile(out)
        if load == "seq":
            self.say(f"  load during the profile: {len(res.get('lat', []))} requests, errors {res.get('errors')}")
        else:
            self.say(
                f"  load during the profile: {res.get('events', 0) / max(res.get('window_s', 1), 1e-9):.0f} ev/s, "
                f"errors {res.get('errors')}"
            )
        for line in self.profile_text.splitlines():
            self.say("  " + line)
        if self.args.keep_profile:
            shutil.copy(out, self.args.keep_profile)
            self.say(f"  raw collapsed stacks copied to {self.args.keep_profile}")

    # -- the verdicts -------------------------------------------------------------------

    def row(self, mode: str, c: int) -> dict[str, Any] | None:
        return next((r for r in self.load_rows if r["mode"] == mode and r["streams"] == c), None)

    def verdicts(self) -> None:
        names = [t.name for t in self.targets[1:]]
        rows: list[tuple[str, str, Callable[[str], tuple[str, bool | None]]]] = []

        def lat_pair(
            d: dict[str, tuple[float | None, float | None]], i: int, limit_ms: float
        ) -> Callable[[str], tuple[str, bool | None]]:
            def f(n: str) -> tuple[str, bool | None]:
                v = d.get(n, (None, None))[i]
                return ms(v, 3), None if v is None else v * 1000 <= limit_ms

            return f

        def load_metric(
            mode: str, c: int, key: str, limit: float, kind: str
        ) -> Callable[[str], tuple[str, bool | None]]:
            def f(n: str) -> tuple[str, bool | None]:
                r = self.row(mode, c)
                v = r["targets"].get(n, {}).get(key) if r else None
                if v is None:
                    return "n/a", None
                if kind == "ratio":
                    return f"{v:.3f}x", v >= limit
                if kind == "ms":
                    return ms(v, 3), v * 1000 <= limit
                return f"{v:.1f} us", v <= limit

            return f

        def errors_and_ratio(c: int) -> Callable[[str], tuple[str, bool | None]]:
            def f(n: str) -> tuple[str, bool | None]:
                r = self.row("paced", c)
                v = r["targets"].get(n) if r else None
                if v is None or v["ratio"] is None:
                    return "n/a", None
                gap = None if v.get("gap_p99_infl") is None else v["gap_p99_infl"] * 1000  # seconds -> ms
                ok = v["ratio"] >= T_256_RATIO and v["errors"] == 0 and (gap is None or gap <= T_256_GAP_MS)
                return f"{v['ratio']:.3f}x, {v['errors']} err, gap {fmt(gap, '+.1f')} ms", ok

            return f

        def capture_cost(n: str) -> tuple[str, bool | None]:
            if not n.startswith("mlxproxy+capture"):
                return "", None
            r = self.row("paced", 64)
            if not r or n not in r["targets"] or "mlxproxy" not in r["targets"]:
                return "n/a", None
            a, b = r["targets"][n]["cpu_us_per_event"], r["targets"]["mlxproxy"]["cpu_us_per_event"]
            if a is None or not b:
                return "n/a", None
            extra = a / b - 1
            return f"{extra:+.1%} CPU", extra <= T_CAPTURE

        def rss_peak(n: str) -> tuple[str, bool | None]:
            r = self.row("paced", 256) or (self.load_rows[-1] if self.load_rows else None)
            v = r["targets"].get(n) if r else None
            if v is None:
                return "n/a", None
            return f"{v['hwm_mb']:.0f} MB", v["hwm_mb"] <= T_RSS_MB

        def rss_growth(n: str) -> tuple[str, bool | None]:
            g = getattr(self, "churn_res", {}).get(n)
            if g is None:
                return "n/a", None
            return f"{g[0]:+.2f} MB, {g[3]} err", g[0] <= T_RSS_GROWTH_MB and g[3] == 0

        rows = [
            (
                "seq non-stream added latency p50",
                f"<= {T_SEQ_P50_MS} ms",
                lat_pair(getattr(self, "seq_added", {}), 0, T_SEQ_P50_MS),
            ),
            (
                "seq non-stream added latency p99",
                f"<= {T_SEQ_P99_MS} ms",
                lat_pair(getattr(self, "seq_added", {}), 1, T_SEQ_P99_MS),
            ),
            (
                "single stream added TTFT p50",
                f"<= {T_TTFT_P50_MS} ms",
                lat_pair(getattr(self, "ttft_added", {}), 0, T_TTFT_P50_MS),
            ),
            (
                "single stream added TTFT p99",
                "(report)",
                lambda n: (lat_pair(getattr(self, "ttft_added", {}), 1, 1e9)(n)[0], None),
            ),
            (
                "single stream added event delay p50",
                "(report)",
                lambda n: (load_metric("paced", 1, "added_lat_p50", 1e9, "ms")(n)[0], None),
            ),
            (
                "single stream added event delay p99",
                f"<= {T_EVENT_P99_MS} ms",
                load_metric("paced", 1, "added_lat_p99", T_EVENT_P99_MS, "ms"),
            ),
            (
                "64 x 100 tok/s events/s vs direct",
                f">= {T_64_RATIO}x",
                load_metric("paced", 64, "ratio", T_64_RATIO, "ratio"),
            ),
            (
                "64 x 100 tok/s gap p99 inflation",
                f"<= {T_64_GAP_MS} ms",
                load_metric("paced", 64, "gap_p99_infl", T_64_GAP_MS, "ms"),
            ),
            (
                "256 x 100 tok/s: ratio, errors, gap p99",
                f">= {T_256_RATIO}x, 0 err, <= +{T_256_GAP_MS:g} ms",
                errors_and_ratio(256),
            ),
            (
                "CPU per event, 64 x 100 tok/s",
                f"<= {T_CPU_US:g} us",
                load_metric("paced", 64, "cpu_us_per_event", T_CPU_US, "us"),
            ),
            ("capture cost (CPU/event vs no capture)", f"<= +{T_CAPTURE:.0%}", capture_cost),
            ("peak RSS (VmHWM) after 256 streams", f"<= {T_RSS_MB:g} MB", rss_peak),
            (f"RSS growth over {self.plan.churn_n} requests", f"<= {T_RSS_GROWTH_MB:g} MB", rss_growth),
        ]
        if self.foreign:
            avg = sum(f for f, _ in self.foreign) / max(sum(w for _, w in self.foreign), 1e-9)
            busy = [f / w for f, w in self.foreign if w >= 1.0]
            self.say(
                f"\nbackground load from processes outside this benchmark during its jobs: {avg:.2f} cores on average"
                + (f", p90 of jobs {pct(busy, 90):.2f}" if busy else "")
                + f" (of {os.cpu_count()})"
                + (
                    "  ** NOISY MACHINE: absolute figures are pessimistic; ratios, CPU/event and medians hold up best"
                    if avg > 0.25
                    else ""
                )
            )
            self.results["background_cores"] = avg
        self.say(
            "\n== summary (added = proxy minus direct, per round, median over the interleaved rounds; "
            "ratios = median of per-round ratios)"
        )
        head = ["metric", "target"]
        for n in names:
            head += [n, "ok?"] if n.startswith("mlxproxy") else [n]
        table = [head]
        for label, tgt, f in rows:
            line = [label, tgt]
            for n in names:
                text, ok = f(n)
                if n.startswith("mlxproxy"):
                    line += [text or "-", "" if ok is None or not text else ("PASS" if ok else "MISS")]
                else:
                    line += [text or "-"]
            table.append(line)
        if self.capture_note:
            table.append(["capture", "", self.capture_note] + [""] * (len(head) - 3))
        widths = [max(len(r[i]) for r in table) for i in range(len(head))]
        for i, r in enumerate(table):
            self.say("| " + " | ".join(x.ljust(w) for x, w in zip(r, widths)) + " |")
            if i == 0:
                self.say("|" + "|".join("-" * (w + 2) for w in widths) + "|")
        self.results["summary"] = table

        self.say("\n== all load rows: events/s ratio to direct | gap p99 inflation | errors | proxy CPU us/event")
        head2 = ["load", "direct ev/s"] + names
        t2 = [head2]
        for r in self.load_rows:
            label = f"{r['streams']} x {r['rate']:g} tok/s" if r["mode"] == "paced" else f"{r['streams']} x fast"
            if r["client_bound"]:
                label += " (*)"
            line = [label, f"{r['direct_eps']:.0f}"]
            for n in names:
                v = r["targets"].get(n)
                line.append(
                    "-"
                    if v is None
                    else f"{fmt(v['ratio'], '.3f')}x | {fmt(None if v['gap_p99_infl'] is None else v['gap_p99_infl'] * 1000, '+.2f')} ms"
                    f" | {v['errors']} | {fmt(v['cpu_us_per_event'], '.1f')}"
                )
            t2.append(line)
        widths = [max(len(r[i]) for r in t2) for i in range(len(head2))]
        for i, r in enumerate(t2):
            self.say("| " + " | ".join(x.ljust(w) for x, w in zip(r, widths)) + " |")
            if i == 0:
                self.say("|" + "|".join("-" * (w + 2) for w in widths) + "|")
        notes = [r for r in self.load_rows if r["client_bound"]]
        for r in notes:
            self.say(f"(*) {r['streams']} x {r['mode']}: {r['client_bound']}")
        if any(r["mode"] == "fast" for r in self.load_rows):
            self.say(
                "'fast' rows are CPU-bound by design: upstream, client and proxy share the machine's cores, "
                "so their ratio shows what the proxy's CPU costs the whole box."
            )


# == profile summary =======================================================================

CATEGORIES = (
    (
        "upstream HTTP client (the proxy's transport, or httpx/httpcore/anyio, aiohttp)",
        (
            "httpx/",
            "httpcore/",
            "h11/",
            "anyio/",
            "sniffio/",
            "aiohttp/",
            "yarl/",
            "multidict/",
            "mlxproxy/proxy/upstream.py",
            "mlxproxy/proxy/transport.py",
            "mlxproxy/edge/dial.py",
            "mlxproxy/edge/httpparse.py",
        ),
    ),
    ("uvicorn + httptools (client side)", ("uvicorn/", "httptools/")),
    ("mlxproxy.core (metering)", ("mlxproxy/core/",)),
    ("mlxproxy.proxy + capture (app, metrics glue)", ("mlxproxy/proxy/", "mlxproxy/capture")),
    ("prometheus_client", ("prometheus_client/",)),
    ("event loop (uvloop C code: I/O, syscalls, callbacks)", ("mlxproxy/edge/runner.py", "uvloop/")),
    ("asyncio (Python)", ("asyncio/",)),
)
WRAPPERS = (
    "<frozen runpy>",
    "click/",
    "mlxproxy/__main__.py",
    "mlxproxy/proxy/cli.py",
    "mlxproxy/edge/runner.py",
    "threading.py",
)


def _frame_loc(frame: str) -> str:
    """'send (httpcore/_async/http11.py:123)' -> 'httpcore/_async/http11.py' (py-spy prints
    site-packages paths relative to it; project files may be absolute)."""
    f = frame.strip()
    i = f.rfind("(")
    loc = f[i + 1 :].rstrip(")") if i >= 0 else f
    path = loc.rsplit(":", 1)[0]
    for marker in ("site-packages/", "/lib/python3"):
        j = path.find(marker)
        if j >= 0:
            path = path[j + len(marker) :]
            if marker == "/lib/python3":
                path = path.split("/", 1)[1] if "/" in path else path
            break
    if "/mlxproxy/" in path:
        path = "mlxproxy/" + path.split("/mlxproxy/", 1)[1]
    return path


def _frame_func(frame: str) -> str:
    f = frame.strip()
    i = f.rfind("(")
    return f"{f[:i].strip()} ({_frame_loc(f)})" if i >= 0 else f


def _category(loc: str) -> str:
    for name, keys in CATEGORIES:
        if any(loc.startswith(k) for k in keys):
            return name
    return "other (stdlib, orjson, builtins)"


def summarise_profile(path: str, top: int = 15) -> str:
    """Own (leaf) and inclusive time per function, and own time per category, from py-spy's
    raw collapsed stacks ("frame;frame;... count"). With uvloop the loop itself is C code:
    its time shows as own time of the frame that runs it (`run_server`)."""
    own: dict[str, int] = {}
    incl: dict[str, int] = {}
    cats: dict[str, int] = {}
    total = 0
    with open(path) as f:
        for line in f:
            line = line.rstrip("\n")
            if not line:
                continue
            stack, _, n = line.rpartition(" ")
            try:
                count = int(n)
            except ValueError:
                continue
            frames = [fr for fr in stack.split(";") if "(" in fr]  # drop process/thread pseudo-frames
            if not frames:
                continue
            total += count
            leaf = frames[-1]
            lf = _frame_func(leaf)
            own[lf] = own.get(lf, 0) + count
            cat = _category(_frame_loc(leaf))
            cats[cat] = cats.get(cat, 0) + count
            for fr in {fr for fr in frames if not _frame_loc(fr).startswith(WRAPPERS)}:
                fn = _frame_func(fr)
                incl[fn] = incl.get(fn, 0) + count
    if not total:
        return "no samples"
    out = [f"{total} samples of CPU-active time (idle excluded), % of the proxy's CPU", "own time by category:"]
    for k, v in sorted(cats.items(), key=lambda kv: -kv[1]):
        out.append(f"  {v / total:6.1%}  {k}")
    out.append("top functions by own time:")
    for k, v in sorted(own.items(), key=lambda kv: -kv[1])[:top]:
        out.append(f"  {v / total:6.1%}  {k}")
    out.append("top functions by inclusive time:")
    for k, v in sorted(incl.items(), key=lambda kv: -kv[1])[: top + 10]:
        out.append(f"  {v / total:6.1%}  {k}")
    return "\n".join(out)


# == main ==================================================================================


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description="Side-by-side latency/throughput/CPU benchmark: direct vs mlxproxy (vs nginx, LiteLLM).",
        epilog="See benchmarks/README.md for what every figure means.",
    )
    ap.add_argument("--quick", action="store_true", help="smoke version: fewer rounds and scenarios (~1-2 minutes)")
    ap.add_argument("--rounds", type=int, help="interleaved rounds per scenario (default 3, quick 2)")
    ap.add_argument("--window", type=float, help="seconds measured per load job (default 2.5, quick 1)")
    ap.add_argument("--clients", type=int, default=1, help="load generator processes (default 1)")
    ap.add_argument("--no-nginx", action="store_true", help="do not include nginx even if installed")
    ap.add_argument(
        "--no-floor",
        action="store_true",
        help="do not run benchmarks/floor.py (uvicorn + the proxy's upstream transport, passthrough with no metering)",
    )
    ap.add_argument("--no-capture", action="store_true", help="do not run the --capture proxy")
    ap.add_argument(
        "--litellm",
        default=None,
        metavar="PATH",
        help="path of a `litellm` executable to include ('' = none; default: $MLXPROXY_LITELLM, else "
        "`litellm` on PATH, except with --quick, where its 20-second start-up is left out)",
    )
    ap.add_argument(
        "--extra-proxy",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="also run `python -m mlxproxy serve` from the package copy in DIR (experiments)",
    )
    ap.add_argument(
        "--only",
        choices=["seq", "ttft", "load", "churn"],
        action="append",
        help="run only these scenarios (repeatable)",
    )
    ap.add_argument("--profile", action="store_true", help="also profile mlxproxy with py-spy under paced streams")
    ap.add_argument(
        "--profile-streams", type=int, default=64, metavar="N", help="streams during the profile (default 64)"
    )
    ap.add_argument(
        "--profile-load",
        choices=["paced", "fast", "seq"],
        default="paced",
        help="load during the profile: paced streams (default), as-fast-as-possible streams, "
        "or sequential non-streaming requests",
    )
    ap.add_argument(
        "--profile-target", default="mlxproxy", metavar="NAME", help="which proxy to profile (default mlxproxy)"
    )
    ap.add_argument("--keep-profile", metavar="FILE", help="copy py-spy's raw collapsed stacks to FILE")
    ap.add_argument(
        "--stack",
        choices=["plain", "fast"],
        default=None,
        help="the proxy's and floor's server stack: plain = asyncio + h11, fast = uvloop + httptools "
        "(default: the fastest installed; sets MLXPROXY_STACK for them)",
    )
    ap.add_argument(
        "--body",
        choices=["small", "agent"],
        default="small",
        help="request body of every scenario: small (one short message, the default) or agent "
        "(50 messages and 10 tools, ~57 kB: benchmarks/bodies.py)",
    )
    ap.add_argument("--out", metavar="FILE", help="also write the printed report to FILE")
    ap.add_argument("--json", metavar="FILE", help="write raw per-round results to FILE")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.stack:  # inherited by every mlxproxy and floor child
        os.environ["MLXPROXY_STACK"] = args.stack
    args.litellm, litellm_skipped = choose_litellm(args.litellm, args.quick, LITELLM_DEFAULT)
    if args.litellm and not os.path.exists(args.litellm):
        print(f"error: --litellm: no such file: {args.litellm}", file=sys.stderr)
        return 2
    if litellm_skipped:
        print(f"litellm: skipped, {litellm_skipped}", flush=True)
    plan = QUICK if args.quick else FULL
    if args.rounds:
        plan.rounds = args.rounds
    if args.window:
        plan.window_s = args.window
    children = Children()

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)  # also when started with SIGINT ignored (nohup, `cmd &`)
    t0 = time.monotonic()
    rc = 0
    with tempfile.TemporaryDirectory(prefix="mlxproxy-bench-") as workdir:
        bench = Bench(args, plan, children, workdir)
        try:
            bench.setup()
            bench.describe()
            bench.warm()
            only = set(args.only or ["seq", "ttft", "load", "churn"])
            if "seq" in only:
                bench.seq()
            if "ttft" in only:
                bench.ttft()
            bench.load_rows = []
            if "load" in only:
                bench.load()
            if "churn" in only:
                bench.churn()
            if args.profile:
                bench.profile()
            bench.verdicts()
            bench.say(f"\nwall time {time.monotonic() - t0:.0f} s")
        except KeyboardInterrupt:
            print("\ninterrupted; stopping every child process", file=sys.stderr)
            rc = 130
        except Exception as exc:
            print(f"\nbenchmark failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            for f in sorted(os.listdir(workdir)):
                if f.endswith(".log"):
                    with open(os.path.join(workdir, f)) as fh:
                        tail = fh.read()[-1500:]
                    if tail.strip():
                        print(f"--- {f} (tail)\n{tail}", file=sys.stderr)
            rc = 1
        finally:
            children.kill_all()
            if args.out and bench.out_lines:
                with open(args.out, "w") as f:
                    f.write("\n".join(bench.out_lines) + "\n")
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(bench.results | {"load_rows": getattr(bench, "load_rows", [])}, f, default=str)
    return rc


if __name__ == "__main__":
    sys.exit(main())
