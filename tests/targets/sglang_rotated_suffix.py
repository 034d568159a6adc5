"""sglang's USPAttention with its replicated suffix rotated to the front, as before PR #33923.

Up to sglang 0.5.17, ``_forward_with_replicated_suffix`` moved the replicated suffix in front
of the shard, ran the replicated-prefix path and moved the output back. It is the same
attention mathematically, but every query scans K/V in another order, so in bf16 the output is
no longer bitwise equal to one rank (Z-Image-Turbo drifted by MAE 7.28 over 9 steps). Only
that method is replaced here; everything else is the installed sglang layer. Use it as::

    parity check --target sglang --target-arg layer=tests.targets.sglang_rotated_suffix:RotatedSuffixUSPAttention

``usp.replicated_suffix_bitwise`` must fail on it and ``usp.replicated_prefix_drift`` pass.
"""

from __future__ import annotations

from typing import Any

import torch
from sglang.multimodal_gen.runtime.layers.attention.layer import USPAttention


class RotatedSuffixUSPAttention(USPAttention):
    def _forward_with_replicated_suffix(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx_attn_metadata: Any, num_rep: int
    ) -> torch.Tensor:
        front = [torch.cat([t[:, -num_rep:], t[:, :-num_rep]], dim=1) for t in (q, k, v)]
        out = self._forward_with_replicated_prefix(*front, ctx_attn_metadata, num_rep)
        return torch.cat([out[:, num_rep:], out[:, :num_rep]], dim=1)
