#!/usr/bin/env python3
"""Build grafana/dashboards/mlxproxy.json, the Grafana dashboard for mlxproxy's metrics.

The JSON is committed and importable as is; this script is its source, so that grid
positions, panel ids and the PromQL stay consistent. Edit here, then run

    python grafana/build_dashboard.py           # rewrite the JSON
    python grafana/build_dashboard.py --check   # exit 1 if the JSON is out of date

Every query is evaluated against a real Prometheus scraping a loaded proxy by
tests/proxy/test_dashboards.py; docs/DASHBOARDS.md describes each panel. Metric names come
from the contract in docs/METRICS.md (and mlxproxy/proxy/metrics.py).

Only the standard library is used, so the script runs anywhere.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent / "dashboards" / "mlxproxy.json"

DS = {"type": "prometheus", "uid": "${datasource}"}
# Every selector carries the proxy (`instance`, set by Prometheus at scrape time), the upstream
# and the model: every panel follows the three variables, and sums over what is selected.
INST = 'instance=~"$instance"'
SEL = f'{INST}, upstream=~"$upstream", model=~"$model"'
GEN_ENDPOINTS = 'endpoint=~"chat_completions|completions|messages|responses|ollama_chat|ollama_generate|lmstudio_chat"'
OK_OUTCOMES = "ok|ok_no_done"
ERR = f'outcome!~"{OK_OUTCOMES}"'
RI = "$__rate_interval"
PROMPT_CACHE = "mlxproxy_prompt_tokens_total"
REUSED = 'cache="reused"'

# The concurrency label's buckets and the stream count each one stands for in the implied
# speedup: the bucket's lower bound, so the figure for a bucket is a lower bound too.
CONCURRENCY_LOWER_BOUND = (("1", 1), ("2", 2), ("3-4", 3), ("5-8", 5), ("9-16", 9), ("17+", 17))


# -- PromQL helpers ------------------------------------------------------------------------

CONCURRENCY = (
    " Concurrency counts the requests whose response was still being forwarded when this one was "
    "sent, itself included: a sequential client on a keep-alive connection is always at 1."
)


def rate(series: str, window: str = RI) -> str:
    return f"rate({series}[{window}])"


def quantile(q: float, metric: str, by: str, extra: str = "") -> str:
    """histogram_quantile over a histogram's buckets, grouped by `by` (plus le)."""
    sel = SEL + (", " + extra if extra else "")
    group = f"le, {by}" if by else "le"
    return f"histogram_quantile({q}, sum by ({group}) ({rate(f'{metric}_bucket{{{sel}}}')}))"


def mean(metric: str, by: str, extra: str = "", window: str = RI, fn: str = "rate", sel: str = SEL) -> str:
    """Mean of a histogram's observations: rate(_sum) / rate(_count)."""
    s = sel + (", " + extra if extra else "")
    group = f"sum by ({by})" if by else "sum"
    return f"{group} ({fn}({metric}_sum{{{s}}}[{window}]))\n/\n{group} ({fn}({metric}_count{{{s}}}[{window}]))"


def rsum(metric: str, by: str = "", extra: str = "") -> str:
    """sum [by (...)] (rate(metric{selected upstream/model, extra}[$__rate_interval]))."""
    sel = SEL + (", " + extra if extra else "")
    group = f"sum by ({by})" if by else "sum"
    return f"{group} ({rate(metric + '{' + sel + '}')})"


def grown(metric: str, window: str, extra: str = "") -> str:
    """How much a counter series grew in the last `window`, exactly, per series.

    increase() cannot see a series' first sample: a counter (or a histogram's _sum/_count)
    born at 1 between two scrapes, which is how every rare event (the first anomaly of a
    kind, the first context-limit error) arrives, never shows up in increase() or rate().
    Here a series that did not exist `window` ago counts from 0, and one that went down (the
    proxy restarted) counts from its restart. No extrapolation: the figures are whole counts.
    """
    s = f"{metric}{{{SEL}{', ' + extra if extra else ''}}}"
    return f"({s} - ({s} offset {window} <= {s}) or {s})"


def gsum(metric: str, window: str, by: str = "", extra: str = "") -> str:
    group = f"sum by ({by})" if by else "sum"
    return f"{group} {grown(metric, window, extra)}"


def range_mean(metric: str, by: str, extra: str = "") -> str:
    """Mean of a histogram's observations over the dashboard range, exact (see grown())."""
    return f"{gsum(metric + '_sum', '$__range', by, extra)}\n/\n{gsum(metric + '_count', '$__range', by, extra)}"


