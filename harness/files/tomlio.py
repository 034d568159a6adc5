"""Reading parity's TOML files (case files, overlays, policies) with errors that name the file."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from harness.errors import ConfigError


def read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"invalid TOML: {exc}", path=path) from None
    except FileNotFoundError:
        raise ConfigError("file not found", path=path) from None
    except OSError as exc:
        raise ConfigError(f"cannot read: {exc.strerror}", path=path) from None
