"""Functions the launcher tests run on the ranks.

Module-level so spawned ranks can unpickle them, and apart from the test module so that
each rank imports only torch, not pytest (a rank's start is dominated by imports).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
from pathlib import Path

import torch
import torch.distributed as dist

from harness.ranks import rank_device


def collectives(seq_len: int) -> dict:
    """all_reduce and all_to_all_single; later ranks answer first, to check the result order."""
    rank, world = dist.get_rank(), dist.get_world_size()
    summed = torch.full((3,), float(rank + 1), device=rank_device())
    dist.all_reduce(summed)
    # Element j of rank r's input is 100*r + j; chunk k goes to rank k.
    send = torch.arange(world * seq_len, dtype=torch.float32) + 100 * rank
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send)
    time.sleep(0.05 * (world - rank))
    threads = torch.get_num_threads()
    return {"rank": rank, "sum": summed, "a2a": received, "device": str(rank_device()), "threads": threads}


def raise_on_rank_1_while_rank_0_waits() -> int:
    if dist.get_rank() == 1:
        raise ValueError("rank 1 refuses")
    dist.all_reduce(torch.ones(1))  # blocks forever: rank 1 never joins
    return 0


def sigkill_rank_1_while_rank_0_waits() -> int:
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.ones(1))
    return 0


def rank_1_sleeps_rank_2_waits_for_it(seconds: float) -> int:
    """Rank 0 answers, rank 1 hangs, rank 2 is blocked receiving from rank 1."""
    rank = dist.get_rank()
    if rank == 1:
        time.sleep(seconds)
    elif rank == 2:
        dist.recv(torch.empty(1), src=1)
    return rank


def add_rank(x: int) -> int:
    t = torch.tensor([x + dist.get_rank()])
    dist.all_reduce(t)
    return int(t.item())


def group_tagged_sum(tag: float, rounds: int) -> list[float]:
    """Sums a group-specific value; two groups that shared a rendezvous would mix their tags."""
    out = []
    for _ in range(rounds):
        t = torch.tensor([tag])
        dist.all_reduce(t)
        out.append(t.item())
    return out


def cuda_probe() -> tuple[str, str, int, float]:
    """Backend, rank device, current CUDA device and an all_reduce sum (staged through host memory on gloo)."""
    device = rank_device()
    t = torch.full((4,), float(dist.get_rank() + 1), device=device)
    if dist.get_backend() == "gloo":
        staged = t.cpu()
        dist.all_reduce(staged)
        t = staged.to(device)
    else:
        dist.all_reduce(t)
    return dist.get_backend(), str(device), torch.cuda.current_device(), float(t[0].item())


def rank_0_holds_the_gil_in_c_rank_1_waits(marker_dir: str, seconds: int) -> int:
    """Rank 0 sleeps inside a C call that keeps the GIL (no Python thread of it can run); rank 1 waits
    for it in a collective. Each writes a marker first, so a test knows both are stuck."""
    rank = dist.get_rank()
    Path(marker_dir, f"stuck-{rank}").write_text(str(os.getpid()))
    if rank == 0:
        ctypes.PyDLL(None).sleep(seconds)  # PyDLL: the GIL is held for the whole call
    dist.all_reduce(torch.ones(1))
    return rank


def start_a_child(then_raise: bool, own_session: bool = False) -> int:
    """Start a process that would outlive the rank by far (``own_session``: out of the rank's process group, as
    a daemon is); optionally fail the call afterwards."""
    child = subprocess.Popen(["sleep", "600"], start_new_session=own_session)
    if then_raise:
        raise RuntimeError(f"raised after starting child {child.pid}")
    return child.pid


def how_i_started(variable: str) -> tuple[int, str | None, int]:
    """This rank's parent pid, one environment variable, and its process group."""
    return os.getppid(), os.environ.get(variable), os.getpgid(0)


def torch_threads() -> tuple[str | None, int]:
    """This rank's OMP_NUM_THREADS and the intra-op threads torch actually uses."""
    return os.environ.get("OMP_NUM_THREADS"), torch.get_num_threads()
