"""Image and video similarity metrics, computed exactly as sglang's diffusion CI computes them.

Images are ``HxWx3`` uint8, videos ``TxHxWx3``; reference and candidate must match in shape and
dtype (a ValueError, never a resize: a resized comparison measures the resizer). :func:`psnr` and
:func:`ssim` are scikit-image's with ``data_range=255`` (SSIM with ``channel_axis=2``),
:func:`mean_abs_diff` is in 0..255 in float64, :class:`ClipScorer` the cosine of CLIP image
features. Identical images have PSNR ``inf``, written ``"inf"`` in JSON (:func:`metric_to_json`),
where ``null`` means skipped. A video's metrics are per-frame means, an identical frame counting as
the PSNR of one level of difference, so one identical conditioning frame cannot hide broken ones.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from skimage.metrics import peak_signal_noise_ratio, structural_similarity

from harness.errors import ConfigError

if TYPE_CHECKING:
    import torch

__all__ = [
    "DATA_RANGE",
    "CLIP_ENV",
    "PSNR_INF_JSON",
    "psnr",
    "ssim",
    "mean_abs_diff",
    "metric_to_json",
    "metric_from_json",
    "ClipScorer",
    "resolve_clip_model",
    "load_clip_scorer",
]

DATA_RANGE = 255
CLIP_ENV = "PARITY_CLIP_MODEL"
PSNR_INF_JSON = "inf"


def _check_uint8_rgb(array: Any, what: str) -> np.ndarray:
    array = np.asarray(array)
    if array.dtype != np.uint8 or array.ndim not in (3, 4) or array.shape[-1] != 3 or 0 in array.shape:
        raise ValueError(
            f"{what} must be uint8 HxWx3 (image) or TxHxWx3 (video), got shape {array.shape} ({array.dtype})"
        )
    return array


def _as_pair(ref: Any, cand: Any) -> tuple[np.ndarray, np.ndarray]:
    """Validate a reference/candidate pair and return it as frame stacks ``[T,H,W,3]``."""
    ref, cand = np.asarray(ref), np.asarray(cand)
    if ref.shape != cand.shape or ref.dtype != cand.dtype:
        raise ValueError(
            f"reference shape {ref.shape} ({ref.dtype}) and candidate shape {cand.shape} ({cand.dtype}) differ"
        )
    ref = _check_uint8_rgb(ref, "reference")
    return (ref[None], cand[None]) if ref.ndim == 3 else (ref, cand)


def _psnr_frame(ref: np.ndarray, cand: np.ndarray) -> float:
    # skimage would divide by zero (with a RuntimeWarning) on identical frames; the answer is inf.
    if np.array_equal(ref, cand):
        return math.inf
    return float(peak_signal_noise_ratio(ref, cand, data_range=DATA_RANGE))


def psnr(ref: Any, cand: Any) -> float:
    """PSNR in dB (``inf`` for identical input); videos: per-frame mean, see the module docstring."""
    refs, cands = _as_pair(ref, cand)
    values = [_psnr_frame(r, c) for r, c in zip(refs, cands)]
    if all(math.isinf(v) for v in values):
        return math.inf
    finite_cap = 10.0 * math.log10(DATA_RANGE**2 * refs[0].size)
    return float(np.mean([finite_cap if math.isinf(v) else v for v in values]))


def ssim(ref: Any, cand: Any) -> float:
    """SSIM in [-1, 1] (1 = identical); videos: mean of per-frame SSIM."""
    refs, cands = _as_pair(ref, cand)
    return float(
        np.mean([structural_similarity(r, c, channel_axis=2, data_range=DATA_RANGE) for r, c in zip(refs, cands)])
    )


def mean_abs_diff(ref: Any, cand: Any) -> float:
    """Mean absolute difference in 0..255 units, in float64 (uint8 subtraction would wrap);
    videos: mean of per-frame values (equal to the mean over all pixels, frames being equal size)."""
    refs, cands = _as_pair(ref, cand)
    return float(np.mean([np.abs(r.astype(np.float64) - c.astype(np.float64)).mean() for r, c in zip(refs, cands)]))


def metric_to_json(value: float | None) -> float | str | None:
    """JSON form of a metric value: None (skipped) -> null, inf -> "inf", finite -> number."""
    if value is None:
        return None
    if math.isnan(value):
        raise ValueError("a NaN metric cannot be recorded: it would neither pass nor fail honestly")
    if value == math.inf:
        return PSNR_INF_JSON
    if math.isinf(value):
        raise ValueError(f"{value} is not a valid metric value")
    return float(value)


def metric_from_json(value: Any, path: str | Path, key: str) -> float | None:
    """Inverse of :func:`metric_to_json`; anything else is a ConfigError naming file and key."""
    if value is None:
        return None
    if value == PSNR_INF_JSON or value == math.inf:  # a decoded value decodes to itself
        return math.inf
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f'expected a number, "{PSNR_INF_JSON}" or null, got {value!r}', path=path, key=key)
    return float(value)


# --------------------------------------------------------------------------------------- CLIP


def _import_transformers() -> Any:
    """transformers is the optional ``clip`` extra; say how to get it instead of a bare ImportError."""
    try:
        import transformers
    except ImportError:
        raise ConfigError("CLIP similarity needs transformers: install parity[clip]") from None
    return transformers


class ClipScorer:
    """CLIP image-image similarity with a model loaded from a local directory (never downloaded:
    CI gates must not depend on the network, and the model version must be pinned by the user)."""

    def __init__(self, model: Any, processor: Any, device: str) -> None:
        self.model = model.to(device).eval()
        self.processor = processor
        self.device = device

    @classmethod
    def from_dir(cls, path: str | Path, device: str | None = None) -> ClipScorer:
        """Load ``CLIPModel`` + ``CLIPImageProcessor`` from ``path``; on CUDA when available."""
        transformers = _import_transformers()
        import torch

        directory = Path(path)
        if not directory.is_dir():
            raise ConfigError("CLIP model directory does not exist", path=directory)
        try:
            model = transformers.CLIPModel.from_pretrained(directory, local_files_only=True)
            processor = transformers.CLIPImageProcessor.from_pretrained(directory, local_files_only=True)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot load a CLIP model and image processor: {exc}", path=directory) from None
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        return cls(model, processor, device)

    def embed(self, images: Sequence[np.ndarray]) -> torch.Tensor:
        """L2-normalised image features ``[N, D]`` (float32, on CPU), all images in one forward."""
        import torch

        arrays = [_check_uint8_rgb(image, "CLIP input") for image in images]
        if any(a.ndim != 3 for a in arrays):
            raise ValueError("CLIP inputs are single HxWx3 images; use video_similarity for videos")
        pixels = self.processor(images=arrays, return_tensors="pt", input_data_format="channels_last")["pixel_values"]
        with torch.inference_mode():
            out = self.model.get_image_features(pixel_values=pixels.to(self.device, self.model.dtype))
        # transformers >= 5 returns a model output whose pooler_output holds the projected features
        features = out if isinstance(out, torch.Tensor) else out.pooler_output
        return torch.nn.functional.normalize(features.float(), dim=-1).cpu()

    def similarity(self, refs: Sequence[np.ndarray], cands: Sequence[np.ndarray]) -> list[float]:
        """Cosine similarity of each (ref, cand) pair, batched in one forward pass."""
        if len(refs) != len(cands):
            raise ValueError(f"{len(refs)} references but {len(cands)} candidates")
        if not refs:
            return []
        features = self.embed([*refs, *cands])
        n = len(refs)
        cosine = (features[:n] * features[n:]).sum(dim=-1).clamp(-1.0, 1.0)
        return [float(c) for c in cosine]

    def video_similarity(self, ref_frames: Any, cand_frames: Any) -> float:
        """CLIP similarity of a video: first, middle and last frames (sglang's key frames), and
        the *minimum* over them, as sglang requires every key frame to pass: a video whose last
        frame collapsed must fail even if the other two match."""
        refs, cands = np.asarray(ref_frames), np.asarray(cand_frames)
        if refs.ndim != 4 or cands.ndim != 4 or len(refs) != len(cands):
            raise ValueError(f"expected TxHxWx3 videos of equal length, got shapes {refs.shape} and {cands.shape}")
        indices = list(dict.fromkeys([0, len(refs) // 2, len(refs) - 1]))
        return min(self.similarity([refs[i] for i in indices], [cands[i] for i in indices]))


def resolve_clip_model(cli_value: str | None, env: Mapping[str, str] | None = None) -> str | None:
    """The configured CLIP model directory: ``--clip-model`` first, else ``$PARITY_CLIP_MODEL``,
    else None. A configured path that does not exist is a ConfigError naming it and its origin."""
    env = os.environ if env is None else env
    if cli_value:
        value, origin = cli_value, "--clip-model"
    elif env.get(CLIP_ENV):
        value, origin = env[CLIP_ENV], CLIP_ENV
    else:
        return None
    if not Path(value).exists():
        raise ConfigError("CLIP model path does not exist", path=value, key=origin)
    return value


def load_clip_scorer(
    cli_value: str | None, device: str | None = None, env: Mapping[str, str] | None = None
) -> tuple[ClipScorer | None, str | None]:
    """``(scorer, None)`` when a CLIP model is configured, else ``(None, skip_reason)``.

    The pair forces callers to handle the unconfigured case explicitly: the CLIP check must be
    reported as *skipped, with this reason*, never as passed.
    """
    path = resolve_clip_model(cli_value, env)
    if path is None:
        return None, f"no CLIP model configured (pass --clip-model DIR or set {CLIP_ENV})"
    return ClipScorer.from_dir(path, device), None
