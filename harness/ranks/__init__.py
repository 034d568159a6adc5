"""Rank groups: real torch.distributed process groups on one host (or torchrun's), kept alive across cases."""

from harness.ranks.launcher import RankFailure, RankPool, choose_backend, rank_device, run_on_ranks
from harness.ranks.pools import PoolSet
from harness.ranks.starting import preload

__all__ = ["PoolSet", "RankFailure", "RankPool", "choose_backend", "preload", "rank_device", "run_on_ranks"]
