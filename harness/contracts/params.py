"""Contract parameters: declaration, type checking, defaults and the checks every case gets.

A contract declares its parameters as :class:`Param` entries; :func:`resolve` turns the raw
values of a case (from TOML, the CLI or ``assert_contract``) into :class:`Params`, or raises
:class:`ParamError` naming the offending key, so a bad case file is refused before any rank
starts.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from harness.errors import ParamError
from harness.files.documents import INT_MAX, INT_MIN, out_of_range

REQUIRED: Any = object()

DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp64": torch.float64,
}
# The dtypes the reference models and the tiny pipeline run in, under their (torch) long names.
LONG_DTYPE = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def long_dtype_check(what: str) -> Callable[[Params], None]:
    """A contract check: the case's dtype is one ``what`` (the models, the pipeline) runs in."""

    def check(p: Params) -> None:
        if p.dtype not in LONG_DTYPE:
            raise ParamError("dtype", f"{what} in {', '.join(LONG_DTYPE)}, not {p.dtype}")

    return check


_DTYPE_ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float64": "fp64"}

#: torch's SDPA kernels a case may pin (torch.nn.attention.SDPBackend: MATH, FLASH_ATTENTION, EFFICIENT_ATTENTION, CUDNN_ATTENTION).
SDPA_KERNELS = ("math", "flash", "efficient", "cudnn")

KINDS = ("int", "float", "bool", "str", "int_list", "str_list", "dtype")

#: The most ranks a case may ask for. A fixed number, not this host's process limit, so a case file
#: is valid or invalid the same way on every machine; 1024 is beyond any sequence-parallel group
#: run today (sglang's largest is 8 GPUs x a few nodes) and still spawnable in principle.
MAX_WORLD_SIZE = 1024
#: Largest batch, heads, kv_heads and head_dim; largest total token count. Beyond these a case is a
#: typo that would allocate until the rank is killed, not a shape.
MAX_DIM = 65536
MAX_TOKENS = 2**24
MAX_SOFTMAX_SCALE = 64.0  # beyond it every row is one-hot in any dtype: nothing left to compare


