"""Where the project's data lives: ``$PARITY_HOME``, else the checkout the package was installed from.

``pip install -e .`` leaves ``harness/`` inside the checkout, so its parent holds ``cases/``
and ``baselines/``. A regular (non-editable) install has no such directories next to the
package: set ``PARITY_HOME`` to a checkout, or pass ``--cases`` / ``--baselines``.
"""

from __future__ import annotations

import os
from pathlib import Path

HOME_ENV = "PARITY_HOME"


def parity_home() -> Path:
    env = os.environ.get(HOME_ENV, "").strip()
    return Path(env) if env else Path(__file__).resolve().parent.parent


def default_cases_dir() -> Path:
    return parity_home() / "cases"


def default_baselines_dir() -> Path:
    return parity_home() / "baselines"
