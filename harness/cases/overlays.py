"""Overlays on the contract cases, each entry carrying the fact that justifies it (keys: docs/formats.md).

``platforms/<platform>.toml`` replaces parameters of the cases a glob matches, on that platform only.
``targets/<target>.toml`` applies to the target's installed versions its entries name (PEP 440 against
``[target] distribution``): ``overrides``, ``expected_failures`` and ``expected_skips``, all strict, so the
day upstream fixes a divergence the run says so; a skip no entry pins fails its case (a skip is a claim).
``backends/<backend>.toml`` pins skips by their reason on every case running that backend (a kernel's
limits hold whatever the case). Globs are ``*`` and ``?``, brackets literal, each must match a case;
every problem is a ConfigError naming file and key.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from harness.cases.files import case_glob
from harness.contracts.case import Case, ExpectedFailure, ExpectedSkip, rebuilt
from harness.contracts.judging import FAILING_NAMES
from harness.errors import ConfigError
from harness.files.tomlio import read_toml
from harness.targets.base import CAPABILITIES, REFUSALS, Refusal, distribution_version
from reference_impl.platform import PLATFORM_KINDS

_META = ("because", "versions", "platforms")
_PIN_KEYS = ("reason", "refusal", "lacks")  # what a pinned skip is matched on (harness.contracts.case.ExpectedSkip)
_SKIP_KEYS = (*_META, *_PIN_KEYS, "when_missing")
_FAILURE_KEYS = (*_META, "fails", "raises")


def _tables(data: Mapping[str, Any], section: str, path: Path) -> dict[str, dict[str, Any]]:
    tables = data.get(section, {})
    if not isinstance(tables, dict) or not all(isinstance(v, dict) for v in tables.values()):
        raise ConfigError("must be a table of tables", path=path, key=section)
    return tables


def _entries(data: Mapping[str, Any], section: str, path: Path) -> list[tuple[str, str, dict[str, Any]]]:
    """A target overlay section's (glob, key, entry) triples: per glob one table, or an array of tables
    (``[[expected_skips."<glob>"]]``), one per version range, when a case's fact changes between releases."""
    tables = data.get(section, {})
    if not isinstance(tables, dict):
        raise ConfigError("must be a table of tables", path=path, key=section)
    if not all(isinstance(v, (dict, list)) for v in tables.values()):
        raise ConfigError("must be a table of tables", path=path, key=section)
    out = []
    for pattern, value in tables.items():
        if isinstance(value, dict):
            out.append((pattern, f"{section}.{pattern}", value))
        elif value and all(isinstance(e, dict) for e in value):
            out += [(pattern, f"{section}.{pattern}[{i}]", e) for i, e in enumerate(value)]
        else:
            raise ConfigError("must be a table, or a non-empty array of tables", path=path, key=f"{section}.{pattern}")
    return out


def _hits(cases: list[Case], pattern: str, path: Path, key: str) -> list[int]:
    glob = case_glob(pattern)
    hits = [i for i, c in enumerate(cases) if glob.fullmatch(c.id)]
    if not hits:
        raise ConfigError("matches no case", path=path, key=key)
    return hits


def _override(cases: list[Case], hits: list[int], values: Mapping[str, Any], path: Path) -> None:
    for i in hits:
        case = cases[i]
        cases[i] = rebuilt(case, values, source=f"{case.source} + {path}")


def apply_platform_overlay(cases: list[Case], path: Path) -> list[Case]:
    """Replace the parameters that ``path``'s ``[overrides."<glob>"]`` tables name, re-validated."""
    data = read_toml(path)
    unknown = set(data) - {"overrides"}
    if unknown:
        raise ConfigError(
            'a platform overlay holds only [overrides."<case glob>"] tables', path=path, key=sorted(unknown)[0]
        )
    cases = list(cases)
    for pattern, values in _tables(data, "overrides", path).items():
        if not values:
            raise ConfigError("must be a non-empty table of parameters", path=path, key=f"overrides.{pattern}")
        _override(cases, _hits(cases, pattern, path, f"overrides.{pattern}"), values, path)
    return cases


def installed_version(distribution: str) -> Version | None:
    found = distribution_version(distribution)
    try:
        return Version(found) if found is not None else None
    except InvalidVersion:
        return None


