"""Summaries, tables and result files for `replay`, `bench` and `report`.

A result file is JSON: `{"mlxproxy_result": 1, "kind", "created_at", "version",
"groups": [{"name", "target", "mode", "params", "summary", "records": [...]}],
"verdicts": {target: text}}`, with every per-request record (timeline included), so
`mlxproxy report` can render it again and others can recompute anything from it.
"""

from __future__ import annotations

import csv
import math
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import orjson

from mlxproxy import __version__
from mlxproxy.core.detect import overlap_ratio
from mlxproxy.core.record import OK_OUTCOMES, Record, rate_figures
from mlxproxy.core.stats import percentile, summarize
from mlxproxy.errors import MlxproxyError

__all__ = ["aggregate_tps", "summarize_records", "render_table", "write_result", "read_result", "write_csv",
           "summary_row", "SUMMARY_COLUMNS", "mark_speeds", "untrusted_mark", "untrusted_notes"]

RESULT_VERSION = 1


def aggregate_tps(records: Iterable[Record]) -> float | None:
    """sum(N_out) / (max t_end - min t_start) over successful records (one clock)."""
    ok = [r for r in records if r.outcome in OK_OUTCOMES and r.n_out is not None and r.duration_s is not None]
    if not ok:
        return None
    span = max(r.t_end_mono for r in ok) - min(r.t_start_mono for r in ok)
    return sum(r.n_out or 0 for r in ok) / span if span > 0 else None


def summarize_records(records: Sequence[Record], *, waves: Sequence[Sequence[Record]] | None = None,
                      single_wall_tps: float | None = None, lag_s: Sequence[float] | None = None) -> dict[str, Any]:
    """Headline figures of a group: medians (p50) first, then p90/p99/min/max/count.
    Failed requests never enter latency statistics; they are counted by outcome."""
    ok = [r for r in records if r.outcome in OK_OUTCOMES]

    def stat(attr: str) -> dict[str, Any]:
        return summarize(getattr(r, attr) for r in ok)

    if waves:
        per_wave = [a for a in (aggregate_tps(w) for w in waves) if a is not None]
        agg = percentile(sorted(per_wave), 50) if per_wave else None
        overlaps = [o for o in (overlap_ratio(w) for w in waves) if o is not None]
        overlap = percentile(sorted(overlaps), 50) if overlaps else None
    else:
        agg = aggregate_tps(records)
        overlap = None
    anomalies: dict[str, dict[str, Any]] = {}
    for r in records:
        for kind in r.anomalies:
            a = anomalies.setdefault(kind, {"count": 0, "evidence": r.anomaly_evidence.get(kind, "")})
            a["count"] += 1
    out: dict[str, Any] = {
        "requests": len(records),
        "ok": len(ok),
        "outcomes": dict(Counter(r.outcome for r in records)),
        "ttft_s": stat("ttft_s"),
        "ttfc_s": stat("ttfc_s"),
        "e2e_s": stat("e2e_s"),
        "wall_tps": stat("wall_tps"),
        "decode_tps": stat("decode_tps"),
        "tpot_s": stat("tpot_s"),
        "prefill_tps": stat("prefill_tps"),
        "aggregate_tps": agg,
        "speedup": (agg / single_wall_tps) if (agg is not None and single_wall_tps) else None,
        "overlap": overlap,
        "anomalies": anomalies,
    }
    # rows whose speeds do not use the server's usage (the stream contradicted it), and what
    # the usage would have made of them (tables mark the row and print both figures)
    untrusted = [r for r in ok if r.usage_untrusted]
    out["untrusted_usage"] = len(untrusted)
    if untrusted:
        by_usage = [rate_figures(r.completion_tokens_reported, r.ttft_s, r.e2e_s, r.duration_s) for r in ok]
        out["usage_figures"] = {"wall_tps_p50": summarize(f[2] for f in by_usage)["p50"],
                                "decode_tps_p50": summarize(f[1] for f in by_usage)["p50"],
                                "sources": dict(Counter(r.tokens_source for r in untrusted))}
    if lag_s is not None:
        out["schedule_lag_s"] = summarize(lag_s)
    return out


def untrusted_mark(s: dict[str, Any]) -> str:
    """"*" for a group some of whose speeds do not use the server's usage count, else ""."""
    return "*" if s.get("untrusted_usage") else ""


def untrusted_notes(items: Iterable[tuple[str, dict[str, Any]]]) -> list[str]:
    """One footnote line per marked group (`label`, summary): which count its speeds use and
    the figures the server's usage would have given."""
    lines = []
    for label, s in items:
        if not untrusted_mark(s):
            continue
        uf = s.get("usage_figures") or {}
        names = {"stream": "streamed", "tokenizer": "local tokenizer's"}
        src = " / ".join(names.get(k, k) for k in sorted(uf.get("sources", {}))) or "streamed"
        lines.append(f"* {label}: usage not trusted in {s['untrusted_usage']} of {s['ok']} requests (the stream "
                     f"contradicts it); speeds use the {src} count. From the usage they would read wall "
                     f"{_num(uf.get('wall_tps_p50'), '.1f')}, decode {_num(uf.get('decode_tps_p50'), '.1f')} tok/s.")
    return lines


