"""The job a launcher started this process in: torchrun's env:// variables, or SLURM's under ``srun``.

Every process of a job is a *job rank*. Rank 0 drives (runs the verb, prints, writes, decides the
exit code); every job rank hosts its rank of each case's group (:mod:`harness.ranks.hosting`): a
case of W ranks runs on job ranks 0..W-1, one rank process each, so every target sees
``dist.get_world_size() == W``. A job of one rank is no job: the local launcher runs. The only
address used is the launcher's ``MASTER_ADDR:MASTER_PORT``: torchrun's agent serves the store
there; under a bare ``srun`` rank 0 serves it on the step's first host.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum

from harness.errors import ConfigError

# What torchrun sets for each of its processes; a rank process gets none of them (its world is its group's).
TORCHRUN_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
)
SLURM_TASK_VARIABLES = ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_STEP_ID")
_SLURM_PORT_BASE, _SLURM_PORT_SPAN = 20000, 10000  # MASTER_PORT under srun when the user sets none


class Launcher(str, Enum):
    TORCHRUN = "torchrun"
    SRUN = "srun"


@dataclass(frozen=True)
class Job:
    """One process of a multi-process job, as its launcher described it."""

    launcher: Launcher
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    serves_store: bool  # this process serves the job's store (rank 0 under srun; torchrun's agent serves it otherwise)
    prefix: str  # this run's keys in the job's store (a torchrun restart or another srun step gets fresh ones)

    def describe(self) -> str:
        return f"this {self.launcher.value} job of {self.world_size} ranks ({self.master_addr}:{self.master_port})"

    def capacity_reason(self, world_size: int) -> str | None:
        """Why a case of ``world_size`` ranks cannot run in this job, or None."""
        if world_size <= self.world_size:
            return None
        return f"needs {world_size} ranks; this {self.launcher.value} job has {self.world_size}"


def current_job(environ: Mapping[str, str] | None = None) -> Job | None:
    """The job described by torchrun's variables, else by srun's, else None (also for a job of one rank)."""
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return _torchrun_job(env)
    if all(name in env for name in SLURM_TASK_VARIABLES):
        return _srun_job(env)
    return None


def rank_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment of a rank process: the job's variables removed, so that a target reading ``RANK`` or
    ``WORLD_SIZE`` sees no world but its group's (and a rank never takes itself for a job rank)."""
    return {k: v for k, v in environ.items() if k not in TORCHRUN_VARIABLES and k not in SLURM_TASK_VARIABLES}


def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    text = env.get(name)
    if text is None:
        if default is None:
            raise ConfigError("is not set (the launcher sets it for every process of a job)", key=name)
        return default
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"not an integer: {text!r}", key=name) from None
    if value < 0:
        raise ConfigError(f"must be >= 0, got {value}", key=name)
    return value


def _port(env: Mapping[str, str], name: str = "MASTER_PORT") -> int:
    """A TCP port: 1..65535 (TCPStore takes a uint16 and fails with a TypeError past it)."""
    port = _int(env, name)
    if not 0 < port < 65536:
        raise ConfigError(f"must be a TCP port in 1..65535, got {port}", key=name)
    return port


def _world(env: Mapping[str, str], name: str) -> int:
    """A job's size: >= 1 (a world of 0 holds no rank, this process included)."""
    world = _int(env, name)
    if world < 1:
        raise ConfigError(f"must be >= 1 (the number of processes in the job), got {world}", key=name)
    return world


def _checked(job: Job, rank_key: str) -> Job:
    if job.rank >= job.world_size:
        raise ConfigError(f"{job.rank} is not a rank of a job of {job.world_size}", key=rank_key)
    return job


def _torchrun_job(env: Mapping[str, str]) -> Job | None:
    rank, world = _int(env, "RANK"), _world(env, "WORLD_SIZE")
    if world == 1:
        if rank:
            raise ConfigError(f"{rank} is not a rank of a job of 1", key="RANK")
        return None
    addr = env.get("MASTER_ADDR") or ""
    if not addr:
        raise ConfigError("is not set; env:// needs it (torchrun sets it)", key="MASTER_ADDR")
    agent_store = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    job = Job(
        Launcher.TORCHRUN,
        rank,
        world,
        _int(env, "LOCAL_RANK", 0),
        _int(env, "LOCAL_WORLD_SIZE", 1),
        addr,
        _port(env),
        rank == 0 and not agent_store,
        f"parity/torchrun-{env.get('TORCHELASTIC_RUN_ID', '')}-{env.get('TORCHELASTIC_RESTART_COUNT', '0')}/",
    )
    return _checked(job, "RANK")


def _srun_job(env: Mapping[str, str]) -> Job | None:
    world_key = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS"
    rank, world = _int(env, "SLURM_PROCID"), _world(env, world_key)
    if world == 1:
        return None
    nodelist_key = next(
        (k for k in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST") if env.get(k)), None
    )
    addr = env.get("MASTER_ADDR") or (first_host(env[nodelist_key]) if nodelist_key else "")
    if not addr:
        raise ConfigError("is not set and no SLURM node list names the first host", key="MASTER_ADDR")
    if "MASTER_PORT" in env:
        port = _port(env)
    else:
        port = _SLURM_PORT_BASE + _int(env, "SLURM_JOB_ID", 0) % _SLURM_PORT_SPAN
    per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or ""
    local_world = tasks_on_node(per_node, _int(env, "SLURM_NODEID", 0)) if per_node else 1
    job = Job(
        Launcher.SRUN,
        rank,
        world,
        _int(env, "SLURM_LOCALID"),
        local_world,
        addr,
        port,
        rank == 0,
        f"parity/srun-{env.get('SLURM_JOB_ID', '')}.{env.get('SLURM_STEP_ID', '')}/",
    )
    return _checked(job, "SLURM_PROCID")


def first_host(nodelist: str) -> str:
    """The first host of a SLURM host list: ``gpu[07-09,12],cpu1`` -> ``gpu07``, ``r[1-2]-n[3-4]`` -> ``r1-n3``."""
    depth, end = 0, len(nodelist)
    for i, char in enumerate(nodelist):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            end = i
            break
    return re.sub(r"\[([^\]]*)\]", lambda m: re.split(r"[,-]", m.group(1))[0], nodelist[:end].strip())


def tasks_on_node(per_node: str, node: int) -> int:
    """This node's task count from SLURM's ``2(x3),1`` form (two tasks on each of three nodes, then one)."""
    counts: list[int] = []
    for part in per_node.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if match is None:
            raise ConfigError(f"not a SLURM task count list: {per_node!r}", key="SLURM_STEP_TASKS_PER_NODE")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts[node] if node < len(counts) else 1
