"""The bench plot, rendered to PNG the way a person sees it: every server's colour is on
every chart that has its data, the stream counts are whole numbers, and batching is drawn.

Rendering needs `rsvg-convert` (Debian/Ubuntu: librsvg2-bin, installed by .ci/run; macOS:
`brew install librsvg`); without it the PNG test skips and says so.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import struct
import subprocess
import xml.etree.ElementTree as ET
import zlib
from pathlib import Path

import pytest

from mlxproxy.edge.runner import ServerThread
from mlxproxy.load.commands.bench import BenchOptions, bench_targets
from mlxproxy.load.data.plot import COLORS, HEIGHT
from mlxproxy.load.data.targets import Target
from mlxproxy.load.output.bench_report import plot_svg
from mlxproxy.sim.app import create_app as create_sim

SERVERS = {
    "batching": ("healthy", {"batch_penalty": 0.02}),
    "serial": ("mlx-omni-server", {}),
    "batching-too": ("vllm-mlx", {}),
    "not-streaming": ("rapid-mlx", {"burst_at_end": True}),
}


def read_png(data: bytes) -> tuple[int, int, list[bytes]]:
    """(width, height, rows of RGBA bytes) of an 8-bit RGBA or RGB, non-interlaced PNG."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, width = 8, b"", 0
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + n]
        if kind == b"IHDR":
            width, height, depth, color, _, _, interlace = struct.unpack(">IIBBBBB", body)
            assert depth == 8 and color in (2, 6) and interlace == 0, (depth, color, interlace)
            bpp = 4 if color == 6 else 3
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    raw = zlib.decompress(idat)
    stride = width * bpp
    rows: list[bytes] = []
    prev = bytearray(stride)
    for y in range(height):
        f, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b = prev[i]
            c = prev[i - bpp] if i >= bpp else 0
            if f == 1:
                line[i] = (line[i] + a) & 255
            elif f == 2:
                line[i] = (line[i] + b) & 255
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        prev = line  # filters refer to the previous row as decoded
        rows.append(
            bytes(line) if bpp == 4 else b"".join(bytes(line[i : i + 3]) + b"\xff" for i in range(0, stride, 3))
        )
    return width, height, rows


@pytest.fixture(scope="module")
def results():
    sims = [
        ServerThread(create_sim(profile, speed=4, prefill_tps=20000.0, **knobs)).start()
        for profile, knobs in SERVERS.values()
    ]
    try:
        targets = [Target(name, s.url, 60.0) for name, s in zip(SERVERS, sims)]
        opts = BenchOptions(prompt_tokens=(100, 1000, 4000), max_tokens=24, repeat=1, batches=(2, 3))
        return asyncio.run(bench_targets(targets, opts, parallel=True))
    finally:
        for s in sims:
            s.stop()


def test_plot_svg_is_labelled_and_counts_are_integers(results) -> None:
    svg = plot_svg(results)
    root = ET.fromstring(svg)  # well-formed XML
    texts = [t.text or "" for t in root.iter("{http://www.w3.org/2000/svg}text")]
    for name in SERVERS:  # every legend entry, on every chart
        assert sum(t.startswith(name) and not t.startswith(name + "-") for t in texts) == 4, name
    assert "not-streaming (no data)" in texts  # its prefill rate means nothing: not drawn, and the legend says so
    assert "Batching: speedup of streams released together" in texts
    charts = svg.split('font-weight="bold">')[1:]
    for chart in charts[2:]:  # x = streams released together: 1, 2, 3, never 1.5
        ticks = re.findall(r'<text x="[\d.]+" y="[\d.]+" text-anchor="middle" font-size="12">([^<]+)</text>', chart)
        assert ticks and all(re.fullmatch(r"\d+", t) for t in ticks), ticks


def test_plot_png_shows_every_server(results, tmp_path: Path) -> None:
    exe = shutil.which("rsvg-convert")
    if exe is None:
        pytest.skip("rsvg-convert not installed (Debian: apt-get install librsvg2-bin); cannot render the plot to PNG")
    svg = tmp_path / "bench.svg"
    png = tmp_path / "bench.png"
    svg.write_text(plot_svg(results))
    subprocess.run([exe, "-b", "white", "-o", str(png), str(svg)], check=True, timeout=60)
    print(f"rendered {png}")
    width, height, rows = read_png(png.read_bytes())
    assert height == 4 * HEIGHT and width > 600

    def present(color: str, top: int, bottom: int, x_max: int) -> int:
        rgb = bytes.fromhex(color[1:])
        return sum(row[x * 4 : x * 4 + 3] == rgb for row in rows[top:bottom] for x in range(70, x_max))

    plot_right = width - 200  # the plot area, left of the legend
    for i, name in enumerate(SERVERS):
        color = COLORS[i]
        for chart in range(4):
            n = present(color, chart * HEIGHT + 30, (chart + 1) * HEIGHT - 55, plot_right)
            expect_line = not (
                chart in (1, 3) and name == "not-streaming"
            )  # no prefill or decode rate: not incremental
            assert (n > 20) == expect_line, (name, chart, n)
