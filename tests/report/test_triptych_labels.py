"""The triptych's labels are readable at 100 % zoom: glyphs of a normal text size, not the ~8 px bitmap font."""

from __future__ import annotations

import numpy as np

from harness.report.triptych import triptych


def test_the_reference_label_is_at_least_10_px_tall() -> None:
    ref = np.full((32, 32, 3), 200, np.uint8)
    drawn = triptych(ref, ref)
    top, _, _, width = drawn.panels[0][0]  # the label "reference" sits above the first panel
    ink = np.flatnonzero((drawn.picture[:top, :width] < 100).all(axis=2).any(axis=1))
    assert ink.size and ink[-1] - ink[0] + 1 >= 10, ink  # 11 px with the 15 px font; 8 px with PIL's bitmap default
