"""The HTML report's replayed sessions view (`replay --sessions --html`): every replayed turn
with the cache doctor's figures; on a server that loses its cache, each evicted turn names
`cache_evicted` and the seconds it lost, and the group's total by cause adds them up."""

from __future__ import annotations

import re
from html import unescape
from pathlib import Path

import orjson
import pytest

from mlxproxy.edge.runner import ServerThread
from mlxproxy.sim.app import create_app as create_sim
from support import cli


@pytest.mark.parametrize("drop", ["", "every-other"])
def test_replayed_sessions_view(tmp_path: Path, drop: str) -> None:
    out, js = tmp_path / "r.html", tmp_path / "r.json"
    with ServerThread(create_sim("healthy", speed=10, prompt_cache=True, cache_drop=drop)) as sim:
        res = cli(
            "replay", "builtin:agent", "--target", f"s={sim.url}", "--sessions", "2", "--repeat", "2",
            "--think-time", "0", "--html", str(out), "--json", str(js),
        )  # fmt: skip
    assert res.returncode == 0, res.stderr
    (g,) = orjson.loads(js.read_bytes())["groups"]
    html = out.read_text()
    section = html[html.index('<section id="sessions">') : html.index("</section>", html.index('id="sessions"'))]
    rows = re.findall(r"<tr><td>(\d+)</td><td class=\"num\">(\d+)</td>(.*?)</tr>", section)
    assert len(rows) == len(g["records"]) > 4  # every turn of every replayed session
    records = {(r["session"], r["turn"] + 1): r for r in g["records"]}
    causes = [unescape(re.findall(r"<td>([a-z_]*)</td>", rest)[0]) for _, _, rest in rows]
    for (sid, turn, _), cause in zip(rows, causes):
        assert cause == (records[(int(sid), int(turn))]["reprefill_cause"] or "")
    # each replayed session (its own nonce) is a conversation of its own, its turns in order
    assert all(r["conversation_id"] for r in g["records"])
    assert len({r["conversation_id"] for r in g["records"]}) == len({r["session"] for r in g["records"]}) == 2
    if not drop:
        assert not any(causes) and "by cause: none" in section
        assert all(r["turn"] == 0 or r["cache_hit_ratio"] > 0.9 for r in g["records"])
    else:
        evicted = [r for r in g["records"] if r["reprefill_cause"] == "cache_evicted"]
        assert evicted and set(causes) == {"", "cache_evicted"}
        total = sum(r["reprefill_lost_s"] for r in evicted)
        assert f"cache_evicted {total:.2f} s" in section
