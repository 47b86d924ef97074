"""The Prometheus metrics are declared once, as a table (`mlxproxy.proxy.metrics.METRICS`): the
families a `ProxyMetrics` exports are exactly the table's, and docs/METRICS.md lists each with its
type and labels (the event-loop lag, `proxy/looplag.py`'s own collector, besides)."""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge

from mlxproxy.proxy.histograms import CountGauge
from mlxproxy.proxy.metrics import METRICS, ProxyMetrics
from support import REPO

DOC_ROW = re.compile(r"^\| `(mlxproxy_[a-z_]+)` \| ([a-z]+)[^|]* \|([^|]*)\|$", re.M)


def exported_name(name: str, kind: type) -> str:
    return name + "_total" if kind is Counter else name


def documented() -> dict[str, tuple[str, tuple[str, ...]]]:
    """name -> (type, label names) for every row of docs/METRICS.md's metrics table."""
    text = (Path(REPO) / "docs" / "METRICS.md").read_text(encoding="utf-8")
    out = {}
    for name, kind, labels in DOC_ROW.findall(text):
        names = tuple(part.strip() for part in re.sub(r"\s*\([^)]*\)", "", labels).split(","))
        out[name] = (kind, tuple(n for n in names if n and n != "(none)"))
    return out


def test_every_declared_metric_is_exported_once_and_nothing_else() -> None:
    registry = CollectorRegistry()
    m = ProxyMetrics(registry)
    assert set(m.families) == {x.key for x in METRICS} and len(METRICS) == len(m.families)
    exported = {metric.name for metric in registry.collect()}
    # prometheus_client names a counter family without its _total
    assert exported == {x.name for x in METRICS}
    assert len({x.name for x in METRICS}) == len(METRICS)


def test_the_docs_list_every_declared_metric_with_its_type_and_labels() -> None:
    docs = documented()
    assert "mlxproxy_requests_total" in docs and "mlxproxy_event_loop_lag_seconds" in docs  # the table was read
    declared = {
        exported_name(x.name, x.kind): ("counter" if x.kind is Counter else "gauge" if x.kind in (Gauge, CountGauge) else "histogram",
                                        x.labels)
        for x in METRICS
    }  # fmt: skip
    assert {n: d for n, d in docs.items() if n != "mlxproxy_event_loop_lag_seconds"} == declared


def test_a_metric_added_to_the_table_is_exported_without_other_code() -> None:
    """What adding a metric costs: one row (the families are made from the table)."""
    from dataclasses import replace

    import mlxproxy.proxy.metrics as metrics_mod

    extra = replace(METRICS[0], key="extra", name="mlxproxy_extra_things", help="Extra.", labels=("upstream",))
    original = metrics_mod.METRICS
    try:
        metrics_mod.METRICS = (*original, extra)
        registry = CollectorRegistry()
        m = ProxyMetrics(registry)
        m.families["extra"].labels("u").inc()
        assert "mlxproxy_extra_things" in {metric.name for metric in registry.collect()}
    finally:
        metrics_mod.METRICS = original


def _fixture_records() -> list:
    """The recorded sessions' records, and each again with other outcomes, statuses, models (past
    the label bound), endpoints, anomalies and tool calls: every branch of `on_record`."""
    import dataclasses
    import json
    import random

    from mlxproxy.core.record import Record

    records = []
    for path in sorted((Path(REPO) / "tests" / "fixtures" / "sessions").glob("*/records.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            r = Record.from_dict(json.loads(line))
            if (r.reprefill_lost_s or 0) >= 0 and (r.prefill_wasted_s or 0) >= 0:  # (a counter never goes down)
                records.append(r)
    rnd = random.Random(40)
    outcomes = ["ok", "ok_no_done", "truncated", "stream_error", "http_error", "client_disconnect"]
    variants = [
        dataclasses.replace(
            r,
            outcome=rnd.choice(outcomes),
            status=rnd.choice([200, 500, None, 429]),
            model=rnd.choice(["a", "b", None, r.model]),
            stream=rnd.choice([True, False]),
            endpoint=rnd.choice([r.endpoint, "models", "completions"]),
            anomalies=rnd.choice([(), ("stall",), r.anomalies]),
            concurrency=rnd.choice([1, 3, 20]),
            tool_calls=rnd.choice([0, 2]),
            tool_calls_valid=rnd.choice([None, 1, 2]),
            prefill_wasted_s=rnd.choice([None, 0.5]),
        )
        for r in records
        for _ in range(3)
    ]
    assert len(records) > 50
    return records + variants


def test_histograms_expose_what_prometheus_client_histograms_fed_the_same_records_would() -> None:
    """Every histogram family is a `BatchHistogram` (one lock and a bisection per value); fed the
    same records, a `ProxyMetrics` whose histograms are prometheus_client's exposes the same."""
    import dataclasses
    from unittest import mock

    from prometheus_client import Histogram, generate_latest

    import mlxproxy.proxy.metrics as metrics_mod
    from mlxproxy.proxy.histograms import BatchHistogram

    records = _fixture_records()
    assert sum(x.kind is BatchHistogram for x in METRICS) >= 10
    reference = tuple(dataclasses.replace(x, kind=Histogram) if x.kind is BatchHistogram else x for x in METRICS)
    texts = []
    for table in (METRICS, reference):
        with mock.patch.object(metrics_mod, "METRICS", table):
            m = ProxyMetrics(CollectorRegistry(), max_model_labels=2)
        for r in records:
            m.on_record(r)
            m.observe_overhead(0.0003, [0.00004, 0.02][: len(r.event_offsets_s) % 3])
        text = generate_latest(m.registry).decode()
        texts.append(sorted(line for line in text.splitlines() if "_created" not in line))
    assert texts[0] == texts[1]
    assert any(line.startswith("mlxproxy_inter_token_latency_seconds_count") for line in texts[0])
    assert any('model="other"' in line for line in texts[0])  # (the label bound was reached)


def test_a_series_is_exported_only_once_observed() -> None:
    """`on_record` keeps one request's children together, made as each is first observed: a record
    of a non-generation endpoint adds no latency series, a failed one no TTFT series."""
    import dataclasses

    record = next(r for r in _fixture_records() if r.ttft_s is not None and r.outcome == "ok")
    m = ProxyMetrics(CollectorRegistry())
    m.on_record(dataclasses.replace(record, endpoint="models", model="x"))
    m.on_record(dataclasses.replace(record, outcome="truncated", model="y"))
    seen = {(s.name, s.labels.get("model")) for fam in m.registry.collect() for s in fam.samples}
    assert ("mlxproxy_requests_total", "x") in seen and ("mlxproxy_requests_total", "y") in seen
    assert ("mlxproxy_time_to_first_byte_seconds_count", "x") not in seen
    assert ("mlxproxy_time_to_first_byte_seconds_count", "y") in seen
    assert ("mlxproxy_time_to_first_token_seconds_count", "y") not in seen
