"""Model checks of the MiniMax-H3 style VAE attention (``vae.audio_fp32_restored``, ``vae.video_dispatch``): figures only.

Each runs in one process and forces platforms through ``PARITY_PLATFORM`` (read by the reference
at construction and call time), so every branch runs on a CPU-only machine: on a simulated
platform the tensors stay on the real device and the USP path runs the platform's default
backend there. The contracts in :mod:`harness.contracts.model_checks` judge the figures.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from harness.targets.figures import AudioFused, AudioRun, BranchAgreement, VideoDispatch
from reference_impl.attention.backends import AttentionBackendEnum, backend_class
from reference_impl.attention.selector import BackendRefused, attention_backend_config
from reference_impl.forward_context import set_forward_context
from reference_impl.models.minimax_vae import Attention, CausalAttention
from reference_impl.platform import PLATFORM_ENV

Tensor = torch.Tensor

DISPATCH_PLATFORMS = ("cpu", "mps", "cuda", "rocm:gfx950", "rocm:gfx942")
DISPATCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@contextmanager
def forced_platform(spec: str) -> Iterator[None]:
    """Force ``PARITY_PLATFORM`` for a block and restore what was there."""
    previous = os.environ.get(PLATFORM_ENV)
    os.environ[PLATFORM_ENV] = spec
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(PLATFORM_ENV, None)
        else:
            os.environ[PLATFORM_ENV] = previous


def _copy_of(template: nn.Module, build: Any) -> nn.Module:
    """Build a module under the current platform and give it the template's weights."""
    module = build()
    module.load_state_dict(template.state_dict())
    return module


def _max_abs(a: Tensor, b: Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def video_dispatch(
    device: str = "cpu", seed: int = 0, tokens: int = 64, heads: int = 2, dim_head: int = 32
) -> VideoDispatch:
    """Which branch the video VAE attention takes per (platform, dtype), and how far the branches are apart.

    ``table[platform][dtype]`` is the ``last_dispatch`` seen; per dtype the max abs difference between
    every branch and the first (cpu) one and against an fp64 run of the same weights.
    """
    dev = torch.device(device)

    def build() -> Attention:
        return Attention(heads, dim_head, qk_norm_type="rms_norm")

    gen = torch.Generator().manual_seed(seed)
    with forced_platform("cpu"):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            template = build()
        x = torch.randn(1, tokens, heads * dim_head, generator=gen).to(dev)
        ref64 = _copy_of(template, build).to(dev, torch.float64)(x.double())

    table: dict[str, dict[str, str | None]] = {}
    outputs: dict[str, dict[str, Tensor]] = {d: {} for d in DISPATCH_DTYPES}
    for platform in DISPATCH_PLATFORMS:
        table[platform] = {}
        with forced_platform(platform):
            for dname, dtype in DISPATCH_DTYPES.items():
                module = _copy_of(template, build).to(dev, dtype)
                with torch.no_grad(), set_forward_context(current_timestep=0, attn_metadata=None):
                    outputs[dname][platform] = module(x.to(dtype))
                table[platform][dname] = module.last_dispatch
    agreement = {}
    for dname, outs in outputs.items():
        first = outs[DISPATCH_PLATFORMS[0]]
        vs_cpu = {platform: _max_abs(out, first) for platform, out in outs.items()}
        agreement[dname] = BranchAgreement(
            max_abs_vs_cpu_branch=vs_cpu,
            max_abs_between_branches=max(vs_cpu.values()),
            max_abs_vs_fp64=max(_max_abs(out, ref64) for out in outs.values()),
            finite=all(bool(torch.isfinite(out).all()) for out in outs.values()),
        )
    return VideoDispatch(table, agreement)


def _attention_dtypes(module: CausalAttention, x: Tensor) -> tuple[Tensor, list[torch.dtype]]:
    """Run ``module`` and record the dtypes that entered and left its USPAttention (a forward hook, not a mock)."""
    seen: list[torch.dtype] = []
    handle = None
    if module.attn is not None:
        handle = module.attn.register_forward_hook(lambda _m, args, out: seen.extend([args[0].dtype, out.dtype]))
    try:
        with torch.no_grad(), set_forward_context(current_timestep=0, attn_metadata=None):
            out = module(x)
    finally:
        if handle is not None:
            handle.remove()
    return out, seen


@dataclass(frozen=True)
class _Audio:
    """The audio attention's input, its weights and its fp32 output on the non-CUDA path (the direct causal SDPA)."""

    x: Tensor
    template: CausalAttention
    direct: Tensor
    direct_dispatch: str | None
    dim: int
    heads: int

    @property
    def bound(self) -> float:
        """One bf16 rounding step of the attention output, scaled by the output's magnitude."""
        return 2.0**-7 * max(1.0, self.direct.abs().max().item())

    def build(self, **kwargs: Any) -> CausalAttention:
        """A copy of the template's weights, built under the platform in force."""
        return _copy_of(self.template, lambda: CausalAttention(self.dim, self.dim, self.heads, **kwargs)).to(
            self.x.device
        )


def _audio(device: str, seed: int, tokens: int = 48, dim: int = 64, heads: int = 4) -> _Audio:
    dev = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, tokens, dim, generator=gen).to(dev)
    with forced_platform("cpu"):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            template = CausalAttention(dim, dim, heads)
            nn.init.normal_(template.q_bias, std=0.1)
            nn.init.normal_(template.v_bias, std=0.1)
        template = template.to(dev)
        direct, _ = _attention_dtypes(template, x)
    return _Audio(x, template, direct, template.last_dispatch, dim, heads)


