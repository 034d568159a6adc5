"""Triptych pictures and the HTML page, from arrays and documents (no pipeline run)."""

from __future__ import annotations

from pathlib import Path

import imageio.v3 as iio
import numpy as np

from harness.report.html import render_index, triptych, write_index, write_png


def _pair(shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    ref = rng.integers(0, 256, shape, dtype=np.uint8)
    cand = ref.copy()
    cand[..., 3, 5, :] = 255 - cand[..., 3, 5, :]  # one pixel (per frame) far off
    return ref, cand


def test_image_triptych_holds_reference_candidate_and_a_heat_map(tmp_path: Path) -> None:
    ref, cand = _pair((16, 16, 3))
    picture, scale = triptych(ref, cand)
    k = picture.shape[0] // 16  # the upscale factor
    assert k > 1 and picture.shape == (16 * k, 3 * 16 * k + 2 * 4, 3)
    assert np.array_equal(picture[::k, : 16 * k : k], ref)
    assert np.array_equal(picture[::k, 16 * k + 4 : 32 * k + 4 : k], cand)
    heat = picture[::k, 32 * k + 8 :: k]
    assert scale == np.abs(ref[3, 5].astype(float) - cand[3, 5]).mean()
    assert heat[3, 5].tolist() == [255, 255, 255]  # the largest difference is white
    assert heat.reshape(-1, 3).sum(axis=1).tolist().count(0) == 16 * 16 - 1  # identical pixels are black
    path = tmp_path / "t.png"
    write_png(path, picture)
    assert np.array_equal(iio.imread(path), picture)


def test_video_triptych_shows_first_middle_last_frames() -> None:
    ref, cand = _pair((5, 8, 8, 3))
    picture, _ = triptych(ref, cand)
    k = (picture.shape[1] - 2 * 4) // (3 * 8)  # three 8-wide panels, two gaps
    rows = [picture[i * (8 * k + 4) : i * (8 * k + 4) + 8 * k : k, : 8 * k : k] for i in range(3)]
    assert picture.shape[0] == 3 * 8 * k + 2 * 4
    for row, frame in zip(rows, (0, 2, 4)):
        assert np.array_equal(row, ref[frame])


def test_index_lists_every_stage_and_embeds_failing_triptychs(tmp_path: Path) -> None:
    document = {
        "passed": False, "device": "cpu", "wall_s": 1.5,
        "stages": {
            "contracts": {"summary": {"passed": 1}, "wall_s": 0.2, "records": [
                {"case_id": "usp<1>", "status": "passed", "bound": "bitwise", "figures": {"max_abs": 0.0}, "traceback": "x"}]},
            "images": {"summary": {"failed": 1}, "records": [
                {"case_id": "img", "status": "failed", "reason": "psnr 40 < 200", "figures": {"psnr": 40.0, "diff_scale": 3.0},
                 "artifacts": {"triptych": "images/img.png"}}]},
            "perf": {"skipped": "no baseline for this hardware"},
        },
    }
    page = render_index(document)
    assert "usp&lt;1&gt;" in page and "bitwise" in page and "traceback" not in page
    assert "<img src='images/img.png'" in page and "psnr 40 &lt; 200" in page and "white = a difference of 3/255" in page
    assert "skipped: no baseline for this hardware" in page and "FAILED" in page
    write_index(tmp_path / "index.html", document)
    assert (tmp_path / "index.html").read_text() == page
