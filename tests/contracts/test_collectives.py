"""Collective counts and bytes on real gloo groups: counted at the dispatcher, recorded per case, judged by
usp.ulysses_collectives.

The independent oracles: the bytes a Ulysses call needs computed from the case's shape alone, and targets
written from scratch (tests/targets/naive_ulysses.py) that compute the same output while exchanging Q, K
and V one by one (passes), gathering K/V (fails on bytes) or exchanging head by head (fails on calls).
"""

from __future__ import annotations

from collections import Counter
from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist

from harness.contracts import collectives
from harness.contracts.case import make_case
from harness.contracts.runner import RunOptions, run_cases
from harness.ranks import PoolSet
from harness.results import FAILED, PASSED, CaseResult
from harness.targets.spec import TargetSpec

pytestmark = pytest.mark.timeout(300)


def _run(pools: PoolSet, contract_id: str, target: str = "reference", **params: object) -> CaseResult:
    case = make_case(contract_id, params, case_id=contract_id, source="test")
    [result] = run_cases([case], RunOptions(TargetSpec(target), allow_new_skips=True), pools)
    return result


def _every_kind_once() -> dict[str, int]:
    """In a rank: one of each c10d op parity counts, made inside a counted call."""
    counts: Counter[str] = Counter()
    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.arange(4.0 * world)

    def layer() -> None:
        dist.all_to_all_single(torch.empty_like(x), x)
        dist.all_gather([torch.empty_like(x) for _ in range(world)], x)
        dist.all_reduce(x.clone())
        got = torch.empty_like(x)
        ops = [dist.P2POp(dist.isend, x, (rank + 1) % world), dist.P2POp(dist.irecv, got, (rank - 1) % world)]
        for request in dist.batch_isend_irecv(ops):
            request.wait()

    dist.all_reduce(x.clone())  # outside any counted call: not counted
    with collectives.recording(counts):
        collectives.Counted(layer, nullcontext)()
    return collectives.figures(counts)


def test_the_counter_sees_each_kind_inside_a_layer_call_only(rank_pools: PoolSet) -> None:
    figures = rank_pools.get(2).run(_every_kind_once)
    # 8 float32 values (32 bytes): all-to-all sends the other rank's half (16), all-gather the whole to the
    # other rank (32), all-reduce 2(W-1)/W of it (32), the send all of it (32)
    sent = 16 + 32 + 32 + 32
    made = {"calls": 1, "all_to_all": 1, "all_gather": 1, "all_reduce": 1, "send": 1, "recv": 1, "sent_bytes": sent}
    assert figures == [made] * 2


@pytest.mark.parametrize("world_size", [2, 4], ids=lambda w: f"w{w}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_the_reference_makes_two_all_to_alls_per_ulysses_call(
    rank_pools: PoolSet, world_size: int, causal: bool
) -> None:
    result = _run(rank_pools, "usp.ulysses_collectives", world_size=world_size, causal=causal)
    assert result.status == PASSED, result.reason
    assert result.figures["collectives"] == {"calls": 1, "all_to_all": 2, "sent_bytes": _needed(result.params)}


def _needed(params: dict) -> int:
    """Bytes a Ulysses call must send, from the case's shape alone: Q, K, V and the output shards, each
    [B, S/W, H, D], (W-1)/W of them to the ranks owning the other heads."""
    shard = params["batch"] * params["tokens_per_rank"] * params["heads"] * params["head_dim"]
    return (
        4
        * shard
        * {"fp32": 4, "bf16": 2, "fp16": 2}[params["dtype"]]
        * (params["world_size"] - 1)
        // params["world_size"]
    )


@pytest.mark.parametrize(
    ("variant", "verdict", "said"),
    [
        ("correct", PASSED, None),  # Q, K and V one by one (diffusers' way): 4 all-to-alls, the bytes needed
        ("gathers_kv", FAILED, "x what a Ulysses exchange of Q, K, V and the output needs"),
        ("per_head", FAILED, "a Ulysses call needs at most 4 collectives"),
    ],
    ids=["qkv-one-by-one", "gathers-kv", "head-by-head"],
)
def test_a_ulysses_is_judged_by_what_it_sends_not_by_one_stacks_call_count(
    rank_pools: PoolSet, variant: str, verdict: str, said: str | None
) -> None:
    target = f"tests.targets.naive_ulysses:{variant}"
    result = _run(rank_pools, "usp.ulysses_collectives", target, world_size=2, heads=8)
    assert result.status == verdict, result.reason
    assert said is None or said in (result.reason or "")
    parity = _run(rank_pools, "usp.ulysses_parity", target, world_size=2, heads=8)
    assert parity.status == PASSED, parity.reason  # the same output: only what was sent tells


@pytest.mark.parametrize(
    ("contract_id", "params", "made"),
    [
        ("usp.ring_parity", dict(world_size=4, ring_degree=4), {"send": 6, "recv": 6}),  # K and V, 3 steps
        ("usp.replicated_suffix_bitwise", dict(world_size=2, replicated=3), {"all_to_all": 2, "all_gather": 1}),
        ("usp.varlen_parity", dict(world_size=2, seq_lens=[5, 3], tokens_per_rank=8), {"all_to_all": 2}),
    ],
    ids=["ring_w4", "replicated_suffix_w2", "varlen_w2"],
)
def test_every_sp_case_records_what_its_call_exchanged(
    rank_pools: PoolSet, contract_id: str, params: dict, made: dict[str, int]
) -> None:
    result = _run(rank_pools, contract_id, **params)
    assert result.status == PASSED, result.reason
    figures = dict(result.figures["collectives"])
    assert figures.pop("sent_bytes") > 0 and figures == {"calls": 1, **made}
