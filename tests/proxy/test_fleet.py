"""A fleet of proxies observed through one Prometheus: the dashboard sums over them and breaks
them down by proxy.

Two `mlxproxy serve` processes, each in front of the same two simulated servers
(`mlxproxy sim`, upstreams `mac-a` and `mac-b`), get different traffic, failures included. A
real Prometheus scrapes both with the shipped deploy/prometheus-fleet.yml (targets and
intervals swapped). The dashboard's queries, taken from the generated JSON with Grafana's
variables substituted, must then give the fleet's sum and one series per proxy, equal to what
was sent: request counts exactly, and the latency histograms bucket for bucket (the exact
range quantiles equal the ones the proxies' own buckets give, and the range mean of a
histogram equals its summed `_sum` over its summed `_count`).

Both proxies forward to both upstreams, the layout docs/DASHBOARDS.md advises against (each
proxy sees only part of an upstream's streams): it is the one where summing across proxies
matters, and the "Proxies per upstream (range)" panel must flag it.

The exposition checks (histograms, never summaries; no target labels) need no Prometheus;
the rest skips, saying why, where the `prometheus` package is not installed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import re
import subprocess
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

import promharness as ph
from support import Process, start, wait_for

DASHBOARD_PATH = ph.ROOT / "grafana" / "dashboards" / "mlxproxy.json"
DOCS = ph.ROOT / "docs" / "DASHBOARDS.md"
PROMETHEUS = ph.find_binary("prometheus")
PROMTOOL = ph.find_binary("promtool")
SKIP_REASON = "prometheus not installed (Debian package prometheus; CI installs it)"

UPSTREAMS = (("mac-a", "model-a"), ("mac-b", "model-b"))
SPEED = 20.0  # healthy profile: prefill 40,000 tok/s, decode 1,000 tok/s
# per proxy: upstream -> (successful streams, failed requests (HTTP 500), prompt tokens). The
# first proxy sends short prompts, the second long ones, so their TTFTs fall in other buckets
# and a fleet figure that left one proxy out could not pass for the sum.
PLAN: tuple[dict[str, tuple[int, int, int]], ...] = (
    {"mac-a": (7, 2, 200), "mac-b": (3, 0, 400)},
    {"mac-a": (4, 0, 4000), "mac-b": (9, 1, 8000)},
)
# the only gauges; every other family is a counter or a histogram
GAUGES = {"mlxproxy_requests_in_flight", "mlxproxy_build_info"}
PER_PROCESS_HISTOGRAMS = {"mlxproxy_proxy_overhead_seconds", "mlxproxy_event_loop_lag_seconds"}


@dataclasses.dataclass
class Fleet:
    proxies: list[Process]  # in PLAN's order
    targets: list[str]  # host:port, Prometheus's instance label of each proxy
    metrics: list[str]  # each proxy's /metrics text after the load
    prom: ph.Prometheus | None
    at: float  # the instant every query is evaluated at
    variables: dict[str, str]


async def _send(url: str, model: str, prompt_tokens: int, fault: str | None) -> None:
    headers = {"x-sim-prompt-tokens": str(prompt_tokens)}
    if fault:
        headers["x-sim-fault"] = fault
    body = {"model": model, "stream": True, "max_tokens": 12, "messages": [{"role": "user", "content": "Hi."}]}
    async with httpx.AsyncClient(base_url=url, timeout=30.0, trust_env=False) as client:
        async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
            async for _ in r.aiter_raw():
                pass
            assert r.status_code == (500 if fault else 200), (url, model, r.status_code)


async def _load(urls: list[str], first: bool) -> None:
    """PLAN's traffic: with `first`, one successful stream per proxy and upstream; else the rest."""
    models = dict(UPSTREAMS)
    for url, plan in zip(urls, PLAN):
        for upstream, (ok, failed, prompt) in plan.items():
            n_ok = 1 if first else ok - 1
            sends = [_send(url, models[upstream], prompt, None) for _ in range(n_ok)]
            sends += [_send(url, models[upstream], prompt, "http-error=500") for _ in range(0 if first else failed)]
            for i in range(0, len(sends), 4):  # a few streams at a time
                await asyncio.gather(*sends[i : i + 4])


def _counted(url: str) -> float:
    text = httpx.get(url + "/metrics", trust_env=False).text
    return sum(v for _, v in _families(text, "mlxproxy_requests_total"))