def range_quantile(q: float, metric: str, by: str, extra: str = "") -> str:
    """histogram_quantile over the bucket counts of the whole dashboard range, exact (see grown())."""
    return f"histogram_quantile({q}, {gsum(metric + '_bucket', '$__range', f'le, {by}', extra)})"


def heatmap_expr(metric: str, extra: str = "") -> str:
    sel = SEL + (", " + extra if extra else "")
    return f"sum by (le) ({rate(f'{metric}_bucket{{{sel}}}')})"


# -- panel builders -----------------------------------------------------------------------


def target(
    expr: str, legend: str = "", ref: str = "A", *, instant: bool = False, fmt: str = "time_series"
) -> dict[str, Any]:
    t: dict[str, Any] = {
        "datasource": DS,
        "editorMode": "code",
        "expr": expr,
        "legendFormat": legend or "__auto",
        "refId": ref,
        "range": not instant,
        "instant": instant,
        "format": fmt,
    }
    return t


def targets(*items: tuple[str, str]) -> list[dict[str, Any]]:
    return [target(expr, legend, chr(ord("A") + i)) for i, (expr, legend) in enumerate(items)]


def quantile_targets(
    metric: str, by: str = "upstream", qs: tuple[float, ...] = (0.5, 0.9, 0.99), extra: str = "", with_mean: bool = True
) -> list[dict[str, Any]]:
    prefix = "{{" + by + "}} " if by else ""
    items = [(quantile(q, metric, by, extra), f"{prefix}p{round(q * 100)}") for q in qs]
    if with_mean:
        items.append((mean(metric, by, extra), f"{prefix}mean"))
    return targets(*items)


def timeseries(
    title: str,
    description: str,
    tgts: list[dict[str, Any]],
    unit: str,
    *,
    w: int = 8,
    h: int = 8,
    stack: bool = False,
    min0: bool = True,
    log2: bool = False,
    bars: bool = False,
) -> dict[str, Any]:
    custom: dict[str, Any] = {
        "drawStyle": "bars" if bars else "line",
        "lineInterpolation": "linear",
        "lineWidth": 1,
        "fillOpacity": 80 if bars else 20 if stack else 8,
        "showPoints": "never",
        "spanNulls": False,
        "axisPlacement": "auto",
        "stacking": {"mode": "normal" if stack else "none", "group": "A"},
    }
    if log2:
        custom["scaleDistribution"] = {"type": "log", "log": 2}
    defaults: dict[str, Any] = {"unit": unit, "custom": custom, "color": {"mode": "palette-classic"}}
    if min0:
        defaults["min"] = 0
    return {
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": DS,
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {
            "legend": {
                "showLegend": True,
                "displayMode": "table",
                "placement": "bottom",
                "calcs": ["lastNotNull", "max"],
            },
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
        "targets": tgts,
        "_w": w,
        "_h": h,
    }


def stat(
    title: str,
    description: str,
    tgts: list[dict[str, Any]],
    unit: str,
    *,
    w: int = 6,
    h: int = 4,
    thresholds: list[tuple[float | None, str]] | None = None,
    text_mode: str = "value",
    decimals: int | None = None,
    instant: bool = False,
) -> dict[str, Any]:
    if instant:
        for t in tgts:
            t["instant"], t["range"] = True, False
    steps = [{"color": c, "value": v} for v, c in (thresholds or [(None, "blue")])]
    defaults: dict[str, Any] = {
        "unit": unit,
        "color": {"mode": "thresholds"},
        "thresholds": {"mode": "absolute", "steps": steps},
    }
    if decimals is not None:
        defaults["decimals"] = decimals
    return {
        "type": "stat",
        "title": title,
        "description": description,
        "datasource": DS,
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "value",
            "graphMode": "none" if instant else "area",
            "justifyMode": "auto",
            "orientation": "auto",
            "textMode": text_mode,
            "showPercentChange": False,
            "wideLayout": True,
        },
        "targets": tgts,
        "_w": w,
        "_h": h,
    }


def bargauge(
    title: str,
    description: str,
    tgts: list[dict[str, Any]],
    unit: str,
    *,
    w: int = 8,
    h: int = 8,
    thresholds: list[tuple[float | None, str]] | None = None,
    decimals: int | None = None,
) -> dict[str, Any]:
    for t in tgts:
        t["instant"], t["range"] = True, False
    steps = [{"color": c, "value": v} for v, c in (thresholds or [(None, "green")])]
    defaults: dict[str, Any] = {
        "unit": unit,
        "min": 0,
        "color": {"mode": "thresholds"},
        "thresholds": {"mode": "absolute", "steps": steps},
    }
    if decimals is not None:
        defaults["decimals"] = decimals
    return {
        "type": "bargauge",
        "title": title,
        "description": description,
        "datasource": DS,
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "orientation": "horizontal",
            "displayMode": "gradient",
            "showUnfilled": True,
            "valueMode": "color",
            "namePlacement": "auto",
            "sizing": "auto",
            "minVizHeight": 16,
            "minVizWidth": 8,
            "maxVizHeight": 300,
        },
        "targets": tgts,
        "_w": w,
        "_h": h,
    }


