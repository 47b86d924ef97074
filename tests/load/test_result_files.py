"""Result files written by earlier versions load and render exactly as they did.

tests/fixtures/results_41d6a63/*.json were written by `bench --json` / `replay --json` of main
at 41d6a63 (the last version whose results were plain dicts), against `mlxproxy sim`; the
`rendered/` files beside them are what `mlxproxy report` of that version printed and wrote for
each (console, Markdown, CSV, HTML, SVG plot). bench_result_main_bcfcda9.json is older still.
Regenerate the renders only on purpose: `PYTHONPATH=tests python tests/load/test_result_files.py --write`.
Each HTML render holds, where the page inlines mlxproxy/load/output/report.css, one line naming
that sheet with the sha256 of its text (`CSS_MARK`); the test puts the sheet's exact text back
there before comparing, and fails when the sheet is not the one the renders were made with.
"""

from __future__ import annotations

import hashlib
import re
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from mlxproxy.cli import main
from support import FIXTURES

DIR = FIXTURES / "results_41d6a63"
RENDERED = DIR / "rendered"
FILES = {p.stem: p for p in [*sorted(DIR.glob("*.json")), FIXTURES / "bench_result_main_bcfcda9.json"]}
#: replay results without a sweep have no plot (report refuses --plot for them)
NO_PLOT = {"replay_batch", "replay_rate"}
#: the report's style sheet, which every HTML page inlines whole; read here as a file, not
#: through the module that inlines it
CSS = (Path(__file__).parents[2] / "mlxproxy/load/output/report.css").read_text(encoding="utf-8")
#: the one line an HTML render holds in the sheet's place: the sheet's name and its text's sha256
CSS_MARK = re.compile(r"/\* report\.css sha256 ([0-9a-f]{64}) \*/\n")


def css_mark(css: str) -> str:
    return f"/* report.css sha256 {hashlib.sha256(css.encode()).hexdigest()} */\n"


def css_out(html: str) -> str:
    """A page as its golden holds it: the inlined sheet, there once, replaced by its mark."""
    assert html.count(CSS) == 1, "the page does not inline report.css exactly once"
    return html.replace(CSS, css_mark(CSS))


def css_in(golden: str) -> str:
    """A golden page as the report writes it: the sheet put back in its mark's place. The mark
    must be there once and name the sheet as it is now."""
    marks = CSS_MARK.findall(golden)
    assert len(marks) == 1, "the golden page does not hold the style sheet's mark once"
    assert css_mark(CSS) in golden, (
        "report.css is not the sheet the goldens were rendered with; regenerate them on purpose"
    )
    return golden.replace(css_mark(CSS), CSS)


def render_all(path: Path, out: Path) -> dict[str, str]:
    """Everything `mlxproxy report` makes of one result file, with the run's own paths and
    the HTML page's time of writing taken out (they differ from run to run)."""
    name = path.stem
    args = [
        "report",
        str(path),
        "--csv",
        str(out / f"{name}.csv"),
        "--markdown",
        str(out / f"{name}.md"),
        "--html",
        str(out / f"{name}.html"),
    ]
    if name not in NO_PLOT:
        args += ["--plot", str(out / f"{name}.svg")]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    got = {"txt": r.output.replace(str(out) + "/", "OUT/")}
    for ext in ("csv", "md", "html", "svg"):
        p = out / f"{name}.{ext}"
        if p.exists():
            got[ext] = p.read_text(encoding="utf-8")
    got["html"] = re.sub(
        r"<header><h1>mlxproxy report</h1><p>written [^<]*</p>", "<header>WRITTEN</header>", got["html"]
    )
    return got


@pytest.fixture(autouse=True)
def utc(monkeypatch: pytest.MonkeyPatch):
    """The HTML page prints the file's time of writing in local time: fix the zone."""
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


@pytest.mark.parametrize("name", sorted(FILES))
def test_an_earlier_result_file_renders_as_it_did(name: str, tmp_path: Path) -> None:
    got = render_all(FILES[name], tmp_path)
    want = {p.suffix[1:]: p.read_text(encoding="utf-8") for p in RENDERED.glob(f"{name}.*")}
    assert sorted(got) == sorted(want)
    want["html"] = css_in(want["html"])
    for ext in want:
        assert got[ext] == want[ext], f"{name}.{ext} renders differently"


def test_a_file_written_again_is_the_same_bytes(tmp_path: Path) -> None:
    """write -> read (from_dict) -> write gives the same bytes; and an earlier file, read and
    written again, differs from what it was only by each group's new `kind` key."""
    import orjson

    from mlxproxy.load.output.files import read_result, write_result

    for name, path in FILES.items():
        first, second = tmp_path / f"{name}.1.json", tmp_path / f"{name}.2.json"
        write_result(first, read_result(path))
        write_result(second, read_result(first))
        assert first.read_bytes() == second.read_bytes(), name
        again = orjson.loads(first.read_bytes())
        assert all(g.pop("kind") for g in again["groups"])
        assert orjson.dumps(again) == orjson.dumps(orjson.loads(path.read_bytes())), name  # keys in the same order


def test_earlier_files_get_the_kind_their_tests_had() -> None:
    from mlxproxy.load.output.files import read_result

    kinds = {name: [(g.name, g.kind) for g in read_result(path).groups] for name, path in FILES.items()}
    assert kinds["bench"][:6] == [
        ("single", "single"),
        ("single 100", "single_size"),
        ("single 500", "single_size"),
        ("baseline", "baseline"),
        ("double", "wave"),
        ("x3", "wave"),
    ]
    assert {k for n, k in kinds["bench"] if n.startswith("sweep ")} == {"sweep_step"}
    assert [k for _, k in kinds["bench_rate"]][-2:] == ["sweep_step", "sweep_step"]
    assert kinds["replay_batch"] == [("single", "single"), ("batch 2", "wave")]
    assert kinds["replay_rate"] == [("constant 5/s", "rate")]
    assert kinds["replay_sessions"] == [("sweep 1", "sweep_step"), ("sweep 2", "sweep_step")]
    assert [k for _, k in kinds["bench_result_main_bcfcda9"]] == ["single", "single_size", "wave"] * 2


def test_a_file_that_is_not_a_result_is_refused_in_one_line(tmp_path: Path) -> None:
    for text, why in (
        ('{"mlxproxy_result": 9, "groups": []}', "newer mlxproxy"),
        ('{"mlxproxy_result": 1, "groups": 3}', "not a list of groups"),
        ('{"mlxproxy_result": "1", "groups": []}', "not an mlxproxy result file"),
    ):
        (tmp_path / "r.json").write_text(text)
        r = CliRunner().invoke(main, ["report", str(tmp_path / "r.json")])
        assert r.exit_code == 2 and why in r.output and len(r.output.strip().splitlines()) == 1, r.output


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    import os
    import tempfile

    os.environ["TZ"] = "UTC"
    time.tzset()
    RENDERED.mkdir(exist_ok=True)
    for stem, path in FILES.items():
        with tempfile.TemporaryDirectory() as tmp:
            got = render_all(path, Path(tmp))
            got["html"] = css_out(got["html"])
            for ext, text in got.items():
                (RENDERED / f"{stem}.{ext}").write_text(text, encoding="utf-8")
