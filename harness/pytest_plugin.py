"""pytest plugin (entry point ``pytest11: parity``): check your implementation from your own suite.

Fixtures:

- ``rank_pool``: ``rank_pool(world_size) -> harness.launcher.RankPool``, one live pool per world
  size for the whole session (started on first use, closed at the end);
- ``assert_contract``: ``assert_contract("usp.ulysses_parity", world_size=2, dtype="bf16")`` runs
  one case on the session's target (or ``target=..., target_args=(("layer", "m:C"),)``) through those pools; it fails the test with the figures,
  skips it with the reason when the target cannot express the case, and returns the Verdict.

Options: ``--parity-target`` (default ``reference``; ``module:factory`` for yours) and
``--parity-device`` (``cpu`` or ``cuda``). Imports are lazy: the plugin costs nothing to a
session that does not use it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from harness.contracts.verdict import Verdict
    from harness.launcher import RankPool


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("parity", "parity contracts")
    group.addoption("--parity-target", default="reference", help="target for assert_contract: reference, yunchang, or module:factory")
    group.addoption("--parity-device", default="cpu", choices=("cpu", "cuda"), help="device of the ranks for rank_pool / assert_contract")


@pytest.fixture(scope="session")
def rank_pool(request: pytest.FixtureRequest) -> Iterator[Callable[[int], RankPool]]:
    from harness.runner import PoolSet

    pools = PoolSet(request.config.getoption("--parity-device"))
    try:
        yield pools.get  # the getter, not the set: run_cases must not release session pools
    finally:
        pools.close()


@pytest.fixture
def assert_contract(request: pytest.FixtureRequest, rank_pool: Callable[[int], RankPool]) -> Callable[..., Verdict]:
    from harness.cases import make_case
    from harness.contracts.verdict import FAILED, SKIPPED
    from harness.runner import run_cases

    target = request.config.getoption("--parity-target")
    device = request.config.getoption("--parity-device")

    def check(contract_id: str, *, target: str = target, target_args: tuple[tuple[str, str], ...] = (), **params: Any) -> Verdict:
        case = make_case(contract_id, params, case_id=f"{request.node.name}:{contract_id}", source="assert_contract")
        [verdict] = run_cases([case], target, device, pools=rank_pool, target_args=target_args)
        if verdict.status == SKIPPED:
            pytest.skip(f"{contract_id}: {verdict.reason}")
        if verdict.status == FAILED:
            figures = {k: v for k, v in verdict.figures.items() if k != "traceback"}
            details = f"\n{verdict.figures['traceback']}" if "traceback" in verdict.figures else ""
            pytest.fail(
                f"{contract_id} failed on target {target}: {verdict.reason}\nbound: {verdict.bound}\n"
                f"kernel: {verdict.kernel}\nfigures: {figures}{details}",
                pytrace=False,
            )
        return verdict

    return check
