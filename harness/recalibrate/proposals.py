"""What threshold and perf proposals share: no bound loosens without explicit permission, and how a change reads.

A proposal that loosens a bound (a lower clip/ssim/psnr, a higher mean_abs_diff, a higher
expected time) is refused by every ``apply`` and write function unless ``allow_loosen`` is
given, and the refusal lists every offending value.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Protocol

from harness.errors import ConfigError


class _Proposal(Protocol):
    @property
    def loosens(self) -> bool: ...

    def describe(self) -> str: ...


class LooseningRefused(ConfigError):
    """Raised instead of loosening a bound without explicit permission."""


def refuse_loosening(proposals: Iterable[_Proposal], allow_loosen: bool) -> None:
    offending = [p.describe() for p in proposals if p.loosens]
    if offending and not allow_loosen:
        raise LooseningRefused(
            f"refusing to loosen {len(offending)} bound(s) without allow_loosen (--allow-loosen):\n  "
            + "\n  ".join(offending)
        )


def fmt(value: float | None) -> str:
    if value is None:
        return "-"
    return "inf" if math.isinf(value) else f"{value:.6g}"


def change_word(changed: bool, loosens: bool) -> str:
    return "LOOSENS" if loosens else ("tightens" if changed else "unchanged")