def _sent() -> int:
    return sum(ok + failed for plan in PLAN for ok, failed, _ in plan.values())


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("fleet")
    with ExitStack() as stack:

        def run(args: list[str]) -> Process:
            proc = start(args, "listening on")
            stack.callback(proc.stop)
            return proc

        sims = [
            run(["sim", "--profile", "healthy", "--port", "0", "--speed", str(SPEED), "--seed", "1"]) for _ in UPSTREAMS
        ]
        proxies = []
        for i in range(len(PLAN)):
            cfg = {
                "port": 0,
                "log_requests": False,
                "upstreams": [
                    {"name": name, "url": sim.url, "models": [model]} for (name, model), sim in zip(UPSTREAMS, sims)
                ],
            }
            path = tmp / f"proxy{i}.yaml"
            path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
            proxies.append(run(["serve", "--config", str(path), "--log-level", "warning"]))
        urls = [p.url for p in proxies]
        targets = [u.removeprefix("http://") for u in urls]

        prom = None
        if PROMETHEUS is not None:
            cfg_text = ph.config_for_test(ph.SHIPPED_FLEET_YML.read_text(encoding="utf-8"), targets)
            prom = stack.enter_context(ph.Prometheus(PROMETHEUS, cfg_text, tmp))
            prom_started = time.time()
            prom.wait_for(
                lambda: prom.scalar('sum(up{job="mlxproxy"})') == float(len(targets)), 20, "a scrape of every proxy"
            )
        # one request per proxy and upstream, scraped, then the rest: every series then grows
        # between two scrapes, so rate() has something to see on both proxies
        asyncio.run(_load(urls, first=True))
        if prom is not None:
            n_first = float(len(PLAN) * len(UPSTREAMS))
            prom.wait_for(lambda: prom.scalar("sum(mlxproxy_requests_total)") == n_first, 20, "the first requests")
        asyncio.run(_load(urls, first=False))
        # a record is finished just after its last byte went out: wait until each proxy counted all
        for url, plan in zip(urls, PLAN):
            want = sum(ok + failed for ok, failed, _ in plan.values())
            done = wait_for(lambda u=url, n=want: _counted(u) == n, 20)
            assert done, f"{url} counted {_counted(url)} of {want} requests"
        metrics = [httpx.get(u + "/metrics", trust_env=False).text for u in urls]

        variables: dict[str, str] = {}
        at = time.time()
        if prom is not None:
            prom.wait_for_requests(_sent())
            at = time.time()
            variables = ph.whole_run_variables(prom_started, at)
        yield Fleet(proxies, targets, metrics, prom, at, variables)


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD_PATH.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def live(fleet: Fleet) -> Fleet:
    if fleet.prom is None:
        pytest.skip(SKIP_REASON)
    return fleet


# -- the exposition: what a fleet can aggregate ----------------------------------------------


def test_every_distribution_is_a_histogram_and_no_target_label_is_exported(fleet: Fleet) -> None:
    """Summaries cannot be added across proxies (their quantiles are per process); histograms can,
    bucket by bucket. `instance` and `job` are Prometheus's target labels: a proxy that exported
    them would have them renamed `exported_instance`/`exported_job` (or, with honor_labels,
    override the scraper's)."""
    for text in fleet.metrics:
        kinds = {fam.name: fam.type for fam in text_string_to_metric_families(text) if fam.name.startswith("mlxproxy_")}
        # (the text format carries each counter's and histogram's creation time as a gauge x_created)
        kinds = {n: k for n, k in kinds.items() if not (n.endswith("_created") and n.removesuffix("_created") in kinds)}
        assert "summary" not in kinds.values()
        odd = {n: k for n, k in kinds.items() if k not in ("counter", "histogram") and n not in GAUGES}
        assert not odd, f"only counters, histograms and {sorted(GAUGES)}: {odd}"
        assert sum(k == "histogram" for k in kinds.values()) >= 12, kinds
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                assert not {"instance", "job", "exported_instance"} & set(s.labels), (s.name, s.labels)
                if (
                    fam.type == "histogram"
                    and fam.name not in PER_PROCESS_HISTOGRAMS
                    and fam.name.startswith("mlxproxy_")
                ):
                    assert {"upstream", "model"} <= set(s.labels), (s.name, s.labels)


