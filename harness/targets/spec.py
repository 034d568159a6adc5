"""A target as the user names it: one shape for contracts, pipelines, the two sides of an A/B and results.

A spec is a built-in name, ``module:factory`` or (for a pipeline) ``rev:GITREV``, with the factory's
keyword arguments as sorted ``(key, value)`` string pairs: only strings travel between processes,
so a spec is what a rank receives and what a results document records.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from harness.errors import ConfigError

TargetArgs = tuple[tuple[str, str], ...]
DEFAULT_TARGET = "reference"  # the attention target and the pipeline target a command line that names none runs
#: ``rev:GITREV``: the reference pipeline as a commit of parity's checkout has it (a perf A/B side).
REVISION_PREFIX = "rev:"
_UNRECORDED_ARGS = frozenset({"tree"})  # a revision's temporary export: another path every run


def parse_target_args(items: Sequence[str], option: str = "--target-arg") -> TargetArgs:
    """``["layer=pkg.mod:Cls", ...]`` as sorted ``(key, value)`` pairs; a ConfigError names a bad one and ``option``."""
    pairs: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.isidentifier():
            raise ConfigError(f"{item!r} is not KEY=VALUE with KEY a Python identifier", key=option)
        if key in pairs:
            raise ConfigError(f"{key!r} is given twice", key=option)
        pairs[key] = value
    return tuple(sorted(pairs.items()))


@dataclass(frozen=True)
class TargetSpec:
    """A target spec and its factory arguments (``--target``/``--target-arg``, ``--pipeline-target``/...)."""

    name: str = DEFAULT_TARGET
    args: TargetArgs = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "args", tuple(sorted(tuple(pair) for pair in self.args)))

    @property
    def is_revision(self) -> bool:
        return self.name.startswith(REVISION_PREFIX)

    def with_args(self, **changes: str) -> TargetSpec:
        return TargetSpec(self.name, tuple({**dict(self.args), **changes}.items()))

    def describe(self) -> dict[str, Any]:
        """As a results document records it: the name, the arguments (a revision with its commit)."""
        args = dict(self.args)
        shown = {k: v for k, v in args.items() if k not in _UNRECORDED_ARGS}
        return {"target": self.name, "args": shown, **({"commit": args["commit"]} if "commit" in args else {})}


REFERENCE = TargetSpec()  # the default target, without arguments
