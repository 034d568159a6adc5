"""Pipeline targets for the non-finite checks: both generate a black image; one says it came from NaN.

That is what a NaN run of the reference pipeline looks like after its uint8 conversion (NaN
becomes 0): the pixels cannot tell the two apart, only the count of non-finite values can.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from harness.targets.base import PipelineOutput, PipelineTarget, Timings


class _Prepared:
    def __init__(self, nonfinite: int) -> None:
        self.nonfinite = nonfinite

    def run(self) -> PipelineOutput:
        return PipelineOutput(
            np.zeros((16, 16, 3), np.uint8), Timings(1.0, {"DenoisingStage": 1.0}), {"dit": "test"}, self.nonfinite
        )

    def close(self) -> None:
        pass


class BlackPipeline(PipelineTarget):
    name = "black"

    def __init__(self, nonfinite: int) -> None:
        self.nonfinite = nonfinite

    def check_case(self, fields: Mapping[str, Any], world_size: int) -> str:
        return "image"

    def prepare(self, fields: Mapping[str, Any], device: str) -> _Prepared:
        return _Prepared(self.nonfinite)


def clean() -> BlackPipeline:
    return BlackPipeline(0)


def nan() -> BlackPipeline:
    return BlackPipeline(16 * 16 * 3)
