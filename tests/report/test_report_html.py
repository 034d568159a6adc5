"""Triptych pictures and the HTML page, from arrays and documents (no pipeline run)."""

from __future__ import annotations

from pathlib import Path

import imageio.v3 as iio
import numpy as np

from harness.report.html import anchor, render_index, value_html, write_index
from harness.report.triptych import DIFF_MAX, heatmap, triptych, write_png


def _pair(shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    ref = rng.integers(0, 256, shape, dtype=np.uint8)
    cand = ref.copy()
    cand[..., 3, 5, :] = 255 - cand[..., 3, 5, :]  # one pixel (per frame) far off
    return ref, cand


def test_image_triptych_holds_reference_candidate_and_a_fixed_scale_heat_map(tmp_path: Path) -> None:
    ref, cand = _pair((16, 16, 3))
    drawn = triptych(ref, cand)
    k = drawn.scale
    assert k > 1 and len(drawn.panels) == 1
    (ry, rx, h, w), (cy, cx, _, _), (hy, hx, _, _) = drawn.panels[0]
    assert (h, w) == (16 * k, 16 * k)
    assert np.array_equal(drawn.picture[ry : ry + h : k, rx : rx + w : k], ref)
    assert np.array_equal(drawn.picture[cy : cy + h : k, cx : cx + w : k], cand)
    heat = drawn.picture[hy : hy + h : k, hx : hx + w : k]
    assert (
        heat[3, 5].tolist() == heatmap(np.array([[np.abs(ref[3, 5].astype(float) - cand[3, 5]).mean()]]))[0, 0].tolist()
    )
    assert heat.reshape(-1, 3).sum(axis=1).tolist().count(0) == 16 * 16 - 1  # identical pixels are black
    assert ry > 0  # a label row above the panels
    path = tmp_path / "t.png"
    write_png(path, drawn.picture)
    assert np.array_equal(iio.imread(path), drawn.picture)


def test_heat_map_scale_is_fixed_not_per_case() -> None:
    """White means the same in every case: 64 levels and above; one level is already a visible red."""
    levels = heatmap(np.array([[0.0, 1.0, 16.0, DIFF_MAX, 218.0]]))[0]
    assert levels[0].tolist() == [0, 0, 0] and levels[1].tolist() == [96, 0, 0]
    assert levels[2].tolist() == [255, 128, 0] and levels[3].tolist() == levels[4].tolist() == [255, 255, 255]
    # the same 1-level drift reads the same next to a 1-level or a 200-level worst pixel
    small, big = np.zeros((2, 2, 3), np.uint8), np.zeros((2, 2, 3), np.uint8)
    small[0, 0], big[0, 0], big[1, 1] = 1, 1, 200
    drawn_small, drawn_big = triptych(np.zeros_like(small), small), triptych(np.zeros_like(big), big)
    (y, x, _, _) = drawn_small.panels[0][2]
    assert drawn_small.picture[y, x].tolist() == drawn_big.picture[y, x].tolist() == [96, 0, 0]


def test_video_triptych_shows_every_frame() -> None:
    ref, cand = _pair((5, 8, 8, 3))
    drawn = triptych(ref, cand)
    assert len(drawn.panels) == 5
    k = drawn.scale
    shown = [
        np.array_equal(drawn.picture[y : y + h : k, x : x + w : k], ref[frame])
        for frame, ((y, x, h, w), _, _) in enumerate(drawn.panels)
    ]
    assert shown == [True] * 5  # frame by frame, each panel is its reference frame


def test_figures_render_as_numbers_and_tables_never_json() -> None:
    html = value_html(
        {"block.image": {"bitwise": True, "max_abs": 1.0733224917736095e-06}, "dit": {"bitwise": False, "max_abs": 0.5}}
    )
    assert "1.073e-06" in html and "<th>block.image</th>" in html and "<th>max_abs</th>" in html
    assert "{" not in html and '"' not in html
    assert value_html(["scaled_mm_rowwise", "scaled_mm_tensorwise"]) == "scaled_mm_rowwise, scaled_mm_tensorwise"
    assert ">inf<" in value_html("inf") and ">yes<" in value_html(True)


def test_index_puts_failures_first_and_folds_passing_cases(tmp_path: Path) -> None:
    document = {
        "command": "gate",
        "passed": False,
        "device": "cpu",
        "wall_s": 1.5,
        "git": {"commit": "0123456789abcdef", "dirty": True},
        "stages": {
            "contracts": {
                "summary": {"passed": 1, "skipped": 1},
                "wall_s": 0.2,
                "records": [
                    {
                        "case_id": "usp<1>",
                        "status": "passed",
                        "bound": "bitwise",
                        "figures": {"max_abs": 0.0},
                        "traceback": "x",
                    },
                    {"case_id": "ring", "status": "skipped", "reason": "backend returns no LSE", "figures": {}},
                ],
            },
            "images": {
                "summary": {"failed": 1},
                "records": [
                    {
                        "case_id": "img",
                        "check": "images.image",
                        "status": "failed",
                        "reason": "psnr 40 < 200",
                        "bound": "psnr ≥ 200",
                        "next_step": "parity bless img",
                        "figures": {
                            "psnr": 40.0,
                            "ssim": 0.99,
                            "clip": None,
                            "mean_abs_diff": 0.5,
                            "thresholds": {"clip": 0.98, "ssim": 0.95, "psnr": 200.0, "mean_abs_diff": 4.0},
                            "skipped_metrics": {"clip": "no CLIP model"},
                            "backends": {"dit": "torch_sdpa"},
                        },
                        "artifacts": {"triptych": "triptychs/img.png", "candidate": "candidates/img.png"},
                    }
                ],
            },
            "perf": {"skipped": "no baseline for this hardware"},
        },
    }
    page = render_index(document)
    assert "FAILED: 1 failing case (1 in images)" in page and "commit 0123456789ab (dirty)" in page
    failures, section, stages = (
        page.index("id='failures'"),
        page.index(f"id='{anchor('images', 'img')}'"),
        page.index("<details><summary>contracts"),
    )
    assert failures < section < page.index("id='skips'") < stages  # the failing cases' evidence before the skips
    assert f"<a href='#{anchor('images', 'img')}'>img</a>" in page and "<code>parity bless img</code>" in page
    assert "backend returns no LSE" in page and "no baseline for this hardware" in page  # skips with reasons
    assert "<img src='triptychs/img.png'" in page and "reference | candidate | |diff|" in page
    assert "≥ 200" in page and "outside" in page and "no CLIP model" in page  # metrics with their bounds
    assert "usp&lt;1&gt;" in page and "traceback" not in page.split("Every case")[1]
    write_index(tmp_path / "index.html", document)
    assert (tmp_path / "index.html").read_text() == page
