"""Metrics agree with scikit-image (exactly) and torchmetrics (stated tolerances) on real photos.

Measured agreement on crops of skimage's astronaut/chelsea/coffee with seeded noise, blur and
quantisation candidates (torch 2.13, torchmetrics 1.9, scikit-image 0.26):
- PSNR vs torchmetrics: relative difference <= 3.8e-8 (asserted <= 1e-6).
- mean abs diff vs torchmetrics' mean_absolute_error: identical (asserted rel <= 1e-12).
- SSIM vs torchmetrics (gaussian window, sigma 1.5, population covariance), whole-image mean:
  |diff| <= 2.7e-3 on 256x256 and 2.6e-3 on the 128x128 crops tested (asserted <= 5e-3).
  The gap is the border: torchmetrics reflect-pads and averages every pixel, scikit-image
  averages only pixels whose window fits inside the image. On those interior pixels the two
  SSIM maps agree to <= 1.5e-12 (asserted <= 1e-9), for the gaussian window and for the uniform
  7x7 window alike. sglang's exact setting (uniform 7x7, *sample* covariance) has no torchmetrics
  equivalent; there our ssim() is checked for equality with the scikit-image call itself.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from skimage import data
from skimage.filters import gaussian
from skimage.metrics import peak_signal_noise_ratio, structural_similarity

from harness.errors import ConfigError
from harness.metrics import (
    ClipScorer,
    load_clip_scorer,
    mean_abs_diff,
    metric_from_json,
    metric_to_json,
    psnr,
    resolve_clip_model,
    ssim,
)

SIZE = 256


def _photos() -> dict[str, np.ndarray]:
    names = ("astronaut", "chelsea", "coffee")
    return {name: np.ascontiguousarray(getattr(data, name)()[:SIZE, :SIZE, :3]) for name in names}


def _candidates(ref: np.ndarray, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    noisy = {
        f"noise{s}": np.clip(ref + rng.normal(0, s, ref.shape).round(), 0, 255).astype(np.uint8) for s in (2, 8, 20)
    }
    blurred = (gaussian(ref, sigma=1.0, channel_axis=2, preserve_range=True)).round().astype(np.uint8)
    quantised = (ref // 16 * 16 + 8).astype(np.uint8)
    return {**noisy, "blur": blurred, "quant": quantised}


PAIRS = [
    (f"{name}-{kind}", ref, cand)
    for i, (name, ref) in enumerate(_photos().items())
    for kind, cand in _candidates(ref, i).items()
]


def _nchw(a: np.ndarray):  # noqa: ANN202 - torch is imported lazily
    import torch

    return torch.from_numpy(a).permute(2, 0, 1)[None].double().contiguous()


@pytest.mark.parametrize(("label", "ref", "cand"), PAIRS, ids=[p[0] for p in PAIRS])
def test_psnr_ssim_mad_equal_scikit_image_calls(label: str, ref: np.ndarray, cand: np.ndarray) -> None:
    assert psnr(ref, cand) == peak_signal_noise_ratio(ref, cand, data_range=255)
    assert ssim(ref, cand) == structural_similarity(ref, cand, channel_axis=2, data_range=255)
    assert mean_abs_diff(ref, cand) == np.abs(ref.astype(np.float64) - cand.astype(np.float64)).mean()


@pytest.mark.parametrize(("label", "ref", "cand"), PAIRS, ids=[p[0] for p in PAIRS])
def test_psnr_and_mad_agree_with_torchmetrics(label: str, ref: np.ndarray, cand: np.ndarray) -> None:
    tm = pytest.importorskip("torchmetrics.functional")
    ours = psnr(ref, cand)
    theirs = tm.image.peak_signal_noise_ratio(_nchw(cand), _nchw(ref), data_range=255.0).item()
    assert abs(ours - theirs) / ours <= 1e-6
    mad = tm.mean_absolute_error(_nchw(cand), _nchw(ref)).item()
    assert mean_abs_diff(ref, cand) == pytest.approx(mad, rel=1e-12)


# float64 grouped convolutions are slow on CPU: one candidate kind per photo, 128x128 crops.
SSIM_PAIRS = [
    (label, ref[:128, :128], cand[:128, :128])
    for label, ref, cand in PAIRS
    if label in ("astronaut-noise8", "chelsea-blur", "coffee-quant")
]


@pytest.mark.parametrize(("label", "ref", "cand"), SSIM_PAIRS, ids=[p[0] for p in SSIM_PAIRS])
def test_ssim_agrees_with_torchmetrics(label: str, ref: np.ndarray, cand: np.ndarray) -> None:
    tm = pytest.importorskip("torchmetrics.functional.image")
    # whole-image mean, gaussian window: differs only through border handling
    sk, sk_map = structural_similarity(
        ref,
        cand,
        channel_axis=2,
        data_range=255,
        gaussian_weights=True,
        sigma=1.5,
        use_sample_covariance=False,
        full=True,
    )
    value, tm_map = tm.structural_similarity_index_measure(
        _nchw(cand), _nchw(ref), data_range=255.0, return_full_image=True
    )
    assert abs(sk - value.item()) <= 5e-3
    pad = 5  # (11 - 1) // 2: the gaussian window's radius
    tm_interior = tm_map[0].permute(1, 2, 0).numpy()[pad:-pad, pad:-pad]
    assert np.abs(sk_map[pad:-pad, pad:-pad] - tm_interior).max() <= 1e-9
    # uniform 7x7 window (sglang's window), population covariance: interior maps identical
    _, sk_map7 = structural_similarity(
        ref, cand, channel_axis=2, data_range=255, use_sample_covariance=False, full=True
    )
    _, tm_map7 = tm.structural_similarity_index_measure(
        _nchw(cand), _nchw(ref), data_range=255.0, gaussian_kernel=False, kernel_size=7, return_full_image=True
    )
    tm7 = tm_map7[0].permute(1, 2, 0).numpy()[3:-3, 3:-3]
    assert np.abs(sk_map7[3:-3, 3:-3] - tm7).max() <= 1e-9


def test_metrics_order_candidates_by_degradation() -> None:
    ref = _photos()["astronaut"]
    c = _candidates(ref, 0)
    assert psnr(ref, c["noise2"]) > psnr(ref, c["noise8"]) > psnr(ref, c["noise20"])
    assert ssim(ref, c["noise2"]) > ssim(ref, c["noise8"]) > ssim(ref, c["noise20"])
    assert mean_abs_diff(ref, c["noise2"]) < mean_abs_diff(ref, c["noise8"]) < mean_abs_diff(ref, c["noise20"])


def test_identical_images_and_json_representation() -> None:
    ref = _photos()["coffee"]
    value = psnr(ref, ref.copy())
    assert value == math.inf and value >= 30.0  # the gate's `psnr >= threshold` passes
    assert ssim(ref, ref) == pytest.approx(1.0) and mean_abs_diff(ref, ref) == 0.0
    encoded = json.dumps({"psnr": metric_to_json(value), "clip": metric_to_json(None)}, allow_nan=False)
    assert encoded == '{"psnr": "inf", "clip": null}'
    decoded = json.loads(encoded)
    assert metric_from_json(decoded["psnr"], "r.json", "psnr") == math.inf
    assert metric_from_json(decoded["clip"], "r.json", "clip") is None
    assert metric_from_json(12.5, "r.json", "psnr") == 12.5
    with pytest.raises(ValueError):
        metric_to_json(float("nan"))
    with pytest.raises(ConfigError, match=r"r\.json: key 'cases\.c\.psnr'"):
        metric_from_json("infinite", "r.json", "cases.c.psnr")


def test_mismatches_raise_value_error_naming_both_shapes() -> None:
    a = np.zeros((8, 8, 3), np.uint8)
    with pytest.raises(ValueError, match=r"\(8, 8, 3\).*\(8, 9, 3\)"):
        psnr(a, np.zeros((8, 9, 3), np.uint8))
    with pytest.raises(ValueError, match="uint8.*float32"):
        ssim(a, a.astype(np.float32))
    with pytest.raises(ValueError, match="HxWx3"):
        mean_abs_diff(np.zeros((8, 8), np.uint8), np.zeros((8, 8), np.uint8))


def test_video_metrics_average_frames_and_cap_identical_frames() -> None:
    photos = list(_photos().values())
    ref = np.stack(photos)
    cand = np.stack([photos[0], *(_candidates(p, 9)["noise8"] for p in photos[1:])])
    per_frame = [peak_signal_noise_ratio(r, c, data_range=255) for r, c in zip(ref[1:], cand[1:])]
    cap = 10 * math.log10(255**2 * SIZE * SIZE * 3)  # frame 0 is identical: counts as the finite cap
    assert psnr(ref, cand) == pytest.approx((cap + sum(per_frame)) / 3, rel=1e-12)
    assert ssim(ref, cand) == pytest.approx(np.mean([ssim(r, c) for r, c in zip(ref, cand)]), rel=1e-12)
    assert mean_abs_diff(ref, cand) == pytest.approx(np.abs(ref.astype(float) - cand).mean(), rel=1e-12)
    assert psnr(ref, ref) == math.inf


images = arrays(np.uint8, st.tuples(st.integers(7, 12), st.integers(7, 12), st.just(3)))


@settings(max_examples=25, deadline=None)
@given(images, st.data())
def test_metric_symmetries(a: np.ndarray, draw: st.DataObject) -> None:
    b = draw.draw(arrays(np.uint8, a.shape))
    assert mean_abs_diff(a, b) == mean_abs_diff(b, a) >= 0.0
    assert (mean_abs_diff(a, b) == 0.0) == np.array_equal(a, b)
    assert psnr(a, b) == psnr(b, a)
    assert ssim(a, b) == pytest.approx(ssim(b, a), abs=1e-12)
    assert ssim(a, b) <= 1.0 + 1e-12


@settings(max_examples=25, deadline=None)
@given(images, st.integers(0, 2**32 - 1), st.floats(0.0, 30.0), st.floats(0.0, 30.0))
def test_psnr_is_monotone_in_noise_amplitude(a: np.ndarray, seed: int, k1: float, k2: float) -> None:
    lo, hi = sorted((k1, k2))
    noise = np.random.default_rng(seed).standard_normal(a.shape)

    def noisy(k: float) -> np.ndarray:
        return np.clip(a + np.round(k * noise), 0, 255).astype(np.uint8)

    assert psnr(a, noisy(lo)) >= psnr(a, noisy(hi))
    assert mean_abs_diff(a, noisy(lo)) <= mean_abs_diff(a, noisy(hi))


# ------------------------------------------------------------------------------------- CLIP


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random CLIP model saved like a real one; nothing is downloaded."""
    pytest.importorskip("transformers")
    from tests.images.tiny_clip import save_tiny_clip

    return save_tiny_clip(tmp_path_factory.mktemp("tiny_clip"))


