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
from harness.targets.reference.locate import locate
from harness.targets.spec import TargetSpec


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
    options = RunOptions(TargetSpec("tests.targets.planted_sp:factory", (("defect", defect),)))
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


def test_a_model_check_failure_names_the_rank_it_is_on(rank_pools: PoolSet) -> None:
    """A wrong rank inside the reference Z-Image's attention (tests/targets/planted_model.py): every block path's
    large differences sit on rank 1, in the reason and in each path's figures."""
    case = make_case("model.zimage_sp_parity", {"world_size": 2, "dtype": "fp32"}, case_id="z", source="test")
    [result] = run_cases([case], RunOptions(TargetSpec("tests.targets.planted_model:factory")), rank_pools)
    assert result.status == FAILED and "block.image: not bitwise" in result.reason, result.reason
    assert "[worst at rank 1, batch 0, token " in result.reason and "above half the worst: rank 1 (" in result.reason
    where = {path: result.figures["paths"][path]["where"] for path in ("block.image", "block.caption")}
    seen = {
        p: (w["worst"]["rank"], w["above_half"]["rank 0"][0], w["above_half"]["rank 1"][0] > 0)
        for p, w in where.items()
    }
    assert seen == dict.fromkeys(where, (1, 0, True)), where  # rank 0 has no large difference, rank 1 has


@pytest.mark.parametrize(
    ("shape", "at", "owners", "worst", "above_half"),
    [
        ((2, 6, 4), (1, 4, 3), [0, 0, 0, 1, 1, 1], {"rank": 1, "batch": 1, "token": 4, "channel": 3},
         {"rank 0": [0, 6], "rank 1": [1, 6]}),
        ((2, 4, 1, 3, 3), (1, 2, 0, 1, 2), None, {"item": 1, "channel": 2, "frame": 0, "row": 1, "col": 2},
         {"item 0": [0, 9], "item 1": [1, 9]}),
    ],
    ids=["block_rows_by_rank", "latents_by_item"],
)  # fmt: skip
def test_a_model_path_difference_is_located_by_axis(shape, at, owners, worst, above_half) -> None:
    diff = torch.zeros(shape)
    diff[at] = 0.5
    diff[(0,) * len(shape)] = 0.1  # below half the worst: not counted
    where = locate(diff, None if owners is None else torch.tensor(owners))
    assert where is not None and where["worst"] == {**worst, "abs": 0.5}
    assert where["above_half"] == above_half and (where["channels_above_half"], where["channels"]) == (
        1,
        shape[-1] if owners else shape[1],
    )
    assert locate(torch.zeros(shape)) is None
    assert locate(torch.full(shape, float("nan")))["worst"]["abs"] == float("inf")  # a NaN is located, as infinite
