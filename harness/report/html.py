"""The gate's HTML report: one table per stage, and a reference | candidate | diff triptych per failing image case.

:func:`write_index` renders a gate results document (what results.json holds) with no other
input, so any stage's records show up: a record's id (``case_id``), ``status``, ``reason`` and
``figures`` are shown; an image record's ``artifacts.triptych`` (a PNG path relative to the report
directory) is embedded as an ``<img>``. Nothing is fetched from the network: the page is one
self-contained file next to its PNGs, readable as a CI artifact.

Triptych PNGs (:func:`triptych`, :func:`write_png`): the reference, the candidate and a heat map
of ``|reference - candidate|`` (mean over RGB, black → red → yellow → white, scaled to the
largest difference so one-level drift is still visible; the scale is printed in the report),
side by side, upscaled with nearest-neighbour so tiny test images stay legible. A video shows
its first, middle and last frames as three rows.
"""

from __future__ import annotations

import html
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from harness.files.atomic import write_bytes_atomic
from harness.report.format import STATUS_COLOUR, figure

_MIN_PANEL_PX = 192  # upscale small frames to about this height
_GAP_PX = 4


def key_frames(array: np.ndarray) -> list[int]:
    """Frame indices shown for a ``[T, H, W, 3]`` video: first, middle, last (deduplicated)."""
    return list(dict.fromkeys([0, len(array) // 2, len(array) - 1]))


def _abs_diff(ref: np.ndarray, cand: np.ndarray) -> np.ndarray:
    return np.abs(ref.astype(np.float64) - cand.astype(np.float64)).mean(axis=-1)


def heatmap(diff: np.ndarray, scale: float) -> np.ndarray:
    """A ``[H, W]`` difference as uint8 RGB ("hot": black → red → yellow → white at ``scale``)."""
    t = diff / scale
    rgb = np.stack([np.clip(3 * t, 0, 1), np.clip(3 * t - 1, 0, 1), np.clip(3 * t - 2, 0, 1)], axis=-1)
    return (rgb * 255).round().astype(np.uint8)


def triptych(ref: np.ndarray, cand: np.ndarray) -> tuple[np.ndarray, float]:
    """One uint8 RGB picture: reference | candidate | diff heat map (a row per key frame for a video).

    Returns it with the heat map's full scale (the largest difference, at least 1 level of 255),
    shared by every row so rows compare.
    """
    if ref.shape != cand.shape:
        raise ValueError(f"reference shape {ref.shape} and candidate shape {cand.shape} differ")
    frames = [(ref, cand)] if ref.ndim == 3 else [(ref[i], cand[i]) for i in key_frames(ref)]
    diffs = [_abs_diff(r, c) for r, c in frames]
    scale = max(1.0, *(float(d.max()) for d in diffs))
    h = frames[0][0].shape[0]
    k = max(1, _MIN_PANEL_PX // h)
    rows = []
    for (r, c), diff in zip(frames, diffs):
        panels = [p.repeat(k, 0).repeat(k, 1) for p in (r, c, heatmap(diff, scale))]
        gap = np.full((h * k, _GAP_PX, 3), 255, np.uint8)
        rows.append(np.concatenate([panels[0], gap, panels[1], gap, panels[2]], axis=1))
    sep = np.full((_GAP_PX, rows[0].shape[1], 3), 255, np.uint8)
    pieces = [rows[0]]
    for row in rows[1:]:
        pieces += [sep, row]
    return np.concatenate(pieces, axis=0), scale


def write_png(path: str | Path, array: np.ndarray) -> None:
    """Encode ``array`` (uint8 HxWx3) as PNG with imageio and write it atomically."""
    import imageio.v3 as iio

    write_bytes_atomic(path, bytes(iio.imwrite("<bytes>", np.ascontiguousarray(array), extension=".png")))


# ------------------------------------------------------------------------------------ HTML
_CSS = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #1f2328; }
table { border-collapse: collapse; margin-bottom: 1.5em; font-size: 0.9em; }
th, td { border: 1px solid #d0d7de; padding: 0.25em 0.6em; text-align: left; vertical-align: top; }
th { background: #f6f8fa; }
td.figures { font-family: ui-monospace, monospace; font-size: 0.85em; max-width: 60em; word-break: break-word; }
.status { font-weight: bold; }
figure { margin: 0.5em 0 1.5em 0; }
img { image-rendering: pixelated; border: 1px solid #d0d7de; }
"""


def _fmt(value: Any) -> str:
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True, default=str)
    return figure(value, 6)


def _figures_cell(figures: Mapping[str, Any]) -> str:
    return "<br>".join(f"{html.escape(k)} = {html.escape(_fmt(v))}" for k, v in figures.items())


def _stage_section(name: str, stage: Mapping[str, Any]) -> str:
    parts = [f"<h2>{html.escape(name)}</h2>"]
    if "skipped" in stage:
        return parts[0] + f"<p>skipped: {html.escape(str(stage['skipped']))}</p>"
    summary = stage.get("summary", {})
    wall = stage.get("wall_s")
    parts.append("<p>" + ", ".join(f"{html.escape(str(v))} {html.escape(k)}" for k, v in summary.items())
                 + (f" in {wall:.1f} s" if isinstance(wall, (int, float)) else "") + "</p>")
    records: Sequence[Mapping[str, Any]] = stage.get("records", [])
    rows = ["<tr><th>case</th><th>status</th><th>reason / bound</th><th>figures</th></tr>"]
    figures_html = []
    for record in records:
        status = str(record.get("status", ""))
        colour = STATUS_COLOUR.get(status, "#1f2328")
        detail = record.get("reason") or record.get("bound") or ""
        case_id = str(record.get("case_id", record.get("id", "?")))
        rows.append(
            f"<tr><td>{html.escape(case_id)}</td><td class='status' style='color:{colour}'>{html.escape(status)}</td>"
            f"<td>{html.escape(str(detail))}</td><td class='figures'>{_figures_cell(record.get('figures', {}))}</td></tr>"
        )
        triptych_png = (record.get("artifacts") or {}).get("triptych")
        if triptych_png:
            src = html.escape(str(triptych_png), quote=True)
            scale = (record.get("figures") or {}).get("diff_scale")
            caption = f"{html.escape(case_id)}: reference | candidate | |diff| heat map"
            if isinstance(scale, (int, float)):
                caption += f" (white = a difference of {scale:.3g}/255)"
            figures_html.append(f"<figure><img src='{src}' alt='{html.escape(case_id)} triptych'>"
                                f"<figcaption>{caption}</figcaption></figure>")
    parts.append("<table>" + "".join(rows) + "</table>")
    parts.extend(figures_html)
    return "\n".join(parts)


def render_index(document: Mapping[str, Any]) -> str:
    """The report page for a gate results document."""
    passed = document.get("passed")
    verdict = "PASSED" if passed else "FAILED"
    env = {k: document[k] for k in ("target", "device", "platform", "torch", "host") if k in document}
    head = (f"<h1>parity gate: <span style='color:{STATUS_COLOUR['passed' if passed else 'failed']}'>{verdict}</span></h1>"
            f"<p>{html.escape(', '.join(f'{k} {v}' for k, v in env.items()))}"
            + (f"; {document['wall_s']:.1f} s" if isinstance(document.get("wall_s"), (int, float)) else "") + "</p>")
    sections = [_stage_section(name, stage) for name, stage in document.get("stages", {}).items()]
    return ("<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>parity gate</title>"
            f"<style>{_CSS}</style></head><body>\n{head}\n" + "\n".join(sections) + "\n</body></html>\n")


def write_index(path: str | Path, document: Mapping[str, Any]) -> None:
    """Write :func:`render_index` atomically."""
    write_bytes_atomic(path, render_index(document).encode("utf-8"))
