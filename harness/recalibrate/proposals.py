"""What threshold and perf proposals share: which runs they may come from, no bound loosens without explicit
permission, and how a change reads.

A proposal that loosens a bound (a lower clip/ssim/psnr, a higher mean_abs_diff, a higher
expected time) is refused by every ``apply`` and write function unless ``allow_loosen`` is
given, and the refusal lists every offending value. Runs that failed are refused as input
unless asked for (:func:`check_runs`): the worst value of a failed run is what the gate just
rejected, and a bound made from it loosens to let the regression through.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from harness.errors import ConfigError
from harness.report.format import figure


class _Proposal(Protocol):
    @property
    def loosens(self) -> bool: ...

    def describe(self) -> str: ...


MIN_RUNS = 3  # fewer runs than this cannot tell noise from the typical value


class LooseningRefused(ConfigError):
    """Raised instead of loosening a bound without explicit permission."""


class FailedRunsRefused(ConfigError):
    """Raised when results of failed gate runs are given without ``include_failed``."""


def _failing_cases(doc: Mapping[str, Any]) -> list[str]:
    return [
        str(r.get("case_id"))
        for stage in (doc.get("stages") or {}).values()
        if isinstance(stage, Mapping)
        for r in stage.get("records", [])
        if isinstance(r, Mapping) and r.get("status") == "failed"
    ]


def check_runs(docs: Sequence[Mapping[str, Any]], paths: Sequence[Path], include_failed: bool) -> list[str]:
    """Refuse results of failed runs unless ``include_failed``; the warnings to show (too few runs, failed runs used)."""
    failed = [(path, _failing_cases(doc)) for path, doc in zip(paths, docs) if doc.get("passed") is False]
    lines = [f"{path} (failed: {', '.join(cases) or 'see the file'})" for path, cases in failed]
    if failed and not include_failed:
        raise FailedRunsRefused(
            f"{len(failed)} of {len(docs)} results come from a failed gate run; a proposal from them would be built "
            "on the values the gate rejected. Re-run the gate, or pass --include-failed if those values are the new "
            "normal:\n  " + "\n  ".join(lines)
        )
    warnings = [f"using {len(failed)} failed run(s) (--include-failed): " + "; ".join(lines)] if failed else []
    if len(docs) < MIN_RUNS:
        warnings.append(
            f"only {len(docs)} run(s): proposals from fewer than {MIN_RUNS} cannot tell run-to-run noise "
            f"from the typical value; gate {MIN_RUNS} times or more"
        )
    return warnings


def refuse_loosening(proposals: Iterable[_Proposal], allow_loosen: bool) -> None:
    offending = [p.describe() for p in proposals if p.loosens]
    if offending and not allow_loosen:
        raise LooseningRefused(
            f"refusing to loosen {len(offending)} bound(s) without --allow-loosen; nothing was written:\n  "
            + "\n  ".join(offending)
        )


def fmt(value: float | None) -> str:
    """A proposal's value in the diff table (6 significant figures, ``-inf`` kept negative)."""
    return figure(value, 6)


def change_word(changed: bool, loosens: bool) -> str:
    return "LOOSENS" if loosens else ("tightens" if changed else "unchanged")
