"""Performance baselines in sglang's ``perf_baselines.json`` schema, and the absolute perf check.

The schema is sglang's, so its published file loads as it is; every other key is a ConfigError naming
the file, the key and the nearest known one, and comments, ``metadata`` and the upstream keys parity
does not gate are kept and written back. A measurement has the shape of a scenario, so a median of
runs is written back unchanged. :func:`check_perf` compares raw values (``actual <= expected * (1 +
tol)``, at least ``expected + abs_floor_ms``): absolute times hold on a dedicated runner only, a
shared machine uses the A/B of :mod:`harness.perf.ab`. Scenarios belong to one machine, so they live
in ``platforms/perf/<platform>.json`` (:meth:`PerfBaselines.for_platform`) and an overlay's scenario
replaces the base one whole. The schema, the check and the overlay rules: docs/formats.md.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.baselines.platforms import find_overlay
from harness.baselines.tolerances import (
    ABS_FLOOR,
    MAX_MS,
    MAX_TOLERANCE,
    OPTIONAL_KEYS,
    TOLERANCE_KEYS,
    WALL,
    Tolerances,
    check_env_tolerances,
    env_tolerance,
    with_env_overrides,
)
from harness.errors import ConfigError
from harness.files.atomic import write_json_atomic
from harness.files.jsonio import (
    expect_id,
    expect_known_key,
    expect_known_keys,
    expect_number,
    expect_object,
    expect_str,
    join_key,
    read_json,
)

PROFILES: tuple[str, ...] = ("pr_test", "long_term")
_MAX_STEP_DIGITS = 6  # step keys are indices "0", "1", ...: a million steps is already absurd

E2E = "expected_e2e_ms"
AVG = "expected_avg_denoise_ms"
MEDIAN = "expected_median_denoise_ms"
STAGES = "stages_ms"
STEPS = "denoise_step_ms"
DISPERSION = "dispersion"
#: The profile an A/B verdict reads (how much slower HEAD may be than BASE); built in where a file has none.
AB_PROFILE = "ab"
DEFAULT_AB_TOLERANCES = Tolerances(
    e2e=0.05,
    denoise_stage=0.05,
    non_denoise_stage=0.25,
    denoise_step=0.15,
    denoise_agg=0.05,
    abs_floor_ms=0.5,
    wall=0.10,
)

#: sglang's keys (its perf_baselines.json and BaselineConfig of 2026) that parity keeps and writes back, not reads:
#: sglang gates load time and peak VRAM, which parity's pipelines do not measure.
UPSTREAM_TOP_KEYS: tuple[str, ...] = ("improvement_reporting", "sampling")
UPSTREAM_PROFILE_KEYS: tuple[str, ...] = ("load", "load_peak_vram", "runtime_peak_vram")
UPSTREAM_SCENARIO_KEYS: tuple[str, ...] = (
    "estimated_full_test_time_s",
    "expected_load_ms",
    "load_peak_vram_mb",
    "runtime_peak_vram_mb",
)
PER_FRAME = "per_frame_generation"  # in stages_ms: sglang's per-frame time of a video (a number or null), not a stage
_TOP_KEYS = ("metadata", "tolerances", "scenarios")
_SCENARIO_KEYS = (E2E, AVG, MEDIAN, STAGES, STEPS, DISPERSION)

PERF_BASE_FILE = "perf_baselines.json"
PERF_OVERLAY_DIR = Path("platforms") / "perf"


def perf_overlay_path(baselines_dir: str | Path, platform: str) -> Path:
    """Where the perf overlay of ``platform`` (a normalised device name) lives."""
    return Path(baselines_dir) / PERF_OVERLAY_DIR / f"{platform}.json"


def platform_matches(name: str, platform: str) -> bool:
    """Whether ``name`` is a token prefix of ``platform``: ``h100`` matches ``h100_80gb_hbm3``."""
    tokens, want = platform.split("_"), name.split("_")
    return bool(name) and tokens[: len(want)] == want


@dataclass(frozen=True)
class PerfCheck:
    """One compared value. ``actual`` is None when the measurement lacks it (then it fails)."""

    metric: str
    expected: float
    actual: float | None
    tol: float
    passed: bool
    limit: float


def is_denoise_stage(name: str) -> bool:
    """sglang names the denoising stage per pipeline (``DenoisingStage``, ``Ideogram4DenoisingStage``)."""
    return "denois" in name.lower()


def tolerance_category(label: str) -> str:
    """Which tolerance applies to a flattened value label (see :func:`scenario_values`)."""
    if label == E2E:
        return "e2e"
    if label in (AVG, MEDIAN):
        return "denoise_agg"
    group, _, name = label.partition(".")
    if group == STEPS:
        return "denoise_step"
    if group == STAGES:
        return "denoise_stage" if is_denoise_stage(name) else "non_denoise_stage"
    raise KeyError(f"not a perf value label: {label!r}")


def validate_scenario(scenario: Any, path: str | Path, key: str) -> dict[str, Any]:
    """Check a scenario (or a measured-results dict, same shape, which adds its extras); unknown keys are
    left alone here (a baselines file's are refused by :func:`_validate_document`)."""
    scenario = expect_object(scenario, path, key)
    if E2E not in scenario:
        raise ConfigError(f"missing required key '{E2E}'", path=path, key=key)
    for name in (E2E, AVG, MEDIAN):
        if name in scenario:
            expect_number(scenario[name], path, join_key(key, name), lo=0.0, hi=MAX_MS)
    for group in (STAGES, STEPS):
        values = expect_object(scenario.get(group, {}), path, join_key(key, group))
        for name, ms in values.items():
            if group == STAGES and name == PER_FRAME and ms is None:
                continue
            if group == STEPS and not (name.isascii() and name.isdigit() and len(name) <= _MAX_STEP_DIGITS):
                raise ConfigError(
                    f'step keys are string indices like "0", got {name[:40]!r}', path=path, key=join_key(key, group)
                )
            expect_number(ms, path, join_key(join_key(key, group), name), lo=0.0, hi=MAX_MS)
    for label, spread in expect_object(scenario.get(DISPERSION, {}), path, join_key(key, DISPERSION)).items():
        try:
            tolerance_category(label)
        except KeyError:
            raise ConfigError(
                f"not a perf value label: {label[:60]!r}", path=path, key=join_key(key, DISPERSION)
            ) from None
        expect_number(spread, path, join_key(join_key(key, DISPERSION), label), lo=0.0, hi=MAX_TOLERANCE)
    return scenario


def scenario_values(scenario: Mapping[str, Any]) -> dict[str, float]:
    """Flatten the checked values to ``{label: ms}``; labels: ``expected_e2e_ms``,
    ``stages_ms.<stage>``, ``denoise_step_ms.<i>``, ``expected_avg_denoise_ms``,
    ``expected_median_denoise_ms``. One flat view serves the check, recalibration and reports."""
    flat: dict[str, float] = {}
    if E2E in scenario:
        flat[E2E] = float(scenario[E2E])
    for group in (STAGES, STEPS):
        for name, ms in scenario.get(group, {}).items():
            if not (group == STAGES and name == PER_FRAME):
                flat[f"{group}.{name}"] = float(ms)
    for name in (AVG, MEDIAN):
        if name in scenario:
            flat[name] = float(scenario[name])
    return flat


def set_scenario_values(scenario: Mapping[str, Any], values: Mapping[str, float]) -> dict[str, Any]:
    """A copy of ``scenario`` with flattened ``{label: ms}`` written back (inverse of
    :func:`scenario_values`); unknown keys of the scenario are kept."""
    out = copy.deepcopy(dict(scenario))
    for label, ms in values.items():
        tolerance_category(label)  # refuses a label that is not a perf value
        group, dot, name = label.partition(".")
        if dot:
            out.setdefault(group, {})[name] = ms
        else:
            out[label] = ms
    if STEPS in out:  # keep steps in numeric order: "10" after "9", as sglang writes them
        out[STEPS] = dict(sorted(out[STEPS].items(), key=lambda kv: int(kv[0])))
    return out


def _is_untracked_aggregate(label: str, expected: float, scenario: Mapping[str, Any]) -> bool:
    return label in (AVG, MEDIAN) and expected == 0.0 and not scenario.get(STEPS)


def check_perf(
    scenario_expected: Mapping[str, Any],
    measured: Mapping[str, Any],
    tolerances: Tolerances,
) -> list[PerfCheck]:
    """Compare a measurement with its baseline scenario (the rules: docs/formats.md, Perf baselines).

    ``tolerances.abs_floor_ms`` widens every limit to at least ``expected + abs_floor_ms``; sglang's
    CI pads by 20 ms (120 ms for stages) so sub-millisecond stages do not flake. 0 is the plain
    relative rule.
    """
    expected_values = scenario_values(scenario_expected)
    actual_values = scenario_values(measured)
    checks = []
    for label, expected in expected_values.items():
        if _is_untracked_aggregate(label, expected, scenario_expected):
            continue
        tol = tolerances.get(tolerance_category(label))
        limit = max(expected * (1.0 + tol), expected + tolerances.abs_floor_ms)
        actual = actual_values.get(label)
        # inclusive, and immune to float rounding: 96 * 1.2 is 115.19999999999999, yet 115.2 is at the limit
        passed = actual is not None and (actual <= limit or math.isclose(actual, limit, rel_tol=1e-9))
        checks.append(PerfCheck(label, expected, actual, tol, passed, limit))
    return checks


def _validate_document(doc: Any, path: str) -> dict[str, Any]:
    doc = expect_object(doc, path, "")
    expect_known_keys(doc, _TOP_KEYS, path, "", UPSTREAM_TOP_KEYS)
    for key in UPSTREAM_TOP_KEYS:
        if key in doc:
            expect_object(doc[key], path, key)
    metadata = expect_object(doc.get("metadata", {}), path, "metadata")
    if "hardware" in metadata:
        expect_str(metadata["hardware"], path, "metadata.hardware")
    tolerances = expect_object(doc.get("tolerances", {}), path, "tolerances")
    for profile, values in tolerances.items():
        profile_key = join_key("tolerances", profile)
        expect_known_key(profile, (*PROFILES, AB_PROFILE), (), path, profile_key)
        values = expect_object(values, path, profile_key)
        expect_known_keys(values, (*TOLERANCE_KEYS, *OPTIONAL_KEYS), path, profile_key, UPSTREAM_PROFILE_KEYS)
        for name in (*TOLERANCE_KEYS, *OPTIONAL_KEYS, *UPSTREAM_PROFILE_KEYS):
            if name in values:
                expect_number(
                    values[name],
                    path,
                    join_key(profile_key, name),
                    lo=0.0,
                    hi=MAX_MS if name == ABS_FLOOR else MAX_TOLERANCE,
                )
    if "platform" in metadata:
        expect_str(metadata["platform"], path, "metadata.platform")
    scenarios = expect_object(doc.get("scenarios", {}), path, "scenarios")
    for scenario_id, scenario in scenarios.items():
        scenario_key = join_key("scenarios", scenario_id)
        expect_id(scenario_id, path, scenario_key, "scenario id")
        validate_scenario(scenario, path, scenario_key)
        expect_known_keys(scenario, _SCENARIO_KEYS, path, scenario_key, UPSTREAM_SCENARIO_KEYS)
        for key in UPSTREAM_SCENARIO_KEYS:
            if key in scenario:
                expect_number(scenario[key], path, join_key(scenario_key, key), lo=0.0)
    return doc


def _merge_overlay(merged: dict[str, Any], overlay: dict[str, Any]) -> None:
    """Merge a validated overlay into ``merged`` in place (the rules: docs/formats.md, Perf baselines)."""
    for key, value in overlay.items():
        if key == "metadata":
            merged.setdefault("metadata", {}).update(value)
        elif key == "tolerances":
            for profile, values in value.items():
                merged.setdefault("tolerances", {}).setdefault(profile, {}).update(values)
        elif key == "scenarios":
            merged.setdefault("scenarios", {}).update(value)
        else:
            merged[key] = value


class PerfBaselines:
    """A base perf file with zero or more per-hardware overlays merged over it (last wins)."""

    def __init__(self, doc: dict[str, Any], paths: Sequence[str]) -> None:
        self._doc = doc
        self.paths = list(paths)

    @classmethod
    def load(cls, base_path: str | Path, overlays: Sequence[str | Path] = ()) -> PerfBaselines:
        """Read and validate each file, then merge the overlays over the base in order."""
        paths = [str(p) for p in [base_path, *overlays]]
        merged = _validate_document(read_json(paths[0]), paths[0])
        for p in paths[1:]:
            _merge_overlay(merged, _validate_document(read_json(p), p))
        return cls(merged, paths)

    @classmethod
    def for_platform(cls, baselines_dir: str | Path, platform: str) -> PerfBaselines:
        """What ``platform`` gates against: the base file's tolerances, its scenarios only when
        its ``metadata.platform`` matches, then the most specific overlay of ``platform``.

        A missing base file is a ConfigError (the tolerances live there); no scenarios in the
        result means this machine has no perf baseline.
        """
        base_path = Path(baselines_dir) / PERF_BASE_FILE
        merged = _validate_document(read_json(base_path), str(base_path))
        if not platform_matches(merged.get("metadata", {}).get("platform", ""), platform):
            merged["scenarios"] = {}
        paths = [str(base_path)]
        overlay = find_overlay(Path(baselines_dir) / PERF_OVERLAY_DIR, platform)
        if overlay is not None:
            _merge_overlay(merged, _validate_document(read_json(overlay), str(overlay)))
            paths.append(str(overlay))
        return cls(merged, paths)

    @classmethod
    def from_json(cls, doc: Any, path: str = "<memory>") -> PerfBaselines:
        """Validate an in-memory document (``path`` only labels errors)."""
        return cls(_validate_document(copy.deepcopy(doc), path), [path])

    @property
    def scenario_ids(self) -> list[str]:
        """Scenario ids in file order."""
        return list(self._doc.get("scenarios", {}))

    def scenario(self, scenario_id: str) -> dict[str, Any] | None:
        """A copy of the scenario, or None when it has no baseline (callers report that as
        'no baseline', which is not a pass)."""
        found = self._doc.get("scenarios", {}).get(scenario_id)
        return copy.deepcopy(found) if found is not None else None

    def tolerances(self, profile: str = "pr_test", env: Mapping[str, str] | None = None) -> Tolerances:
        """The profile's tolerances, each overridable by ``PARITY_PERF_TOL_<KEY>`` (all of which are checked);
        the A/B profile falls back to :data:`DEFAULT_AB_TOLERANCES` where the files have none."""
        check_env_tolerances(env)
        where = " + ".join(self.paths)
        profiles = self._doc.get("tolerances", {})
        if profile == AB_PROFILE and profile not in profiles:
            return with_env_overrides(DEFAULT_AB_TOLERANCES, env)
        if profile not in profiles:
            raise ConfigError(
                f"no tolerance profile {profile!r}; found {sorted(profiles)}", path=where, key="tolerances"
            )
        given = profiles[profile]
        values: dict[str, float | None] = {name: float(given.get(name, 0.0)) for name in (*TOLERANCE_KEYS, ABS_FLOOR)}
        values[WALL] = float(given[WALL]) if WALL in given else None
        for name in TOLERANCE_KEYS:
            if name not in profiles[profile] and env_tolerance(name, env) is None:
                raise ConfigError("missing tolerance", path=where, key=f"tolerances.{profile}.{name}")
        return with_env_overrides(Tolerances(**values), env)

    def with_scenario(self, scenario_id: str, scenario: Mapping[str, Any]) -> PerfBaselines:
        """A copy with one scenario replaced (or added), validated first."""
        doc = copy.deepcopy(self._doc)
        label = self.paths[-1] if self.paths else "<memory>"
        doc.setdefault("scenarios", {})[scenario_id] = validate_scenario(
            copy.deepcopy(dict(scenario)), label, join_key("scenarios", scenario_id)
        )
        return PerfBaselines(doc, self.paths)

    def to_json(self) -> dict[str, Any]:
        """The merged document (for one file: exactly its content, unknown keys and order kept)."""
        return copy.deepcopy(self._doc)

    def save(self, path: str | Path, backup: bool = True) -> None:
        """Write :meth:`to_json` atomically, keeping ``path.bak`` of the previous file."""
        write_json_atomic(path, self.to_json(), backup=backup)
