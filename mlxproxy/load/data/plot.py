"""A small dependency-free SVG line chart (log-scaled x where asked), for bench results.

Each series gets its own colour, marker shape and dash pattern, and lines drawn earlier
are wider, so series that coincide (six healthy servers at the same speed) still show
every colour; every series has a legend entry, with "(no data)" when nothing was drawn.
A chart with nothing to draw is left out; an x axis whose range holds fewer than two of
its round ticks (one prompt size on a log scale) is labelled at the data's own x values.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape

__all__ = ["Series", "Chart", "svg_charts"]

COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#7f7f7f", "#bcbd22")
DASHES = ("", "8,4", "2,3", "10,3,2,3", "5,5", "1,2", "12,4,4,4", "6,2")
MARKERS = ("circle", "square", "triangle", "diamond", "down", "cross", "plus", "star")
Series = tuple[str, Sequence[tuple[float, float | None]]]  # (name, [(x, y), ...])

WIDTH, HEIGHT = 760, 320
LEGEND_W = 190
LEGEND_TEXT_W = LEGEND_W - 46  # room for a legend entry's text after its line and marker
CHAR_W = 6.8  # a 12 px sans-serif character's typical width, to tell when a label would not fit


@dataclass(frozen=True)
class Chart:
    title: str
    xlabel: str
    ylabel: str
    series: Sequence[Series]
    log_x: bool = False
    integer_x: bool = False  # counts (streams): ticks at whole numbers only
    log_y: bool = False  # for figures spanning decades (TTFT from 10 ms to 10 s)
    note: str = ""  # one line under the x label
    hlines: Sequence[tuple[str, float]] = ()  # (label, y): reference lines across the chart (e.g. an SLO)


def _ticks(lo: float, hi: float, log: bool, integer: bool = False) -> list[float]:
    if log:
        lo_e, hi_e = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
        return [10.0**e for e in range(lo_e, hi_e + 1)]
    if hi <= lo:
        return [lo]
    step = 10 ** math.floor(math.log10((hi - lo) / 4 or 1))
    for mult in (1, 2, 5, 10):
        if (hi - lo) / (step * mult) <= 6:
            step *= mult
            break
    if integer:
        step = max(1.0, round(step))
    start = math.floor(lo / step) * step
    return [start + i * step for i in range(int((hi - start) / step) + 2)]


def _has_data(c: Chart) -> bool:
    return any(y is not None and (x > 0 or not c.log_x) and (y > 0 or not c.log_y) for _, s in c.series for x, y in s)


def _x_ticks(c: Chart, xlo: float, xhi: float, xs: Sequence[float]) -> list[float]:
    """Round ticks inside [xlo, xhi]; the data's own x values when fewer than two fall inside."""
    ticks = [t for t in _ticks(xlo, xhi, c.log_x, c.integer_x) if xlo <= t <= xhi]
    data = sorted(set(xs))
    if len(ticks) < 2 and len(data) <= 8:
        return data
    return ticks


def _legend_text(x: float, y: float, text: str) -> str:
    """A legend entry's text, squeezed into the legend's width when it is longer (never cut)."""
    fit = f' textLength="{LEGEND_TEXT_W}" lengthAdjust="spacingAndGlyphs"' if len(text) * CHAR_W > LEGEND_TEXT_W else ""
    return f'<text x="{x}" y="{y}" font-size="12"{fit}>{escape(text)}</text>'


def _label(v: float) -> str:
    if v >= 1000:
        return f"{v / 1000:g}k"
    return f"{v:g}" if v >= 1 or v == 0 else f"{v:.2g}"


def _marker(kind: str, x: float, y: float, color: str, r: float = 4.0) -> str:
    if kind == "circle":
        return f'<circle cx="{x:.1f}" cy="{y:.1f}" r="{r}" fill="{color}"/>'
    if kind == "square":
        return f'<rect x="{x - r:.1f}" y="{y - r:.1f}" width="{2 * r}" height="{2 * r}" fill="{color}"/>'
    if kind in ("triangle", "down"):
        s = -1 if kind == "triangle" else 1
        return (
            f'<polygon points="{x:.1f},{y + s * r * 1.2:.1f} {x - r:.1f},{y - s * r * 0.8:.1f} '
            f'{x + r:.1f},{y - s * r * 0.8:.1f}" fill="{color}"/>'
        )
    if kind == "diamond":
        return f'<polygon points="{x:.1f},{y - r * 1.3:.1f} {x + r:.1f},{y:.1f} {x:.1f},{y + r * 1.3:.1f} {x - r:.1f},{y:.1f}" fill="{color}"/>'
    if kind == "cross":
        return (
            f'<path d="M{x - r:.1f},{y - r:.1f}L{x + r:.1f},{y + r:.1f}M{x - r:.1f},{y + r:.1f}L{x + r:.1f},{y - r:.1f}" '
            f'stroke="{color}" stroke-width="2.2"/>'
        )
    if kind == "plus":
        return (
            f'<path d="M{x - r * 1.2:.1f},{y:.1f}L{x + r * 1.2:.1f},{y:.1f}M{x:.1f},{y - r * 1.2:.1f}L{x:.1f},{y + r * 1.2:.1f}" '
            f'stroke="{color}" stroke-width="2.2"/>'
        )
    pts = " ".join(
        f"{x + (r * 1.3 if i % 2 == 0 else r * 0.55) * math.sin(i * math.pi / 5):.1f},"
        f"{y - (r * 1.3 if i % 2 == 0 else r * 0.55) * math.cos(i * math.pi / 5):.1f}"
        for i in range(10)
    )
    return f'<polygon points="{pts}" fill="{color}"/>'


