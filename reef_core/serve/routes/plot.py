"""A tiny line plotter: a series of ``(step, value)`` points as an inline SVG, rendered on the server.

Shipped with the package (no CDN, no JavaScript): the dashboard works offline and without scripts. Each point is
a ``<circle class="pt">`` carrying its step and value in a ``<title>``, so a reader (or a browser test) can count
and read them.
"""

from __future__ import annotations

import math
from html import escape

WIDTH, HEIGHT, PAD = 560, 180, 36


def _fmt(value: float) -> str:
    return f"{value:.3g}"


def line_svg(title: str, points: list[tuple[float, float]], *, unit: str = "", x_label: str = "step",
             series: str | None = None) -> str:
    """An SVG of ``points`` (x ascending) with its title, axis bounds and one marker a point; ``x_label`` names
    the x axis (``step``, ``release``), ``series`` the figure's ``data-series`` (default: from the title)."""
    points = [(x, y) for x, y in points if math.isfinite(x) and math.isfinite(y)]
    slug = "".join(c if c.isalnum() else "-" for c in (series or title).lower())
    head = (f'<figure class="plot" data-series="{escape(slug)}" data-points="{len(points)}">'
            f'<figcaption>{escape(title)}{f" ({escape(unit)})" if unit else ""}</figcaption>')
    if not points:
        return head + '<p class="empty">no data yet</p></figure>'
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(ys), max(ys)
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    if y1 == y0:
        y0, y1 = y0 - 1, y1 + 1

    def sx(x: float) -> float:
        return PAD + (x - x0) / (x1 - x0) * (WIDTH - 2 * PAD)

    def sy(y: float) -> float:
        return HEIGHT - PAD + (y - y0) / (y1 - y0) * (2 * PAD - HEIGHT)

    path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in points)
    dots = "".join(f'<circle class="pt" cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3">'
                   f"<title>{escape(x_label)} {_fmt(x)}: {_fmt(y)}</title></circle>" for x, y in points)
    axes = (f'<line x1="{PAD}" y1="{HEIGHT - PAD}" x2="{WIDTH - PAD}" y2="{HEIGHT - PAD}" class="axis"/>'
            f'<line x1="{PAD}" y1="{PAD}" x2="{PAD}" y2="{HEIGHT - PAD}" class="axis"/>'
            f'<text x="{PAD - 4}" y="{PAD + 4}" text-anchor="end">{_fmt(y1)}</text>'
            f'<text x="{PAD - 4}" y="{HEIGHT - PAD}" text-anchor="end">{_fmt(y0)}</text>'
            f'<text x="{PAD}" y="{HEIGHT - PAD + 16}">{escape(x_label)} {_fmt(x0)}</text>'
            f'<text x="{WIDTH - PAD}" y="{HEIGHT - PAD + 16}" text-anchor="end">{_fmt(x1)}</text>')
    return (head + f'<svg viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" height="{HEIGHT}" role="img" '
            f'aria-label="{escape(title)}">{axes}<polyline points="{path}" class="line"/>{dots}</svg></figure>')
