"""Contract case files (TOML): load, expand, validate.

A file holds optional ``[defaults]`` and one ``[cases.<id>]`` table per case, naming its
``contract`` and that contract's parameters; a ``matrix`` expands into one case per combination
(``ulysses[dtype=fp32,causal=false]``), at most :data:`MAX_MATRIX_CASES` per table and
:data:`MAX_FILE_CASES` per file, so a small file cannot expand into billions of cases. Platform and
target overlays adjust the cases afterwards (:mod:`harness.cases.overlays`). Every problem (syntax,
an unknown contract or key, a wrong type, a token count the world size does not divide, heads the
Ulysses degree does not divide) is a ConfigError naming the file, the case and the key. The
format: docs/formats.md; every contract's parameters: docs/contracts.md.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.cases.files import case_glob, load_case_directory, read_case_tables
from harness.cases.overlays import apply_backend_overlays, apply_platform_overlay, apply_target_overlay
from harness.contracts.case import Case, contract_of, make_case, with_overrides
from harness.errors import ConfigError
from harness.files.jsonio import expect_id
from harness.files.reading import is_present

_CASE_META = ("contract", "description", "matrix", "timeout")
MAX_MATRIX_CASES = 1024
MAX_FILE_CASES = 4096


def load_case_file(path: str | Path) -> list[Case]:
    path = Path(path)
    defaults, cases_table = read_case_tables(path, "a case")
    cases: list[Case] = []
    for case_id, body in cases_table.items():
        cases.extend(_expand(path, case_id, body, defaults))
        if len(cases) > MAX_FILE_CASES:
            raise ConfigError(
                f"the file expands to more than {MAX_FILE_CASES} cases", path=path, key=f"cases.{case_id}"
            )
    used = {key for case in cases for key in case.raw} | {"timeout"}
    for key in defaults:
        if key not in used:
            raise ConfigError(
                "applies to no case of this file (no contract here has that parameter)",
                path=path,
                key=f"defaults.{key}",
            )
    return cases


def _expand(path: Path, case_id: str, body: Any, defaults: Mapping[str, Any]) -> list[Case]:
    where = f"cases.{case_id}"
    expect_id(case_id, path, where)
    if not isinstance(body, dict):
        raise ConfigError(f"case '{case_id}' must be a table", path=path, key=where)
    contract_id = body.get("contract")
    if not isinstance(contract_id, str):
        raise ConfigError(f"case '{case_id}': missing or non-string 'contract'", path=path, key=f"{where}.contract")
    description = body.get("description", "")
    if not isinstance(description, str):
        raise ConfigError(f"case '{case_id}': description must be a string", path=path, key=f"{where}.description")
    timeout = _timeout(path, case_id, body.get("timeout", defaults.get("timeout")))
    matrix = _matrix(path, case_id, body)
    contract = contract_of(path, case_id, contract_id)
    # A default applies where the contract has that parameter (a file may mix contracts).
    declared = {p.name for p in contract.params}
    params = {
        **{k: v for k, v in defaults.items() if k in declared and k not in _CASE_META},
        **{k: v for k, v in body.items() if k not in _CASE_META},
    }
    combos = [dict(zip(matrix, values)) for values in itertools.product(*matrix.values())] if matrix else [{}]
    cases = []
    for combo in combos:
        cid = case_id + ("[" + ",".join(f"{k}={_show(v)}" for k, v in combo.items()) + "]" if combo else "")
        raw = {**params, **combo}
        inherited = set(params) - set(body) - set(combo)
        cases.append(
            make_case(
                contract_id,
                raw,
                case_id=cid,
                source=str(path),
                description=description,
                inherited=inherited,
                timeout=timeout,
            )
        )
    return cases


def _matrix(path: Path, case_id: str, body: Mapping[str, Any]) -> dict[str, list[Any]]:
    """A case table's ``matrix``: axes of non-empty lists, none also a parameter, at most MAX_MATRIX_CASES cases."""
    where = f"cases.{case_id}"
    matrix = body.get("matrix", {})
    if not isinstance(matrix, dict):
        raise ConfigError(f"case '{case_id}': matrix must be a table of lists", path=path, key=f"{where}.matrix")
    for key, values in matrix.items():
        if not isinstance(values, list) or not values:
            raise ConfigError(
                f"case '{case_id}': matrix values must be a non-empty list", path=path, key=f"{where}.matrix.{key}"
            )
        if key in body:
            raise ConfigError(
                f"case '{case_id}': '{key}' is both a parameter and a matrix axis", path=path, key=f"{where}.{key}"
            )
    size = math.prod(len(values) for values in matrix.values())
    if size > MAX_MATRIX_CASES:
        raise ConfigError(
            f"case '{case_id}': the matrix expands to {size} cases; at most {MAX_MATRIX_CASES} per case table",
            path=path,
            key=f"{where}.matrix",
        )
    return matrix


