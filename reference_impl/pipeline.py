"""A tiny seeded text-to-image / text-to-video pipeline on the reference models.

prompt → Qwen3 text encoder → DiT denoising (flow-matching Euler, seeded noise) → ViT VAE → uint8
RGB; images on the Z-Image transformer, videos on HunyuanVideo's, each called as its diffusers
pipeline calls it. Plain data in and out (:class:`PipelineConfig` → :class:`PipelineResult`), so
every rank of a group runs the whole pipeline and, under sequence parallelism, the DiT shards the
image tokens; rank 0's image is the result. Weights: the trained ``weights="tiny-v1"``
(:mod:`reference_impl.weights`) or random from ``weights_seed``; the same config on the same
machine gives the same bytes. ``suffix_mode="rotate_to_front"`` reproduces sglang's old layout for
the turbo-drift check: the replicated caption becomes the prefix, RoPE applied before the rotation.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from reference_impl.attention.layer import LocalAttention, USPAttention
from reference_impl.forward_context import set_forward_context
from reference_impl.models.hunyuanvideo_transformer import HunyuanVideoConfig, HunyuanVideoTransformer
from reference_impl.models.layers import ModelConfig, build_and_load
from reference_impl.models.minimax_vae import ViT3DDecoder, ViT3DDecoderConfig
from reference_impl.models.qwen3 import Qwen3EncoderConfig, Qwen3TextEncoder
from reference_impl.models.zimage import ZImageConfig
from reference_impl.models.zimage_transformer import ZImageTransformer
from reference_impl.parallel.state import (
    destroy_sequence_parallel,
    get_sp_rank,
    get_sp_world_size,
    init_sequence_parallel,
)
from reference_impl.weights import WEIGHTS_DIR, read_pipeline_weights, weights_path

Tensor = torch.Tensor

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SUFFIX_MODES = ("order_preserving", "rotate_to_front")

# Tiny sizes: a 32×32 image in 4 steps takes well under a second on one CPU core.
TEXT_ENCODER_TINY = dict(
    vocab_size=320,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
)
LATENT_CHANNELS = 4
VAE_TINY = ViT3DDecoderConfig(
    latent_channels=LATENT_CHANNELS, hidden_size=32, num_heads=2, num_layers=2, patch_size=(1, 4, 4)
)
DIT_PATCH = 2
# diffusers config keys; cap_feat_dim / text_embed_dim / pooled_projection_dim follow the text encoder.
ZIMAGE_TINY = dict(
    all_patch_size=[DIT_PATCH],
    all_f_patch_size=[1],
    in_channels=LATENT_CHANNELS,
    dim=64,
    n_layers=2,
    n_refiner_layers=2,
    n_heads=4,
    n_kv_heads=4,
    axes_dims=[4, 6, 6],
    axes_lens=[1024, 64, 64],
)
HUNYUAN_TINY = dict(
    in_channels=LATENT_CHANNELS,
    out_channels=LATENT_CHANNELS,
    num_attention_heads=4,
    attention_head_dim=16,
    num_layers=1,
    num_single_layers=1,
    num_refiner_layers=1,
    mlp_ratio=2.0,
    patch_size=DIT_PATCH,
    patch_size_t=1,
    rope_axes_dim=[4, 6, 6],
    guidance_embeds=True,
)
GUIDANCE = 6.0  # HunyuanVideo's default guidance scale, embedded (×1000) by the guidance-distilled transformer
PIXELS_PER_DIT_TOKEN = VAE_TINY.patch_size[1] * DIT_PATCH  # along H and along W


@dataclass(frozen=True)
class PipelineConfig(ModelConfig):
    """One generation request; plain data, so it pickles to every rank.

    ``num_frames=None`` makes an image ``[H, W, 3]``; an int makes frames ``[T, H, W, 3]``.
    ``height``/``width`` must be multiples of 8 (VAE ×4, DiT patch 2). Under SP, an image's
    tokens are padded to a multiple of 32 (any degree dividing 32 shards them); a video's
    ``T·(H/8)·(W/8)`` tokens must divide by the SP degree. ``weights``: a checkpoint name or
    ``.safetensors`` path (see :mod:`reference_impl.weights`); None draws random weights from
    ``weights_seed``.
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
    weights: str | None = None
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
        if self.text_encoder_dir is not None and not os.path.isfile(os.path.join(self.text_encoder_dir, "config.json")):
            raise self.error(
                "text_encoder_dir",
                f"{self.text_encoder_dir!r}: not a transformers model directory (no config.json in it)",
            )  # found now, not after the ranks started
        if self.weights is not None:
            if self.text_encoder_dir is not None:
                raise self.error(
                    "text_encoder_dir", "a checkpoint (weights) brings the text encoder its DiT was trained on"
                )
            try:
                path = weights_path(self.weights)
            except ValueError as exc:
                raise self.error("weights", str(exc)) from None
            if not path.is_file():  # found now, not after the case's ranks started
                known = ", ".join(sorted(p.stem for p in WEIGHTS_DIR.glob("*.safetensors"))) or "none"
                raise self.error("weights", f"{self.weights!r}: no such checkpoint ({path}); built in: {known}")