def heatmap(
    title: str, description: str, expr: str, unit: str, *, w: int = 8, h: int = 8, scheme: str = "Oranges"
) -> dict[str, Any]:
    return {
        "type": "heatmap",
        "title": title,
        "description": description,
        "datasource": DS,
        "fieldConfig": {
            "defaults": {
                "custom": {
                    "hideFrom": {"legend": False, "tooltip": False, "viz": False},
                    "scaleDistribution": {"type": "linear"},
                }
            },
            "overrides": [],
        },
        "options": {
            "calculate": False,
            "cellGap": 1,
            "color": {
                "mode": "scheme",
                "scheme": scheme,
                "exponent": 0.5,
                "fill": "dark-orange",
                "reverse": False,
                "scale": "exponential",
                "steps": 64,
            },
            "exemplars": {"color": "rgba(255,0,255,0.7)"},
            "filterValues": {"le": 1e-9},
            "legend": {"show": True},
            "rowsFrame": {"layout": "auto", "value": "requests/s"},
            "tooltip": {"mode": "single", "yHistogram": True, "showColorScale": False},
            "yAxis": {"axisPlacement": "left", "reverse": False, "unit": unit},
        },
        "targets": [target(expr, "{{le}}", fmt="heatmap")],
        "_w": w,
        "_h": h,
    }


def row(title: str) -> dict[str, Any]:
    return {"type": "row", "title": title, "collapsed": False, "panels": [], "_w": 24, "_h": 1}


# -- the panels ---------------------------------------------------------------------------

REQ = "mlxproxy_requests_total"
# The trusted-count rule (docs/METRICS.md, "Trusted token count"), stated on every speed panel.
TRUSTED = (
    " N_out is the record's trusted count: the server's usage when the stream agrees with it, else "
    "a local tokenizer's count, else the counted events; a usage count that fired usage_mismatch or "
    "phantom_speed is never used (those requests show in the anomaly panels)."
)
TOK = "mlxproxy_tokens_total"
TPS = "mlxproxy_output_tokens_per_second"
USAGE = "mlxproxy_usage_reports_total"
COUNTED = 'type="completion", source="counted"'
REPORTED = 'type="completion", source="reported"'
NO_USAGE = 'present="false"'
TTFT = "mlxproxy_time_to_first_token_seconds"
OVERHEAD = "mlxproxy_proxy_overhead_seconds"
LOOP_LAG = "mlxproxy_event_loop_lag_seconds"


def speedup_expr() -> str:
    per_level = range_mean(TPS, "upstream, concurrency", 'kind="decode"')
    streams = "\n  or ".join(
        f'label_replace(vector({n}), "concurrency", "{label}", "", "")' for label, n in CONCURRENCY_LOWER_BOUND
    )
    alone = range_mean(TPS, "upstream", 'kind="decode", concurrency="1"')
    return (
        f"(\n{per_level}\n)\n* on (concurrency) group_left ()\n(\n  {streams}\n)\n"
        f"/ on (upstream) group_left ()\n(\n{alone}\n)"
    )


