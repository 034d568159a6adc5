"""Only what pyproject.toml cannot say: a built wheel embeds parity's own cases/ and baselines/ as
parity/_data (the defaults :mod:`harness.paths` reads when no checkout is there); an editable
install reads them from the checkout instead."""

from __future__ import annotations

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

DATA = ("cases", "baselines")


class BuildPyWithData(build_py):
    """build_py, plus the data directories copied under parity/_data of the build tree."""

    def run(self) -> None:
        super().run()
        if self.editable_mode:
            return
        for name in DATA:
            target = Path(self.build_lib) / "parity" / "_data" / name
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(Path(__file__).parent / name, target, ignore=shutil.ignore_patterns("__pycache__", "*.bak"))


setup(cmdclass={"build_py": BuildPyWithData})
