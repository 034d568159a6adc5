"""Rank groups: real torch.distributed process groups on one host, or on the ranks of a torchrun/srun job."""

from harness.ranks.control import JobLost
from harness.ranks.launcher import RankFailure, RankPool, choose_backend, rank_device, run_on_ranks
from harness.ranks.pools import PoolSet
from harness.ranks.session import capacity_reason, run_as_job
from harness.ranks.starting import preload

__all__ = [
    "JobLost",
    "PoolSet",
    "RankFailure",
    "RankPool",
    "capacity_reason",
    "choose_backend",
    "preload",
    "rank_device",
    "run_as_job",
    "run_on_ranks",
]
