"""Every place that cites docs/WIRE.md names one of its sections, and that section exists; the
links inside WIRE.md itself lead to its own headings; every relative link in the Markdown documents
(README.md, docs/, the other top-level files, benchmarks/README.md) leads to a file that exists and,
with an anchor, to a heading of that file."""

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


#: the Markdown documents whose links are checked (the recorded fixtures' READMEs are notes on data)
DOCUMENTS = [*sorted(ROOT.glob("*.md")), *sorted(ROOT.glob("docs/*.md")), ROOT / "benchmarks" / "README.md"]
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)\)")  # [text](target), ![alt](target)


def anchors_of(path: Path) -> set[str]:
    """The anchors of a Markdown file's headings (outside fenced code)."""
    out: set[str] = set()
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            out.add(slug(line.lstrip("#")))
    return out


def links_of(path: Path) -> list[tuple[int, str]]:
    """(line, target) of every link and image outside fenced code; a link's text (an image's alt)
    may wrap over several lines."""
    lines, fenced = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            lines.append("")
        else:
            lines.append("" if fenced else line)
    text = "\n".join(lines)
    return [(text.count("\n", 0, m.start()) + 1, m.group(1)) for m in LINK.finditer(text)]


def test_every_relative_link_in_the_documents_resolves() -> None:
    checked, bad = 0, []
    for doc in DOCUMENTS:
        for n, target in links_of(doc):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
                continue
            path_part, _, anchor = target.partition("#")
            dest = (doc.parent / path_part).resolve() if path_part else doc
            checked += 1
            where = f"{doc.relative_to(ROOT)}:{n}: {target}"
            if not dest.exists():
                bad.append(f"{where} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors_of(dest):
                bad.append(f"{where} (no such heading)")
    assert checked > 80, checked  # README.md and docs/ link to each other throughout
    assert bad == [], "\n".join(bad)


def test_the_link_check_sees_a_broken_link(tmp_path: Path) -> None:
    doc = tmp_path / "x.md"
    doc.write_text(
        "# Title\n\n[ok](#title), [gone](#nowhere), ![an image\nwrapped](img/none.png)\n\n```\n[code](#x)\n```\n",
        encoding="utf-8",
    )
    assert links_of(doc) == [(3, "#title"), (3, "#nowhere"), (3, "img/none.png")]
    assert "nowhere" not in anchors_of(doc) and "title" in anchors_of(doc)
