"""Building blocks shared by the reference models (DiTs, text encoder, VAE).

- :class:`ModelConfig`: a frozen-dataclass base whose ``from_dict`` refuses unknown, missing or mistyped keys
  with an error naming the key, so a bad config never builds a wrong model.
- :class:`RMSNorm`, with or without an affine weight (``elementwise_affine=False``: some VAEs' q/k norm).
- RoPE: 1-D and axial (2-D/3-D) cos/sin tables, rounded where the followed implementation rounds them
  (:data:`ROPE_ROUNDINGS`), applied to ``[B, S, H, D]`` in fp32 at explicit positions, so a sequence-parallel
  shard passes its tokens' *global* positions and gets exactly the single-rank rotation.
- :func:`timestep_embedding` (sinusoidal), :func:`even_shard_bounds` (the contiguous tokens a rank holds), and
  :func:`load_safetensors_into`: no pickle; every missing, unexpected or misshapen tensor named before any is copied.
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
M = TypeVar("M", bound=nn.Module)


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
            raise ModelConfigError(
                f"must be a finite number, got {value if number != math.inf else 'a huge integer'!r}", key
            )
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

    @classmethod
    def from_diffusers(cls: type[C], config: Mapping[str, Any]) -> C:
        """Build from a diffusers ``config.json`` dict: its bookkeeping keys (``_class_name``,
        ``_diffusers_version``, ``_use_default_values``: every key starting with ``_``) are
        dropped, the rest checked as :meth:`from_dict` checks them."""
        if not isinstance(config, Mapping):
            raise ModelConfigError(f"{cls.__name__} config must be a mapping, got {type(config).__name__}")
        return cls.from_dict({k: v for k, v in config.items() if not str(k).startswith("_")})

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly dict that ``from_dict`` reads back."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}


# ---------------------------------------------------------------------------- norms
class RMSNorm(nn.Module):
    """RMS normalisation over the last dim in fp32 (fp64 for fp64 input), rounded where diffusers rounds.

    A half-precision weight multiplies the normalised input after it is rounded to the weight's
    dtype (diffusers' ``RMSNorm``, transformers' ``Qwen3RMSNorm``); an fp32/fp64 weight multiplies
    it unrounded, and the result is cast back once. ``elementwise_affine=False`` has no parameters
    at all (nothing to load), which is what an affine-free q/k norm means; with it, the learned
    weight starts at ones.
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
        if self.weight is not None and self.weight.dtype in (torch.float16, torch.bfloat16):
            y = y.to(self.weight.dtype) * self.weight
        elif self.weight is not None:
            y = y * self.weight.to(x32.dtype)
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, elementwise_affine={self.weight is not None}"


# ---------------------------------------------------------------------------- RoPE
# Where a table below fp64 is rounded: a reference model must round where the implementation
# whose weights it runs does, or its tables differ by up to 1.5e-5 near position 513.
ROPE_ROUNDINGS = ("fp64", "fp32_angles", "fp32")


def rope_cos_sin(
    positions: Tensor, dim: int, theta: float = 10000.0, dtype: torch.dtype = torch.float32, rounding: str = "fp64"
) -> tuple[Tensor, Tensor]:
    """cos/sin tables ``[S, dim // 2]`` for 1-D positions ``[S]`` in ``dtype``.

    ``rounding`` says where a table below fp64 is rounded:

    - ``fp64``: frequencies, angles, cos and sin in fp64, rounded once (the most accurate table);
    - ``fp32_angles``: frequencies and angles in fp64, the angle rounded to fp32, cos/sin taken
      in fp32 through ``torch.polar`` (diffusers' Z-Image ``RopeEmbedder``; polar's cos can differ
      from ``torch.cos`` by an ulp);
    - ``fp32``: frequencies, angles, cos and sin all in fp32 (diffusers' ``get_1d_rotary_pos_embed``,
      HunyuanVideo).

    An fp64 ``dtype`` always gets the fp64 table: that is the oracle's, whose only rounding is fp64's.
    """
    if dim % 2:
        raise ValueError(f"RoPE dim must be even, got {dim}")
    if positions.dim() != 1:
        raise ValueError(f"positions must be [S], got shape {tuple(positions.shape)}")
    if rounding not in ROPE_ROUNDINGS:
        raise ValueError(f"unknown RoPE rounding {rounding!r}; valid: {', '.join(ROPE_ROUNDINGS)}")
    if dtype == torch.float64:
        rounding = "fp64"
    freqs_dtype = torch.float32 if rounding == "fp32" else torch.float64
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=freqs_dtype, device=positions.device) / dim)
    angles = torch.outer(positions.to(freqs_dtype), inv_freq)
    if rounding == "fp32_angles":
        rotation = torch.polar(torch.ones_like(angles.float()), angles.float())
        return rotation.real.to(dtype), rotation.imag.to(dtype)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def axial_rope_cos_sin(
    positions: Tensor,
    axes_dims: Sequence[int],
    theta: float = 10000.0,
    dtype: torch.dtype = torch.float32,
    rounding: str = "fp64",
) -> tuple[Tensor, Tensor]:
    """Axial RoPE (2-D/3-D DiTs): axis ``i`` of ``positions [S, n_axes]`` rotates ``axes_dims[i]`` channels.

    Returns cos/sin ``[S, sum(axes_dims) // 2]``: each axis' table, concatenated in axis order.
    """
    if positions.dim() != 2 or positions.shape[1] != len(axes_dims):
        raise ValueError(
            f"positions must be [S, {len(axes_dims)}] for axes_dims {list(axes_dims)}, got {tuple(positions.shape)}"
        )
    tables = [rope_cos_sin(positions[:, i], d, theta, dtype, rounding) for i, d in enumerate(axes_dims)]
    return torch.cat([c for c, _ in tables], dim=-1), torch.cat([s for _, s in tables], dim=-1)


