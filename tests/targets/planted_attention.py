"""A diffusers pipeline with a planted sequence-parallel fault: every attention's image-token output gathered out of order.

The classic Ulysses/ring bug: the per-rank output shards are concatenated in the wrong order, so
token i receives the attention output of token i + S/2. Here it is planted on one rank by rolling
the output of every attention module by half its length (``--pipeline-target
tests.targets.planted_attention:factory --pipeline-target-arg path=DIR``). The image gate must
fail it against references blessed from the healthy pipeline.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from harness.targets.diffusers_pipeline import DiffusersPipelineTarget


def _misordered(module: torch.nn.Module, args: Any, output: Any) -> Any:
    image = output[0] if isinstance(output, tuple) else output
    rolled = image.roll(image.shape[1] // 2, dims=1)
    return (rolled, *output[1:]) if isinstance(output, tuple) else rolled


class PlantedAttentionTarget(DiffusersPipelineTarget):
    name = "diffusers-misordered-gather"

    def load(self, path: Path, dtype: torch.dtype, device: str) -> Any:
        from diffusers.models.attention import AttentionModuleMixin

        pipe = super().load(path, dtype, device)
        for module in pipe.transformer.modules():
            if isinstance(module, AttentionModuleMixin):
                module.register_forward_hook(_misordered)
        return pipe


def factory(path: str | None = None) -> PlantedAttentionTarget:
    return PlantedAttentionTarget(path)
