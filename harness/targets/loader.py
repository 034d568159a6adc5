"""Resolve a target spec string: a built-in name or ``module:factory``.

``module:factory`` imports ``module`` (from the installed packages or the current directory)
and calls ``factory(**target_args)``, which must return a :class:`~harness.targets.base.Target`
(or, for pipelines, a :class:`~harness.targets.base.PipelineTarget`). ``target_args`` are the
``--target-arg KEY=VALUE`` strings (``--pipeline-target-arg`` for a pipeline target), handed to
the factory as keyword arguments. Resolution
happens in the parent, to learn capabilities, and again inside each rank: only the strings
travel between processes.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable
from typing import TypeVar

from harness.errors import ConfigError
from harness.targets.base import CAPABILITIES, PipelineTarget, Target
from harness.targets.interface import InterfaceError, check_capabilities
from harness.targets.spec import REVISION_PREFIX, TargetArgs, TargetSpec

# name -> (module, factory attribute, one-line description)
BUILTIN_TARGETS: dict[str, tuple[str, str, str]] = {
    "reference": ("harness.targets.reference.attention", "factory", "reference_impl USPAttention (default)"),
    "sglang": (
        "harness.targets.sglang",
        "factory",
        "sglang's multimodal_gen USPAttention on sglang's parallel state (layer=MODULE:CLASS)",
    ),
    "yunchang": (
        "harness.targets.yunchang",
        "factory",
        "yunchang 0.6.4 LongContextAttention (Ulysses x ring; CUDA only)",
    ),
    "yunchang-ulysses": ("harness.targets.yunchang", "ulysses_factory", "yunchang 0.6.4 UlyssesAttention (CUDA only)"),
    "xdit": (
        "harness.targets.xdit",
        "factory",
        "xDiT (xfuser 0.7.0) USP, as its attention processors call it (CUDA only)",
    ),
    "diffusers": (
        "harness.targets.diffusers",
        "factory",
        "diffusers dispatch_attention_fn under ContextParallelConfig (backend=NAME)",
    ),
}
BUILTIN_PIPELINES: dict[str, tuple[str, str, str]] = {
    "reference": ("harness.targets.reference.pipeline", "factory", "reference_impl tiny seeded pipeline (default)"),
    "diffusers": (
        "harness.targets.diffusers_pipeline",
        "factory",
        "a diffusers DiffusionPipeline from a local directory (path=DIR)",
    ),
    "command": (
        "harness.targets.command_pipeline",
        "factory",
        "an external command writing PNGs and timings (template='...')",
    ),
    "openai": (
        "harness.targets.openai_pipeline",
        "factory",
        "a model behind an OpenAI Images API server (url=http://HOST:PORT, or launch='CMD ... {port}')",
    ),
}
REVISION_PIPELINE = (
    "harness.targets.reference.revision",
    "factory",
    "rev:GITREV: the reference pipeline at another commit of parity's checkout (a side of parity perf)",
)

T = TypeVar("T", Target, PipelineTarget)

_cache: dict[tuple[str, str, TargetArgs], object] = {}
_building: set[tuple[str, str, TargetArgs]] = set()  # a factory that loads the target it is building recurses


def load_target(spec: TargetSpec) -> Target:
    """The attention target ``spec`` names, built with its arguments; cached per process (ranks build it once)."""
    return _load(spec.name, spec.args, BUILTIN_TARGETS, Target, "target")


def load_pipeline_target(spec: TargetSpec, instance: str = "") -> PipelineTarget:
    """The pipeline target ``spec`` names, built with its arguments; cached per process and ``instance`` (the two
    sides of an A/B run in one process as two instances: each its own launched server, even with the same spec)."""
    return _load(spec.name, spec.args, BUILTIN_PIPELINES, PipelineTarget, "pipeline target", instance)


def stop_pipeline_targets() -> None:
    """Stop what every pipeline target built in this process keeps running between cases (a launched server)."""
    for target in list(_cache.values()):
        if isinstance(target, PipelineTarget):
            target.stop()


def _load(
    spec: str, args: TargetArgs, builtin: dict[str, tuple[str, str, str]], kind: type[T], what: str, instance: str = ""
) -> T:
    key = (what + instance, spec, tuple(args))
    if key not in _cache:
        if key in _building:
            raise ConfigError(
                f"{what} {spec!r}: its factory loads {spec!r} again (it is not a target factory)", key="target"
            )
        _building.add(key)
        try:
            _cache[key] = _build(spec, dict(args), builtin, kind, what)
        finally:
            _building.discard(key)
    target = _cache[key]
    assert isinstance(target, kind)
    return target


def _factory_of(
    spec: str, args: dict[str, str], builtin: dict[str, tuple[str, str, str]], kind: type[T], what: str
) -> tuple[str, str, dict[str, str]]:
    """Where ``spec`` names its factory: (module, attribute, the factory's arguments); a ``rev:`` pipeline adds its
    revision to them."""
    if spec in builtin:
        module_name, attr, _ = builtin[spec]
    elif kind is PipelineTarget and spec.startswith(REVISION_PREFIX):
        module_name, attr, _ = REVISION_PIPELINE
        args = {**args, "rev": spec[len(REVISION_PREFIX) :]}
    elif ":" in spec:
        module_name, _, attr = spec.partition(":")
        if not module_name or not attr:
            raise ConfigError(f"{what} {spec!r} must be 'module:factory'", key="target")
    else:
        raise ConfigError(
            f"unknown {what} {spec!r}; built-in {what}s: {', '.join(builtin)}, or give 'module:factory'", key="target"
        )
    return module_name, attr, args


def _checked(target: object, spec: str, attr: str, kind: type[T], what: str) -> T:
    """What the factory returned, if it is a ``kind`` (a Target's declared capabilities all known)."""
    if not isinstance(target, kind):
        raise ConfigError(
            f"{what} {spec!r}: {attr}() returned {type(target).__name__}, not a harness.targets.{kind.__name__}",
            key="target",
        )
    if isinstance(target, Target):
        try:
            unknown = check_capabilities(target) - set(CAPABILITIES)
        except InterfaceError as exc:
            raise ConfigError(str(exc), key="target") from exc
        if unknown:
            raise ConfigError(
                f"target {spec!r} declares unknown capabilities {sorted(unknown)}; known: {', '.join(CAPABILITIES)}",
                key="target",
            )
    return target


def _build(spec: str, args: dict[str, str], builtin: dict[str, tuple[str, str, str]], kind: type[T], what: str) -> T:
    module_name, attr, args = _factory_of(spec, args, builtin, kind, what)
    if os.getcwd() not in sys.path and "" not in sys.path:  # `parity` runs from a bin dir: see the user's modules
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except (
        Exception,
        SystemExit,
    ) as exc:  # a syntax error, or anything its import raises: a broken target, not a traceback
        raise ConfigError(
            f"{what} {spec!r}: cannot import module {module_name!r}: {_one_line(exc)}", key="target"
        ) from None
    factory: Callable[..., object] | None = getattr(module, attr, None)
    if not callable(factory):
        raise ConfigError(f"{what} {spec!r}: module {module_name!r} has no callable {attr!r}", key="target")
    option = "--pipeline-target-arg" if kind is PipelineTarget else "--target-arg"
    try:
        inspect.signature(factory).bind(**args)
    except TypeError as exc:
        taking = f"does not take {sorted(args)}" if args else "needs arguments"
        raise ConfigError(f"{what} {spec!r} {taking}: {exc}", key=option if args else "target") from None
    except ValueError:  # no signature to inspect (some builtins): the call below says it
        pass
    try:
        target = factory(**args)
    except ConfigError:
        raise
    except (Exception, SystemExit) as exc:  # sys:exit would end parity with 0 having run nothing
        raise ConfigError(
            f"{what} {spec!r}: {attr}() raised {_one_line(exc)}", key=option if args else "target"
        ) from None
    return _checked(target, spec, attr, kind, what)


def _one_line(exc: BaseException) -> str:
    """``Type: message`` of an exception on one line (a SyntaxError's with its file and line)."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
