"""Per-event CPU of the proxy's metering path, in-process.

What the proxy's relay runs per upstream read on its default path (the client did not ask
for usage, so the proxy injected it and strips it again): `RequestMeter.strip` (`SSEDecoder.feed`,
`UsageStripper.process`) then `RequestMeter.feed_forwarded`; plus what each request costs at its
end (`finish_checked`, `ProxyMetrics.on_record`, `observe_overhead`). One read per event,
as a paced upstream delivers them. Reports the best of 5 × (300,000 / TOKENS) streams, in CPU
microseconds per generated event (no I/O, so it is far less noisy than the side-by-side run).

    .venv/bin/python benchmarks/bench_meter.py [SRC_DIR] [--tokens N] [--profile]

SRC_DIR (default: this repository) is a folder holding a `mlxproxy/` package, e.g. a scratch
copy with a hot-path change, so two versions can be compared on one machine.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

TOKEN = (
    'data: {{"id":"chatcmpl-bench","object":"chat.completion.chunk","created":1700000000,"model":"bench",'
    '"ts":{ts:.7f},"choices":[{{"index":0,"delta":{{"content":"tok{k} "}},"finish_reason":null}}]}}\n\n'
)
ROLE = (
    b'data: {"id":"chatcmpl-bench","object":"chat.completion.chunk","created":1700000000,"model":"bench",'
    b'"choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}\n\n'
)
FINISH = (
    b'data: {"id":"chatcmpl-bench","object":"chat.completion.chunk","created":1700000000,"model":"bench",'
    b'"choices":[{"index":0,"delta":{},"finish_reason":"length"}]}\n\n'
)
USAGE = (
    'data: {{"id":"chatcmpl-bench","object":"chat.completion.chunk","created":1700000000,"model":"bench",'
    '"choices":[],"usage":{{"prompt_tokens":12,"completion_tokens":{n},"total_tokens":{t}}}}}\n\n'
)
BODY = b'{"model":"bench","messages":[{"role":"user","content":"Say hello."}],"max_tokens":100,"stream":true}'


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="CPU per event of the proxy's metering path, in-process.")
    ap.add_argument(
        "src",
        nargs="?",
        default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        help="folder holding the mlxproxy package to measure (default: this repository)",
    )
    ap.add_argument("--tokens", type=int, default=100, help="content events per stream (default 100)")
    ap.add_argument("--profile", action="store_true", help="print a cProfile of 500 streams instead")
    args = ap.parse_args(argv)
    src = os.path.abspath(args.src)
    sys.path.insert(0, src)
    from prometheus_client import CollectorRegistry

    import mlxproxy
    from mlxproxy.core.analyze import finish_checked
    from mlxproxy.core.detect import Thresholds
    from mlxproxy.core.meter import RequestMeter
    from mlxproxy.core.openai import inject_include_usage, parse_request
    from mlxproxy.core.strip import UsageStripper
    from mlxproxy.proxy.metrics import ProxyMetrics

    if not os.path.abspath(mlxproxy.__file__).startswith(src):
        print(f"imported {mlxproxy.__file__}, not the package under {src}", file=sys.stderr)
        return 2
    n_tok = args.tokens
    chunks = (
        [ROLE]
        + [TOKEN.format(ts=1000.0 + k, k=k).encode() for k in range(n_tok)]
        + [FINISH + USAGE.format(n=n_tok, t=n_tok + 12).encode() + b"data: [DONE]\n\n"]
    )
    metrics = ProxyMetrics(CollectorRegistry())
    th = Thresholds()
    now = time.perf_counter

    def one_stream() -> object:
        info, obj = parse_request("POST", "/v1/chat/completions", BODY)
        inject_include_usage(BODY, obj)  # type: ignore[arg-type]
        t = now()
        m = RequestMeter(info, request_id="x", upstream="default", t_start=t, started_at=0.0, usage_injected=True)
        m.upstream_sent(t)
        m.response_started(t, 200, "text/event-stream")
        stripper = UsageStripper()
        overheads = []
        if hasattr(m, "feed_forwarded"):  # the proxy's stripping relay loop (proxy/relay.py), less the send
            strip, feed_forwarded = m.strip, m.feed_forwarded
            for c in chunks:
                t = now()
                _, items = strip(c, stripper)
                feed_forwarded(c, items, t)
                overheads.append(now() - t)
        else:  # a source before strip/feed_forwarded: the stripper branch of ProxyApp._forward as it was
            dec = m.decoder
            assert dec is not None
            for c in chunks:
                t = now()
                if m.done:
                    stripper.flush()
                    m.feed(c, t)
                else:
                    items = dec.feed(c)
                    stripper.process(c, items, dec.safe_offset)
                    m.feed_decoded(len(c), items, t)
                overheads.append(now() - t)
        stripper.flush()
        record = finish_checked(m, now(), th)
        metrics.on_record(record)
        metrics.observe_overhead(0.0001, overheads)
        return record

    for _ in range(200):
        one_stream()
    record = one_stream()
    if getattr(record, "generated_events", None) != n_tok:
        print(f"unexpected record: {record!r}", file=sys.stderr)
        return 1
    if args.profile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.runcall(lambda: [one_stream() for _ in range(500)])
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)
        return 0
    n = max(300_000 // n_tok, 20)
    runs = []
    for _ in range(5):
        t0 = time.process_time()
        for _ in range(n):
            one_stream()
        runs.append((time.process_time() - t0) / (n * n_tok) * 1e6)
    print(
        f"{src}: {min(runs):.2f} us CPU per event, {n_tok}-token streams "
        f"(best of 5: {', '.join(f'{r:.2f}' for r in runs)})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