@pytest.fixture(scope="module")
def scorer(clip_dir: Path) -> ClipScorer:
    return ClipScorer.from_dir(clip_dir, device="cpu")


def test_clip_identical_different_and_batched(scorer: ClipScorer) -> None:
    photos = list(_photos().values())
    noisy = _candidates(photos[0], 1)["noise20"]
    refs = [photos[0], photos[0], photos[1]]
    cands = [photos[0].copy(), noisy, photos[2]]
    batched = scorer.similarity(refs, cands)
    assert batched[0] == pytest.approx(1.0, abs=1e-5)
    assert batched[1] < 1.0 - 1e-6 and batched[2] < batched[1]
    one_by_one = [scorer.similarity([r], [c])[0] for r, c in zip(refs, cands)]
    assert batched == pytest.approx(one_by_one, abs=1e-5)
    assert scorer.similarity([], []) == []
    with pytest.raises(ValueError, match="2 references but 1 candidates"):
        scorer.similarity(refs[:2], cands[:1])


def test_clip_video_uses_first_middle_last_and_takes_the_minimum(scorer: ClipScorer) -> None:
    photos = list(_photos().values())
    video = np.stack([photos[0], photos[0], photos[1], photos[1], photos[2]])
    assert scorer.video_similarity(video, video.copy()) == pytest.approx(1.0, abs=1e-5)
    broken_last = video.copy()
    broken_last[-1] = photos[0]
    expected = scorer.similarity([photos[2]], [photos[0]])[0]
    assert scorer.video_similarity(video, broken_last) == pytest.approx(expected, abs=1e-5)
    changed_unsampled = video.copy()
    changed_unsampled[1] = photos[2]  # frame 1 is not a key frame of a 5-frame video (0, 2, 4)
    assert scorer.video_similarity(video, changed_unsampled) == pytest.approx(1.0, abs=1e-5)


