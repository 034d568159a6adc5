"""Reading and validating parity's JSON files with errors that point at the exact spot.

Every baseline, manifest, policy and results file is user-edited or machine-merged; when one is
wrong the user must learn *which file, which line or key* without reading code. These helpers are
shared by all readers so every format reports problems the same way (``ConfigError``, exit 2).
"""

from __future__ import annotations

import difflib
import json
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from harness.errors import ConfigError
from harness.files.documents import INT_MAX, INT_MIN, JSON_HOOKS, check_document, join_key, out_of_range
from harness.files.reading import MAX_BYTES, read_text

__all__ = [
    "read_json",
    "parse_json",
    "join_key",
    "expect_object",
    "expect_known_keys",
    "expect_number",
    "expect_int",
    "expect_str",
    "expect_id",
    "expect_known_key",
    "MAX_ID_LENGTH",
]

#: Ids become file names (``<id>.png`` plus a temp-file prefix): a safe alphabet and well under 255 bytes.
MAX_ID_LENGTH = 128
_SAFE_ID = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


def read_json(path: str | Path, max_bytes: int = MAX_BYTES, within: str | Path | None = None) -> Any:
    """Parse a JSON file; any problem is a ConfigError naming the file: not a regular file, too large,
    not UTF-8, malformed (with line and column), nested too deep, a duplicate key, NaN/Infinity or
    an integer outside 64 bits (with its key path). ``within``: a file another program handed over,
    read only as a regular file inside that directory (:func:`harness.files.reading.read_regular_bytes`)."""
    p = Path(path)
    return parse_json(read_text(p, max_bytes, within), p)


def parse_json(text: str, where: str | Path) -> Any:
    """JSON ``text`` read from ``where`` (a file, a server's answer), checked as :func:`read_json` checks a file."""
    try:
        data = json.loads(text, **JSON_HOOKS)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"malformed JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}", path=where) from None
    except RecursionError:
        raise ConfigError("malformed JSON: nested too deeply to parse", path=where) from None
    check_document(data, where)
    return data


def expect_object(value: Any, path: str | Path, key: str) -> dict[str, Any]:
    """A JSON object or a ConfigError naming the key (``key=""`` is the document root)."""
    if not isinstance(value, dict):
        where = key or "the document root"
        raise ConfigError(f"{where} must be a JSON object, got {_type_name(value)}", path=path, key=key or None)
    return value


def expect_known_key(key: str, own: Sequence[str], upstream: Sequence[str], path: str | Path, where: str) -> None:
    """Refuse a key that is none of parity's (``own``), sglang's (``upstream``: kept, not read) or a comment
    (``_...``), naming the nearest known one: a misspelt key would otherwise be ignored and its default used."""
    if key in own or key in upstream or key.startswith("_"):
        return
    near = difflib.get_close_matches(key, [*own, *upstream], n=1, cutoff=0.6)
    hint = f"did you mean {near[0]!r}? " if near else ""
    theirs = f", sglang's {', '.join(upstream)} (kept, not gated)" if upstream else ""
    raise ConfigError(
        f"unknown key: {hint}the keys here are {', '.join(own)}{theirs} and comments starting with '_'",
        path=path,
        key=where,
    )


def expect_known_keys(
    table: Mapping[str, Any], own: Sequence[str], path: str | Path, where: str, upstream: Sequence[str] = ()
) -> None:
    """:func:`expect_known_key` for every key of ``table``, found at ``where`` (``""``: the document root)."""
    for key in table:
        expect_known_key(key, own, upstream, path, join_key(where, key))


def expect_number(value: Any, path: str | Path, key: str, *, lo: float | None = None, hi: float | None = None) -> float:
    """A finite JSON number within [lo, hi] as float; ints are accepted (sglang writes
    ``"psnr_threshold": 19``) but booleans are not (``true`` is an int to Python, not a bound)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"expected a number, got {_type_name(value)} {value!r}", path=path, key=key)
    if isinstance(value, int) and not INT_MIN <= value <= INT_MAX:  # an in-memory document skipped the reader
        raise ConfigError(out_of_range(value), path=path, key=key)
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


def expect_int(value: Any, path: str | Path, key: str, *, lo: int | None = None, hi: int | None = None) -> int:
    """A JSON integer within [lo, hi] (not a boolean, not a float such as 2.0)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"expected an integer, got {_type_name(value)} {value!r}", path=path, key=key)
    if not INT_MIN <= value <= INT_MAX:
        raise ConfigError(out_of_range(value), path=path, key=key)
    if lo is not None and value < lo:
        raise ConfigError(f"{value} is below the minimum {lo}", path=path, key=key)
    if hi is not None and value > hi:
        raise ConfigError(f"{value} is above the maximum {hi}", path=path, key=key)
    return value


def expect_id(value: Any, path: str | Path | None, key: str, what: str = "case id") -> str:
    """An id that is safe as a file name: letters, digits, ``_ . -``, not starting with ``.`` or ``-``,
    no ``..``, at most :data:`MAX_ID_LENGTH` characters."""
    if not isinstance(value, str) or not _SAFE_ID.fullmatch(value) or ".." in value or len(value) > MAX_ID_LENGTH:
        shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
        raise ConfigError(
            f"{what} {shown} is not usable as a file name: letters, digits, '_', '.', '-' (not first), "
            f"no '..', at most {MAX_ID_LENGTH} characters",
            path=path,
            key=key,
        )
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