def _applies(entry: Mapping[str, Any], version: Version | None, platform: str | None, path: Path, key: str) -> bool:
    because = entry.get("because")
    if not isinstance(because, str) or not because.strip():
        raise ConfigError(
            "every entry needs 'because': the upstream fact that justifies it", path=path, key=f"{key}.because"
        )
    platforms = entry.get("platforms")
    if platforms is not None:
        if not isinstance(platforms, list) or not platforms or any(p not in PLATFORM_KINDS for p in platforms):
            raise ConfigError(
                f"must be a non-empty list of {', '.join(PLATFORM_KINDS)}", path=path, key=f"{key}.platforms"
            )
    versions = entry.get("versions")
    if versions is None:
        return platforms is None or platform in platforms
    try:
        spec = SpecifierSet(versions) if isinstance(versions, str) else None
    except InvalidSpecifier:
        spec = None
    if spec is None:
        raise ConfigError(
            f"{versions!r} is not a PEP 440 version specifier (e.g. '>=0.5.20')", path=path, key=f"{key}.versions"
        )
    if platforms is not None and platform not in platforms:
        return False
    return version is not None and spec.contains(version, prereleases=True)


def apply_target_overlay(
    cases: list[Case],
    path: Path,
    version: Version | None = None,
    platform: str | None = None,
    target_runs: bool = False,
) -> list[Case]:
    """The cases as ``path`` says they run on its target at the installed ``version`` (default: looked up)
    on ``platform`` (an entry with ``platforms`` applies only there).

    An entry whose ``versions`` excludes the installed version is validated but not applied; so is any
    entry when the distribution is not installed and the target is unavailable (its cases skip). A target
    that runs (``target_runs``) with its overlay's distribution not installed is a ConfigError: the name
    is wrong, and every versioned entry would silently never apply.
    """
    data = read_toml(path)
    distribution = _distribution(data, path)
    version = version if version is not None else installed_version(distribution) if distribution else None
    if distribution and version is None and target_runs:
        raise ConfigError(
            f"names {distribution!r}, which is not installed here, while the target runs: its versioned "
            "entries would never apply (name the distribution the target imports, as pip lists it)",
            path=path,
            key="target.distribution",
        )
    cases = list(cases)
    for pattern, key, entry in _entries(data, "overrides", path):
        hits = _hits(cases, pattern, path, key)
        values = {k: v for k, v in entry.items() if k not in _META}
        if not values:
            raise ConfigError("names no parameter to override", path=path, key=key)
        if _applies(entry, version, platform, path, key):
            _override(cases, hits, values, path)
    for pattern, key, entry in _entries(data, "expected_failures", path):
        hits = _hits(cases, pattern, path, key)
        expected = _expected_failure(entry, path, key, f"{distribution} {version}; {path.name}: {key}")
        if _applies(entry, version, platform, path, key):
            for i in hits:
                cases[i] = dataclasses.replace(cases[i], expected_failure=expected)
    for pattern, key, entry in _entries(data, "expected_skips", path):
        hits = _hits(cases, pattern, path, key)
        pin = _expected_skip(entry, path, key)
        if _applies(entry, version, platform, path, key) and _module_missing(entry, path, key):
            for i in hits:
                cases[i] = dataclasses.replace(cases[i], expected_skip=pin)
    return [dataclasses.replace(case, target_overlay=str(path)) for case in cases]


def _distribution(data: Mapping[str, Any], path: Path) -> str | None:
    """The overlay's ``[target] distribution``, its sections checked (versioned entries need a distribution)."""
    unknown = set(data) - {"target", "overrides", "expected_failures", "expected_skips"}
    if unknown:
        raise ConfigError(
            "a target overlay holds [target], [overrides.*], [expected_failures.*] and [expected_skips.*]",
            path=path,
            key=sorted(unknown)[0],
        )
    target = data.get("target", {})
    distribution = target.get("distribution") if isinstance(target, dict) else None
    if not isinstance(target, dict) or not isinstance(distribution, (str, type(None))):
        raise ConfigError('must be a table with distribution = "<installed distribution>"', path=path, key="target")
    if distribution is None and _uses_versions(data, path):
        raise ConfigError(
            "entries with 'versions' need [target] distribution = \"<installed distribution>\"",
            path=path,
            key="target.distribution",
        )
    return distribution


def _uses_versions(data: Mapping[str, Any], path: Path) -> bool:
    return any(
        "versions" in entry
        for section in ("overrides", "expected_failures", "expected_skips")
        for _, _, entry in _entries(data, section, path)
    )


