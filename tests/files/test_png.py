"""The guarded PNG decoder: an animated PNG is refused from its chunk headers, before a frame is decoded.

A 1.2 MB APNG of 100 frames of 2048 x 2048 (each within the pixel limit) decodes to 1.2 GB frame
by frame; the refusal must say why (not a decode failure) and allocate no frame on the way.
"""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from harness.errors import ConfigError
from harness.files.png import decode_rgb_png
from tests.files.hostile import apng_bytes

PEAK_LIMIT = 64 * 2**20  # one decoded 2048 x 2048 frame is 12 MiB; all 100 are 1.2 GiB


@pytest.mark.parametrize(
    ("frame", "frames"),
    [
        (np.zeros((2048, 2048, 3), np.uint8), 100),
        (np.arange(48, dtype=np.uint8).reshape(4, 4, 3), 2),
    ],
    ids=["100_frames_of_2048x2048", "2_frames_of_4x4"],
)
def test_an_animated_png_is_refused_before_any_frame_is_decoded(frame: np.ndarray, frames: int) -> None:
    data = apng_bytes(frame, frames)
    tracemalloc.start()
    try:
        with pytest.raises(ConfigError, match=rf"an animated PNG \(APNG, {frames} frames\)") as info:
            decode_rgb_png(data, "ref/case.png")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert "ref/case.png" in str(info.value)
    assert peak < PEAK_LIMIT, f"{peak / 2**20:.0f} MiB allocated while refusing"


def test_the_hand_written_apng_is_one_pillow_reads_as_animated() -> None:
    """So the refusal above is of a real APNG: Pillow sees its frames, and its first frame is the image."""
    import io

    from PIL import Image

    frame = np.arange(48, dtype=np.uint8).reshape(4, 4, 3)
    with Image.open(io.BytesIO(apng_bytes(frame, 3))) as image:
        assert image.is_animated and image.n_frames == 3
        assert np.array_equal(np.asarray(image.convert("RGB")), frame)