@dataclass(frozen=True)
class _Frame:
    """Where a chart's plot area is on the page and the data range it shows."""

    left: float
    right: float
    top: float
    bottom: float
    xlo: float
    xhi: float
    ylo: float
    yhi: float
    log_x: bool
    log_y: bool

    def usable(self, x: float, y: float | None) -> bool:
        """A point this chart can draw (log axes take no zero or negative value)."""
        return y is not None and (x > 0 or not self.log_x) and (y > 0 or not self.log_y)

    def sx(self, x: float) -> float:
        left, right, lo, hi = self.left, self.right, self.xlo, self.xhi
        if self.log_x:
            return left + (math.log10(x) - math.log10(lo)) / (math.log10(hi) - math.log10(lo)) * (right - left)
        return left + (x - lo) / (hi - lo) * (right - left)

    def sy(self, y: float) -> float:
        top, bottom, lo, hi = self.top, self.bottom, self.ylo, self.yhi
        if self.log_y:
            return bottom - (math.log10(y) - math.log10(lo)) / (math.log10(hi) - math.log10(lo)) * (bottom - top)
        return bottom - (y - lo) / (hi - lo) * (bottom - top)


def _frame(c: Chart, x0: int, y0: int, w: int, h: int) -> tuple[_Frame, list[tuple[float, float | None]]]:
    """The chart's frame and the points it can draw (reference lines kept inside the y range)."""
    probe = _Frame(0, 0, 0, 0, 0, 0, 0, 0, c.log_x, c.log_y)
    pts = [(x, y) for _, s in c.series for x, y in s if probe.usable(x, y)]
    if pts:
        pts += [(pts[0][0], y) for _, y in c.hlines if probe.usable(pts[0][0], y)]
    if pts:
        xs = [p[0] for p in pts]
        ys = [float(p[1]) for p in pts if p[1] is not None]
        xlo, xhi = min(xs), max(xs)
        if xlo == xhi:
            xlo, xhi = (xlo / 2, xhi * 2) if c.log_x else (xlo - 1, xhi + 1)
        if c.integer_x:
            xlo, xhi = math.floor(xlo), math.ceil(xhi)
        ylo, yhi = 0.0, max(ys) * 1.12 or 1.0
        if c.log_y:
            ylo, yhi = 10 ** math.floor(math.log10(min(ys))), 10 ** math.ceil(math.log10(max(ys)))
            if ylo == yhi:
                yhi = ylo * 10
    else:
        xlo, xhi, ylo, yhi = 1.0, 10.0, 0.0, 1.0
    left, right, top, bottom = x0 + 70, x0 + w - LEGEND_W - 10, y0 + 34, y0 + h - 58
    return _Frame(left, right, top, bottom, xlo, xhi, ylo, yhi, c.log_x, c.log_y), pts


def _chart(c: Chart, x0: int, y0: int, w: int = WIDTH, h: int = HEIGHT) -> list[str]:
    f, pts = _frame(c, x0, y0, w, h)
    out = [
        f'<text x="{x0 + (w - LEGEND_W) / 2 + 30}" y="{y0 + 20}" text-anchor="middle" font-size="15" '
        f'font-weight="bold">{escape(c.title)}</text>'
    ]
    out += _axes(c, f, pts, x0)
    if pts:
        for label, y in c.hlines:
            if f.usable(pts[0][0], y) and y is not None:
                out.append(
                    f'<line x1="{f.left}" y1="{f.sy(y):.1f}" x2="{f.right}" y2="{f.sy(y):.1f}" stroke="#444" '
                    f'stroke-width="1.5" stroke-dasharray="6,4"/><text x="{f.left + 6}" y="{f.sy(y) - 5:.1f}" '
                    f'text-anchor="start" font-size="11" fill="#444">{escape(label)}</text>'
                )
    out += _lines(c, f)
    return out


