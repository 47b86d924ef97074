"""The self-contained HTML report (`report --html`, `bench --html`, the demo's bench.html):
nothing in it points outside the file, every target's verdict, the curves and the request
timelines are there, and headless Chromium shows them from a file URL with the network off.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
from click.testing import CliRunner

from browser import Chromium, Page, require_chromium
from mlxproxy.cli import main
from mlxproxy.core.record import Record
from mlxproxy.edge.runner import ServerThread
from mlxproxy.load.commands.demo import DEMO_PROFILES
from mlxproxy.sim.app import create_app as create_sim

EVIL = "evil<script>alert(1)</script>"


@contextlib.contextmanager
def sims() -> Iterator[dict[str, str]]:
    with contextlib.ExitStack() as es:
        yield {
            name: es.enter_context(ServerThread(create_sim(profile, speed=8.0))).url
            for name, profile in (("healthy", "healthy"), ("phantom", "phantom-usage"), (EVIL, "mlx-omni-server"))
        }


@pytest.fixture(scope="module")
def bench_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    d = tmp_path_factory.mktemp("bench")
    with sims() as urls:
        args = ["bench", "--prompt-tokens", "100,800", "--max-tokens", "40", "--repeat", "1", "--batch", "2,3"]
        for n, u in urls.items():
            args += ["--target", f"{n}={u}"]
        res = CliRunner().invoke(main, args + ["--json", str(d / "a.json"), "--html", str(d / "a.html")])
        assert res.exit_code == 0, res.output
        assert f"wrote {d / 'a.html'}" in res.output
        res = CliRunner().invoke(
            main,
            [
                "bench",
                "--target",
                f"healthy={urls['healthy']}",
                "--prompt-tokens",
                "100",
                "--max-tokens",
                "30",
                "--repeat",
                "1",
                "--json",
                str(d / "b.json"),
            ],
        )
        assert res.exit_code == 0, res.output
    res = CliRunner().invoke(main, ["report", str(d / "a.json"), str(d / "b.json"), "--html", str(d / "both.html")])
    assert res.exit_code == 0, res.output
    return d / "a.json", d / "a.html", d / "both.html"


def external_refs(html: str) -> list[str]:
    """Every URL or loadable reference in the file but the SVG namespace."""
    refs = re.findall(r"""(?:src|href|action|url)\s*[=(]\s*["']?([^"' >)]+)""", html, re.I)
    refs += re.findall(r"(?:https?:)?//[\w.-]+\.[a-z]{2,}[^\s\"'<]*", html, re.I)
    return [r for r in refs if r not in ("http://www.w3.org/2000/svg", "//www.w3.org/2000/svg")]


def test_html_report_is_self_contained_and_complete(bench_files: tuple[Path, Path, Path]) -> None:
    json_path, html_path, both_path = bench_files
    doc = orjson.loads(json_path.read_bytes())
    html = html_path.read_text()
    assert external_refs(html) == [] and "<script" not in html.lower() and "<link" not in html.lower()
    assert EVIL not in html and "evil&lt;script&gt;" in html  # names are escaped
    for target, verdict in doc["verdicts"].items():
        assert f'<td>{_esc(target)}</td><td class="verdict">{_esc(verdict)}</td>' in html
    for title in (
        "TTFT by prompt size",
        "Prefill tokens/s by prompt size",
        "Per-stream decode tokens/s",
        "Aggregate tokens/s by parallel streams",
        "Speedup over one stream",
    ):
        assert title in html
    ids = {r["id"] for g in doc["groups"] for r in g["records"]}
    assert set(re.findall(r'<g class="req" data-id="([0-9a-f]+)"', html)) == ids  # every request, once
    assert html.count('<g class="req"') == len(ids)
    # anomalies of the pathological target come with their evidence
    phantom = [a for g in doc["groups"] if g["target"] == "phantom" for a in g["summary"]["anomalies"].items()]
    assert phantom and all(_esc(a["evidence"]) in html for _, a in phantom)
    assert "response_text" not in html and "reasoning_text" not in html
    # two files side by side: every target named file:target
    both = both_path.read_text()
    assert external_refs(both) == []
    assert "a.json:healthy" in both and "b.json:healthy" in both and "a.json:phantom" in both


def test_html_option_errors_are_one_line(tmp_path: Path, bench_files: tuple[Path, Path, Path]) -> None:
    res = CliRunner().invoke(main, ["report", str(bench_files[0]), "--html", str(tmp_path / "no" / "x.html")])
    assert res.exit_code == 2 and "cannot write" in res.output and "Traceback" not in res.output


def _esc(s: str) -> str:
    from html import escape

    return escape(s)


def open_offline(chromium: Chromium, path: Path) -> Page:
    page = chromium.page(offline=True)
    page.goto(path.resolve().as_uri())
    return page


def assert_shows_report(page: Page, doc: dict) -> None:
    shown = page.eval(
        "Object.fromEntries([...document.querySelectorAll('#verdicts tr[data-target]')]"
        ".map(tr => [tr.dataset.target, tr.querySelector('.verdict').textContent]))"
    )
    assert shown == doc["verdicts"] and shown
    # each curve is drawn, with one line per target that has two or more points
    plots = page.eval(
        "[...document.querySelectorAll('#plots svg')].map(s => [s.querySelector('text').textContent,"
        " s.querySelectorAll('polyline').length, s.querySelectorAll('circle').length,"
        " s.getBoundingClientRect().width])"
    )
    titles = [p[0] for p in plots]
    assert titles[:3] == [
        "TTFT by prompt size (p50)",
        "Prefill tokens/s by prompt size (p50)",
        "Per-stream decode tokens/s by parallel streams (p50)",
    ], titles
    assert all(p[2] > 0 and p[3] > 100 for p in plots), plots
    ttft = plots[0]
    assert ttft[1] >= len([t for t in doc.get("targets", []) if not t.get("error")]) - 1  # one may have failed sizes
    lanes = page.eval("document.querySelectorAll('#timelines g.req').length")
    assert lanes == len({r["id"] for g in doc["groups"] for r in g["records"]})
    assert page.eval("document.querySelectorAll('#timelines g.req rect').length") >= lanes
    assert page.errors == [], page.errors
    assert {u.split(":", 1)[0] for u in page.requests} == {"file"}, page.requests  # nothing but the file itself


def test_html_report_in_browser_from_a_file_url_offline(bench_files: tuple[Path, Path, Path], tmp_path: Path) -> None:
    require_chromium()
    json_path, html_path, _ = bench_files
    with Chromium() as chromium:
        page = open_offline(chromium, html_path)
        assert_shows_report(page, orjson.loads(json_path.read_bytes()))
        assert page.eval("document.body.textContent").count("evil<script>alert(1)</script>") >= 1  # shown as text
        print(f"\nscreenshot: {page.screenshot(tmp_path / 'report.png')}")


def test_demo_writes_an_html_report_that_opens_offline(tmp_path: Path) -> None:
    """`mlxproxy demo` (one repetition) prints the report's path; Chromium shows every target's
    verdict and the curves from it with no network."""
    require_chromium()
    out = tmp_path / "demo"
    res = subprocess.run(
        [sys.executable, "-m", "mlxproxy", "demo", "--repeat", "1", "--dir", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    report = out / "bench.html"
    assert f"HTML report: {report.resolve()}" in res.stdout
    doc = orjson.loads((out / "bench.json").read_bytes())
    assert set(doc["verdicts"]) == set(DEMO_PROFILES)
    # one request count everywhere: each measured request once (bench's `single` repeats its
    # `single N`), the CSV's rows, and the capture's lines are those plus the calibration probes
    measured = len({(g["target"], r["id"]) for g in doc["groups"] for r in g["records"]})
    assert measured < sum(len(g["records"]) for g in doc["groups"])
    captured = len((out / "capture.jsonl").read_bytes().splitlines())
    csv_rows = len((out / "bench.csv").read_text().splitlines()) - 1
    assert csv_rows == measured and captured == measured + 2 * len(DEMO_PROFILES)
    assert f"all {captured} requests the proxy forwarded: the {measured} measured and " in res.stdout
    with Chromium() as chromium:
        page = open_offline(chromium, report)
        assert_shows_report(page, doc)
        sources = page.eval("document.querySelector('#sources').textContent")
        assert f"{measured} requests measured" in sources
        text = page.eval("document.querySelector('#anomalies').textContent")
        for kind in ("non_incremental_stream", "context_limit", "stall", "usage_mismatch", "serialized"):
            assert kind in text, kind
        # every lane's label is drawn whole inside its chart, measured where it is drawn (the
        # phantom-usage lanes' 47-character labels began up to 10 px left of the chart's edge)
        cut = page.eval(
            "[...document.querySelectorAll('#timelines g.req > text')]"
            ".map(t => [t.textContent, t.getBBox().x]).filter(([_, x]) => x < 0)"
        )
        assert cut == [], cut
        print(f"\nscreenshot: {page.screenshot(tmp_path / 'demo-report.png')}")


def test_replay_html_report(tmp_path: Path) -> None:
    """`replay --html`: the replayed group, its summary and one timeline lane per request."""
    from mlxproxy.config import build_config
    from mlxproxy.proxy.app import create_app
    from support import wait_for

    cap = tmp_path / "capture.jsonl"
    with ServerThread(create_sim("healthy", speed=20.0)) as sim:
        app = create_app(
            build_config({"upstreams": [{"name": "sim", "url": sim.url}], "capture": str(cap)}, log_requests=False)
        )
        with ServerThread(app) as px:
            import httpx

            for _ in range(3):
                httpx.post(
                    px.url + "/v1/chat/completions",
                    json={
                        "model": "m",
                        "stream": True,
                        "max_tokens": 20,
                        "messages": [{"role": "user", "content": "hi"}],
                    },
                )
            assert wait_for(lambda: app.capture is not None and app.capture.written == 3)
        out = tmp_path / "replay.html"
        res = CliRunner().invoke(
            main,
            [
                "replay",
                str(cap),
                "--target",
                sim.url,
                "--name",
                "again",
                "--mode",
                "sequential",
                "--html",
                str(out),
                "--json",
                str(tmp_path / "r.json"),
            ],
        )
    assert res.exit_code == 0, res.output
    html = out.read_text()
    doc = orjson.loads((tmp_path / "r.json").read_bytes())
    assert external_refs(html) == [] and "<script" not in html
    ids = {r["id"] for g in doc["groups"] for r in g["records"]}
    assert len(ids) == 3 and set(re.findall(r'<g class="req" data-id="([0-9a-f]+)"', html)) == ids
    assert "<td>again</td><td>sequential</td>" in html


def test_html_report_curves_have_whole_stream_ticks_and_lanes_whole_anomaly_names(tmp_path: Path) -> None:
    """One wave of two streams (as the demo runs): the stream charts are ticked at whole
    numbers, the aggregate chart has its one-stream point too (a line, not a lone dot on an
    axis from 1 to 3), and a lane's label never cuts an anomaly name."""
    from mlxproxy.core.detect import ANOMALY_KINDS

    require_chromium()
    out = tmp_path / "r.html"
    with ServerThread(create_sim("mlx-openai-server@1.6", speed=8.0, prefill_tps=20000.0)) as sim:
        res = CliRunner().invoke(
            main,
            ["bench", "--target", f"serial={sim.url}", "--prompt-tokens", "100,2000", "--repeat", "1"]
            + ["--max-tokens", "40", "--batch", "2", "--html", str(out)],
        )
    assert res.exit_code == 0, res.output
    with Chromium() as chromium:
        page = open_offline(chromium, out)
        charts = page.eval(
            "[...document.querySelectorAll('#plots svg')].map(s => [s.querySelector('text').textContent,"
            " [...s.querySelectorAll('text[text-anchor=middle][font-size=\"12\"]')].map(t => t.textContent),"
            " s.querySelectorAll('polyline').length])"
        )
        streams = [c for c in charts if "parallel streams" in c[0] or "Speedup" in c[0]]
        assert len(streams) == 3, charts
        for title, ticks, lines in streams:
            assert ticks and all(t.isdigit() for t in ticks), (title, ticks)  # no 1.2, 1.5, 2.5 streams
            assert lines >= 1, title  # one stream alone and the wave: a line
        labels = page.eval("[...document.querySelectorAll('#timelines g.req > text')].map(t => t.textContent)")
        named = [ln.split(" ", 3)[3] for ln in labels if len(ln.split(" ", 3)) == 4]
        assert named, labels
        for part in named:
            names = part.split(" +")[0].split(",") if not part.startswith("+") else []
            assert all(n in ANOMALY_KINDS for n in names), part
        shots = Path(os.environ.get("MLXPROXY_TEST_ARTIFACTS") or tmp_path)
        print(f"\nscreenshot: {page.screenshot(shots / 'html-report-one-wave.png')}")
        assert page.errors == [], page.errors


def test_a_lane_label_keeps_whole_anomaly_names() -> None:
    from mlxproxy.load.output.htmlreport import LANE_LABEL_CHARS, _lane_label

    kinds = ["unreported_length", "serialized", "stall"]
    for ttft in (0.5, 12.5):
        label = _lane_label(
            Record(
                "0123456789ab", 0.0, "t", None, "chat_completions", True, 200, "ok", ttft_s=ttft, anomalies=tuple(kinds)
            )
        )
        assert len(label) <= LANE_LABEL_CHARS, label
        part = label.split(" ", 3)[3]
        names, _, more = part.partition(" +")
        shown = names.split(",") if names else []
        assert shown == kinds[: len(shown)] and len(shown) + int(more or 0) == 3, label  # whole names, the rest counted
