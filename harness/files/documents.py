"""What every parsed JSON or TOML document must satisfy, whatever file it is: the checks that need no schema.

Python's parsers accept more than parity can use: NaN and Infinity (``x >= nan`` is always False,
so a NaN bound silently fails or passes), integers of any length (a 400-digit number crashes the
first ``float()`` of it), duplicate JSON keys (the last one silently wins) and nesting as deep as
the interpreter's stack. The parsers' hooks (:data:`JSON_HOOKS`, :func:`toml_float`) turn what
they cannot refuse in place into a :class:`Refused` marker; :func:`check_document` then walks
the document once and raises a ConfigError naming the file and the key path of the first
marker, non-finite number, out-of-range integer or too deep a nesting.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from harness.errors import ConfigError

__all__ = [
    "MAX_DEPTH",
    "INT_MIN",
    "INT_MAX",
    "Refused",
    "JSON_HOOKS",
    "toml_float",
    "check_document",
    "join_key",
    "out_of_range",
]

#: Nesting levels a document may have (parity's deepest, a results file, has 7).
MAX_DEPTH = 64
#: TOML's integers are 64-bit (its spec); JSON's are held to the same range.
INT_MIN, INT_MAX = -(2**63), 2**63 - 1
_MAX_INT_DIGITS = 20  # longer than any int64: refused without converting (int() of 5000 digits raises)


class Refused(str):
    """A value a parser hook refused; the message travels in the document until the walk can name its key."""


def out_of_range(value: int) -> str:
    """Why an integer outside 64 bits is refused, without printing it (``str()`` of 5000 digits raises)."""
    shown = str(value) if abs(value) < 10**24 else f"of about {int(value.bit_length() * 0.30103) + 1} digits"
    return f"the integer {shown} is out of range [{INT_MIN}, {INT_MAX}]"


def join_key(parent: str, key: str | int) -> str:
    """Dotted key path as users write it: ``cases.flux_image_t2i.psnr_threshold``."""
    return f"{parent}.{key}" if parent else str(key)


def _json_int(text: str) -> int | Refused:
    if len(text.lstrip("-")) > _MAX_INT_DIGITS:
        return Refused(f"an integer of {len(text.lstrip('-'))} digits is out of range [{INT_MIN}, {INT_MAX}]")
    return int(text)


def _float(text: str) -> float | Refused:
    value = float(text)
    if not math.isfinite(value):
        shown = text if len(text) <= 24 else text[:20] + "..."
        return Refused(f"{shown} is not a finite number")
    return value


def _json_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for key, value in pairs:
        obj[key] = Refused("duplicate key: it appears more than once in this object") if key in obj else value
    return obj


#: Keyword arguments of ``json.loads`` that mark what the walk refuses.
JSON_HOOKS: dict[str, Any] = {
    "object_pairs_hook": _json_object,
    "parse_int": _json_int,
    "parse_float": _float,
    "parse_constant": lambda name: Refused(f"{name} is not a finite number (and not JSON)"),
}

#: ``tomllib.loads(parse_float=...)``: nan, inf and overflowing floats become markers.
toml_float = _float


def _encodable(text: str) -> bool:
    """Whether ``text`` is UTF-8 text: JSON's ``"\\ud800"`` escape decodes to a lone surrogate, which no
    output (a terminal, a report, a file) can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_document(value: Any, path: str | Path, key: str = "", depth: int = 0, nul_free: bool = False) -> None:
    """Raise a ConfigError at the first marker, non-finite float, out-of-range int or nesting beyond MAX_DEPTH;
    with ``nul_free`` also at a NUL character in a key or a string (configuration: its strings become paths,
    arguments and names, which a NUL ends or breaks)."""
    if depth > MAX_DEPTH:
        raise ConfigError(f"nested deeper than {MAX_DEPTH} levels", path=path, key=key or None)
    if nul_free and isinstance(value, str) and "\x00" in value:
        raise ConfigError(
            "a NUL character in a string (it cannot be part of a path, an argument or a name)",
            path=path,
            key=key or None,
        )
    if isinstance(value, str) and not _encodable(value):
        raise ConfigError("a lone surrogate in a string (not text: \\ud800-\\udfff alone)", path=path, key=key or None)
    if isinstance(value, Refused):
        raise ConfigError(str(value), path=path, key=key or None)
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{value} is not a finite number", path=path, key=key or None)
    if isinstance(value, int) and not isinstance(value, bool) and not INT_MIN <= value <= INT_MAX:
        raise ConfigError(out_of_range(value), path=path, key=key or None)
    if isinstance(value, dict):
        for k, v in value.items():
            if nul_free and "\x00" in k:
                raise ConfigError("a NUL character in a key", path=path, key=join_key(key, repr(k)))
            if not _encodable(k):
                raise ConfigError("a lone surrogate in a key (not text)", path=path, key=join_key(key, ascii(k)[1:-1]))
            check_document(v, path, join_key(key, k), depth + 1, nul_free)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            check_document(v, path, join_key(key, i), depth + 1, nul_free)
