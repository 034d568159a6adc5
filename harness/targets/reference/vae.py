"""Checks for the MiniMax-H3 style VAE attention contracts (``vae.audio_fp32_restored``, ``vae.video_dispatch``).

Both run in one process and force platforms through ``PARITY_PLATFORM`` (which the
reference implementation reads at construction and call time), so every branch runs on a
CPU-only machine: on a simulated platform the tensors stay on the real device and the
USP path runs the platform's default backend there (TORCH_SDPA when FlashAttention is not
installed). Each check returns a dict of figures with ``passed``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from reference_impl.attention.backends import AttentionBackendEnum
from reference_impl.attention.selector import attention_backend_config
from reference_impl.forward_context import set_forward_context
from reference_impl.models.minimax_vae import Attention, CausalAttention
from reference_impl.platform import PLATFORM_ENV

Tensor = torch.Tensor

DISPATCH_PLATFORMS = ("cpu", "mps", "cuda", "rocm:gfx950", "rocm:gfx942")
DISPATCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# Which branch each (platform, dtype) must take; "usp" matches "usp:<backend>".
EXPECTED_DISPATCH = {
    (p, d): ("usp" if p == "cuda" and d != "fp32" else "sdpa-math" if p == "rocm:gfx950" else "sdpa")
    for p in DISPATCH_PLATFORMS
    for d in DISPATCH_DTYPES
}
# Max abs difference allowed between any two branches of one dtype. fp32: accumulation-order
# noise of different SDPA kernels; bf16: one bf16 rounding step of O(1) outputs (2^-7 = 7.8e-3).
CROSS_BRANCH_BOUND = {"fp32": 1e-5, "bf16": 1e-2}


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


def video_dispatch(device: str = "cpu", seed: int = 0, tokens: int = 64, heads: int = 2, dim_head: int = 32) -> dict[str, Any]:
    """Which branch the video VAE attention takes per (platform, dtype), and do the branches agree?

    Figures: ``table[platform][dtype]`` = the ``last_dispatch`` seen; ``mismatches`` against
    EXPECTED_DISPATCH; per dtype the max abs difference between every branch and the first
    (cpu) one and against an fp64 run of the same weights. NaN/Inf never pass.
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
    mismatches = [
        f"{p}/{d}: expected {want}, ran {table[p][d]}"
        for (p, d), want in EXPECTED_DISPATCH.items()
        if not (table[p][d] or "").split(":")[0] == want
    ]
    agreement: dict[str, dict[str, float | bool]] = {}
    for dname, outs in outputs.items():
        first = outs[DISPATCH_PLATFORMS[0]]
        vs_cpu = {platform: _max_abs(out, first) for platform, out in outs.items()}
        cross = max(vs_cpu.values())
        agreement[dname] = {
            "max_abs_vs_cpu_branch": vs_cpu,
            "max_abs_between_branches": cross,
            "max_abs_vs_fp64": max(_max_abs(out, ref64) for out in outs.values()),
            "bound": CROSS_BRANCH_BOUND[dname],
            "finite": all(bool(torch.isfinite(out).all()) for out in outs.values()),
            "within_bound": cross <= CROSS_BRANCH_BOUND[dname],
        }
    passed = not mismatches and all(a["finite"] and a["within_bound"] for a in agreement.values())
    return {"passed": passed, "table": table, "mismatches": mismatches, "agreement": agreement}


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


def audio_fp32_restored(device: str = "cpu", seed: int = 0, tokens: int = 48, dim: int = 64, heads: int = 4) -> dict[str, Any]:
    """The audio VAE attention keeps fp32 in → fp32 out: by default, and when a fused backend runs.

    On the CUDA platform (simulated on a CPU machine):

    - ``default``: the layer picks TORCH_SDPA, no cast happens (the attention sees fp32),
      and the output equals the direct causal SDPA of the non-CUDA path (``bitwise``).
    - ``fa``: ``audio_vae=fa`` either runs (flash-attn installed: fp32 out, attention at the
      backend dtype) or is refused at construction with a reason naming the package. A
      silent fallback to SDPA would fail this check.
    - ``cast_restore``: the cast-and-restore path itself, with a backend that runs
      everywhere. FA is the only fused backend in the released supported set and it is not
      installed on CPU machines, so the supported set is widened to {MATH, TORCH_SDPA} and
      ``audio_vae=math`` is built at a bf16 compute dtype: the attention must see bf16 q/k/v,
      the caller must get fp32 back, and the result must differ from the fp32 path by no more
      than bf16 rounding (``bound``). This proves the layer's cast logic, not FA's numerics.
    """
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
        direct_dispatch = template.last_dispatch

    # One bf16 rounding step of the attention output, scaled by the output's magnitude.
    bound = 2.0**-7 * max(1.0, direct.abs().max().item())
    with forced_platform("cuda"):
        default = _copy_of(template, lambda: CausalAttention(dim, dim, heads)).to(dev)
        out, seen = _attention_dtypes(default, x)
        default_fig = {
            "dispatch": default.last_dispatch,
            "attention_dtypes": [str(d) for d in seen],
            "out_dtype": str(out.dtype),
            "bitwise_vs_direct_sdpa": bool(torch.equal(out, direct)),
            "direct_dispatch": direct_dispatch,
        }
        default_ok = (
            default.last_dispatch == f"usp:{AttentionBackendEnum.TORCH_SDPA.value}"
            and seen == [torch.float32, torch.float32]
            and out.dtype == torch.float32
            and default_fig["bitwise_vs_direct_sdpa"]
        )

        fa_fig: dict[str, Any]
        try:
            with attention_backend_config("audio_vae=fa"):
                fa = _copy_of(template, lambda: CausalAttention(dim, dim, heads)).to(dev)
        except ValueError as exc:
            fa_fig = {"ran": False, "refused": str(exc)}
            fa_ok = "flash-attn" in str(exc)
        else:
            out_fa, seen_fa = _attention_dtypes(fa, x)
            fa_fig = {
                "ran": True,
                "dispatch": fa.last_dispatch,
                "attention_dtypes": [str(d) for d in seen_fa],
                "out_dtype": str(out_fa.dtype),
                "max_abs_vs_fp32": _max_abs(out_fa, direct),
            }
            fa_ok = (
                out_fa.dtype == torch.float32
                and seen_fa[0] == fa.attn.dtype
                and bool(torch.isfinite(out_fa).all())
                and fa_fig["max_abs_vs_fp32"] <= bound
            )

        with attention_backend_config("audio_vae=math"):
            fused = _copy_of(
                template,
                lambda: CausalAttention(
                    dim, dim, heads,
                    supported_attention_backends={AttentionBackendEnum.MATH, AttentionBackendEnum.TORCH_SDPA},
                    dtype=torch.bfloat16,
                ),
            ).to(dev)
        out_c, seen_c = _attention_dtypes(fused, x)
        cast_fig = {
            "dispatch": fused.last_dispatch,
            "attention_dtypes": [str(d) for d in seen_c],
            "out_dtype": str(out_c.dtype),
            "max_abs_vs_fp32": _max_abs(out_c, direct),
            "bound": bound,
        }
        cast_ok = (
            seen_c == [torch.bfloat16, torch.bfloat16]
            and out_c.dtype == torch.float32
            and 0.0 < cast_fig["max_abs_vs_fp32"] <= bound
        )
    return {
        "passed": bool(default_ok and fa_ok and cast_ok),
        "default": default_fig,
        "fa": fa_fig,
        "cast_restore": cast_fig,
    }
