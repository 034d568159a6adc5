"""A contract's checks read its parameters and never write them: what depends on other parameters (the token
counts, varlen's default lengths) is filled by its completions first, so a check is a pure claim."""

from __future__ import annotations

from typing import Any

import pytest

from harness.cases import load_cases
from harness.contracts.params import Params, check_common
from harness.contracts.registry import get_contract
from harness.paths import default_cases_dir


class _ReadOnly(Params):
    def __setitem__(self, key: str, value: Any) -> None:
        raise AssertionError(f"a check wrote {key!r}")


CASES = [c for c in load_cases(default_cases_dir(), "cpu") if hasattr(c, "contract_id")]


@pytest.mark.parametrize("contract_id", sorted({c.contract_id for c in CASES}))
def test_every_check_of_every_default_case_only_reads(contract_id: str) -> None:
    contract = get_contract(contract_id)
    for case in (c for c in CASES if c.contract_id == contract_id):
        frozen = _ReadOnly(case.params)
        for check in (check_common, *contract.checks):
            check(frozen)


def test_a_varlen_case_gets_its_default_lengths_from_a_completion() -> None:
    params = get_contract("usp.varlen_parity").resolve({"world_size": 4, "tokens_per_rank": 8})
    assert params["seq_lens"] == [8, 6, 4, 2] and params["tokens"] == 32
