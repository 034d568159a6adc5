"""sglang's USPAttention whose masked sequence-parallel path runs at SDPA's default scale (``scale=None``).

The defect issue 38 names: a masked SP call that drops the layer's ``softmax_scale``. With the default
scale (1/√d) it changes nothing, so only a case with another scale (``scale_masked``) can see it. Only
the masked call under Ulysses is touched; every other path is the installed sglang layer. Use it as::

    parity check --target sglang --target-arg layer=tests.targets.sglang_masked_scale:MaskedScaleDroppedUSPAttention
"""

from __future__ import annotations

from typing import Any

import torch
from sglang.multimodal_gen.runtime.distributed.parallel_state import get_ulysses_parallel_world_size
from sglang.multimodal_gen.runtime.layers.attention.layer import USPAttention


class MaskedScaleDroppedUSPAttention(USPAttention):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        masked = kwargs.get("attn_mask") is not None or (args and args[0] is not None)
        if not masked or get_ulysses_parallel_world_size() == 1:
            return super().forward(q, k, v, *args, **kwargs)
        kept, self.softmax_scale = self.softmax_scale, None  # the masked SP path reads it at its SDPA call
        try:
            return super().forward(q, k, v, *args, **kwargs)
        finally:
            self.softmax_scale = kept
