"""A contract case: one contract instantiated with validated parameters.

Case files (:mod:`harness.cases`), the CLI and ``assert_contract`` all build cases here, so a
parameter is checked the same way whoever wrote it; a problem is a ConfigError naming the
source, the case and the key.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.contracts.params import Params
from harness.contracts.registry import Contract, get_contract
from harness.errors import ConfigError, ParamError
from harness.targets.base import Refusal, Refused


@dataclass(frozen=True)
class CaseOrigin:
    """What every case has, contract or image: its id, the file (or caller) it came from, a description."""

    id: str
    source: str = field(kw_only=True)
    description: str = field(default="", kw_only=True)


@dataclass(frozen=True)
class ExpectedSkip:
    """A pinned skip (from an overlay): the case may be skipped, for ``because``, by a refusal of kind ``refusal``,
    lacking one of the capabilities ``lacks``, with a message holding the words ``reason`` (each: any when unset);
    ``where`` names the file and key that pin it."""

    because: str
    where: str
    reason: str | None = None
    refusal: Refusal | None = None
    lacks: frozenset[str] = frozenset()

    def mismatch(self, refused: Refused | None, message: str) -> str | None:
        """What this pin expects that a skip (its typed cause and message) does not show; None: it covers it."""
        if self.refusal is not None and (refused is None or refused.kind != self.refusal):
            return f"a {self.refusal} refusal, not {refused.kind if refused else 'an untyped skip'}"
        if self.lacks and (refused is None or refused.kind != Refusal.LACKS or not self.lacks & refused.lacks):
            return f"a target lacking {' or '.join(sorted(self.lacks))}"
        if self.reason is not None and self.reason not in message:
            return repr(self.reason)
        return None


@dataclass(frozen=True)
class ExpectedFailure:
    """A known upstream divergence (from a target overlay), pinned to what fails: the comparisons named in
    ``fails`` (``output``, ``dq``, ``dk``, ``dv``, ``checks``) or an error whose text holds one of ``raises`` (the
    words differ by torch release and device). Anything else failing in the case is a regression, not covered
    by it; ``where`` names the file and key."""

    because: str
    where: str
    fails: tuple[str, ...] = ()
    raises: tuple[str, ...] = ()

    def describe(self) -> str:
        what = f"raises {' or '.join(map(repr, self.raises))}" if self.raises else f"{', '.join(self.fails)} fail"
        return f"{self.because} ({what}; {self.where})"

    def uncovered(self, reason: str, failing: list[str] | None) -> tuple[str | None, str]:
        """What a failure with ``reason`` and ``failing`` comparisons shows beyond this one (None: nothing), and
        which of the named comparisons pass now (said, not failed: the divergence narrowed)."""
        if self.raises:
            return (None, "") if any(r in reason for r in self.raises) else ("it did not raise as pinned", "")
        if not failing:
            return "it failed before its comparisons were judged", ""
        extra = sorted(set(failing) - set(self.fails))
        passing = [name for name in self.fails if name not in failing]
        fixed = f" ({', '.join(passing)} now pass{'es' if len(passing) == 1 else ''})" if passing else ""
        return (f"{', '.join(extra)} fail{'s' if len(extra) == 1 else ''} too" if extra else None), fixed


@dataclass(frozen=True)
class Case(CaseOrigin):
    """One contract instantiated with parameters; ``raw`` keeps what was written (for overrides)."""

    contract_id: str
    params: Params
    raw: Mapping[str, Any]
    # A known upstream divergence (from a target overlay): why this case is expected to fail, and what fails.
    expected_failure: ExpectedFailure | None = field(default=None, kw_only=True)
    # What the target cannot express (from a target overlay): the skip this case is expected to end in.
    expected_skip: ExpectedSkip | None = field(default=None, kw_only=True)
    # The target overlay applied, if any: it states what its target runs, so an unpinned skip there is a change,
    # where without one a case needing an undeclared capability is merely not applicable.
    target_overlay: str | None = field(default=None, kw_only=True)
    # What the case's backend cannot express (a backend overlay): a skip whose reason holds one of these is pinned.
    backend_skips: tuple[ExpectedSkip, ...] = field(default=(), kw_only=True)
    # Seconds the case may take (a production shape's oracle takes minutes); None: the contract's own.
    timeout: float | None = field(default=None, kw_only=True)

    @property
    def world_size(self) -> int:
        return int(self.params.get("world_size", 1))


def make_case(
    contract_id: str,
    raw: Mapping[str, Any],
    *,
    case_id: str,
    source: str,
    description: str = "",
    inherited: Iterable[str] = (),
    timeout: float | None = None,
) -> Case:
    """Validate ``raw`` against the contract; a ConfigError names ``source``, the case and the key.

    ``inherited`` are the keys whose value came from the file's ``[defaults]`` (the error says so).
    """
    contract = contract_of(Path(source), case_id, contract_id)
    try:
        params = contract.resolve(raw)
    except ParamError as exc:
        note = " (value from [defaults])" if exc.key in set(inherited) else ""
        raise ConfigError(f"case '{case_id}': {exc}{note}", path=source, key=f"cases.{case_id}.{exc.key}") from None
    return Case(case_id, contract_id, params, dict(raw), source=source, description=description, timeout=timeout)


def rebuilt(case: Case, values: Mapping[str, Any], source: str | None = None) -> Case:
    """``case`` with ``values`` over its raw parameters, re-validated; it keeps its expected failure and skip."""
    fresh = make_case(
        case.contract_id,
        {**case.raw, **values},
        case_id=case.id,
        source=source or case.source,
        description=case.description,
        timeout=case.timeout,
    )
    return dataclasses.replace(fresh, expected_failure=case.expected_failure, expected_skip=case.expected_skip)


def with_overrides(cases: Iterable[Case], **overrides: Any) -> list[Case]:
    """The cases with ``overrides`` applied where the contract has that parameter (re-validated)."""
    result = []
    for case in cases:
        declared = {p.name for p in get_contract(case.contract_id).params}
        applied = {k: v for k, v in overrides.items() if v is not None and k in declared}
        result.append(rebuilt(case, applied) if applied else case)
    return result


def contract_of(path: Path, case_id: str, contract_id: str) -> Contract:
    """The registered contract a case names; a ConfigError naming the case otherwise."""
    try:
        return get_contract(contract_id)
    except KeyError as exc:
        raise ConfigError(f"case '{case_id}': {exc.args[0]}", path=path, key=f"cases.{case_id}.contract") from None
