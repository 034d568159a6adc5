"""The reference pipeline with a planted slowdown: every denoising step sleeps ``fraction`` of its own wall time.

For the perf gate's acceptance: ``parity gate --perf --pipeline-target tests.targets.slow_pipeline:factory``
must fail against baselines the plain reference pipeline passes. The models keep their classes
(the pipeline dispatches on them); the sleep comes from forward hooks. The text encoder's hook
marks where the denoising loop starts; each DiT call's hook, once the device finished it, sleeps
``fraction`` of the time since the previous mark (the scheduler update before it and the DiT
call: one step) and marks again after the sleep. A host sleep while the GPU is still busy would
hide inside the step, hence the synchronisation before measuring.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch

from harness.targets.reference.pipeline import ReferencePipelineTarget, _Prepared


class SlowPipelineTarget(ReferencePipelineTarget):
    name = "slow_pipeline"

    def __init__(self, fraction: str = "0.2") -> None:
        self.fraction = float(fraction)

    def prepare(self, fields: Mapping[str, Any], device: str, world_size: int | None = None) -> _Prepared:
        prepared = super().prepare(fields, device, world_size)
        sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
        mark = [time.perf_counter()]

        def loop_starts(module: object, args: object, out: object) -> None:
            sync()
            mark[0] = time.perf_counter()

        def step_done(module: object, args: object, out: object) -> None:
            sync()
            time.sleep((time.perf_counter() - mark[0]) * self.fraction)
            mark[0] = time.perf_counter()

        prepared.models.text_encoder.register_forward_hook(loop_starts)
        prepared.models.dit.register_forward_hook(step_done)
        return prepared


def factory(fraction: str = "0.2") -> SlowPipelineTarget:
    return SlowPipelineTarget(fraction)
