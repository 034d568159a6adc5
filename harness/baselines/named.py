"""A record of named numbers (thresholds per metric, tolerances per family) read by a name that must exist."""

from __future__ import annotations

from typing import ClassVar


class NamedValues:
    """Mixin for frozen dataclasses of floats: ``get(name)`` by one of ``names``, a KeyError listing them otherwise.

    ``class Thresholds(NamedValues, names=METRICS, what="metric")``.
    """

    NAMES: ClassVar[tuple[str, ...]] = ()
    WHAT: ClassVar[str] = "name"

    def __init_subclass__(cls, names: tuple[str, ...] = (), what: str = "name", **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        cls.NAMES, cls.WHAT = names, what

    def get(self, name: str) -> float:
        if name not in self.NAMES:
            raise KeyError(f"unknown {self.WHAT} {name!r}; valid: {list(self.NAMES)}")
        return float(getattr(self, name))
