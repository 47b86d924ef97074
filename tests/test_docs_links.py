"""Every place that cites docs/WIRE.md names one of its sections, and that section exists; the
links inside WIRE.md itself lead to its own headings."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WIRE = ROOT / "docs" / "WIRE.md"
CITATION = re.compile(r"WIRE\.md(?!\]\()(#[A-Za-z0-9_-]+)?")  # a link text `[WIRE.md](...)` is not one


def slug(heading: str) -> str:
    """The anchor a Markdown renderer (GitHub's rule) gives a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def wire_anchors() -> set[str]:
    return {
        slug(line.lstrip("#")) for line in WIRE.read_text(encoding="utf-8").splitlines() if re.match(r"#{1,6} ", line)
    }


def citing_files() -> list[Path]:
    files = [
        *ROOT.glob("mlxproxy/**/*.py"),
        *ROOT.glob("tests/**/*.py"),
        *ROOT.glob("benchmarks/*.py"),
        *ROOT.glob("docs/*.md"),
        *ROOT.glob("*.md"),
    ]
    # the changelog names the file as news; this test names it in its own text
    skip = {WIRE, ROOT / "CHANGELOG.md", Path(__file__).resolve()}
    return [p for p in files if p.resolve() not in skip]


def test_slug_follows_the_renderer() -> None:
    assert slug(" The simulator's styles") == "the-simulators-styles"
    assert slug("Rules the core applies") == "rules-the-core-applies"


def test_every_wire_citation_names_an_existing_section() -> None:
    anchors = wire_anchors()
    assert {"what-each-server-sends", "rules-the-core-applies", "the-simulators-styles"} <= anchors
    found, bad = 0, []
    for path in citing_files():
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for m in CITATION.finditer(line):
                found += 1
                anchor = (m.group(1) or "#")[1:]
                if anchor not in anchors:
                    bad.append(f"{path.relative_to(ROOT)}:{n}: {m.group(0)}")
    assert found >= 8  # core/openai.py, core/detect.py, the three sim/wire*.py, ARCHITECTURE, SIMULATOR, ...
    assert bad == [], "cite a section: WIRE.md#<heading anchor>"


def test_links_inside_wire_md_lead_to_its_headings() -> None:
    anchors = wire_anchors()
    links = re.findall(r"\]\(#([^)]+)\)", WIRE.read_text(encoding="utf-8"))
    assert links and sorted(set(links) - anchors) == []
