"""Triptych PNGs of a failing image case: reference | candidate | |diff| heat map, labelled, one fixed scale.

The heat map shows ``|reference - candidate|`` (mean over RGB, in levels of 255) on the same
scale in every case and every report, so two heat maps compare at a glance: black is 0, white is
:data:`DIFF_MAX` levels or more, on a square-root ramp (black → red → yellow → white) so a
one-level drift is already a visible dark red (96/255) while large errors still separate. A
colour bar with ticks at 0, 1, 4, 16 and 64 sits under the heat map. Panels are labelled
(reference / candidate / |diff|) in the picture itself; a video gets one row per frame, each
labelled with its frame's PSNR, mean and largest |diff| (:func:`frame_metrics`). Small frames
are upscaled with nearest-neighbour so tiny test images stay legible.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from harness.files.atomic import write_bytes_atomic
from harness.files.png import encode_png
from harness.report.format import figure

DIFF_MAX = 64.0  # levels of 255 at which the heat map is white
TICKS = (0, 1, 4, 16, 64)
PANEL_LABELS = ("reference", "candidate", "|diff|")
_MIN_PANEL_PX = 192  # upscale small frames to about this height
_GAP_PX = 6
_FONT_PX = 15  # label size: readable at 100 % zoom (the bitmap default font is ~8 px)
_TEXT_PX = 22  # height of a line of labels
_BAR_PX = 12
_BACKGROUND = 255

Box = tuple[int, int, int, int]  # top, left, height, width in the picture


@dataclass
class Triptych:
    """The picture and where each frame's three panels sit in it (so tests and tools can find them)."""

    picture: np.ndarray = field(repr=False)
    panels: list[tuple[Box, Box, Box]]
    scale: int  # the upscale factor of the panels


def abs_diff(ref: np.ndarray, cand: np.ndarray) -> np.ndarray:
    """``|ref - cand|`` per pixel, mean over RGB, in levels of 255 (float64: uint8 would wrap)."""
    return np.abs(ref.astype(np.float64) - cand.astype(np.float64)).mean(axis=-1)


def heatmap(diff: np.ndarray) -> np.ndarray:
    """A ``[H, W]`` |diff| as uint8 RGB on the fixed square-root scale (white at :data:`DIFF_MAX` and above)."""
    t = np.sqrt(np.clip(diff, 0.0, DIFF_MAX) / DIFF_MAX)
    rgb = np.stack([np.clip(3 * t, 0, 1), np.clip(3 * t - 1, 0, 1), np.clip(3 * t - 2, 0, 1)], axis=-1)
    return (rgb * 255).round().astype(np.uint8)


def frame_metrics(ref: np.ndarray, cand: np.ndarray) -> list[dict[str, Any]]:
    """Per frame of a ``[T, H, W, 3]`` pair: ``frame``, ``psnr`` (inf when identical), ``mean_abs_diff``, ``max_abs_diff``."""
    from harness.metrics import mean_abs_diff, psnr

    out = []
    for i, (r, c) in enumerate(zip(ref, cand)):
        diff = np.abs(r.astype(np.int16) - c.astype(np.int16))
        out.append(
            {"frame": i, "psnr": psnr(r, c), "mean_abs_diff": mean_abs_diff(r, c), "max_abs_diff": int(diff.max())}
        )
    return out


def _frame_label(m: dict[str, Any]) -> str:
    value = m["psnr"]
    db = "identical" if isinstance(value, float) and math.isinf(value) else f"psnr {figure(value)} dB"
    return f"frame {m['frame']}: {db}, mean |diff| {figure(m['mean_abs_diff'])}, max {m['max_abs_diff']}"


def triptych(ref: np.ndarray, cand: np.ndarray) -> Triptych:
    """One labelled uint8 RGB picture: reference | candidate | |diff| (a row per frame for a video), colour bar below."""
    from PIL import Image, ImageDraw, ImageFont

    if ref.shape != cand.shape:
        raise ValueError(f"reference shape {ref.shape} and candidate shape {cand.shape} differ")
    video = ref.ndim == 4
    frames = list(zip(ref, cand)) if video else [(ref, cand)]
    labels = [_frame_label(m) for m in frame_metrics(ref, cand)] if video else []
    h, w = frames[0][0].shape[:2]
    k = max(1, _MIN_PANEL_PX // h)
    ph, pw = h * k, w * k
    row_h = ph + (_TEXT_PX if video else 0)
    width = 3 * pw + 2 * _GAP_PX
    height = _TEXT_PX + len(frames) * (row_h + _GAP_PX) + _BAR_PX + _TEXT_PX
    picture = np.full((height, width, 3), _BACKGROUND, np.uint8)
    panels = []
    for i, (r, c) in enumerate(frames):
        top = _TEXT_PX + i * (row_h + _GAP_PX) + (_TEXT_PX if video else 0)
        boxes = tuple((top, j * (pw + _GAP_PX), ph, pw) for j in range(3))
        for (y, x, _, _), panel in zip(boxes, (r, c, heatmap(abs_diff(r, c)))):
            picture[y : y + ph, x : x + pw] = panel.repeat(k, 0).repeat(k, 1)
        panels.append(boxes)
    bar_top = height - _BAR_PX - _TEXT_PX
    bar_left = 2 * (pw + _GAP_PX)
    ramp = (np.linspace(0.0, 1.0, pw) ** 2 * DIFF_MAX)[None, :].repeat(_BAR_PX, 0)
    picture[bar_top : bar_top + _BAR_PX, bar_left : bar_left + pw] = heatmap(ramp)
    image = Image.fromarray(picture)
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default(size=_FONT_PX)
    for j, label in enumerate(PANEL_LABELS):
        draw.text((j * (pw + _GAP_PX) + 2, 3), label, fill=(0, 0, 0), font=font)
    for i, label in enumerate(labels):
        draw.text((2, _TEXT_PX + i * (row_h + _GAP_PX) + 3), label, fill=(0, 0, 0), font=font)
    for tick in TICKS:
        x = bar_left + round(math.sqrt(tick / DIFF_MAX) * (pw - 1))
        draw.line([(x, bar_top + _BAR_PX), (x, bar_top + _BAR_PX + 3)], fill=(0, 0, 0))
        text = f"{tick}+" if tick == TICKS[-1] else str(tick)
        draw.text(
            (min(x, bar_left + pw - draw.textlength(text, font=font)), bar_top + _BAR_PX + 4),
            text,
            fill=(0, 0, 0),
            font=font,
        )
    draw.text((2, bar_top), f"|diff| in levels of 255, sqrt scale, white = {DIFF_MAX:g}+", fill=(0, 0, 0), font=font)
    return Triptych(np.asarray(image), panels, k)


def write_png(path: str | Path, array: np.ndarray) -> None:
    """Encode ``array`` (uint8 HxWx3) as PNG and write it atomically."""
    write_bytes_atomic(path, encode_png(array))