class Params(dict):
    """Resolved parameters: a plain dict (picklable) with attribute access for contract bodies."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self["dtype"]]


@dataclass(frozen=True)
class Param:
    """One parameter. ``default`` may be REQUIRED, a value, None (optional) or ``fn(params_so_far)``."""

    name: str
    kind: str
    default: Any = REQUIRED
    doc: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"parameter {self.name}: unknown kind {self.kind!r}; valid: {', '.join(KINDS)}")


def canonical_dtype(value: str) -> str:
    name = _DTYPE_ALIASES.get(value, value)
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {value!r}; valid: {', '.join(DTYPES)} (or {', '.join(_DTYPE_ALIASES)})")
    return name


def _check_kind(param: Param, value: Any) -> Any:
    kind = param.kind
    if kind == "int" and isinstance(value, int) and not isinstance(value, bool):
        if not INT_MIN <= value <= INT_MAX:
            raise ParamError(param.name, out_of_range(value))
        return value
    if kind == "float" and isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(float(value)):
            raise ParamError(param.name, f"must be a finite number, got {value!r}")
        return float(value)
    if kind == "bool" and isinstance(value, bool):
        return value
    if kind in ("str", "dtype") and isinstance(value, str):
        if kind == "dtype":
            try:
                return canonical_dtype(value)
            except ValueError as exc:
                raise ParamError(param.name, str(exc)) from None
        return value
    if kind == "int_list" and isinstance(value, (list, tuple)):
        if all(isinstance(v, int) and not isinstance(v, bool) and INT_MIN <= v <= INT_MAX for v in value):
            return list(value)
    if kind == "str_list" and isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return list(value)
    expected = {"int_list": "a list of integers", "str_list": "a list of strings", "dtype": "a dtype name"}.get(
        kind, kind
    )
    raise ParamError(param.name, f"expected {expected}, got {type(value).__name__} {value!r}")


def resolve(
    declared: Sequence[Param],
    raw: Mapping[str, Any],
    checks: Sequence[Callable[[Params], None]] = (),
    completions: Sequence[Callable[[Params], None]] = (),
) -> Params:
    """Type-check ``raw`` against ``declared``, fill defaults in declaration order, fill the parameters derived
    from others (``completions``, which refuse what they cannot complete), then run ``checks``, which only read."""
    names = [p.name for p in declared]
    for key in raw:
        if key not in names:
            raise ParamError(key, f"unknown parameter; valid: {', '.join(names)}")
    params = Params()
    for param in declared:
        if param.name in raw:
            params[param.name] = _check_kind(param, raw[param.name])
        elif param.default is REQUIRED:
            raise ParamError(param.name, "missing required parameter")
        elif callable(param.default):
            params[param.name] = param.default(params)
        else:
            params[param.name] = param.default
    for complete in completions:
        complete(params)
    for check in checks:
        check(params)
    return params


# ------------------------------------------------------------------ the standard parameter sets

PARALLEL = (Param("world_size", "int", doc="number of ranks W"),)


def degrees(ring_default: Callable[[Params], int] | int = 1) -> tuple[Param, ...]:
    """ring_degree (default per contract) and ulysses_degree (default W / ring_degree)."""
    return (
        Param("ring_degree", "int", ring_default, "ring degree R"),
        Param(
            "ulysses_degree", "int", lambda p: max(1, p["world_size"] // max(1, p["ring_degree"])), "Ulysses degree U"
        ),
    )


SHAPE = (
    Param("batch", "int", 1, "batch size B"),
    Param("tokens", "int", None, "total sharded tokens (must divide by world_size); or give tokens_per_rank"),
    Param("tokens_per_rank", "int", None, "sharded tokens per rank (default 16)"),
    Param("heads", "int", 4, "query heads H"),
    Param("kv_heads", "int", lambda p: p["heads"], "K/V heads (GQA when fewer than heads)"),
    Param("head_dim", "int", 32, "head dim D"),
)

NUMERIC = (
    Param("dtype", "dtype", "fp32", "fp32, bf16, fp16 or fp64"),
    Param("causal", "bool", False, "causal attention"),
    Param(
        "softmax_scale",
        "float",
        None,
        "the scale of QKᵀ passed to the layer (default 1/√head_dim, the layer's own); large values make logits "
        "large (block LSEs past 100: an unshifted LSE merge overflows fp32)",
    ),
    Param("seed", "int", 0, "seed of the inputs (every rank generates the same ones)"),
    Param("backend", "str", None, "kernel family (reference: torch_sdpa, fa, sage_attn, math); default: the target's"),
    Param("sdpa_kernel", "str", None, "pin torch SDPA to math, flash, efficient or cudnn"),
)


DETERMINISTIC = Param(
    "deterministic",
    "bool",
    False,
    "the target's calls and backward under torch.use_deterministic_algorithms(True): a torch kernel with a "
    "deterministic mode uses it (SDPA's flash backward does); one without refuses and the case is skipped",
)


def bound_param(default: str) -> Param:
    return Param("bound", "str", default, "bitwise, abs:X or fa[:K[:FLOOR[:ULPS]]]")


def complete_tokens(params: Params) -> None:
    """``tokens`` and ``tokens_per_rank`` from whichever is given (16 a rank when neither is), for a case that
    shards tokens; what cannot be completed is refused here (a world size out of range is check_common's)."""
    if "tokens_per_rank" not in params:
        return
    world, tokens, per_rank = params.get("world_size"), params.get("tokens"), params["tokens_per_rank"]
    if tokens is not None and per_rank is not None:
        raise ParamError("tokens", "give tokens or tokens_per_rank, not both")
    if not isinstance(world, int) or not 1 <= world <= MAX_WORLD_SIZE:
        return
    if tokens is not None and tokens % world:
        raise ParamError("tokens", f"{tokens} tokens are not divisible by world_size {world}")
    params["tokens_per_rank"] = tokens // world if tokens is not None else per_rank if per_rank is not None else 16
    params["tokens"] = params["tokens_per_rank"] * world
    if params["tokens_per_rank"] < 1:
        raise ParamError("tokens_per_rank", f"must be >= 1, got {params['tokens_per_rank']}")
    if params["tokens"] > MAX_TOKENS:
        key = "tokens" if tokens is not None else "tokens_per_rank"
        raise ParamError(key, f"{params['tokens']} tokens in all; at most {MAX_TOKENS}")


def check_common(params: Params) -> None:
    """Consistency every case gets: degrees, token counts and head counts that the world size divides."""
    world = params.get("world_size")
    if world is not None and not 1 <= world <= MAX_WORLD_SIZE:
        raise ParamError("world_size", f"must be in [1, {MAX_WORLD_SIZE}], got {world}")
    scale = params.get("softmax_scale")
    if scale is not None and not 0 < scale <= MAX_SOFTMAX_SCALE:
        raise ParamError("softmax_scale", f"must be in (0, {MAX_SOFTMAX_SCALE:g}], got {scale}")
    kernel = params.get("sdpa_kernel")
    if kernel is not None and kernel not in SDPA_KERNELS:
        raise ParamError("sdpa_kernel", f"unknown SDPA kernel {kernel!r}; valid: {', '.join(SDPA_KERNELS)}")
    if "ring_degree" in params:
        ring, ulysses = params["ring_degree"], params["ulysses_degree"]
        if ring < 1 or ulysses < 1 or ring * ulysses != world:
            raise ParamError(
                "ulysses_degree", f"ulysses_degree ({ulysses}) × ring_degree ({ring}) must equal world_size ({world})"
            )
    for key in ("heads", "kv_heads", "head_dim", "batch"):
        if isinstance(params.get(key), int) and not 1 <= params[key] <= MAX_DIM:
            raise ParamError(key, f"must be in [1, {MAX_DIM}], got {params[key]}")
    if "kv_heads" in params:
        heads, kv_heads = params["heads"], params["kv_heads"]
        ulysses = params.get("ulysses_degree", world or 1)
        if heads % kv_heads:
            raise ParamError("kv_heads", f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
        if heads % ulysses:
            raise ParamError("heads", f"{heads} heads are not divisible by the Ulysses degree {ulysses}")
        if kv_heads % ulysses:
            raise ParamError("kv_heads", f"{kv_heads} kv_heads are not divisible by the Ulysses degree {ulysses}")
