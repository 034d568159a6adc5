"""Everything in the harness that knows ``reference_impl``: its attention target, pipeline target and model checks.

No other part of the harness imports ``reference_impl`` (``reference_impl.platform``, the platform
detector, excepted); contracts reach these through the target interface. The package imports
nothing itself (its names load on first use), so a rank that imports ``reference_impl`` from
another commit (:mod:`.revision`) loads only the modules that side runs.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {"ReferenceAttention": "attention", "ReferenceTarget": "attention", "factory": "attention"}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)


__all__ = ["ReferenceAttention", "ReferenceTarget", "factory"]
