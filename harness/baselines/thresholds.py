"""Image/video consistency thresholds in sglang's ``consistency_threshold.json`` schema.

The schema is sglang's, unchanged, so its published files load as they are: per-case
``{clip,ssim,psnr,mean_abs_diff}_threshold`` and ``default_<metric>_threshold_{image,video}``.
clip, ssim and psnr are lower bounds, mean_abs_diff an upper bound. Any other key is a ConfigError
naming file, key and the nearest known one (a misspelt key would gate the case at the default);
comments (``_`` keys) and sglang's bounds for metrics parity does not gate (:data:`UPSTREAM_METRICS`)
are kept and written back. A platform overlay merges key by key (a case's keys one at a time) and
overlays chain; a case with neither its own value nor a default is a ConfigError, never an
invented number. The rules: docs/formats.md.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.baselines.named import NamedValues
from harness.errors import ConfigError
from harness.files.atomic import write_json_atomic
from harness.files.jsonio import expect_id, expect_known_key, expect_number, expect_object, join_key, read_json

__all__ = [
    "METRICS",
    "KINDS",
    "HIGHER_IS_BETTER",
    "Thresholds",
    "ThresholdSet",
    "case_key",
    "default_key",
    "THRESHOLDS_FILE",
    "OVERLAYS_DIR",
    "METRIC_RANGES",
    "check_metric",
]

THRESHOLDS_FILE = "consistency_threshold.json"
OVERLAYS_DIR = "platforms"  # <baselines>/platforms/<platform>.json: a platform's overlay

METRICS: tuple[str, ...] = ("clip", "ssim", "psnr", "mean_abs_diff")
KINDS: tuple[str, ...] = ("image", "video")
#: metrics whose threshold is a lower bound; mean_abs_diff is the one upper bound.
HIGHER_IS_BETTER: frozenset[str] = frozenset({"clip", "ssim", "psnr"})


def meets(metric: str, value: float, bound: float) -> bool:
    """Whether ``value`` is on the right side of ``bound`` (``>=`` for clip/ssim/psnr, ``<=`` for mean_abs_diff)."""
    return value >= bound if metric in HIGHER_IS_BETTER else value <= bound


#: The values a measured metric can take: a cosine and SSIM in [-1, 1]; PSNR in dB from 0 (the
#: worst an 8-bit image can be) upwards, ``inf`` for identical images, finite values far below
#: 1000 dB (one level off in a 10^90-pixel image); mean abs diff in 0..255 pixel levels.
METRIC_RANGES: dict[str, tuple[float, float]] = {
    "clip": (-1.0, 1.0),
    "ssim": (-1.0, 1.0),
    "psnr": (0.0, 1000.0),
    "mean_abs_diff": (0.0, 255.0),
}


def check_metric(metric: str, value: float | None, path: str | Path, key: str) -> float | None:
    """A measured value (None: not measured) within its possible range, else a ConfigError naming file and key."""
    lo, hi = METRIC_RANGES[metric]
    if value is None or (metric == "psnr" and value == math.inf):
        return value
    if not lo <= value <= hi:
        raise ConfigError(
            f"{value!r} is impossible for {metric} (its values lie in [{lo:g}, {hi:g}]"
            + (', or "inf"' if metric == "psnr" else "")
            + ")",
            path=path,
            key=key,
        )
    return value


def case_key(metric: str) -> str:
    """Key of a metric inside a case object: ``psnr`` -> ``psnr_threshold``."""
    return f"{metric}_threshold"


def default_key(metric: str, kind: str) -> str:
    """Top-level default key: (``psnr``, ``video``) -> ``default_psnr_threshold_video``."""
    return f"default_{metric}_threshold_{kind}"


def _check_kind(kind: str) -> str:
    """A case kind is 'image' or 'video'; anything else is a configuration error."""
    if kind not in KINDS:
        raise ConfigError(f"kind must be one of {list(KINDS)}, got {kind!r}", key="kind")
    return kind


_DEFAULT_KEYS = {default_key(m, k): m for m in METRICS for k in KINDS}
#: Metrics sglang's files bound that parity does not gate (sglang 0.5.23's h100.json): kept, not read.
UPSTREAM_METRICS: tuple[str, ...] = (
    "audio_spectral_similarity",
    "audio_waveform_correlation",
    "audio_rms_db_diff",
    "audio_duration_diff",
)
_UPSTREAM_DEFAULT_KEYS = tuple(f"default_{m}_threshold" for m in UPSTREAM_METRICS)
_CASE_KEYS = tuple(case_key(m) for m in METRICS)
_UPSTREAM_CASE_KEYS = tuple(case_key(m) for m in UPSTREAM_METRICS)


def _validate_value(metric: str, value: Any, path: str, key: str) -> float:
    """A bound within its metric's range; clip and SSIM bounds also >= 0 (a negative one bounds nothing)."""
    return expect_number(value, path, key, lo=0.0, hi=METRIC_RANGES[metric][1])


