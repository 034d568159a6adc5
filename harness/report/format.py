"""How a figure reads in a table, a report or a message: one formatter for every output."""

from __future__ import annotations

import math
from typing import Any

STATUS_COLOUR = {"passed": "#1a7f37", "failed": "#cf222e", "skipped": "#9a6700", "xfailed": "#6e7781"}
STATUS_STYLE = {"passed": "green", "failed": "bold red", "skipped": "yellow", "xfailed": "dim"}


def figure(value: Any, digits: int = 4) -> str:
    """``None`` -> ``-``, booleans as yes/no, floats to ``digits`` significant figures (``inf``, ``nan`` spelled out)."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return f"{value:.{digits}g}"
    return str(value)
