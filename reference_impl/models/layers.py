"""Building blocks shared by the reference models (DiTs, text encoder, VAE).

- :class:`ModelConfig`: a frozen-dataclass base whose ``from_dict`` refuses unknown, missing
  or mistyped keys with an error naming the key, so a bad config never builds a wrong model.
- :class:`RMSNorm` with or without an affine weight (``elementwise_affine=False`` is the
  affine-free q/k norm some VAEs use).
- RoPE: 1-D and axial (2-D/3-D) cos/sin tables computed in fp64, applied to ``[B, S, H, D]``
  in fp32. Positions are explicit tensors, so a sequence-parallel shard passes the *global*
  positions of its tokens and gets exactly the rotation the single-rank run gives them.
- :func:`even_shard_bounds`: which contiguous tokens a sequence-parallel rank holds.
- safetensors I/O: :func:`load_safetensors_into` reads weights without pickle and reports
  every missing, unexpected or misshapen tensor by name before touching the module.
"""

from __future__ import annotations

import dataclasses
import math
import os
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

Tensor = torch.Tensor
C = TypeVar("C", bound="ModelConfig")


# ---------------------------------------------------------------------------- config
class ModelConfigError(ValueError):
    """A model config problem; ``key`` names the offending key (``axes_dims[1]`` for an element)."""

    def __init__(self, message: str, key: str | None = None) -> None:
        self.key = key
        super().__init__(f"config key '{key}': {message}" if key else message)