def panels() -> list[list[dict[str, Any]]]:
    """Lines of the grid, top to bottom: each line is a list of panels whose widths add up to <= 24."""
    return [
        [row("Traffic")],
        [
            stat(
                "Requests/s",
                "Finished requests per second through the proxy, all outcomes, for the selected upstreams and models.",
                targets((f"sum ({rate(f'{REQ}{{{SEL}}}')})", "requests/s")),
                "reqps",
                w=5,
            ),
            stat(
                "Failed requests (range)",
                "Finished requests in the selected time range whose outcome is not ok "
                "or ok_no_done: HTTP errors, context-limit rejections, stream errors, truncated streams, unreachable "
                "or timed-out upstreams, client disconnects, protocol errors. An exact count: the first error of a "
                "kind shows too.",
                targets((gsum(REQ, "$__range", extra=ERR), "failed")),
                "short",
                w=5,
                decimals=0,
                instant=True,
                thresholds=[(None, "green"), (1, "orange")],
            ),
            stat(
                "Error share (range)",
                "Failed requests / all finished requests in the selected time range.",
                targets((f"{gsum(REQ, '$__range', extra=ERR)}\n/\n{gsum(REQ, '$__range')}", "error share")),
                "percentunit",
                w=5,
                instant=True,
                thresholds=[(None, "green"), (0.01, "orange"), (0.1, "red")],
            ),
            stat(
                "Streams in flight",
                "Requests the proxy is forwarding right now (sampled at each scrape: a "
                "request shorter than the scrape interval may never be seen here; the request rate counts it).",
                targets((f"sum (mlxproxy_requests_in_flight{{{SEL}}})", "in flight")),
                "short",
                decimals=0,
                w=5,
            ),
            stat(
                "Proxy build",
                "mlxproxy version of the scraped proxies (mlxproxy_build_info), and how many of the selected "
                "proxies run it: one value per version, so a fleet half-way through an upgrade shows both.",
                targets((f"count by (version) (mlxproxy_build_info{{{INST}}})", "{{version}}")),
                "short",
                text_mode="value_and_name",
                w=4,
            ),
        ],
        [
            timeseries(
                "Requests/s by outcome",
                "Finished requests per second by outcome (ok, ok_no_done, "
                "truncated, stream_error, http_error, context_limit, upstream_unreachable, upstream_timeout, "
                "client_disconnect, protocol_error), stacked. One request has exactly one outcome.",
                targets((f"sum by (outcome) ({rate(f'{REQ}{{{SEL}}}')})", "{{outcome}}")),
                "reqps",
                stack=True,
            ),
            timeseries(
                "Failed requests by outcome and status",
                "Failed requests in each interval of the graph, by "
                'outcome and HTTP status (code "none": no status, e.g. the upstream was unreachable; 200 '
                "with stream_error: an error object inside a streamed answer). Whole counts, so a single "
                "error is visible.",
                targets((gsum(REQ, "$__interval", "outcome, code", ERR), "{{outcome}} ({{code}})")),
                "short",
                stack=True,
                bars=True,
            ),
            timeseries(
                "Streams in flight by upstream",
                "Requests in flight per upstream, sampled at each scrape. "
                "Compare with the batching row: this is the concurrency the server is asked to handle.",
                targets((f"sum by (upstream) (mlxproxy_requests_in_flight{{{SEL}}})", "{{upstream}}")),
                "short",
            ),
        ],
        [row("Latency (successful requests)")],
        [
            timeseries(
                "Time to first token (TTFT)",
                "From the whole client request being in the proxy to the first "
                "generated token: content, reasoning or tool call. Role-only chunks, keep-alive comments and "
                "empty deltas do not count. p50/p90/p99 from histogram buckets, mean exact. Successful "
                "requests only.",
                quantile_targets("mlxproxy_time_to_first_token_seconds"),
                "s",
            ),
            timeseries(
                "Time to first content (TTFC)",
                "Time to the first answer or tool-call token, reasoning "
                "excluded: what the user waits for before the answer starts. Equals TTFT for a model that "
                "does not think.",
                quantile_targets("mlxproxy_time_to_first_content_seconds"),
                "s",
            ),
            timeseries(
                "End-to-end request duration",
                "From the client request in to the response body fully "
                "sent, for the generation endpoints (chat completions, completions, messages, responses). "
                "Unlike TTFT/TTFC this histogram includes failed requests; the trailing usage chunk and "
                "[DONE] are included.",
                quantile_targets("mlxproxy_request_duration_seconds", extra=GEN_ENDPOINTS),
                "s",
            ),
        ],
        [
            timeseries(
                "Thinking before the answer (mean TTFC - mean TTFT)",
                "Mean time to first content minus mean "
                "time to first token, per upstream: roughly how long the model reasons before it starts "
                "answering. 0 for models that do not think. Approximate: a request that never reached its "
                "answer (stopped while reasoning) has a TTFT but no TTFC.",
                targets(
                    (
                        f"(\n{mean('mlxproxy_time_to_first_content_seconds', 'upstream')}\n)\n-\n"
                        f"(\n{mean('mlxproxy_time_to_first_token_seconds', 'upstream')}\n)",
                        "{{upstream}}",
                    )
                ),
                "s",
                w=12,
            ),
            timeseries(
                "First byte vs first token (p50)",
                "Median time to the first response body byte next to the "
                "median time to the first token. A server that sends keep-alive comments or a role-only "
                "chunk has a first byte long before its first token: tools that take the first byte as TTFT "
                "report that gap as speed.",
                targets(
                    (quantile(0.5, "mlxproxy_time_to_first_byte_seconds", "upstream"), "{{upstream}} first byte p50"),
                    (quantile(0.5, "mlxproxy_time_to_first_token_seconds", "upstream"), "{{upstream}} first token p50"),
                ),
                "s",
                w=12,
            ),
        ],
        [row("Token flow")],
        [
            timeseries(
                "Event gaps p50 / p99",
                "Every gap between consecutive generated events of successful "
                "streams (inter-token latency on per-token servers). p99 far above p50 means stalls; a p50 "
                "near 0 with a huge p99 means bursts (tokens held back, then flushed).",
                quantile_targets("mlxproxy_inter_token_latency_seconds", qs=(0.5, 0.99), with_mean=False),
                "s",
            ),
            heatmap(
                "Decode tokens/s per stream (heatmap)",
                "Distribution of per-stream decode speed, (N_out - 1) / "
                "(last token - first token), one observation per successful request, all concurrency levels. "
                "Colour: requests/s in each bucket." + TRUSTED,
                heatmap_expr(TPS, 'kind="decode"'),
                "short",
            ),
            timeseries(
                "Output tokens/s per upstream (all streams)",
                "Generated events per second summed over all "
                "streams of an upstream: the server's live throughput under the real concurrency. Counted by "
                "the proxy (not the server's usage) and added when a request finishes, so long requests "
                "arrive in steps.",
                targets((rsum(TOK, "upstream", COUNTED), "{{upstream}}")),
                "short",
            ),
        ],
        [
            timeseries(
                "Time per output token (TPOT) p50 / p99",
                "Per request: (last token - first token) / "
                "(N_out - 1), the same definition as vLLM's TPOT and aiperf's ITL." + TRUSTED,
                quantile_targets("mlxproxy_time_per_output_token_seconds", qs=(0.5, 0.99), with_mean=False),
                "s",
                w=12,
            ),
            timeseries(
                "Prefill tokens/s p50",
                "Per request: (prompt tokens - cached tokens) / TTFT, with the "
                "server's reported prompt tokens. Falls with prompt length on servers with superlinear "
                "prefill; compare with the prompt-length heatmap.",
                quantile_targets("mlxproxy_prefill_tokens_per_second", qs=(0.5,), with_mean=False),
                "short",
                w=12,
            ),
        ],
        [row("Batching")],
        [
            timeseries(
                "Per-stream decode tokens/s by concurrency (p50)",
                "Median per-stream decode speed, split by "
                "the number of requests in flight to the same upstream when the request was sent (1, 2, 3-4, "
                "5-8, 9-16, 17+)."
                + CONCURRENCY
                + " On a batching server each stream slows a little as streams are added; on a "
                "serial server it does not slow, but requests queue (see TTFT)." + TRUSTED,
                targets(
                    (quantile(0.5, TPS, "upstream, concurrency", 'kind="decode"'), "{{upstream}} c={{concurrency}}")
                ),
                "short",
            ),
            bargauge(
                "Mean per-stream decode tokens/s by concurrency (range)",
                "Mean per-stream decode speed over "
                "the whole selected time range, per upstream and concurrency level: sum of observations / "
                "count, exact (no bucket interpolation)." + CONCURRENCY + TRUSTED,
                targets((range_mean(TPS, "upstream, concurrency", 'kind="decode"'), "{{upstream}} c={{concurrency}}")),
                "short",
                decimals=1,
            ),
            bargauge(
                "Implied decode speedup by concurrency (range)",
                "n x (mean per-stream decode tokens/s at "
                "concurrency level n) / (mean per-stream decode tokens/s of requests that ran alone), per "
                "upstream, over the selected range. n is the lower bound of the level (3-4 counts as 3, 5-8 "
                "as 5, 9-16 as 9, 17+ as 17), so the figure is a lower bound. 2.0 at c=2 is perfect batching; "
                "1.0 means no gain over one stream; below 1 means worse than serial. Decode phase only: "
                "prefill and queueing are not in it. Empty for an upstream with no request that ran alone."
                + CONCURRENCY
                + TRUSTED,
                targets((speedup_expr(), "{{upstream}} c={{concurrency}}")),
                "none",
                decimals=2,
                thresholds=[(None, "red"), (1, "orange"), (1.5, "green")],
            ),
        ],
        [row("Truth: usage and anomalies")],
        [
            timeseries(
                "Reported / counted output tokens",
                "The server's usage.completion_tokens divided by the "
                "generated events the proxy counted, per upstream and model. About 1 on a per-token server "
                "(slightly above if it counts EOS); far above 1 means the server reports tokens it never "
                "streamed (phantom speed in tools that trust usage) or sends several tokens per event. "
                "Below 1 when some streams carried no usage (see the next panel); above 1 when non-streamed "
                "answers are in the mix (they add reported tokens, but the proxy counts tokens only in "
                "streams). The anomaly panels judge each request on its own; a request whose usage fired "
                "usage_mismatch or phantom_speed has its speeds computed from its streamed (or tokenizer) "
                "count instead.",
                targets(
                    (
                        rsum(TOK, "upstream, model", REPORTED) + "\n/\n" + rsum(TOK, "upstream, model", COUNTED),
                        "{{upstream}} {{model}}",
                    )
                ),
                "none",
            ),
            timeseries(
                "Usage missing share",
                "Share of successful-status responses (streams and non-streamed "
                "answers of the generation endpoints) that carried no usage report at all, per upstream. "
                "The proxy asks for usage on streams by default, so a share above 0 is the server dropping "
                "it (or a stream that broke before its end).",
                targets(
                    (
                        f"(\n  {rsum(USAGE, 'upstream', NO_USAGE)}\n  or {rsum(USAGE, 'upstream')} * 0\n)\n/\n{rsum(USAGE, 'upstream')}",
                        "{{upstream}}",
                    )
                ),
                "percentunit",
            ),
            bargauge(
                "Anomalies in range by kind",
                "Truth-check findings in the selected time range, per upstream "
                "and kind (usage_mismatch, phantom_speed, usage_missing, non_incremental_stream, stall, "
                "context_limit, missing_finish, stream_error, duplicate_content, dual_reasoning_fields, ...). "
                "Whole counts: a single finding shows. docs/DASHBOARDS.md says what each kind means.",
                targets((gsum("mlxproxy_anomalies_total", "$__range", "upstream, kind"), "{{upstream}} {{kind}}")),
                "short",
                decimals=0,
                thresholds=[(None, "green"), (1, "orange")],
            ),
        ],
        [
            timeseries(
                "Anomalies over time by kind",
                "The same findings in each interval of the graph, so an "
                "anomaly can be matched with what you were doing at the time.",
                targets((gsum("mlxproxy_anomalies_total", "$__interval", "upstream, kind"), "{{upstream}} {{kind}}")),
                "short",
                w=24,
                h=7,
                stack=True,
                bars=True,
            ),
        ],
        [row("Prompt cache (agents' multi-turn conversations)")],
        [
            timeseries(
                "Prompt cache hit ratio",
                "Share of prompt tokens the server served from its prompt cache "
                "(prompt_tokens_details.cached_tokens) among all prompt tokens of the requests that report "
                'cached tokens, per upstream: rate(prompt_tokens{cache="reused"}) / rate(prompt_tokens). An '
                "agent resending its conversation every turn should sit near 1 after the first turn; a server "
                "that re-prefills every turn sits near 0. The prefix_cache_miss and prompt_prefix_changed "
                "anomalies say which turns missed and why.",
                targets(
                    (rsum(PROMPT_CACHE, "upstream", REUSED) + "\n/\n" + rsum(PROMPT_CACHE, "upstream"), "{{upstream}}")
                ),
                "percentunit",
                w=12,
            ),
            timeseries(
                "Prefill time wasted on cache misses",
                "Seconds of TTFT lost to prefix_cache_miss in each "
                "interval, per upstream: for every turn whose reusable prefix the server did not reuse, its TTFT "
                "minus the TTFT a hit would have had (prefill_wasted_s; an estimate from the turn's own prefill "
                "rate). This is the time agents waited because the server re-prefilled what it already had.",
                targets((gsum("mlxproxy_prefill_wasted_seconds_total", "$__interval", "upstream"), "{{upstream}}")),
                "s",
                w=12,
                bars=True,
            ),
        ],
        [
            timeseries(
                "Prefill time lost to re-prefills, by cause",
                "Seconds of prefill that agent conversations lost in each interval because a turn could not "
                "reuse the previous turn's prompt, by cause (reprefill_lost_s; an estimate: TTFT x lost / "
                "prefilled tokens): volatile_span (a per-request value in the system prompt), system_changed, "
                "tools_changed, history_rewritten (compaction, truncation), model_changed, cache_evicted (the "
                "prompt extended the previous one but the server prefilled it all). /sessions and the live "
                "page's conversations panel show which conversation and where.",
                targets((gsum("mlxproxy_reprefill_lost_seconds_total", "$__interval", "cause"), "{{cause}}")),
                "s",
                w=24,
                bars=True,
            ),
        ],
        [row("Proxy overhead")],
        [
            timeseries(
                "Proxy overhead p50 / p99 by phase",
                "Time the proxy itself adds. phase=request: from the "
                "whole client request in to the request handed to the upstream connection (once per "
                "request); phase=chunk: from an upstream read to the client write done (once per chunk). "
                "All upstreams and the selected proxies (this histogram has no upstream label).",
                [
                    target(
                        f"histogram_quantile({q}, sum by (le, phase) ({rate(OVERHEAD + '_bucket{' + INST + '}')}))",
                        f"{{{{phase}}}} p{round(q * 100)}",
                        chr(ord("A") + i),
                    )
                    for i, q in enumerate((0.5, 0.99))
                ],
                "s",
                w=12,
                h=7,
            ),
            timeseries(
                "Proxy event-loop lag p50 / p99",
                "How much later than scheduled the proxy's event "
                "loop ran a timer (sampled every 50 ms; ~1 ms resolution on uvloop). While the loop is late, "
                "requests wait unread in the proxy's sockets and tokens wait unforwarded: time no TTFT or "
                "overhead figure contains. Tens of milliseconds mean the proxy itself (or a starved machine) "
                "is slowing clients down.",
                [
                    target(
                        f"histogram_quantile({q}, sum by (le) ({rate(LOOP_LAG + '_bucket{' + INST + '}')}))",
                        f"p{round(q * 100)}",
                        chr(ord("A") + i),
                    )
                    for i, q in enumerate((0.5, 0.99))
                ],
                "s",
                w=12,
                h=7,
            ),
        ],
        [row("Prompt and generation length")],
        [
            heatmap(
                "Prompt length (tokens)",
                "Prompt tokens per successful request as the server reported them, "
                "bucketed (16 ... 131072). Colour: requests/s in each bucket.",
                heatmap_expr("mlxproxy_prompt_length_tokens"),
                "short",
                w=12,
                scheme="Blues",
            ),
            heatmap(
                "Generation length (tokens)",
                "Output tokens per successful request, bucketed. Colour: requests/s in each bucket." + TRUSTED,
                heatmap_expr("mlxproxy_generation_length_tokens"),
                "short",
                w=12,
                scheme="Greens",
            ),
        ],
        *fleet_panels(),
    ]


