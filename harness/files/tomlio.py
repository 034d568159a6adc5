"""Reading parity's TOML files (case files, overlays, policies) with errors that name the file and key.

The same guarantees as :func:`harness.files.jsonio.read_json`: a regular UTF-8 file under the
size limit, no NaN/inf, integers within TOML's 64 bits, nesting within
:data:`harness.files.documents.MAX_DEPTH` (duplicate keys are already an error in TOML itself), and
no NUL character in a key or string (``"\u0000"`` is legal TOML, but a case field becomes an argument or a path).
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

from harness.errors import ConfigError
from harness.files.documents import check_document, toml_float
from harness.files.reading import MAX_BYTES, read_text

__all__ = ["read_toml"]

_LONG_DIGITS = re.compile(r"\d{4000,}")
_HEADER = re.compile(r"^[ \t]*\[+([^\]\n]+)\]+", re.MULTILINE)


def read_toml(path: str | Path, max_bytes: int = MAX_BYTES) -> dict[str, Any]:
    """Parse a TOML file; every problem is a ConfigError naming the file (and the key or line)."""
    p = Path(path)
    text = read_text(p, max_bytes)
    try:
        data = tomllib.loads(text, parse_float=toml_float)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"invalid TOML: {exc}", path=p) from None
    except RecursionError:
        raise ConfigError("invalid TOML: nested too deeply to parse", path=p) from None
    except ValueError:  # int() refuses more than 4300 digits before tomllib can say where
        found = _LONG_DIGITS.search(text)
        if found is None:
            raise ConfigError("invalid TOML: a value Python cannot convert", path=p) from None
        start = text.rfind("\n", 0, found.start()) + 1
        raise ConfigError(
            f"invalid TOML: line {text.count(chr(10), 0, start) + 1}: an integer of "
            f"{len(found.group())} digits is out of range",
            path=p,
            key=_key_at(text, start, text[start : found.start()].partition("=")[0]),
        ) from None
    check_document(data, p, nul_free=True)
    return data


def _key_at(text: str, line_start: int, local: str) -> str | None:
    """The dotted key of ``local = ...`` on the line at ``line_start``: its table header's key, then its own."""
    headers = [m for m in _HEADER.finditer(text, 0, line_start)]
    table = headers[-1].group(1) if headers else ""
    parts = [part.strip().strip("\"'") for part in (table.split(".") if table else []) + local.split(".")]
    return ".".join(part for part in parts if part) or None
