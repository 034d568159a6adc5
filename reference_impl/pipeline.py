"""A tiny seeded text-to-image / text-to-video pipeline on the reference models.

prompt → Qwen3 text encoder → DiT denoising loop (flow-matching Euler, seeded noise) → ViT
VAE decode → uint8 RGB. Images use the Z-Image DiT (caption as replicated suffix); videos a
HunyuanVideo style DiT built from ``MMDoubleStreamBlock`` / ``MMSingleStreamBlock`` (text as
replicated suffix). Everything is plain data in and out (:class:`PipelineConfig` →
:class:`PipelineResult`), so a harness can run it on every rank of a process group: under
sequence parallelism each rank runs the whole pipeline, the DiT shards image tokens and
all-gathers its output, and rank 0's image is the result.

Weights are random, built from ``weights_seed`` (the text encoder may instead be loaded from
a transformers-layout directory): the pipeline exists to measure parity and speed, not to
draw. Same config on the same machine gives identical bytes.

``suffix_mode="rotate_to_front"`` reproduces sglang's old layout for the turbo-drift
experiment: under sequence parallelism the replicated caption is rotated to the front of
the attention's token order and passed as the replicated *prefix*. RoPE is applied before
the rotation, so positions are unchanged; only the order in which keys are scanned moves.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from reference_impl.attention.layer import LocalAttention, USPAttention
from reference_impl.forward_context import set_forward_context
from reference_impl.models.hunyuanvideo import HunyuanVideoBlockConfig, MMDoubleStreamBlock, MMSingleStreamBlock, hunyuan_rope
from reference_impl.models.layers import ModelConfig, even_shard_bounds
from reference_impl.models.minimax_vae import ViT3DDecoder, ViT3DDecoderConfig
from reference_impl.models.qwen3 import Qwen3EncoderConfig, Qwen3TextEncoder
from reference_impl.models.zimage import FinalLayer, TimestepEmbedder, ZImageConfig, ZImageDiT
from reference_impl.parallel import comm
from reference_impl.parallel.state import (
    destroy_sequence_parallel,
    get_ring_world_size,
    get_sp_rank,
    get_sp_world_size,
    get_ulysses_group,
    init_sequence_parallel,
)

Tensor = torch.Tensor

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SUFFIX_MODES = ("order_preserving", "rotate_to_front")

# Tiny sizes: a 32×32 image in 4 steps takes well under a second on one CPU core.
TEXT_ENCODER_TINY = dict(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8)
LATENT_CHANNELS = 4
VAE_TINY = ViT3DDecoderConfig(latent_channels=LATENT_CHANNELS, hidden_size=32, num_heads=2, num_layers=2, patch_size=(1, 4, 4))
DIT_PATCH = 2
ZIMAGE_TINY = dict(dim=64, num_heads=4, num_kv_heads=4, head_dim=16, ffn_hidden_dim=128, num_layers=2, axes_dims=(4, 6, 6),
                   in_channels=LATENT_CHANNELS, patch_size=DIT_PATCH, cap_feat_dim=32, adaln_embed_dim=32,
                   t_embed_mid_dim=64, t_freq_dim=32)
VIDEO_BLOCKS_TINY = HunyuanVideoBlockConfig(hidden_size=64, num_heads=4, mlp_ratio=2.0, rope_axes_dim=(4, 6, 6))
PIXELS_PER_DIT_TOKEN = VAE_TINY.patch_size[1] * DIT_PATCH  # along H and along W


@dataclass(frozen=True)
class PipelineConfig(ModelConfig):
    """One generation request; plain data, so it pickles to every rank.

    ``num_frames=None`` makes an image ``[H, W, 3]``; an int makes frames ``[T, H, W, 3]``.
    ``height``/``width`` must be multiples of 8 (VAE ×4, DiT patch 2); under SP the image
    token count ``(H/8)·(W/8)`` (per frame, times T for video) must divide by the SP degree.
    """

    prompt: str = "a red fox in fresh snow"
    seed: int = 0
    height: int = 32
    width: int = 32
    steps: int = 4
    num_frames: int | None = None
    dtype: str = "float32"
    suffix_mode: str = "order_preserving"
    flow_shift: float = 3.0
    weights_seed: int = 0
    text_encoder_dir: str | None = None
    max_text_tokens: int = 32
    device: str = "cpu"

    def validate(self) -> None:
        for key in ("height", "width"):
            value = getattr(self, key)
            if value <= 0 or value % PIXELS_PER_DIT_TOKEN:
                raise self.error(key, f"must be a positive multiple of {PIXELS_PER_DIT_TOKEN}, got {value}")
        for key in ("steps", "max_text_tokens"):
            if getattr(self, key) <= 0:
                raise self.error(key, f"must be positive, got {getattr(self, key)}")
        if self.num_frames is not None and self.num_frames <= 0:
            raise self.error("num_frames", f"must be positive (or None for an image), got {self.num_frames}")
        if self.dtype not in DTYPES:
            raise self.error("dtype", f"{self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.suffix_mode not in SUFFIX_MODES:
            raise self.error("suffix_mode", f"{self.suffix_mode!r} is not one of {', '.join(SUFFIX_MODES)}")
        if self.flow_shift <= 0:
            raise self.error("flow_shift", f"must be positive, got {self.flow_shift}")


@dataclass(frozen=True)
class StageTimings:
    """Milliseconds per stage; CUDA events on a GPU, ``perf_counter`` otherwise (``clock`` says which)."""

    text_encoding_ms: float
    denoising_ms: float
    denoise_step_ms: tuple[float, ...]
    decoding_ms: float
    e2e_ms: float
    clock: str

    @property
    def stages_ms(self) -> dict[str, float]:
        return {"text_encoding": self.text_encoding_ms, "denoising": self.denoising_ms, "decoding": self.decoding_ms}


@dataclass(frozen=True)
class PipelineResult:
    """``output``: uint8 RGB, ``[H, W, 3]`` for an image or ``[T, H, W, 3]`` for frames (host memory).

    ``latents``: the final fp32 latents the VAE decoded, for parity finer than 8-bit pixels.
    ``nonfinite``: how many NaN/Inf values the latents and the decoded frames held before the uint8
    conversion, which turns NaN into 0: a NaN run would otherwise look like a black image.
    """

    output: np.ndarray
    latents: np.ndarray
    timings: StageTimings
    config: PipelineConfig
    sp_world_size: int
    sp_rank: int
    backends: dict[str, str] = field(default_factory=dict)
    nonfinite: int = 0


# ---------------------------------------------------------------------------- the video DiT
class HunyuanStyleVideoDiT(nn.Module):
    """patch embed → double-stream blocks → single-stream blocks over [image | text] → final layer.

    The timestep embedder and final layer are Z-Image's (their config carries only the sizes
    they read). Under SP (Ulysses only) each rank keeps its contiguous image-token shard, the
    whole text rides as the replicated suffix, and the image output is all-gathered, so every
    rank returns the full prediction.
    """

    def __init__(self, blocks: HunyuanVideoBlockConfig, in_channels: int, text_dim: int, patch_size: int,
                 num_double: int = 1, num_single: int = 1) -> None:
        super().__init__()
        h = blocks.hidden_size
        self.blocks_config, self.in_channels, self.patch_size = blocks, in_channels, patch_size
        pieces = ZImageConfig(dim=h, adaln_embed_dim=h, t_embed_mid_dim=2 * h, t_freq_dim=32, patch_size=patch_size,
                              in_channels=in_channels)
        self.img_in = nn.Linear(in_channels * patch_size**2, h)
        self.txt_in = nn.Linear(text_dim, h)
        self.time_in = TimestepEmbedder(pieces)
        self.double_blocks = nn.ModuleList(MMDoubleStreamBlock(blocks) for _ in range(num_double))
        self.single_blocks = nn.ModuleList(MMSingleStreamBlock(blocks) for _ in range(num_single))
        self.final_layer = FinalLayer(pieces)

    def forward(self, latents: Tensor, timestep: float, text: Tensor) -> Tensor:
        """``latents [B, C, T, H, W]``, ``text [B, L, text_dim]`` → prediction in ``latents``' shape and dtype."""
        b, c, t, h, w = latents.shape
        p = self.patch_size
        world, rank = get_sp_world_size(), get_sp_rank()
        if world > 1 and get_ring_world_size() > 1:
            raise NotImplementedError("the video DiT shards image tokens over Ulysses only (ring degree must be 1)")
        dtype = self.img_in.weight.dtype
        tokens = latents.to(dtype).view(b, c, t, h // p, p, w // p, p).permute(0, 2, 3, 5, 4, 6, 1).reshape(b, -1, p * p * c)
        start, end = even_shard_bounds(tokens.shape[1], rank, world)
        img = self.img_in(tokens[:, start:end])
        txt = self.txt_in(text.to(dtype))
        vec = self.time_in(torch.full((b,), timestep, dtype=torch.float32, device=latents.device))
        rope = hunyuan_rope(self.blocks_config, (t, h // p, w // p), rank, world, latents.device)
        for block in self.double_blocks:
            img, txt = block(img, txt, vec, rope)
        x = torch.cat([img, txt], dim=1)
        for block in self.single_blocks:
            x = block(x, vec, txt.shape[1], rope)
        out = self.final_layer(x[:, : end - start], vec)
        if world > 1:
            out = comm.all_gather(out, dim=1, group=get_ulysses_group())
        out = out.view(b, t, h // p, w // p, p, p, c).permute(0, 6, 1, 2, 4, 3, 5)
        return out.reshape(b, c, t, h, w).to(latents.dtype)


# ---------------------------------------------------------------------------- sglang's old caption layout
class CaptionToFront(nn.Module):
    """Wraps a USPAttention: under SP, the replicated suffix is rotated to the front and passed as a prefix.

    This is sglang's behaviour before seed 001's fix; the single-rank path is untouched (there
    was no replicated path on one GPU), so only sequence-parallel runs drift.
    """

    def __init__(self, inner: USPAttention) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, q: Tensor, k: Tensor, v: Tensor, num_replicated_suffix: int = 0, num_replicated_prefix: int = 0,
                **kwargs: Any) -> Tensor:
        n = num_replicated_suffix
        if n == 0 or num_replicated_prefix or get_sp_world_size() == 1:
            return self.inner(q, k, v, num_replicated_suffix=n, num_replicated_prefix=num_replicated_prefix, **kwargs)
        front = [torch.cat([t[:, -n:], t[:, :-n]], dim=1) for t in (q, k, v)]
        out = self.inner(*front, num_replicated_prefix=n, **kwargs)
        return torch.cat([out[:, n:], out[:, :n]], dim=1)


def rotate_captions_to_front(model: nn.Module) -> int:
    """Wrap every USPAttention of ``model`` in :class:`CaptionToFront`; returns how many were wrapped."""
    targets = [(parent, name) for parent in model.modules() for name, child in parent.named_children()
               if isinstance(child, USPAttention)]
    for parent, name in targets:
        setattr(parent, name, CaptionToFront(getattr(parent, name)))
    return len(targets)


# ---------------------------------------------------------------------------- stages
def tokenize(prompt: str, vocab_size: int, max_tokens: int) -> Tensor:
    """Byte-level ids ``[1, L]``: a BOS id 1, then ``2 + byte`` (folded into the vocabulary), truncated."""
    ids = [1] + [2 + (b % (vocab_size - 2)) for b in prompt.encode("utf-8")]
    return torch.tensor([ids[:max_tokens]], dtype=torch.long)


def flow_sigmas(steps: int, shift: float) -> list[float]:
    """``steps + 1`` noise levels from 1 to 0, time-shifted as flow-matching schedulers do (fp64)."""
    s = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64)
    return (shift * s / (1 + (shift - 1) * s)).tolist()


# The config keys that decide which weights are built; a reused PipelineModels must agree on them.
MODEL_KEYS = ("dtype", "device", "suffix_mode", "weights_seed", "text_encoder_dir")


@dataclass
class PipelineModels:
    text_encoder: Qwen3TextEncoder
    dit: nn.Module
    vae: ViT3DDecoder
    built_for: PipelineConfig

    def check_serves(self, config: PipelineConfig) -> None:
        """Refuse a config these models were not built for, naming the key that differs."""
        for key in MODEL_KEYS:
            if getattr(config, key) != getattr(self.built_for, key):
                raise ValueError(f"models were built for {key}={getattr(self.built_for, key)!r}, config has {getattr(config, key)!r}")
        if (config.num_frames is None) != (self.built_for.num_frames is None):
            raise ValueError("num_frames: models built for an image cannot make a video, nor the reverse")


def _seeded(seed: int, build: Any) -> Any:
    """Build a module with its default init drawn from ``seed``, leaving the global RNG as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


def _init_text_encoder(encoder: Qwen3TextEncoder, seed: int) -> Qwen3TextEncoder:
    """Draw the encoder's weights from ``seed`` as transformers initialises Qwen3 (normal, std 0.02).

    Its linear layers are allocated for checkpoint loading and left uninitialised; norms start at one.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in encoder.named_parameters():
            if param.dim() >= 2:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.02)
            elif name.endswith("bias"):
                param.zero_()
    return encoder


def build_models(config: PipelineConfig) -> PipelineModels:
    """The three models on ``config.device`` in ``config.dtype``, weights from ``weights_seed`` (or the encoder dir)."""
    device, dtype = torch.device(config.device), DTYPES[config.dtype]
    s = config.weights_seed * 3
    if config.text_encoder_dir is not None:
        encoder = Qwen3TextEncoder.from_pretrained(config.text_encoder_dir, device=device, dtype=dtype)
    else:
        encoder = _init_text_encoder(Qwen3TextEncoder(Qwen3EncoderConfig(**TEXT_ENCODER_TINY), dtype=dtype), s)
    text_dim = encoder.config.hidden_size
    if config.num_frames is None:
        dit: nn.Module = _seeded(s + 1, lambda: ZImageDiT(ZImageConfig(**{**ZIMAGE_TINY, "cap_feat_dim": text_dim})))
    else:
        dit = _seeded(s + 1, lambda: HunyuanStyleVideoDiT(VIDEO_BLOCKS_TINY, LATENT_CHANNELS, text_dim, DIT_PATCH))
    if config.suffix_mode == "rotate_to_front":
        rotate_captions_to_front(dit)
    vae = _seeded(s + 2, lambda: ViT3DDecoder(VAE_TINY))
    return PipelineModels(encoder.to(device, dtype).eval(), dit.to(device, dtype).eval(), vae.to(device, dtype).eval(), config)


class _Clock:
    """Stage marks: CUDA events on a GPU (read once at the end, adding no syncs mid-run), else perf_counter."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.name = "cuda_events" if self.cuda else "perf_counter"

    def mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def ms(self, start: Any, end: Any) -> float:
        if self.cuda:
            end.synchronize()
            return float(start.elapsed_time(end))
        return (end - start) * 1000.0


def _to_uint8(frames: Tensor) -> np.ndarray:
    """``[3, T, H, W]`` in [-1, 1] → uint8 ``[T, H, W, 3]`` on the host."""
    pixels = ((frames.float().clamp(-1.0, 1.0) + 1.0) * 127.5).round().to(torch.uint8)
    return pixels.permute(1, 2, 3, 0).cpu().numpy()


def _backends(models: PipelineModels) -> dict[str, str]:
    """The attention backend each model was built with (what a report must name)."""
    found: dict[str, str] = {}
    for name, model in (("text_encoder", models.text_encoder), ("dit", models.dit)):
        kinds = sorted({m.backend.value for m in model.modules() if isinstance(m, (LocalAttention, USPAttention))})
        found[name] = ",".join(kinds)
    return found


def run_pipeline(config: PipelineConfig, models: PipelineModels | None = None) -> PipelineResult:
    """Generate one image or clip on this rank (SP degree: whatever ``reference_impl.parallel`` holds now).

    ``models`` lets a caller time several runs without rebuilding; building is not timed.
    """
    if models is None:
        models = build_models(config)
    models.check_serves(config)
    device, dtype = torch.device(config.device), DTYPES[config.dtype]
    clock = _Clock(device)
    frames = config.num_frames
    lat_h, lat_w = config.height // VAE_TINY.patch_size[1], config.width // VAE_TINY.patch_size[2]
    shape = (1, LATENT_CHANNELS, lat_h, lat_w) if frames is None else (1, LATENT_CHANNELS, frames, lat_h, lat_w)
    # Noise is drawn on the CPU so that every device and every rank starts from the same bytes.
    noise = torch.randn(shape, generator=torch.Generator().manual_seed(config.seed), dtype=torch.float32)
    ids = tokenize(config.prompt, models.text_encoder.config.vocab_size, config.max_text_tokens).to(device)
    sigmas = flow_sigmas(config.steps, config.flow_shift)

    with torch.inference_mode(), set_forward_context(current_timestep=0, attn_metadata=None):
        t_start = clock.mark()
        # Z-Image conditions on the second-to-last hidden state of its Qwen3 encoder.
        text = models.text_encoder(ids, output_hidden_states=True).hidden_states[-2]
        t_text = clock.mark()
        latents = noise.to(device)  # the scheduler state stays fp32; the DiT computes in its own dtype
        step_marks = [t_text]
        for i in range(config.steps):
            velocity = models.dit(latents, sigmas[i], text)
            latents = latents + (sigmas[i + 1] - sigmas[i]) * velocity.float()
            step_marks.append(clock.mark())
        video_latents = latents if frames is not None else latents.unsqueeze(2)
        decoded = models.vae.decode(video_latents.to(dtype))[0]
        output = _to_uint8(decoded)
        t_end = clock.mark()

    timings = StageTimings(
        text_encoding_ms=clock.ms(t_start, t_text),
        denoising_ms=clock.ms(t_text, step_marks[-1]),
        denoise_step_ms=tuple(clock.ms(a, b) for a, b in zip(step_marks, step_marks[1:])),
        decoding_ms=clock.ms(step_marks[-1], t_end),
        e2e_ms=clock.ms(t_start, t_end),
        clock=clock.name,
    )
    backends = _backends(models)
    backends["vae"] = ",".join(sorted({d or "" for d in models.vae.attention_dispatches()}))
    nonfinite = int((~torch.isfinite(latents)).sum()) + int((~torch.isfinite(decoded)).sum())  # after the clock: not timed
    return PipelineResult(output[0] if frames is None else output, latents.cpu().numpy(), timings, config, get_sp_world_size(),
                          get_sp_rank(), backends, nonfinite)


def run_pipeline_sequence_parallel(config: PipelineConfig) -> PipelineResult:
    """On every rank of the default process group: Ulysses degree = world size (ring 1), run, tear down.

    For callers that do not manage sequence parallelism themselves (a harness worker); rank 0's
    result is the output. Any SP state already set is replaced.
    """
    if not dist.is_initialized():
        raise RuntimeError("run_pipeline_sequence_parallel needs torch.distributed.init_process_group() first")
    init_sequence_parallel(dist.get_world_size(), 1)
    try:
        return run_pipeline(config)
    finally:
        destroy_sequence_parallel()
