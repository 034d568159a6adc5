"""pytest plugin (entry point ``pytest11: parity``): check your implementation from your own suite.

Fixtures: ``rank_pools`` (the session's :class:`harness.ranks.PoolSet`), ``rank_pool(world_size)``
and ``assert_contract("usp.ulysses_parity", world_size=2, dtype="bf16")``, which runs one case on
the session's target, fails the test with the figures, skips it with the reason when the target
cannot express the case, and returns the CaseResult. Options: ``--parity-target`` (a built-in name
or ``module:factory``; default ``reference``), ``--parity-target-arg KEY=VALUE`` (repeatable),
``--parity-device`` and ``--parity-no-skip`` (a skip fails the test: parity's own suite runs so, so a
pass cannot quietly become a skip). Imports are lazy: a session that does not use it pays nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from harness.ranks import PoolSet, RankPool
    from harness.results import CaseResult


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("parity", "parity contracts")
    group.addoption(
        "--parity-target", default="reference", help="target for assert_contract: a built-in name or module:factory"
    )
    group.addoption(
        "--parity-target-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="keyword argument of the target's factory (repeatable)",
    )
    group.addoption(
        "--parity-device",
        default="cpu",
        choices=("cpu", "cuda"),
        help="device of the ranks for rank_pool / assert_contract",
    )
    group.addoption(
        "--parity-no-skip",
        action="store_true",
        help="assert_contract fails a case the target cannot express instead of skipping it (a suite whose "
        "every case must run: a capability the target dropped then turns the run red, not silently skipped)",
    )


@pytest.fixture(scope="session")
def rank_pools(request: pytest.FixtureRequest) -> Iterator[PoolSet]:
    from harness.ranks import PoolSet

    with PoolSet(request.config.getoption("--parity-device")) as pools:
        yield pools


@pytest.fixture(scope="session")
def rank_pool(rank_pools: PoolSet) -> Callable[[int], RankPool]:
    return rank_pools.get


@pytest.fixture
def assert_contract(request: pytest.FixtureRequest, rank_pools: PoolSet) -> Callable[..., CaseResult]:
    from harness.contracts.case import make_case
    from harness.contracts.runner import RunOptions, run_cases
    from harness.results import FAILED, SKIPPED
    from harness.targets.loader import parse_target_args

    default_target = request.config.getoption("--parity-target")
    target_args = parse_target_args(request.config.getoption("--parity-target-arg"))
    device = request.config.getoption("--parity-device")

    def check(contract_id: str, *, target: str = default_target, **params: Any) -> CaseResult:
        case = make_case(contract_id, params, case_id=f"{request.node.name}:{contract_id}", source="assert_contract")
        no_skip = request.config.getoption("--parity-no-skip")  # else a skip skips the test, pinned or not
        options = RunOptions(
            target, target_args if target == default_target else (), device, allow_new_skips=not no_skip
        )
        [result] = run_cases([case], options, rank_pools)
        if result.status == SKIPPED:
            if no_skip:
                pytest.fail(
                    f"{contract_id} was skipped on target {target} under --parity-no-skip: {result.reason}",
                    pytrace=False,
                )
            pytest.skip(f"{contract_id}: {result.reason}")
        if result.status == FAILED:
            details = f"\n{result.traceback}" if result.traceback else ""
            pytest.fail(
                f"{contract_id} failed on target {target}: {result.reason}\nbound: {result.bound}\n"
                f"kernel: {result.kernel}\nfigures: {result.figures}{details}",
                pytrace=False,
            )
        return result

    return check