def _num(v: Any, fmt: str) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return format(v, fmt)


SUMMARY_COLUMNS = ("target", "mode", "requests", "errors", "ttft_p50", "wall_tps_p50", "decode_tps_p50",
                   "tpot_p50", "tpot_p99", "aggregate_tps", "speedup", "anomalies")


def summary_row(target: str, mode: str, s: dict[str, Any]) -> dict[str, str]:
    errors = {k: v for k, v in s["outcomes"].items() if k not in OK_OUTCOMES}
    row = {
        "target": target,
        "mode": mode,
        "requests": str(s["requests"]),
        "errors": ", ".join(f"{k} {v}" for k, v in sorted(errors.items())) or "0",
        "ttft_p50": _num(s["ttft_s"]["p50"], ".3f") + ("s" if s["ttft_s"]["p50"] is not None else ""),
        "wall_tps_p50": _num(s["wall_tps"]["p50"], ".1f"),
        "decode_tps_p50": _num(s["decode_tps"]["p50"], ".1f"),
        "tpot_p50": _ms(s["tpot_s"]["p50"]),
        "tpot_p99": _ms(s["tpot_s"]["p99"]),
        "aggregate_tps": _num(s["aggregate_tps"], ".1f"),
        "speedup": (_num(s["speedup"], ".2f") + "x") if s.get("speedup") is not None else "-",
        "anomalies": ", ".join(f"{k} {v['count']}" for k, v in sorted(s["anomalies"].items())) or "-",
    }
    return mark_speeds(row, s, ("wall_tps_p50", "decode_tps_p50", "tpot_p50", "tpot_p99", "aggregate_tps", "speedup"))


def mark_speeds(row: dict[str, str], s: dict[str, Any], keys: Sequence[str]) -> dict[str, str]:
    """`row` with the untrusted-usage mark after each figure in `keys` (see `untrusted_notes`)."""
    mark = untrusted_mark(s)
    if mark:
        for k in keys:
            if row.get(k, "-") != "-":
                row[k] += mark
    return row


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.1f}ms"


def render_table(rows: Sequence[dict[str, str]], columns: Sequence[str] | None = None) -> str:
    """A plain-text table (no dependency), columns in order, widths fitted."""
    if not rows:
        return "(no results)"
    cols = list(columns or rows[0].keys())
    widths = {c: max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in cols}
    line = "  ".join(c.ljust(widths[c]) for c in cols)
    sep = "  ".join("-" * widths[c] for c in cols)
    body = ["  ".join(str(r.get(c, "")).ljust(widths[c]) for c in cols) for r in rows]
    return "\n".join([line, sep, *body])


def write_result(path: str | Path, kind: str, groups: list[dict[str, Any]], verdicts: dict[str, str] | None = None,
                 extra: dict[str, Any] | None = None) -> None:
    doc = {"mlxproxy_result": RESULT_VERSION, "kind": kind, "version": __version__, "created_at": time.time(),
           "groups": groups, "verdicts": verdicts or {}, **(extra or {})}
    Path(path).write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))


def read_result(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    try:
        doc = orjson.loads(p.read_bytes())
    except OSError as exc:
        raise MlxproxyError(f"cannot read result file {str(p)!r}: {exc.strerror or exc}") from exc
    except orjson.JSONDecodeError as exc:
        raise MlxproxyError(f"{p} is not a JSON result file ({exc})") from exc
    if not isinstance(doc, dict) or "mlxproxy_result" not in doc:
        raise MlxproxyError(f"{p} is not an mlxproxy result file (written by replay/bench --json)")
    if doc["mlxproxy_result"] > RESULT_VERSION:
        raise MlxproxyError(f"{p} was written by a newer mlxproxy (result format {doc['mlxproxy_result']}); upgrade mlxproxy")
    return doc


CSV_FIELDS = ("group", "target", "mode", "id", "source_id", "model", "endpoint", "stream", "status", "outcome", "ttfb_s",
              "ttft_s", "ttfc_s", "e2e_s", "tpot_s", "decode_tps", "wall_tps", "prefill_tps", "prompt_tokens",
              "cached_tokens", "completion_tokens", "tokens_source", "completion_tokens_reported", "completion_tokens_counted",
              "completion_tokens_tokenizer", "reasoning_tokens_counted",
              "usage_reports", "finish_reason", "concurrency", "anomalies", "error")


def write_csv(path: str | Path, groups: list[dict[str, Any]]) -> None:
    """One row per request of every group."""
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        for g in groups:
            for r in g["records"]:
                row = dict(r)
                row.update(group=g["name"], target=g["target"], mode=g["mode"], anomalies=";".join(r.get("anomalies", [])))
                w.writerow(row)
