"""Real agent sessions recorded through the proxy (``tests/fixtures/sessions/``, issue 36): a loader
and an offline replay through the proxy's own finishing path.

Each session folder holds, per HTTP exchange N in the order the client sent them, the request
(``turnN.headers``, ``turnN.request.json``), the response to the client (``turnN.response``), what
the proxy sent the server and got back (``turnN.upstream.request``, ``turnN.upstream.response``,
with each read's arrival time in ``turnN.upstream.marks.json``), the timings
(``turnN.timing.json``), plus ``truth.json`` (the server's truth and the expected verdict per
exchange), ``records.jsonl`` (what mlxproxy said when it was recorded) and ``session.json``.

:func:`replay` feeds each generation request's upstream bytes into a
:class:`~mlxproxy.core.meter.RequestMeter` at the recorded times (scripted timestamps: no clock,
no I/O) and finishes it with :func:`~mlxproxy.core.analyze.finish_checked` against one
:class:`~mlxproxy.core.cachecheck.PrefixIndex`, in the order the proxy finished them, as the proxy
does: the records are what today's core says about the session.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from integration.sessiontap import body_pieces
from mlxproxy.core.analyze import finish_checked
from mlxproxy.core.cachecheck import PrefixIndex
from mlxproxy.core.clients import classify
from mlxproxy.core.detect import Thresholds
from mlxproxy.core.meter import RequestMeter
from mlxproxy.core.openai import parse_request
from mlxproxy.core.record import Record
from support import FIXTURES

SESSIONS = FIXTURES / "sessions"
GENERATION_PATHS = ("/v1/chat/completions", "/v1/messages", "/v1/responses")


@dataclasses.dataclass(frozen=True)
class Exchange:
    n: int
    method: str
    path: str  # without the query
    body: bytes  # the request body as the client sent it
    upstream_request: bytes | None  # head and body as the proxy sent them
    #: head and body (chunked framing kept) as the server sent them; behind a gateway, as the proxy
    #: relayed the gateway's
    upstream_response: bytes | None
    upstream_marks: tuple[tuple[int, float], ...]  # (byte offset in upstream_response, seconds after t_sent)
    t_sent: float  # seconds from the session's start
    t_end: float | None  # seconds after t_sent
    truth: dict[str, Any]

    @property
    def expected(self) -> dict[str, Any]:
        return dict(self.truth.get("expected") or {})

    @property
    def generation(self) -> bool:
        return self.method == "POST" and self.path in GENERATION_PATHS


@dataclasses.dataclass(frozen=True)
class Session:
    name: str  # the folder: <client>_<version>__<server>
    folder: Path
    client: str
    client_version: str
    server: str
    server_version: str
    exchanges: tuple[Exchange, ...]
    #: the sessions recorded before this one through the same proxy, in order (folder names): its
    #: prefix index had seen them (``record_sessions --one-proxy``)
    after: tuple[str, ...] = ()

    @property
    def turns(self) -> list[Exchange]:
        """The exchanges the truth calls turns of the session's conversation, in order."""
        return [e for e in self.exchanges if e.expected.get("role") == "turn"]


def _read(path: Path) -> bytes | None:
    return path.read_bytes() if path.exists() else None


def load_session(folder: Path) -> Session:
    session = json.loads((folder / "session.json").read_text())
    truth = {e["n"]: e for e in json.loads((folder / "truth.json").read_text())["exchanges"]}
    out = []
    for ex in session["exchanges"]:
        n = ex["n"]
        timing = json.loads((folder / f"turn{n}.timing.json").read_text())
        # what the proxy got back: the upstream tap's bytes, or behind a gateway (no tap between
        # the proxy and it) the bytes the proxy relayed to the client
        up = folder / f"turn{n}.upstream.response"
        kind = "upstream" if up.exists() else "response"
        marks_path = folder / (f"turn{n}.upstream.marks.json" if up.exists() else f"turn{n}.response.marks.json")
        marks = tuple((int(o), float(t)) for o, t in json.loads(marks_path.read_text())) if marks_path.exists() else ()
        out.append(
            Exchange(
                n=n,
                method=ex["method"],
                path=ex["path"].split("?", 1)[0],
                body=(folder / f"turn{n}.request.json").read_bytes(),
                upstream_request=_read(folder / f"turn{n}.upstream.request"),
                upstream_response=_read(up if kind == "upstream" else folder / f"turn{n}.response"),
                upstream_marks=marks,
                t_sent=float(timing["t_sent_session"]),
                t_end=timing.get("t_end"),
                truth=truth.get(n, {}),
            )
        )
    return Session(
        name=folder.name,
        folder=folder,
        client=session["client"],
        client_version=session["client_version"],
        server=session["server"],
        server_version=session["server_version"],
        exchanges=tuple(out),
        after=tuple(session.get("after") or ()),
    )


def load_sessions(root: Path = SESSIONS) -> list[Session]:
    return [load_session(p.parent) for p in sorted(root.glob("*/truth.json"))]


def _time_at(marks: tuple[tuple[int, float], ...], offset: int) -> float:
    t = marks[0][1] if marks else 0.0
    for off, when in marks:
        if off > offset:
            break
        t = when
    return t


