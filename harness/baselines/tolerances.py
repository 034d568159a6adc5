"""The perf check's tolerances: the relative slack per value family, from a baselines profile or the environment.

A CI lane on a noisy runner overrides a profile's value with one variable per key:
``PARITY_PERF_TOL_{E2E,DENOISE_STAGE,NON_DENOISE_STAGE,DENOISE_STEP,DENOISE_AGG,WALL}`` (fractions:
``0.2`` = 20 %) and ``PARITY_PERF_TOL_ABS_FLOOR_MS`` (ms). ``wall`` is parity's own family (``e2e``'s
value where absent): its wall clock of a run, which for a command includes start-up and loading
(±12 % per pair for a 0.12 s command on an H200 host, the command's own timings ±2 %).
:func:`check_env_tolerances` refuses an out-of-range value or an unknown ``PARITY_PERF_TOL_*`` name
(a typo would be ignored) before any stage runs.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

from harness.baselines.named import NamedValues
from harness.errors import ConfigError

__all__ = [
    "TOLERANCE_KEYS",
    "ABS_FLOOR",
    "WALL",
    "OPTIONAL_KEYS",
    "ENV_PREFIX",
    "MAX_TOLERANCE",
    "MAX_MS",
    "Tolerances",
    "env_tolerance",
    "check_env_tolerances",
    "with_env_overrides",
]

TOLERANCE_KEYS: tuple[str, ...] = ("e2e", "denoise_stage", "non_denoise_stage", "denoise_step", "denoise_agg")
WALL = "wall"
ABS_FLOOR = "abs_floor_ms"
OPTIONAL_KEYS: tuple[str, ...] = (WALL, ABS_FLOOR)  # a profile may leave them out
ENV_PREFIX = "PARITY_PERF_TOL_"
#: The largest relative tolerance (a lane that means "do not gate this" can say 1e5); with MAX_MS it keeps
#: every limit ``expected * (1 + tol)`` finite, where 1e308 would overflow into a limit that passes anything.
MAX_TOLERANCE = 1e6
#: The longest time a perf value may hold (about 11.6 days): above it a value is not a timing, and
#: ``expected * (1 + tol)`` would overflow to a limit that passes everything.
MAX_MS = 1e9


@dataclass(frozen=True)
class Tolerances(NamedValues, names=(*TOLERANCE_KEYS, WALL), what="tolerance"):
    """Relative slack per metric family (0.2 = the value may be 20 % above its baseline); ``get`` by family."""

    e2e: float
    denoise_stage: float
    non_denoise_stage: float
    denoise_step: float
    denoise_agg: float
    abs_floor_ms: float = 0.0
    wall: float | None = None  # None: as e2e

    def get(self, name: str) -> float:
        return self.e2e if name == WALL and self.wall is None else super().get(name)


def _env_name(key: str) -> str:
    return ENV_PREFIX + key.upper()


def env_tolerance(key: str, env: Mapping[str, str] | None = None) -> float | None:
    """The override of ``key`` (a tolerance key or ``abs_floor_ms``) from the environment, None when unset."""
    env = os.environ if env is None else env
    raw = env.get(_env_name(key))
    if raw is None or raw.strip() == "":
        return None
    hi = MAX_MS if key == ABS_FLOOR else MAX_TOLERANCE
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0.0 <= value <= hi):
        raise ConfigError(f"environment variable must be a number in [0, {hi:g}], got {raw!r}", key=_env_name(key))
    return value


def with_env_overrides(tolerances: Tolerances, env: Mapping[str, str] | None = None) -> Tolerances:
    """``tolerances`` with every ``PARITY_PERF_TOL_*`` variable that is set in place of its value."""
    overrides = {
        key: value for key in (*TOLERANCE_KEYS, *OPTIONAL_KEYS) if (value := env_tolerance(key, env)) is not None
    }
    return dataclasses.replace(tolerances, **overrides)


def check_env_tolerances(env: Mapping[str, str] | None = None) -> None:
    """Every ``PARITY_PERF_TOL_*`` variable set: a known name with a valid value (ConfigError naming it otherwise)."""
    env = os.environ if env is None else env
    known = {_env_name(k): k for k in (*TOLERANCE_KEYS, *OPTIONAL_KEYS)}
    for name in sorted(env):
        if name.startswith(ENV_PREFIX):
            if name not in known:
                raise ConfigError(f"unknown variable; valid: {', '.join(known)}", key=name)
            env_tolerance(known[name], env)
