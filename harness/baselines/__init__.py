"""Baseline files: thresholds (sglang schema), perf baselines, reference images, atomic writes.

Submodules are imported explicitly (``from harness.baselines.thresholds import ThresholdSet``) so
that a light user such as the atomic writer does not pay for numpy/imageio imports.
"""
