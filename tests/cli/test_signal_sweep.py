"""SIGINT and SIGTERM at every 0.75 s of the first 15 s of ``parity check``: 130 or 143, one line, nothing left.

The run's first seconds are its imports (torch), the preloaded server's start and imports, the
group's start and the ranks' first case. Its clock starts at parity's first instruction, when
its handlers are set (seen in ``/proc/<pid>/status``; the interpreter's own start-up before it,
which takes a second on a loaded box, runs no parity code). Each 0.75 s step from 0.75 to 15 s gets one
delivery in a run of its own, the signals alternating (so each gets every 1.5 s, offset by 0.75 s; both at
every 0.5 s cost CI two minutes): SIGINT to the whole process group (what a terminal's Ctrl-C does: the
preloaded server and the ranks get it at the same moment) and SIGTERM to the parity process (what
``kill``, ``timeout`` and CI runners send). On a loaded box 15 s may all pass before the ranks start,
so one more run per signal delivers it once both ranks hold their grandchildren. The case's ranks (``tests.targets.daemons``) each start a child and a daemon in a session of
its own and then never return, so every delivery lands in a live run, and the runs cost little CPU
once started. Every delivery must end its run with 130 or 143 and exactly one line on stderr, no
traceback anywhere, no process left (all of them are found by an environment tag every descendant
inherits) and nothing in its TMPDIR (the preloaded server's ``pymp-*`` listener included).

The 22 runs go six at a time in one sweep, shared by the 22 test ids (run once per session even
across xdist workers, behind a file lock); each id asserts its own delivery.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from filelock import FileLock

from tests.ranks.procs import kill_tagged, tagged

pytestmark = [
    pytest.mark.timeout(900),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc, setsid"),
]

REPO = Path(__file__).resolve().parents[2]
CASE = "ulysses[world_size=2,dtype=fp32,causal=false]"
STEP_S, STEPS = 0.75, 20
RANKS_RUN = None  # a delivery's moment: once both ranks have started their grandchildren, however long that took
DELIVERIES: list[tuple[signal.Signals, float | None]] = [
    *((signal.SIGINT if i % 2 else signal.SIGTERM, round(i * STEP_S, 2)) for i in range(1, STEPS + 1)),
    (signal.SIGINT, RANKS_RUN),
    (signal.SIGTERM, RANKS_RUN),
]
CONCURRENT = 6  # most of a run is waiting for its moment to come
TAG = "PARITY_SIGNAL_SWEEP_TAG"


def _handlers_set(proc: subprocess.Popen[str]) -> float:
    """When the run's SIGTERM handler was seen (its first instruction has run), polled every millisecond."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            status = Path(f"/proc/{proc.pid}/status").read_text()
        except OSError:
            break
        caught = int(next(line for line in status.splitlines() if line.startswith("SigCgt:")).split()[1], 16)
        if caught & (1 << (signal.SIGTERM - 1)):
            break
        time.sleep(0.001)
    return time.monotonic()


def _ranks_ran(proc: subprocess.Popen[str], marker: Path) -> None:
    """Wait until both ranks wrote their grandchildren's pids (or the run ended)."""
    deadline = time.monotonic() + 120
    while len(list(marker.iterdir())) < 2 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)


def _deliver(sig: signal.Signals, at: float | None, root: Path) -> dict[str, Any]:
    """One run of ``parity check`` with ``sig`` delivered ``at`` seconds after its start (None: once its ranks
    run); what it left."""
    tmp, marker, tag = root / "tmp", root / "marker", uuid.uuid4().hex
    tmp.mkdir(parents=True)
    marker.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp), TAG: tag, "PYTHONUNBUFFERED": "1"}
    launched = time.monotonic()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "harness.cli",
            "check",
            CASE,
            "--target",
            "tests.targets.daemons:factory",
            "--target-arg",
            f"marker={marker}",
            "--timeout",
            "300",
        ],
        cwd=REPO,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        start = _handlers_set(proc)
        if at is RANKS_RUN:
            _ranks_ran(proc, marker)
        else:
            time.sleep(max(0.0, at - (time.monotonic() - start)))
        finished_first = proc.poll() is not None
        if sig == signal.SIGINT:
            os.killpg(proc.pid, sig)  # as Ctrl-C does: the whole foreground process group
        else:
            os.kill(proc.pid, sig)
        try:
            out, err = proc.communicate(timeout=120)
            hung = False
        except subprocess.TimeoutExpired:
            hung = True
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        deadline = time.monotonic() + 30
        while tagged(TAG, tag) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = tagged(TAG, tag)
    finally:
        kill_tagged(TAG, tag)  # whatever happened, this test leaves nothing running
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return {
        "code": proc.returncode,
        "hung": hung,
        "startup_s": start - launched,
        "finished_first": finished_first,
        "out": out,
        "err": err,
        "left": left,
        "files": sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*")),
        "ranks_started": len(list(marker.iterdir())),
    }


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> dict[str, dict[str, Any]]:
    """Every delivery's outcome, by delivery id; computed once per session, whichever xdist worker asks first."""
    base = tmp_path_factory.getbasetemp()
    shared = base if worker_id == "master" else base.parent  # the session's folder, shared by its workers
    results = shared / "signal_sweep.json"
    with FileLock(str(shared / "signal_sweep.lock")):
        if not results.exists():
            root = shared / "signal_sweep"
            with ThreadPoolExecutor(CONCURRENT) as pool:
                outcomes = pool.map(lambda d: _deliver(d[0], d[1], root / _id(d)), DELIVERIES)
                results.write_text(json.dumps(dict(zip(map(_id, DELIVERIES), outcomes))))
    return json.loads(results.read_text())