# The fleet row: the same metrics broken down by the proxy that exported them (`instance`, the
# target label Prometheus adds at scrape time). Every panel above sums over the selected proxies.
SHARDING = (
    " The serialized and generation_after_disconnect checks, the concurrency label (the batching row) and "
    "the prompt-cache checks each see only the streams of their own proxy: keep every stream of one "
    'upstream on one proxy (docs/DASHBOARDS.md, "A fleet of proxies").'
)


def fleet_panels() -> list[list[dict[str, Any]]]:
    by_proxy = "{{instance}}"
    return [
        [row("Fleet: per proxy")],
        [
            timeseries(
                "Requests/s by proxy",
                "Finished requests per second, all outcomes, per proxy (the instance label Prometheus gives each "
                "scrape target). The Requests/s stat is their sum.",
                targets((rsum(REQ, "instance"), by_proxy)),
                "reqps",
            ),
            timeseries(
                "Streams in flight by proxy",
                "Requests each proxy is forwarding, sampled at each scrape. The Streams in flight stat is their sum.",
                targets((f"sum by (instance) (mlxproxy_requests_in_flight{{{SEL}}})", by_proxy)),
                "short",
            ),
            bargauge(
                "Requests by proxy and upstream (range)",
                "Finished requests in the selected time range, all outcomes, per proxy and upstream: how the "
                "traffic is spread over the fleet. Whole counts.",
                targets((gsum(REQ, "$__range", "instance, upstream"), "{{instance}} {{upstream}}")),
                "short",
                decimals=0,
            ),
        ],
        [
            timeseries(
                "TTFT p50 / p99 by proxy",
                "Time to first token per proxy, successful requests, from each proxy's own histogram buckets. "
                "The TTFT panel sums the buckets of every selected proxy before taking the quantile (a "
                "quantile of the whole fleet, never an average of quantiles).",
                quantile_targets(TTFT, by="instance", qs=(0.5, 0.99), with_mean=False),
                "s",
            ),
            bargauge(
                "TTFT p50 / p99 by proxy (range)",
                "Time to first token per proxy over the whole selected time range, successful requests: "
                "p50 and p99 from the exact bucket counts of the range (every request in it, the first ones "
                "included).",
                targets(
                    (range_quantile(0.5, TTFT, "instance"), "{{instance}} p50"),
                    (range_quantile(0.99, TTFT, "instance"), "{{instance}} p99"),
                ),
                "s",
                decimals=3,
            ),
            bargauge(
                "Proxies per upstream (range)",
                "How many proxies forwarded requests to each upstream in the selected time range. 1 is the "
                "layout the checks need; 2 or more (orange) means each proxy sees only part of that upstream's "
                "streams." + SHARDING,
                targets(
                    (
                        f"count by (upstream) (\n{gsum(REQ, '$__range', 'upstream, instance')} > 0\n)",
                        "{{upstream}}",
                    )
                ),
                "short",
                decimals=0,
                thresholds=[(None, "green"), (2, "orange")],
            ),
        ],
        [
            timeseries(
                "Proxy event-loop lag p99 by proxy",
                "How late each proxy's event loop ran its 50 ms timer, p99 per proxy: a starved machine "
                "shows here, where the fleet-wide panel would average it away.",
                targets(
                    (
                        f"histogram_quantile(0.99, sum by (le, instance) ({rate(LOOP_LAG + '_bucket{' + INST + '}')}))",
                        by_proxy,
                    )
                ),
                "s",
                w=12,
                h=7,
            ),
            timeseries(
                "Proxy overhead p99 by proxy",
                "The time each proxy itself adds, p99 per proxy and phase (request: client request in to "
                "upstream send; chunk: upstream read to client write done).",
                targets(
                    (
                        f"histogram_quantile(0.99, sum by (le, instance, phase) ({rate(OVERHEAD + '_bucket{' + INST + '}')}))",
                        "{{instance}} {{phase}}",
                    )
                ),
                "s",
                w=12,
                h=7,
            ),
        ],
    ]