def _coerce(value: Any, hint: Any, key: str) -> Any:
    """Check ``value`` against a field's type hint; ints widen to float, lists become tuples."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]  # only Optional[X] is supported
        return _coerce(value, inner, key)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ModelConfigError(f"expected a list, got {type(value).__name__} {value!r}", key)
        return tuple(_coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value))
    if hint is bool:
        if not isinstance(value, bool):
            raise ModelConfigError(f"expected a bool, got {type(value).__name__} {value!r}", key)
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ModelConfigError(f"expected an int, got {type(value).__name__} {value!r}", key)
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ModelConfigError(f"expected a number, got {type(value).__name__} {value!r}", key)
        number = float(value) if not isinstance(value, int) or abs(value) < 2**1000 else math.inf
        if not math.isfinite(number):  # nan passes every "<= 0" check and poisons the run silently
            raise ModelConfigError(f"must be a finite number, got {value if number != math.inf else 'a huge integer'!r}", key)
        return number
    if hint is str:
        if not isinstance(value, str):
            raise ModelConfigError(f"expected a string, got {type(value).__name__} {value!r}", key)
        return value
    raise TypeError(f"ModelConfig field '{key}' has an unsupported type hint {hint!r}")


@dataclass(frozen=True)
class ModelConfig:
    """Base for model configs: frozen dataclasses of int/float/bool/str, tuples of them, Optional.

    Types are checked (and ints widened to float, lists turned into tuples) on construction;
    subclasses add cross-field checks in :meth:`validate`, raising :meth:`error`.
    """

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, _coerce(getattr(self, f.name), hints[f.name], f.name))
        self.validate()

    def validate(self) -> None:
        """Cross-field checks; the base has none."""

    @staticmethod
    def error(key: str, message: str) -> ModelConfigError:
        return ModelConfigError(message, key)

    @classmethod
    def from_dict(cls: type[C], data: Mapping[str, Any]) -> C:
        """Build from a plain dict (e.g. a JSON config); unknown or missing keys are errors naming the key."""
        if not isinstance(data, Mapping):
            raise ModelConfigError(f"{cls.__name__} config must be a mapping, got {type(data).__name__}")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        for key in data:
            if key not in fields:
                raise ModelConfigError(f"unknown key for {cls.__name__} (valid: {', '.join(sorted(fields))})", str(key))
        for name, f in fields.items():
            no_default = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            if no_default and name not in data:
                raise ModelConfigError(f"required by {cls.__name__} but missing", name)
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly dict that ``from_dict`` reads back."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}


# ---------------------------------------------------------------------------- norms
class RMSNorm(nn.Module):
    """RMS normalisation over the last dim, computed in fp32 (fp64 for fp64 input) and cast back once.

    ``elementwise_affine=False`` has no parameters at all (nothing to load), which is what an
    affine-free q/k norm means; with it, the learned weight starts at ones.
    """

    def __init__(self, dim: int, eps: float = 1e-6, elementwise_affine: bool = True) -> None:
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if elementwise_affine else None

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[-1] != self.dim:
            raise ValueError(f"RMSNorm({self.dim}) got a last dim of {x.shape[-1]}")
        x32 = x.to(torch.promote_types(x.dtype, torch.float32))
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight is not None:
            y = y * self.weight.to(x32.dtype)
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, elementwise_affine={self.weight is not None}"


# ---------------------------------------------------------------------------- RoPE
def rope_cos_sin(positions: Tensor, dim: int, theta: float = 10000.0, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """cos/sin tables ``[S, dim // 2]`` for 1-D positions ``[S]``, computed in fp64 and returned in ``dtype``.

    fp32 tables are the norm; an fp64 reference run asks for fp64 ones so its only rounding is fp64's.
    """
    if dim % 2:
        raise ValueError(f"RoPE dim must be even, got {dim}")
    if positions.dim() != 1:
        raise ValueError(f"positions must be [S], got shape {tuple(positions.shape)}")
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device=positions.device) / dim)
    angles = torch.outer(positions.to(torch.float64), inv_freq)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def axial_rope_cos_sin(
    positions: Tensor, axes_dims: Sequence[int], theta: float = 10000.0, dtype: torch.dtype = torch.float32
) -> tuple[Tensor, Tensor]:
    """Axial RoPE (2-D/3-D DiTs): axis ``i`` of ``positions [S, n_axes]`` rotates ``axes_dims[i]`` channels.

    Returns cos/sin ``[S, sum(axes_dims) // 2]``: each axis' table, concatenated in axis order.
    """
    if positions.dim() != 2 or positions.shape[1] != len(axes_dims):
        raise ValueError(f"positions must be [S, {len(axes_dims)}] for axes_dims {list(axes_dims)}, got {tuple(positions.shape)}")
    tables = [rope_cos_sin(positions[:, i], d, theta, dtype) for i, d in enumerate(axes_dims)]
    return torch.cat([c for c, _ in tables], dim=-1), torch.cat([s for _, s in tables], dim=-1)


def grid_positions(sizes: Sequence[int], offsets: Sequence[int] | None = None, device: torch.device | str | None = None) -> Tensor:
    """Integer positions ``[prod(sizes), len(sizes)]`` of a row-major grid, axis ``i`` starting at ``offsets[i]``."""
    offsets = [0] * len(sizes) if offsets is None else list(offsets)
    if len(offsets) != len(sizes):
        raise ValueError(f"{len(sizes)} sizes but {len(offsets)} offsets")
    axes = [torch.arange(o, o + n, dtype=torch.long, device=device) for o, n in zip(offsets, sizes)]
    return torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1).reshape(-1, len(sizes))


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = True) -> Tensor:
    """Rotate ``x [B, S, H, D]`` by tables ``[S, D/2]`` or ``[B, S, D/2]``; fp32 (fp64) math, result in x's dtype.

    ``interleaved=True`` pairs channels (2i, 2i+1) (sglang's ``is_neox_style=False``, used by
    Z-Image and HunyuanVideo); ``False`` pairs (i, i + D/2) (GPT-NeoX / Llama / Qwen).
    """
    if x.dim() != 4:
        raise ValueError(f"apply_rope expects [B, S, H, D], got shape {tuple(x.shape)}")
    half = x.shape[-1] // 2
    if cos.shape[-1] != half or cos.shape[-2] != x.shape[1]:
        raise ValueError(f"RoPE tables {tuple(cos.shape)} do not fit x {tuple(x.shape)} (need [..., {x.shape[1]}, {half}])")
    compute = torch.promote_types(x.dtype, torch.float32)  # fp32, or fp64 for an fp64 reference
    c, s = cos.to(compute).unsqueeze(-2), sin.to(compute).unsqueeze(-2)  # broadcast over heads
    if c.dim() == 3:
        c, s = c.unsqueeze(0), s.unsqueeze(0)
    x32 = x.to(compute)
    if interleaved:
        x1, x2 = x32[..., 0::2], x32[..., 1::2]
        out = torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).flatten(-2)
    else:
        x1, x2 = x32[..., :half], x32[..., half:]
        out = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    return out.to(x.dtype)


# ---------------------------------------------------------------------------- sequence sharding
def even_shard_bounds(num_tokens: int, rank: int, world: int) -> tuple[int, int]:
    """The contiguous ``[start, end)`` tokens rank ``rank`` of ``world`` holds under an even split.

    Sharded image tokens use this; an uneven count is an error here rather than a hang or a
    shape error inside a collective later.
    """
    if num_tokens % world:
        raise ValueError(f"{num_tokens} tokens cannot be split evenly over {world} sequence-parallel ranks")
    n = num_tokens // world
    return rank * n, (rank + 1) * n


# ---------------------------------------------------------------------------- weights
class WeightLoadError(ValueError):
    """Weights that do not fit a module; lists every problem by tensor name, so one run shows them all."""

    def __init__(
        self,
        source: str,
        missing: Sequence[str] = (),
        unexpected: Sequence[str] = (),
        mismatched: Sequence[tuple[str, tuple[int, ...], tuple[int, ...]]] = (),
        reason: str | None = None,
    ) -> None:
        self.source = source
        self.missing = list(missing)
        self.unexpected = list(unexpected)
        self.mismatched = list(mismatched)
        lines = [f"cannot load weights from {source}" + (f": {reason}" if reason else "")]
        if self.missing:
            lines.append(f"missing tensors: {', '.join(self.missing)}")
        if self.unexpected:
            lines.append(f"unexpected tensors: {', '.join(self.unexpected)}")
        for name, want, got in self.mismatched:
            lines.append(f"misshapen tensor {name}: module expects {list(want)}, checkpoint has {list(got)}")
        super().__init__("\n".join(lines))


def read_safetensors(path: str | os.PathLike[str]) -> dict[str, Tensor]:
    """All tensors of a .safetensors file (CPU); never unpickles, errors name the file."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"weights file not found: {p}")
    try:
        return load_file(str(p))
    except (SafetensorError, OSError, ValueError) as exc:
        raise WeightLoadError(str(p), reason=f"not a readable safetensors file ({exc})") from exc


def load_safetensors_into(
    module: nn.Module,
    source: str | os.PathLike[str] | Mapping[str, Tensor],
    *,
    strict: bool = True,
    key_map: Callable[[str], str | None] | None = None,
) -> list[str]:
    """Copy checkpoint tensors into ``module``'s state dict; returns the names loaded.

    ``source`` is a .safetensors path or an already-read ``{name: tensor}`` dict. ``key_map``
    renames checkpoint keys to module keys (return None to drop one). Every missing or
    misshapen tensor is an error, and so is an unexpected one when ``strict``; all problems
    are reported together and nothing is copied unless all tensors fit. Tensors are cast to
    the dtype of the parameter they fill (build the module in the dtype you want first).
    """
    label = "<dict>" if isinstance(source, Mapping) else str(source)
    raw = dict(source) if isinstance(source, Mapping) else read_safetensors(source)
    tensors: dict[str, Tensor] = {}
    for name, tensor in raw.items():
        target = key_map(name) if key_map is not None else name
        if target is not None:
            tensors[target] = tensor
    expected = module.state_dict()
    missing = [n for n in expected if n not in tensors]
    unexpected = [n for n in tensors if n not in expected] if strict else []
    mismatched = [
        (n, tuple(expected[n].shape), tuple(t.shape))
        for n, t in tensors.items()
        if n in expected and tuple(t.shape) != tuple(expected[n].shape)
    ]
    if missing or unexpected or mismatched:
        raise WeightLoadError(label, missing, unexpected, mismatched)
    with torch.no_grad():
        for name, dest in expected.items():
            dest.copy_(tensors[name])  # state_dict tensors share storage with the module
    return list(expected)


def save_safetensors(module: nn.Module, path: str | os.PathLike[str], metadata: Mapping[str, str] | None = None) -> Path:
    """Write ``module``'s state dict as .safetensors (contiguous copies, so shared storage is fine)."""
    p = Path(path)
    tensors = {n: t.detach().contiguous().clone() for n, t in module.state_dict().items()}
    save_file(tensors, str(p), metadata=dict(metadata) if metadata else None)
    return p
