"""pipeline.turbo_drift on a real 2-rank gloo group: order-preserving SP is bitwise, the control can fail."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from harness.contracts.case import make_case
from harness.contracts.runner import RunOptions, run_cases, validate_for_target
from harness.errors import ConfigError
from harness.ranks import PoolSet
from harness.results import FAILED, PASSED
from harness.targets.reference import ReferenceTarget

pytestmark = pytest.mark.timeout(240)


def test_order_preserving_is_bitwise_and_the_rotated_layout_is_reported(assert_contract: Callable) -> None:
    verdict = assert_contract("pipeline.turbo_drift", world_size=2, dtype="fp32", steps=9, height=32, width=32)
    figures = verdict.figures
    assert verdict.status == PASSED and figures["bitwise"] and figures["mismatched"] == 0
    assert figures["order_preserving_bitwise"] and figures["order_preserving_mae"] == 0.0
    assert figures["rotate_to_front_latent_mae"] > 0.0  # the control: key order is visible in fp32
    assert {"rotate_to_front_mae", "rotate_to_front_max_abs"} <= set(figures) and verdict.kernel == "torch_sdpa"


def test_the_trained_checkpoint_reaches_the_pipeline(assert_contract: Callable) -> None:
    """``weights`` is passed through: the trained DiT moves differently under rotation than the random one."""
    params = {"world_size": 2, "dtype": "fp32", "steps": 4, "height": 32, "width": 32, "prompt": "a cameraman"}
    trained = assert_contract("pipeline.turbo_drift", weights="tiny-v1", **params).figures
    random = assert_contract("pipeline.turbo_drift", **params).figures
    assert trained["order_preserving_bitwise"] and random["order_preserving_bitwise"]
    assert trained["rotate_to_front_latent_mae"] not in (0.0, random["rotate_to_front_latent_mae"])


def rotation_is_the_identity() -> None:
    """Rank worker: from now on this rank builds the rotate_to_front pipeline without rotating anything."""
    import reference_impl.pipeline as pipeline

    pipeline.rotate_captions_to_front = lambda model: 0


def test_a_case_that_cannot_see_key_order_fails_its_control() -> None:
    """A case blind to key order by construction, whatever the CPU's arithmetic: on these ranks the
    "rotated" layout is the order-preserving one, so its run is the same computation as the
    order-preserving run and equals one rank bit for bit. Its control must fail. (fp32, where a real
    rotation is visible at every step count measured, so only the construction makes it blind.)"""
    case = make_case(
        "pipeline.turbo_drift",
        {"world_size": 2, "dtype": "fp32", "steps": 9, "height": 32, "width": 32},
        case_id="blind",
        source="test",
    )
    with PoolSet() as pools:  # its own ranks: the patch must not reach the session's pools
        pools.get(2).run(rotation_is_the_identity)
        [verdict] = run_cases([case], RunOptions(), pools)
    assert verdict.status == FAILED and "control: rotate_to_front latents equal one rank's" in (verdict.reason or "")
    assert verdict.figures["order_preserving_bitwise"] and verdict.figures["rotate_to_front_latent_mae"] == 0.0


@pytest.mark.parametrize(
    "contract_id", ["pipeline.turbo_drift", "perf.sp_step_ratio"]
)  # every contract that runs the pipeline
@pytest.mark.parametrize(
    ("params", "key"),
    [
        ({"height": 20}, "height"),
        ({"world_size": 1}, "world_size"),
        ({"world_size": 3}, "world_size"),
        ({"dtype": "fp64"}, "dtype"),
        ({"weights": "no-such-checkpoint"}, "weights"),
    ],
)
def test_bad_parameters_name_the_key(contract_id: str, params: dict, key: str) -> None:
    with pytest.raises(ConfigError) as info:  # the contract's own checks, then the pipeline's (through the target)
        validate_for_target([make_case(contract_id, params, case_id="c", source="f.toml")], ReferenceTarget())
    assert info.value.key == f"cases.c.{key}"
