"""harness.launcher on real gloo groups: results, failures of every kind, cleanup, concurrency (jobs: test_job*.py)."""

from __future__ import annotations

import os
import pickle
import signal
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch

from harness.ranks import RankFailure, RankPool, choose_backend, rank_device, run_on_ranks

from .procs import assert_all_ended, live_children, parity_files
from .rank_fns import (
    add_rank,
    collectives,
    cuda_probe,
    group_tagged_sum,
    raise_on_rank_1_while_rank_0_waits,
    rank_1_sleeps_rank_2_waits_for_it,
    sigkill_rank_1_while_rank_0_waits,
)

pytestmark = pytest.mark.timeout(180)


# ---------------------------------------------------------------- results


def test_choose_backend() -> None:
    assert choose_backend("cpu", 3) == ("gloo", ["cpu", "cpu", "cpu"])
    with pytest.raises(ValueError, match="world_size"):
        choose_backend("cpu", 0)
    if torch.cuda.device_count() == 0:
        with pytest.raises(ValueError, match="no CUDA device"):
            choose_backend("cuda", 2)
    else:
        n = torch.cuda.device_count()
        assert choose_backend("cuda", n) == ("nccl", [f"cuda:{i}" for i in range(n)])
        assert choose_backend("cuda", n + 1) == ("gloo", ["cuda:0"] * (n + 1))


def _check_collectives(results: list[dict], world_size: int, seq: int) -> None:
    assert [r["rank"] for r in results] == list(range(world_size))  # later ranks answered first
    expected_sum = float(sum(range(1, world_size + 1)))
    for rank, r in enumerate(results):
        torch.testing.assert_close(r["sum"], torch.full((3,), expected_sum), rtol=0, atol=0)
        # Rank `rank` receives chunk `rank` of every source s: 100*s + rank*seq + j.
        expected = torch.cat([torch.arange(seq, dtype=torch.float32) + 100 * s + rank * seq for s in range(world_size)])
        torch.testing.assert_close(r["a2a"], expected, rtol=0, atol=0)
        assert r["device"] == "cpu"
        if "OMP_NUM_THREADS" not in os.environ:
            assert r["threads"] == 1


def test_run_on_ranks_collectives_on_4_ranks() -> None:
    before = live_children()
    _check_collectives(run_on_ranks(collectives, 3, world_size=4), 4, 3)
    assert live_children() <= before


@pytest.mark.gpu
def test_cuda_ranks_get_their_device_and_backend() -> None:
    n = torch.cuda.device_count()
    shared = run_on_ranks(cuda_probe, world_size=n + 1, device="cuda")  # more ranks than GPUs
    total = float(sum(range(1, n + 2)))
    assert shared == [("gloo", "cuda:0", 0, total)] * (n + 1)
    own = run_on_ranks(cuda_probe, world_size=n, device="cuda")  # one GPU per rank
    assert own == [("nccl", f"cuda:{i}", i, float(sum(range(1, n + 1)))) for i in range(n)]


def test_rank_device_outside_a_rank_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="outside a rank"):
        rank_device()


def test_rank_failure_pickles_with_its_fields() -> None:
    err = pickle.loads(pickle.dumps(RankFailure("rank 3 raised", 3, "Traceback ...")))
    assert (str(err), err.rank, err.traceback) == ("rank 3 raised", 3, "Traceback ...")


# ---------------------------------------------------------------- failures end every rank