def _split(piece: bytes, at: int, marks: tuple[tuple[int, float], ...]) -> Iterator[tuple[bytes, float]]:
    """``piece`` (starting at raw offset ``at``) cut where a new read arrived."""
    cuts = [off - at for off, _ in marks if at < off < at + len(piece)]
    lo = 0
    for c in [*cuts, len(piece)]:
        if c > lo:
            yield piece[lo:c], _time_at(marks, at + lo)
        lo = c


def request_headers(ex: Exchange) -> list[tuple[str, str]]:
    """The request's headers as the proxy forwarded them (its User-Agent is the client's)."""
    head = (ex.upstream_request or b"").partition(b"\r\n\r\n")[0].decode("latin-1")
    pairs = (line.partition(":") for line in head.split("\r\n")[1:])
    return [(k.strip(), v.strip()) for k, sep, v in pairs if sep]


def meter_for(session: Session, ex: Exchange) -> tuple[RequestMeter, float]:
    """A meter fed with the exchange's upstream response at its recorded times; and its end time."""
    assert ex.upstream_response is not None, f"{session.name} #{ex.n}: no upstream bytes"
    info, _ = parse_request(ex.method, ex.path, ex.body)
    up_body = (ex.upstream_request or b"").partition(b"\r\n\r\n")[2]
    injected = b'"include_usage"' in up_body and b'"include_usage"' not in ex.body
    t0 = ex.t_sent
    m = RequestMeter(
        info, request_id=f"{session.name}#{ex.n}", upstream="u", t_start=t0, started_at=t0, usage_injected=injected
    )
    raw = ex.upstream_response
    head = raw.partition(b"\r\n\r\n")[0]
    status = int(head.split(b" ", 2)[1])
    ctype = re.search(rb"(?im)^content-type:\s*([^\r\n;]+)", head)
    marks = ex.upstream_marks
    m.response_started(t0 + _time_at(marks, 0), status, ctype.group(1).decode() if ctype else None)
    last = t0 + _time_at(marks, 0)
    for piece, at in body_pieces(raw):
        for part, t in _split(piece, at, marks):
            last = t0 + t
            m.feed(part, last)
    end = t0 + ex.t_end if ex.t_end is not None else last
    return m, max(end, last)


#: the rigged model's tokenizer, which the recording proxy was configured with (``tokenizer:``)
TOKENIZER = SESSIONS / "rigged-tokenizer.json"


@functools.cache
def rigged_token_counter() -> Callable[[str], int] | None:
    """Counts tokens as the recording proxy did (``mlxproxy.proxy.tokens``); None without
    the ``tokenizers`` package (the proxy then had none either)."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None
    tok = Tokenizer.from_file(str(TOKENIZER))

    def count(text: str) -> int:
        return len(tok.encode(text, add_special_tokens=False).ids)

    return count


def replay(
    session: Session,
    th: Thresholds | None = None,
    count_tokens: Callable[[str], int] | None = None,
    *,
    before: tuple[Session, ...] = (),
) -> dict[int, Record]:
    """Today's core on the recorded session: each generation request's record, by exchange number.
    ``count_tokens`` defaults to the rigged tokenizer, which the recording proxy had. ``before``:
    the sessions that went through the same proxy first (``Session.after``), replayed in order
    into the same prefix index (and stream of earlier records), each after the previous one's end."""
    th = th or Thresholds()
    count_tokens = count_tokens or rigged_token_counter()
    index = PrefixIndex()
    earlier: list[Record] = []
    start = 0.0
    for s in before:
        start = _replay_into(s, index, earlier, th, count_tokens, start)[1] + 1.0
    return _replay_into(session, index, earlier, th, count_tokens, start)[0]


def _replay_into(
    session: Session,
    index: PrefixIndex,
    earlier: list[Record],
    th: Thresholds,
    count_tokens: Callable[[str], int] | None,
    start: float,
) -> tuple[dict[int, Record], float]:
    """``session`` replayed into ``index`` from ``start`` (seconds): its records and its end."""
    finished: list[tuple[float, RequestMeter, Exchange]] = []
    for ex in session.exchanges:
        if ex.generation and ex.upstream_response is not None:
            m, end = meter_for(session, dataclasses.replace(ex, t_sent=ex.t_sent + start))
            finished.append((end, m, ex))
    out: dict[int, Record] = {}
    for end, m, ex in sorted(finished, key=lambda f: f[0]):  # the proxy finishes in end order
        # (the proxy counts with its tokenizer where the body is a stream: `ProxyApp._record`)
        counter = count_tokens if m.sse else None
        # who sent it, as the proxy classifies it (`ProxyApp._record`): from the headers it forwarded
        client = classify(request_headers(ex), ex.method, ex.path, m.request.prompt_obj)
        n = ex.n
        rec = finish_checked(m, end, th, earlier=earlier, prefixes=index, count_tokens=counter, client=client)
        earlier.append(rec)
        out[n] = rec
    return out, max((f[0] for f in finished), default=start)