def _audio_run(audio: _Audio, module: CausalAttention, fused: bool) -> AudioRun:
    out, seen = _attention_dtypes(module, audio.x)
    common = dict(dispatch=module.last_dispatch, attention_dtypes=[str(d) for d in seen], out_dtype=str(out.dtype))
    if not fused:
        return AudioRun(
            **common, bitwise_vs_direct_sdpa=bool(torch.equal(out, audio.direct)), direct_dispatch=audio.direct_dispatch
        )
    return AudioRun(**common, max_abs_vs_fp32=_max_abs(out, audio.direct), bound=audio.bound)


def audio_default(device: str = "cpu", seed: int = 0) -> AudioRun:
    """On the (simulated) CUDA platform the layer picks TORCH_SDPA and casts nothing: fp32 in, fp32 out."""
    audio = _audio(device, seed)
    with forced_platform("cuda"):
        return _audio_run(audio, audio.build(), fused=False)


def audio_fa(device: str = "cpu", seed: int = 0) -> AudioFused:
    """``audio_vae=fa`` runs (flash-attn installed) or is refused at construction because flash-attn is missing.

    Any other refusal propagates: a strict override that is refused for another reason, or silently
    served by SDPA, is the finding (a fallback shows as a dispatch other than FA's).
    """
    audio = _audio(device, seed)
    with forced_platform("cuda"):
        try:
            with attention_backend_config("audio_vae=fa"):
                module = audio.build()
        except BackendRefused as exc:
            if backend_class(AttentionBackendEnum.FA.value).unavailable_reason() is None:
                raise
            return AudioFused(ran=False, refused=str(exc))
        run = _audio_run(audio, module, fused=True)
        return AudioFused(ran=True, run=dataclasses.replace(run, backend_dtype=str(module.attn.dtype)))


def audio_cast_restore(device: str = "cpu", seed: int = 0) -> AudioRun:
    """The cast-and-restore path with a backend that runs everywhere.

    FA is the only fused backend in the released supported set and it is not installed on CPU
    machines, so the supported set is widened to {MATH, TORCH_SDPA} and ``audio_vae=math`` is built
    at a bf16 compute dtype: this proves the layer's cast logic, not FA's numerics.
    """
    audio = _audio(device, seed)
    with forced_platform("cuda"):
        with attention_backend_config("audio_vae=math"):
            module = audio.build(
                supported_attention_backends={AttentionBackendEnum.MATH, AttentionBackendEnum.TORCH_SDPA},
                dtype=torch.bfloat16,
            )
        return _audio_run(audio, module, fused=True)
