"""Which parity this is: its version, and where its own data lives.

parity's own cases and baselines (the defaults when no project file names others, see
:mod:`harness.project`) are read from ``$PARITY_HOME``, else from the checkout an editable install
(``pip install -e .``) points into, else from the copy a built wheel embeds as ``parity/_data``
(``setup.py`` puts it there). That embedded copy is read-only: nothing is ever written inside the
installed package (:func:`is_inside_package`).
"""

from __future__ import annotations

import os
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

HOME_ENV = "PARITY_HOME"
PACKAGES = ("harness", "reference_impl", "parity")  # what the distribution installs
EMBEDDED_DATA = Path("parity") / "_data"  # the wheel's copy of cases/ and baselines/, under the install root

_INSTALL_ROOT = Path(__file__).resolve().parent.parent  # the checkout (editable install) or site-packages


def parity_version() -> str:
    """The installed package's version (``parity --version``, results.json); ``0+unknown`` run from a bare checkout."""
    try:
        return version("parity")
    except PackageNotFoundError:
        return "0+unknown"


def is_checkout() -> bool:
    """Whether this parity runs from its source checkout (an editable install, or a bare checkout)."""
    return (_INSTALL_ROOT / "pyproject.toml").is_file() and (_INSTALL_ROOT / "cases").is_dir()


def parity_home() -> Path:
    env = os.environ.get(HOME_ENV, "").strip()
    if env:
        return Path(env)
    if is_checkout() or not (_INSTALL_ROOT / EMBEDDED_DATA).is_dir():
        return _INSTALL_ROOT
    return _INSTALL_ROOT / EMBEDDED_DATA


def is_inside_package(path: Path) -> bool:
    """Whether ``path`` lies inside the installed (non-editable) package: a place parity must never write."""
    if is_checkout():
        return False
    resolved = path.resolve()
    return any(resolved.is_relative_to(_INSTALL_ROOT / name) for name in PACKAGES)


def default_cases_dir() -> Path:
    return parity_home() / "cases"


def default_baselines_dir() -> Path:
    return parity_home() / "baselines"


#: The case sets parity ships besides its default cases (``--suite NAME``): each a cases root under ``cases/``.
SUITES = {
    "production": "released models' shapes (Z-Image, FLUX.1, HunyuanVideo, Wan2.1) at W = 2, 4, 8: for a GPU",
    "long": "8k to 12k-token sequences sized for a CPU: the O(S) paths on every commit",
    "sweeps": "kernel-sensitive shapes for hardware sweeps",
}


def suite_dir(name: str) -> Path:
    """The cases root of the shipped suite ``name`` (one of :data:`SUITES`)."""
    return parity_home() / "cases" / name
