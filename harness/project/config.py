"""The project file: where a project keeps its cases and baselines, and what it gates by default.

``parity.toml``, or ``[tool.parity]`` in ``pyproject.toml``, found like pytest's rootdir: the first
directory upwards from the working directory that holds one (both in one directory is an error, so
which one counts is never a guess). Keys: ``cases``, ``baselines`` (relative to the file),
``target`` and ``target_args``, ``pipeline_target`` and ``pipeline_target_args``, ``device``,
``profile``; all optional. A command-line option overrides its key (``--target`` replaces
``target_args`` too, ``--target-arg`` only them). Validated on read, errors naming file and key;
the table: docs/project.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.baselines.perf import PROFILES
from harness.baselines.thresholds import THRESHOLDS_FILE
from harness.errors import ConfigError
from harness.files.reading import is_present
from harness.files.tomlio import read_toml
from harness.targets.spec import DEFAULT_TARGET, TargetArgs, TargetSpec, parse_target_args

PROJECT_FILE = "parity.toml"
PYPROJECT = "pyproject.toml"
DEVICES = ("cpu", "cuda")
_KEYS = ("cases", "baselines", "target", "target_args", "pipeline_target", "pipeline_target_args", "device", "profile")


@dataclass(frozen=True)
class Project:
    """A project file as read: ``None`` (or empty args) where it leaves a key to the command line and the defaults."""

    file: Path
    table: str  # "tool.parity" in a pyproject.toml, "" in a parity.toml: the prefix of its keys in errors
    cases: Path | None = None
    baselines: Path | None = None
    target: str | None = None
    target_args: TargetArgs = ()
    pipeline_target: str | None = None
    pipeline_target_args: TargetArgs = ()
    device: str | None = None
    profile: str | None = None

    @property
    def root(self) -> Path:
        return self.file.parent

    def spec_of(self, option: str) -> TargetSpec:
        """What ``--target`` (``option`` "target") or ``--pipeline-target`` ("pipeline_target") resolves to when the
        command line gives neither: the file's target, else the reference, with the file's arguments."""
        return TargetSpec(getattr(self, option) or DEFAULT_TARGET, getattr(self, f"{option}_args"))

    def key(self, name: str) -> str:
        """A key as the file spells it (``tool.parity.cases``), for errors."""
        return f"{self.table}.{name}" if self.table else name


def find_project(start: Path) -> Path | None:
    """The project file that governs ``start``: the nearest ``parity.toml`` or ``pyproject.toml`` with
    ``[tool.parity]`` in ``start`` or a directory above it; None when there is none."""
    for directory in (start.resolve(), *start.resolve().parents):
        own, pyproject = directory / PROJECT_FILE, directory / PYPROJECT
        has_table = is_present(pyproject) and "parity" in _tool(read_toml(pyproject), pyproject)
        if is_present(own) and has_table:
            raise ConfigError(
                f"both {PROJECT_FILE} and [tool.parity] in {PYPROJECT} are here: keep one", path=directory
            )
        if is_present(own):
            return own
        if has_table:
            return pyproject
    return None


def _tool(document: Mapping[str, Any], path: Path) -> Mapping[str, Any]:
    tool = document.get("tool", {})
    if not isinstance(tool, dict):
        raise ConfigError("must be a table", path=path, key="tool")
    return tool


def _not_a(name: str, folder: Path) -> str | None:
    """Why ``folder`` is not a project's ``cases`` or ``baselines`` folder (``cases = "/etc"`` would otherwise
    fail later, naming neither the project file nor the key), or None."""
    if name == "cases" and not any((folder / kind).is_dir() for kind in ("contracts", "images", "perf")):
        return "holds no contracts/, images/ or perf/ folder of cases (parity init writes a project's)"
    if name == "baselines" and not (folder / THRESHOLDS_FILE).is_file():
        return f"holds no {THRESHOLDS_FILE} (the image gate's thresholds; parity init writes a project's)"
    return None


@dataclass(frozen=True)
class _Keys:
    """The project table being read: each key's value checked, errors naming the file and the key."""

    path: Path
    project: Project
    body: dict[str, Any]

    def text(self, name: str, choices: tuple[str, ...] = ()) -> str | None:
        value = self.body.get(name)
        if value is None:
            return None
        if not isinstance(value, str) or not value.strip():
            raise ConfigError(f"must be a non-empty string, got {value!r}", path=self.path, key=self.project.key(name))
        if choices and value not in choices:
            raise ConfigError(
                f"must be one of {', '.join(choices)}, got {value!r}", path=self.path, key=self.project.key(name)
            )
        return value

    def directory(self, name: str) -> Path | None:
        value = self.text(name)
        if value is None:
            return None
        resolved = (self.path.parent / value).resolve()
        if not resolved.is_dir():
            raise ConfigError(f"no such directory: {resolved}", path=self.path, key=self.project.key(name))
        missing = _not_a(name, resolved)
        if missing:
            raise ConfigError(f"{resolved} {missing}", path=self.path, key=self.project.key(name))
        return resolved

    def pairs(self, name: str) -> TargetArgs:
        value = self.body.get(name, {})
        if not isinstance(value, dict):
            raise ConfigError('must be a table of KEY = "VALUE" strings', path=self.path, key=self.project.key(name))
        for key, item in value.items():
            if not isinstance(item, str):
                raise ConfigError(
                    f"must be a string, as --target-arg passes it, got {item!r}",
                    path=self.path,
                    key=self.project.key(f"{name}.{key}"),
                )
        try:
            return parse_target_args([f"{k}={v}" for k, v in value.items()], self.project.key(name))
        except ConfigError as exc:
            raise ConfigError(str(exc).removeprefix(f"key '{exc.key}': "), path=self.path, key=exc.key) from None


def load_project(path: Path) -> Project:
    """The project file at ``path``, every key checked (a directory must exist; a value must have its type)."""
    path = path.resolve()
    document = read_toml(path)
    if path.name == PYPROJECT:
        table, body = "tool.parity", _tool(document, path).get("parity")
        if not isinstance(body, dict):
            raise ConfigError("must be a table", path=path, key=table)
    else:
        table, body = "", document
    project = Project(path, table)
    unknown = sorted(set(body) - set(_KEYS))
    if unknown:
        raise ConfigError(
            f"unknown key(s) {', '.join(unknown)}; known: {', '.join(_KEYS)}", path=path, key=project.key(unknown[0])
        )
    keys = _Keys(path, project, body)
    return Project(
        path,
        table,
        keys.directory("cases"),
        keys.directory("baselines"),
        keys.text("target"),
        keys.pairs("target_args"),
        keys.text("pipeline_target"),
        keys.pairs("pipeline_target_args"),
        keys.text("device", DEVICES),
        keys.text("profile", PROFILES),
    )
