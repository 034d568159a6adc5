"""TEST-ONLY: the reference target with one bug planted in its ring path, each one that only a case with a
non-default softmax scale or large logits can see (every default case passes with it):

- ``ring_ignores_scale``: the ring attends every K/V block with the kernel's default scale (1/√d), dropping the
  layer's ``softmax_scale``;
- ``lse_drops_scale``: the kernel's LSE path (``return_lse=True``, what a ring calls) drops the scale, while its
  plain path keeps it;
- ``unsafe_merge``: blocks merged as log(exp(a) + exp(b)) with weights exp(lse_block) / exp(lse_total), without
  the max shift: exact until the LSEs pass ~88, where fp32's exp overflows.

Each is planted by patching ``reference_impl`` for the duration of each call.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any
from unittest import mock

import torch

from reference_impl.attention import backends, ring
from tests.targets.planting import PlantedTarget, planted_target

Tensor = torch.Tensor
_attend, _math_forward, _sdpa_forward = (
    ring.Blocks.attend,
    backends.MathBackend.forward,
    backends.TorchSDPABackend.forward,
)


def _attend_unscaled(self: ring.Blocks, q: Tensor, k: Tensor, v: Tensor, causal: bool) -> ring.Partial:
    out, lse = self.impl.forward(q, k, v, causal=causal, softmax_scale=None, return_lse=True)
    return out.float(), lse


def _lse_path_unscaled(forward: Callable[..., Any]) -> Callable[..., Any]:
    def call(self: Any, q: Tensor, k: Tensor, v: Tensor, causal: bool = False, softmax_scale: float | None = None,
             return_lse: bool = False, attn_mask: Tensor | None = None) -> Any:  # fmt: skip
        return forward(self, q, k, v, causal, None if return_lse else softmax_scale, return_lse, attn_mask)

    return call


def _unsafe_merge(parts: Sequence[ring.Partial]) -> ring.Partial:
    out_acc, lse_acc = parts[0]
    for out, lse in parts[1:]:
        total = torch.exp(lse_acc) + torch.exp(lse)
        w_old = (torch.exp(lse_acc) / total).transpose(1, 2).unsqueeze(-1)
        w_new = (torch.exp(lse) / total).transpose(1, 2).unsqueeze(-1)
        out_acc, lse_acc = out_acc * w_old + out * w_new, torch.log(total)
    return out_acc, lse_acc


def _patches(bug: str) -> list[Any]:
    if bug == "ring_ignores_scale":
        return [mock.patch.object(ring.Blocks, "attend", _attend_unscaled)]
    if bug == "lse_drops_scale":
        return [
            mock.patch.object(backends.MathBackend, "forward", _lse_path_unscaled(_math_forward)),
            mock.patch.object(backends.TorchSDPABackend, "forward", _lse_path_unscaled(_sdpa_forward)),
        ]
    return [mock.patch.object(ring, "merge", _unsafe_merge)]


BUGS = ("ring_ignores_scale", "lse_drops_scale", "unsafe_merge")


@contextmanager
def planted(bug: str) -> Iterator[None]:
    patches = _patches(bug)
    for patch in patches:
        patch.start()
    try:
        yield
    finally:
        for patch in patches:
            patch.stop()


def factory(bug: str) -> PlantedTarget:
    return planted_target(bug, BUGS, planted, "ring")