def _validate_document(doc: Any, path: str) -> dict[str, Any]:
    """Check types and ranges of every key parity understands; leave every other key alone."""
    doc = expect_object(doc, path, "")
    for key, value in doc.items():
        expect_known_key(key, ("cases", *_DEFAULT_KEYS), _UPSTREAM_DEFAULT_KEYS, path, key)
        if key in _DEFAULT_KEYS:
            _validate_value(_DEFAULT_KEYS[key], value, path, key)
        elif key in _UPSTREAM_DEFAULT_KEYS:
            expect_number(value, path, key)
    cases = expect_object(doc.get("cases", {}), path, "cases")
    for case_id, case in cases.items():
        case_path = join_key("cases", case_id)
        expect_id(case_id, path, case_path)
        expect_object(case, path, case_path)
        for key, value in case.items():
            expect_known_key(key, _CASE_KEYS, _UPSTREAM_CASE_KEYS, path, join_key(case_path, key))
            if key in _UPSTREAM_CASE_KEYS:
                expect_number(value, path, join_key(case_path, key))
        for metric in METRICS:
            if case_key(metric) in case:
                _validate_value(metric, case[case_key(metric)], path, join_key(case_path, case_key(metric)))
    return doc


@dataclass(frozen=True)
class Thresholds(NamedValues, names=METRICS, what="metric"):
    """The four bounds for one case, with ``source[metric]`` = ``"<file>:<key path>"`` so a report
    can say where a bound came from (a platform overlay, the base, or a default); ``get`` by metric."""

    clip: float
    ssim: float
    psnr: float
    mean_abs_diff: float
    source: dict[str, str] = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class _Layer:
    path: str
    data: dict[str, Any]


class ThresholdSet:
    """A base thresholds file with zero or more overlays merged over it (last one wins)."""

    def __init__(self, layers: Sequence[_Layer]) -> None:
        if not layers:
            raise ValueError("a ThresholdSet needs at least one file")
        self._layers = tuple(layers)

    @classmethod
    def load(cls, base_path: str | Path, overlays: Sequence[str | Path] = ()) -> ThresholdSet:
        """Read and validate the base file and each overlay, in order."""
        return cls([_Layer(str(p), _validate_document(read_json(p), str(p))) for p in [base_path, *overlays]])

    @classmethod
    def for_platform(cls, baselines_dir: str | Path, platform: str) -> ThresholdSet:
        """The base thresholds of a baselines directory with this platform's overlay (if any) merged over them."""
        from harness.baselines.platforms import find_overlay

        overlay = find_overlay(Path(baselines_dir) / OVERLAYS_DIR, platform)
        return cls.load(Path(baselines_dir) / THRESHOLDS_FILE, [overlay] if overlay else [])

    @classmethod
    def from_json(cls, doc: Any, path: str = "<memory>") -> ThresholdSet:
        """Validate an in-memory document (``path`` only labels errors and sources)."""
        return cls([_Layer(path, _validate_document(copy.deepcopy(doc), path))])

    @property
    def paths(self) -> list[str]:
        """Files of the chain, base first."""
        return [layer.path for layer in self._layers]

    @property
    def case_ids(self) -> list[str]:
        """Every case named in any layer, in first-appearance order."""
        return list(self.to_json().get("cases", {}))

    def for_case(self, case_id: str, kind: str = "image") -> Thresholds:
        """The effective bounds for ``case_id`` of ``kind``: case value, else the kind's default."""
        _check_kind(kind)
        values: dict[str, float] = {}
        source: dict[str, str] = {}
        for metric in METRICS:
            found = self._lookup(["cases", case_id, case_key(metric)]) or self._lookup([default_key(metric, kind)])
            if found is None:
                raise ConfigError(
                    f"no {metric} threshold for {kind} case {case_id!r}: add "
                    f"cases.{case_id}.{case_key(metric)} or {default_key(metric, kind)}",
                    path=" + ".join(self.paths),
                    key=f"cases.{case_id}.{case_key(metric)}",
                )
            values[metric], source[metric] = found
        return Thresholds(**values, source=source)

    def _lookup(self, keys: list[str]) -> tuple[float, str] | None:
        """Value at ``keys`` from the top-most layer holding it, with its ``file:key`` source."""
        for layer in reversed(self._layers):
            node: Any = layer.data
            for k in keys:
                if not isinstance(node, dict) or k not in node:
                    break
                node = node[k]
            else:
                return float(node), f"{layer.path}:{'.'.join(keys)}"
        return None

    def with_values(self, updates: Mapping[tuple[str, str], float]) -> ThresholdSet:
        """A copy with ``{(case_id, metric): bound}`` written into the top-most layer.

        The top layer is the most specific file (the platform overlay when there is one), which is
        where a recalibration measured on that platform belongs.
        """
        top = self._layers[-1]
        data = copy.deepcopy(top.data)
        for (case_id, metric), value in updates.items():
            if metric not in METRICS:
                raise KeyError(f"unknown metric {metric!r}; valid: {list(METRICS)}")
            key = join_key(join_key("cases", case_id), case_key(metric))
            _validate_value(metric, value, top.path, key)
            data.setdefault("cases", {}).setdefault(case_id, {})[case_key(metric)] = float(value)
        return ThresholdSet([*self._layers[:-1], _Layer(top.path, data)])

    def to_json(self) -> dict[str, Any]:
        """The merged document (for one file: exactly its content, unknown keys and order kept)."""
        merged = copy.deepcopy(self._layers[0].data)
        for layer in self._layers[1:]:
            for key, value in layer.data.items():
                if key == "cases":
                    cases = merged.setdefault("cases", {})
                    for case_id, case in value.items():
                        cases.setdefault(case_id, {}).update(copy.deepcopy(case))
                else:
                    merged[key] = copy.deepcopy(value)
        return merged

    def save(self, path: str | Path, backup: bool = True) -> None:
        """Write :meth:`to_json` atomically, keeping ``path.bak`` of the previous file."""
        write_json_atomic(path, self.to_json(), backup=backup)
