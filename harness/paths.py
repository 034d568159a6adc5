"""Which parity this is: its version, and where its data lives (``$PARITY_HOME``, else the checkout it was installed from).

``pip install -e .`` leaves ``harness/`` inside the checkout, so its parent holds ``cases/``
and ``baselines/``. A regular (non-editable) install has no such directories next to the
package: set ``PARITY_HOME`` to a checkout, or pass ``--cases`` / ``--baselines``.
"""

from __future__ import annotations

import os
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

HOME_ENV = "PARITY_HOME"


def parity_version() -> str:
    """The installed package's version (``parity --version``, results.json); ``0+unknown`` run from a bare checkout."""
    try:
        return version("parity")
    except PackageNotFoundError:
        return "0+unknown"


def parity_home() -> Path:
    env = os.environ.get(HOME_ENV, "").strip()
    return Path(env) if env else Path(__file__).resolve().parent.parent


def default_cases_dir() -> Path:
    return parity_home() / "cases"


def default_baselines_dir() -> Path:
    return parity_home() / "baselines"
