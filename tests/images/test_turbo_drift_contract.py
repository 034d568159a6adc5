"""pipeline.turbo_drift on a real 2-rank gloo group: order-preserving SP is bitwise, the control can fail."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from harness.contracts.case import make_case
from harness.results import FAILED, PASSED
from harness.errors import ConfigError
from harness.contracts.runner import RunOptions, run_cases, validate_for_target
from harness.ranks import PoolSet
from harness.targets.reference import ReferenceTarget

pytestmark = pytest.mark.timeout(240)


def test_order_preserving_is_bitwise_and_the_rotated_layout_is_reported(assert_contract: Callable) -> None:
    verdict = assert_contract("pipeline.turbo_drift", world_size=2, dtype="fp32", steps=9, height=32, width=32)
    figures = verdict.figures
    assert verdict.status == PASSED and figures["bitwise"] and figures["mismatched"] == 0
    assert figures["order_preserving_bitwise"] and figures["order_preserving_mae"] == 0.0
    assert figures["rotate_to_front_latent_mae"] > 0.0  # the control: key order is visible in fp32
    assert {"rotate_to_front_mae", "rotate_to_front_max_abs"} <= set(figures) and verdict.kernel == "torch_sdpa"


def test_a_case_that_cannot_see_key_order_fails_its_control(rank_pools: PoolSet) -> None:
    # bf16 at 9 steps: the rotated layout's reorder noise stays under bf16 rounding (measured).
    case = make_case("pipeline.turbo_drift", {"world_size": 2, "dtype": "bf16", "steps": 9, "height": 32, "width": 32},
                     case_id="blind", source="test")
    [verdict] = run_cases([case], RunOptions(), rank_pools)
    assert verdict.status == FAILED and "control: rotate_to_front latents equal one rank's" in (verdict.reason or "")
    assert verdict.figures["order_preserving_bitwise"] and verdict.figures["rotate_to_front_latent_mae"] == 0.0


@pytest.mark.parametrize(("params", "key"), [({"height": 20}, "height"), ({"world_size": 1}, "world_size"),
                                              ({"world_size": 3}, "world_size"), ({"dtype": "fp64"}, "dtype")])
def test_bad_parameters_name_the_key(params: dict, key: str) -> None:
    with pytest.raises(ConfigError) as info:  # the contract's own checks, then the pipeline's (through the target)
        validate_for_target([make_case("pipeline.turbo_drift", params, case_id="c", source="f.toml")], ReferenceTarget())
    assert info.value.key == f"cases.c.{key}"
