"""The 15 kinds of input parity reads, each with a legitimate example and its real loader.

A *project* (:func:`build_project`) is a temp directory holding one valid file of every kind;
a hostile case replaces one of them and runs that kind's ``load`` (the loaders the gate,
``parity recalibrate``, ``parity matrix`` and ``parity bless`` use, and the steps after them
that once crashed on a bad value: threshold lookups, recalibration proposals, perf limits,
rendering). Two kinds are environment variables, not files (``env`` is then what is replaced).
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

PLATFORM = "testbox"  # the platform whose overlays the project holds
CASE = "case_a"

THRESHOLDS = {
    "_comment": "kept, as sglang's files have one",
    **{
        f"default_{m}_threshold_{k}": v
        for k in ("image", "video")
        for m, v in (("clip", 0.9), ("ssim", 0.9), ("psnr", 25.0), ("mean_abs_diff", 8.0))
    },
    "cases": {
        CASE: {"clip_threshold": 0.9, "ssim_threshold": 0.9, "psnr_threshold": 25, "mean_abs_diff_threshold": 8.0}
    },
}
THRESHOLD_OVERLAY = {"_comment": "an overlay", "cases": {CASE: {"psnr_threshold": 30.0}}}
_PROFILE = {
    "e2e": 0.25,
    "denoise_stage": 0.25,
    "non_denoise_stage": 0.8,
    "denoise_step": 0.3,
    "denoise_agg": 0.2,
    "abs_floor_ms": 1.0,
}
PERF_BASE = {
    "metadata": {"hardware": "none"},
    "tolerances": {"pr_test": dict(_PROFILE), "long_term": dict(_PROFILE)},
    "scenarios": {},
}
SCENARIO = {
    "expected_e2e_ms": 10.0,
    "stages_ms": {"TextEncodingStage": 1.0, "DenoisingStage": 5.0},
    "denoise_step_ms": {"0": 2.5, "1": 2.5},
    "expected_avg_denoise_ms": 2.5,
    "expected_median_denoise_ms": 2.5,
}
PERF_OVERLAY = {
    "metadata": {"hardware": "a test box", "platform": PLATFORM},
    "scenarios": {CASE: {**SCENARIO, "dispersion": {"expected_e2e_ms": 0.02, "denoise_step_ms.0": 0.05}}},
}
RESULTS = {
    "command": "gate",
    "platform": PLATFORM,
    "passed": True,
    "stages": {},
    "cases": {
        CASE: {
            "kind": "image",
            "passed": True,
            "metrics": {"clip": None, "ssim": 0.99, "psnr": "inf", "mean_abs_diff": 0.5},
        }
    },
    "perf": {CASE: dict(SCENARIO)},
}
POLICY = {
    "clip": {"margin": 0.02, "cap": 0.98},
    "psnr": {"margin": 3.0, "cap": 30.0},
    "mean_abs_diff": {"margin": 3, "floor": 4},
}
SWEEP = {
    "schema": "parity.sweep/1",
    "created": "2026-01-01T00:00:00+00:00",
    "target": "reference",
    "device": "cpu",
    "platform": {"kind": "cpu", "label": "cpu", "simulated": False, "gcn_arch": None, "device_name": "x86_64"},
    "cells": [
        {
            "case": "u@torch_sdpa/fp32",
            "contract": "usp.ulysses_parity",
            "backend": "torch_sdpa",
            "kernel": None,
            "dtype": "fp32",
            "world_size": 2,
            "status": "passed",
            "reason": None,
            "bound": "bitwise",
            "figures": {"bitwise": True, "max_abs": 0.0},
        },
        {
            "case": "r@math/bf16",
            "contract": "usp.ring_parity",
            "backend": "math",
            "kernel": None,
            "dtype": "bf16",
            "world_size": 2,
            "status": "failed",
            "reason": "max abs is nan",
            "bound": "fa:2",
            "figures": {"bitwise": False, "max_abs": "nan"},
        },
    ],
    "kernels": [
        {
            "backend": "torch_sdpa",
            "kernel": None,
            "dtype": "bfloat16",
            "shape": "B=1 S=64 H=4 D=32",
            "median_ms": 0.5,
            "tflops": 1.5,
            "skipped": None,
        }
    ],
    "usp_overhead": {"note": "kept"},
}
CONTRACT_CASES = {
    "defaults": {"dtype": "fp32"},
    "cases": {
        "uly": {
            "contract": "usp.ulysses_parity",
            "world_size": 2,
            "tokens_per_rank": 8,
            "heads": 4,
            "head_dim": 16,
            "backend": "torch_sdpa",
        },
        "grid": {"contract": "usp.ulysses_parity", "world_size": 1, "matrix": {"causal": [False, True]}},
    },
}
CONTRACT_OVERLAY = {"overrides": {"uly*": {"bound": "bitwise"}}}
IMAGE_CASES = {
    "defaults": {"prompt": "a fox", "height": 16, "width": 16, "steps": 2},
    "cases": {CASE: {"world_size": 1, "flow_shift": 3.0, "seed": 0}},
}


def png_bytes(array: np.ndarray) -> bytes:
    import imageio.v3 as iio

    return bytes(iio.imwrite("<bytes>", array, extension=".png"))


REFERENCE_PIXELS = np.arange(4 * 4 * 3, dtype=np.uint8).reshape(4, 4, 3)
REFERENCE = png_bytes(REFERENCE_PIXELS)


def manifest_for(png: bytes) -> dict[str, Any]:
    return {"format": 2, "cases": {CASE: {"files": {f"{CASE}.png": hashlib.sha256(png).hexdigest()}}}}


# ------------------------------------------------------------------------------ writing files


def _toml_key(key: str) -> str:
    return key if key.replace("_", "").replace("-", "").isalnum() and key.isascii() else json.dumps(key)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"no TOML for {value!r}")


def to_toml(doc: Mapping[str, Any], prefix: str = "") -> str:
    """A tiny TOML writer (tables of scalars, lists and inline tables) for the test documents."""
    scalars = [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in doc.items() if not isinstance(v, dict) or _inline(v)]
    lines = ([f"[{prefix}]"] if prefix and scalars else []) + scalars
    for key, value in doc.items():
        if isinstance(value, dict) and not _inline(value):
            lines.append(to_toml(value, f"{prefix}.{_toml_key(key)}" if prefix else _toml_key(key)))
    return "\n".join(lines) + "\n"


def _inline(value: dict[str, Any]) -> bool:
    """Tables whose values are all scalars or lists are written as tables, others recurse; matrices stay inline."""
    return False if not value else all(isinstance(v, list) for v in value.values()) and "contract" not in value


# ------------------------------------------------------------------------------------- kinds


@dataclass
class Project:
    root: Path
    env: dict[str, str] = field(default_factory=dict)

    @property
    def cases(self) -> Path:
        return self.root / "cases"

    @property
    def baselines(self) -> Path:
        return self.root / "baselines"


@dataclass(frozen=True)
class Kind:
    """One input kind: where its file lives in a project, its format, a valid document and the loader."""

    name: str
    relpath: str  # "" for an environment variable (then ``env_var`` names it)
    fmt: str  # "json", "toml", "png" or "env"
    valid: Any
    load: Callable[[Project], object]
    optional: bool = False  # absent is legitimate (an overlay, a policy section)
    extra_ok: bool = False  # an unknown key at ``extra_at`` is kept (sglang's schemas)
    extra_at: tuple[str, ...] = ()  # the table where an unknown key is tried
    empty_ok: bool = False  # an empty document (TOML) is legitimate
    extra_refusal: str = ""  # the key that refuses an unknown key, when not the unknown key's own path
    env_var: str = ""
    links_ok: bool = True  # a symlink to a valid file is read (a reference set is read only inside its directory)

    def path(self, project: Project) -> Path:
        return project.root / self.relpath

    def write(self, project: Project, doc: Any) -> None:
        path = self.path(project)
        path.parent.mkdir(parents=True, exist_ok=True)
        if self.fmt == "json":
            path.write_text(json.dumps(doc), encoding="utf-8")
        elif self.fmt == "toml":
            path.write_text(to_toml(doc), encoding="utf-8")
        else:
            path.write_bytes(doc)

    def text(self) -> str:
        return json.dumps(self.valid) if self.fmt == "json" else to_toml(self.valid)


def _thresholds(p: Project) -> object:
    from harness.baselines.thresholds import ThresholdSet

    return ThresholdSet.for_platform(p.baselines, PLATFORM).for_case(CASE, "image")


def _perf(p: Project) -> object:
    from harness.baselines.perf import PerfBaselines, check_perf

    chain = PerfBaselines.for_platform(p.baselines, PLATFORM)
    tolerances = chain.tolerances("pr_test", env=p.env)
    scenario = chain.scenario(CASE) or dict(SCENARIO)
    return check_perf(scenario, scenario, tolerances)


def _reference(p: Project) -> object:
    from harness.baselines.images import load_reference

    return load_reference(p.baselines / "images", CASE)


def _contracts(p: Project) -> object:
    from harness.cases.contract import load_cases
    from harness.contracts.runner import validate_for_target
    from harness.targets.reference import ReferenceTarget

    cases = load_cases(p.cases, "cpu")
    validate_for_target(cases, ReferenceTarget())
    return cases


def _images(p: Project) -> object:
    from harness.cases.image import load_image_cases

    return load_image_cases(p.cases)


def _policy(name: str) -> Callable[[Project], object]:
    def load(p: Project) -> object:
        from harness.recalibrate.policy import load_policy

        policy = load_policy(p.root / name)
        extremes = (("clip", -1.0), ("ssim", 1.0), ("psnr", math.inf), ("psnr", 0.0), ("mean_abs_diff", 255.0))
        return [policy.threshold(metric, worst) for metric, worst in extremes]

    return load


def _results(p: Project) -> object:
    """What ``parity recalibrate thresholds`` and ``perf`` do with a results file, short of writing."""
    from harness.baselines.perf import PerfBaselines
    from harness.baselines.thresholds import ThresholdSet
    from harness.recalibrate import apply_perf_proposals, apply_proposals, propose_perf, propose_thresholds
    from harness.results import load_results

    docs = [load_results(p.root / "results.json")]
    thresholds = ThresholdSet.for_platform(p.baselines, PLATFORM)
    apply_proposals(thresholds, propose_thresholds(thresholds, docs), allow_loosen=True)
    chain = PerfBaselines.for_platform(p.baselines, PLATFORM)
    return apply_perf_proposals(chain, propose_perf(chain, docs, chain.tolerances(env={})), allow_loosen=True)


def _sweep(p: Project) -> object:
    from harness.sweep.matrix import load_sweep, render_html, render_markdown

    sweeps = [load_sweep(p.root / "sweep.json")]
    return render_markdown(sweeps), render_html(sweeps)


def _platform_env(p: Project) -> object:
    import os

    from harness.cli import check_platform_env

    saved = os.environ.get("PARITY_PLATFORM")
    os.environ["PARITY_PLATFORM"] = p.env.get("PARITY_PLATFORM", "")
    try:
        return check_platform_env()
    finally:
        if saved is None:
            os.environ.pop("PARITY_PLATFORM")
        else:
            os.environ["PARITY_PLATFORM"] = saved


KINDS: dict[str, Kind] = {
    k.name: k
    for k in (
        Kind("thresholds", "baselines/consistency_threshold.json", "json", THRESHOLDS, _thresholds, extra_ok=True),
        Kind(
            "threshold_overlay",
            f"baselines/platforms/{PLATFORM}.json",
            "json",
            THRESHOLD_OVERLAY,
            _thresholds,
            optional=True,
            extra_ok=True,
        ),
        Kind("perf_baselines", "baselines/perf_baselines.json", "json", PERF_BASE, _perf, extra_ok=True),
        Kind(
            "perf_overlay",
            f"baselines/platforms/perf/{PLATFORM}.json",
            "json",
            PERF_OVERLAY,
            _perf,
            optional=True,
            extra_ok=True,
        ),
        Kind("env_tolerances", "", "env", {}, _perf, env_var="PARITY_PERF_TOL_E2E"),
        Kind(
            "manifest",
            "baselines/images/manifest.json",
            "json",
            manifest_for(REFERENCE),
            _reference,
            links_ok=False,
            extra_ok=True,
        ),
        Kind("png", f"baselines/images/{CASE}.png", "png", REFERENCE, _reference),
        Kind("contract_cases", "cases/contracts/c.toml", "toml", CONTRACT_CASES, _contracts, extra_at=("cases", "uly")),
        Kind(
            "contract_overlay",
            "cases/contracts/platforms/cpu.toml",
            "toml",
            CONTRACT_OVERLAY,
            _contracts,
            optional=True,
            empty_ok=True,
            extra_at=("overrides", "uly*"),
            extra_refusal="cases.uly._hostile",
        ),
        Kind("image_cases", "cases/images/i.toml", "toml", IMAGE_CASES, _images, extra_at=("cases", CASE)),
        Kind("policy_json", "policy.json", "json", POLICY, _policy("policy.json")),
        Kind("policy_toml", "policy.toml", "toml", POLICY, _policy("policy.toml"), empty_ok=True, extra_at=("psnr",)),
        Kind("results", "results.json", "json", RESULTS, _results, extra_ok=True),
        Kind("sweep", "sweep.json", "json", SWEEP, _sweep, extra_ok=True),
        Kind("platform_env", "", "env", {}, _platform_env, env_var="PARITY_PLATFORM"),
    )
}


def build_project(root: Path) -> Project:
    """A temp project holding one valid file of every kind."""
    project = Project(root)
    for kind in KINDS.values():
        if kind.fmt != "env":
            kind.write(project, copy.deepcopy(kind.valid))
    return project
