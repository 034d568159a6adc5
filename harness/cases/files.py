"""What every TOML case file shares: the ``[defaults]`` + ``[cases.<id>]`` layout, and a
directory of such files with unique case ids.

Contract cases (:mod:`harness.cases.contract`) and image cases (:mod:`harness.cases.image`)
differ only in what a case table means.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

from harness.errors import ConfigError
from harness.files.tomlio import read_toml


def read_case_tables(path: Path, what: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """``([defaults], [cases])`` of a case file; anything else at the top level is an error."""
    data = read_toml(path)
    unknown = set(data) - {"defaults", "cases"}
    if unknown:
        raise ConfigError(
            f"unknown top-level table; {what} file holds [defaults] and [cases.<id>]", path=path, key=sorted(unknown)[0]
        )
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
                raise ConfigError(
                    f"case '{case.id}' is also defined in {seen[case.id]}", path=file, key=f"cases.{case.id}"
                )
            seen[case.id] = str(file)
            cases.append(case)
    return cases


def case_glob(pattern: str) -> re.Pattern[str]:
    """A case-id pattern: ``*`` and ``?`` as wildcards; brackets stay literal, since matrix case ids contain
    them (``masked_ring[*]`` means every matrix case of ``masked_ring``), in overlays and on the command line alike."""
    return re.compile(re.escape(pattern).replace(r"\*", ".*").replace(r"\?", "."))
