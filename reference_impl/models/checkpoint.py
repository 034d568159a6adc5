"""Lazy, counted read access to a transformers- or diffusers-layout checkpoint directory.

``config.json`` plus ``model.safetensors`` or shards listed by ``model.safetensors.index.json``
(diffusers names them ``diffusion_pytorch_model.*``: pass ``weights_name=DIFFUSERS_WEIGHTS``).
Opening validates every file's header (safetensors checks that the data region covers every
tensor, so a truncated or corrupt file fails here, naming the file) but reads no tensor data.
Tensors are read one at a time through :meth:`SafetensorsCheckpoint.get_tensor`, which counts
them: that count is how a loader proves it rejected a checkpoint before reading any weight.
Never unpickles.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

Tensor = torch.Tensor
TRANSFORMERS_WEIGHTS = "model"
DIFFUSERS_WEIGHTS = "diffusion_pytorch_model"


class CheckpointError(ValueError):
    """A checkpoint file that cannot be used; the message starts with the file's path."""

    def __init__(self, path: str | os.PathLike[str], message: str) -> None:
        self.path = str(path)
        super().__init__(f"{self.path}: {message}")


def read_json_object(path: Path, error: type[CheckpointError] = CheckpointError, hint: str = "") -> dict[str, Any]:
    """A checkpoint's JSON file (config, index, card) as a dict; ``error`` (naming the file) otherwise."""
    if not path.is_file():
        raise error(path, f"file not found{hint}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise error(path, f"not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise error(path, f"must hold a JSON object, got {type(data).__name__}")
    return data


class SafetensorsCheckpoint:
    """A checkpoint directory: ``config`` (dict), tensor names and shapes, and counted tensor reads."""

    def __init__(self, directory: str | os.PathLike[str], weights_name: str = TRANSFORMERS_WEIGHTS) -> None:
        self.directory = Path(directory)
        self.single_file, self.index_file = f"{weights_name}.safetensors", f"{weights_name}.safetensors.index.json"
        if not self.directory.is_dir():
            raise CheckpointError(self.directory, "not a directory")
        self.config = read_json_object(self.directory / "config.json")
        self._file_of = self._tensor_files()
        self._handles = {path: self._open(path) for path in sorted(set(self._file_of.values()))}
        for name, path in self._file_of.items():
            if name not in self._handles[path].keys():
                raise CheckpointError(path, f"the index lists tensor {name!r} in this file but it is not there")
        self.tensors_read = 0

    def _tensor_files(self) -> dict[str, Path]:
        index_path = self.directory / self.index_file
        if index_path.is_file():
            weight_map = read_json_object(index_path).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise CheckpointError(index_path, "key 'weight_map' must be a non-empty object")
            files = {}
            for name, shard in weight_map.items():
                path = self.directory / str(shard)
                if not path.is_file():
                    raise CheckpointError(index_path, f"shard {shard!r} (holding {name!r}) does not exist")
                files[name] = path
            return files
        single = self.directory / self.single_file
        if not single.is_file():
            raise CheckpointError(
                self.directory, f"no {self.single_file} or {self.index_file} (only safetensors checkpoints are read)"
            )
        return {name: single for name in self._open(single).keys()}

    @staticmethod
    def _open(path: Path) -> Any:
        try:
            return safe_open(str(path), framework="pt")
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(path, f"not a readable safetensors file ({exc})") from exc

    def keys(self) -> list[str]:
        return sorted(self._file_of)

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape from the header (reads no data)."""
        return tuple(self._handles[self._path(name)].get_slice(name).get_shape())

    def _path(self, name: str) -> Path:
        try:
            return self._file_of[name]
        except KeyError:
            raise KeyError(f"tensor {name!r} is not in the checkpoint at {self.directory}") from None

    def get_tensor(self, name: str) -> Tensor:
        """Read one tensor (CPU); every call counts in ``tensors_read``."""
        path = self._path(name)
        self.tensors_read += 1
        try:
            return self._handles[path].get_tensor(name)
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(path, f"cannot read tensor {name!r} ({exc})") from exc

    def iter_tensors(self) -> Iterator[tuple[str, Tensor]]:
        """Every tensor, read lazily one at a time (file by file, so each shard is read in one pass)."""
        for name in sorted(self._file_of, key=lambda n: (str(self._file_of[n]), n)):
            yield name, self.get_tensor(name)
