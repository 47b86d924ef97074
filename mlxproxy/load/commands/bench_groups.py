"""bench's groups, built from what its tests measured: the one-at-a-time groups (`single`, and
`single N` per prompt size) and the wave groups (`double`, `xN`: each wave's speedup judged
against the requests alone measured just before and after it)."""

from __future__ import annotations

from collections.abc import Sequence

from mlxproxy.core.detect import Thresholds, overlap_ratio, prefill_scaling
from mlxproxy.core.record import OK_OUTCOMES, Record
from mlxproxy.core.stats import percentile
from mlxproxy.load.data.results import Group, GroupKind
from mlxproxy.load.data.summary import FailedRequest, JSONObject, Summary, Wave
from mlxproxy.load.data.targets import TargetResult
from mlxproxy.load.output.report import aggregate_tps, summarize_records
from mlxproxy.load.run.client import Timed

__all__ = ["REJECT_OUTCOMES", "bench_group", "sent_size", "single_groups", "wave_groups"]


def bench_group(name: str, kind: GroupKind, target: str, params: JSONObject, timed: Timed, summary: Summary) -> Group:
    return Group(name, target, name, kind, params, summary, tuple(timed.rows(source_ids=False)))


#: a request of a wave that failed this way, while another of the wave was served, means the
#: server refused to serve them together (context_limit is about the prompt, not concurrency)
REJECT_OUTCOMES = frozenset(
    {"http_error", "stream_error", "truncated", "protocol_error", "upstream_unreachable", "upstream_timeout"}
)


def wave_groups(
    res: TargetResult,
    baseline: Timed,
    per: dict[int, tuple[Timed, list[list[Record]]]],
    waves: list[int],
    params: JSONObject,
    bsize: int,
) -> None:
    if baseline.records:
        res.groups.append(
            bench_group(
                "baseline",
                "baseline",
                res.target.name,
                {**params, "prompt_tokens": bsize},
                baseline,
                summarize_records(baseline.records),
            )
        )
    walls = [r.wall_tps if r.outcome in OK_OUTCOMES else None for r in baseline.records]
    ok_walls = sorted(w for w in walls if w)
    median_wall = percentile(ok_walls, 50)
    for i, n in enumerate(waves):
        timed, wave_recs = per[n]
        if not wave_recs:
            continue
        summ = summarize_records(timed.records, waves=wave_recs, single_wall_tps=median_wall)
        rows: list[Wave] = []
        for k, wave in enumerate(wave_recs):  # wave k ran between baseline requests k and k + 1
            around = [w for w in walls[k : k + 2] if w]
            base = sum(around) / len(around) if around else median_wall
            agg = aggregate_tps(wave)
            rows.append(
                Wave(
                    speedup=agg / base if agg is not None and base else None,
                    overlap=overlap_ratio(wave),
                    ok=sum(1 for r in wave if r.outcome in OK_OUTCOMES),
                    failed=tuple(FailedRequest(r.outcome, r.status) for r in wave if r.outcome in REJECT_OUTCOMES),
                    aggregate_tps=agg,
                    baseline_wall_tps=base,
                )
            )
        speedups = sorted(w.speedup for w in rows if w.speedup is not None)
        overlaps = sorted(w.overlap for w in rows if w.overlap is not None)
        summ = summ.updated(
            {
                "speedup": percentile(speedups, 50),
                "speedup_min": speedups[0] if speedups else None,
                "speedup_max": speedups[-1] if speedups else None,
                "overlap_min": overlaps[0] if overlaps else None,
                "overlap_max": overlaps[-1] if overlaps else None,
                "baseline_wall_tps": median_wall,
                "waves": [w.to_json() for w in rows],
            }
        )
        name = "double" if n == 2 and i == 0 else f"x{n}"
        res.groups.append(
            bench_group(name, "wave", res.target.name, {**params, "prompt_tokens": bsize, "streams": n}, timed, summ)
        )


def single_groups(res: TargetResult, single: Timed, sizes: list[int], params: JSONObject, th: Thresholds) -> None:
    """The one-at-a-time groups: `single` (every size) first, then `single N` per size."""
    for size in sizes:
        sub = Timed([r for r in single.records if single.source_ids[r.id] == f"{size}"])
        if sub.records:
            res.groups.append(
                bench_group(
                    f"single {size}",
                    "single_size",
                    res.target.name,
                    {**params, "prompt_tokens": size, "prompt_tokens_sent": sent_size(sub.records)},
                    sub,
                    summarize_records(sub.records),
                )
            )
    if single.records:
        all_single = summarize_records(single.records)
        scaling = prefill_scaling(single.records, th)
        if scaling is not None:
            all_single = all_single.with_anomaly(scaling.kind, 1, scaling.evidence)
        res.groups.insert(0, bench_group("single", "single", res.target.name, params, single, all_single))


def sent_size(records: Sequence[Record]) -> int | None:
    vals = sorted(v for r in records if (v := r.prompt_tokens or r.context_prompt_tokens))
    p50 = percentile(vals, 50)
    return int(p50) if p50 is not None else None
