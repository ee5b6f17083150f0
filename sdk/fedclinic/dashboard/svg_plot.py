"""Line plots as inline SVG, rendered on the server (no plotting library, no external asset).

One plot: x = the round number, one polyline per series, a ``<circle class="pt">`` per point (with a
``<title>`` giving series, round and value), a legend, and the y range's bounds as tick labels. Every text is
escaped; the numbers are formatted here, so nothing of the input reaches the page unescaped.
"""

from __future__ import annotations

import html
import math
from typing import Mapping, Sequence

#: a colour-blind-safe palette (Okabe-Ito), cycled over the series
PALETTE = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#000000", "#F0E442")
WIDTH, HEIGHT = 440, 210
LEFT, RIGHT, TOP, BOTTOM = 64, 12, 12, 46


def fmt(value: float, unit: str = "") -> str:
    """A compact label: 3 significant digits, thousands as k/M/G for byte counts."""
    if unit == "B":
        for div, suffix in ((1e9, " GB"), (1e6, " MB"), (1e3, " kB")):
            if abs(value) >= div:
                return f"{value / div:.3g}{suffix}"
        return f"{value:.0f} B"
    return f"{value:.3g}"


def line_plot(name: str, title: str, series: Mapping[str, Sequence[Sequence[float]]], unit: str = "") -> str:
    """An ``<svg class="plot" data-plot=NAME>`` of ``series`` (label -> [[round, value], ...]); points with a
    non-finite value are skipped. The y axis spans the values (widened by 5 % each side; a flat series gets a
    band around its value); the x axis spans rounds 1..max."""
    pts = {label: [(float(x), float(y)) for x, y in points if math.isfinite(x) and math.isfinite(y)]
           for label, points in series.items()}
    xs = [x for p in pts.values() for x, _ in p]
    ys = [y for p in pts.values() for _, y in p]
    esc = html.escape
    parts = [f'<svg class="plot" data-plot="{esc(name)}" viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" '
             f'height="{HEIGHT}" role="img" aria-label="{esc(title)}" xmlns="http://www.w3.org/2000/svg">']
    x0, x1 = LEFT, WIDTH - RIGHT
    y0, y1 = HEIGHT - BOTTOM, TOP
    parts.append(f'<rect x="{x0}" y="{y1}" width="{x1 - x0}" height="{y0 - y1}" fill="#fafafa" stroke="#bbb"/>')
    if not xs:
        parts.append(f'<text x="{(x0 + x1) / 2}" y="{(y0 + y1) / 2}" text-anchor="middle" fill="#777" '
                     'font-size="12">no closed round yet</text></svg>')
        return "".join(parts)
    lo_x, hi_x = 1.0, max(max(xs), 2.0)
    lo, hi = min(ys), max(ys)
    if hi - lo < 1e-12:
        pad = abs(lo) * 0.1 or 1.0
        lo, hi = lo - pad, hi + pad
    else:
        pad = (hi - lo) * 0.05
        lo, hi = lo - pad, hi + pad
    if min(ys) >= 0 > lo:  # counts and scores stay non-negative on the axis
        lo = 0.0

    def px(x: float) -> float:
        return x0 + (x - lo_x) / (hi_x - lo_x) * (x1 - x0)

    def py(y: float) -> float:
        return y0 - (y - lo) / (hi - lo) * (y0 - y1)

    for value in (lo, (lo + hi) / 2, hi):  # y ticks: bounds and middle
        parts.append(f'<line x1="{x0 - 4}" x2="{x1}" y1="{py(value):.1f}" y2="{py(value):.1f}" stroke="#e3e3e3"/>'
                     f'<text x="{x0 - 6}" y="{py(value) + 4:.1f}" text-anchor="end" font-size="11" fill="#333">'
                     f'{esc(fmt(value, unit))}</text>')
    step = max(1, math.ceil((hi_x - lo_x + 1) / 10))
    for r in range(1, int(hi_x) + 1, step):  # x ticks: rounds
        parts.append(f'<text x="{px(r):.1f}" y="{y0 + 15}" text-anchor="middle" font-size="11" fill="#333">{r}'
                     '</text>')
    parts.append(f'<text x="{(x0 + x1) / 2}" y="{y0 + 29}" text-anchor="middle" font-size="11" fill="#555">round'
                 '</text>')
    legend_x = x0
    for i, (label, points) in enumerate(pts.items()):
        colour = PALETTE[i % len(PALETTE)]
        if points:
            path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in points)
            parts.append(f'<polyline class="series" data-series="{esc(label)}" points="{path}" fill="none" '
                         f'stroke="{colour}" stroke-width="2"/>')
            for x, y in points:
                parts.append(f'<circle class="pt" data-series="{esc(label)}" cx="{px(x):.1f}" cy="{py(y):.1f}" '
                             f'r="3.5" fill="{colour}"><title>{esc(label)}, round {x:g}: {esc(fmt(y, unit))}'
                             '</title></circle>')
        parts.append(f'<rect x="{legend_x}" y="{HEIGHT - 11}" width="10" height="10" fill="{colour}"/>'
                     f'<text x="{legend_x + 13}" y="{HEIGHT - 2}" font-size="11" fill="#333">{esc(label)}</text>')
        legend_x += 24 + 6.5 * len(label)
    parts.append("</svg>")
    return "".join(parts)
