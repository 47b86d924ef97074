"""Finish a meter into a checked record: the one path the proxy, replay and bench share.

In order, each step once, the data flowing one way (docs/ARCHITECTURE.md): the meter measures
(`RequestMeter.finish`: a frozen `Measurement`, with what the wire's figures and error text
mean already read); the per-request checks run on it and give their verdict: the anomalies
and the trusted output count (`core.detect.findings`, `verdict`); the prompt is fingerprinted
and its conversation found among this upstream's (`core.prefix.fingerprint`, `find_turn`: pure
functions reading the index); the cache doctor judges a continuing turn, measures a first
turn's cold prefill rate and remembers the turn (`core.cachecheck.check_turn`, `cold_rate`,
`PrefixIndex.add`: the index is written only there, after the judgement); and the record is
built once from the measurement, the verdict and the conversation fields
(`core.record.checked_record`).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from typing import Any, ParamSpec, TypeVar

from mlxproxy.core.cachecheck import PrefixIndex, TurnVerdict, check_turn, cold_rate
from mlxproxy.core.clients import NO_CLIENT, ClientInfo
from mlxproxy.core.detect import Thresholds, findings, verdict
from mlxproxy.core.fixes import fix_for
from mlxproxy.core.meter import Measurement, RequestMeter
from mlxproxy.core.prefix import find_turn, fingerprint
from mlxproxy.core.record import OK_OUTCOMES, Outcome, PromptTokensSource, Record, checked_record

__all__ = ["finish_checked", "finish_steps", "run_steps", "all_at_once", "prompt_size"]

R = TypeVar("R")
P = ParamSpec("P")

CHARS_PER_TOKEN = 4  # a prompt's size without a tokenizer: characters / 4 (docs/METRICS.md)


def prompt_size(
    m: Measurement, texts: list[str], count_tokens: Callable[[str], int] | None
) -> tuple[int | None, PromptTokensSource | None]:
    """The prompt's tokens as the cache doctor uses them, and where they came from: the
    server's usage; where it reported none, the tokenizer's count of the rendered prompt
    (`texts`, its pieces), else characters / 4. A failing tokenizer falls back to characters."""
    if m.whole_prompt_tokens is not None:
        return m.whole_prompt_tokens, "usage"
    if not texts:
        return None, None
    if count_tokens is not None:
        try:
            return sum(count_tokens(t) for t in texts), "tokenizer"
        except Exception:  # a tokenizer problem must not lose the record
            pass
    return sum(len(t) for t in texts) // CHARS_PER_TOKEN, "chars"


def run_steps(steps: Generator[None, None, R]) -> R:
    """What a generator of steps (`finish_steps`) returns, all its steps run now."""
    while True:
        try:
            next(steps)
        except StopIteration as end:
            return end.value  # type: ignore[no-any-return]


def finish_steps(
    meter: RequestMeter,
    t_end: float,
    th: Thresholds,
    *,
    outcome: Outcome | None = None,
    error: str | None = None,
    earlier: Sequence[Record] = (),
    count_tokens: Callable[[str], int] | None = None,
    prefixes: PrefixIndex | None = None,
    scrub: Callable[[str], str] | None = None,
    side: bool = False,
    client: ClientInfo = NO_CLIENT,
) -> Generator[None, None, Record]:
    """The checked record, made in steps of a few tens of microseconds each: a generator that
    pauses between them and returns the record (the proxy runs one step per turn of its event
    loop, `proxy.finisher`; `finish_checked` runs them all at once). `earlier` and `prefixes`
    must not change while it is paused (the proxy finishes one record at a time).

    `meter.finish` plus the per-record truth checks and, against `earlier` records
    of the same process, the serialized-batching check. `count_tokens` (a tokenizer)
    makes the usage check exact; a failing tokenizer is ignored. `prefixes` (this
    upstream's prompt-prefix index) adds the conversation fields and the prefix checks,
    and remembers this request's prompt fingerprints. `scrub` takes secrets out of the
    record's error text. `side`: a side request (a title, a token count, a probe:
    `core.clients`) is neither linked to a conversation nor remembered; it gets no
    conversation fields and takes no turn number. `client` (`core.clients.classify`) names
    the client and the side request on the record (a side request whatever `side` says), and
    the fix of a cause (`core.fixes`) is the client's own where it has one."""
    side = side or client is not NO_CLIENT and client.side is not None
    m = meter.finish(t_end, outcome=outcome, error=error, count_tokens=count_tokens)
    yield
    found, stalls = findings(m, th, earlier)
    v = verdict(m, found, stalls)
    anomalies, evidence = v.anomalies, v.anomaly_evidence
    fields: dict[str, Any] = {}
    info = meter.request
    pp = None
    texts: list[str] = []
    yield
    if prefixes is not None and info.prompt_obj is not None and not side:
        pp = fingerprint(
            info.endpoint, info.prompt_obj, info.model, texts if m.prompt_tokens is None else None, prefixes.memo
        )
        yield
    if prefixes is not None and pp is not None:
        # the turn: looked up, judged, remembered (with its cold rate and lost seconds)
        whole, source = prompt_size(m, texts, count_tokens)
        if source is not None and source != "usage":
            fields.update(prompt_tokens_counted=whole, prompt_tokens_source=source)
        elif source is not None:
            fields["prompt_tokens_source"] = source
        match = find_turn(prefixes.latest, pp, info.prompt_obj)
        judged: TurnVerdict | None = None
        if match is not None:
            judged = check_turn(m, match, prefixes.facts(), th, whole=whole)
            fields.update(judged.fields(match))
            for a in judged.anomalies:  # (kinds of their own: the per-request checks never name them)
                if a.kind not in evidence:
                    anomalies += (a.kind,)
                    evidence[a.kind] = a.evidence
        if m.outcome in OK_OUTCOMES:
            burst = "non_incremental_stream" in evidence
            cold = cold_rate(m, th, whole) if match is None and not burst else None
            lost = (judged.lost_s if judged is not None else None) or 0.0
            cid, turn = prefixes.add(
                pp,
                match,
                m.id,
                whole,
                t_end,
                cold_prefill_tps=cold,
                lost_s=lost,
                cached_tokens=m.cached_tokens,
                hit_excess_s=judged.hit_excess_s if judged is not None and not burst else None,
                prompt_source=source or "usage",
                reach=judged.reach if judged is not None and not burst else None,
            )
        elif match is not None:
            cid, turn = match.conversation_id, match.turn
        else:
            cid, turn = None, None
        fields.update(conversation_id=cid, turn=turn)
        cause = fields.get("reprefill_cause")
        if cause is not None:
            fields["reprefill_fix"] = fix_for(cause, client.name)
    return checked_record(
        m,
        completion_tokens=v.completion_tokens,
        tokens_source=v.tokens_source,
        anomalies=anomalies,
        anomaly_evidence=evidence,
        stall_count=v.stall_count,
        stall_total_s=v.stall_total_s,
        conversation=fields,
        error=scrub(m.error) if scrub is not None and m.error is not None else None,
        client=client,
    )


def all_at_once(steps: Callable[P, Generator[None, None, R]]) -> Callable[P, R]:
    """The function that runs all of `steps`' steps now and returns what they return."""

    def whole(*args: P.args, **kwargs: P.kwargs) -> R:
        return run_steps(steps(*args, **kwargs))

    whole.__doc__ = f"`{steps.__name__}` run to its end (see there)."
    return whole


#: `finish_steps` run to its end: the checked record, at once (replay, bench, the tests)
finish_checked = all_at_once(finish_steps)