@dataclass(frozen=True)
class StageTimings:
    """Milliseconds per stage: CUDA events on a GPU, ``perf_counter`` otherwise (``clock`` says which); the
    end-to-end time is always the host's wall clock, from the call to the pixels in host memory (on the
    CPU the stage marks are that clock, so the stages add up to it exactly)."""

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


# ---------------------------------------------------------------------------- sglang's old caption layout
class CaptionToFront(nn.Module):
    """Wraps a USPAttention: under SP, the replicated suffix is rotated to the front and passed as a prefix.

    This is sglang's behaviour before seed 001's fix; the single-rank path is untouched (there
    was no replicated path on one GPU), so only sequence-parallel runs drift.
    """

    def __init__(self, inner: USPAttention) -> None:
        super().__init__()
        self.inner = inner

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        num_replicated_suffix: int = 0,
        num_replicated_prefix: int = 0,
        **kwargs: Any,
    ) -> Tensor:
        n = num_replicated_suffix
        if n == 0 or num_replicated_prefix or get_sp_world_size() == 1:
            return self.inner(q, k, v, num_replicated_suffix=n, num_replicated_prefix=num_replicated_prefix, **kwargs)
        front = [torch.cat([t[:, -n:], t[:, :-n]], dim=1) for t in (q, k, v)]
        out = self.inner(*front, num_replicated_prefix=n, **kwargs)
        return torch.cat([out[:, n:], out[:, :n]], dim=1)


def rotate_captions_to_front(model: nn.Module) -> int:
    """Wrap every USPAttention of ``model`` in :class:`CaptionToFront`; returns how many were wrapped."""
    targets = [
        (parent, name)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, USPAttention)
    ]
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
MODEL_KEYS = ("dtype", "device", "suffix_mode", "weights", "weights_seed", "text_encoder_dir")


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
                raise ValueError(
                    f"models were built for {key}={getattr(self.built_for, key)!r}, config has {getattr(config, key)!r}"
                )
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
    """The three models on ``config.device`` in ``config.dtype``: from the checkpoint ``weights`` names, else
    drawn from ``weights_seed`` (the text encoder possibly from ``text_encoder_dir``)."""
    device, dtype = torch.device(config.device), DTYPES[config.dtype]
    checkpoint = read_pipeline_weights(config.weights) if config.weights is not None else None
    s = config.weights_seed * 3

    def build(part: str, make: Any, seed: int) -> Any:
        if checkpoint is None:
            return _seeded(seed, make)
        return build_and_load(make, checkpoint.part(part), dtype, device)

    if config.text_encoder_dir is not None:
        encoder = Qwen3TextEncoder.from_pretrained(config.text_encoder_dir, device=device, dtype=dtype)
    elif checkpoint is not None:
        encoder = build(
            "text_encoder", lambda: Qwen3TextEncoder(Qwen3EncoderConfig(**TEXT_ENCODER_TINY), dtype=dtype), s
        )
    else:
        encoder = _init_text_encoder(Qwen3TextEncoder(Qwen3EncoderConfig(**TEXT_ENCODER_TINY), dtype=dtype), s)
    text_dim = encoder.config.hidden_size
    if config.num_frames is None:
        dit: nn.Module = build(
            "zimage",
            lambda: ZImageTransformer(
                ZImageConfig.from_dict({**ZIMAGE_TINY, "cap_feat_dim": text_dim}), compute_dtype=dtype
            ),
            s + 1,
        )
    else:
        video = HunyuanVideoConfig.from_dict(
            {**HUNYUAN_TINY, "text_embed_dim": text_dim, "pooled_projection_dim": text_dim}
        )
        dit = build("hunyuan", lambda: HunyuanVideoTransformer(video, compute_dtype=dtype), s + 1)
    if config.suffix_mode == "rotate_to_front":
        rotate_captions_to_front(dit)
    vae = build("vae", lambda: ViT3DDecoder(VAE_TINY), s + 2)
    return PipelineModels(
        encoder.to(device, dtype).eval(), dit.to(device, dtype).eval(), vae.to(device, dtype).eval(), config
    )


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


