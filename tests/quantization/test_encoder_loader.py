"""Encoder loading: fail-closed admission (proven by counting tensor reads), the kept exceptions,
packed QKV scales, FP8 vs bf16 parity, and unreadable checkpoints."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from harness.contracts.model_checks import judge_admission, judge_fp8, judge_packed_qkv
from harness.targets.reference.encoder import (
    TINY_QWEN3,
    check_fp8_parity,
    check_packed_qkv_scale,
    check_quantized_admission,
    fp8_quantization_config,
    fp8_tensors,
    qwen3_tensors,
    write_checkpoint,
)
from reference_impl.models.checkpoint import CheckpointError, SafetensorsCheckpoint
from reference_impl.models.encoder_loader import (
    ComponentCheckpointUnsupportedError,
    NativeEncoderMixin,
    load_text_encoder,
)
from reference_impl.models.qwen3 import Qwen3TextEncoder

BLOCKS = [None, (32, 48)]


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tensors = fp8_tensors(qwen3_tensors(TINY_QWEN3), None)
    return write_checkpoint(tmp_path_factory.mktemp("fp8"), TINY_QWEN3, tensors, fp8_quantization_config(None))


@pytest.mark.parametrize("block", BLOCKS)
def test_admission_is_fail_closed_before_any_read(block) -> None:
    figures = check_quantized_admission(block)
    assert judge_admission(figures)[0] == [], figures
    assert figures.admitted_tensors_read == figures.checkpoint_tensors == 39
    assert {case: r.tensors_read for case, r in figures.rejections.items()} == {
        "native_without_quantized_layers": 0,
        "not_native": 0,
        "unsupported_method": 0,
    }


@pytest.mark.parametrize("block", BLOCKS)
def test_packed_qkv_and_gate_up_scales_land_in_their_shards(block) -> None:
    figures = check_packed_qkv_scale(block)
    assert judge_packed_qkv(figures)[0] == [], figures


@pytest.mark.parametrize("block", BLOCKS)
def test_fp8_encoder_vs_bf16(block) -> None:
    figures = check_fp8_parity(block)
    assert judge_fp8(figures)[0] == [], figures


def test_fp8_parity_with_real_128x128_blocks() -> None:
    config = dict(TINY_QWEN3, hidden_size=256, intermediate_size=256, head_dim=64, num_hidden_layers=1)
    figures = check_fp8_parity((128, 128), config=config)
    assert judge_fp8(figures)[0] == [], figures


def test_rejection_names_class_and_component(fp8_dir: Path) -> None:
    class PlainModule(nn.Module):
        pass

    checkpoint = SafetensorsCheckpoint(fp8_dir)
    with pytest.raises(ComponentCheckpointUnsupportedError, match=r"'text_encoder_2'.*'fp8'.*PlainModule is not"):
        load_text_encoder(checkpoint, model_cls=PlainModule, component="text_encoder_2")
    assert checkpoint.tensors_read == 0


class SelfManagedEncoder(NativeEncoderMixin, nn.Module):
    """Interprets quantization_config itself: the loader must neither require quantized linears nor post-process."""

    manages_checkpoint_quantization = True

    def __init__(self, declared: dict, quant_config) -> None:
        super().__init__()
        self.declared = declared
        self.quant_config = quant_config
        self.dtypes: dict[str, torch.dtype] = {}

    @classmethod
    def from_config(cls, hf_config, quant_config=None, dtype=None, component="text_encoder"):
        return cls(hf_config["quantization_config"], quant_config)

    def load_weights(self, weights):
        self.dtypes = {name: t.dtype for name, t in weights}
        return set()


class NotSelfManagedEncoder(SelfManagedEncoder):
    manages_checkpoint_quantization = False


def test_models_managing_their_own_quantization_keep_their_path(fp8_dir: Path) -> None:
    checkpoint = SafetensorsCheckpoint(fp8_dir)
    model = load_text_encoder(checkpoint, model_cls=SelfManagedEncoder)
    assert model.declared["quant_method"] == "fp8" and model.quant_config is None
    assert len(model.dtypes) == checkpoint.tensors_read == len(checkpoint.keys())
    assert model.dtypes["model.layers.0.self_attn.q_proj.weight"] == torch.float8_e4m3fn
    refused = SafetensorsCheckpoint(fp8_dir)
    with pytest.raises(ComponentCheckpointUnsupportedError, match="NotSelfManagedEncoder"):
        load_text_encoder(refused, model_cls=NotSelfManagedEncoder)
    assert refused.tensors_read == 0


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is not None, reason="bitsandbytes is installed here")
def test_bnb_4bit_is_delegated_and_names_bitsandbytes_when_missing(tmp_path: Path) -> None:
    bnb = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}
    directory = write_checkpoint(tmp_path, TINY_QWEN3, qwen3_tensors(TINY_QWEN3), bnb)
    checkpoint = SafetensorsCheckpoint(directory)
    with pytest.raises(
        ComponentCheckpointUnsupportedError,
        match=r"bitsandbytes 4-bit.*delegated to transformers.*pip install bitsandbytes",
    ):
        load_text_encoder(checkpoint, model_cls=Qwen3TextEncoder)
    assert checkpoint.tensors_read == 0


def test_bnb_8bit_is_not_the_kept_exception(tmp_path: Path) -> None:
    bnb8 = {"quant_method": "bitsandbytes", "load_in_8bit": True}
    directory = write_checkpoint(tmp_path, TINY_QWEN3, qwen3_tensors(TINY_QWEN3), bnb8)
    with pytest.raises(
        ComponentCheckpointUnsupportedError, match="'bitsandbytes' quantization; Qwen3TextEncoder supports fp8"
    ):
        load_text_encoder(directory)


class PretrainedStyleEncoder(nn.Module):
    """A non-native class that loads itself, transformers style."""

    @classmethod
    def from_pretrained(cls, directory: str) -> PretrainedStyleEncoder:
        model = cls()
        model.directory = directory
        return model


def test_unquantized_non_native_class_loads_itself(tmp_path: Path) -> None:
    directory = write_checkpoint(tmp_path, TINY_QWEN3, qwen3_tensors(TINY_QWEN3))
    checkpoint = SafetensorsCheckpoint(directory)
    model = load_text_encoder(checkpoint, model_cls=PretrainedStyleEncoder)
    assert isinstance(model, PretrainedStyleEncoder) and model.directory == str(directory) and not model.training
    assert checkpoint.tensors_read == 0  # the class read its own weights


def test_default_class_comes_from_model_type(tmp_path: Path) -> None:
    directory = write_checkpoint(tmp_path / "ok", TINY_QWEN3, qwen3_tensors(TINY_QWEN3))
    assert isinstance(load_text_encoder(directory), Qwen3TextEncoder)
    other = write_checkpoint(tmp_path / "other", dict(TINY_QWEN3, model_type="t5"), qwen3_tensors(TINY_QWEN3))
    with pytest.raises(ValueError, match="'model_type' is 't5'"):
        load_text_encoder(other)


# ---------------------------------------------------------------------------- unreadable checkpoints
def _truncate(path: Path, keep: float = 0.6) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def test_truncated_file_is_named(fp8_dir: Path, tmp_path: Path) -> None:
    directory = write_checkpoint(tmp_path, TINY_QWEN3, qwen3_tensors(TINY_QWEN3))
    _truncate(directory / "model.safetensors")
    with pytest.raises(CheckpointError, match=rf"{directory / 'model.safetensors'}: not a readable safetensors file"):
        load_text_encoder(directory)


def test_corrupt_shard_of_a_sharded_checkpoint_is_named(tmp_path: Path) -> None:
    tensors = qwen3_tensors(TINY_QWEN3)
    directory = write_checkpoint(tmp_path, TINY_QWEN3, tensors)
    (directory / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[: len(names) // 2],
        "model-00002-of-00002.safetensors": names[len(names) // 2 :],
    }
    from safetensors.torch import save_file

    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(directory / shard))
    index = {"metadata": {}, "weight_map": {k: shard for shard, keys in shards.items() for k in keys}}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    assert isinstance(load_text_encoder(directory), Qwen3TextEncoder)
    (directory / "model-00002-of-00002.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00not json")
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors: not a readable safetensors file"):
        load_text_encoder(directory)
    (directory / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(
        CheckpointError, match=r"index.json: shard 'model-00002-of-00002.safetensors' .* does not exist"
    ):
        load_text_encoder(directory)


def test_missing_or_broken_config_is_named(tmp_path: Path) -> None:
    directory = write_checkpoint(tmp_path, TINY_QWEN3, qwen3_tensors(TINY_QWEN3))
    (directory / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"config.json: not valid JSON"):
        load_text_encoder(directory)
    (directory / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config.json: file not found"):
        load_text_encoder(directory)
    (directory / "model.safetensors").unlink()
    (directory / "config.json").write_text(json.dumps(TINY_QWEN3))
    with pytest.raises(CheckpointError, match="no model.safetensors or model.safetensors.index.json"):
        load_text_encoder(directory)
