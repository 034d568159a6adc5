"""The reference pipeline with a planted slowdown: each DiT call sleeps ``fraction`` of its own wall time.

For the perf gate's acceptance: ``parity gate --perf --pipeline-target tests.targets.slow_pipeline:factory``
must fail against baselines the plain reference pipeline passes. The DiT keeps its class (the
pipeline dispatches on it); the sleep comes from forward hooks, after the device finished the
call (a host sleep while the GPU is still busy would hide inside the step).
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

    def prepare(self, fields: Mapping[str, Any], device: str) -> _Prepared:
        prepared = super().prepare(fields, device)
        dit = prepared.models.dit
        started: list[float] = []
        sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

        def begin(module: object, args: object) -> None:
            sync()
            started.append(time.perf_counter())

        def end(module: object, args: object, out: object) -> None:
            sync()
            time.sleep((time.perf_counter() - started.pop()) * self.fraction)

        dit.register_forward_pre_hook(begin)
        dit.register_forward_hook(end)
        return prepared


def factory(fraction: str = "0.2") -> SlowPipelineTarget:
    return SlowPipelineTarget(fraction)
