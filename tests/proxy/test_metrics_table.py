"""The Prometheus metrics are declared once, as a table (`mlxproxy.proxy.metrics.METRICS`): the
families a `ProxyMetrics` exports are exactly the table's, and docs/METRICS.md lists each with its
type and labels (the event-loop lag, `proxy/looplag.py`'s own collector, besides)."""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge

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
        exported_name(x.name, x.kind): ("counter" if x.kind is Counter else "gauge" if x.kind is Gauge else "histogram",
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
