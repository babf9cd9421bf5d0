"""A PNG of a circle packing and of a best-score curve, drawn with numpy and written with zlib (no plotting library).

:func:`packing_png` draws, side by side, the packing in the unit square (each circle filled, its rim darker) and the
curve of the archive's best score per step (with the seeds' best as a dashed line), and writes an 8-bit RGB PNG.
"""

from __future__ import annotations

import struct
import zlib
from pathlib import Path
from typing import Sequence

import numpy as np

WHITE = np.array([255, 255, 255], dtype=np.uint8)


def write_png(path: str | Path, image: np.ndarray) -> None:
    """Write an ``[H, W, 3]`` uint8 image as a PNG file."""
    height, width, _ = image.shape
    raw = b"".join(b"\x00" + image[y].tobytes() for y in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
    png += chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")
    Path(path).write_bytes(png)


def _draw_packing(circles: np.ndarray, size: int) -> np.ndarray:
    image = np.tile(WHITE, (size, size, 1))
    margin = size // 20
    inner = size - 2 * margin
    ys, xs = np.mgrid[0:inner, 0:inner]
    px, py = (xs + 0.5) / inner, 1.0 - (ys + 0.5) / inner  # y up
    canvas = np.tile(np.array([245, 245, 245], dtype=np.uint8), (inner, inner, 1))
    palette = np.array([[66, 133, 244], [219, 68, 55], [244, 180, 0], [15, 157, 88], [171, 71, 188]], dtype=np.uint8)
    for i, (x, y, r) in enumerate(circles):
        d = np.hypot(px - x, py - y)
        canvas[d <= r] = palette[i % len(palette)]
        canvas[(d <= r) & (d >= r - 1.5 / inner)] = palette[i % len(palette)] // 2
    image[margin:margin + inner, margin:margin + inner] = canvas
    image[margin - 1, margin - 1:margin + inner + 1] = 0  # the square's border
    image[margin + inner, margin - 1:margin + inner + 1] = 0
    image[margin - 1:margin + inner + 1, margin - 1] = 0
    image[margin - 1:margin + inner + 1, margin + inner] = 0
    return image


def _draw_curve(values: Sequence[float], baseline: float | None, size: int) -> np.ndarray:
    image = np.tile(WHITE, (size, size, 1))
    margin = size // 10
    inner = size - 2 * margin
    image[margin + inner, margin:margin + inner] = 0  # axes
    image[margin:margin + inner, margin] = 0
    points = list(values) + ([baseline] if baseline is not None else [])
    if not values:
        return image
    low, high = min(points), max(points)
    span = (high - low) or 1.0

    def row(v: float) -> int:
        return margin + inner - 1 - int(round((v - low) / span * (inner - 1)))

    if baseline is not None:
        for x in range(margin, margin + inner, 6):
            image[row(baseline), x:x + 3] = (150, 150, 150)
    n = len(values)
    cols = [margin + int(round(i / max(n - 1, 1) * (inner - 1))) for i in range(n)]
    for (x0, v0), (x1, v1) in zip(zip(cols, values), zip(cols[1:], values[1:])):
        for t in np.linspace(0.0, 1.0, max(abs(x1 - x0), abs(row(v1) - row(v0)), 1) + 1):
            x, y = int(round(x0 + t * (x1 - x0))), int(round(row(v0) + t * (row(v1) - row(v0))))
            image[max(y - 1, 0):y + 2, max(x - 1, 0):x + 2] = (219, 68, 55)
    return image


def packing_png(path: str | Path, circles: Sequence[Sequence[float]], history: Sequence[float],
                baseline: float | None = None, size: int = 400) -> Path:
    """Write the packing and the best-score curve side by side; returns the path."""
    left = _draw_packing(np.asarray(circles, dtype=np.float64), size)
    right = _draw_curve([float(v) for v in history], baseline, size)
    write_png(path, np.concatenate([left, right], axis=1))
    return Path(path)