def _axes(c: Chart, f: _Frame, pts: list[tuple[float, float | None]], x0: int) -> list[str]:
    """The plot area's box, its ticks (or "no data") and the axis labels."""
    left, right, top, bottom = f.left, f.right, f.top, f.bottom
    out = [f'<rect x="{left}" y="{top}" width="{right - left}" height="{bottom - top}" fill="none" stroke="#999"/>']
    if not pts:
        out.append(
            f'<text x="{(left + right) / 2}" y="{(top + bottom) / 2}" text-anchor="middle" font-size="13">'
            "no data</text>"
        )
    else:
        for t in _x_ticks(c, f.xlo, f.xhi, [x for x, y in pts]):
            if f.xlo <= t <= f.xhi:
                out.append(
                    f'<line x1="{f.sx(t):.1f}" y1="{bottom}" x2="{f.sx(t):.1f}" y2="{bottom + 4}" stroke="#666"/>'
                    f'<text x="{f.sx(t):.1f}" y="{bottom + 17}" text-anchor="middle" font-size="12">{_label(t)}</text>'
                )
        for t in _ticks(f.ylo, f.yhi, f.log_y):
            if f.ylo <= t <= f.yhi:
                out.append(
                    f'<line x1="{left - 4}" y1="{f.sy(t):.1f}" x2="{right}" y2="{f.sy(t):.1f}" stroke="#e4e4e4"/>'
                    f'<text x="{left - 7}" y="{f.sy(t) + 4:.1f}" text-anchor="end" font-size="12">{_label(t)}</text>'
                )
    out.append(
        f'<text x="{(left + right) / 2}" y="{bottom + 35}" text-anchor="middle" font-size="13">{escape(c.xlabel)}</text>'
    )
    if c.note:
        out.append(
            f'<text x="{(left + right) / 2}" y="{bottom + 51}" text-anchor="middle" font-size="11" fill="#555">'
            f"{escape(c.note)}</text>"
        )
    out.append(
        f'<text x="{x0 + 18}" y="{(top + bottom) / 2}" text-anchor="middle" font-size="13" '
        f'transform="rotate(-90 {x0 + 18} {(top + bottom) / 2})">{escape(c.ylabel)}</text>'
    )
    return out


def _lines(c: Chart, f: _Frame) -> list[str]:
    """Each series' line and markers, and its legend entry."""
    out: list[str] = []
    n = len(c.series)
    for i, (name, s) in enumerate(c.series):
        color, dash, marker = COLORS[i % len(COLORS)], DASHES[i % len(DASHES)], MARKERS[i % len(MARKERS)]
        width = 2.0 + 2.5 * (n - 1 - i) / max(1, n - 1)  # earlier lines wider: coinciding ones stay visible
        good = sorted((x, float(y)) for x, y in s if f.usable(x, y) and y is not None)
        if len(good) > 1:
            path = " ".join(f"{f.sx(x):.1f},{f.sy(y):.1f}" for x, y in good)
            dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
            out.append(
                f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="{width:.1f}" '
                f'stroke-linejoin="round"{dash_attr}/>'
            )
        out.extend(_marker(marker, f.sx(x), f.sy(y), color) for x, y in good)
        ly = f.top + 18 * i + 8
        lx = f.right + 14
        dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
        out.append(
            f'<line x1="{lx}" y1="{ly}" x2="{lx + 26}" y2="{ly}" stroke="{color}" stroke-width="2.5"{dash_attr}/>'
            + _marker(marker, lx + 13, ly, color, 3.5)
            + _legend_text(lx + 32, ly + 4, f"{name}{'' if good else ' (no data)'}")
        )
    return out


def svg_charts(charts: Sequence[Chart | tuple[str, str, str, Sequence[Series], bool]]) -> str:
    """Charts stacked vertically: each a `Chart` (or the old tuple: title, xlabel, ylabel, series, log_x).
    Charts with nothing to draw are left out (all of them are drawn, saying "no data", when none has any)."""
    body: list[str] = []
    given = [c if isinstance(c, Chart) else Chart(c[0], c[1], c[2], c[3], log_x=c[4]) for c in charts]
    drawn = [c for c in given if _has_data(c)] or given
    for i, chart in enumerate(drawn):
        body.extend(_chart(chart, 0, i * HEIGHT))
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT * len(drawn)}" '
        f'viewBox="0 0 {WIDTH} {HEIGHT * len(drawn)}" font-family="DejaVu Sans, Helvetica, Arial, sans-serif">'
        f'<rect width="100%" height="100%" fill="white"/>' + "".join(body) + "</svg>\n"
    )
