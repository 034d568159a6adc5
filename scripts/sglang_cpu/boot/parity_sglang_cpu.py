"""Stand-in for sglang's top-level ``__init__``, loaded at interpreter start by ``parity-sglang-cpu.pth``.

sglang's ``sglang/__init__.py`` sets up the LLM server front end (``sglang.lang``, cache
redirections, transformers patches) before any submodule can be imported; the multimodal_gen
attention layer needs none of it. This finder answers only ``import sglang``: it returns the
installed package (same directory, same submodules, ``__version__`` from its metadata) with
this module's body in place of sglang's ``__init__``, and only then puts ``../standins``
(IPython, torchvision) at the end of ``sys.path``, so a process that never imports sglang sees
no stand-in and a real package always wins over one. No file of sglang is changed.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from importlib.metadata import version
from pathlib import Path

STANDINS = str(Path(__file__).resolve().parent.parent / "standins")
NOTE = "sglang's top-level __init__ replaced by parity's CPU stand-in (scripts/sglang_cpu/README.md)"


class _InitStandIn(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None  # a plain module object

    def exec_module(self, module: types.ModuleType) -> None:
        module.__doc__ = NOTE
        module.__version__ = version("sglang")
        if STANDINS not in sys.path:
            sys.path.append(STANDINS)


class SglangFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if name != "sglang":
            return None
        real = importlib.machinery.PathFinder.find_spec(name)
        if real is None or real.submodule_search_locations is None:
            return None  # not installed: the import fails as it would without this finder
        spec = importlib.machinery.ModuleSpec(name, _InitStandIn(), origin=real.origin, is_package=True)
        spec.submodule_search_locations = list(real.submodule_search_locations)
        return spec


if not any(isinstance(finder, SglangFinder) for finder in sys.meta_path):
    sys.meta_path.insert(0, SglangFinder())
