"""A real Prometheus for tests, and the Grafana-side helpers the dashboard tests need.

`Prometheus` runs the `prometheus` binary (Debian's package) as a subprocess on a free
loopback port with a throw-away TSDB, waits for `/-/ready`, answers instant queries through
the HTTP API and is killed on exit. `config_for_test` turns the shipped deploy/prometheus.yml
into the config a test runs (targets and intervals swapped, everything else kept), so the
shipped file is the one tested. `substitute` replaces Grafana's variables in a panel query
the way Grafana would before sending it. Readiness is polled with deadlines; nothing here
sleeps to measure.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import yaml

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD_DIR = ROOT / "grafana" / "dashboards"
SHIPPED_PROMETHEUS_YML = ROOT / "deploy" / "prometheus.yml"
SHIPPED_FLEET_YML = ROOT / "deploy" / "prometheus-fleet.yml"


def find_binary(name: str) -> str | None:
    """`name` on PATH, else Debian's /usr/bin location, else None."""
    found = shutil.which(name)
    if found:
        return found
    candidate = Path("/usr/bin") / name
    return str(candidate) if candidate.exists() and os.access(candidate, os.X_OK) else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def config_for_test(
    shipped: str, target: str | list[str], *, scrape_interval: str = "1s", job: str = "mlxproxy"
) -> str:
    """The shipped Prometheus config with `job`'s targets replaced by `target` (one address, or
    a list for a fleet: the first static group keeps its `labels`, the other groups are dropped)
    and every scrape interval set to `scrape_interval` (timeouts no longer than it)."""
    cfg = yaml.safe_load(shipped)
    cfg.setdefault("global", {})["scrape_interval"] = scrape_interval
    cfg["global"]["evaluation_interval"] = scrape_interval
    jobs = [j for j in cfg.get("scrape_configs", []) if j.get("job_name") == job]
    if len(jobs) != 1:
        raise ValueError(f"the shipped config must have exactly one scrape job named {job!r}")
    for j in cfg["scrape_configs"]:
        j["scrape_interval"] = scrape_interval
        if "scrape_timeout" in j:
            j["scrape_timeout"] = scrape_interval
    groups = jobs[0].get("static_configs") or [{}]
    group: dict[str, Any] = {"targets": [target] if isinstance(target, str) else list(target)}
    if groups[0].get("labels"):
        group["labels"] = groups[0]["labels"]
    jobs[0]["static_configs"] = [group]
    return yaml.safe_dump(cfg, sort_keys=False)