def _expected_failure(entry: Mapping[str, Any], path: Path, key: str, where: str) -> ExpectedFailure:
    """An expected failure pinned to what fails: ``fails`` (a list of comparisons) or ``raises`` (an error's text)."""
    extra = sorted(set(entry) - set(_FAILURE_KEYS))
    if extra:
        raise ConfigError(
            f"unknown key; an expected failure has only {', '.join(_FAILURE_KEYS)}", path=path, key=f"{key}.{extra[0]}"
        )
    fails, raises = entry.get("fails"), entry.get("raises")
    if (fails is None) == (raises is None):
        raise ConfigError(
            "an expected failure names what fails: `fails = [...]` (of " + ", ".join(FAILING_NAMES) + ") or "
            '`raises = "<text of the error>"`, one of them',
            path=path,
            key=key,
        )
    raises = [raises] if isinstance(raises, str) else raises
    if raises is not None and (not isinstance(raises, list) or not raises or not all(_text(r) for r in raises)):
        raise ConfigError("must be a non-empty string or a list of them", path=path, key=f"{key}.raises")
    if fails is not None and (not isinstance(fails, list) or not fails or any(f not in FAILING_NAMES for f in fails)):
        raise ConfigError(f"must be a non-empty list of {', '.join(FAILING_NAMES)}", path=path, key=f"{key}.fails")
    return ExpectedFailure(str(entry["because"]), where, tuple(fails or ()), tuple(raises or ()))


def _text(value: Any) -> bool:
    return isinstance(value, str) and bool(value.strip())


def _expected_skip(entry: Mapping[str, Any], path: Path, key: str) -> ExpectedSkip:
    extra = sorted(set(entry) - set(_SKIP_KEYS))
    if extra:
        raise ConfigError(
            f"unknown key; an expected skip has only {', '.join(_SKIP_KEYS)}", path=path, key=f"{key}.{extra[0]}"
        )
    if "when_missing" in entry and not _text(entry["when_missing"]):
        raise ConfigError("must be a non-empty string", path=path, key=f"{key}.when_missing")
    return _pin(entry, path, key)


def _pin(entry: Mapping[str, Any], path: Path, key: str) -> ExpectedSkip:
    """A pinned skip's typed cause (``refusal``, ``lacks``) and the words (``reason``) its message holds."""
    if "reason" in entry and not _text(entry["reason"]):
        raise ConfigError("must be a non-empty string", path=path, key=f"{key}.reason")
    refusal = entry.get("refusal")
    if refusal is not None and refusal not in REFUSALS:
        raise ConfigError(f"must be one of {', '.join(REFUSALS)}, got {refusal!r}", path=path, key=f"{key}.refusal")
    lacks = entry.get("lacks", [])
    if not isinstance(lacks, list) or any(c not in CAPABILITIES for c in lacks) or ("lacks" in entry and not lacks):
        raise ConfigError(
            f"must be a non-empty list of capabilities ({', '.join(CAPABILITIES)}), got {lacks!r}",
            path=path,
            key=f"{key}.lacks",
        )
    return ExpectedSkip(
        str(entry.get("because", "")),
        f"{path}: {key}",
        entry.get("reason"),
        Refusal(refusal) if refusal else None,
        frozenset(lacks),
    )


def _module_missing(entry: Mapping[str, Any], path: Path, key: str) -> bool:
    """Whether an entry with ``when_missing`` applies: that module cannot be imported here."""
    module = entry.get("when_missing")
    if module is None:
        return True
    try:
        return importlib.util.find_spec(module) is None
    except (ImportError, ValueError):
        return True


def apply_backend_overlays(cases: list[Case], directory: Path) -> list[Case]:
    """Each case with the skips its backend's overlay (``directory/<backend>.toml``, when present) pins."""
    pins: dict[str, tuple[ExpectedSkip, ...]] = {}
    out = []
    for case in cases:
        backend = case.params.get("backend")
        if not isinstance(backend, str):
            out.append(case)
            continue
        if backend not in pins:
            path = directory / f"{backend}.toml"
            pins[backend] = _backend_pins(path) if path.is_file() else ()
        out.append(dataclasses.replace(case, backend_skips=pins[backend]))
    return out


def _backend_pins(path: Path) -> tuple[ExpectedSkip, ...]:
    data = read_toml(path)
    unknown = set(data) - {"expected_skips"}
    entries = data.get("expected_skips")
    if unknown or not isinstance(entries, list) or not entries or not all(isinstance(e, dict) for e in entries):
        raise ConfigError(
            "a backend overlay holds only [[expected_skips]] entries (because; refusal and/or reason)",
            path=path,
            key=sorted(unknown)[0] if unknown else "expected_skips",
        )
    pins = []
    for i, entry in enumerate(entries):
        key = f"expected_skips[{i}]"
        extra = sorted(set(entry) - {"reason", "refusal", "because"})
        if extra:
            raise ConfigError(
                "unknown key; a backend's expected skip has only because, refusal and reason",
                path=path,
                key=f"{key}.{extra[0]}",
            )
        if not _text(entry.get("because")):
            raise ConfigError("must be a non-empty string", path=path, key=f"{key}.because")
        if "reason" not in entry and "refusal" not in entry:
            raise ConfigError("a backend's pin names its refusal, its reason's words or both", path=path, key=key)
        pins.append(_pin(entry, path, key))
    return tuple(pins)
