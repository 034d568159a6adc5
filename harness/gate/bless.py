"""Blessing: run image cases on one rank and store their outputs as the references the image stage compares with.

The only writer of reference images. Every case is run first (the single-rank output of its
fields, :meth:`ImageCase.reference_case`); only when all runs succeeded are the PNGs written,
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
from harness.gate.images import nonfinite_reason
from harness.gate.pipeline_runs import generate
from harness.ranks import PoolSet


def bless_cases(cases: Sequence[ImageCase], directory: Path, pools: PoolSet, pipeline: str = "reference",
                timeout: float | None = None) -> dict[str, tuple[tuple[int, ...], list[str]]]:
    """Run and write every case's reference; ``{case id: (output shape, files written)}``.

    A run that produced NaN/Inf is refused (ConfigError naming the case; nothing is written): its
    uint8 pixels would store a black image that every equally broken run then matches.
    """
    pools.prestart([1])
    outputs: dict[str, np.ndarray] = {}
    by_fields: dict[str, np.ndarray] = {}  # cases sharing their fields (1-rank and N-rank of one prompt) share one run
    for case in cases:
        key = json.dumps(case.fields, sort_keys=True, default=str)
        if key not in by_fields:
            produced = generate(case.reference_case(), pools, pipeline, timeout)
            if produced.nonfinite:
                raise ConfigError(f"refusing to bless: {nonfinite_reason(produced.nonfinite)}", path=case.source,
                                  key=f"cases.{case.id}")
            by_fields[key] = produced.output
        outputs[case.id] = by_fields[key]
    return {case.id: (tuple(outputs[case.id].shape), bless(directory, case.id, outputs[case.id])) for case in cases}