def test_clip_configuration(clip_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    scorer_, reason = load_clip_scorer(None, env={})
    assert scorer_ is None and reason is not None and "PARITY_CLIP_MODEL" in reason and "--clip-model" in reason
    assert resolve_clip_model(None, env={"PARITY_CLIP_MODEL": str(clip_dir)}) == str(clip_dir)
    assert resolve_clip_model(str(clip_dir), env={"PARITY_CLIP_MODEL": "/elsewhere"}) == str(clip_dir)  # CLI wins
    missing = str(tmp_path / "no_such_model")
    with pytest.raises(ConfigError, match="does not exist") as info:
        resolve_clip_model(missing, env={})
    assert info.value.path == missing and info.value.key == "--clip-model"
    with pytest.raises(ConfigError) as info:
        load_clip_scorer(None, env={"PARITY_CLIP_MODEL": missing})
    assert info.value.key == "PARITY_CLIP_MODEL"
    with pytest.raises(ConfigError, match="does not exist"):
        ClipScorer.from_dir(missing)
    with pytest.raises(ConfigError, match="cannot load"):
        ClipScorer.from_dir(tmp_path)  # exists, holds no model
    loaded, reason = load_clip_scorer(str(clip_dir), device="cpu", env={})
    assert isinstance(loaded, ClipScorer) and reason is None
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if the clip extra were not installed
    with pytest.raises(ConfigError, match=r"install parity\[clip\]"):
        ClipScorer.from_dir(clip_dir)
