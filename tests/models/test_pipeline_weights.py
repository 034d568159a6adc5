"""The pipeline's checkpoints (reference_impl.weights): the committed one loads, a changed file is refused by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from reference_impl.models.layers import ModelConfigError
from reference_impl.pipeline import PipelineConfig, build_models, run_pipeline
from reference_impl.weights import (
    PipelineWeightsError,
    read_pipeline_weights,
    weights_path,
    write_pipeline_weights,
)

BUILT_IN = "tiny-v1"


@pytest.fixture
def copy_of_built_in(tmp_path: Path) -> Path:
    """The committed checkpoint and its card copied out, to be damaged without touching the repository."""
    source = weights_path(BUILT_IN)
    target = tmp_path / source.name
    shutil.copy(source, target)
    shutil.copy(source.with_suffix(".json"), target.with_suffix(".json"))
    return target


def test_the_committed_checkpoint_matches_its_card_and_holds_every_model() -> None:
    weights = read_pipeline_weights(BUILT_IN)  # refuses a file whose sha256 is not its card's
    # pinned here as well: a retrained checkpoint committed with a fresh card must be a reviewed change of this line
    assert weights.card["sha256"] == "5247f5d741ab42ed23dd8d5411c68bb124fda90d8c877b8fd41552b1d479f36b"
    assert {k.split(".", 1)[0] for k in weights.tensors} == {"text_encoder", "vae", "zimage", "hunyuan"}
    assert weights_path(BUILT_IN).stat().st_size < 8 * 2**20


@pytest.mark.parametrize(("frames", "prefix"), [(None, "zimage"), (3, "hunyuan")], ids=["zimage", "hunyuan"])
def test_every_tensor_of_a_model_comes_from_the_committed_checkpoint(frames: int | None, prefix: str) -> None:
    weights = read_pipeline_weights(BUILT_IN)
    state = build_models(PipelineConfig(weights=BUILT_IN, num_frames=frames)).dit.state_dict()  # a strict load
    torch.testing.assert_close(state, {name: weights.tensors[f"{prefix}.{name}"] for name in state}, rtol=0, atol=0)


def test_trained_weights_repeat_and_are_not_the_random_ones() -> None:
    config = PipelineConfig(weights=BUILT_IN, dtype="bfloat16")
    trained = run_pipeline(config)
    assert trained.output.tobytes() == run_pipeline(config).output.tobytes()
    random_models = build_models(PipelineConfig(dtype="bfloat16"))
    assert not np.array_equal(trained.output, run_pipeline(PipelineConfig(dtype="bfloat16"), random_models).output)
    with pytest.raises(ValueError, match="built for weights=None, config has 'tiny-v1'"):
        run_pipeline(config, random_models)


def test_a_changed_byte_is_refused_naming_the_file(copy_of_built_in: Path) -> None:
    data = bytearray(copy_of_built_in.read_bytes())
    data[-1] ^= 0x01  # the last byte of the last tensor: still a readable safetensors file
    copy_of_built_in.write_bytes(bytes(data))
    with pytest.raises(PipelineWeightsError, match=f"{copy_of_built_in}: sha256 .* does not match tiny-v1.json's"):
        read_pipeline_weights(str(copy_of_built_in))
    with pytest.raises(PipelineWeightsError, match="tiny-v1.safetensors: sha256"):
        build_models(PipelineConfig(weights=str(copy_of_built_in)))


def test_a_missing_or_foreign_card_is_refused_naming_it(copy_of_built_in: Path) -> None:
    card = copy_of_built_in.with_suffix(".json")
    card.write_text(json.dumps({"sha256": "0" * 64}))
    with pytest.raises(PipelineWeightsError, match=f"{card}: not a parity.tiny_pipeline/1 card"):
        read_pipeline_weights(str(copy_of_built_in))
    card.unlink()
    with pytest.raises(PipelineWeightsError, match=f"{card}: file not found"):
        read_pipeline_weights(str(copy_of_built_in))


def test_a_written_checkpoint_round_trips_and_a_missing_model_is_named(tmp_path: Path) -> None:
    random = build_models(PipelineConfig())
    path = tmp_path / "partial.safetensors"
    digest = write_pipeline_weights(
        path, {"text_encoder": random.text_encoder, "vae": random.vae, "zimage": random.dit}, {"note": "random weights"}
    )
    card = json.loads(path.with_suffix(".json").read_text())
    assert card["sha256"] == digest and card["note"] == "random weights"
    loaded = run_pipeline(PipelineConfig(weights=str(path)))  # the same tensors as weights_seed=0 draws
    assert loaded.output.tobytes() == run_pipeline(PipelineConfig()).output.tobytes()
    with pytest.raises(PipelineWeightsError, match=f"{path}: holds no 'hunyuan' weights"):
        build_models(PipelineConfig(weights=str(path), num_frames=2))
    with pytest.raises(ValueError, match="unknown parts"):
        write_pipeline_weights(path, {"unet": random.dit}, {})
    with pytest.raises(ValueError, match="holds fp32 weights; got torch.bfloat16"):
        write_pipeline_weights(tmp_path / "bf16.safetensors", {"vae": random.vae.to(torch.bfloat16)}, {})


def test_config_errors_name_the_key() -> None:
    with pytest.raises(ModelConfigError, match="'weights'.*neither a checkpoint name"):
        PipelineConfig(weights="../elsewhere")
    with pytest.raises(ModelConfigError, match="'text_encoder_dir'"):
        PipelineConfig(weights=BUILT_IN, text_encoder_dir="/some/qwen3")
    with pytest.raises(ModelConfigError, match="'weights': 'no-such': no such checkpoint .*; built in: tiny-v1"):
        PipelineConfig(weights="no-such")  # at config time, before any rank starts


@pytest.mark.parametrize("weights", [None, BUILT_IN], ids=["random", "trained"])
def test_a_checkpoint_builds_the_text_encoder_for_the_run_dtype(weights: str | None) -> None:
    """Trained and random encoders alike choose their attention for bf16 when the run is bf16 (a cast of the
    parameters after building would leave the attention chosen, and computing, for fp32)."""
    from reference_impl.attention.layer import LocalAttention

    encoder = build_models(PipelineConfig(weights=weights, dtype="bfloat16")).text_encoder
    layers = [m for m in encoder.modules() if isinstance(m, LocalAttention)]
    assert layers and {m.dtype for m in layers} == {torch.bfloat16}
