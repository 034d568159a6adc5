"""Target resolution: built-in names, module:factory, and clear errors for everything else."""

from __future__ import annotations

import sys
import types

import pytest

from harness.errors import ConfigError
from harness.targets import CAPABILITIES, Target, load_target
from harness.targets.reference import ReferenceTarget
from harness.targets.spec import TargetSpec
from harness.targets.yunchang import CUDA_ONLY, NOT_INSTALLED, YunchangTarget


def test_builtin_targets():
    assert isinstance(load_target(TargetSpec("reference")), ReferenceTarget)
    assert load_target(TargetSpec("reference")) is load_target(TargetSpec("reference"))  # built once per process
    yunchang = load_target(TargetSpec("yunchang"))
    assert isinstance(yunchang, YunchangTarget) and yunchang.layer == "long_context"
    assert load_target(TargetSpec("yunchang-ulysses")).capabilities() == {"ulysses", "causal"}
    assert load_target(TargetSpec("reference")).capabilities() <= set(CAPABILITIES)


def test_module_factory_target_is_imported_and_called():
    target = load_target(TargetSpec("tests.targets.rotating_suffix:factory"))
    assert isinstance(target, Target) and target.name == "rotating_suffix"
    assert "replicated_suffix" in target.capabilities() and "reference_models" not in target.capabilities()


@pytest.fixture
def fake_module(monkeypatch):
    module = types.ModuleType("parity_fake_targets")

    class Odd(ReferenceTarget):
        def capabilities(self) -> frozenset[str]:
            return frozenset({"ulysses", "teleportation"})

    module.not_a_target = lambda: object()
    module.odd = Odd
    module.constant = 3
    monkeypatch.setitem(sys.modules, "parity_fake_targets", module)
    return module


@pytest.mark.parametrize(
    "spec,message",
    [
        (
            "nosuch",
            "unknown target 'nosuch'; built-in targets: reference, sglang, yunchang, yunchang-ulysses, xdit, diffusers, or give 'module:factory'",
        ),
        ("nosuch_module_xyz:factory", "cannot import module 'nosuch_module_xyz'"),
        ("parity_fake_targets:missing", "has no callable 'missing'"),
        ("parity_fake_targets:constant", "has no callable 'constant'"),
        ("parity_fake_targets:not_a_target", "not_a_target() returned object, not a harness.targets.Target"),
        ("parity_fake_targets:odd", "declares unknown capabilities ['teleportation']"),
        (":factory", "must be 'module:factory'"),
    ],
)
def test_bad_target_specs_are_config_errors(fake_module, spec, message):
    with pytest.raises(ConfigError) as info:
        load_target(TargetSpec(spec))
    assert message in str(info.value) and info.value.key == "target"


def test_yunchang_says_why_it_cannot_run(monkeypatch):
    target = YunchangTarget()
    import importlib.util

    real_find_spec = importlib.util.find_spec
    if real_find_spec("yunchang") is None:
        assert (
            target.unavailable_reason("cpu")
            == NOT_INSTALLED
            == "yunchang is not installed (pip install yunchang==0.6.4)"
        )
    # Installed or not, the CPU is refused for its own reason once the package is there.
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "yunchang" else real_find_spec(name, *a)
    )
    assert target.unavailable_reason("cpu") == CUDA_ONLY
    assert (
        CUDA_ONLY.startswith("yunchang's torch kernels call CUDA-only aten ops") and "one GPU per rank" not in CUDA_ONLY
    )
    assert target.unavailable_reason("cuda") is None
    with pytest.raises(ValueError, match="unknown yunchang layer 'ring'"):
        YunchangTarget("ring")