def grid_positions(
    sizes: Sequence[int], offsets: Sequence[int] | None = None, device: torch.device | str | None = None
) -> Tensor:
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
        raise ValueError(
            f"RoPE tables {tuple(cos.shape)} do not fit x {tuple(x.shape)} (need [..., {x.shape[1]}, {half}])"
        )
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


def apply_rope_complex(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """:func:`apply_rope` (interleaved) as a complex multiply, the way diffusers' Z-Image rotates q and k.

    Channels (2i, 2i+1) are one complex number, multiplied by ``cos + i·sin`` in complex64
    (complex128 for fp64 input); the result is in x's dtype. The value is the real rotation's,
    but the CPU's vectorised complex multiply rounds differently from four real products: it
    differs from :func:`apply_rope` by an ulp wherever ``D/2`` is not a multiple of the vector
    width (head dims 8, 24, 36 on this CPU), so a model that follows diffusers must multiply here.
    """
    if x.dim() != 4:
        raise ValueError(f"apply_rope_complex expects [B, S, H, D], got shape {tuple(x.shape)}")
    half = x.shape[-1] // 2
    if cos.shape[-1] != half or cos.shape[-2] != x.shape[1]:
        raise ValueError(
            f"RoPE tables {tuple(cos.shape)} do not fit x {tuple(x.shape)} (need [..., {x.shape[1]}, {half}])"
        )
    compute = torch.promote_types(x.dtype, torch.float32)  # fp32, or fp64 for an fp64 reference
    rotation = torch.complex(cos.to(compute), sin.to(compute)).unsqueeze(-2)  # broadcast over heads
    if rotation.dim() == 3:
        rotation = rotation.unsqueeze(0)
    pairs = torch.view_as_complex(x.to(compute).reshape(*x.shape[:-1], half, 2))
    return torch.view_as_real(pairs * rotation).flatten(3).to(x.dtype)


# ---------------------------------------------------------------------------- timesteps
def timestep_embedding(t: Tensor, dim: int, max_period: float = 10000.0) -> Tensor:
    """Sinusoidal embedding ``[N, dim]`` of ``t [N]`` in fp32, the cos half first.

    The arithmetic of diffusers' ``get_timestep_embedding(flip_sin_to_cos=True,
    downscale_freq_shift=0)`` (HunyuanVideo) and of Z-Image's ``TimestepEmbedder``: they agree bit for bit.
    """
    if dim % 2:
        raise ValueError(f"timestep embedding dim must be even, got {dim}")
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t.reshape(-1).float()[:, None] * freqs[None]
    return torch.cat([args.cos(), args.sin()], dim=-1)


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


def build_and_load(
    build: Callable[[], M],
    source: str | os.PathLike[str] | Mapping[str, Tensor],
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> M:
    """``build()`` without initialising it (on the meta device), then fill every tensor from ``source``.

    Loading is strict (see :func:`load_safetensors_into`), so no tensor keeps the undefined
    values ``to_empty`` leaves; a real-sized model is never randomly initialised first.
    """
    with torch.device("meta"):
        module = build()
    module = module.to(dtype).to_empty(device=device)
    load_safetensors_into(module, source)
    return module


def save_safetensors(
    module: nn.Module, path: str | os.PathLike[str], metadata: Mapping[str, str] | None = None
) -> Path:
    """Write ``module``'s state dict as .safetensors (contiguous copies, so shared storage is fine)."""
    p = Path(path)
    tensors = {n: t.detach().contiguous().clone() for n, t in module.state_dict().items()}
    save_file(tensors, str(p), metadata=dict(metadata) if metadata else None)
    return p
