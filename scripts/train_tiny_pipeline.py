"""Train the tiny pipeline's built-in checkpoint on scikit-image's sample photos (CPU, minutes).

    nice -n 10 .venv/bin/python scripts/train_tiny_pipeline.py            # writes reference_impl/weights/tiny-v1.*

Random weights draw colour noise, on which SSIM, CLIP and a triptych say nothing; trained, each
prompt of :data:`SUBJECTS` draws its photo. Views (square crops at 32×32 and 64×64, 3-frame pans) train
an autoencoder whose ViT decoder is the pipeline's (latents standardised, folded into its input
projection); then the DiTs learn flow matching through ``pipeline.velocity``, the sampler's own
function, and the checkpoint keeps their moving average. Seeded draws, seeded initialisation and a
fixed thread count give the same bytes on the same machine and torch. Recipe, figures: docs/models.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import skimage
import skimage.data
import torch
from skimage.transform import resize
from torch import nn

from reference_impl.forward_context import set_forward_context
from reference_impl.pipeline import LATENT_CHANNELS, VAE_TINY, PipelineConfig, build_models, encode_prompt, velocity
from reference_impl.weights import WEIGHTS_DIR, write_pipeline_weights

Tensor = torch.Tensor

#: prompt -> the scikit-image sample photo it draws.
SUBJECTS: dict[str, str] = {
    "an astronaut": "astronaut",
    "a cat": "chelsea",
    "a cup of coffee": "coffee",
    "a rocket at night": "rocket",
    "a cameraman": "camera",
    "a colour wheel": "colorwheel",
    "silver coins": "coins",
    "the scikit-image logo": "logo",
}
IMAGE_SIZES = (32, 64)
CLIP_FRAMES, CLIP_SIZE = 3, 32


@dataclass(frozen=True)
class TrainConfig:
    seed: int = 0
    threads: int = 1  # fixed, so reductions run in one order; one thread is also the fastest for ops this small
    crops: int = 4  # views per subject and size (the first is the whole centred square)
    min_crop: float = 0.85  # the other views cover this much of the square at least
    clips: int = 4  # panning clips per subject
    batch: int = 16
    ae_steps: int = 800
    ae_lr: float = 3e-3
    latent_noise: float = 0.2  # the decoder learns to decode latents this far off (relative), as a DiT draws them
    dit_steps: int = 3000
    dit_lr: float = 2e-3
    video_steps: int = 1500
    video_lr: float = 2e-3
    ema: float = 0.995  # the checkpoint holds the DiTs' exponential moving average


# ---------------------------------------------------------------------------- data
def photo(name: str) -> np.ndarray:
    """A scikit-image sample photo as float RGB in [0, 1] (grey replicated, alpha dropped)."""
    image = getattr(skimage.data, name)()
    image = np.stack([image] * 3, axis=-1) if image.ndim == 2 else image[..., :3]
    return image.astype(np.float64) / 255.0


def _square(image: np.ndarray, side: int, y: int, x: int, size: int) -> np.ndarray:
    return resize(image[y : y + side, x : x + side], (size, size), anti_aliasing=True)


def training_image(prompt: str, size: int) -> np.ndarray:
    """The first view of a prompt's subject: the photo's centred square at ``size``, uint8 ``[size, size, 3]``."""
    image = photo(SUBJECTS[prompt])
    h, w = image.shape[:2]
    side = min(h, w)
    return (_square(image, side, (h - side) // 2, (w - side) // 2, size) * 255).round().astype(np.uint8)


def image_views(prompt: str, size: int, count: int, min_crop: float, rng: np.random.Generator) -> np.ndarray:
    """``[count, size, size, 3]`` in [0, 1]: the centred square, then seeded crops of ``min_crop``-100 % of it."""
    image = photo(SUBJECTS[prompt])
    h, w = image.shape[:2]
    views = [training_image(prompt, size) / 255.0]
    for _ in range(count - 1):
        side = int(min(h, w) * rng.uniform(min_crop, 1.0))
        views.append(_square(image, side, int(rng.integers(0, h - side + 1)), int(rng.integers(0, w - side + 1)), size))
    return np.stack(views)


def clip_views(prompt: str, count: int, rng: np.random.Generator) -> np.ndarray:
    """``[count, T, s, s, 3]``: a square of 70 % of the photo panning sideways by a seeded step per frame."""
    image = photo(SUBJECTS[prompt])
    h, w = image.shape[:2]
    side = int(min(h, w) * 0.7)
    clips = []
    for _ in range(count):
        step = int(rng.integers(-(w - side) // (2 * CLIP_FRAMES), (w - side) // (2 * CLIP_FRAMES) + 1))
        x0 = int(
            rng.integers(max(0, -step * (CLIP_FRAMES - 1)), min(w - side, w - side - step * (CLIP_FRAMES - 1)) + 1)
        )
        y = int(rng.integers(0, h - side + 1))
        clips.append(np.stack([_square(image, side, y, x0 + step * f, CLIP_SIZE) for f in range(CLIP_FRAMES)]))
    return np.stack(clips)


@dataclass
class Views:
    """Training views as ``[-1, 1]`` tensors ``[N, 3, T, H, W]`` with one subject index each."""

    images: dict[int, Tensor]  # by size
    image_subject: Tensor
    clips: Tensor
    clip_subject: Tensor


def make_views(config: TrainConfig) -> Views:
    rng = np.random.default_rng(config.seed)
    prompts = list(SUBJECTS)

    def as_tensor(x: np.ndarray) -> Tensor:  # [..., T, H, W, 3] in [0, 1] -> [N, 3, T, H, W] in [-1, 1]
        return torch.tensor(x, dtype=torch.float32).movedim(-1, 1) * 2 - 1

    images = {
        s: as_tensor(np.concatenate([image_views(p, s, config.crops, config.min_crop, rng) for p in prompts])[:, None])
        for s in IMAGE_SIZES
    }
    clips = as_tensor(np.concatenate([clip_views(p, config.clips, rng) for p in prompts]))
    subjects = torch.arange(len(prompts))
    return Views(images, subjects.repeat_interleave(config.crops), clips, subjects.repeat_interleave(config.clips))


# ---------------------------------------------------------------------------- autoencoder
class Encoder(nn.Module):
    """Frames ``[B, 3, T, H, W]`` → latents ``[B, C, T, H/4, W/4]``, frame by frame (the decoder's inverse, training only)."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        p = VAE_TINY.patch_size[1]
        self.net = nn.Sequential(
            nn.Conv2d(3, width, p, p),
            nn.GELU(),
            nn.Conv2d(width, width, 1),
            nn.GELU(),
            nn.Conv2d(width, LATENT_CHANNELS, 1),
        )

    def forward(self, frames: Tensor) -> Tensor:
        b, _, t, h, w = frames.shape
        z = self.net(frames.transpose(1, 2).reshape(b * t, 3, h, w))
        return z.view(b, t, *z.shape[1:]).transpose(1, 2)


def _progress(name: str, step: int, steps: int, losses: list[float]) -> None:
    """One line per 100 steps (a full run takes minutes)."""
    if (step + 1) % 100 == 0 or step + 1 == steps:
        print(f"{name} {step + 1}/{steps}: loss {np.mean(losses[-100:]):.4f}", flush=True)


def _schedule(optimizer: torch.optim.Optimizer, lr: float, steps: int) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.OneCycleLR(optimizer, lr, total_steps=steps, pct_start=0.1)


def train_autoencoder(decoder: nn.Module, views: Views, config: TrainConfig, steps: int) -> tuple[Encoder, list[float]]:
    """Encoder + decoder on pixel MSE, the decoder fed latents with relative noise ``latent_noise`` (a 1e-4 latent L2
    keeps them bounded); returns the encoder and the losses."""
    gen = torch.Generator().manual_seed(config.seed + 1)
    encoder = Encoder()
    params = list(encoder.parameters()) + list(decoder.parameters())
    optimizer = torch.optim.AdamW(params, lr=config.ae_lr, weight_decay=0.0)
    schedule, losses = _schedule(optimizer, config.ae_lr, steps), []
    pools = [views.images[s] for s in IMAGE_SIZES] + [
        views.clips
    ]  # the 32×32 images, the 64×64 ones, the clips in turn
    with set_forward_context():
        for step in range(steps):
            pool = pools[step % len(pools)]
            x = pool[torch.randint(0, len(pool), (config.batch,), generator=gen)]
            z = encoder(x)
            noisy = z + config.latent_noise * z.detach().std() * torch.randn(z.shape, generator=gen)
            loss = (decoder(noisy) - x).pow(2).mean() + 1e-4 * z.pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            schedule.step()
            losses.append(loss.item())
            _progress("autoencoder", step, steps, losses)
    return encoder, losses


@torch.no_grad()
def standardise_latents(encoder: Encoder, decoder: nn.Module, views: Views) -> dict[str, Tensor]:
    """Per-channel mean/std of every view's latents, folded into ``decoder.proj_in`` (so it decodes standardised
    latents); returns the standardised latents of every pool."""
    pools = {f"image{s}": views.images[s] for s in IMAGE_SIZES} | {"clips": views.clips}
    raw = {k: encoder(v) for k, v in pools.items()}
    flat = torch.cat([z.movedim(1, -1).reshape(-1, LATENT_CHANNELS) for z in raw.values()])
    mean, std = flat.mean(0), flat.std(0)
    proj = decoder.proj_in  # proj(z·std + mean) = (W·diag(std)) z + (W·mean + b)
    proj.bias.add_(proj.weight @ mean)
    proj.weight.mul_(std)
    shape = (1, LATENT_CHANNELS, 1, 1, 1)
    return {k: (z - mean.view(shape)) / std.view(shape) for k, z in raw.items()}


@torch.no_grad()
def reconstruction_psnr(decoder: nn.Module, latents: Tensor, frames: Tensor) -> float:
    """PSNR (dB, 8-bit range) of the decoded standardised latents against the views."""
    with set_forward_context():
        mse = (decoder(latents).clamp(-1, 1) - frames).pow(2).mean().item()
    return float(10 * np.log10(4.0 / mse))


# ---------------------------------------------------------------------------- DiTs
def flow_loss(dit: nn.Module, x0: Tensor, texts: list[Tensor], noise: Tensor, sigma: Tensor) -> Tensor:
    """MSE between the DiT's velocity at ``(1 - sigma)·x0 + sigma·noise`` and ``noise - x0`` (``sigma [B]``, fp64)."""
    s = sigma.float().view(-1, *[1] * (x0.dim() - 1))
    return (velocity(dit, (1 - s) * x0 + s * noise, sigma, texts) - (noise - x0)).pow(2).mean()


def _image_or_clip(x: Tensor, video: bool) -> Tensor:
    """Z-Image takes ``[B, C, H, W]`` latents, HunyuanVideo ``[B, C, T, H, W]``."""
    return x if video else x[:, :, 0]


def eval_flow_loss(
    dit: nn.Module, pools: list[tuple[Tensor, Tensor]], captions: list[Tensor], seed: int, video: bool
) -> float:
    """The flow loss over every latent at 8 fixed noise levels with fixed noise: a deterministic yardstick."""
    gen, total, count = torch.Generator().manual_seed(seed), 0.0, 0
    with torch.no_grad(), set_forward_context():
        for latents, subject in pools:
            x0 = _image_or_clip(latents, video)
            for sigma in torch.linspace(0.05, 0.95, 8, dtype=torch.float64):
                noise = torch.randn(x0.shape, generator=gen)
                total += flow_loss(dit, x0, [captions[i] for i in subject], noise, sigma.expand(len(x0))).item() * len(
                    x0
                )
                count += len(x0)
    return total / count


def train_dit(
    dit: nn.Module,
    pools: list[tuple[Tensor, Tensor]],
    captions: list[Tensor],
    steps: int,
    lr: float,
    config: TrainConfig,
    video: bool,
) -> list[float]:
    """AdamW on the flow loss (sigma uniform in [0, 1), rectified flow's choice), the pools in turn, a seeded batch
    each step; leaves the DiT holding the moving average of its weights; returns the losses."""
    gen = torch.Generator().manual_seed(config.seed + (3 if video else 2))
    params = list(dit.parameters())
    average = [p.detach().clone() for p in params]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    schedule, losses = _schedule(optimizer, lr, steps), []
    with set_forward_context():
        for step in range(steps):
            latents, subject = pools[step % len(pools)]
            pick = torch.randint(0, len(latents), (config.batch,), generator=gen)
            x0 = _image_or_clip(latents[pick], video)
            noise, sigma = (
                torch.randn(x0.shape, generator=gen),
                torch.rand(config.batch, generator=gen, dtype=torch.float64),
            )
            loss = flow_loss(dit, x0, [captions[i] for i in subject[pick]], noise, sigma)
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            schedule.step()
            torch._foreach_lerp_(average, [p.detach() for p in params], 1.0 - config.ema)
            losses.append(loss.item())
            _progress("hunyuan" if video else "zimage", step, steps, losses)
    with torch.no_grad():
        for p, a in zip(params, average):
            p.copy_(a)
    return losses


# ---------------------------------------------------------------------------- the run
def _summary(losses: list[float]) -> dict[str, float]:
    """First and last 20-step means of a loss curve (single steps are noisy)."""
    return {"first_20_mean": float(np.mean(losses[:20])), "last_20_mean": float(np.mean(losses[-20:]))}


@contextmanager
def _deterministic(config: TrainConfig) -> Iterator[None]:
    """Seeded global RNG, fixed threads, deterministic kernels; all restored after (a test trains in-process)."""
    threads, strict = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        torch.set_num_threads(config.threads)
        torch.use_deterministic_algorithms(True)
        try:
            yield
        finally:
            torch.set_num_threads(threads)
            torch.use_deterministic_algorithms(strict)


def train(config: TrainConfig, out: Path) -> dict[str, Any]:
    """The whole run: views, autoencoder, both DiTs; writes the checkpoint and returns its card."""
    with _deterministic(config):
        return _train(config, out)


def _train(config: TrainConfig, out: Path) -> dict[str, Any]:
    image, video = build_models(PipelineConfig()), build_models(PipelineConfig(num_frames=CLIP_FRAMES))
    clocks, cpu_start = {"start": time.perf_counter()}, time.process_time()
    views = make_views(config)
    decoder = image.vae.train()
    encoder, ae_losses = train_autoencoder(decoder, views, config, config.ae_steps)
    latents = standardise_latents(encoder, decoder.eval(), views)
    clocks["autoencoder"] = time.perf_counter()
    with torch.no_grad(), set_forward_context():
        captions = [encode_prompt(image.text_encoder, p, PipelineConfig().max_text_tokens) for p in SUBJECTS]
    image_pools = [(latents[f"image{s}"], views.image_subject) for s in IMAGE_SIZES]
    clip_pools = [(latents["clips"], views.clip_subject)]
    runs: dict[str, Any] = {}
    for name, dit, pools, steps, lr, is_video in (
        ("zimage", image.dit, image_pools, config.dit_steps, config.dit_lr, False),
        ("hunyuan", video.dit, clip_pools, config.video_steps, config.video_lr, True),
    ):
        before = eval_flow_loss(dit, pools, captions, config.seed, is_video)
        curve = train_dit(dit.train(), pools, captions, steps, lr, config, is_video)
        after = eval_flow_loss(dit.eval(), pools, captions, config.seed, is_video)
        runs[name] = {
            "steps": steps,
            "eval_flow_loss_initial": before,
            "eval_flow_loss_final": after,
            **_summary(curve),
        }
        clocks[name] = time.perf_counter()
    psnr = {f"image{s}": reconstruction_psnr(decoder, latents[f"image{s}"], views.images[s]) for s in IMAGE_SIZES}
    psnr["clips"] = reconstruction_psnr(decoder, latents["clips"], views.clips)
    card = {
        "subjects": SUBJECTS,
        "training": dataclasses.asdict(config),
        "losses": {
            "autoencoder": {"steps": config.ae_steps, **_summary(ae_losses), "reconstruction_psnr_db": psnr},
            **runs,
        },
        "wall_s": {
            "autoencoder": round(clocks["autoencoder"] - clocks["start"], 1),
            "zimage": round(clocks["zimage"] - clocks["autoencoder"], 1),
            "hunyuan": round(clocks["hunyuan"] - clocks["zimage"], 1),
        },
        "cpu_s": round(time.process_time() - cpu_start, 1),  # wall time also counts what else this machine ran
        "versions": {"torch": torch.__version__, "scikit-image": skimage.__version__},
    }
    models = {"text_encoder": image.text_encoder, "vae": decoder, "zimage": image.dit, "hunyuan": video.dit}
    card["sha256"] = write_pipeline_weights(out, models, card)
    return card


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", type=Path, default=WEIGHTS_DIR / "tiny-v1.safetensors", help="checkpoint path (.safetensors)"
    )
    for field in dataclasses.fields(TrainConfig):
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=type(field.default), default=field.default)
    args = vars(parser.parse_args())
    out = args.pop("out")
    card = train(TrainConfig(**args), out)
    print(f"wrote {out} (sha256 {card['sha256']}); wall s {card['wall_s']}, cpu s {card['cpu_s']}")
    for name, figures in card["losses"].items():
        print(f"  {name}: {figures}")


if __name__ == "__main__":
    main()
