"""``backend.selection_precedence``: every level of the backend selector beats every level below it.

Levels, highest first: explicit argument > global force > component+role override >
component override > global setting > the layer's default > platform default. For each level
the contract sets that level to backend X and every lower level to Y (two distinct backends
available here) and checks X is chosen. It also checks that an unknown name is a ValueError
listing the valid names and that a strict (component) override that cannot be honoured is an
error rather than a silent fallback, while a soft level (the global setting) falls back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from harness.contracts.judging import RankOutcome
from harness.contracts.params import Param, ParamError, Params
from harness.contracts.registry import Contract, RankContext, register
from harness.targets.base import AttentionSpec, Capability

_COMPONENT = "parity_component"

# (level, how to set it to a backend: spec changes and backend_config items)
_LEVELS: tuple[tuple[str, Callable[[str], tuple[dict[str, Any], dict[str, str]]]], ...] = (
    ("explicit argument", lambda b: ({"backend": b}, {})),
    ("global force", lambda b: ({}, {"force": b})),
    ("component+role override", lambda b: ({}, {f"{_COMPONENT}.self": b})),
    ("component override", lambda b: ({}, {_COMPONENT: b})),
    ("global setting", lambda b: ({}, {"default": b})),
    ("layer default", lambda b: ({"default_backend": b}, {})),
)


def _spec_at(base: AttentionSpec, top: int, x: str, y: str) -> AttentionSpec:
    """Level ``top`` set to ``x``, every level below it to ``y``, levels above it unset."""
    changes: dict[str, Any] = {"component": _COMPONENT}
    config: dict[str, str] = {}
    for index, (_, setter) in enumerate(_LEVELS[top:], start=top):
        spec_changes, config_items = setter(x if index == top else y)
        changes.update(spec_changes)
        config.update(config_items)
    changes["backend_config"] = ",".join(f"{k}={v}" for k, v in config.items()) or None
    return base.with_(**changes)


def _check_backends(p: Params) -> None:
    if len(p.backends) != 2 or p.backends[0] == p.backends[1]:
        raise ParamError("backends", f"needs two distinct backend names, got {p.backends}")


def selection_precedence(ctx: RankContext, p: Params) -> RankOutcome:
    x, y = p.backends
    base = AttentionSpec(num_heads=p.heads, head_dim=p.head_dim, dtype=p.torch_dtype)
    problems: list[str] = []
    checks = 0
    for backend in (x, y):  # both must run here, or the levels cannot be told apart
        ctx.target.make_attention(base.with_(backend=backend))  # Unsupported (a skip) when unavailable
    for top, (level, _) in enumerate(_LEVELS):
        for want, other in ((x, y), (y, x)):
            checks += 1
            got = ctx.target.make_attention(_spec_at(base, top, want, other)).backend
            if got != want:
                problems.append(f"{level} set to {want} (lower levels {other}) chose {got}")

    def expect_error(label: str, spec: AttentionSpec, must_mention: tuple[str, ...]) -> None:
        nonlocal checks
        checks += 1
        try:
            chosen = ctx.target.make_attention(spec).backend
        except ValueError as exc:
            missing = [m for m in must_mention if m not in str(exc)]
            if missing:
                problems.append(f"{label}: the ValueError does not mention {missing}: {exc}")
            return
        problems.append(f"{label}: no ValueError (chose {chosen})")

    expect_error("unknown explicit backend", base.with_(backend="no_such_backend"), tuple(p.valid_names))
    expect_error(
        "unknown name in the global setting", base.with_(backend_config="default=no_such_backend"), tuple(p.valid_names)
    )
    expect_error(
        "component override outside the layer's supported set",
        base.with_(component=_COMPONENT, backend_config=f"{_COMPONENT}={y}", supported_backends=(x,)),
        (y,),
    )
    checks += 1
    fallback = ctx.target.make_attention(base.with_(backend_config=f"default={y}", supported_backends=(x,))).backend
    if fallback != x:
        problems.append(f"global setting {y} outside the supported set ({x}) chose {fallback}, not a fallback to {x}")
    return RankOutcome(problems=problems, checks=checks)


register(
    Contract(
        "backend.selection_precedence",
        "backend selector: each precedence level beats every level below it; unknown names are a ValueError "
        "listing the valid names; a strict component override that cannot be honoured is an error",
        (
            Param("world_size", "int", 1, "ranks (the check is rank-local)"),
            Param("backends", "str_list", ["torch_sdpa", "math"], "two distinct backends available here"),
            Param(
                "valid_names",
                "str_list",
                ["torch_sdpa", "fa", "sage_attn", "math"],
                "names an unknown-name error must list",
            ),
            Param("heads", "int", 4, "query heads"),
            Param("head_dim", "int", 32, "head dim"),
            Param("dtype", "dtype", "fp32", "dtype the layers are built for"),
        ),
        selection_precedence,
        requires=frozenset({Capability.BACKEND_CHOICE, Capability.BACKEND_SELECTION}),
        checks=(_check_backends,),
    )
)
