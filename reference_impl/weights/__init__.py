"""The tiny pipeline's trained checkpoints: committed here, read only through :func:`read_pipeline_weights`.

A checkpoint is ``<name>.safetensors`` (every model of the pipeline under its prefix:
``text_encoder.``, ``vae.``, ``zimage.``, ``hunyuan.``) and its card ``<name>.json`` (training config,
final losses, the safetensors file's sha256), both written by ``scripts/train_tiny_pipeline.py``.
They live in the package, not under ``baselines/``, because they are an input of the implementation
(the pipeline draws with them wherever it is installed), not something a run is compared with.
Reading checks the sha256 against the card before any tensor is used; it never unpickles.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load
from torch import nn

from reference_impl.models.checkpoint import CheckpointError, read_json_object
from reference_impl.models.layers import save_safetensors

Tensor = torch.Tensor

WEIGHTS_DIR = Path(__file__).resolve().parent
FORMAT = "parity.tiny_pipeline/1"
PARTS = ("text_encoder", "vae", "zimage", "hunyuan")
_NAME = re.compile(r"[a-z0-9][a-z0-9._-]*")


class PipelineWeightsError(CheckpointError):
    """A pipeline checkpoint that cannot be used; the message starts with the file's path."""


def weights_path(weights: str) -> Path:
    """A committed checkpoint's name (``"tiny-v1"``) or a path to a ``.safetensors`` file with its card beside it."""
    if weights.endswith(".safetensors"):
        return Path(weights)
    if not _NAME.fullmatch(weights):
        raise ValueError(f"weights {weights!r} is neither a checkpoint name ([a-z0-9._-]) nor a .safetensors path")
    return WEIGHTS_DIR / f"{weights}.safetensors"


def card_path(path: Path) -> Path:
    return path.with_suffix(".json")


def sha256_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class PipelineWeights:
    """The tensors of one checkpoint, by part, and its card."""

    path: Path
    card: dict[str, Any]
    tensors: dict[str, Tensor]

    def part(self, name: str) -> dict[str, Tensor]:
        """The tensors of one model, its prefix removed; an error naming the file when it has none."""
        prefix = f"{name}."
        found = {k[len(prefix) :]: v for k, v in self.tensors.items() if k.startswith(prefix)}
        if not found:
            have = sorted({k.split(".", 1)[0] for k in self.tensors})
            raise PipelineWeightsError(self.path, f"holds no {name!r} weights (it has: {', '.join(have)})")
        return found


def read_pipeline_weights(weights: str) -> PipelineWeights:
    """Read a checkpoint whose bytes match the sha256 its card records (errors name the file)."""
    path = weights_path(weights)
    card_file = card_path(path)
    hint = " (train one with scripts/train_tiny_pipeline.py)"
    if not path.is_file():
        raise PipelineWeightsError(path, f"file not found{hint}")
    card = read_json_object(card_file, PipelineWeightsError, hint)
    if card.get("format") != FORMAT or not isinstance(card.get("sha256"), str):
        raise PipelineWeightsError(card_file, f"not a {FORMAT} card (needs 'format' and 'sha256')")
    data = path.read_bytes()
    digest = sha256_of(data)
    if digest != card["sha256"]:
        raise PipelineWeightsError(
            path,
            f"sha256 {digest} does not match {card_file.name}'s {card['sha256']}: the file "
            "changed after training (restore it, or re-train with scripts/train_tiny_pipeline.py)",
        )
    try:
        tensors = load(data)
    except (SafetensorError, ValueError) as exc:
        raise PipelineWeightsError(path, f"not a readable safetensors file ({exc})") from exc
    unknown = sorted({k.split(".", 1)[0] for k in tensors} - set(PARTS))
    if unknown:
        raise PipelineWeightsError(path, f"unknown parts {unknown} (known: {', '.join(PARTS)})")
    return PipelineWeights(path, card, tensors)


def write_pipeline_weights(
    path: str | os.PathLike[str], models: Mapping[str, nn.Module], card: Mapping[str, Any]
) -> str:
    """Write the models (fp32) under their part prefixes and the card with the file's sha256; returns the sha256.

    The card is written last, so a run that dies halfway leaves a checkpoint that fails its hash check.
    """
    path = Path(path)
    unknown = sorted(set(models) - set(PARTS))
    if unknown:
        raise ValueError(f"unknown parts {unknown} (known: {', '.join(PARTS)})")
    together = nn.ModuleDict(dict(models))  # its state dict names every tensor "<part>.<key>"
    not_fp32 = sorted({str(t.dtype) for t in together.state_dict().values()} - {str(torch.float32)})
    if not_fp32:
        raise ValueError(f"a pipeline checkpoint holds fp32 weights; got {', '.join(not_fp32)}")
    path.parent.mkdir(parents=True, exist_ok=True)
    save_safetensors(together, path, {"format": FORMAT})
    digest = sha256_of(path.read_bytes())
    card_path(path).write_text(
        json.dumps({"format": FORMAT, "sha256": digest, **card}, indent=2) + "\n", encoding="utf-8"
    )
    return digest