def encode_prompt(encoder: Qwen3TextEncoder, prompt: str, max_tokens: int) -> Tensor:
    """The caption features ``[L, D]`` the DiT conditions on: Z-Image's choice, the second-to-last hidden state."""
    ids = tokenize(prompt, encoder.config.vocab_size, max_tokens).to(encoder.embed_tokens.weight.device)
    return encoder(ids, output_hidden_states=True).hidden_states[-2][0]


def velocity(dit: nn.Module, latents: Tensor, sigma: float | Tensor, texts: list[Tensor]) -> Tensor:
    """The DiT's flow-matching velocity ``d latents / d sigma`` (= ``noise - x0`` on the path
    ``(1 - sigma)·x0 + sigma·noise``) at noise level ``sigma`` (one, or one per item), one caption
    ``[L_i, D]`` per item, the DiT called as its diffusers pipeline calls it.

    ZImagePipeline passes ``t = 1 - sigma`` and negates the prediction; HunyuanVideoPipeline
    passes ``t = 1000·sigma``, the text mask, a pooled text vector (CLIP's there; the mean of
    the valid text here, the tiny pipeline having one encoder) and the guidance scale ×1000.
    """
    b, device = latents.shape[0], latents.device
    if isinstance(dit, ZImageTransformer):
        pred = dit(list(latents.unsqueeze(2).unbind(0)), _per_item(sigma, b, device, lambda s: 1.0 - s), texts)
        return -torch.stack(pred).squeeze(2)
    text = torch.nn.utils.rnn.pad_sequence(texts, batch_first=True)
    mask = torch.nn.utils.rnn.pad_sequence(
        [torch.ones(t.shape[0], dtype=torch.long, device=device) for t in texts], batch_first=True
    )
    pooled = torch.stack([t.mean(dim=0) for t in texts])
    return dit(
        latents,
        _per_item(sigma, b, device, lambda s: 1000.0 * s),
        text,
        mask,
        pooled,
        torch.full((b,), 1000.0 * GUIDANCE, device=device),
    )


def _per_item(sigma: float | Tensor, b: int, device: torch.device, of: Callable[[Any], Any]) -> Tensor:
    """``of(sigma)`` per item as fp32 ``[B]`` on ``device``, computed in float64 first (as the pipelines do).

    A float is filled on the device: a host tensor copied there would wait for the device every
    step (a blocking copy), and the step is what the perf stage times."""
    if isinstance(sigma, Tensor):
        return of(sigma.to(torch.float64).expand(b)).float().to(device)
    return torch.full((b,), of(float(sigma)), dtype=torch.float32, device=device)


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
    sigmas = flow_sigmas(config.steps, config.flow_shift)

    with torch.inference_mode(), set_forward_context(current_timestep=0, attn_metadata=None):
        wall_start = time.perf_counter()
        t_start = clock.mark()
        text = [encode_prompt(models.text_encoder, config.prompt, config.max_text_tokens)]
        t_text = clock.mark()
        latents = noise.to(device)  # the scheduler state stays fp32; the DiT computes in its own dtype
        step_marks = [t_text]
        for i in range(config.steps):
            v = velocity(models.dit, latents, sigmas[i], text)
            latents = latents + (sigmas[i + 1] - sigmas[i]) * v.float()
            step_marks.append(clock.mark())
        video_latents = latents if frames is not None else latents.unsqueeze(2)
        decoded = models.vae.decode(video_latents.to(dtype))[0]
        output = _to_uint8(decoded)  # a copy to the host: the device has finished every kernel of the run
        t_end = clock.mark()
        e2e_ms = (time.perf_counter() - wall_start) * 1000.0 if clock.cuda else clock.ms(t_start, t_end)

    timings = StageTimings(
        text_encoding_ms=clock.ms(t_start, t_text),
        denoising_ms=clock.ms(t_text, step_marks[-1]),
        denoise_step_ms=tuple(clock.ms(a, b) for a, b in zip(step_marks, step_marks[1:])),
        decoding_ms=clock.ms(step_marks[-1], t_end),
        e2e_ms=e2e_ms,
        clock=clock.name,
    )
    backends = _backends(models)
    backends["vae"] = ",".join(sorted({d or "" for d in models.vae.attention_dispatches()}))
    nonfinite = int((~torch.isfinite(latents)).sum()) + int(
        (~torch.isfinite(decoded)).sum()
    )  # after the clock: not timed
    return PipelineResult(
        output[0] if frames is None else output,
        latents.cpu().numpy(),
        timings,
        config,
        get_sp_world_size(),
        get_sp_rank(),
        backends,
        nonfinite,
    )


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
