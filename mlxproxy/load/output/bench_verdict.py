"""What a bench result says: the batching verdict of its waves (`wave_class`,
`batching_verdict`), the one-line verdict per target (`verdict`) and the headline row with its
footnotes (`headline`, `headline_notes`). Read from results alone, so `mlxproxy report` says the
same of a saved file as the run that wrote it."""

from __future__ import annotations

import math
from collections.abc import Sequence

from mlxproxy.core.record import OK_OUTCOMES
from mlxproxy.core.stats import percentile
from mlxproxy.load.data.results import Group
from mlxproxy.load.data.summary import AnomalyCount, Wave
from mlxproxy.load.data.targets import TargetResult
from mlxproxy.load.output.report import mark_speeds, range_text, untrusted_notes

__all__ = [
    "ANOMALY_SHARE",
    "BATCH_CLASSES",
    "batching_verdict",
    "first_wave",
    "headline",
    "headline_notes",
    "smallest_single",
    "verdict",
    "wave_class",
]

#: overlap (share of a wave's decode time when at least two of its streams were generating) at or
#: below which the streams were served one after another, and at or above which they were generated together
OVERLAP_SERIAL = 0.25
OVERLAP_BATCHING = 0.6
#: with overlapping streams, a speedup below this is no gain (a CPU-bound server shares one compute)
GAIN = 1.2
#: a median speedup within this of GAIN (1.1-1.3) cannot say gain from no gain: one lone request's
#: tok/s varies that much from the next on a shared machine, so the verdict says so instead of flipping
GAIN_MARGIN = 0.1
#: N streams can give at most N x one stream; beyond N x this margin the baseline was not comparable
IMPOSSIBLE_MARGIN = 1.1
#: a verdict names an anomaly only when at least this share of the target's requests had it
ANOMALY_SHARE = 0.25

BATCH_CLASSES = (
    "rejects concurrent requests",
    "serial",
    "partial batching",
    "batches, no gain",
    "continuous batching",
    "overlap not measurable",
)


def wave_class(w: Wave) -> str:
    """What one wave of the batch test showed (one of BATCH_CLASSES): a request failed while
    another was served; else by overlap first (serial only with low overlap, batching only with
    high), the speedup deciding only between gain and no gain among overlapping streams."""
    if w.failed and w.ok:
        return "rejects concurrent requests"
    ov, sp = w.overlap, w.speedup
    if ov is None:
        return "overlap not measurable"
    if ov <= OVERLAP_SERIAL:
        return "serial"
    if ov < OVERLAP_BATCHING:
        return "partial batching"
    return "continuous batching" if sp is None or sp >= GAIN else "batches, no gain"


def batching_verdict(group: Group) -> str | None:
    """The batching part of a verdict, from a wave group (`double`, `xN`): the class most
    waves agree on (two thirds of them), with the median speedup and its spread over the waves
    and the overlap; "inconclusive" with the reason when they disagree. Groups written before
    per-wave figures existed are judged as one wave from their summary."""
    s, n = group.summary, group.param("streams") or 2
    waves = s.waves
    if waves is None:  # an older result file: one judgment from the medians
        waves = (Wave(s.speedup, s.overlap, s.ok),)
    rows = [w for w in waves if w.ok]  # a wave with nothing served says nothing about batching
    if not rows:
        return None
    classes = [wave_class(w) for w in rows]
    counts = {c: classes.count(c) for c in BATCH_CLASSES if c in classes}
    top = max(counts, key=lambda c: counts[c])
    at = "" if n == 2 else f" at {n} streams"
    sp, ov = s.speedup, s.overlap
    sp_txt = "" if sp is None else f"{sp:.2f}x" + range_text(s.figure("speedup_min"), s.figure("speedup_max"), ".2f")
    ov_txt = (
        "" if ov is None else f"overlap {ov:.2f}" + range_text(s.figure("overlap_min"), s.figure("overlap_max"), ".2f")
    )
    if counts[top] * 3 < len(rows) * 2:
        mix = " / ".join(f"{counts[c]} {c}" for c in sorted(counts, key=lambda c: -counts[c]))
        figures = "; ".join(x for x in (ov_txt, f"speedup {sp_txt}" if sp_txt else "") if x)
        return f"inconclusive{at}: the {len(rows)} waves disagree ({mix}){'; ' + figures if figures else ''}"
    if top == "rejects concurrent requests":
        failed = [f for w in rows for f in w.failed]
        how = sorted(
            {
                "HTTP 200 then an error in the stream"
                if f.outcome == "stream_error" and f.status == 200
                else f"HTTP 200 then {f.outcome}"
                if f.status == 200
                else f"HTTP {f.status}"
                if f.status
                else f.outcome
                for f in failed
            }
        )
        return f"rejects concurrent requests{at} ({counts[top]} of {len(rows)} waves: {', '.join(how)})"
    if top in ("continuous batching", "batches, no gain") and sp is not None and abs(sp - GAIN) < GAIN_MARGIN:
        return (
            f"inconclusive{at}: the streams are generated together ({ov_txt or 'overlap not measured'}), but "
            f"speedup {sp_txt} is too close to {GAIN:g}x to say whether they gain"
        )
    parts = [top + at]
    if top == "overlap not measurable":
        return f"speedup{at} {sp_txt}, overlap not measurable" if sp_txt else top + at
    if sp_txt:
        parts[0] += (": " if top in ("serial", "batches, no gain") else " ") + sp_txt
    over = [w.speedup for w in rows if w.speedup is not None and w.speedup > n * IMPOSSIBLE_MARGIN]
    if over:
        parts.append(f"speedup unreliable: {len(over)} of {len(rows)} waves above what {n} streams can give ({n}x)")
    if ov_txt:
        parts.append(ov_txt)
    return ", ".join(parts)


