"""Reading and validating parity's JSON files with errors that point at the exact spot.

Every baseline, manifest, policy and results file is user-edited or machine-merged; when one is
wrong the user must learn *which file, which line or key* without reading code. These helpers are
shared by all readers so every format reports problems the same way (``ConfigError``, exit 2).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from harness.errors import ConfigError

__all__ = ["read_json", "join_key", "expect_object", "expect_number", "expect_str", "check_finite_tree"]


def join_key(parent: str, key: str | int) -> str:
    """Dotted key path as users write it: ``cases.flux_image_t2i.psnr_threshold``."""
    return f"{parent}.{key}" if parent else str(key)


def check_finite_tree(value: Any, path: str | Path, key: str = "") -> None:
    """Refuse NaN/Infinity anywhere (Python's json accepts them; strict JSON and every threshold
    comparison do not: ``x >= nan`` is always False, so a NaN bound would silently fail or pass)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{value} is not a finite number", path=path, key=key or None)
    if isinstance(value, dict):
        for k, v in value.items():
            check_finite_tree(v, path, join_key(key, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            check_finite_tree(v, path, join_key(key, i))


def read_json(path: str | Path) -> Any:
    """Parse a JSON file; a missing file, malformed JSON (with line and column) or a non-finite
    number (with its key path) is a ConfigError naming the file."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError("file not found", path=p) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read file: {exc}", path=p) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"malformed JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}", path=p) from None
    check_finite_tree(data, p)
    return data


def expect_object(value: Any, path: str | Path, key: str) -> dict[str, Any]:
    """A JSON object or a ConfigError naming the key (``key=""`` is the document root)."""
    if not isinstance(value, dict):
        where = key or "the document root"
        raise ConfigError(f"{where} must be a JSON object, got {_type_name(value)}", path=path, key=key or None)
    return value


def expect_number(
    value: Any, path: str | Path, key: str, *, lo: float | None = None, hi: float | None = None
) -> float:
    """A finite JSON number within [lo, hi] as float; ints are accepted (sglang writes
    ``"psnr_threshold": 19``) but booleans are not (``true`` is an int to Python, not a bound)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"expected a number, got {_type_name(value)} {value!r}", path=path, key=key)
    number = float(value)
    if not math.isfinite(number):
        raise ConfigError(f"{number} is not a finite number", path=path, key=key)
    if lo is not None and number < lo:
        raise ConfigError(f"{value} is below the minimum {lo}", path=path, key=key)
    if hi is not None and number > hi:
        raise ConfigError(f"{value} is above the maximum {hi}", path=path, key=key)
    return number


def expect_str(value: Any, path: str | Path, key: str) -> str:
    """A JSON string or a ConfigError naming the key."""
    if not isinstance(value, str):
        raise ConfigError(f"expected a string, got {_type_name(value)} {value!r}", path=path, key=key)
    return value


def _type_name(value: Any) -> str:
    """JSON's names for types, since users read JSON, not Python."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__
