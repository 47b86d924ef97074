"""`mlxproxy serve --otlp-endpoint` end to end: the real CLI in a subprocess, in front of the
simulator, exports the GenAI metrics and one span per request over OTLP/HTTP to a loopback
receiver (what a Collector's `otlp` receiver takes), flushed when it stops, under the current
GenAI names by default and the old ones with `--otel-semconv old`; a bad URL, another OTLP
protocol, a missing `[otel]` extra and an export option without `--otlp-endpoint` are one line
and exit 2."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from mlxproxy.edge.runner import ServerThread
from mlxproxy.sim.app import create_app as create_sim
from support import ENV, cli, start, wait_for


def error_line(res: subprocess.CompletedProcess[str]) -> str:
    assert res.returncode == 2, (res.returncode, res.stderr[-1500:])
    assert "Traceback" not in res.stderr, res.stderr[-1500:]
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("url", ["127.0.0.1:4318", "grpc://127.0.0.1:4317", "http://:4318"])
def test_a_bad_otlp_endpoint_is_one_line(url: str) -> None:
    line = error_line(cli("serve", "--port", "0", "--otlp-endpoint", url))
    assert "--otlp-endpoint" in line and url in line


@pytest.mark.parametrize(
    "args",
    [
        ["--otel-semconv", "old"],
        ["--otel-per-chunk"],
        ["--otlp-endpoint", "http://127.0.0.1:4318", "--otel-semconv", "v9"],
    ],
)
def test_export_options_without_the_export_or_with_a_wrong_value_are_one_line(args: list[str]) -> None:
    res = cli("serve", "--port", "0", *args)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-1500:]
    line = [ln for ln in res.stderr.splitlines() if ln.strip()][-1]
    assert ("needs --otlp-endpoint" in line) if "v9" not in args else ("'v9' is not one of" in line), line


def test_another_otlp_protocol_is_refused_not_ignored() -> None:
    res = subprocess.run(
        [sys.executable, "-m", "mlxproxy", "serve", "--port", "0", "--otlp-endpoint", "http://127.0.0.1:4317"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**ENV, "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"},
        stdin=subprocess.DEVNULL,
    )
    assert "OTEL_EXPORTER_OTLP_PROTOCOL=grpc" in error_line(res)


def test_without_the_extra_serve_names_the_pip_command() -> None:
    # an interpreter where `import opentelemetry` fails, as where the extra is not installed
    code = "import sys; sys.modules['opentelemetry'] = None; from mlxproxy.cli import main; main()"
    res = subprocess.run(
        [sys.executable, "-c", code, "serve", "--port", "0", "--otlp-endpoint", "http://127.0.0.1:4318"],
        capture_output=True,
        text=True,
        timeout=120,
        env=ENV,
        stdin=subprocess.DEVNULL,
    )
    assert "pip install 'mlxproxy[otel]'" in error_line(res)


@pytest.mark.parametrize("semconv", [None, "old"])
def test_serve_exports_metrics_and_spans_over_otlp_http(monkeypatch: pytest.MonkeyPatch, semconv: str | None) -> None:
    pytest.importorskip("opentelemetry.sdk", reason="the [otel] extra is not installed (pip install -e '.[otel]')")
    pytest.importorskip("opentelemetry.proto", reason="the [otel] extra is not installed (pip install -e '.[otel]')")
    from otlpreceiver import otlp_attrs, receiver

    # ms: no periodic export during the test, so what arrives is what stopping the proxy flushed
    monkeypatch.setenv("OTEL_METRIC_EXPORT_INTERVAL", "600000")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "600000")
    monkeypatch.setenv("PYTHONPATH", ENV["PYTHONPATH"])
    with receiver() as collector, ServerThread(create_sim("healthy", speed=20)) as sim:
        names = ["--otel-semconv", semconv] if semconv else []
        proxy = start(
            ["serve", "--upstream", sim.url, "--port", "0", "--otlp-endpoint", collector.url + "/", *names],
            "listening on",
        )
        try:
            body = {"model": "m", "stream": True, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
            r = httpx.post(proxy.url + "/v1/chat/completions", json=body, timeout=30)
            assert r.status_code == 200
            rid = r.headers["x-mlxproxy-request-id"]
            assert wait_for(lambda: any(rid in ln for ln in proxy.lines), 15)  # the record is finished
            assert collector.spans() == [] and collector.metrics() == {}  # held until the flush
        finally:
            proxy.stop()  # SIGTERM: uvicorn shuts down gracefully (then re-raises the signal)
        assert proxy.proc.returncode in (0, -15), "".join(proxy.lines)[-2000:]
    said = next(ln for ln in proxy.lines if "exporting OpenTelemetry metrics and spans to" in ln)
    assert f"(metric names: {semconv or 'current'}, " in said
    (span,) = collector.spans()
    attrs = otlp_attrs(span.attributes)
    assert span.name == "chat m" and attrs["mlxproxy.request.id"] == rid
    assert attrs["gen_ai.operation.name"] == "chat" and attrs["gen_ai.request.model"] == "m"
    assert attrs["server.port"] == int(sim.url.rsplit(":", 1)[1]) and attrs["gen_ai.usage.output_tokens"] == 8
    metrics = collector.metrics()
    if semconv == "old":
        assert "gen_ai.client.inference.duration" not in metrics
        usage = {
            otlp_attrs(p.attributes)["gen_ai.token.type"]: p
            for p in metrics["gen_ai.client.token.usage"].histogram.data_points
        }
        assert usage["output"].sum == 8 and usage["output"].count == 1
        assert metrics["gen_ai.client.operation.duration"].histogram.data_points[0].count == 1
    else:
        assert "gen_ai.client.operation.duration" not in metrics and "gen_ai.client.token.usage" not in metrics
        (out,) = metrics["gen_ai.client.inference.usage.output_tokens"].sum.data_points
        assert out.as_int == 8
        (per_op,) = metrics["gen_ai.client.inference.operation.output_tokens"].histogram.data_points
        assert per_op.sum == 8 and per_op.count == 1
        assert metrics["gen_ai.client.inference.duration"].histogram.data_points[0].count == 1
