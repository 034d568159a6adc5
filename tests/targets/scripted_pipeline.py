"""A pipeline target whose timings are a script, for verdicts that must not depend on this machine's noise.

``e2e`` is a ``:``-separated cycle of end-to-end times in ms (``"9:11.5"`` alternates them run by run);
the denoising stage is 80 % of each and text encoding the rest. It runs in the gate's process
(``runs_in_ranks`` False) and draws a flat image, so the perf stage's verdict logic is tested on
exact numbers end to end; parity's own wall clock of it is microseconds, under every floor.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

import numpy as np

from harness.errors import ParamError
from harness.targets.base import PipelineOutput, PipelineTarget, Timings


class _Scripted:
    def __init__(self, times: list[float], shape: tuple[int, int]) -> None:
        self._times, self._shape = itertools.cycle(times), shape

    def run(self) -> PipelineOutput:
        e2e = next(self._times)
        timings = Timings(e2e, {"TextEncodingStage": 0.2 * e2e, "DenoisingStage": 0.8 * e2e}, [], "script")
        return PipelineOutput(np.full((*self._shape, 3), 128, dtype=np.uint8), timings)

    def close(self) -> None:
        """Nothing to release."""


class ScriptedPipeline(PipelineTarget):
    name = "scripted"
    runs_in_ranks = False

    def __init__(self, e2e: str) -> None:
        self.times = [float(t) for t in e2e.split(":")]

    def check_case(self, fields: Mapping[str, Any], world_size: int) -> str:
        for key in fields:
            if key not in ("height", "width"):
                raise ParamError(key, "unknown key")
        return "image"

    def prepare(self, fields: Mapping[str, Any], device: str, world_size: int | None = None) -> _Scripted:
        return _Scripted(self.times, (int(fields.get("height", 8)), int(fields.get("width", 8))))


def factory(e2e: str = "10") -> ScriptedPipeline:
    return ScriptedPipeline(e2e)
