"""The job a launcher describes (torchrun's variables, srun's), read without starting anything."""

from __future__ import annotations

import pytest

from harness.errors import ConfigError
from harness.ranks import RankPool
from harness.ranks.control import LOST_ENV, lost_after_s
from harness.ranks.job import Job, Launcher, current_job, first_host, rank_environment, tasks_on_node

TORCHRUN = {
    "RANK": "3",
    "WORLD_SIZE": "4",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "node7",
    "MASTER_PORT": "29500",
    "TORCHELASTIC_USE_AGENT_STORE": "True",
    "TORCHELASTIC_RUN_ID": "j1",
    "TORCHELASTIC_RESTART_COUNT": "0",
}
# What srun gives task 5 of 8, two nodes of four tasks each (a batch script's own shell has no SLURM_STEP_ID).
SRUN = {
    "SLURM_PROCID": "5",
    "SLURM_STEP_NUM_TASKS": "8",
    "SLURM_NTASKS": "8",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_STEP_ID": "0",
    "SLURM_JOB_ID": "123456",
    "SLURM_STEP_NODELIST": "gpu[07-08]",
    "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
}


def test_torchrun_variables_make_a_job_whose_store_torchruns_agent_serves() -> None:
    assert current_job(TORCHRUN) == Job(Launcher.TORCHRUN, 3, 4, 1, 2, "node7", 29500, False, "parity/torchrun-j1-0/")


def test_without_the_agent_store_rank_0_serves_it() -> None:
    env = {**TORCHRUN, "RANK": "0", "TORCHELASTIC_USE_AGENT_STORE": "False"}
    job = current_job(env)
    assert job is not None and job.serves_store


def test_srun_variables_make_a_job_on_the_first_node_that_rank_0_serves() -> None:
    assert current_job(SRUN) == Job(
        Launcher.SRUN, 5, 8, 1, 4, "gpu07", 20000 + 123456 % 10000, False, "parity/srun-123456.0/"
    )
    job = current_job({**SRUN, "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0"})
    assert job is not None and job.serves_store


def test_srun_takes_the_users_master_address_and_port() -> None:
    job = current_job({**SRUN, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "31000"})
    assert job is not None and (job.master_addr, job.master_port) == ("10.0.0.1", 31000)


@pytest.mark.parametrize(
    "env",
    [
        {},
        {**TORCHRUN, "RANK": "0", "WORLD_SIZE": "1"},
        {**SRUN, "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1"},
        {k: v for k, v in SRUN.items() if k != "SLURM_STEP_ID"},
    ],
    ids=["no launcher", "torchrun of one", "srun of one", "a batch script's shell"],
)
def test_no_job_where_the_local_launcher_runs_every_case(env: dict[str, str]) -> None:
    assert current_job(env) is None


@pytest.mark.parametrize(
    "env,key",
    [
        ({**TORCHRUN, "RANK": "x"}, "RANK"),
        ({**TORCHRUN, "RANK": "4"}, "RANK"),
        ({k: v for k, v in TORCHRUN.items() if k != "MASTER_ADDR"}, "MASTER_ADDR"),
        ({k: v for k, v in TORCHRUN.items() if k != "MASTER_PORT"}, "MASTER_PORT"),
        ({**SRUN, "SLURM_STEP_TASKS_PER_NODE": "4(y2)"}, "SLURM_STEP_TASKS_PER_NODE"),
        ({**TORCHRUN, "MASTER_PORT": "99999"}, "MASTER_PORT"),
        ({**TORCHRUN, "MASTER_PORT": "0"}, "MASTER_PORT"),
        ({**SRUN, "MASTER_PORT": "70000"}, "MASTER_PORT"),
        ({**TORCHRUN, "RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE"),
        ({**TORCHRUN, "RANK": "1", "WORLD_SIZE": "1"}, "RANK"),
        ({**SRUN, "SLURM_STEP_NUM_TASKS": "0"}, "SLURM_STEP_NUM_TASKS"),
    ],
    ids=[
        "rank not a number",
        "rank outside the world",
        "no master address",
        "no master port",
        "bad task counts",
        "port past 65535",
        "port 0",
        "srun port past 65535",
        "a world of 0",
        "rank 1 of a world of 1",
        "srun world of 0",
    ],
)
def test_a_broken_job_description_names_the_variable(env: dict[str, str], key: str) -> None:
    with pytest.raises(ConfigError) as info:
        current_job(env)
    assert info.value.key == key


@pytest.mark.parametrize(
    "nodelist,first",
    [
        ("node1", "node1"),
        ("gpu[07-09,12],cpu1", "gpu07"),
        ("a,b[1-2]", "a"),
        ("r[1-2]-n[3-4]", "r1-n3"),
        ("h[3,5]", "h3"),
    ],
)
def test_the_first_host_of_a_slurm_node_list(nodelist: str, first: str) -> None:
    assert first_host(nodelist) == first


@pytest.mark.parametrize("spec,node,count", [("4(x2)", 1, 4), ("2(x3),1", 3, 1), ("2(x3),1", 0, 2), ("3", 0, 3)])
def test_the_task_count_of_a_node(spec: str, node: int, count: int) -> None:
    assert tasks_on_node(spec, node) == count


def test_a_rank_process_sees_no_job() -> None:
    env = rank_environment({**TORCHRUN, **SRUN, "PATH": "/bin"})
    assert current_job(env) is None and env["PATH"] == "/bin" and env["MASTER_ADDR"] == "node7"


def test_a_case_larger_than_the_job_is_refused_with_the_reason() -> None:
    job = current_job(TORCHRUN)
    assert job is not None and job.capacity_reason(4) is None
    assert job.capacity_reason(8) == "needs 8 ranks; this torchrun job has 4"


def test_a_pool_in_a_jobs_process_outside_run_as_job_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in TORCHRUN.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(RuntimeError, match="run_as_job"):
        RankPool(2)


@pytest.mark.parametrize("text", ["soon", "1", "inf"])
def test_a_bad_silence_limit_is_a_configuration_error(monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    monkeypatch.setenv(LOST_ENV, text)
    with pytest.raises(ConfigError, match=LOST_ENV):
        lost_after_s()


@pytest.mark.parametrize(("text", "ok"), [("", True), ("12.5", True), ("0", False), ("inf", False), ("x", False)])
def test_the_start_patience_is_a_positive_number_of_seconds(
    monkeypatch: pytest.MonkeyPatch, text: str, ok: bool
) -> None:
    from harness.ranks.control import START_ENV, start_patience_s

    monkeypatch.setenv(START_ENV, text)
    if ok:
        assert start_patience_s() == (float(text) if text else 300.0)
        return
    with pytest.raises(ConfigError) as info:
        start_patience_s()
    assert info.value.key == START_ENV