def verdict(res: TargetResult) -> str:
    """One line naming what the run found about a target."""
    if res.error:
        return res.error if res.error.startswith("interrupted") else f"failing: {res.error}"
    parts: list[str] = []
    wave_group = next((g for g in res.groups if g.kind == "wave"), None)
    if wave_group is not None:
        b = batching_verdict(wave_group)
        if b:
            parts.append(b)
    records = [r.record for g in res.groups if g.kind != "single" for r in g.records]
    total = len(records)
    counts: dict[str, int] = {}
    for r in records:
        for kind in r.anomalies:
            counts[kind] = counts.get(kind, 0) + 1
    anomalies: dict[str, AnomalyCount] = {}
    for g in res.groups:
        for k, a in g.summary.anomalies.items():
            anomalies.setdefault(k, a)

    def named(kind: str) -> str | None:
        """ " (k of n requests)" when `kind` is in a meaningful share of the requests, else None;
        "" for a judgment made once over the whole run (no per-request count)."""
        if kind not in anomalies:
            return None
        k = counts.get(kind, 0)
        if k == 0:
            return ""
        return f" ({k} of {total} requests)" if k >= ANOMALY_SHARE * total else None

    share = named("non_incremental_stream")
    if share is not None:
        parts.append("no incremental streaming" + share)
    limits = sorted(
        {r.context_limit_tokens for r in records if r.outcome == "context_limit" and r.context_limit_tokens}
    )
    rejected = sorted({r.context_prompt_tokens or 0 for r in records if r.outcome == "context_limit"})
    if limits:
        parts.append(f"rejects prompts > {limits[0]} tokens")
    elif rejected:
        parts.append(f"rejects prompts of {rejected[0]} tokens")
    share = named("stall")
    if share is not None:
        parts.append(("cyclic stalls" if "cyclic" in anomalies["stall"].evidence else "stalls") + share)
    usage = [x for x in (named("usage_mismatch"), named("phantom_speed")) if x is not None]
    if usage:
        ratios = [
            r.completion_tokens_reported / r.completion_tokens_counted
            for r in records
            if r.completion_tokens_reported and r.completion_tokens_counted
        ]
        if ratios:
            ratio = percentile(sorted(ratios), 50) or 0.0
            text = f"usage over-reports {ratio:.1f}x" if ratio > 1 else f"usage under-reports {1 / ratio:.1f}x"
            parts.append(text + max(usage, key=len))
    if "superlinear_prefill" in anomalies:
        parts.append("superlinear prefill")
    for kind, text in (
        ("dual_reasoning_fields", "dual reasoning fields"),
        ("unreported_length", "never reports length"),
        ("stream_error", "errors inside streams"),
        ("missing_finish", "streams end without finish_reason"),
        ("usage_missing", "no usage"),
    ):
        share = named(kind)
        if share is not None:
            parts.append(text + share)
    failed = sum(1 for r in records if r.outcome not in OK_OUTCOMES and r.outcome != "context_limit")
    if failed:
        parts.append(f"{failed} failed requests")
    return ", ".join(parts) or "healthy"


def smallest_single(res: TargetResult) -> Group | None:
    """The one-at-a-time group at the smallest prompt size: the headline's figures come
    from it, so a server that refuses big prompts cannot look fastest by a median over sizes."""
    sized = [g for g in res.groups if g.kind == "single_size" and g.summary.ok]
    return min(sized, key=lambda g: g.param("prompt_tokens") or 0) if sized else None


def first_wave(res: TargetResult) -> Group | None:
    """The first test of requests released together (its speedup is the headline's)."""
    return next((g for g in res.groups if g.kind == "wave"), None)


def headline(res: TargetResult, size_label: bool = True) -> dict[str, str]:
    """One row per target: TTFT, TTFC, decode and wall tok/s at the smallest prompt size with
    that test's ok/req (not the whole run's), and the speedup of the first batch test."""
    g = smallest_single(res)
    s = g.summary if g else None
    batch = first_wave(res)
    b = batch.summary if batch else None

    def f(v: float | None, fmt: str, unit: str = "") -> str:
        return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, fmt) + unit

    # the row's own test: the one-at-a-time requests at its prompt size (every size's where none succeeded)
    own = [g] if g else [x for x in res.groups if x.kind == "single_size"]
    ok = sum(x.summary.ok for x in own)
    sent = sum(x.summary.requests for x in own)
    row = {
        "target": res.target.name,
        "prompt": f"{g.params.get('prompt_tokens_sent') or g.params['prompt_tokens']} tok" if g else "-",
        "TTFT p50": f(s.ttft_s.p50, ".3f", "s") if s else "-",
        "TTFC p50": f(s.ttfc_s.p50, ".3f", "s") if s else "-",
        "decode tok/s": f(s.decode_tps.p50, ".1f") if s else "-",
        "wall tok/s": f(s.wall_tps.p50, ".1f") if s else "-",
        "speedup": (f(b.speedup, ".2f", "x") + f" ({batch.params['streams']})") if batch and b and b.speedup else "-",
        "ok/req": f"{ok}/{sent}",
    }
    if s:  # speeds that do not use the server's usage are marked (footnote: headline_notes)
        mark_speeds(row, s, ("decode tok/s", "wall tok/s"))
    if b:
        mark_speeds(row, b, ("speedup",))
    return row


def headline_notes(results: Sequence[TargetResult]) -> list[str]:
    """The footnotes of `headline` rows marked for untrusted usage."""
    items = []
    for res in results:
        g = smallest_single(res)
        for grp in (g, first_wave(res)):
            if grp is not None:
                items.append((f"{res.target.name} {grp.name}", grp.summary))
    return untrusted_notes(items)