def layout(lines: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    y = 0
    next_id = 1
    for line in lines:
        x = 0
        height = 0
        for p in line:
            w, h = p.pop("_w"), p.pop("_h")
            if x + w > 24:
                raise ValueError(f"panel {p['title']!r} does not fit in its line")
            p["gridPos"] = {"x": x, "y": y, "w": w, "h": h}
            p["id"] = next_id
            next_id += 1
            out.append(p)
            x += w
            height = max(height, h)
        y += height
    return out


def variables() -> list[dict[str, Any]]:
    def query_var(name: str, label: str, query: str) -> dict[str, Any]:
        return {
            "type": "query",
            "name": name,
            "label": label,
            "datasource": DS,
            "definition": query,
            "query": {"query": query, "refId": f"PrometheusVariableQueryEditor-{name}"},
            "refresh": 2,
            "regex": "",
            "sort": 1,
            "multi": True,
            "includeAll": True,
            "allValue": ".*",
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
            "options": [],
            "hide": 0,
            "skipUrlSync": False,
        }

    return [
        {
            "type": "datasource",
            "name": "datasource",
            "label": "Data source",
            "query": "prometheus",
            "regex": "",
            "current": {},
            "options": [],
            "hide": 0,
            "refresh": 1,
            "includeAll": False,
            "multi": False,
            "skipUrlSync": False,
        },
        query_var("instance", "Proxy", "label_values(mlxproxy_build_info, instance)"),
        query_var("upstream", "Upstream", f"label_values({REQ}{{{INST}}}, upstream)"),
        query_var("model", "Model", f'label_values({REQ}{{{INST}, upstream=~"$upstream"}}, model)'),
    ]


def dashboard() -> dict[str, Any]:
    return {
        "__requires": [
            {"type": "grafana", "id": "grafana", "name": "Grafana", "version": "10.0.0"},
            {"type": "datasource", "id": "prometheus", "name": "Prometheus", "version": "1.0.0"},
            {"type": "panel", "id": "timeseries", "name": "Time series", "version": ""},
            {"type": "panel", "id": "stat", "name": "Stat", "version": ""},
            {"type": "panel", "id": "bargauge", "name": "Bar gauge", "version": ""},
            {"type": "panel", "id": "heatmap", "name": "Heatmap", "version": ""},
        ],
        "annotations": {
            "list": [
                {
                    "builtIn": 1,
                    "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                    "enable": True,
                    "hide": True,
                    "iconColor": "rgba(0, 211, 255, 1)",
                    "name": "Annotations & Alerts",
                    "type": "dashboard",
                }
            ]
        },
        "description": "mlxproxy: what a local OpenAI-compatible LLM server really does (TTFT vs first content, "
        "event gaps, per-stream speed against concurrency, reported vs counted tokens, anomalies). "
        "Panels: docs/DASHBOARDS.md.",
        "editable": True,
        "fiscalYearStartMonth": 0,
        "graphTooltip": 1,
        "id": None,
        "links": [],
        "panels": layout(panels()),
        "refresh": "10s",
        "schemaVersion": 39,
        "tags": ["mlxproxy", "llm", "mlx"],
        "templating": {"list": variables()},
        "time": {"from": "now-30m", "to": "now"},
        "timepicker": {"refresh_intervals": ["5s", "10s", "30s", "1m", "5m"]},
        "timezone": "browser",
        "title": "mlxproxy: local LLM serving",
        "uid": "mlxproxy",
        "version": 1,
        "weekStart": "",
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if not OUT.exists() or OUT.read_text(encoding="utf-8") != text:
            print(f"{OUT} is out of date: run python grafana/build_dashboard.py", file=sys.stderr)
            return 1
        return 0
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