def _id(delivery: tuple[signal.Signals, float | None]) -> str:
    sig, at = delivery
    return f"{sig.name}@{'ranks' if at is RANKS_RUN else f'{at:g}s'}"


@pytest.mark.parametrize("delivery", DELIVERIES, ids=[_id(d) for d in DELIVERIES])
def test_a_signal_at_any_moment_ends_the_run_in_one_line_leaving_nothing(
    delivery: tuple[signal.Signals, float | None], sweep: dict[str, dict[str, Any]]
) -> None:
    sig, _ = delivery
    outcome = sweep[_id(delivery)]
    assert not outcome["finished_first"], "the run ended before the signal: the sweep no longer covers this moment"
    assert not outcome["hung"], f"still running 120 s after {sig.name}: {outcome['err'][-2000:]}"
    assert outcome["code"] == 128 + sig, outcome["out"][-2000:] + outcome["err"][-4000:]
    assert "Traceback" not in outcome["out"] + outcome["err"], outcome["err"][-4000:]
    lines = [line for line in outcome["err"].splitlines() if line.strip()]
    assert len(lines) == 1 and re.fullmatch(
        rf"parity( check)?: stopped by {sig.name}; every rank was ended", lines[0]
    ), lines
    assert outcome["left"] == [], "processes left behind"
    assert outcome["files"] == [], "files left in TMPDIR"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=lambda s: s.name)
def test_the_sweep_reached_the_ranks(sig: signal.Signals, sweep: dict[str, dict[str, Any]]) -> None:
    """Whatever the box's load, one delivery of each signal lands while both ranks hold their grandchildren."""
    assert sweep[_id((sig, RANKS_RUN))]["ranks_started"] == 2


COMMAND_CASE = """[cases.cmd]
target = "command"
template = "sh -c 'setsid sleep 300 & : > {marker}/started; sleep 300' sh {{out_dir}}"
height = 8
width = 8
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=lambda s: s.name)
def test_a_signal_while_an_external_command_runs_leaves_no_process_and_no_folder(
    sig: signal.Signals, tmp_path: Path
) -> None:
    """``parity bless`` runs a ``command`` case in its own process (under a keeper): a signal there ends the command,
    a daemon it started and the case's output folder; on a SIGKILL of parity the keeper, told by the kernel, does."""
    cases, marker, tmp, tag = tmp_path / "cases", tmp_path / "marker", tmp_path / "tmp", uuid.uuid4().hex
    for folder in (cases / "images", cases / "contracts", marker, tmp, tmp_path / "baselines"):
        folder.mkdir(parents=True)
    (cases / "images" / "c.toml").write_text(COMMAND_CASE.format(marker=marker))
    (cases / "contracts" / "c.toml").write_text('[cases.u]\ncontract = "usp.ulysses_parity"\nworld_size = 1\n')
    env = {**os.environ, "TMPDIR": str(tmp), TAG: tag}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "harness.cli",
            "bless",
            "--all",
            "--dry-run",
            "--cases",
            str(cases),
            "--baselines",
            str(tmp_path / "baselines"),
        ],
        cwd=REPO,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not (marker / "started").exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert (marker / "started").exists(), "the command never ran"
        assert len(tagged(TAG, tag)) >= 3, "the keeper, the command and its daemon"
        os.killpg(proc.pid, sig) if sig == signal.SIGINT else os.kill(proc.pid, sig)
        _, err = proc.communicate(timeout=60)
        deadline = time.monotonic() + 30
        while tagged(TAG, tag) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert tagged(TAG, tag) == [], "a process the command started outlived the run"
        assert sorted(p.name for p in tmp.rglob("*")) == [], "files left in TMPDIR"
        assert proc.returncode == (-signal.SIGKILL if sig == signal.SIGKILL else 128 + sig), err
        if sig != signal.SIGKILL:
            assert (
                err.strip() == f"parity bless: stopped by {sig.name}; every rank was ended" and "Traceback" not in err
            )
    finally:
        kill_tagged(TAG, tag)
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
