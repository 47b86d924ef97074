"""Every file a result is written to, each format written here and nowhere else: the JSON
result file (`write_result`; `read_result` reads it back), CSV (`write_csv`: one row per
request), and the rendered text formats (`write_text`: Markdown, the SVG plot, the HTML report).
Each file written is said in one line on stderr; one that cannot be written is one line too
(`MlxproxyError`, which the commands print and exit 2 on).

A result file is JSON (its types: `mlxproxy.load.data.results`): `{"mlxproxy_result": 1, "kind",
"version", "created_at", "groups": [{"name", "target", "mode", "kind", "params", "summary",
"records": [...]}], "verdicts": {target: text}}`, with every per-request record (timeline
included), so `mlxproxy report` can render it again and others can recompute anything from it.
"""

from __future__ import annotations

import csv
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import click
import orjson

from mlxproxy.errors import MlxproxyError
from mlxproxy.load.data.results import Group, ResultFile

__all__ = ["CSV_FIELDS", "Outputs", "measured_requests", "read_result", "write_csv", "write_result", "write_text"]


@dataclass(frozen=True)
class Outputs:
    """The files a command writes its result to, one per format asked for (`--json`, `--csv`,
    `--markdown`, `--plot`, `--html`; None: not asked for)."""

    json: str | None = None
    csv: str | None = None
    markdown: str | None = None
    plot: str | None = None
    html: str | None = None

    @property
    def paths(self) -> tuple[str, ...]:
        """The paths asked for, in the order they are written."""
        return tuple(p for p in (self.json, self.csv, self.markdown, self.plot, self.html) if p)


@contextmanager
def _writing(path: str | Path, note: str = "", *, quiet: bool = False) -> Iterator[None]:
    """Write `path` inside, then say so (unless `quiet`); an OSError is one line."""
    try:
        yield
    except OSError as exc:
        raise MlxproxyError(f"cannot write {path}: {exc.strerror or exc}") from None
    if not quiet:
        click.echo(f"wrote {path}{note}", err=True)


def write_text(path: str | Path, text: str, *, quiet: bool = False) -> None:
    """A rendered text format (Markdown, SVG, HTML) as UTF-8 (said unless `quiet`)."""
    with _writing(path, quiet=quiet):
        Path(path).write_text(text, encoding="utf-8")


def write_result(path: str | Path, result: ResultFile, *, quiet: bool = False) -> None:
    """The result file: `result.to_dict()` as indented JSON (said with how to render it again,
    unless `quiet`)."""
    with _writing(path, f" (render again with: mlxproxy report {path})", quiet=quiet):
        Path(path).write_bytes(orjson.dumps(result.to_dict(), option=orjson.OPT_INDENT_2))


def read_result(path: str | Path) -> ResultFile:
    """A result file written by this version or an earlier one (one-line error otherwise)."""
    p = Path(path)
    try:
        doc = orjson.loads(p.read_bytes())
    except OSError as exc:
        raise MlxproxyError(f"cannot read result file {str(p)!r}: {exc.strerror or exc}") from exc
    except orjson.JSONDecodeError as exc:
        raise MlxproxyError(f"{p} is not a JSON result file ({exc})") from exc
    if not isinstance(doc, dict) or "mlxproxy_result" not in doc:
        raise MlxproxyError(f"{p} is not an mlxproxy result file (written by replay/bench --json)")
    try:
        return ResultFile.from_dict(doc)
    except ValueError as exc:
        raise MlxproxyError(f"{p} {exc}") from exc


CSV_FIELDS = (
    "group",
    "target",
    "mode",
    "id",
    "source_id",
    "model",
    "endpoint",
    "stream",
    "status",
    "outcome",
    "ttfb_s",
    "ttft_s",
    "ttfc_s",
    "e2e_s",
    "tpot_s",
    "decode_tps",
    "wall_tps",
    "prefill_tps",
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
    "tokens_source",
    "completion_tokens_reported",
    "completion_tokens_counted",
    "completion_tokens_tokenizer",
    "reasoning_tokens_counted",
    "usage_reports",
    "finish_reason",
    "concurrency",
    "anomalies",
    "error",
    "session",
    "turn",
    "think_s",
)


def measured_requests(groups: Sequence[Group]) -> int:
    """How many requests `groups` measured, each once: a request that belongs to several groups
    (bench's `single` holds every `single N`) counts once, as in `write_csv`'s rows. Requests
    sent but not measured (bench's two calibration probes per target) are not among them."""
    return len({(g.target, r.id) for g in groups for r in g.records})


def write_csv(path: str | Path, groups: Sequence[Group]) -> None:
    """One row per request. A request that belongs to several groups (bench's `single`
    holds every `single N`) is written once, under its most specific (last) group."""
    rows: dict[str, dict[str, object]] = {}
    for g in groups:
        for r in g.records:
            row = r.to_dict()  # the row as the result file holds it, less what CSV_FIELDS leave out
            row.update(group=g.name, target=g.target, mode=g.mode, anomalies=";".join(r.record.anomalies))
            key = f"{g.target}\0{r.id}"
            if key in rows:
                rows[key].update(group=g.name, mode=g.mode)
            else:
                rows[key] = row
    with _writing(path), open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows.values())
