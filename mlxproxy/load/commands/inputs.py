"""What replay says in one line about an input it cannot use (a result file given for a
capture, a capture without a request, filters that matched none), saying what to run
instead, and about a run stopped with Ctrl-C."""

from __future__ import annotations

from collections.abc import Sequence

from mlxproxy.load.commands.common import requests_text
from mlxproxy.load.data.results import Group

#: the key that opens every result file (`results.ResultFile.to_dict`)
_RESULT_KEY = b'"mlxproxy_result"'


def result_file_hint(path: str) -> str | None:
    """When `path` is a result file (written by `--json`), not a capture: what to run instead."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(4096)
    except OSError:
        return None
    if not head.lstrip().startswith(b"{") or _RESULT_KEY not in head:
        return None
    return (
        f"{path} is a result file (written by --json), not a capture: `mlxproxy report {path}` shows it again; "
        "replay takes a capture (`mlxproxy serve --capture FILE`, or builtin:agent)"
    )


def nothing_to_replay(path: str, captured: int) -> str:
    """Why no request is left to replay: the capture holds none, or the filters matched none."""
    if captured == 0:
        return (
            f"no requests to replay: {path} holds none (a capture gets one line per request the proxy "
            "forwarded: `mlxproxy serve --capture FILE`, then send requests through it)"
        )
    return f"no requests to replay: {path} has {captured}, none matched the filters"


def interrupted_line(groups: Sequence[Group], files: bool) -> str:
    """Ctrl-C: how many finished requests were printed (and written to the output files)."""
    n = len({(g.target, r.id) for g in groups for r in g.records})
    if n == 0:
        return "interrupted before any request finished" + ("; the output files hold none" if files else "")
    return f"interrupted: {requests_text(n, 'finished')} printed" + (" and written" if files else "")
