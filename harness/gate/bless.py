"""Blessing: run image cases on one rank and store their outputs as the references the image stage compares with.

The only writer of reference images. Every case is run first (the single-rank output of its
fields on its own pipeline target, :meth:`ImageCase.reference_case`); only when all runs succeeded are the PNGs written,
each atomically, and the manifest of SHA-256 hashes last (:func:`harness.baselines.images.bless`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from harness.baselines.images import bless
from harness.cases.image import ImageCase
from harness.errors import ConfigError
from harness.gate.pipeline_runs import generate, needs_ranks, unavailable
from harness.ranks import PoolSet


def bless_cases(cases: Sequence[ImageCase], directory: Path, pools: PoolSet,
                timeout: float | None = None) -> dict[str, tuple[tuple[int, ...], list[str]]]:
    """Run and write every case's reference; ``{case id: (output shape, files written)}``."""
    references = [case.reference_case() for case in cases]
    for reference in references:
        reason = unavailable(reference, pools.device)
        if reason:
            raise ConfigError(f"case '{reference.id}': its pipeline target {reference.target!r} cannot run here: {reason}")
    if any(needs_ranks(r) for r in references):
        pools.prestart([1])
    outputs: dict[str, np.ndarray] = {}
    by_fields: dict[str, np.ndarray] = {}  # cases sharing target and fields (1-rank and N-rank of one prompt) share one run
    for case, reference in zip(cases, references):
        key = json.dumps([case.target, case.target_args, case.fields], sort_keys=True, default=str)
        if key not in by_fields:
            by_fields[key] = generate(reference, pools, timeout).output
        outputs[case.id] = by_fields[key]
    return {case.id: (tuple(outputs[case.id].shape), bless(directory, case.id, outputs[case.id])) for case in cases}
