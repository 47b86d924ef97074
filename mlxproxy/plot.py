"""A small dependency-free SVG line chart (log-scaled x where asked), for bench results."""

from __future__ import annotations

import math
from collections.abc import Sequence
from html import escape

__all__ = ["Series", "svg_charts"]

COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#17becf")
Series = tuple[str, Sequence[tuple[float, float]]]  # (name, [(x, y), ...])


def _ticks(lo: float, hi: float, log: bool) -> list[float]:
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
    start = math.floor(lo / step) * step
    return [start + i * step for i in range(int((hi - start) / step) + 2)]


def _label(v: float) -> str:
    if v >= 1000:
        return f"{v / 1000:g}k"
    return f"{v:g}" if v >= 1 else f"{v:.2g}"


def _chart(title: str, xlabel: str, ylabel: str, series: Sequence[Series], log_x: bool, x0: int, y0: int,
           w: int = 520, h: int = 300) -> list[str]:
    pts = [(x, y) for _, s in series for x, y in s if y is not None and (x > 0 or not log_x)]
    out = [f'<text x="{x0 + w / 2}" y="{y0 + 18}" text-anchor="middle" font-size="14" font-weight="bold">{escape(title)}</text>']
    if not pts:
        out.append(f'<text x="{x0 + w / 2}" y="{y0 + h / 2}" text-anchor="middle" font-size="12">no data</text>')
        return out
    left, right, top, bottom = x0 + 60, x0 + w - 130, y0 + 30, y0 + h - 40
    xs = [p[0] for p in pts]
    ys = [p[1] for p in pts]
    xlo, xhi = min(xs), max(xs)
    if xlo == xhi:
        xlo, xhi = (xlo / 2, xhi * 2) if log_x else (xlo - 1, xhi + 1)
    ylo, yhi = 0.0, max(ys) * 1.1 or 1.0

    def sx(x: float) -> float:
        if log_x:
            return left + (math.log10(x) - math.log10(xlo)) / (math.log10(xhi) - math.log10(xlo)) * (right - left)
        return left + (x - xlo) / (xhi - xlo) * (right - left)

    def sy(y: float) -> float:
        return bottom - (y - ylo) / (yhi - ylo) * (bottom - top)

    out.append(f'<rect x="{left}" y="{top}" width="{right - left}" height="{bottom - top}" fill="none" stroke="#999"/>')
    for t in _ticks(xlo, xhi, log_x):
        if xlo <= t <= xhi:
            out.append(f'<line x1="{sx(t):.1f}" y1="{bottom}" x2="{sx(t):.1f}" y2="{bottom + 4}" stroke="#666"/>'
                       f'<text x="{sx(t):.1f}" y="{bottom + 16}" text-anchor="middle" font-size="10">{_label(t)}</text>')
    for t in _ticks(ylo, yhi, False):
        if ylo <= t <= yhi:
            out.append(f'<line x1="{left - 4}" y1="{sy(t):.1f}" x2="{right}" y2="{sy(t):.1f}" stroke="#eee"/>'
                       f'<text x="{left - 6}" y="{sy(t) + 3:.1f}" text-anchor="end" font-size="10">{_label(t)}</text>')
    out.append(f'<text x="{(left + right) / 2}" y="{bottom + 32}" text-anchor="middle" font-size="11">{escape(xlabel)}</text>')
    out.append(f'<text x="{x0 + 14}" y="{(top + bottom) / 2}" text-anchor="middle" font-size="11" '
               f'transform="rotate(-90 {x0 + 14} {(top + bottom) / 2})">{escape(ylabel)}</text>')
    for i, (name, s) in enumerate(series):
        color = COLORS[i % len(COLORS)]
        good = sorted((x, y) for x, y in s if y is not None and (x > 0 or not log_x))
        if good:
            path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in good)
            out.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2"/>')
            out.extend(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3" fill="{color}"/>' for x, y in good)
        ly = top + 14 * i + 8
        out.append(f'<rect x="{right + 10}" y="{ly - 8}" width="10" height="10" fill="{color}"/>'
                   f'<text x="{right + 24}" y="{ly}" font-size="11">{escape(name)}</text>')
    return out


def svg_charts(charts: Sequence[tuple[str, str, str, Sequence[Series], bool]]) -> str:
    """Charts stacked vertically: each (title, xlabel, ylabel, series, log_x)."""
    h = 300
    body: list[str] = []
    for i, (title, xl, yl, series, log_x) in enumerate(charts):
        body.extend(_chart(title, xl, yl, series, log_x, 0, i * h))
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="520" height="{h * len(charts)}" '
            f'font-family="sans-serif"><rect width="100%" height="100%" fill="white"/>' + "".join(body) + "</svg>\n")
