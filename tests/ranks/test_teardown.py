"""No process left behind, in the corners: a parent killed while a rank holds the GIL in C, a rank's own
children, stacks of a rank stuck in C, and how ranks start (preloaded server or spawn)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from harness.ranks import PoolSet, RankFailure, RankPool
from harness.ranks.starting import START_METHOD_ENV, start_method

from .procs import (
    alive,
    assert_all_ended,
    descendants,
    kill_tagged,
    live_children,
    parity_files,
    tagged,
    wait_until_gone,
)
from .rank_fns import add_rank, how_i_started, rank_0_holds_the_gil_in_c_rank_1_waits, start_a_child

REPO_ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(180)

PARENT_SCRIPT = """
import sys
from harness.ranks import RankPool
from tests.ranks.rank_fns import rank_0_holds_the_gil_in_c_rank_1_waits

if __name__ == "__main__":
    pool = RankPool(2)
    print(*pool.pids, flush=True)
    pool.run(rank_0_holds_the_gil_in_c_rank_1_waits, sys.argv[1], 3600)
"""


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_ranks_die_with_the_parent_even_while_one_holds_the_gil_in_c(tmp_path: Path, method: str) -> None:
    """kill -9 of the parent: no rank, no helper process (preloaded server, resource tracker), no file survives."""
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(PARENT_SCRIPT))
    markers = tmp_path / "markers"
    markers.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "TMPDIR": str(tmp_path), START_METHOD_ENV: method}
    parent = subprocess.Popen([sys.executable, str(script), str(markers)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == 2
        deadline = time.monotonic() + 60
        while len(list(markers.iterdir())) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert sorted(p.name for p in markers.iterdir()) == ["stuck-0", "stuck-1"]
        time.sleep(0.3)  # rank 0 is inside sleep(3600) now, rank 1 inside all_reduce
        everything = descendants(parent.pid)
        assert set(pids) <= everything and len(everything) >= 3  # the ranks and the helpers
        parent.kill()
        parent.wait()
        assert wait_until_gone(everything, 15) == [], "a process outlived its parent"
        assert parity_files(tmp_path) == []
    finally:
        parent.kill()
        parent.wait()
        parent.stdout.close()


@pytest.mark.parametrize("own_session", [False, True], ids=["child", "daemon"])
@pytest.mark.parametrize("then_raise", [False, True], ids=["close", "failure"])
def test_what_a_rank_started_ends_with_its_group(then_raise: bool, own_session: bool) -> None:
    before = live_children()
    with RankPool(2, timeout=60) as pool:
        pids = pool.pids
        if then_raise:
            with pytest.raises(RankFailure, match="raised after starting child") as info:
                pool.run(start_a_child, True, own_session)
            grandchild = int(str(info.value).split("raised after starting child ")[1].split()[0])
        else:
            grandchild = pool.run(start_a_child, False, own_session)[0]
            assert alive(grandchild)
    assert wait_until_gone([grandchild], 10) == [], "a process a rank started survived the group"
    assert_all_ended(pids, before)


def test_a_timeout_shows_the_stack_of_a_rank_stuck_in_c_with_the_gil(tmp_path: Path) -> None:
    before = live_children()
    with RankPool(2, timeout=60) as pool:
        pids = pool.pids
        with pytest.raises(RankFailure, match="timeout after 2s") as info:
            pool.run(rank_0_holds_the_gil_in_c_rank_1_waits, str(tmp_path), 3600, timeout=2)
    stacks = info.value.traceback
    rank_0 = stacks[: stacks.index("--- rank 1")]
    assert "in rank_0_holds_the_gil_in_c_rank_1_waits" in rank_0  # dumped from C while the GIL was held
    assert "in all_reduce" in stacks[stacks.index("--- rank 1") :]
    assert_all_ended(pids, before)


def test_ranks_fork_from_the_preloaded_server_or_are_spawned(monkeypatch: pytest.MonkeyPatch) -> None:
    me = os.getpid()
    RankPool(1, start_method="forkserver").close()  # the server runs from here on, if it did not before
    monkeypatch.setenv("PARITY_TEST_LATE_VARIABLE", "set after the server started")
    with RankPool(2, start_method="forkserver") as pool:
        forked = pool.run(how_i_started, "PARITY_TEST_LATE_VARIABLE")
    with RankPool(2, start_method="spawn") as pool:
        spawned = pool.run(how_i_started, "PARITY_TEST_LATE_VARIABLE")
    server = {ppid for ppid, _, _ in forked}
    assert len(server) == 1 and me not in server  # both forked by one server, not by this process
    assert {ppid for ppid, _, _ in spawned} == {me}
    assert [variable for _, variable, _ in forked + spawned] == ["set after the server started"] * 4  # the parent's now
    assert os.getpgid(0) not in {
        group for _, _, group in forked + spawned
    }  # groups of their own: teardown kills them whole


def test_start_method_cpu_ranks_forked_cuda_ranks_spawned_unless_told(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(START_METHOD_ENV, raising=False)
    assert (start_method("cpu"), start_method("cuda"), start_method("cuda:1")) == ("forkserver", "spawn", "spawn")
    assert start_method("cuda", "forkserver") == "forkserver" and start_method("cpu", "spawn") == "spawn"
    monkeypatch.setenv(START_METHOD_ENV, "spawn")
    assert start_method("cpu") == "spawn" and start_method("cpu", "forkserver") == "forkserver"
    with pytest.raises(ValueError, match="start_method='fork'"):
        RankPool(1, start_method="fork")
    monkeypatch.setenv(START_METHOD_ENV, "thread")
    with pytest.raises(ValueError, match=f"{START_METHOD_ENV}='thread'"):
        RankPool(1)


def test_a_pool_set_left_by_an_exception_ends_every_group_at_once() -> None:
    """An interrupted run: the started group and the one still starting are ended, nothing is waited for."""
    with PoolSet() as pools:  # the preloaded server outlives every group by design: started before counting
        pools.get(1)
    before = descendants(os.getpid())
    with pytest.raises(KeyboardInterrupt):
        with PoolSet() as pools:
            pools.prestart([1, 3])
            ranks = pools.get(1).pids
            raise KeyboardInterrupt
    assert not [p for p in ranks if alive(p)]
    deadline = time.monotonic() + 60  # the 3-rank group is ended as soon as it has started
    while descendants(os.getpid()) - before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in descendants(os.getpid()) - before if alive(p)], "a rank of the starting group survived"


def test_spawned_ranks_outlive_the_background_thread_that_started_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """PR_SET_PDEATHSIG follows the starting *thread*: a pool started in the background must survive that thread."""
    monkeypatch.setenv(START_METHOD_ENV, "spawn")
    with PoolSet() as pools:
        pools.prestart([2])
        pool = pools.get(2)
        for thread in threading.enumerate():  # the start thread must have ended, or this proves nothing
            if thread.name.startswith("pool-start"):
                thread.join(10)
        assert not [t for t in threading.enumerate() if t.name.startswith("pool-start")]
        assert pool.run(how_i_started, "PATH")[0][0] == os.getpid()
        assert pool.run(add_rank, 1) == [3, 3]


def test_a_parent_sigkill_leaves_no_process_no_daemon_and_no_file(tmp_path: Path) -> None:
    """``parity check`` killed with SIGKILL while its ranks hold a child and a daemon each: the preloaded server
    ends them all on its way out and removes the listener socket the killed parent would have removed."""
    marker = tmp_path / "marker"
    marker.mkdir()
    tmp, tag = tmp_path / "tmp", f"{os.getpid()}-{time.monotonic_ns()}"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp), "PARITY_LEFTOVER_TAG": tag}
    log = tmp_path / "parity.log"
    with log.open("w") as out:
        parent = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "harness.cli",
                "check",
                "ulysses[world_size=2,dtype=fp32,causal=false]",
                "--target",
                "tests.targets.daemons:factory",
                "--target-arg",
                f"marker={marker}",
            ],
            cwd=REPO_ROOT,
            env=env,
            stdout=out,
            stderr=out,
        )
    try:
        deadline = time.monotonic() + 120
        while len(list(marker.iterdir())) < 2 and time.monotonic() < deadline and parent.poll() is None:
            time.sleep(0.1)
        started = [int(pid) for path in marker.iterdir() for pid in path.read_text().split()]
        assert len(started) == 6, (
            f"exit {parent.poll()}: {log.read_text()[-3000:]}"
        )  # two ranks, a child and a daemon each
        parent.kill()
        parent.wait()
        assert wait_until_gone(started, 30) == [], "a rank, or what it started, outlived the killed parent"
        assert wait_until_gone(tagged("PARITY_LEFTOVER_TAG", tag), 30) == []
        assert sorted(p.name for p in tmp.rglob("*")) == []  # the pymp-*/listener-* socket too
    finally:
        parent.kill()
        parent.wait()
        kill_tagged("PARITY_LEFTOVER_TAG", tag)


def test_a_tmpdir_too_long_for_a_unix_socket_still_starts_the_preloaded_server(tmp_path: Path) -> None:
    """The server listens on <TMPDIR>/pymp-*/listener-*: past 107 bytes ``bind`` fails ("AF_UNIX path too long"),
    which CI runners' and pytest's nested folders reach; the folder is made in a short system folder instead."""
    long_tmp = tmp_path / ("t" * max(1, 100 - len(str(tmp_path))))
    long_tmp.mkdir()
    assert len(str(long_tmp)) >= 100
    env = {**os.environ, "TMPDIR": str(long_tmp), START_METHOD_ENV: "forkserver"}
    done = subprocess.run(
        [sys.executable, "-m", "harness.cli", "check", "ulysses[world_size=2,dtype=fp32,causal=false]"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "1 passed" in done.stdout
    assert sorted(p.name for p in long_tmp.rglob("*")) == []


def test_a_ranks_own_error_is_blamed_before_a_collective_its_leaving_broke() -> None:
    """Rank 3 raised; rank 2's all-to-all then broke on the closed connection and answered first."""
    from harness.ranks.group import describe_failure

    broken = (
        "Traceback...\nRuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer"
    )
    own = "Traceback...\nRuntimeError: rank 3 cannot build its layer"
    failure = describe_failure([(2, False, broken), (3, False, own)], "call of 'f'")
    assert failure.rank == 3 and str(failure).startswith("rank 3 raised: RuntimeError: rank 3 cannot build its layer")
    assert "also failed: rank 2: RuntimeError: [" in str(failure)
    only_broken = describe_failure([(1, False, broken), (0, False, broken)], "call of 'f'")
    assert only_broken.rank == 0