def _timeout(path: Path, case_id: str, value: Any) -> float | None:
    """A case's ``timeout`` (seconds, > 0; from its table or the file's ``[defaults]``), or None: the contract's."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 86400:
        raise ConfigError(
            f"case '{case_id}': timeout must be a number of seconds in (0, 86400], got {value!r}",
            path=path,
            key=f"cases.{case_id}.timeout",
        )
    return float(value)


def _show(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def contract_case_dir(root: str | Path) -> Path:
    """``root/contracts`` when it exists (the cases root), else ``root`` itself (a directory of case files)."""
    root = Path(root)
    return root / "contracts" if (root / "contracts").is_dir() else root


def platform_of_device(device: str) -> str:
    """The overlay name for runs on ``device``: the platform kind on an accelerator (cuda/rocm), else cpu."""
    from reference_impl.platform import current_platform

    return current_platform.kind if device != "cpu" else "cpu"


def load_cases(
    root: str | Path, platform: str | None = None, target: str | None = None, target_runs: bool = False
) -> list[Case]:
    """Every case of every ``*.toml`` in the contract case directory of ``root``; ids must be unique.

    With ``platform``, ``platforms/<platform>.toml`` (when present) overrides matching cases; with
    ``target`` (a target's name), ``targets/<target>.toml`` (when present) applies its overrides
    and expected failures for the installed version (:mod:`harness.cases.overlays`; ``target_runs``:
    the target is available here, so the overlay's distribution must be installed).
    """
    directory = contract_case_dir(root)
    cases = load_case_directory(directory, load_case_file, "contract case")
    overlay = directory / "platforms" / f"{platform}.toml"
    if platform and is_present(overlay):
        cases = apply_platform_overlay(cases, overlay)
    overlay = directory / "targets" / f"{target}.toml"
    if target and is_present(overlay):
        cases = apply_target_overlay(cases, overlay, platform=platform, target_runs=target_runs)
    return apply_backend_overlays(cases, directory / "backends")


@dataclass(frozen=True)
class CaseSelection:
    """Which cases to run and what to override in them (``parity check ID... --world-size --backend ...``).

    An id matches a contract id (``usp.ring_parity``), a case id (``sglang_suffix_w2``), the id of
    a matrix case without its ``[axes]`` (``ulysses``), or a glob (``usp.replicated_*``).
    """

    ids: tuple[str, ...] = ()
    world_size: int | None = None
    backend: str | None = None
    dtype: str | None = None
    sdpa_kernel: str | None = None
    deterministic: bool = False


def _matches(case: Case, pattern: str) -> bool:
    if pattern in (case.id, case.contract_id, case.id.split("[", 1)[0]):
        return True
    glob = case_glob(pattern)
    return any(ch in pattern for ch in "*?") and (
        glob.fullmatch(case.id) is not None or glob.fullmatch(case.contract_id) is not None
    )


def select_cases(cases: Sequence[Case], selection: CaseSelection, root: str | Path | None = None) -> list[Case]:
    """The cases ``selection`` asks for, overrides applied (re-validated), with the skips the backend overlay of
    ``root`` pins for the backend each case then runs; ConfigError when a selector matches nothing."""
    for pattern in selection.ids:
        if not any(_matches(c, pattern) for c in cases):
            known = sorted({c.contract_id for c in cases})
            raise ConfigError(f"no case matches {pattern!r}; contracts with cases: {', '.join(known)}", key="ID")
    chosen = [c for c in cases if not selection.ids or any(_matches(c, p) for p in selection.ids)]
    if selection.world_size is not None:
        chosen = [c for c in chosen if c.world_size == selection.world_size]
        if not chosen:
            raise ConfigError(f"no selected case runs at world size {selection.world_size}", key="--world-size")
    chosen = with_overrides(
        chosen,
        backend=selection.backend,
        dtype=selection.dtype,
        sdpa_kernel=selection.sdpa_kernel,
        deterministic=selection.deterministic or None,
    )
    return chosen if root is None else apply_backend_overlays(chosen, contract_case_dir(root) / "backends")
