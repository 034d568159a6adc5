"""Errors the CLI maps to exit codes: configuration problems exit 2, regressions exit 1.

Both live at the bottom of the harness so every layer (targets included) can raise them.
"""

from __future__ import annotations

from pathlib import Path


class ConfigError(Exception):
    """A usage or configuration error (bad file, bad key, bad argument); the CLI exits 2.

    The message always names where the problem is, so a user can fix it without reading code.
    """

    def __init__(self, message: str, *, path: str | Path | None = None, key: str | None = None) -> None:
        self.path = str(path) if path is not None else None
        self.key = key
        where = []
        if self.path:
            where.append(self.path)
        if key:
            where.append(f"key '{key}'")
        super().__init__(f"{': '.join(where)}: {message}" if where else message)


class ParamError(ValueError):
    """A case parameter is missing, unknown, of the wrong type or inconsistent; ``key`` names it.

    Raised while a case is resolved (contract parameters, an image case's pipeline fields); the
    case loader turns it into a :class:`ConfigError` naming the file and ``cases.<id>.<key>``.
    """

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key
