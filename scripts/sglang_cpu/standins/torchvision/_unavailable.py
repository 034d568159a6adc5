"""The placeholders of the torchvision stand-in: modules for any submodule, objects for any name."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import types
from collections.abc import Callable
from typing import NoReturn

REASON = "torchvision is a stand-in here (no CPU build for torch 2.13; scripts/sglang_cpu/README.md)"


class Unavailable:
    """Any attribute is another placeholder; calling or subclassing one raises."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Unavailable:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Unavailable(f"{self._name}.{attr}")

    def __call__(self, *args: object, **kwargs: object) -> NoReturn:
        raise RuntimeError(f"{self._name}: {REASON}")

    def __mro_entries__(self, bases: tuple[object, ...]) -> NoReturn:
        raise RuntimeError(f"cannot subclass {self._name}: {REASON}")

    def __repr__(self) -> str:
        return f"<unavailable {self._name}>"


def module_getattr(module: str) -> Callable[[str], Unavailable]:
    """A module-level ``__getattr__`` (PEP 562) that answers every public name with a placeholder."""

    def __getattr__(name: str) -> Unavailable:
        if name.startswith("__"):
            raise AttributeError(name)
        return Unavailable(f"{module}.{name}")

    return __getattr__


class _PlaceholderModule(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        module.__getattr__ = module_getattr(module.__name__)  # type: ignore[method-assign]


class SubmoduleFinder(importlib.abc.MetaPathFinder):
    """Serves every ``<package>.*`` submodule as a placeholder package (searched last, after real files)."""

    def __init__(self, package: str) -> None:
        self.prefix = package + "."

    def find_spec(self, name: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if not name.startswith(self.prefix):
            return None
        return importlib.machinery.ModuleSpec(name, _PlaceholderModule(), is_package=True)