def test_pool_lifecycle_many_calls_raise_restart_close(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where a rendezvous file would go
    before = live_children()
    pool = RankPool(2, timeout=60)
    assert parity_files(tmp_path) == []  # the rendezvous is a TCPStore served by this process
    first_pids = pool.pids
    _check_collectives(pool.run(collectives, 5), 2, 5)
    for i in range(50):  # repeats: one group, 50 calls in a row
        assert pool.run(add_rank, i) == [2 * i + 1] * 2
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        pool.run(lambda: 0)  # refused in the caller; the group is untouched
    assert pool.pids == first_pids

    # A rank raises while its peer is blocked in a collective: both end on the raise, not at the 60 s timeout.
    with pytest.raises(RankFailure) as info:
        pool.run(raise_on_rank_1_while_rank_0_waits)
    assert "timeout" not in str(info.value)
    assert info.value.rank == 1 and "raise_on_rank_1_while_rank_0_waits" in info.value.traceback
    assert str(info.value).startswith("rank 1 raised: ValueError: rank 1 refuses\n")
    assert pool.pids == [] and parity_files(tmp_path) == []
    assert_all_ended(first_pids, before)

    assert pool.run(add_rank, 10) == [21, 21]  # a fresh group, started by run()
    second_pids = pool.pids
    assert second_pids and not set(second_pids) & set(first_pids)
    pool.close()
    assert_all_ended(second_pids, before)
    assert parity_files(tmp_path) == []
    with pytest.raises(RuntimeError, match="after close"):
        pool.run(add_rank, 0)


@pytest.mark.parametrize("who", ["self", "outside"])
def test_sigkilled_rank_names_rank_and_signal(who: str) -> None:
    before = live_children()
    with RankPool(2, timeout=60) as pool:
        pids = pool.pids
        with pytest.raises(RankFailure) as info:
            if who == "self":
                pool.run(sigkill_rank_1_while_rank_0_waits)
            else:
                killer = threading.Timer(0.5, os.kill, (pids[1], signal.SIGKILL))
                killer.start()
                pool.run(time.sleep, 30)
    assert "timeout" not in str(info.value)  # noticed as the kill, not at the call's 60 s timeout
    assert info.value.rank == 1
    assert "SIGKILL" in str(info.value) and "SIGKILL" in info.value.traceback
    assert_all_ended(pids, before)


def test_timeout_ends_every_rank_and_shows_where_each_silent_one_waits() -> None:
    before = live_children()
    with RankPool(3, timeout=60) as pool:
        pids = pool.pids
        with pytest.raises(RankFailure, match="timeout after 3s") as info:
            pool.run(rank_1_sleeps_rank_2_waits_for_it, 60, timeout=3)
    assert info.value.rank is None
    message = str(info.value)
    assert message.splitlines()[0].endswith("rank(s) [1, 2] had not answered")  # rank 0 had answered
    # faulthandler's dump of each pending rank: rank 1 in its sleep, rank 2 in the recv from rank 1.
    rank_1 = message[message.index(f"--- rank 1 (pid {pids[1]}) stack:") : message.index("--- rank 2")]
    rank_2 = message[message.index(f"--- rank 2 (pid {pids[2]}) stack:") :]
    assert 'rank_fns.py", line' in rank_1 and "in rank_1_sleeps_rank_2_waits_for_it" in rank_1
    assert "in recv" in rank_2 and "in rank_1_sleeps_rank_2_waits_for_it" in rank_2
    assert "--- rank 0" not in message and info.value.traceback in message
    assert_all_ended(pids, before)


# ---------------------------------------------------------------- concurrency


def test_two_groups_started_at_once_do_not_collide() -> None:
    before = live_children()
    results: dict[float, list] = {}
    errors: list[BaseException] = []

    def one_group(tag: float) -> None:
        try:
            results[tag] = run_on_ranks(group_tagged_sum, tag, 20, world_size=2, timeout=60)
        except BaseException as exc:  # surfaced below; a thread cannot fail the test itself
            errors.append(exc)

    threads = [threading.Thread(target=one_group, args=(tag,)) for tag in (1.0, 1000.0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert results == {1.0: [[2.0] * 20] * 2, 1000.0: [[2000.0] * 20] * 2}
    assert live_children() <= before


@pytest.mark.parametrize("value", ["2", "1"])
def test_a_chosen_thread_count_reaches_torch_in_every_rank(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    """OMP_NUM_THREADS set after the preloaded server started still decides a new rank's torch threads."""
    from tests.ranks.rank_fns import torch_threads

    RankPool(1).close()  # the server (where ranks fork from) runs from here on, if it did not before
    monkeypatch.setenv("OMP_NUM_THREADS", value)
    assert run_on_ranks(torch_threads, world_size=2) == [(value, int(value))] * 2
