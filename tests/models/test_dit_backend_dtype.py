"""A DiT built for bf16 picks FlashAttention where it can run, as sglang's DiTs do; an fp32 one cannot.

The DiTs are built in the default dtype and cast after, so each attention layer must be told the
dtype it will compute in: before, every DiT layer selected for fp32 and a bf16 DiT on CUDA never
got FlashAttention. The platform is forced to CUDA (``PARITY_PLATFORM``) and a flash-attn (FA4's entry
points, :mod:`tests.planted_flash_attn`) planted: selection only, nothing is run.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from reference_impl.attention.backends import AttentionBackendEnum, FlashAttnBackend
from reference_impl.attention.layer import USPAttention
from reference_impl.pipeline import PipelineConfig, build_models
from tests.planted_flash_attn import planted


@pytest.fixture
def cuda_with_flash_attn(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    monkeypatch.setenv("PARITY_PLATFORM", "cuda")
    with planted(tmp_path, "fa4"):
        assert FlashAttnBackend.is_available()
        yield


def _dit_backends(num_frames: int | None, dtype: str) -> set[AttentionBackendEnum]:
    config = PipelineConfig(
        prompt="a cameraman",
        height=16,
        width=16,
        steps=1,
        dtype={"bf16": "bfloat16", "fp32": "float32"}[dtype],
        device="cpu",
        num_frames=num_frames,
        weights=None,
    )
    dit = build_models(config).dit
    layers = [m for m in dit.modules() if isinstance(m, USPAttention)]
    assert layers
    return {m.backend for m in layers}


@pytest.mark.parametrize("num_frames", [None, 2], ids=["zimage", "hunyuanvideo"])
def test_a_bf16_dit_selects_flash_attention_and_an_fp32_one_sdpa(
    cuda_with_flash_attn: None, num_frames: int | None
) -> None:
    assert _dit_backends(num_frames, "bf16") == {AttentionBackendEnum.FA}
    assert _dit_backends(num_frames, "fp32") == {AttentionBackendEnum.TORCH_SDPA}  # FA computes in fp16/bf16 only


def test_on_the_cpu_the_dtype_changes_nothing() -> None:
    assert _dit_backends(None, "bf16") == _dit_backends(None, "fp32") == {AttentionBackendEnum.TORCH_SDPA}
    assert torch.get_default_dtype() == torch.float32
