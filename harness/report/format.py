"""How a figure reads in a table, a report or a message: one formatter for every output."""

from __future__ import annotations

import math
import re
from typing import Any

STATUS_COLOUR = {
    "passed": "#1a7f37",
    "failed": "#cf222e",
    "skipped": "#9a6700",
    "xfailed": "#6e7781",
    "inconclusive": "#8250df",
    "not_applicable": "#6e7781",
}
STATUS_STYLE = {
    "passed": "green",
    "failed": "bold red",
    "skipped": "yellow",
    "xfailed": "dim",
    "inconclusive": "bold magenta",
    "not_applicable": "dim",
}


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


def psnr_text(value: float | None) -> str:
    """A PSNR between two images: ``-`` (nothing to compare), ``identical`` (inf) or ``x.xx dB``."""
    if value is None:
        return "-"
    return "identical" if math.isinf(value) else f"{value:.2f} dB"


#: C0 and C1 control characters, DEL, and the bidirectional overrides that reorder what a terminal shows.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def inert(text: Any) -> str:
    """``text`` as a terminal shows it harmlessly: every control character (an escape sequence's ESC
    among them) written as its ``\\xNN`` or ``\\uNNNN`` escape; for text read from files, such as a
    results file's case ids."""
    return _CONTROL.sub(
        lambda m: repr(m.group())[1:-1] if ord(m.group()) < 0x100 else f"\\u{ord(m.group()):04x}", str(text)
    )


def inert_lines(text: Any) -> str:
    """:func:`inert`, line by line: a multi-line message or table keeps its line breaks, nothing else."""
    return "\n".join(inert(line) for line in str(text).split("\n"))


OUTCOME_WORD = {
    "passed": "pass",
    "failed": "FAIL",
    "xfailed": "xfail",
    "skipped": "skip",
    "inconclusive": "undecided",
    "not_applicable": "n/a",
}


def outcome_cell(status: str, figures: dict[str, Any] | None) -> str:
    """A matrix cell: the outcome's word, then ``=`` when bitwise with one rank or the max abs error
    (``2.00e-03``, or ``inf``/``nan`` as results files record them); a skip is its word alone."""
    word = OUTCOME_WORD.get(status, status)
    figures = figures or {}
    if status in ("skipped", "not_applicable"):
        return word
    if figures.get("bitwise"):
        return f"{word} ="
    max_abs = figures.get("max_abs")
    if isinstance(max_abs, str):  # a non-finite value as results files write it
        return f"{word} {max_abs}"
    if isinstance(max_abs, (int, float)) and not isinstance(max_abs, bool):
        return f"{word} {max_abs:.2e}"
    return word
