"""The Grafana dashboard and the Prometheus/compose set-up, proven against a real Prometheus.

Structural tests (always run): the dashboard JSON is what grafana/build_dashboard.py makes,
imports into Grafana 10+ (unique ids, non-overlapping grid, datasource variable, upstream
and model variables), every metric it queries is one the proxy exposes, every panel is
described in docs/DASHBOARDS.md, and the compose file, provisioning and prometheus.yml agree.

Live tests (need Debian's `prometheus` and `promtool`; CI installs them): simulated MLX
servers (healthy and pathological profiles) behind one proxy with several upstreams, a
real Prometheus scraping the proxy with the shipped deploy/prometheus.yml (target and
intervals swapped), a few seconds of load; then every query of every panel is evaluated
through Prometheus's HTTP API with Grafana's variables substituted, and each must return
data. A metric renamed in the proxy but not in the dashboard fails here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import json
import random
import re
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

import promharness as ph
from mlxproxy.config import build_config
from mlxproxy.edge.runner import ServerThread
from mlxproxy.proxy.app import create_app

ROOT = ph.ROOT
DASHBOARD_PATH = ROOT / "grafana" / "dashboards" / "mlxproxy.json"
BUILDER = ROOT / "grafana" / "build_dashboard.py"
COMPOSE = ROOT / "deploy" / "docker-compose.yml"
PROVISIONING = ROOT / "grafana" / "provisioning"
DOCS = ROOT / "docs" / "DASHBOARDS.md"

DS = {"type": "prometheus", "uid": "${datasource}"}
KNOWN_VARIABLES = {"__rate_interval", "__range", "__interval", "instance", "upstream", "model"}
# Families without upstream/model labels: the only ones a panel may query without those filters
# (every query still filters by the proxy, $instance).
UNFILTERED_OK = {
    "mlxproxy_proxy_overhead_seconds",
    "mlxproxy_event_loop_lag_seconds",
    "mlxproxy_build_info",
}  # no upstream label
CONTRACT_FAMILIES = (
    "mlxproxy_requests_total",
    "mlxproxy_requests_in_flight",
    "mlxproxy_request_duration_seconds",
    "mlxproxy_time_to_first_byte_seconds",
    "mlxproxy_time_to_first_token_seconds",
    "mlxproxy_time_to_first_content_seconds",
    "mlxproxy_inter_token_latency_seconds",
    "mlxproxy_time_per_output_token_seconds",
    "mlxproxy_output_tokens_per_second",
    "mlxproxy_prefill_tokens_per_second",
    "mlxproxy_tokens_total",
    "mlxproxy_usage_reports_total",
    "mlxproxy_anomalies_total",
    "mlxproxy_proxy_overhead_seconds",
    "mlxproxy_build_info",
    "mlxproxy_prompt_length_tokens",
    "mlxproxy_generation_length_tokens",
    "mlxproxy_event_loop_lag_seconds",
    "mlxproxy_prompt_tokens_total",
    "mlxproxy_prefill_wasted_seconds_total",
)
ROWS = ("traffic", "latency", "token flow", "batching", "truth", "prompt cache", "overhead", "length", "fleet")


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD_PATH.read_text(encoding="utf-8"))


def base_family(series: str) -> str:
    for suffix in ("_bucket", "_sum", "_count"):
        if series.endswith(suffix):
            return series[: -len(suffix)]
    return series


# -- structure ----------------------------------------------------------------------------


def test_dashboard_json_is_built_from_its_source() -> None:
    spec = importlib.util.spec_from_file_location("build_dashboard", BUILDER)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert DASHBOARD_PATH.read_text(encoding="utf-8") == mod.render(), (
        "grafana/dashboards/mlxproxy.json is stale: run python grafana/build_dashboard.py"
    )
    assert subprocess.run([sys.executable, str(BUILDER), "--check"], capture_output=True).returncode == 0


def test_only_one_dashboard_and_it_is_the_tested_one() -> None:
    assert list(ph.load_dashboards()) == ["mlxproxy.json"]


def test_dashboard_imports_into_grafana_10(dashboard: dict[str, Any]) -> None:
    d = dashboard
    assert d["id"] is None, "an importable dashboard carries no database id"
    assert isinstance(d["uid"], str) and 0 < len(d["uid"]) <= 40 and re.fullmatch(r"[A-Za-z0-9_-]+", d["uid"])
    assert d["title"] and 38 <= d["schemaVersion"] <= 41, "Grafana 10/11 schema"
    assert any(r["type"] == "grafana" and int(r["version"].split(".")[0]) >= 10 for r in d["__requires"])
    assert d["annotations"]["list"][0]["builtIn"] == 1

    panels = d["panels"]
    ids = [p["id"] for p in ph.all_panels(d)]
    assert all(isinstance(i, int) and i > 0 for i in ids) and len(ids) == len(set(ids)), "panel ids must be unique"
    rects = []
    for p in panels:
        g = p["gridPos"]
        assert set(g) >= {"x", "y", "w", "h"} and all(isinstance(g[k], int) for k in ("x", "y", "w", "h")), p["title"]
        assert g["x"] >= 0 and g["y"] >= 0 and g["w"] >= 1 and g["h"] >= 1 and g["x"] + g["w"] <= 24, p["title"]
        rects.append((g["x"], g["y"], g["x"] + g["w"], g["y"] + g["h"], p["title"]))
    for i, a in enumerate(rects):
        for b in rects[i + 1 :]:
            overlap = a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]
            assert not overlap, f"panels {a[4]!r} and {b[4]!r} overlap"
    # Grafana lays panels out in reading order: the list must follow the grid.
    assert [(p["gridPos"]["y"], p["gridPos"]["x"]) for p in panels] == sorted(
        (p["gridPos"]["y"], p["gridPos"]["x"]) for p in panels
    )

    rows = [p for p in panels if p["type"] == "row"]
    for r in rows:
        assert r["gridPos"]["w"] == 24 and r["gridPos"]["h"] == 1 and r["gridPos"]["x"] == 0
        assert r["collapsed"] is False and r["panels"] == [], "an open row lists its panels after itself, not inside"
    titles = " | ".join(r["title"].lower() for r in rows)
    for needed in ROWS:
        assert needed in titles, f"no row about {needed!r}"
    assert panels[0]["type"] == "row"

    seen_titles = set()
    for p in ph.all_panels(d):
        if p["type"] == "row":
            continue
        assert p["type"] in {"timeseries", "stat", "bargauge", "heatmap"}, p["type"]
        assert p["title"] and p["title"] not in seen_titles, f"duplicate or empty title {p['title']!r}"
        seen_titles.add(p["title"])
        assert len(p.get("description", "")) > 40, f"panel {p['title']!r} needs a description"
        assert p["datasource"] == DS, f"panel {p['title']!r} must use the datasource variable"
        assert p["targets"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert t["datasource"] == DS and t["expr"].strip(), p["title"]
            if p["type"] == "heatmap":
                assert t["format"] == "heatmap" and t["legendFormat"] == "{{le}}"
            if p["type"] == "bargauge":
                assert t["instant"] is True and t["range"] is False


def test_template_variables(dashboard: dict[str, Any]) -> None:
    by_name = {v["name"]: v for v in dashboard["templating"]["list"]}
    ds = by_name["datasource"]
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"
    assert [v["name"] for v in dashboard["templating"]["list"]] == ["datasource", "instance", "upstream", "model"]
    for name in ("instance", "upstream", "model"):
        v = by_name[name]
        assert v["type"] == "query" and v["datasource"] == DS
        assert v["multi"] is True and v["includeAll"] is True and v["allValue"] == ".*"
        assert v["query"]["query"] == v["definition"]
        m = re.fullmatch(r"label_values\((mlxproxy_\w+)(\{.*\})?, (\w+)\)", v["definition"])
        assert m and m.group(3) == name, v["definition"]
    assert "$upstream" in by_name["model"]["definition"], "the model list follows the chosen upstreams"
    for name in ("upstream", "model"):
        assert 'instance=~"$instance"' in by_name[name]["definition"], f"the {name} list follows the chosen proxies"
    text = json.dumps(dashboard)
    assert '"uid": "prometheus"' not in text and "mlxproxy-prometheus" not in text, "no hard-coded datasource"


def test_queries_use_only_known_variables_and_filters(dashboard: dict[str, Any]) -> None:
    for p, t in ph.panel_queries(dashboard):
        expr = t["expr"]
        assert ph.variables_used(expr) <= KNOWN_VARIABLES, (p["title"], ph.variables_used(expr))
        for window in re.findall(r"\[([^\]]*)\]", expr):
            assert window in ("$__rate_interval", "$__range"), f"{p['title']}: hard-coded window [{window}]"
        for window in re.findall(r"\boffset\s+(\S+)", expr):
            assert window in ("$__interval", "$__range"), f"{p['title']}: hard-coded offset {window}"
        for m in re.finditer(r"(mlxproxy_\w+)(\{[^}]*\})?", expr):
            name, sel = m.group(1), m.group(2) or ""
            assert 'instance=~"$instance"' in sel, f"{p['title']}: {name} is not filtered by the instance variable"
            if base_family(name) in UNFILTERED_OK:
                continue
            assert 'upstream=~"$upstream"' in sel and 'model=~"$model"' in sel, (
                f"{p['title']}: {name} is not filtered by the upstream and model variables"
            )


def test_every_queried_metric_is_exposed_by_the_proxy(dashboard: dict[str, Any]) -> None:
    """A metric renamed in the proxy (or misspelt in the dashboard) fails here, without Prometheus."""
    app = create_app(build_config({}, log_requests=False))
    exposed = ph.exposed_series_names(generate_latest(app.registry).decode())
    used: set[str] = set()
    for p, t in ph.panel_queries(dashboard):
        for name in ph.metric_names(t["expr"]):
            assert name in exposed, f"panel {p['title']!r} queries {name}, which the proxy does not expose"
            used.add(base_family(name))
    for v in dashboard["templating"]["list"]:
        for name in ph.metric_names(v.get("definition", "")):
            assert name in exposed, f"variable {v['name']} uses {name}, which the proxy does not expose"
    missing = [f for f in CONTRACT_FAMILIES if f not in used]
    assert not missing, f"contract metrics no panel shows: {missing}"


def test_docs_describe_every_panel(dashboard: dict[str, Any]) -> None:
    docs = DOCS.read_text(encoding="utf-8")
    for p in ph.all_panels(dashboard):
        assert f"**{p['title']}**" in docs or f"### {p['title']}" in docs, (
            f"docs/DASHBOARDS.md does not describe {p['title']!r}"
        )
    assert "docker compose -f deploy/docker-compose.yml up -d" in docs
    assert "mlxproxy serve" in docs


def test_compose_provisioning_and_prometheus_agree() -> None:
    compose = yaml.safe_load(COMPOSE.read_text(encoding="utf-8"))
    services = compose["services"]
    assert set(services) >= {"prometheus", "grafana"}
    mounts: dict[str, dict[str, Path]] = {}
    for name, svc in services.items():
        assert ":" in svc["image"] and not svc["image"].endswith(":latest"), f"{name}: pin the image version"
        mounts[name] = {}
        for vol in svc.get("volumes", []):
            src, dst = vol.split(":")[:2]
            if src.startswith("."):
                path = (COMPOSE.parent / src).resolve()
                assert path.exists(), f"{name} mounts {src}, which does not exist"
                mounts[name][dst] = path
        for port in svc.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name}: publish on loopback only"
    assert "host.docker.internal:host-gateway" in services["prometheus"]["extra_hosts"]
    assert mounts["prometheus"]["/etc/prometheus/prometheus.yml"] == ph.SHIPPED_PROMETHEUS_YML
    assert "--config.file=/etc/prometheus/prometheus.yml" in services["prometheus"]["command"]
    assert mounts["grafana"]["/etc/grafana/provisioning"] == PROVISIONING
    dash_mount = mounts["grafana"]["/etc/grafana/dashboards"]
    assert dash_mount == DASHBOARD_PATH.parent
    home = services["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (dash_mount / Path(home).relative_to("/etc/grafana/dashboards")).exists()

    prom = yaml.safe_load(ph.SHIPPED_PROMETHEUS_YML.read_text(encoding="utf-8"))
    jobs = {j["job_name"]: j for j in prom["scrape_configs"]}
    job = jobs["mlxproxy"]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    assert job["static_configs"][0]["targets"] == ["host.docker.internal:8000"]

    ds = yaml.safe_load((PROVISIONING / "datasources" / "prometheus.yml").read_text(encoding="utf-8"))
    (source,) = ds["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090" and source["isDefault"] is True
    assert source["jsonData"]["timeInterval"] == job.get("scrape_interval", prom["global"]["scrape_interval"]), (
        "Grafana's $__rate_interval is derived from timeInterval: keep it equal to the scrape interval"
    )
    prov = yaml.safe_load((PROVISIONING / "dashboards" / "mlxproxy.yml").read_text(encoding="utf-8"))
    (provider,) = prov["providers"]
    assert provider["type"] == "file" and provider["options"]["path"] == "/etc/grafana/dashboards"


# -- promtool ------------------------------------------------------------------------------

PROMTOOL = ph.find_binary("promtool")
PROMETHEUS = ph.find_binary("prometheus")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool not installed (Debian package prometheus; CI installs it)"
)
needs_prometheus = pytest.mark.skipif(
    PROMETHEUS is None or PROMTOOL is None,
    reason="prometheus not installed (Debian package prometheus; CI installs it)",
)


def promtool(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *args], input=stdin, capture_output=True, timeout=60)


@needs_promtool
def test_promtool_check_config_on_shipped_and_test_configs(tmp_path: Path) -> None:
    r = promtool("check", "config", str(ph.SHIPPED_PROMETHEUS_YML))
    assert r.returncode == 0, r.stdout.decode() + r.stderr.decode()
    test_cfg = tmp_path / "prometheus.yml"
    test_cfg.write_text(ph.config_for_test(ph.SHIPPED_PROMETHEUS_YML.read_text(), "127.0.0.1:9"), encoding="utf-8")
    r = promtool("check", "config", str(test_cfg))
    assert r.returncode == 0, r.stdout.decode() + r.stderr.decode()


# -- live: a real Prometheus scraping a loaded proxy ---------------------------------------

SPEED = 20.0
LOAD_S = 6.0  # > several 1 s scrapes, so every rate() has samples on both sides
MAX_ROUNDS = 40
# upstream name, simulator profile, model the client asks for (routes to that upstream)
SIMS = (
    ("healthy", "healthy", "sim-healthy"),
    ("phantom", "phantom-usage", "sim-phantom"),
    ("burst", "rapid-mlx", "sim-burst"),
    ("stalls", "mlx-vlm", "sim-stalls"),
    ("thinking", "vllm-mlx", "sim-thinking"),
    ("cache", "healthy", "sim-cache"),  # a prompt cache dropped before every other request (SIM_KNOBS)
)
SIM_KNOBS = {
    "cache": {"prompt_cache": True, "cache_drop": "every-other"},
    "burst": {"burst_at_end": True},
}  # the whole answer in one write (Rapid-MLX's wire)
AGENT_SYSTEM = "You are a coding agent; keep the repository's conventions and run its tests. " * 80  # ~1600 tokens
PROMPT_TOKENS = (40, 300, 1500, 6000)
MAX_TOKENS = (16, 40, 80, 160)


@dataclasses.dataclass
class Live:
    prom: ph.Prometheus
    proxy_url: str
    variables: dict[str, str]
    requests_sent: int
    metrics_text: str


async def _one(
    client: httpx.AsyncClient,
    rng: random.Random,
    model: str,
    *,
    stream: bool = True,
    fault: str | None = None,
    max_tokens: int | None = None,
) -> None:
    headers = {"x-sim-prompt-tokens": str(rng.choice(PROMPT_TOKENS))}
    if fault:
        headers["x-sim-fault"] = fault
    body = {
        "model": model,
        "stream": stream,
        "max_tokens": max_tokens or rng.choice(MAX_TOKENS),
        "messages": [{"role": "user", "content": "Say something."}],
    }
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
            async for _ in r.aiter_raw():
                pass
    except httpx.HTTPError:
        if not fault:
            raise


async def _agent(client: httpx.AsyncClient, rng: random.Random, turns: int = 3) -> int:
    """An agent conversation on the caching upstream: every turn resends the conversation."""
    msgs = [{"role": "system", "content": AGENT_SYSTEM}, {"role": "user", "content": f"task {rng.random()}"}]
    for turn in range(turns):
        body = {"model": "sim-cache", "stream": True, "max_tokens": 8, "messages": msgs}
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            async for _ in r.aiter_raw():
                pass
        msgs = msgs + [{"role": "assistant", "content": "done"}, {"role": "user", "content": f"next {turn}"}]
    return turns


async def _round(client: httpx.AsyncClient, rng: random.Random) -> int:
    models = [m for _, _, m in SIMS if m != "sim-cache"]
    sent = await _agent(client, rng)
    # every upstream alone (concurrency 1 on each), then batches of 2 and 4 on each
    for n in (1, 2, 4):
        await asyncio.gather(*(_one(client, rng, m) for m in models for _ in range(n)))
        sent += n * len(models)
    # deep batches on the healthy server: concurrency 5-8, 9-16 and 17+
    for n in (8, 20):
        await asyncio.gather(*(_one(client, rng, "sim-healthy", max_tokens=40) for _ in range(n)))
        sent += n
    # failures and the non-streamed path
    faults = ("http-error=500", "stream-error", "reset-mid-stream")
    await asyncio.gather(
        *(_one(client, rng, "sim-healthy", fault=f) for f in faults),
        _one(client, rng, "sim-healthy", stream=False),
        _one(client, rng, "sim-thinking", stream=False),
    )
    return sent + len(faults) + 2


async def _load(proxy_url: str) -> int:
    rng = random.Random(7)
    sent = 0
    deadline = time.monotonic() + LOAD_S
    async with httpx.AsyncClient(
        base_url=proxy_url, timeout=30.0, limits=httpx.Limits(max_connections=64, max_keepalive_connections=64)
    ) as client:
        for _ in range(MAX_ROUNDS):
            sent += await _round(client, rng)
            if time.monotonic() >= deadline:
                break
    return sent


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Any:
    if PROMETHEUS is None or PROMTOOL is None:
        pytest.skip("prometheus not installed (Debian package prometheus; CI installs it)")
    from mlxproxy.sim.app import create_app as create_sim

    t0 = time.monotonic()
    with ExitStack() as stack:
        upstreams = []
        for name, profile, model in SIMS:
            srv = stack.enter_context(
                ServerThread(
                    create_sim(profile, speed=SPEED, seed=1, **SIM_KNOBS.get(name, {})),
                    server_header=False,
                    date_header=False,
                )
            )
            upstreams.append({"name": name, "url": srv.url, "models": [model]})
        config = build_config({"upstreams": upstreams, "default_upstream": "healthy"}, log_requests=False)
        proxy = stack.enter_context(ServerThread(create_app(config), server_header=False, date_header=False))
        target = proxy.url.removeprefix("http://")
        workdir = tmp_path_factory.mktemp("prometheus")
        cfg = ph.config_for_test(ph.SHIPPED_PROMETHEUS_YML.read_text(encoding="utf-8"), target)
        prom = stack.enter_context(ph.Prometheus(PROMETHEUS, cfg, workdir))
        prom_started = time.time()
        prom.wait_for(lambda: prom.scalar('up{job="mlxproxy"}') == 1.0, 20, "a first successful scrape of the proxy")

        sent = asyncio.run(_load(proxy.url))
        load_done = time.monotonic()

        # every request finished and scraped, and every series has >= 2 samples for rate()
        prom.wait_for_requests(sent)
        variables = ph.whole_run_variables(prom_started, time.time())
        metrics_text = httpx.get(proxy.url + "/metrics").text
        print(
            f"\n[dashboards] {sent} requests in {load_done - t0:.1f} s from start; windows {variables['__range']}; "
            f"ready to query at {time.monotonic() - t0:.1f} s"
        )
        yield Live(prom, proxy.url, variables, sent, metrics_text)


@needs_prometheus
def test_every_panel_query_returns_data(live: Live, dashboard: dict[str, Any]) -> None:
    failures, lines = [], []
    for p, t in ph.panel_queries(dashboard):
        expr = ph.substitute(t["expr"], live.variables)
        ok, summary = ph.result_summary(live.prom.query(expr))
        lines.append(f"  [{'ok' if ok else 'NO DATA'}] #{p['id']} {p['title']} / {t['refId']}: {summary}")
        if not ok:
            failures.append(f"#{p['id']} {p['title']!r} {t['refId']}: {summary}\n    {expr}")
    print("\n[dashboards] panel queries:\n" + "\n".join(lines))
    assert not failures, "panel queries without data:\n" + "\n".join(failures)


@needs_prometheus
def test_the_docs_promql_for_prometheus_own_ui_returns_data(live: Live) -> None:
    """docs/DASHBOARDS.md gives queries to paste into Prometheus's own UI: each one runs and
    returns data on a loaded proxy."""
    block = DOCS.read_text(encoding="utf-8").split("```promql")[1].split("```")[0]
    exprs = [ln.strip() for ln in block.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    assert len(exprs) >= 5, exprs
    failures = []
    for expr in exprs:
        ok, summary = ph.result_summary(live.prom.query(expr))
        if not ok:
            failures.append(f"{expr}: {summary}")
    assert not failures, failures


def _panel_result(live: Live, dashboard: dict[str, Any], title: str) -> dict[tuple[str, ...], float]:
    (expr,) = [t["expr"] for p, t in ph.panel_queries(dashboard) if p["title"] == title]
    ans = live.prom.query(ph.substitute(expr, live.variables))
    assert ans["status"] == "success", ans
    return {tuple(sorted(s["metric"].items())): float(s["value"][1]) for s in ans["data"]["result"]}


def _proxy_counter(
    live: Live, family: str, by: tuple[str, ...], where: Any = lambda labels: True
) -> dict[tuple[str, ...], float]:
    out: dict[tuple[str, ...], float] = {}
    for fam in text_string_to_metric_families(live.metrics_text):
        for s in fam.samples:
            if s.name == family and where(s.labels):
                key = tuple(sorted((k, s.labels[k]) for k in by))
                out[key] = out.get(key, 0.0) + s.value
    return out


@needs_prometheus
def test_range_counts_are_exact(live: Live, dashboard: dict[str, Any]) -> None:
    """Rare events count from their first occurrence: the range panels equal the proxy's own counters
    (increase() would have dropped every series' first scrape)."""
    want = _proxy_counter(live, "mlxproxy_anomalies_total", ("upstream", "kind"))
    got = _panel_result(live, dashboard, "Anomalies in range by kind")
    assert got == want
    failed = _proxy_counter(
        live, "mlxproxy_requests_total", (), lambda labels: labels["outcome"] not in ("ok", "ok_no_done")
    )
    assert _panel_result(live, dashboard, "Failed requests (range)") == failed and failed[()] > 0


@needs_prometheus
def test_panel_queries_run_with_a_multi_value_selection(live: Live, dashboard: dict[str, Any]) -> None:
    """Grafana sends a multi-value selection as (a|b): every query must still parse and run."""
    variables = {**live.variables, "upstream": "(healthy|phantom)", "model": "(sim-healthy|sim-phantom)"}
    for p, t in ph.panel_queries(dashboard):
        ans = live.prom.query(ph.substitute(t["expr"], variables))
        assert ans.get("status") == "success", (p["title"], t["refId"], ans)
    ok, summary = ph.result_summary(
        live.prom.query(
            ph.substitute(
                next(t["expr"] for p, t in ph.panel_queries(dashboard) if p["title"] == "Requests/s by outcome"),
                variables,
            )
        )
    )
    assert ok, summary


@needs_prometheus
def test_template_variables_list_upstreams_and_models(live: Live, dashboard: dict[str, Any]) -> None:
    for v in dashboard["templating"]["list"]:
        if v["type"] != "query":
            continue
        m = re.fullmatch(r"label_values\((.+), (\w+)\)", ph.substitute(v["definition"], live.variables))
        assert m, v["definition"]
        values = set(live.prom.label_values(m.group(2), m.group(1)))
        expected = {
            "instance": {live.proxy_url.removeprefix("http://")},
            "upstream": {n for n, _, _ in SIMS},
            "model": {mod for _, _, mod in SIMS},
        }[v["name"]]
        assert values >= expected, (v["name"], values)


@needs_prometheus
def test_a_renamed_metric_would_fail(live: Live, dashboard: dict[str, Any]) -> None:
    """The data check is not vacuous: the same query on a drifted name returns nothing."""
    p, t = next((p, t) for p, t in ph.panel_queries(dashboard) if "mlxproxy_requests_total" in t["expr"])
    good = ph.substitute(t["expr"], live.variables)
    assert ph.result_summary(live.prom.query(good))[0]
    drifted = good.replace("mlxproxy_requests_total", "mlxproxy_request_total")
    assert not ph.result_summary(live.prom.query(drifted))[0]


@needs_prometheus
def test_promtool_check_metrics_on_the_loaded_proxy(live: Live) -> None:
    assert "mlxproxy_output_tokens_per_second_bucket" in live.metrics_text
    r = promtool("check", "metrics", stdin=live.metrics_text.encode())
    assert r.returncode == 0, r.stdout.decode() + r.stderr.decode()


@needs_prometheus
def test_prompt_cache_panels_show_the_dropping_server(live: Live, dashboard: dict[str, Any]) -> None:
    """The caching upstream that drops its cache before every other request: its hit ratio lies
    strictly between 0 and 1, and its misses cost prefill time. The healthy profile has no
    prompt cache (it reports cached_tokens 0): its ratio is 0."""
    variables = {**live.variables, "__interval": live.variables["__range"]}
    by_title = {p["title"]: p for p, _ in ph.panel_queries(dashboard)}

    def values(title: str) -> dict[str, float]:
        expr = ph.substitute(by_title[title]["targets"][0]["expr"], variables)
        ans = live.prom.query(expr)
        return {r["metric"].get("upstream", ""): float(r["value"][1]) for r in ans["data"]["result"]}

    ratio = values("Prompt cache hit ratio")
    wasted = values("Prefill time wasted on cache misses")
    assert 0.1 < ratio["cache"] < 0.95, ratio
    assert wasted["cache"] > 0, wasted
    assert ratio["healthy"] == 0, ratio