def _families(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    return [(s.labels, s.value) for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == name]


def test_each_proxy_counted_what_it_was_sent(fleet: Fleet) -> None:
    """The ground truth the Prometheus checks compare with: each proxy's own counters and TTFT
    histogram equal the traffic sent to it."""
    for text, plan in zip(fleet.metrics, PLAN):
        for upstream, (ok, failed, _) in plan.items():
            reqs = _families(text, "mlxproxy_requests_total")
            assert sum(v for labels, v in reqs if labels["upstream"] == upstream) == ok + failed
            assert (
                sum(v for labels, v in reqs if labels["upstream"] == upstream and labels["outcome"] != "ok") == failed
            )
            ttft = _families(text, "mlxproxy_time_to_first_token_seconds_count")
            assert sum(v for labels, v in ttft if labels["upstream"] == upstream) == ok


# -- the dashboard's queries against a real Prometheus ---------------------------------------


def _query(live: Fleet, dashboard: dict[str, Any], title: str, ref: str = "A", **override: str) -> list[dict[str, Any]]:
    (expr,) = [t["expr"] for p, t in ph.panel_queries(dashboard) if p["title"] == title and t["refId"] == ref]
    assert live.prom is not None
    ans = live.prom.query(ph.substitute(expr, {**live.variables, **override}), at=live.at)
    assert ans["status"] == "success", (title, ans)
    return list(ans["data"]["result"])


def _by(result: list[dict[str, Any]], *labels: str) -> dict[tuple[str, ...], float]:
    out = {tuple(s["metric"].get(k, "") for k in labels): float(s["value"][1]) for s in result}
    assert len(out) == len(result), f"series not told apart by {labels}: {result}"
    return out


def test_fleet_config_is_valid_for_promtool(tmp_path: Path) -> None:
    if PROMTOOL is None:
        pytest.skip(SKIP_REASON)
    (job,) = yaml.safe_load(ph.SHIPPED_FLEET_YML.read_text(encoding="utf-8"))["scrape_configs"]
    assert job["job_name"] == "mlxproxy" and len(job["static_configs"][0]["targets"]) >= 2, "a fleet: several targets"
    test_cfg = tmp_path / "fleet.yml"
    test_cfg.write_text(ph.config_for_test(ph.SHIPPED_FLEET_YML.read_text(), ["127.0.0.1:9", "127.0.0.1:10"]))
    for path in (ph.SHIPPED_FLEET_YML, test_cfg):
        r = subprocess.run([PROMTOOL, "check", "config", str(path)], capture_output=True, timeout=60)
        assert r.returncode == 0, r.stdout.decode() + r.stderr.decode()


def test_request_counts_per_proxy_and_fleet_are_exact(live: Fleet, dashboard: dict[str, Any]) -> None:
    want = {
        (target, upstream): float(ok + failed)
        for target, plan in zip(live.targets, PLAN)
        for upstream, (ok, failed, _) in plan.items()
    }
    got = _by(_query(live, dashboard, "Requests by proxy and upstream (range)"), "instance", "upstream")
    print(f"\n[fleet] requests per proxy and upstream: {got}")
    assert got == want
    failed = sum(f for plan in PLAN for _, f, _ in plan.values())
    assert _by(_query(live, dashboard, "Failed requests (range)")) == {(): float(failed)}
    share = _by(_query(live, dashboard, "Error share (range)"))[()]
    assert share == pytest.approx(failed / _sent(), rel=1e-12)
    # the instance variable narrows every panel to the chosen proxies
    first, second = live.targets
    assert _by(_query(live, dashboard, "Failed requests (range)", instance=first)) == {
        (): float(sum(f for _, f, _ in PLAN[0].values()))
    }
    both = f"({first}|{second})"
    assert _by(_query(live, dashboard, "Failed requests (range)", instance=both)) == {(): float(failed)}


def test_the_sharding_panel_flags_upstreams_behind_two_proxies(live: Fleet, dashboard: dict[str, Any]) -> None:
    title = "Proxies per upstream (range)"
    assert _by(_query(live, dashboard, title), "upstream") == {("mac-a",): 2.0, ("mac-b",): 2.0}
    assert _by(_query(live, dashboard, title, instance=live.targets[1]), "upstream") == {
        ("mac-a",): 1.0,
        ("mac-b",): 1.0,
    }


def test_rates_and_gauges_are_the_sum_of_the_proxies(live: Fleet, dashboard: dict[str, Any]) -> None:
    total = _by(_query(live, dashboard, "Requests/s"))
    per_proxy = _by(_query(live, dashboard, "Requests/s by proxy"), "instance")
    assert set(per_proxy) == {(t,) for t in live.targets}
    assert all(v > 0 for v in per_proxy.values()), per_proxy
    assert list(total) == [()], "the fleet stat is one series, summed over proxies"
    assert total[()] == pytest.approx(sum(per_proxy.values()), rel=1e-9)
    print(f"\n[fleet] requests/s: fleet {total[()]:.4f}, per proxy {per_proxy}")
    # the gauge: nothing in flight now, on either proxy, and the fleet stat is their sum
    in_flight = _by(_query(live, dashboard, "Streams in flight by proxy"), "instance")
    assert set(in_flight) == {(t,) for t in live.targets} and sum(in_flight.values()) == 0
    assert _by(_query(live, dashboard, "Streams in flight")) == {(): 0.0}


def _bucket_quantile(q: float, buckets: dict[float, float]) -> float:
    """Prometheus's histogram_quantile on cumulative bucket counts {upper bound: count}."""
    bounds = sorted(buckets)
    counts = [buckets[b] for b in bounds]
    rank = q * counts[-1]
    b = next(i for i, c in enumerate(counts[:-1] + [math.inf]) if c >= rank)
    if b == len(bounds) - 1:
        return bounds[-2]
    start, count = (0.0, counts[0]) if b == 0 else (bounds[b - 1], counts[b] - counts[b - 1])
    if b > 0:
        rank -= counts[b - 1]
    return start + (bounds[b] - start) * (rank / count)


def _buckets(text: str, family: str, where: dict[str, str] | None = None) -> dict[float, float]:
    out: dict[float, float] = {}
    for labels, v in _families(text, family + "_bucket"):
        if all(labels.get(k) == val for k, val in (where or {}).items()):
            le = float(labels["le"])
            out[le] = out.get(le, 0.0) + v
    return out


def test_histograms_per_proxy_are_exact_bucket_for_bucket(live: Fleet, dashboard: dict[str, Any]) -> None:
    """The range quantiles per proxy come from Prometheus's sums of the bucket series; equal to
    the quantile of the proxy's own buckets only if every observation of that proxy is in them."""
    ttft = "mlxproxy_time_to_first_token_seconds"
    title = "TTFT p50 / p99 by proxy (range)"
    for ref, q in (("A", 0.5), ("B", 0.99)):
        got = _by(_query(live, dashboard, title, ref), "instance")
        want = {(t,): _bucket_quantile(q, _buckets(text, ttft)) for t, text in zip(live.targets, live.metrics)}
        assert got == pytest.approx(want, rel=1e-9), (q, got, want)
        print(f"\n[fleet] TTFT p{round(q * 100)} per proxy over the range: {got}")
    p50 = {t: v for (t,), v in _by(_query(live, dashboard, title, "A"), "instance").items()}
    assert p50[live.targets[0]] < p50[live.targets[1]], "short prompts on the first proxy, long on the second"
    # each proxy's series carries its own counts: a per-proxy time series for both
    rate_p99 = _by(_query(live, dashboard, "TTFT p50 / p99 by proxy", "B"), "instance")
    assert set(rate_p99) == {(t,) for t in live.targets}


def test_fleet_histograms_sum_the_buckets_of_every_proxy(live: Fleet, dashboard: dict[str, Any]) -> None:
    """Fleet-wide panels add the proxies' histograms: the exact range mean per upstream and
    concurrency level is the summed _sum over the summed _count of both proxies, and the TTFT
    panel has one series per upstream (no instance label: never a quantile per proxy, averaged)."""
    tps = "mlxproxy_output_tokens_per_second"
    sums: dict[tuple[str, str], list[float]] = {}
    for text in live.metrics:
        for suffix, i in (("_sum", 0), ("_count", 1)):
            for labels, v in _families(text, tps + suffix):
                if labels["kind"] == "decode":
                    sums.setdefault((labels["upstream"], labels["concurrency"]), [0.0, 0.0])[i] += v
    want = {k: s / c for k, (s, c) in sums.items() if c}
    got = _by(
        _query(live, dashboard, "Mean per-stream decode tokens/s by concurrency (range)"), "upstream", "concurrency"
    )
    assert got == pytest.approx(want, rel=1e-9)
    n_observed = sum(c for _, c in sums.values())
    assert n_observed == sum(ok for plan in PLAN for ok, _, _ in plan.values())
    for ref in ("A", "C"):  # p50 and p99 of the TTFT panel
        result = _query(live, dashboard, "Time to first token (TTFT)", ref)
        assert {s["metric"].get("upstream") for s in result} == {"mac-a", "mac-b"}
        assert all("instance" not in s["metric"] for s in result)


def test_every_panel_query_runs_on_the_fleet(live: Fleet, dashboard: dict[str, Any]) -> None:
    failures = []
    for p, t in ph.panel_queries(dashboard):
        assert live.prom is not None
        ok, summary = ph.result_summary(live.prom.query(ph.substitute(t["expr"], live.variables), at=live.at))
        if not ok:
            failures.append(f"#{p['id']} {p['title']!r} {t['refId']}: {summary}")
    assert not failures, "panel queries without data on the fleet:\n" + "\n".join(failures)
    # the proxy variable lists both proxies, and the upstream list follows it
    for v in dashboard["templating"]["list"]:
        if v["type"] != "query":
            continue
        m = re.fullmatch(r"label_values\((.+), (\w+)\)", ph.substitute(v["definition"], live.variables))
        assert m and live.prom is not None, v["definition"]
        values = set(live.prom.label_values(m.group(2), m.group(1)))
        want = {
            "instance": set(live.targets),
            "upstream": {u for u, _ in UPSTREAMS},
            "model": {m for _, m in UPSTREAMS},
        }
        assert values == want[v["name"]], (v["name"], values)


def test_docs_show_the_fleet_config() -> None:
    docs = DOCS.read_text(encoding="utf-8")
    assert "deploy/prometheus-fleet.yml" in docs and "## A fleet of proxies" in docs