class Prometheus:
    """`prometheus` on 127.0.0.1:<free port>, storing into `workdir`. A context manager."""

    def __init__(self, binary: str, config_text: str, workdir: Path) -> None:
        self.binary = binary
        self.workdir = Path(workdir)
        self.config_path = self.workdir / "prometheus.yml"
        self.config_path.write_text(config_text, encoding="utf-8")
        self.log_path = self.workdir / "prometheus.log"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.client = httpx.Client(base_url=self.url, timeout=10.0)

    def start(self, timeout_s: float = 20.0) -> Prometheus:
        log = open(self.log_path, "wb")
        try:
            self.proc = subprocess.Popen(
                [
                    self.binary,
                    f"--config.file={self.config_path}",
                    f"--storage.tsdb.path={self.workdir / 'data'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--storage.tsdb.retention.time=1h",
                    "--log.level=warn",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        finally:
            log.close()
        self.wait_for(self._ready, timeout_s, "Prometheus to be ready")
        return self

    def _ready(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"prometheus exited with {self.proc.returncode}:\n{self.log()}")
        try:
            return self.client.get("/-/ready").status_code == 200
        except httpx.TransportError:
            return False

    def log(self) -> str:
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")[-4000:]
        except OSError:
            return ""

    def wait_for(self, pred: Callable[[], bool], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if pred():
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}\n{self.log()}")
            time.sleep(0.1)  # readiness poll, not a measurement

    def scalar(self, expr: str) -> float | None:
        """The first sample of an instant query's answer, None when it has none (or failed)."""
        ans = self.query(expr)
        if ans.get("status") != "success" or not ans["data"]["result"]:
            return None
        return float(ans["data"]["result"][0]["value"][1])

    def wait_for_requests(self, sent: int, timeout_s: float = 20.0) -> None:
        """Until Prometheus has scraped all `sent` requests and every mlxproxy series has two
        samples (a rate over the whole run has two points to take)."""
        self.wait_for(
            lambda: self.scalar("sum(mlxproxy_requests_total)") == float(sent),
            timeout_s,
            f"Prometheus to see all {sent} requests",
        )
        self.wait_for(
            lambda: self.scalar('count(count_over_time({__name__=~"mlxproxy_.+"}[5m]) < 2)') is None,
            timeout_s,
            "two samples of every mlxproxy series",
        )

    def query(self, expr: str, at: float | None = None) -> dict[str, Any]:
        """The API's whole answer to an instant query: {"status": ..., "data"|"error": ...}."""
        params: dict[str, Any] = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        r = self.client.post("/api/v1/query", data=params)
        try:
            return r.json()
        except ValueError:
            return {"status": "error", "errorType": f"http {r.status_code}", "error": r.text[:500]}

    def label_values(self, label: str, match: str) -> list[str]:
        r = self.client.get(f"/api/v1/label/{label}/values", params={"match[]": match})
        body = r.json()
        if body.get("status") != "success":
            raise RuntimeError(f"label values of {label} for {match}: {body}")
        return list(body["data"])

    def stop(self) -> None:
        self.client.close()
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)

    def __enter__(self) -> Prometheus:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# -- Grafana side -------------------------------------------------------------------------

GRAFANA_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\[\[(\w+)\]\]|\$(\w+)")


def substitute(expr: str, variables: dict[str, str]) -> str:
    """Replace Grafana variables ($name, ${name}, ${name:fmt}, [[name]]) as Grafana would;
    a variable not in `variables` is an error (the query would not run in Grafana either)."""

    def repl(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2) or m.group(3)
        if name not in variables:
            raise KeyError(f"query uses ${name}, which the test does not know how to substitute: {expr!r}")
        return variables[name]

    return GRAFANA_VARIABLE.sub(repl, expr)


def whole_run_variables(started: float, at: float) -> dict[str, str]:
    """Grafana's variables for queries over a whole run that Prometheus began scraping at
    `started` (time.time()), asked at `at`: the range covers it all, every proxy, upstream
    and model chosen."""
    window = f"{math.ceil(at - started) + 5}s"
    return {
        "__rate_interval": window,
        "__range": window,
        "__interval": "1s",
        "instance": ".*",
        "upstream": ".*",
        "model": ".*",
    }


def variables_used(expr: str) -> set[str]:
    return {m.group(1) or m.group(2) or m.group(3) for m in GRAFANA_VARIABLE.finditer(expr)}


def load_dashboards() -> dict[str, dict[str, Any]]:
    import json

    return {p.name: json.loads(p.read_text(encoding="utf-8")) for p in sorted(DASHBOARD_DIR.glob("*.json"))}


def all_panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, the ones inside collapsed rows included."""
    for p in dashboard.get("panels", []):
        yield p
        yield from p.get("panels", [])


def panel_queries(dashboard: dict[str, Any]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(panel, target) for every Prometheus target of every panel."""
    for p in all_panels(dashboard):
        if p.get("type") == "row":
            continue
        for t in p.get("targets", []):
            yield p, t


METRIC_NAME = re.compile(r"\b(mlxproxy_[a-zA-Z0-9_]+)")


def metric_names(expr: str) -> set[str]:
    return set(METRIC_NAME.findall(expr))


def exposed_series_names(metrics_text: str) -> set[str]:
    """Series names a /metrics text exposes, from its TYPE lines (so a family with no
    samples yet still counts): a histogram exposes name_bucket, name_sum and name_count."""
    names: set[str] = set()
    for line in metrics_text.splitlines():
        if not line.startswith("# TYPE "):
            continue
        _, _, name, kind = line.split(None, 3)
        if kind.strip() == "histogram":
            names.update({f"{name}_bucket", f"{name}_sum", f"{name}_count"})
        else:
            names.add(name)
    return names


def result_summary(answer: dict[str, Any]) -> tuple[bool, str]:
    """(has data, one line): data means success and at least one finite sample value."""
    if answer.get("status") != "success":
        return False, f"error: {answer.get('errorType')}: {answer.get('error')}"
    data = answer["data"]
    kind, result = data["resultType"], data["result"]
    if kind == "scalar":
        values = [float(result[1])]
        series = 1
    elif kind == "vector":
        values = [float(s["value"][1]) for s in result]
        series = len(result)
    elif kind == "matrix":
        values = [float(v[1]) for s in result for v in s["values"]]
        series = len(result)
    else:
        return False, f"unexpected result type {kind}"
    finite = [v for v in values if math.isfinite(v)]
    if not series:
        return False, "no data (empty result)"
    if not finite:
        return False, f"no data ({series} series, all NaN/Inf)"
    return True, f"{series} series, e.g. {finite[0]:.4g}"
