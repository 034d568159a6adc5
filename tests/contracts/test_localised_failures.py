"""A failing comparison says where: the worst element's rank, batch, token and head, and how the large differences
spread over heads and ranks, in the reason and the figures (real 2-rank gloo groups; the defects:
tests/targets/planted_sp.py). A one-head bug and a wrong-rank bug no longer read alike."""

from __future__ import annotations

import pytest
import torch

from harness.contracts.case import make_case
from harness.contracts.runner import RunOptions, run_cases
from harness.contracts.stats import compare
from harness.ranks import PoolSet
from harness.results import FAILED


@pytest.mark.parametrize(
    ("defect", "words", "heads", "ranks"),
    [
        ("one_head", "head 1; above half the worst: head 1 of 4, ranks 0 (", [1], ["0", "1"]),
        ("scaled_rank", "above half the worst: heads 0, 1, 2, 3 of 4, rank 1 (", [0, 1, 2, 3], ["1"]),
    ],
)  # fmt: skip
def test_a_failure_names_the_heads_and_ranks_it_is_in(
    rank_pools: PoolSet, defect: str, words: str, heads: list[int], ranks: list[str]
) -> None:
    case = make_case("usp.ulysses_parity", {"world_size": 2, "dtype": "fp32"}, case_id="u", source="test")
    options = RunOptions("tests.targets.planted_sp:factory", (("defect", defect),))
    [result] = run_cases([case], options, rank_pools)
    where = result.figures["where"]
    half = where["worst"]["abs"] / 2
    assert result.status == FAILED and words in result.reason, result.reason
    assert [h for h, m in enumerate(where["head_max"]) if m >= half] == heads
    assert sorted(r for r, f in where["ranks"].items() if f["max_abs"] >= half) == ranks


def test_the_worst_element_is_located_exactly() -> None:
    expected = torch.zeros(2, 5, 3, 4)
    out = expected.clone()
    out[1, 3, 2, 0] = 0.5  # batch 1, token 3, head 2
    out[0, 0, 0, 1] = 0.1
    where = compare(out, expected).where
    assert where is not None and (where.worst, where.value) == ((0, 1, 3, 2), 0.5)
    assert where.ranks[0][1:] == (1, 10)  # one token of ten above half the worst
    assert compare(expected, expected).where is None  # nothing differs: nothing to locate
