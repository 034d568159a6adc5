"""The models' float64 oracle (:func:`harness.targets.reference.models.float64_copy`): the same weights in fp64, with
attention computed by the MATH backend whatever kernel the model under test uses (flash-attn has no fp64)."""

from __future__ import annotations

import torch

from harness.targets.reference.models import ZIMAGE_TINY, float64_copy
from reference_impl.attention.backends import MathBackend, TorchSDPABackend
from reference_impl.attention.layer import USPAttention
from reference_impl.forward_context import set_forward_context
from reference_impl.models.layers import grid_positions
from reference_impl.models.zimage import ZImageConfig, ZImageTransformerBlock, zimage_rope


def test_the_copy_attends_through_math_in_float64_and_leaves_the_model_alone() -> None:
    torch.manual_seed(0)
    cfg = ZImageConfig.from_dict(ZIMAGE_TINY)
    block = ZImageTransformerBlock(cfg, compute_dtype=torch.bfloat16).to(torch.bfloat16)
    exact = float64_copy(block)
    layers = [m for m in exact.modules() if isinstance(m, USPAttention)]
    assert layers and all(isinstance(m.attn_impl, MathBackend) for m in layers)
    assert all(p.dtype == torch.float64 for p in exact.parameters())
    assert isinstance(block.attention.attn.attn_impl, TorchSDPABackend)  # the model under test keeps its kernel

    x = torch.randn(1, 16, cfg.dim, dtype=torch.float64)
    ada = torch.randn(1, cfg.adaln_embed_dim, dtype=torch.float64)
    rope = zimage_rope(cfg, grid_positions((1, 4, 4), (1, 0, 0), torch.device("cpu")), torch.float64)
    sdpa64 = block.to(torch.float64)  # the same weights, attending through SDPA's fp64 math
    with torch.no_grad(), set_forward_context():
        assert torch.allclose(exact(x, rope, ada), sdpa64(x, rope, ada), rtol=0, atol=1e-12)
