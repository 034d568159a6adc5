"""The overlays of the CUDA-only targets (yunchang, yunchang-ulysses, xdit) pin every case the adapter's declared
capabilities keep from running, by its typed cause: checked here against the adapters themselves
on any machine (availability set aside), while tests/targets/test_release_pins.py holds them to what the H200
runs recorded."""

from __future__ import annotations

import pytest
from packaging.version import Version

from harness.cases import load_cases
from harness.cases.overlays import apply_target_overlay
from harness.contracts.runner import RunOptions, precheck
from harness.paths import default_cases_dir
from harness.targets.base import Capability, Target
from harness.targets.spec import TargetSpec
from harness.targets.xdit import XditTarget
from harness.targets.yunchang import YunchangTarget, has_flash_attn_2

TARGETS = {
    "yunchang": (lambda: YunchangTarget("long_context"), "0.6.4"),
    "yunchang-ulysses": (lambda: YunchangTarget("ulysses"), "0.6.4"),
    "xdit": (XditTarget, "0.7.0"),
}


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_every_case_the_adapter_cannot_express_is_pinned_by_its_cause(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if name.startswith("yunchang"):
        pytest.importorskip("yunchang", reason="yunchang is not installed (pip install yunchang==0.6.4)")
        assert not has_flash_attn_2(), "measured without flash-attn 2.x: the backward pins assume it missing"
    make, version = TARGETS[name]
    target: Target = make()
    monkeypatch.setattr(target, "unavailable_reason", lambda device: None)  # what it declares, installed or not
    overlay = default_cases_dir() / "contracts" / "targets" / f"{name}.toml"
    cases = apply_target_overlay(load_cases(default_cases_dir(), "cuda"), overlay, Version(version), "cuda")
    options = RunOptions(TargetSpec(name), device="cuda")
    refusals = {c.id: (precheck(c, target, options), c) for c in cases}
    wrong = {
        case_id: f"{why.reason} / pin: {case.expected_skip}"
        for case_id, (why, case) in refusals.items()
        if why
        and Capability.REFERENCE_MODELS not in why.reason
        and (case.expected_skip is None or case.expected_skip.mismatch(why.refused, why.reason))
    }
    assert wrong == {}
    assert sum(why is None for why, _ in refusals.values()) >= 27  # the Ulysses cases run, pinned or not
