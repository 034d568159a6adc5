"""scripts/train_tiny_pipeline.py: a short run lowers its losses and is reproducible; the committed checkpoint draws.

"Draws" is measured two ways, each with a control that fails it: neighbouring pixels of a sample
are correlated as a photo's are (random weights give colour noise, correlation near 0), and each
prompt's sample is nearer (SSIM) to its own training photo than to any other prompt's.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
from skimage.metrics import structural_similarity

from reference_impl.pipeline import PipelineConfig, build_models, run_pipeline
from reference_impl.weights import read_pipeline_weights

pytestmark = pytest.mark.timeout(600)

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "train_tiny_pipeline.py"
BUILT_IN = "tiny-v1"


def _load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("train_tiny_pipeline", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


train = _load_script()


def neighbour_correlation(image: np.ndarray) -> float:
    """Mean correlation of each pixel with its right and lower neighbour (per channel): ~0 for noise, ~0.9 for photos."""
    x = image.astype(np.float64)
    pairs = [(x[:, :-1], x[:, 1:]), (x[:-1], x[1:])]
    return float(np.mean([np.corrcoef(a[..., c].ravel(), b[..., c].ravel())[0, 1] for a, b in pairs for c in range(3)]))


def ssim(a: np.ndarray, b: np.ndarray) -> float:
    return float(structural_similarity(a, b, channel_axis=2, data_range=255))


def test_a_short_run_lowers_every_loss(tmp_path: Path) -> None:
    # No weight averaging: over 40 steps the average would still be mostly the initial weights.
    config = train.TrainConfig(crops=2, clips=1, batch=8, ae_steps=40, dit_steps=40, video_steps=40, ema=0.0)
    card = train.train(config, tmp_path / "short.safetensors")
    losses = card["losses"]
    ae = losses["autoencoder"]
    assert ae["last_20_mean"] < 0.6 * ae["first_20_mean"], ae
    # The same noise, noise levels and latents before and after: only training can move this figure.
    lowered = {
        name: losses[name]["eval_flow_loss_final"] < 0.7 * losses[name]["eval_flow_loss_initial"]
        for name in ("zimage", "hunyuan")
    }
    assert lowered == {"zimage": True, "hunyuan": True}, losses
    written = tmp_path / "short.safetensors"
    assert (
        hashlib.sha256(written.read_bytes()).hexdigest() == card["sha256"]
    )  # the card returned names the file written
    read_pipeline_weights(str(written))  # and the reader takes it


def test_a_run_repeats_bit_for_bit(tmp_path: Path) -> None:
    config = train.TrainConfig(crops=2, clips=1, batch=4, ae_steps=3, dit_steps=3, video_steps=3)
    first, second = (train.train(config, tmp_path / f"{n}.safetensors") for n in ("first", "second"))
    assert first["sha256"] == second["sha256"] and first["losses"] == second["losses"]
    assert (tmp_path / "first.safetensors").read_bytes() == (tmp_path / "second.safetensors").read_bytes()


def test_the_committed_card_records_a_trained_run() -> None:
    card = read_pipeline_weights(BUILT_IN).card
    assert card["subjects"] == train.SUBJECTS
    assert card["training"] == dataclasses.asdict(train.TrainConfig())  # the script's defaults made it
    losses = card["losses"]
    halved = {
        name: losses[name]["eval_flow_loss_final"] < 0.5 * losses[name]["eval_flow_loss_initial"]
        for name in ("zimage", "hunyuan")
    }
    assert halved == {"zimage": True, "hunyuan": True}, losses
    assert min(card["losses"]["autoencoder"]["reconstruction_psnr_db"].values()) > 20.0


@pytest.fixture(scope="module")
def samples() -> dict[str, np.ndarray]:
    """Each prompt drawn by the committed checkpoint at the built-in cases' size, steps and seed."""
    config = PipelineConfig(weights=BUILT_IN)
    models = build_models(config)
    return {p: run_pipeline(PipelineConfig(weights=BUILT_IN, prompt=p), models).output for p in train.SUBJECTS}


def test_samples_are_pictures_and_random_weights_are_not(samples: dict[str, np.ndarray]) -> None:
    correlations = {p: neighbour_correlation(image) for p, image in samples.items()}
    assert min(correlations.values()) > 0.6, correlations
    noise = neighbour_correlation(run_pipeline(PipelineConfig(prompt="an astronaut")).output)  # random weights
    assert abs(noise) < 0.3, noise


@pytest.mark.parametrize("prompt", list(train.SUBJECTS))
def test_each_prompt_draws_its_own_photo(samples: dict[str, np.ndarray], prompt: str) -> None:
    photos = {p: train.training_image(p, 32) for p in train.SUBJECTS}
    scores = {other: ssim(samples[prompt], photo) for other, photo in photos.items()}
    assert max(scores, key=scores.get) == prompt, scores
