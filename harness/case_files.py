"""What every TOML case file shares: reading it with errors that name the file, the
``[defaults]`` + ``[cases.<id>]`` layout, and a directory of such files with unique case ids.

Contract cases (:mod:`harness.cases`) and image cases (:mod:`harness.image_cases`) differ only
in what a case table means; the policy files of :mod:`harness.recalibrate` reuse ``read_toml``.
"""

from __future__ import annotations

import tomllib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

from harness.errors import ConfigError


def read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"invalid TOML: {exc}", path=path) from None
    except FileNotFoundError:
        raise ConfigError("file not found", path=path) from None
    except OSError as exc:
        raise ConfigError(f"cannot read: {exc.strerror}", path=path) from None


def read_case_tables(path: Path, what: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """``([defaults], [cases])`` of a case file; anything else at the top level is an error."""
    data = read_toml(path)
    unknown = set(data) - {"defaults", "cases"}
    if unknown:
        raise ConfigError(f"unknown top-level table; {what} file holds [defaults] and [cases.<id>]", path=path,
                          key=sorted(unknown)[0])
    defaults = data.get("defaults", {})
    if not isinstance(defaults, dict):
        raise ConfigError("must be a table", path=path, key="defaults")
    cases = data.get("cases")
    if not isinstance(cases, dict) or not cases:
        raise ConfigError("no cases: add at least one [cases.<id>] table", path=path, key="cases")
    return defaults, cases


class _HasId(Protocol):
    id: str


C = TypeVar("C", bound=_HasId)


def load_case_directory(directory: Path, load_file: Callable[[Path], Sequence[C]], what: str) -> list[C]:
    """Every case of every ``*.toml`` in ``directory``, in file order; a case id defined twice is an error."""
    if not directory.is_dir():
        raise ConfigError(f"no such {what} directory (see PARITY_HOME or --cases)", path=directory)
    files = sorted(directory.glob("*.toml"))
    if not files:
        raise ConfigError(f"no *.toml {what} files here", path=directory)
    seen: dict[str, str] = {}
    cases: list[C] = []
    for file in files:
        for case in load_file(file):
            if case.id in seen:
                raise ConfigError(f"case '{case.id}' is also defined in {seen[case.id]}", path=file, key=f"cases.{case.id}")
            seen[case.id] = str(file)
            cases.append(case)
    return cases
