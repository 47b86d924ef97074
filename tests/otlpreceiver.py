"""A loopback OTLP/HTTP receiver for the OpenTelemetry tests: what a Collector's `otlp` receiver
takes on its HTTP port (`/v1/traces`, `/v1/metrics`, protobuf bodies), decoded with the
opentelemetry-proto package (installed with the `[otel]` extra; import this module only after
checking it is there)."""

from __future__ import annotations

import contextlib
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from integration.serving import serving

KINDS = {"/v1/traces": ExportTraceServiceRequest, "/v1/metrics": ExportMetricsServiceRequest}


class Receiver(ThreadingHTTPServer):
    """Keeps each decoded export request by path, and the content types it was sent with."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.got: dict[str, list[Any]] = {path: [] for path in KINDS}
        self.content_types: set[str] = set()
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def spans(self) -> list[Any]:
        with self.lock:
            reqs = list(self.got["/v1/traces"])
        return [s for req in reqs for rs in req.resource_spans for ss in rs.scope_spans for s in ss.spans]

    def metrics(self) -> dict[str, Any]:
        """name -> the last exported metric of that name (the SDK exports cumulative sums)."""
        with self.lock:
            reqs = list(self.got["/v1/metrics"])
        return {m.name: m for req in reqs for rm in req.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}


class _Handler(BaseHTTPRequestHandler):
    server: Receiver

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        kind = KINDS.get(self.path)
        if kind is None or self.headers.get("Content-Encoding"):  # the exporters send uncompressed by default
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        msg = kind()
        msg.ParseFromString(body)
        with self.server.lock:
            self.server.got[self.path].append(msg)
            self.server.content_types.add(self.headers["Content-Type"])
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


def receiver() -> contextlib.AbstractContextManager[Receiver]:
    srv = Receiver()

    def stop() -> None:
        srv.shutdown()
        srv.server_close()

    return serving(srv, srv.serve_forever, stop)


def otlp_attrs(kvs: Any) -> dict[str, object]:
    """OTLP key-values as a dict (string arrays as lists)."""
    out: dict[str, object] = {}
    for kv in kvs:
        v = kv.value
        which = v.WhichOneof("value")
        out[kv.key] = [x.string_value for x in v.array_value.values] if which == "array_value" else getattr(v, which)
    return out
